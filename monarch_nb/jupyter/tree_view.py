"""The supervision-tree widget's browser side: an ES module and its CSS, shipped as strings (no JavaScript build step).

It draws what :class:`~.tree_widget.SupervisionTree` puts in its model and sends clicks back:

- a toolbar: hosts and procs, a legend with the count of procs in each state, and the view
  toggle (``grid`` / ``list``; the model's ``view``, "auto" until a user picks one);
- ``layout`` "list": one row per node (``nodes``, the tree), fault and restart buttons on each proc row;
- ``layout`` "grid": one row per host (``grid``: name, machine, state or LOST, load) with one
  cell per rank coloured by state (a failed rank hatched); a click selects the rank. The grid
  arrives as ``grid_delta`` messages (the rows that changed, see
  :meth:`~.tree_widget.SupervisionTree._push_grid`) and only those rows are redrawn;
- the selected node's details (``details``: title, facts, a rank's fault and restart buttons,
  its actors, events and last output), the status line, the recent events.

A click sends a message: ``{"action": "select", "name"}`` (a node, a host or a cell),
``{"action": "view", "view"}`` (the toggle), ``{"action": "fault"|"restart", "kind", "mesh",
"rank"}`` (a button), ``{"action": "grid_sync", "v"}`` (a view's grid version: Python sends the
whole grid when it is not the latest); Python sets ``selected`` and ``view`` from them.
Elements carry ``data-*`` attributes (state, rank, pid, ...) that the browser tests read.
"""

from __future__ import annotations

import json

from .tree_grid import COLORS

__all__ = ["ESM", "CSS", "BUTTON_FAULTS"]

#: the fault buttons of a proc, in order
BUTTON_FAULTS = ("kill", "hang", "nan", "slow", "partition", "raise")

ESM = "const COLORS = " + json.dumps(COLORS) + ";\nconst FAULTS = " + json.dumps(list(BUTTON_FAULTS)) + ";\n" + r"""

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick") e.addEventListener("click", v);
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
}

function short(text) {
  const line = String(text || "").split("\n")[0];
  return line.length > 140 ? line.slice(0, 137) + "..." : line;
}

function fmt(s) { return s === null || s === undefined ? "-" : `${Number(s).toFixed(1)} s`; }

function dot(state) { return el("span", {class: "mnb-dot", style: `background:${COLORS[state] || "#9e9e9e"}`}); }

function render({ model, el: host }) {
  const root = el("div", {class: "mnb-tree"});
  host.append(root);
  // a choice goes to Python as a message, not as a synced trait: ipywidgets holds back a trait
  // update while the previous one is unanswered, and a kernel busy in an awaiting cell (%mesh
  // wait) answers none, so a second click would wait for the cell to end; messages are not held
  const select = (name) => { model.set("selected", name); model.send({action: "select", name}); };

  // the fault and restart buttons of one proc node (a list row, or the grid's details)
  const buttons = (node, into) => {
    const pending = (model.get("busy") || []).includes(`${node.mesh}.${node.rank}`);
    const alive = node.state === "healthy" || node.state === "busy" || node.state === "paused";
    for (const kind of FAULTS) {
      const b = el("button", {class: "mnb-btn mnb-fault", "data-kind": kind, title: `inject ${kind} into rank ${node.rank}`,
        onclick: () => model.send({action: "fault", kind, mesh: node.mesh, rank: node.rank})}, kind);
      if (!alive || pending) b.disabled = true;
      into.append(b);
    }
    const r = el("button", {class: "mnb-btn mnb-restart", "data-kind": "restart", title: `restart rank ${node.rank} in place`,
      onclick: () => model.send({action: "restart", mesh: node.mesh, rank: node.rank})}, "restart");
    if (pending || node.state === "restarting") r.disabled = true;
    into.append(r);
  };

  const toolbar = (box, layout) => {
    const grid = model.get("grid") || {};
    box.append(el("span", {class: "mnb-summary"}, `${(grid.hosts || []).length} host(s) · ${grid.procs || 0} procs`));
    const legend = el("span", {class: "mnb-legend"});
    for (const [state, n] of Object.entries(grid.counts || {}))
      legend.append(el("span", {class: "mnb-legend-item", "data-state": state},
        el("span", {class: "mnb-swatch", style: `background-color:${COLORS[state] || "#9e9e9e"}`}), `${state} ${n}`));
    box.append(legend);
    const toggle = el("span", {class: "mnb-toggle", title: "grid: one cell per rank; list: one row per node"});
    for (const view of ["grid", "list"])
      toggle.append(el("button", {class: "mnb-btn mnb-view", "data-view": view, "aria-pressed": String(layout === view),
        onclick: () => { model.set("view", view); model.send({action: "view", view}); }}, view));
    box.append(toggle);
  };

  const drawList = (box, tree, selected) => {
    const label = (node) => {
      let text;
      if (node.kind === "controller") text = `controller · pid ${node.pid}`;
      else if (node.kind === "host") text = `${node.name}${(node.detail || {}).hostname ? ` (${node.detail.hostname})` : ""} · ` +
        `${node.lost ? "LOST" : node.state}` +
        `${node.load === null || node.load === undefined ? "" : ` · load ${Number(node.load).toFixed(2)}`} · pid ${node.pid}`;
      else if (node.kind === "proc") {
        text = `rank ${node.rank}${node.group === null || node.group === undefined ? "" : ` · group ${node.group}`} · ` +
          `${node.name} · pid ${node.pid} · ${node.state} · heartbeat ${fmt(node.heartbeat_age_s)}` +
          ` · restarts ${node.restarts}` + (node.endpoint ? ` · ${node.endpoint} (${fmt(node.endpoint_running_s)})` : "");
      } else if (node.kind === "spare") text = `${node.name} · ${node.state}`;
      else text = `${node.name} (${(node.detail || {}).class || "actor"}) · ${node.state}` +
          (node.endpoint ? ` · ${node.endpoint} ${fmt(node.endpoint_running_s)}` : "");
      return el("span", {class: "mnb-label" + (selected === node.name ? " mnb-selected" : ""), title: "show details",
        onclick: () => select(node.name)}, dot(node.state), text);
    };
    const visit = (node, depth) => {
      const row = el("div", {class: `mnb-node mnb-${node.kind}` + (node.lost ? " mnb-lost" : ""), "data-name": node.name,
        "data-state": node.state, style: `margin-left:${depth * 18}px`});
      if (node.kind === "proc") {
        row.setAttribute("data-rank", node.rank); row.setAttribute("data-mesh", node.mesh);
        row.setAttribute("data-pid", node.pid); row.setAttribute("data-failures", node.failures || 0);
        row.setAttribute("data-restarts", node.restarts);
      }
      if (node.kind === "host") row.setAttribute("data-lost", String(!!node.lost));
      row.append(label(node));
      if (node.kind === "proc") {
        buttons(node, row);
        if (node.last_failure) {
          const f = node.last_failure;
          row.append(el("span", {class: "mnb-failure", title: f.detail}, ` last failure ${f.clock}: ${f.cause || f.kind}` +
            (node.failures > 1 ? ` (${node.failures} in all)` : "")));
        }
      }
      box.append(row);
      for (const child of node.children || []) visit(child, depth + 1);
    };
    if (tree.kind) visit(tree, 0); else box.append(el("div", {}, "no controller yet"));
  };

  // the grid's host rows: each redrawn only when its row (or the selection in it) changed, so an
  // update of one rank at 1,024 hosts touches one row, not 8,192 cells
  const gridLines = new Map();  // host name -> {key, line}
  const hostLine = (row, selected, several) => {
      const line = el("div", {class: "mnb-hostrow mnb-host" + (row.lost ? " mnb-lost" : ""), "data-name": row.name,
        "data-state": row.state, "data-lost": String(row.lost)});
      const label = el("span", {class: "mnb-hostlabel" + (selected === row.name ? " mnb-selected" : ""),
          title: `${row.address || "this machine"} · pid ${row.pid}: show details`, onclick: () => select(row.name)},
        dot(row.state), el("span", {class: "mnb-hostname"}, row.name),
        row.hostname ? el("span", {class: "mnb-machine"}, row.hostname) : null,
        row.lost ? el("span", {class: "mnb-badge"}, "LOST") : el("span", {class: "mnb-hoststate"}, row.state),
        el("span", {class: "mnb-load"}, row.load === null || row.load === undefined ? "load -" : `load ${Number(row.load).toFixed(2)}`));
      const cells = el("span", {class: "mnb-cells"});
      let mesh = null;
      for (const c of row.cells) {
        if (several && c.mesh !== mesh) { cells.append(el("span", {class: "mnb-meshtag"}, c.mesh)); mesh = c.mesh; }
        cells.append(el("span", {class: "mnb-cell" + (selected === c.name ? " mnb-cell-selected" : ""), "data-rank": c.rank,
          "data-mesh": c.mesh, "data-name": c.name, "data-state": c.state, "data-pid": c.pid, "data-restarts": c.restarts,
          title: c.title, style: `background-color:${COLORS[c.state] || "#9e9e9e"}`, onclick: () => select(c.name)}, String(c.rank)));
      }
      if (row.spares) cells.append(el("span", {class: "mnb-spares"}, `+${row.spares} spare${row.spares > 1 ? "s" : ""}`));
      line.append(label, cells);
      if (row.lost && row.last_event)
        line.append(el("span", {class: "mnb-lostwhy", title: row.last_event.detail},
                       `lost ${row.last_event.clock}: ${short(row.last_event.detail)}`));
      return line;
  };
  const drawGrid = (box, grid, selected) => {
    const several = (grid.meshes || []).length > 1;
    box.classList.add("mnb-grid");
    const wanted = [];
    for (const row of grid.hosts || []) {
      const mine = selected === row.name || row.cells.some((c) => c.name === selected);
      const key = JSON.stringify([row, mine ? selected : "", several]);
      let known = gridLines.get(row.name);
      if (!known || known.key !== key) {
        known = {key, line: hostLine(row, selected, several)};
        gridLines.set(row.name, known);
      }
      wanted.push(known.line);
    }
    const names = new Set((grid.hosts || []).map((r) => r.name));
    for (const name of [...gridLines.keys()]) if (!names.has(name)) gridLines.delete(name);
    wanted.forEach((line, i) => { if (box.children[i] !== line) box.insertBefore(line, box.children[i] || null); });
    while (box.children.length > wanted.length) box.lastChild.remove();
  };

  // the selected node: a head (title, a rank's buttons) and a body (facts, actors, events, output),
  // redrawn apart: the body changes every second (heartbeat age), the buttons must stay clickable
  const detailsHead = (box, d, layout) => {
    const n = d.node;
    box.append(el("div", {class: "mnb-title"}, d.title || `${n.kind} ${n.name}`));
    if (n.kind === "proc" && layout === "grid") {
      const actions = el("div", {class: "mnb-actions"});
      buttons(n, actions);
      box.append(actions);
    }
  };
  const detailsBody = (box, d) => {
    for (const [k, v] of d.facts || []) box.append(el("div", {class: "mnb-fact", "data-fact": k}, `${k}: ${v}`));
    if ((d.actors || []).length) {
      box.append(el("div", {class: "mnb-title"}, "actors"));
      for (const a of d.actors) box.append(el("div", {class: "mnb-actor"}, dot(a.state),
        `${a.name} (${a.class}) · ${a.state}` + (a.endpoint ? ` · ${a.endpoint} ${fmt(a.endpoint_running_s)}` : "")));
    }
    if ((d.events || []).length) {
      box.append(el("div", {class: "mnb-title"}, "events"));
      for (const e of d.events) box.append(el("div", {class: "mnb-event", title: e.detail}, `${e.clock} ${e.kind} ${short(e.detail)}`));
    }
    if (d.output) {
      box.append(el("div", {class: "mnb-title"}, "last output"));
      box.append(el("pre", {class: "mnb-output"}, d.output.join("\n") || "(none)"));
    }
  };
  const eventLog = (box, events) => {
    if (!events.length) return;
    box.append(el("div", {class: "mnb-title"}, "recent events"));
    for (const e of events.slice().reverse())
      box.append(el("div", {class: "mnb-event", "data-kind": e.kind, "data-rank": e.rank, title: e.detail},
        `${e.clock} ${e.rank >= 0 ? `${e.mesh}.${e.rank}` : e.host} ${e.kind} ${short(e.detail)}`));
  };

  // each part is redrawn only when what it shows changed: a cell or a button is not replaced
  // under the pointer by an update that does not concern it (heartbeat ages tick every second)
  const parts = {toolbar: el("div", {class: "mnb-toolbar"}), body: el("div", {class: "mnb-body"}),
    status: el("div", {class: "mnb-status"}), details: el("div", {class: "mnb-details"}), events: el("div", {class: "mnb-events"})};
  parts.head = el("div", {class: "mnb-details-head"});
  parts.facts = el("div", {class: "mnb-details-body"});
  parts.details.append(parts.head, parts.facts);
  for (const name of ["toolbar", "body", "status", "details", "events"]) root.append(parts[name]);
  const shown = {};
  const update = (name, inputs, fn) => {
    const key = JSON.stringify(inputs);
    if (shown[name] === key) return;
    shown[name] = key;
    const box = parts[name];
    box.replaceChildren();
    box.className = box.className.split(" ")[0];
    fn(box);
  };

  const draw = () => {
    const layout = model.get("layout") || "list";
    const selected = model.get("selected");
    const busy = model.get("busy") || [];
    const grid = model.get("grid") || {};
    root.setAttribute("data-layout", layout);
    update("toolbar", [layout, grid.counts, (grid.hosts || []).length, grid.procs], (box) => toolbar(box, layout));
    if (layout === "grid") {
      if (shown.body !== "grid") {  // from the list (or nothing): start the rows afresh
        parts.body.replaceChildren();
        parts.body.className = "mnb-body";
        gridLines.clear();
        shown.body = "grid";
      }
      drawGrid(parts.body, grid, selected);
    } else update("body", [layout, model.get("nodes"), selected, busy], (box) => drawList(box, model.get("nodes") || {}, selected));
    const status = model.get("status");
    update("status", status, (box) => { if (status) box.append(status); });
    const d = model.get("details") || {};
    parts.details.style.display = d.node ? "" : "none";
    if (d.node) {
      parts.details.setAttribute("data-kind", d.node.kind);
      parts.details.setAttribute("data-name", d.node.name);
      const n = d.node;
      update("head", [layout, d.title, n.kind, n.name, n.state, n.mesh, n.rank, busy.includes(`${n.mesh}.${n.rank}`)],
        (box) => detailsHead(box, d, layout));
      update("facts", [d.facts, d.actors, d.events, d.output], (box) => detailsBody(box, d));
    }
    const events = model.get("events") || [];
    update("events", events, (box) => eventLog(box, events));
  };
  for (const name of ["nodes", "grid", "layout", "selected", "details", "events", "status", "busy"]) model.on(`change:${name}`, draw);
  // the grid comes as deltas of the rows that changed (see SupervisionTree._push_grid): applied
  // to the model's grid when it is the version the delta starts from; otherwise (a delta missed
  // while no view was drawn, or not applied yet by another view) the whole grid is asked for
  const onCustom = (msg) => {
    if (!msg || msg.type !== "grid_delta") return;
    const grid = model.get("grid") || {};
    if (grid.v === msg.v) return;  // another view of this model applied it
    if (grid.v !== msg.from) { model.send({action: "grid_sync", v: grid.v === undefined ? null : grid.v}); return; }
    const rows = new Map((grid.hosts || []).map((r) => [r.name, r]));
    for (const [name, row] of Object.entries(msg.rows || {})) rows.set(name, row);
    const order = msg.order || (grid.hosts || []).map((r) => r.name);
    model.set("grid", {...msg.summary, v: msg.v, hosts: order.map((name) => rows.get(name)).filter((r) => r)});
  };
  model.on("msg:custom", onCustom);
  model.send({action: "grid_sync", v: (model.get("grid") || {}).v ?? null});  // a view drawn late: is its grid the latest?
  draw();
  return () => model.off("msg:custom", onCustom);
}
export default { render };
"""

CSS = """
.mnb-tree { font-family: var(--jp-code-font-family, monospace); font-size: 12px; line-height: 1.7; }
.mnb-toolbar { display: flex; flex-wrap: wrap; align-items: center; column-gap: 14px; margin-bottom: 4px; }
.mnb-legend-item { margin-right: 10px; white-space: nowrap; }
.mnb-swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 3px; vertical-align: -1px; }
.mnb-view[aria-pressed="true"] { font-weight: bold; text-decoration: underline; }
.mnb-node { display: flex; flex-wrap: wrap; align-items: center; row-gap: 2px; }
.mnb-label { cursor: pointer; margin-right: 8px; }
.mnb-selected { text-decoration: underline; font-weight: bold; }
.mnb-dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin-right: 6px; }
.mnb-btn { font-size: 11px; padding: 0 5px; margin-right: 3px; cursor: pointer; }
.mnb-restart { margin-left: 6px; }
.mnb-failure { color: #c62828; margin-left: 6px; }
.mnb-grid { display: flex; flex-direction: column; row-gap: 2px; }
.mnb-hostrow { display: flex; flex-wrap: wrap; align-items: center; padding: 1px 4px; border-radius: 3px; }
.mnb-hostlabel { flex: 0 0 25em; cursor: pointer; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.mnb-hostlabel > span { margin-right: 6px; }
.mnb-hostname { font-weight: bold; }
.mnb-machine, .mnb-load { color: var(--jp-ui-font-color2, #666); }
.mnb-cells { display: flex; flex-wrap: wrap; align-items: center; }
.mnb-cell { display: inline-block; min-width: 24px; height: 20px; line-height: 20px; margin: 1px; padding: 0 2px;
  text-align: center; font-size: 10px; color: #fff; border-radius: 3px; cursor: pointer; box-sizing: border-box; }
.mnb-cell[data-state="failed"] { background-image: repeating-linear-gradient(135deg, rgba(255,255,255,.28) 0 3px, transparent 3px 6px); }
.mnb-cell[data-state="hung"] { border: 2px dashed rgba(0,0,0,.45); line-height: 16px; }
.mnb-cell-selected { outline: 2px solid var(--jp-ui-font-color0, #000); outline-offset: 1px; }
.mnb-meshtag, .mnb-spares { color: var(--jp-ui-font-color2, #666); margin: 0 4px; }
.mnb-lost { background: repeating-linear-gradient(135deg, rgba(198,40,40,.10) 0 6px, transparent 6px 12px);
  outline: 1px solid #c62828; }
.mnb-badge { background: #c62828; color: #fff; padding: 0 4px; border-radius: 3px; font-weight: bold; font-size: 10px; }
.mnb-lostwhy { color: #c62828; margin-left: 8px; }
.mnb-status { margin-top: 4px; color: #555; }
.mnb-status:empty, .mnb-events:empty { display: none; }
.mnb-details { margin-top: 6px; padding: 4px 8px; border-left: 3px solid #90caf9; }
.mnb-actions { margin: 2px 0 4px; }
.mnb-title { font-weight: bold; margin-top: 4px; }
.mnb-output { max-height: 160px; overflow: auto; background: rgba(127,127,127,.08); margin: 2px 0; }
.mnb-events { margin-top: 6px; max-height: 140px; overflow: auto; }
"""
