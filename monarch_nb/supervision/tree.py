"""The supervision tree as plain data: controller (root) -> host agents -> procs -> actors.

:func:`snapshot` reads the controller's records once and returns nested dicts and lists (no live
objects), so a widget can diff two snapshots and a test can assert on one. ``procs.tree()`` and
``Controller.get().tree()`` return it. Every node has the same keys:

===================  ===========================================================================
key                  meaning
===================  ===========================================================================
kind                 "controller", "host", "proc", "actor", or "spare" (a warm spare proc under its
                     host, waiting to take a failed rank's place)
name                 "controller", the host agent's name, the proc's identity ("pm0.3"), the actor
                     mesh's name
state                starting, healthy, busy, paused (a user holds it at breakpoint(); never fenced),
                     hung, failed, restarting, stopping, stopped
pid                  OS pid (0 if unknown)
mesh                 the proc mesh's name (procs and actors), else None
rank                 flat rank in the proc mesh (procs and their actors), else None
coords               coordinates, dim -> index (procs and their actors), else {}
group                the replica group of a sharded training run's proc (rank // group size; procs
                     and their actors), else None
restarts             times this proc was restarted (procs and their actors), else 0
heartbeat_age_s      seconds since the proc's last heartbeat (procs and their actors), else None
endpoint             the endpoint an actor is running now (None if idle); on a proc, the longest
                     running one of its actors
endpoint_running_s   for how long that endpoint has run, seconds (None if idle)
uptime_s             seconds since the node started serving (None if it is not running)
detail               extra facts: a proc's exit ({"returncode", "signal"}), "fenced", "paused" (at
                     breakpoint(), by the debugger), an actor's class
children             the nodes below
===================  ===========================================================================
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any, Iterable, Iterator, Mapping

from .records import ALIVE, ActorSpawn, HostRecord, ProcMeshRecord, ProcRecord, ProcState

__all__ = ["snapshot", "walk", "find", "render", "deferred_gc", "NODE_STATES", "Node"]

#: A node of the tree: the keys of the module docstring.
Node = dict[str, Any]

#: Every state a node can be in.
NODE_STATES = tuple(ProcState)


@contextlib.contextmanager
def deferred_gc() -> Iterator[None]:
    """Hold off the cyclic garbage collector while a snapshot (or what is made of it) is built.

    At 8,192 procs a snapshot is ~25,000 acyclic dicts and lists; the collections their
    allocations trigger scan the whole heap at generation 2, and in a process that imported
    torch that tripled the time (mean of 16: 0.75 s against 0.25 s deferred). Collection resumes
    after (one collection then, not dozens during).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _node(kind: str, name: str, state: str, pid: int, **extra: Any) -> Node:
    node: Node = {
        "kind": kind, "name": name, "state": state, "pid": pid, "mesh": None, "rank": None, "coords": {}, "group": None,
        "restarts": 0, "heartbeat_age_s": None, "endpoint": None, "endpoint_running_s": None,
        "uptime_s": None, "detail": {}, "children": [],
    }
    node.update(extra)
    return node


def snapshot(
    hosts: Iterable[HostRecord],
    meshes: Mapping[str, ProcMeshRecord],
    procs: Mapping[str, ProcRecord],
    *,
    closed: bool = False,
    started_at: float | None = None,
    mesh: str | None = None,
    ranks: set[int] | None = None,
) -> Node:
    """The supervision tree now, as plain data (see the module docstring for the keys).

    Args:
        hosts: the host agents' records.
        meshes: proc mesh name -> record.
        procs: proc identity -> record.
        closed: the controller was shut down (the root is then "stopped").
        started_at: ``time.monotonic()`` when the controller started (for its uptime).
        mesh: only this proc mesh's procs (all meshes if None).
        ranks: only these flat ranks of ``mesh`` (all if None).

    Returns:
        The root node (a dict); host agents are its children, procs theirs, actors theirs.
    """
    with deferred_gc():
        return _snapshot(hosts, meshes, procs, closed, started_at, mesh, ranks)


def _snapshot(hosts: Iterable[HostRecord], meshes: Mapping[str, ProcMeshRecord], procs: Mapping[str, ProcRecord], closed: bool,
              started_at: float | None, mesh: str | None, ranks: set[int] | None) -> Node:
    now = time.monotonic()
    root = _node(
        "controller", "controller", ProcState.STOPPED if closed else ProcState.HEALTHY, os.getpid(),
        uptime_s=round(now - (started_at if started_at is not None else now), 3),
    )
    host_nodes: dict[str, Node] = {}
    for host in list(hosts):
        running = host.state in (ProcState.STARTING, ProcState.HEALTHY)
        host_nodes[host.name] = _node(
            "host", host.name, host.state, host.pid, uptime_s=round(now - host.started_at, 3) if running else None,
        )
        root["children"].append(host_nodes[host.name])
        for spare_mesh, spares in list(host.spares.items()):
            if mesh is not None and spare_mesh != mesh:
                continue
            for spare in spares:
                state = ProcState.HEALTHY if spare["ready"] else ProcState.STARTING
                host_nodes[host.name]["children"].append(
                    _node("spare", f"spare {spare_mesh} pid {spare['pid']}", state, spare["pid"], mesh=spare_mesh))
    for name, record in list(meshes.items()):
        if mesh is not None and name != mesh:
            continue
        spawns = [(spawn, frozenset(spawn.ranks)) for spawn in list(record.actors)]  # a set: 8,192 ranks, not n^2
        for rank, identity in enumerate(record.procs):
            if ranks is not None and rank not in ranks:
                continue
            rec = procs.get(identity)
            if rec is None:
                continue
            proc = _proc_node(rec, spawns, now)
            if record.replica_group_size > 1:
                group = rank // record.replica_group_size
                for node in (proc, *proc["children"]):
                    node["group"] = group
            host_node = host_nodes.get(rec.host)
            if host_node is None:
                host_node = host_nodes[rec.host] = _node("host", rec.host, ProcState.FAILED, 0)
                root["children"].append(host_node)
            host_node["children"].append(proc)
    return root


def _proc_node(rec: ProcRecord, spawns: list[tuple[ActorSpawn, frozenset[int]]], now: float) -> Node:
    alive = rec.alive
    heard = rec.last_heard
    age = round(now - heard, 3) if heard else None
    started = rec.started_at
    detail: dict[str, Any] = {}
    if rec.exit_info:
        detail["exit"] = dict(rec.exit_info)
    if rec.fenced:
        detail["fenced"] = True
    if rec.paused:  # stopped at breakpoint() by a user: not hung
        detail["paused"] = list(rec.paused)
    paused_actors = {p.get("actor") for p in rec.paused}
    proc_state = ProcState.PAUSED if paused_actors and rec.serving else rec.state
    proc = _node(
        "proc", rec.identity, proc_state, rec.pid, mesh=rec.mesh, rank=rec.rank, coords=dict(rec.coords),
        restarts=rec.restarts, heartbeat_age_s=age,
        uptime_s=round(now - started, 3) if alive and started and rec.state != ProcState.RESTARTING else None, detail=detail,
    )
    busy = dict(rec.busy) if alive else {}
    since_hb = (now - heard) if heard else 0.0
    for spawn, on_ranks in spawns:
        if rec.rank not in on_ranks:
            continue
        current = busy.get(spawn.name)
        if rec.serving:
            state = ProcState.PAUSED if spawn.name in paused_actors else (ProcState.BUSY if current else ProcState.HEALTHY)
        else:
            state = rec.state
        endpoint, running = (current[0], round(current[1] + since_hb, 3)) if current else (None, None)
        proc["children"].append(_node(
            "actor", spawn.name, state, rec.pid, mesh=rec.mesh, rank=rec.rank, coords=dict(rec.coords),
            restarts=rec.restarts, heartbeat_age_s=age, endpoint=endpoint, endpoint_running_s=running,
            uptime_s=proc["uptime_s"], detail={"class": getattr(spawn.cls, "__qualname__", str(spawn.cls))},
        ))
        if running is not None and (proc["endpoint_running_s"] is None or running > proc["endpoint_running_s"]):
            proc["endpoint"], proc["endpoint_running_s"] = f"{spawn.name}.{endpoint}", running
    return proc


def walk(tree: Node) -> Iterator[Node]:
    """Every node of ``tree``, parents before children (depth first)."""
    yield tree
    for child in tree["children"]:
        yield from walk(child)


def find(tree: Node, kind: str | None = None, **match: Any) -> list[Node]:
    """The nodes of ``tree`` of ``kind`` whose keys equal ``match`` (``find(t, "proc", rank=2)``)."""
    return [n for n in walk(tree) if (kind is None or n["kind"] == kind) and all(n.get(k) == v for k, v in match.items())]


def render(tree: Node) -> str:
    """The tree as indented text, one node a line (for a terminal or a notebook cell)."""
    lines: list[str] = []

    def visit(node: Node, depth: int) -> None:
        facts = [node["state"], f"pid {node['pid']}"]
        if node["rank"] is not None and node["kind"] == "proc":
            facts.append(f"rank {node['rank']} {node['coords']}")
        if node["kind"] == "proc" and node["restarts"]:
            facts.append(f"restarts {node['restarts']}")
        if node["kind"] == "proc" and node["heartbeat_age_s"] is not None and node["state"] in ALIVE:
            facts.append(f"hb {node['heartbeat_age_s']:.2f}s ago")
        if node["endpoint"]:
            facts.append(f"in {node['endpoint']} for {node['endpoint_running_s']:.2f}s")
        if node["uptime_s"] is not None:
            facts.append(f"up {node['uptime_s']:.1f}s")
        lines.append(f"{'  ' * depth}{node['kind']} {node['name']}: {', '.join(facts)}")
        for child in node["children"]:
            visit(child, depth + 1)

    visit(tree, 0)
    return "\n".join(lines)
