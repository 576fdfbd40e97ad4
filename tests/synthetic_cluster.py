"""A synthetic cluster for the supervision-tree widget: real records, no processes.

:class:`SyntheticController` holds real :mod:`monarch_nb.supervision.records` (HostRecord,
ProcRecord, ProcMeshRecord) and a real EventLog, and answers what
:class:`~monarch_nb.jupyter.tree_widget.SupervisionTree` asks a controller (``tree()`` through
the real :func:`monarch_nb.supervision.tree.snapshot`, ``events``, ``meshes``, ``hosts``,
``proc_record``, ``inject``, ``restart_proc``). It lets a test (and the browser test, through a
kernel) show a cluster of 8 hosts x 8 GPUs on a 2-core machine.

The default picture: one proc mesh ``pm0`` with dims {"hosts": 8, "gpus": 8} on host1..host8;
rank 19 failed (SIGKILL), host6 lost (its 8 ranks failed with cause ``host_lost``), a few ranks
busy, one hung, one paused at breakpoint() (52), one restarting.
"""

from __future__ import annotations

import time

from monarch_nb.actor.shape import Extent
from monarch_nb.supervision.events import Event, EventLog
from monarch_nb.supervision.records import ActorSpawn, HostRecord, ProcMeshRecord, ProcRecord, ProcState
from monarch_nb.supervision.tree import snapshot

__all__ = ["SyntheticController", "FAILED_RANK", "LOST_HOST"]

#: the rank that failed (SIGKILL) in the default picture, and the lost host
FAILED_RANK = 19
LOST_HOST = "host6"


class _Trainer:  # the class an actor mesh was spawned from (its name shows in the tree)
    pass


class SyntheticController:
    """What the tree widget reads of a controller, over real records of ``hosts`` x ``per_host`` ranks."""

    def __init__(self, hosts: int = 8, per_host: int = 8, mesh: str = "pm0", scenario: bool = True):
        now = time.monotonic()
        self.started_at = now - 600.0
        self.events = EventLog()
        self.hosts: dict[str, HostRecord] = {}
        self.procs: dict[str, ProcRecord] = {}
        self.meshes: dict[str, ProcMeshRecord] = {}
        self.mesh = mesh
        self.closed = False
        for h in range(hosts):
            name = f"host{h + 1}"
            record = HostRecord(name, state=ProcState.HEALTHY, pid=4000 + h, started_at=now - 590.0,
                                last_heartbeat=now, load=round(0.25 + 0.11 * h, 2), address=f"tcp://10.0.0.{h + 2}:26600",
                                detail={"hostname": f"gpu-node-{h + 1:02d}", "ip": f"10.0.0.{h + 2}", "iface": "eth0",
                                        "cores": 96, "gpus": {"count": per_host, "kind": "cuda"}})
            record.ready.set()
            self.hosts[name] = record
        extent = Extent({"hosts": hosts, "gpus": per_host})
        identities = []
        for rank in range(hosts * per_host):
            h, g = divmod(rank, per_host)
            identity = f"{mesh}.{rank}"
            rec = ProcRecord(identity, mesh, rank, {"hosts": h, "gpus": g}, f"host{h + 1}", {}, state=ProcState.HEALTHY,
                             pid=10_000 + rank, last_heartbeat=now, started_at=now - 580.0)
            rec.ready.set()
            rec.output_tail.extend([f"rank {rank}: step {s} loss {2.0 / (s + 1):.3f}" for s in range(5)])
            self.procs[identity] = rec
            identities.append(identity)
            self.events.append(Event("proc_started", rank=rank, coords=rec.coords, pid=rec.pid, mesh=mesh, host=rec.host,
                                     detail="serving"))
        self.meshes[mesh] = ProcMeshRecord(mesh, extent, identities,
                                           actors=[ActorSpawn("trainers", _Trainer, b"", [], list(range(hosts * per_host)))])
        if scenario:
            self._scenario(hosts, per_host)

    def _scenario(self, hosts: int, per_host: int) -> None:
        for rank in (3, 12, 33, 44):
            if rank < len(self.procs):
                rec = self.record(rank)
                rec.state = ProcState.BUSY
                rec.busy = {"trainers": ["step", 1.5 + rank / 10]}
        if 52 < len(self.procs):  # a user holds rank 52 at breakpoint()
            self.record(52).paused = [{"actor": "trainers", "file": "train.py", "line": 88}]
        if 58 < len(self.procs):
            self.record(58).state = ProcState.HUNG
            self._event("proc_hung", 58, "no heartbeat for 1.2 s", "heartbeat")
        if 62 < len(self.procs):
            self.record(62).state = ProcState.RESTARTING
            self.record(62).restarts = 1
        if FAILED_RANK < len(self.procs):
            self.fail(FAILED_RANK, "SIGKILL", "killed by signal SIGKILL")
        if int(LOST_HOST[4:]) <= hosts:
            self.lose_host(LOST_HOST, "no heartbeat for 1.05 s")

    # -- what the widget asks -------------------------------------------------------------------
    def tree(self, mesh: str | None = None, ranks: set[int] | None = None) -> dict:
        now = time.monotonic()
        for rec in self.procs.values():  # the ranks that serve keep heartbeating
            if rec.state in (ProcState.HEALTHY, ProcState.BUSY):
                rec.last_heartbeat = now - 0.05 * (rec.rank % 4)
        return snapshot(self.hosts.values(), self.meshes, self.procs, closed=self.closed, started_at=self.started_at,
                        mesh=mesh, ranks=ranks)

    def proc_record(self, mesh: str, rank: int) -> ProcRecord:
        record = self.meshes.get(mesh)
        if record is None or not 0 <= rank < len(record.procs):
            raise ValueError(f"no rank {rank} in {mesh!r}")
        return self.procs[record.procs[rank]]

    def inject(self, mesh: str, rank: int, kind: str, params: dict) -> Event:
        rec = self.proc_record(mesh, rank)
        if not rec.serving:
            raise RuntimeError(f"rank {rank} of {mesh!r} is {rec.state}; faults go to live procs (restart it first)")
        event = self._event("fault_injected", rank, kind, kind)
        if kind == "kill":
            self.fail(rank, "SIGKILL", "killed by signal SIGKILL")
        elif kind == "hang":
            rec.state = ProcState.HUNG
            self._event("proc_hung", rank, "no heartbeat for 1.0 s", "heartbeat")
        return event

    def restart_proc(self, mesh: str, rank: int, timeout_s: float = 30.0) -> None:
        rec = self.proc_record(mesh, rank)
        rec.state = ProcState.RESTARTING
        rec.restarts += 1
        self._event("proc_restarting", rank, f"restart {rec.restarts}", "restart")
        rec.pid += 1000
        rec.exit_info = None
        rec.state = ProcState.HEALTHY
        rec.started_at = time.monotonic()
        self._event("proc_restarted", rank, "serving again", "restart")

    # -- building the picture -------------------------------------------------------------------
    def record(self, rank: int) -> ProcRecord:
        return self.proc_record(self.mesh, rank)

    def fail(self, rank: int, cause: str, detail: str) -> None:
        rec = self.record(rank)
        rec.state = ProcState.FAILED
        rec.exit_info = {"returncode": -9, "signal": "SIGKILL"} if cause == "SIGKILL" else {"returncode": None}
        rec.busy = {}
        self._event("proc_exited", rank, detail, cause)

    def lose_host(self, name: str, why: str) -> None:
        host = self.hosts[name]
        host.state = ProcState.FAILED
        host.last_heartbeat = time.monotonic() - 1.05
        self.events.append(Event("host_lost", pid=host.pid, host=name, detail=why, cause="host_lost"))
        for rec in self.procs.values():
            if rec.host == name and rec.state not in (ProcState.FAILED, ProcState.STOPPED):
                rec.state = ProcState.FAILED
                rec.exit_info = {"returncode": None, "signal": None, "host_lost": True}
                rec.busy, rec.paused = {}, []
                self._event("proc_exited", rec.rank, f"host {name} lost: {why}", "host_lost")

    def _event(self, kind: str, rank: int, detail: str, cause: str) -> Event:
        rec = self.record(rank)
        return self.events.append(Event(kind, rank=rank, coords=rec.coords, pid=rec.pid, mesh=rec.mesh, host=rec.host,
                                        detail=detail, cause=cause))
