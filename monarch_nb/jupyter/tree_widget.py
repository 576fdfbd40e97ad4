"""The live supervision-tree widget: controller -> hosts -> procs -> actors, with fault buttons.

One anywidget model for the whole tree (not one comm per node, as ipytree has). ``widget.tree``
is the last :func:`monarch_nb.supervision.tree.snapshot` (plain data; host nodes carry their
load, address, machine and a ``lost`` flag); ``layout`` says what the browser draws of it: a
list of nodes for small meshes (the ``nodes`` trait: the tree), or above
:data:`.tree_grid.GRID_AT` procs a grid of one cell per rank per host (the ``grid`` trait,
:func:`.tree_grid.grid_of`: 8 hosts x 8 GPUs fit on a screen; ``nodes`` is then empty, so the
heartbeat ages that change every second are not sent for 64 ranks). The ``view`` trait ("auto",
"grid", "list") is the user's choice, toggled in the widget's toolbar. The browser side is
:mod:`.tree_view`.

A background thread follows the controller's event log and refreshes the model at most
``max_hz`` times a second inside ``hold_sync()`` (heartbeat ages tick once a second when nothing
happens). Each proc row (list), or the details of a selected rank (grid), has fault buttons
(kill, hang, nan, slow, partition, raise) and restart; a click is a message to Python, handled on
a worker thread (a restart blocks), so the kernel stays responsive. Clicking a node (a row, a
host, a cell) selects it: ``details`` then holds its title and facts, and for a rank its actors,
last output lines and events; for a host its machine and events.

Without a browser, the same state is there to read (``widget.tree``, ``widget.grid``,
``widget.proc_states()``), and clicks can be simulated with :meth:`SupervisionTree.click` and
:meth:`SupervisionTree.select`.
"""

from __future__ import annotations

import html
import logging
import threading
import time
import weakref
from typing import Any

import anywidget
import traitlets

from ..supervision.records import ProcState
from ..supervision.tree import deferred_gc
from . import tree_grid
from .fallback import StaticFallback
from .refresh import push_changes, refresh_loop
from .tree_grid import COLORS, GRID_AT, VIEWS
from .tree_view import BUTTON_FAULTS, CSS, ESM

__all__ = ["SupervisionTree", "BUTTON_FAULTS", "COLORS", "GRID_AT", "VIEWS"]

log = logging.getLogger(__name__)

_MARKER = "\x1emnb:"
#: a proc that failed shows as failed for at least this long, even when it is restarted at once
#: (a training run restarts a killed rank within milliseconds: the red would not be seen)
FAILED_HOLD_S = 1.5
_FAILURE_EVENTS = ("proc_exited", "proc_hung")
_HOST_EVENTS = ("host_lost", "host_returned")
#: states a failed proc passes through while it comes back (shown as failed for FAILED_HOLD_S)
_RECOVERING = (ProcState.RESTARTING, ProcState.STARTING, ProcState.FAILED)


class SupervisionTree(StaticFallback, anywidget.AnyWidget):
    """The supervision tree of this kernel's controller, live. ``%mesh tree`` shows one.

    Args:
        mesh: show only this proc mesh (default: every running one).
        max_hz: the most model updates per second (default 10).
        controller: the controller to follow (default ``Controller.get()``); any object with its
            ``tree()``, ``events``, ``meshes``, ``hosts``, ``proc_record()``, ``inject()`` and
            ``restart_proc()``.
        view: "auto" (a grid of ranks above :data:`GRID_AT` procs, else a list of nodes),
            "grid" or "list"; the toolbar's toggle changes it.

    Raises:
        ValueError: an unknown ``view``.
    """

    _esm = traitlets.Unicode(ESM).tag(sync=True)
    _css = traitlets.Unicode(CSS).tag(sync=True)
    nodes = traitlets.Dict().tag(sync=True)  # the tree for the list layout; {} while the grid shows
    grid = traitlets.Dict().tag(sync=True)  # whole in Python; to the browser as row deltas (_push_grid)
    view = traitlets.Unicode("auto").tag(sync=True)  # what the user asked for: auto, grid, list
    layout = traitlets.Unicode("list").tag(sync=True)  # what is drawn: grid or list
    selected = traitlets.Unicode("").tag(sync=True)
    details = traitlets.Dict().tag(sync=True)
    events: traitlets.List[Any] = traitlets.List().tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)
    busy: traitlets.List[Any] = traitlets.List().tag(sync=True)  # "mesh.rank" keys with an action in flight

    def __init__(self, mesh: str | None = None, max_hz: float = 10.0, controller: Any = None, view: str = "auto",
                 **kwargs: Any) -> None:
        if view not in VIEWS:
            raise ValueError(f"view {view!r}: use one of {', '.join(VIEWS)}")
        super().__init__(view=view, **kwargs)
        if controller is None:
            from ..runtime.controller import Controller

            controller = Controller.get()
        self._controller = controller
        self._mesh = mesh
        self._min_interval_s = 1.0 / max_hz
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._busy: set[str] = set()
        self._failures: dict[tuple, list] = {}  # (mesh, rank) -> failure events, oldest first
        self._host_events: dict[str, Any] = {}  # host -> its last host_lost / host_returned event
        for event in self._controller.events.events():
            _note(event, self._failures, self._host_events)
        self.tree: dict = {}  # the last snapshot (what the list draws; the grid groups its procs)
        self._grid_by_delta = True  # grid changes go out as deltas, not as trait updates
        self.updates = 0
        self.on_msg(self._on_frontend_msg)
        self.observe(self._on_choice, names=["selected", "view"])
        self._refresh()
        ref = weakref.ref(self)
        dirty = self._dirty
        failures, host_events = self._failures, self._host_events

        def on_event(event: Any) -> None:  # the controller's IO thread: record, flag, return
            _note(event, failures, host_events)
            dirty.set()

        self._unsubscribe = self._controller.events.subscribe(on_event)
        self._thread = threading.Thread(
            target=refresh_loop, args=(ref, dirty, self._stop, "_refresh"), kwargs={"periodic": True}, name="mnb-tree-widget", daemon=True
        )
        self._thread.start()

    def _on_choice(self, change: dict) -> None:
        if change["name"] == "view" and change["new"] not in VIEWS:  # a bad value from a frontend: keep the old one
            self.view = change["old"] if change["old"] in VIEWS else "auto"
            return
        self._dirty.set()

    # -- state ------------------------------------------------------------------------------------
    def _snapshot(self) -> dict:
        tree = self._controller.tree(self._mesh)
        running = {name for name, m in self._controller.meshes.items() if not m.stopped}
        hosts = self._controller.hosts
        failures = self._failures
        now = time.monotonic()
        for host in tree.get("children", []):
            _describe_host(host, hosts.get(host["name"]), self._host_events.get(host["name"]))
            host["children"] = [p for p in host["children"] if p.get("mesh") in running]
            for proc in host["children"]:
                if proc["kind"] != "proc":
                    continue
                seen = list(failures.get((proc["mesh"], proc["rank"]), []))
                proc["failures"] = len(seen)
                if seen:
                    last = seen[-1]
                    proc["last_failure"] = {"kind": last.kind, "cause": last.cause, "detail": last.detail, "clock": _clock(last.time)}
                    if now - last.monotonic < FAILED_HOLD_S and proc["state"] in _RECOVERING:
                        if proc["state"] != ProcState.FAILED:
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

    def _latest_events(self, n: int = 2000) -> list:
        """The last ``n`` events of the log (a long run's log holds up to 100,000)."""
        log = self._controller.events
        return log.events(since_seq=max(0, log.next_seq - n))

    def _recent_events(self, n: int = 12) -> list[dict]:
        events = self._latest_events(500)
        if self._mesh is not None:
            events = [e for e in events if e.mesh == self._mesh or e.kind in _HOST_EVENTS]
        return [_event_dict(e) for e in events[-n:]]

    def _details(self, tree: dict) -> dict:
        if not self.selected:
            return {}
        found = _find(tree, self.selected)
        if found is None:
            return {"node": {"kind": "gone", "name": self.selected, "state": ProcState.STOPPED},
                    "title": f"{self.selected} (gone)", "facts": []}
        node, host = found
        out: dict = {"node": {k: v for k, v in node.items() if k != "children"}}
        if node["kind"] == "host":
            out["title"], out["facts"] = _host_details(node)
            mine = [e for e in self._latest_events() if e.host == node["name"]]  # its own events, then its procs'
            keep = {e.seq for e in [e for e in mine if e.kind in _HOST_EVENTS][-4:] + [e for e in mine if e.kind not in _HOST_EVENTS][-8:]}
            out["events"] = [_event_dict(e) for e in mine if e.seq in keep]
            return out
        if host is not None and node["kind"] in ("proc", "actor"):
            out["node"]["host"] = host["name"]
        if node["kind"] == "proc":
            out["title"], out["facts"] = _proc_details(node, host)
            out["actors"] = [{"name": a["name"], "class": (a.get("detail") or {}).get("class", "actor"), "state": a["state"],
                              "endpoint": a.get("endpoint"), "endpoint_running_s": a.get("endpoint_running_s")}
                             for a in node.get("children", [])]
        else:
            out["title"] = f"{node['kind']} {node['name']}" + (f" on rank {node['rank']}" if node.get("rank") is not None else "")
            out["facts"] = [[k, _fact(node.get(k))] for k in ("state", "pid", "uptime_s", "endpoint", "detail")
                            if node.get(k) not in (None, {}, "")]
        if node.get("rank") is not None and node.get("mesh"):
            try:
                rec = self._controller.proc_record(node["mesh"], node["rank"])
                out["output"] = [line for line in list(rec.output_tail) if _MARKER not in line][-20:]
            except ValueError:
                out["output"] = []
            out["events"] = [_event_dict(e) for e in self._latest_events()
                             if e.mesh == node["mesh"] and e.rank == node["rank"]][-8:]
        return out

    def _refresh(self) -> None:
        with deferred_gc():  # thousands of small dicts at cluster size (see deferred_gc)
            tree = self._snapshot()
            grid = tree_grid.grid_of(tree)
        layout = tree_grid.layout_of(tree, self.view if self.view in VIEWS else "auto")
        events = self._recent_events()
        details = self._details(tree)
        nodes = tree if layout == "list" else {}  # the grid needs no per-node data: less to send each second
        self.tree = tree
        push_changes(self, nodes=nodes, layout=layout, events=events, details=details, busy=sorted(self._busy))
        self._push_grid(grid)
        self.updates += 1

    def _push_grid(self, grid: dict) -> None:
        """Make ``grid`` the model's grid; the browser gets the host rows that changed.

        ``self.grid`` holds the whole grid and a version ``v`` (what a new frontend receives
        with the model's state); a change goes out as one ``grid_delta`` message: ``{"from",
        "v", "summary": counts/procs/meshes, "order": host names (None: unchanged), "rows":
        {host: row}}``. At 1,024 hosts x 8 ranks a rank's failure is one row (about 2 KB), not the
        whole grid (about 2 MB). A frontend whose version is not ``from`` asks for the whole grid
        (``grid_sync``).
        """
        old = self.grid
        old_hosts = old.get("hosts", [])
        summary = {k: v for k, v in grid.items() if k != "hosts"}
        if old and grid["hosts"] == old_hosts and summary == {k: v for k, v in old.items() if k not in ("hosts", "v")}:
            return
        before = int(old.get("v", 0))
        previous = {row["name"]: row for row in old_hosts}
        rows = {row["name"]: row for row in grid["hosts"] if previous.get(row["name"]) != row}
        order = [row["name"] for row in grid["hosts"]]
        self.grid = {**grid, "v": before + 1}  # not sent whole: see _should_send_property
        self.send({"type": "grid_delta", "from": before, "v": before + 1, "summary": summary,
                   "order": None if order == [row["name"] for row in old_hosts] else order, "rows": rows})

    def _should_send_property(self, key: str, value: Any) -> bool:
        if key == "grid" and getattr(self, "_grid_by_delta", False):
            return False  # the grid goes out as deltas (_push_grid), or whole when a frontend asks
        return super()._should_send_property(key, value)

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

    def refresh(self) -> None:
        """Bring the model up to date now (the background loop does it within ``1 / max_hz`` s)."""
        self._refresh()

    # -- clicks -----------------------------------------------------------------------------------
    def select(self, rank: int | None = None, mesh: str | None = None, host: str | None = None) -> dict:
        """Do what a click on a rank's cell or row (or, with ``host``, on a host) does: select it;
        return its ``details`` once shown.

        Raises:
            ValueError: no such rank (or host) in the tree.
        """
        if host is not None:
            if _find(self.tree, host) is None:
                raise ValueError(f"no host {host!r} in the tree")
            name = host
        else:
            node = self.proc_node(rank, mesh) if rank is not None else None
            if node is None:
                raise ValueError(f"no rank {rank!r}{f' of {mesh!r}' if mesh else ''} in the tree")
            name = node["name"]
        self._on_frontend_msg(self, {"action": "select", "name": name}, [])  # what a click sends
        self._refresh()
        return self.details

    def click(self, action: str, rank: int, kind: str | None = None, mesh: str | None = None) -> threading.Thread | None:
        """Do what a button click does (``action`` "fault" with ``kind``, or "restart"); returns
        the worker thread that carries it out (None for another action: nothing runs)."""
        if mesh is None:
            node = self.proc_node(rank)
            mesh = node["mesh"] if node else None
        return self._on_frontend_msg(self, {"action": action, "kind": kind, "mesh": mesh, "rank": rank}, [])

    def _on_frontend_msg(self, _widget: Any, content: dict, _buffers: list) -> threading.Thread | None:
        action = content.get("action")
        if action == "select" and isinstance(content.get("name"), str):
            self.selected = content["name"]
            return None
        if action == "view" and content.get("view") in VIEWS:
            self.view = content["view"]
            return None
        if action == "grid_sync":  # a frontend's grid is not the latest (a new view, a missed delta)
            if content.get("v") != self.grid.get("v"):
                self.send_state("grid")
            return None
        if action not in ("fault", "restart"):
            return None
        worker = threading.Thread(target=self._act, args=(content,), name="mnb-tree-action", daemon=True)
        worker.start()
        return worker

    def _act(self, content: dict) -> None:
        mesh, action, kind = content.get("mesh"), content.get("action"), content.get("kind")
        rank: Any = content.get("rank")  # the frontend's int (int() below says so if it is not one)
        key = f"{mesh}.{rank}"
        if key in self._busy:
            return
        self._busy.add(key)
        self._dirty.set()
        try:
            record = self._controller.meshes.get(mesh)
            if record is None or record.stopped:
                raise ValueError(f"proc mesh {mesh!r} is not running")
            if action == "fault":
                if kind not in BUTTON_FAULTS:
                    raise ValueError(f"unknown fault {kind!r}; buttons: {', '.join(BUTTON_FAULTS)}")
                self._controller.inject(mesh, int(rank), kind, {})
                self.status = f"injected {kind} into rank {rank} of {mesh}"
            else:
                self.status = f"restarting rank {rank} of {mesh} ..."
                t0 = time.monotonic()
                self._controller.restart_proc(mesh, int(rank))
                self.status = f"rank {rank} of {mesh} restarted in {time.monotonic() - t0:.2f} s"
        except Exception as exc:
            self.status = f"{action} {kind or ''} on rank {rank} failed: {exc}"
        finally:
            self._busy.discard(key)
            self._dirty.set()

    # -- the static fallback (saved notebooks, after %mesh stop) ------------------------------------
    def static_text(self) -> str:
        if not self.tree.get("kind"):
            lines = ["(no controller)"]
        elif self.layout == "grid":
            lines = tree_grid.grid_text(self.grid or tree_grid.grid_of(self.tree))
        else:
            lines = tree_grid.list_text(self.tree)
        return "\n".join(lines + [f"({self.status})" if self.status else ""]).rstrip()

    def static_html(self) -> str:
        out = [f'<div class="mnb-tree-static" data-layout="{html.escape(self.layout)}" '
               'style="font-family:monospace;font-size:12px;line-height:1.7">']
        if self.layout == "grid":
            out += tree_grid.grid_html(self.grid or tree_grid.grid_of(self.tree))
        else:
            out += tree_grid.list_html(self.tree)
        if self.status:
            out.append(f'<div style="color:#555">{html.escape(self.status)}</div>')
        out.append('<div style="color:#777;font-style:italic">a snapshot of the supervision tree; '
                   '%mesh tree shows it live</div></div>')
        return "".join(out)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        if hasattr(self, "_stop"):  # not when __init__ refused its arguments
            self._stop.set()
            self._dirty.set()
        unsubscribe = getattr(self, "_unsubscribe", None)
        if unsubscribe is not None:
            unsubscribe()
        super().close()


def _note(event: Any, failures: dict, host_events: dict) -> None:
    """Keep what the tree shows of an event: a proc's failures, a host's last loss or return."""
    if event.kind in _FAILURE_EVENTS:
        failures.setdefault((event.mesh, event.rank), []).append(event)
    elif event.kind in _HOST_EVENTS:
        host_events[event.host] = event


def _clock(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds))


def _describe_host(node: dict, record: Any, event: Any) -> None:
    """Add what a host's row shows to its tree node: load, address, machine, lost, last event.

    Lost: failed, or lost and not yet back (while the controller attaches it again, its record
    is a new one, "starting", until its agent says hello: still lost for the user)."""
    node["lost"] = node["state"] == ProcState.FAILED or (event is not None and event.kind == "host_lost")
    node["load"] = round(record.load, 2) if record is not None and record.last_heartbeat else None
    node["address"] = record.address if record is not None else ""
    node["detail"] = {**node.get("detail", {}), **(dict(record.detail) if record is not None else {})}
    node["heartbeat_age_s"] = (round(time.monotonic() - record.last_heartbeat, 1)
                               if record is not None and record.last_heartbeat else None)
    node["last_event"] = ({"kind": event.kind, "detail": event.detail, "clock": _clock(event.time)}
                          if event is not None else None)


def _find(tree: dict, name: str) -> tuple[dict, dict | None] | None:
    """The node called ``name`` and the host it is under (None for the controller and hosts)."""
    if not tree.get("kind"):
        return None
    if tree["name"] == name:
        return tree, None
    for host in tree.get("children", []):
        if host["name"] == name:
            return host, None
        for node in host.get("children", []):
            if node["name"] == name:
                return node, host
            for actor in node.get("children", []):
                if actor["name"] == name:
                    return actor, host
    return None


def _fact(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f} s"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return "-" if value is None else str(value)


def _proc_details(node: dict, host: dict | None) -> tuple[str, list]:
    where = ""
    if host is not None:
        machine = (host.get("detail") or {}).get("hostname")
        where = f" on {host['name']}" + (f" ({machine})" if machine else "") + (" · host LOST" if host.get("lost") else "")
    title = f"rank {node['rank']} of {node['mesh']} · {node['name']}{where}"
    facts = [["state", str(node["state"])], ["pid", str(node["pid"])], ["coords", _fact(node.get("coords"))],
             ["restarts", str(node["restarts"])], ["heartbeat age", _fact(node.get("heartbeat_age_s"))],
             ["uptime", _fact(node.get("uptime_s"))]]
    if node.get("group") is not None:
        facts.insert(1, ["replica group", f"{node['group']} (a sharded run: its ranks fail and restart together)"])
    if node.get("endpoint"):
        facts.append(["running", f"{node['endpoint']} for {_fact(node.get('endpoint_running_s'))}"])
    failure = node.get("last_failure")
    if failure:
        count = node.get("failures", 1)
        facts.append(["last failure", f"{failure['clock']} {failure.get('cause') or failure['kind']}: {failure['detail']}"
                      + (f" ({count} in all)" if count > 1 else "")])
    if node.get("detail"):
        facts.append(["detail", _fact(node["detail"])])
    return title, facts


def _host_details(node: dict) -> tuple[str, list]:
    detail = node.get("detail") or {}
    title = f"host {node['name']}" + (f" ({detail['hostname']})" if detail.get("hostname") else "") + (" · LOST" if node.get("lost") else "")
    procs = [c for c in node.get("children", []) if c.get("kind") == "proc"]
    facts = [["state", "lost (" + str(node["state"]) + ")" if node.get("lost") else str(node["state"])],
             ["pid", str(node["pid"])], ["load", "-" if node.get("load") is None else f"{node['load']:.2f} runnable per core"],
             ["address", node.get("address") or "this machine"]]
    for key in ("ip", "iface", "cores", "gpus"):
        if detail.get(key) not in (None, "", {}):
            facts.append([key, _fact(detail[key])])
    facts += [["heartbeat age", _fact(node.get("heartbeat_age_s"))], ["uptime", _fact(node.get("uptime_s"))],
              ["procs", str(len(procs))]]
    if node.get("last_event"):
        event = node["last_event"]
        facts.append(["last event", f"{event['clock']} {event['kind']}: {event['detail']}"])
    return title, facts


def _event_dict(event: Any) -> dict:
    return {
        "seq": event.seq, "kind": event.kind, "mesh": event.mesh, "rank": event.rank, "pid": event.pid, "host": event.host,
        "detail": event.detail, "cause": event.cause, "time": event.time, "clock": _clock(event.time),
    }
