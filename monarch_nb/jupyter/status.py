"""``%mesh status``: one line per rank that answers the first question (is it alive, what is it
doing, how much memory does it hold), then the running cells and the last events.

Per rank: its host, state, pid, heartbeat age, restarts (the controller's record), device, device memory
used/total, CPU % and RSS (asked from the rank's :class:`~.worker.MeshProbe`, which answers while
a cell runs and never creates a CUDA context on an idle rank), and the cell or endpoint it runs.
"""

from __future__ import annotations

import time
from typing import Any

from .ranks import format_ranks

__all__ = ["status_text", "records_text", "format_bytes"]


def format_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _memory(stats: dict | None) -> str:
    if not stats:
        return "-"
    used, total = stats.get("memory_used_bytes"), stats.get("memory_total_bytes")
    if used is None or total is None:
        return f"- ({stats['memory_note']})" if stats.get("memory_note") else "-"
    return f"{format_bytes(used)} / {format_bytes(total)}"


def _running(busy: dict, cells: dict[int, tuple[str, float]], rank: int) -> str:
    parts = []
    if rank in cells:
        name, seconds = cells[rank]
        parts.append(f"{name} ({seconds:.1f} s)")
    for actor, (endpoint, seconds) in busy.items():
        if not actor.startswith("_mesh_"):
            parts.append(f"{actor}.{endpoint} ({seconds:.1f} s)")
    return ", ".join(parts) or "-"


def status_text(session: Any, auto_mode: bool = False) -> str:
    """The status of ``session``'s mesh: header, one row per rank, running cells, last events."""
    records = [session.controller.proc_record(session.mesh_name, rank) for rank in range(session.world_size)]
    states = [(rec.host, rec.state, rec.pid, rec.last_heard, rec.alive, rec.restarts, dict(rec.busy)) for rec in records]
    stats = session.stats()  # after reading the records: asking makes a rank busy for a moment
    now = time.monotonic()
    cells: dict[int, tuple[str, float]] = {}
    running = session.running()
    for run in running:
        for rank in run.running_ranks():
            cells.setdefault(rank, (run.filename, now - run.started))
    header = (f"mesh {session.mesh_name}: {session.world_size} procs"
              f"{', torch.distributed ' + session.dist_backend if session.dist_backend else ''}"
              f"{', auto mode on (every cell runs on the ranks)' if auto_mode else ''}")
    width = _host_width([s[0] for s in states])
    rows = [header, *_hosts_lines(session.controller, [s[0] for s in states]),
            f"{'rank':>4}  {'host':<{width}}  {'state':<10} {'pid':>7}  {'heartbeat':>9}  {'restarts':>8}  {'device':<7} "
            f"{'memory used / total':<22} {'cpu %':>6}  {'rss':>9}  running"]
    for rank, (host, state, pid, heartbeat, alive, restarts, busy) in enumerate(states):
        age = f"{now - heartbeat:.1f} s" if heartbeat and alive else "-"
        st = stats.get(rank)
        cpu = f"{st['cpu_percent']:.0f}" if st else "-"
        rss = format_bytes(st["rss_bytes"]) if st else "-"
        device = st["device"] if st else "-"
        rows.append(f"{rank:>4}  {host:<{width}}  {state:<10} {pid:>7}  {age:>9}  {restarts:>8}  {device:<7} "
                    f"{_memory(st):<22} {cpu:>6}  {rss:>9}  {_running(busy, cells, rank)}")
    if running:
        rows.append("cells running: " + ", ".join(f"{r.filename} on rank(s) {format_ranks(r.running_ranks())}" for r in running))
    rows += _events(session.controller, session.mesh_name, {s[0] for s in states})
    return "\n".join(rows)


def records_text(controller: Any, mesh: str, world_size: int) -> str:
    """Status of a proc mesh without a notebook session (a training run's): the controller's
    records only."""
    now = time.monotonic()
    records = [controller.proc_record(mesh, rank) for rank in range(world_size)]
    width = _host_width([rec.host for rec in records])
    rows = [f"mesh {mesh}: {world_size} procs", *_hosts_lines(controller, [rec.host for rec in records]),
            f"{'rank':>4}  {'host':<{width}}  {'state':<10} {'pid':>7}  {'heartbeat':>9}  {'restarts':>8}  running"]
    for rank, rec in enumerate(records):
        age = f"{now - rec.last_heard:.1f} s" if rec.last_heard and rec.alive else "-"
        rows.append(f"{rank:>4}  {rec.host:<{width}}  {rec.state:<10} {rec.pid:>7}  {age:>9}  {rec.restarts:>8}  "
                    f"{_running(rec.busy, {}, rank)}")
    rows += _events(controller, mesh, {rec.host for rec in records})
    return "\n".join(rows)


def _host_width(hosts: list[str]) -> int:
    return max([4] + [len(h) for h in hosts])


def _hosts_lines(controller: Any, hosts: list[str]) -> list[str]:
    """For a mesh on attached hosts, one line per host: its state, machine, address and load."""
    records = getattr(controller, "hosts", {})
    last = {}  # host -> its last host_lost / host_returned: lost until it is back, also while re-attached
    for event in controller.events.events(since_seq=max(0, controller.events.next_seq - 2000)):
        if event.kind in ("host_lost", "host_returned"):
            last[event.host] = event.kind
    shown = []
    for name in dict.fromkeys(hosts):
        rec = records.get(name)
        if rec is None or not rec.address:  # this machine's host agent: nothing to tell
            continue
        state = "LOST" if rec.state == "failed" or last.get(name) == "host_lost" else str(rec.state)
        machine = rec.detail.get("hostname") or "?"
        load = f", load {rec.load:.2f}" if rec.last_heartbeat else ""
        shown.append(f"  {name}: {state}, {machine} at {rec.address}{load}")
    return ["hosts:", *shown] if shown else []


def _events(controller: Any, mesh: str, hosts: set[str]) -> list[str]:
    """The mesh's last events, with the losses and returns of its hosts."""
    log = controller.events
    events = [e for e in log.events(since_seq=max(0, log.next_seq - 2000))
              if e.mesh == mesh or (not e.mesh and e.host in hosts and e.kind in ("host_lost", "host_returned"))][-5:]
    if not events:
        return []
    return ["last events:"] + [
        f"  {time.strftime('%H:%M:%S', time.localtime(e.time))}  {f'rank {e.rank}' if e.mesh else e.host}  {e.kind}  {e.detail}"
        for e in events
    ]
