"""How the supervision-tree widget lays the tree out: a grid of ranks per host at cluster size, a list of nodes below it.

Plain functions over :func:`monarch_nb.supervision.tree.snapshot` data (no widget, no IPython),
used by the live widget (:mod:`.tree_widget`, which sends :func:`grid_of`'s result to the
browser, where :mod:`.tree_view` draws it) and by its static fallback (saved notebooks, after
``%mesh stop``):

- **list**: one row per node (controller, host, proc, actor) with its facts and a proc's fault
  buttons; for small meshes (:data:`GRID_AT` procs or fewer, the default) or when asked.
- **grid**: one row per host (its name, machine, state, load; a lost host marked) holding one
  small cell per rank, coloured by state; a click on a cell shows that rank's details with its
  fault and restart buttons. For more than :data:`GRID_AT` procs, or when asked.
"""

from __future__ import annotations

import html
from typing import Any

from .ranks import format_ranks

__all__ = ["GRID_AT", "COLORS", "VIEWS", "layout_of", "grid_of", "node_label", "grid_text", "grid_html", "list_html",
           "list_text", "cell_title"]

#: the grid replaces the list (view "auto") when the tree shows more procs than this
GRID_AT = 16
#: the views a user can ask for: "auto" (grid above GRID_AT procs), "grid", "list"
VIEWS = ("auto", "grid", "list")
#: the colour of each state (dots, cells; the live view and the static fallback)
COLORS = {"healthy": "#2e7d32", "busy": "#1565c0", "paused": "#00838f", "starting": "#9e9e9e", "hung": "#ef6c00",
          "failed": "#c62828", "restarting": "#6a1b9a", "stopping": "#757575", "stopped": "#757575"}
#: states in the order the legend lists them
_LEGEND = ("healthy", "busy", "paused", "starting", "hung", "failed", "restarting", "stopping", "stopped")


def _procs(tree: dict) -> list[dict]:
    return [p for h in tree.get("children", []) for p in h.get("children", []) if p.get("kind") == "proc"]


def layout_of(tree: dict, view: str) -> str:
    """"grid" or "list": what ``view`` ("auto", "grid", "list") shows for ``tree``.

    Raises:
        ValueError: an unknown view.
    """
    if view not in VIEWS:
        raise ValueError(f"view {view!r}: use one of {', '.join(VIEWS)}")
    if view != "auto":
        return view
    return "grid" if len(_procs(tree)) > GRID_AT else "list"


def grid_of(tree: dict) -> dict:
    """The grid of ``tree``: ``{"hosts": [row, ...], "counts": {state: n}, "procs": n, "meshes": [...]}``.

    A row is ``{"name", "state", "lost", "load", "hostname", "address", "pid", "spares", "last_event",
    "cells"}`` (``lost``: the host agent is silent or gone; ``load``: runnable procs per core, None
    before its first heartbeat); a cell is ``{"rank", "mesh", "name", "state", "pid", "restarts",
    "group", "cause", "host"}`` (``group``: its replica group in a sharded training run, else None;
    ``cause``: of its last failure, "" if none), in (mesh, rank) order.
    """
    rows: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    meshes: list[str] = []
    for host in tree.get("children", []):
        if host.get("kind") != "host":
            continue
        cells = []
        for proc in host.get("children", []):
            if proc.get("kind") != "proc":
                continue
            failure = proc.get("last_failure") or {}
            cells.append({"rank": proc["rank"], "mesh": proc["mesh"], "name": proc["name"], "state": str(proc["state"]),
                          "pid": proc["pid"], "restarts": proc["restarts"], "group": proc.get("group"),
                          "cause": failure.get("cause") or failure.get("kind") or ""})
            cells[-1]["title"] = cell_title(cells[-1])
            counts[str(proc["state"])] = counts.get(str(proc["state"]), 0) + 1
            if proc["mesh"] not in meshes:
                meshes.append(proc["mesh"])
        cells.sort(key=lambda c: (c["mesh"], c["rank"]))
        detail = host.get("detail") or {}
        rows.append({"name": host["name"], "state": str(host["state"]), "lost": bool(host.get("lost")),
                     "load": host.get("load"), "hostname": detail.get("hostname") or "", "address": host.get("address") or "",
                     "pid": host.get("pid", 0), "spares": sum(1 for c in host.get("children", []) if c.get("kind") == "spare"),
                     "last_event": host.get("last_event"), "cells": cells})
    return {"hosts": rows, "counts": {s: counts[s] for s in _LEGEND if s in counts}, "procs": sum(counts.values()),
            "meshes": meshes}


def _fmt_s(seconds: Any) -> str:
    return "-" if seconds is None else f"{float(seconds):.1f} s"


def _host_facts(node: dict) -> str:
    """``host3 (gpu-node-03) · healthy · load 0.42`` (``LOST`` for a lost host)."""
    detail = node.get("detail") or {}
    name = node.get("name", "")
    if detail.get("hostname"):
        name += f" ({detail['hostname']})"
    state = "LOST" if node.get("lost") else str(node.get("state"))
    load = node.get("load")
    return f"{name} · {state}" + (f" · load {load:.2f}" if isinstance(load, (int, float)) else "")


def node_label(node: dict) -> str:
    """One node as the list view labels it (controller, host, proc, actor or spare)."""
    kind = node.get("kind")
    if kind == "controller":
        return f"controller · pid {node.get('pid')}"
    if kind == "host":
        return _host_facts(node) + f" · pid {node.get('pid')}"
    if kind == "proc":
        group = f" · group {node['group']}" if node.get("group") is not None else ""
        text = (f"rank {node.get('rank')}{group} · {node.get('name')} · pid {node.get('pid')} · {node.get('state')} · "
                f"heartbeat {_fmt_s(node.get('heartbeat_age_s'))} · restarts {node.get('restarts')}")
        if node.get("endpoint"):
            text += f" · {node['endpoint']} ({_fmt_s(node.get('endpoint_running_s'))})"
        failure = node.get("last_failure")
        if failure:
            text += f" · last failure {failure.get('clock')}: {failure.get('cause') or failure.get('kind')}"
        return text
    if kind == "spare":
        return f"{node.get('name')} · {node.get('state')}"
    detail = node.get("detail") or {}
    return f"{node.get('name')} ({detail.get('class', 'actor')}) · {node.get('state')}"


def _rows(tree: dict) -> list[tuple[int, dict]]:
    rows: list[tuple[int, dict]] = []

    def visit(node: dict, depth: int) -> None:
        rows.append((depth, node))
        for child in node.get("children", []):
            visit(child, depth + 1)

    if tree.get("kind"):
        visit(tree, 0)
    return rows


def _summary(grid: dict) -> str:
    counts = ", ".join(f"{n} {state}" for state, n in grid["counts"].items())
    return f"{len(grid['hosts'])} hosts, {grid['procs']} procs: {counts or 'none'}"


def grid_text(grid: dict) -> list[str]:
    """The grid as text: a summary line, then one line per host naming the ranks that are not healthy."""
    lines = [_summary(grid)]
    for row in grid["hosts"]:
        head = _host_facts({"name": row["name"], "state": row["state"], "lost": row["lost"], "load": row["load"],
                            "detail": {"hostname": row["hostname"]}})
        cells = row["cells"]
        by_state: dict[str, list[int]] = {}
        for cell in cells:
            by_state.setdefault(cell["state"], []).append(cell["rank"])
        parts = [f"{len(v)} {s}" if s in ("healthy", "busy") else f"{s} {'rank' if len(v) == 1 else 'ranks'} {format_ranks(v)}"
                 for s, v in by_state.items()]
        ranks = f"ranks {format_ranks([c['rank'] for c in cells])}" if cells else "no procs"
        lines.append(f"  {head} · {ranks}: {', '.join(parts) or '-'}")
    return lines


def list_text(tree: dict) -> list[str]:
    """The list view as text: one indented line per node."""
    return ["  " * depth + node_label(node) for depth, node in _rows(tree)]


def _dot(state: str, size: int = 9) -> str:
    color = COLORS.get(state, "#9e9e9e")
    return (f'<span style="display:inline-block;width:{size}px;height:{size}px;border-radius:50%;margin-right:6px;'
            f'background:{color}"></span>')


def list_html(tree: dict) -> list[str]:
    """The list view as HTML rows (inline styles: a saved notebook has no widget CSS)."""
    return [f'<div data-state="{html.escape(str(node.get("state", "")))}" style="margin-left:{depth * 18}px">'
            f'{_dot(str(node.get("state", "")))}{html.escape(node_label(node))}</div>' for depth, node in _rows(tree)]


def cell_title(cell: dict) -> str:
    """A cell's tooltip: ``rank 19 · pm0.19 · failed (SIGKILL) · pid 10019 · restarts 0`` (with
    ``· replica group 9`` after the rank in a sharded training run)."""
    state = cell["state"] + (f" ({cell['cause']})" if cell["cause"] and cell["state"] == "failed" else "")
    group = f" · replica group {cell['group']}" if cell.get("group") is not None else ""
    return f"rank {cell['rank']}{group} · {cell['name']} · {state} · pid {cell['pid']} · restarts {cell['restarts']}"


def grid_html(grid: dict) -> list[str]:
    """The grid as HTML (inline styles: a saved notebook has no widget CSS): a summary, then one
    row per host (name, machine, state or a LOST badge, load) with its cells (failed ones hatched)."""
    out = [f'<div style="margin-bottom:4px">{html.escape(_summary(grid))}</div>']
    for row in grid["hosts"]:
        lost = ("background:repeating-linear-gradient(135deg,rgba(198,40,40,.10) 0 6px,transparent 6px 12px);"
                "outline:1px solid #c62828;" if row["lost"] else "")
        state = ('<span style="background:#c62828;color:#fff;padding:0 4px;border-radius:3px;font-weight:bold;'
                 'font-size:10px">LOST</span>' if row["lost"] else html.escape(row["state"]))
        load = "-" if row["load"] is None else f"{row['load']:.2f}"
        machine = f' <span style="color:#666">{html.escape(row["hostname"])}</span>' if row["hostname"] else ""
        label = (f'<span style="flex:0 0 24em;white-space:nowrap;overflow:hidden;text-overflow:ellipsis">{_dot(row["state"])}'
                 f'<b>{html.escape(row["name"])}</b>{machine} {state} <span style="color:#666">load {load}</span></span>')
        cells = "".join(
            f'<span class="mnb-cell" data-rank="{c["rank"]}" data-state="{html.escape(c["state"])}" '
            f'title="{html.escape(c["title"])}" style="display:inline-block;min-width:24px;height:20px;margin:1px;'
            f'text-align:center;font-size:10px;line-height:20px;color:#fff;border-radius:3px;'
            f'background-color:{COLORS.get(c["state"], "#9e9e9e")};{_HATCH if c["state"] == "failed" else ""}">{c["rank"]}</span>'
            for c in row["cells"])
        out.append(f'<div class="mnb-hostrow" data-name="{html.escape(row["name"])}" data-lost="{str(row["lost"]).lower()}" '
                   f'style="display:flex;align-items:center;padding:1px 4px;border-radius:3px;{lost}">'
                   f'{label}<span style="display:flex;flex-wrap:wrap">{cells}</span>{_lost_why(row)}</div>')
    return out


def _lost_why(row: dict) -> str:
    event = row.get("last_event")
    if not (row["lost"] and event):
        return ""
    return f'<span style="color:#c62828;margin-left:8px">lost {html.escape(event["clock"])}: {html.escape(event["detail"])}</span>'


#: a failed cell's hatching (the live view's CSS does the same), so it differs from the others without colour
_HATCH = "background-image:repeating-linear-gradient(135deg,rgba(255,255,255,.28) 0 3px,transparent 3px 6px)"
