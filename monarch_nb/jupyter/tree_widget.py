"""The live supervision-tree widget: controller -> hosts -> procs -> actors, with fault buttons.

One anywidget model for the whole tree (not one comm per node, as ipytree has): its ``tree``
trait holds :func:`monarch_nb.supervision.tree.snapshot` (plain data), redrawn in the browser
by a small ES module shipped as a string (no JavaScript build step). A background thread follows
the controller's event log and refreshes the model at most ``max_hz`` times a second inside
``hold_sync()`` (heartbeat ages tick once a second when nothing happens). Each proc row has
fault buttons (kill, hang, nan, slow, partition, raise) and restart; a click is a message to
Python, handled on a worker thread (a restart blocks), so the kernel stays responsive. Clicking a
node selects it: ``details`` then holds its facts, its last output lines and its events.

Without a browser, the same state is there to read (``widget.tree``, ``widget.proc_states()``)
and clicks can be simulated with :meth:`SupervisionTree.click`.
"""

from __future__ import annotations

import html
import json
import logging
import threading
import time
import weakref
from typing import Any

import anywidget
import traitlets

from ..supervision.records import ProcState
from .fallback import StaticFallback
from .refresh import refresh_loop

__all__ = ["SupervisionTree", "BUTTON_FAULTS"]

log = logging.getLogger(__name__)

#: the fault buttons on each proc, in order
BUTTON_FAULTS = ("kill", "hang", "nan", "slow", "partition", "raise")
_MARKER = "\x1emnb:"
#: a proc that failed shows as failed for at least this long, even when it is restarted at once
#: (a training run restarts a killed rank within milliseconds: the red would not be seen)
FAILED_HOLD_S = 1.5
_FAILURE_EVENTS = ("proc_exited", "proc_hung")
#: states a failed proc passes through while it comes back (shown as failed for FAILED_HOLD_S)
_RECOVERING = (ProcState.RESTARTING, ProcState.STARTING, ProcState.FAILED)

#: the dot colour of each state (the live view and the static fallback)
COLORS = {"healthy": "#2e7d32", "busy": "#1565c0", "paused": "#00838f", "starting": "#9e9e9e", "hung": "#ef6c00",
          "failed": "#c62828", "restarting": "#6a1b9a", "stopping": "#757575", "stopped": "#757575"}

_ESM = "const COLORS = " + json.dumps(COLORS) + ";\nconst FAULTS = " + json.dumps(list(BUTTON_FAULTS)) + ";\n" + r"""

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

function render({ model, el: host }) {
  const root = el("div", {class: "mnb-tree"});
  host.append(root);
  const draw = () => {
    const tree = model.get("tree") || {};
    const selected = model.get("selected");
    const busy = model.get("busy") || [];
    root.replaceChildren();
    const label = (node) => {
      const dot = el("span", {class: "mnb-dot", style: `background:${COLORS[node.state] || "#9e9e9e"}`});
      let text;
      if (node.kind === "controller") text = `controller · pid ${node.pid}`;
      else if (node.kind === "host") text = `${node.name} · pid ${node.pid} · ${node.state}`;
      else if (node.kind === "proc") {
        text = `rank ${node.rank} · ${node.name} · pid ${node.pid} · ${node.state} · heartbeat ${fmt(node.heartbeat_age_s)}` +
          ` · restarts ${node.restarts}` + (node.endpoint ? ` · ${node.endpoint} (${fmt(node.endpoint_running_s)})` : "");
      } else text = `${node.name} (${(node.detail || {}).class || "actor"}) · ${node.state}` +
          (node.endpoint ? ` · ${node.endpoint} ${fmt(node.endpoint_running_s)}` : "");
      const span = el("span", {class: "mnb-label" + (selected === node.name ? " mnb-selected" : ""), title: "show details",
        onclick: () => { model.set("selected", node.name); model.save_changes(); }}, dot, text);
      return span;
    };
    const visit = (node, depth) => {
      const row = el("div", {class: `mnb-node mnb-${node.kind}`, "data-name": node.name, "data-state": node.state,
        style: `margin-left:${depth * 18}px`});
      if (node.kind === "proc") {
        row.setAttribute("data-rank", node.rank); row.setAttribute("data-mesh", node.mesh);
        row.setAttribute("data-pid", node.pid); row.setAttribute("data-failures", node.failures || 0);
        row.setAttribute("data-restarts", node.restarts);
      }
      row.append(label(node));
      if (node.kind === "proc") {
        const key = `${node.mesh}.${node.rank}`;
        const pending = busy.includes(key);
        const alive = node.state === "healthy" || node.state === "busy" || node.state === "paused";
        for (const kind of FAULTS) {
          const b = el("button", {class: "mnb-btn mnb-fault", "data-kind": kind, title: `inject ${kind} into rank ${node.rank}`,
            onclick: () => model.send({action: "fault", kind, mesh: node.mesh, rank: node.rank})}, kind);
          if (!alive || pending) b.disabled = true;
          row.append(b);
        }
        const r = el("button", {class: "mnb-btn mnb-restart", "data-kind": "restart", title: `restart rank ${node.rank} in place`,
          onclick: () => model.send({action: "restart", mesh: node.mesh, rank: node.rank})}, "restart");
        if (pending || node.state === "restarting") r.disabled = true;
        row.append(r);
        if (node.last_failure) {
          const f = node.last_failure;
          row.append(el("span", {class: "mnb-failure", title: f.detail}, ` last failure ${f.clock}: ${f.cause || f.kind}` +
            (node.failures > 1 ? ` (${node.failures} in all)` : "")));
        }
      }
      root.append(row);
      for (const child of node.children || []) visit(child, depth + 1);
    };
    if (tree.kind) visit(tree, 0); else root.append(el("div", {}, "no controller yet"));
    const status = model.get("status");
    if (status) root.append(el("div", {class: "mnb-status"}, status));
    const d = model.get("details") || {};
    if (d.node) {
      const n = d.node;
      const box = el("div", {class: "mnb-details"});
      box.append(el("div", {class: "mnb-title"}, `${n.kind} ${n.name}`));
      const facts = [["state", n.state], ["pid", n.pid], ["rank", n.rank], ["coords", JSON.stringify(n.coords || {})],
        ["restarts", n.restarts], ["heartbeat age", fmt(n.heartbeat_age_s)], ["uptime", fmt(n.uptime_s)],
        ["endpoint", n.endpoint || "-"], ["detail", JSON.stringify(n.detail || {})]];
      for (const [k, v] of facts) if (v !== null && v !== undefined) box.append(el("div", {}, `${k}: ${v}`));
      if ((d.events || []).length) {
        box.append(el("div", {class: "mnb-title"}, "events"));
        for (const e of d.events) box.append(el("div", {class: "mnb-event", title: e.detail}, `${e.clock} ${e.kind} ${short(e.detail)}`));
      }
      box.append(el("div", {class: "mnb-title"}, "last output"));
      box.append(el("pre", {class: "mnb-output"}, (d.output || []).join("\n") || "(none)"));
      root.append(box);
    }
    const events = model.get("events") || [];
    if (events.length) {
      const log = el("div", {class: "mnb-events"}, el("div", {class: "mnb-title"}, "recent events"));
      for (const e of events.slice().reverse())
        log.append(el("div", {class: "mnb-event", "data-kind": e.kind, "data-rank": e.rank, title: e.detail},
          `${e.clock} ${e.mesh}.${e.rank} ${e.kind} ${short(e.detail)}`));
      root.append(log);
    }
  };
  for (const name of ["tree", "selected", "details", "events", "status", "busy"]) model.on(`change:${name}`, draw);
  draw();
}
export default { render };
"""

_CSS = """
.mnb-tree { font-family: var(--jp-code-font-family, monospace); font-size: 12px; line-height: 1.7; }
.mnb-node { display: flex; flex-wrap: wrap; align-items: center; row-gap: 2px; }
.mnb-label { cursor: pointer; margin-right: 8px; }
.mnb-selected { text-decoration: underline; font-weight: bold; }
.mnb-dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin-right: 6px; }
.mnb-btn { font-size: 11px; padding: 0 5px; margin-right: 3px; cursor: pointer; }
.mnb-restart { margin-left: 6px; }
.mnb-failure { color: #c62828; margin-left: 6px; }
.mnb-status { margin-top: 4px; color: #555; }
.mnb-details { margin-top: 6px; padding: 4px 8px; border-left: 3px solid #90caf9; }
.mnb-title { font-weight: bold; margin-top: 4px; }
.mnb-output { max-height: 160px; overflow: auto; background: rgba(127,127,127,.08); margin: 2px 0; }
.mnb-events { margin-top: 6px; max-height: 140px; overflow: auto; }
"""


class SupervisionTree(StaticFallback, anywidget.AnyWidget):
    """The supervision tree of this kernel's controller, live. ``%mesh tree`` shows one.

    Args:
        mesh: show only this proc mesh (default: every running one).
        max_hz: the most model updates per second (default 10).
        controller: the controller to follow (default ``Controller.get()``).
    """

    _esm = traitlets.Unicode(_ESM).tag(sync=True)
    _css = traitlets.Unicode(_CSS).tag(sync=True)
    tree = traitlets.Dict().tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)
    details = traitlets.Dict().tag(sync=True)
    events = traitlets.List().tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)
    busy = traitlets.List().tag(sync=True)  # "mesh.rank" keys with an action in flight

    def __init__(self, mesh: str | None = None, max_hz: float = 10.0, controller: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from ..runtime.controller import Controller

        self._controller = controller or Controller.get()
        self._mesh = mesh
        self._min_interval_s = 1.0 / max_hz
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._busy: set[str] = set()
        self._failures: dict[tuple, list] = {}  # (mesh, rank) -> failure events, oldest first
        for event in self._controller.events.events():
            if event.kind in _FAILURE_EVENTS:
                self._failures.setdefault((event.mesh, event.rank), []).append(event)
        self.updates = 0
        self.on_msg(self._on_frontend_msg)
        self.observe(lambda _change: self._dirty.set(), names=["selected"])
        self._refresh()
        ref = weakref.ref(self)
        dirty = self._dirty
        failures = self._failures

        def on_event(event: Any) -> None:  # the controller's IO thread: record, flag, return
            if event.kind in _FAILURE_EVENTS:
                failures.setdefault((event.mesh, event.rank), []).append(event)
            dirty.set()

        self._unsubscribe = self._controller.events.subscribe(on_event)
        self._thread = threading.Thread(
            target=refresh_loop, args=(ref, dirty, self._stop, "_refresh"), kwargs={"periodic": True}, name="mnb-tree-widget", daemon=True
        )
        self._thread.start()

    # -- state ------------------------------------------------------------------------------------
    def _snapshot(self) -> dict:
        tree = self._controller.tree(self._mesh)
        running = {name for name, m in self._controller.meshes.items() if not m.stopped}
        failures = self._failures
        now = time.monotonic()
        for host in tree.get("children", []):
            host["children"] = [p for p in host["children"] if p.get("mesh") in running]
            for proc in host["children"]:
                seen = list(failures.get((proc["mesh"], proc["rank"]), []))
                proc["failures"] = len(seen)
                if seen:
                    last = seen[-1]
                    proc["last_failure"] = {"kind": last.kind, "cause": last.cause, "detail": last.detail,
                                            "clock": time.strftime("%H:%M:%S", time.localtime(last.time))}
                    if now - last.monotonic < FAILED_HOLD_S and proc["state"] in _RECOVERING:
                        proc["detail"] = {**proc.get("detail", {}), "state_now": proc["state"]}
                        proc["state"] = ProcState.FAILED
                        for actor in proc.get("children", []):
                            actor["state"] = ProcState.FAILED
                if proc.get("heartbeat_age_s") is not None:
                    proc["heartbeat_age_s"] = round(proc["heartbeat_age_s"], 1)
                for actor in proc.get("children", []):
                    if actor.get("heartbeat_age_s") is not None:
                        actor["heartbeat_age_s"] = round(actor["heartbeat_age_s"], 1)
        return tree

    def _recent_events(self, n: int = 12) -> list[dict]:
        log = self._controller.events
        events = log.events(since_seq=max(0, log.next_seq - 500))
        if self._mesh is not None:
            events = [e for e in events if e.mesh == self._mesh]
        return [_event_dict(e) for e in events[-n:]]

    def _details(self, tree: dict) -> dict:
        if not self.selected:
            return {}
        from ..supervision.tree import walk

        node = next((n for n in walk(tree) if n["name"] == self.selected), None)
        if node is None:
            return {"node": {"kind": "gone", "name": self.selected, "state": ProcState.STOPPED}}
        out: dict = {"node": {k: v for k, v in node.items() if k != "children"}}
        if node.get("rank") is not None and node.get("mesh"):
            try:
                rec = self._controller.proc_record(node["mesh"], node["rank"])
                out["output"] = [line for line in list(rec.output_tail) if _MARKER not in line][-20:]
            except ValueError:
                out["output"] = []
            out["events"] = [_event_dict(e) for e in self._controller.events.events()
                             if e.mesh == node["mesh"] and e.rank == node["rank"]][-8:]
        return out

    def _refresh(self) -> None:
        tree = self._snapshot()
        events = self._recent_events()
        details = self._details(tree)
        with self.hold_sync():
            if tree != self.tree:
                self.tree = tree
            if events != self.events:
                self.events = events
            if details != self.details:
                self.details = details
            busy = sorted(self._busy)
            if busy != self.busy:
                self.busy = busy
        self.updates += 1

    # -- reading (tests, scripts) -------------------------------------------------------------------
    def proc_states(self, mesh: str | None = None) -> dict[int, str]:
        """rank -> state as the widget shows it now (of ``mesh``, or of the only/first mesh)."""
        from ..supervision.tree import walk

        procs = [n for n in walk(self.tree) if n["kind"] == "proc"]
        mesh = mesh or (procs[0]["mesh"] if procs else None)
        return {n["rank"]: n["state"] for n in procs if n["mesh"] == mesh}

    def proc_node(self, rank: int, mesh: str | None = None) -> dict | None:
        from ..supervision.tree import walk

        for node in walk(self.tree):
            if node["kind"] == "proc" and node["rank"] == rank and (mesh is None or node["mesh"] == mesh):
                return node
        return None

    # -- clicks -----------------------------------------------------------------------------------
    def click(self, action: str, rank: int, kind: str | None = None, mesh: str | None = None) -> threading.Thread:
        """Do what a button click does (``action`` "fault" with ``kind``, or "restart"); returns
        the worker thread that carries it out."""
        if mesh is None:
            node = self.proc_node(rank)
            mesh = node["mesh"] if node else None
        return self._on_frontend_msg(self, {"action": action, "kind": kind, "mesh": mesh, "rank": rank}, [])

    def _on_frontend_msg(self, _widget: Any, content: dict, _buffers: list) -> threading.Thread | None:
        action = content.get("action")
        if action not in ("fault", "restart"):
            return None
        worker = threading.Thread(target=self._act, args=(content,), name="mnb-tree-action", daemon=True)
        worker.start()
        return worker

    def _act(self, content: dict) -> None:
        from ..actor.mesh import ProcMesh

        mesh, rank, action, kind = content.get("mesh"), content.get("rank"), content.get("action"), content.get("kind")
        key = f"{mesh}.{rank}"
        if key in self._busy:
            return
        self._busy.add(key)
        self._dirty.set()
        try:
            record = self._controller.meshes.get(mesh)
            if record is None or record.stopped:
                raise ValueError(f"proc mesh {mesh!r} is not running")
            procs = ProcMesh(mesh, record.extent)
            if action == "fault":
                if kind not in BUTTON_FAULTS:
                    raise ValueError(f"unknown fault {kind!r}; buttons: {', '.join(BUTTON_FAULTS)}")
                procs.inject(int(rank), kind)
                self.status = f"injected {kind} into rank {rank} of {mesh}"
            else:
                self.status = f"restarting rank {rank} of {mesh} ..."
                t0 = time.monotonic()
                procs.restart(int(rank))
                self.status = f"rank {rank} of {mesh} restarted in {time.monotonic() - t0:.2f} s"
        except Exception as exc:
            self.status = f"{action} {kind or ''} on rank {rank} failed: {exc}"
        finally:
            self._busy.discard(key)
            self._dirty.set()

    # -- the static fallback (saved notebooks, after %mesh stop) ------------------------------------
    def _rows(self) -> list[tuple[int, dict]]:
        rows: list[tuple[int, dict]] = []

        def visit(node: dict, depth: int) -> None:
            rows.append((depth, node))
            for child in node.get("children", []):
                visit(child, depth + 1)

        if self.tree.get("kind"):
            visit(self.tree, 0)
        return rows

    def static_text(self) -> str:
        lines = ["  " * depth + _node_label(node) for depth, node in self._rows()] or ["(no controller)"]
        return "\n".join(lines + [f"({self.status})" if self.status else ""]).rstrip()

    def static_html(self) -> str:
        out = ['<div class="mnb-tree-static" style="font-family:monospace;font-size:12px;line-height:1.7">']
        for depth, node in self._rows():
            color = COLORS.get(node.get("state", ""), "#9e9e9e")
            out.append(f'<div data-state="{html.escape(str(node.get("state", "")))}" style="margin-left:{depth * 18}px">'
                       f'<span style="display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:6px;'
                       f'background:{color}"></span>{html.escape(_node_label(node))}</div>')
        if self.status:
            out.append(f'<div style="color:#555">{html.escape(self.status)}</div>')
        out.append('<div style="color:#777;font-style:italic">a snapshot of the supervision tree; '
                   '%mesh tree shows it live</div></div>')
        return "".join(out)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        unsubscribe = getattr(self, "_unsubscribe", None)
        if unsubscribe is not None:
            unsubscribe()
        super().close()


def _node_label(node: dict) -> str:
    """One node as the live view labels it (controller, host, proc or actor)."""
    def fmt(seconds: Any) -> str:
        return "-" if seconds is None else f"{float(seconds):.1f} s"

    kind = node.get("kind")
    if kind == "controller":
        return f"controller · pid {node.get('pid')}"
    if kind == "host":
        return f"{node.get('name')} · pid {node.get('pid')} · {node.get('state')}"
    if kind == "proc":
        text = (f"rank {node.get('rank')} · {node.get('name')} · pid {node.get('pid')} · {node.get('state')} · "
                f"heartbeat {fmt(node.get('heartbeat_age_s'))} · restarts {node.get('restarts')}")
        if node.get("endpoint"):
            text += f" · {node['endpoint']} ({fmt(node.get('endpoint_running_s'))})"
        failure = node.get("last_failure")
        if failure:
            text += f" · last failure {failure.get('clock')}: {failure.get('cause') or failure.get('kind')}"
        return text
    detail = node.get("detail") or {}
    return f"{node.get('name')} ({detail.get('class', 'actor')}) · {node.get('state')}"


def _event_dict(event: Any) -> dict:
    return {
        "seq": event.seq, "kind": event.kind, "mesh": event.mesh, "rank": event.rank, "pid": event.pid,
        "detail": event.detail, "cause": event.cause, "time": event.time,
        "clock": time.strftime("%H:%M:%S", time.localtime(event.time)),
    }

