"""The life of proc meshes: starting one on its hosts, stopping it, restarting one of its procs.

:class:`ProcMeshes` is a part of the :class:`~monarch_nb.runtime.controller.Controller` (it works
on the controller's records: ``procs``, ``meshes``, ``hosts``), kept here so that the
controller's module stays the hub and each room does one thing; of the controller it sees only
:class:`ProcMeshesController` (and of the hosts room only :class:`HostPlacement`). Every proc mesh gets a
:class:`~monarch_nb.runtime.rendezvous.LazyStore` on an address all its hosts reach, named in
its procs' ``MASTER_ADDR`` / ``MASTER_PORT``; warm spares are asked of each host's agent once the
mesh serves. A restart reuses the proc's spec (same rank, coordinates and environment) and is
serialized per rank: a second request while one runs waits for it (``restart_skipped`` event).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from ..actor.shape import Extent
from ..config import config
from ..errors import SupervisionError
from .hosts import AttachError
from ..supervision.policy import SupervisionPolicy
from ..supervision.records import HostRecord, ProcMeshRecord, ProcRecord, ProcState
from .launch import proc_specs, spare_proc_env
from .protocol import Kind, RendezvousHeader
from .rendezvous import LazyStore

if TYPE_CHECKING:
    import threading

    from ..supervision.events import Event, EventLog
    from ..transport.channel import Channel
    from .messenger import Messenger

__all__ = ["ProcMeshes", "ProcMeshesController", "HostPlacement"]

log = logging.getLogger(__name__)


class HostPlacement(Protocol):
    """What :class:`ProcMeshes` uses of the hosts room (:class:`~.hosts.Hosts` is one)."""

    def resolve(self, host: str) -> HostRecord:
        """The record of ``host``, started or attached and serving (raises ValueError, AttachError)."""

    def reattaching(self, host: str) -> bool:
        """``host`` is lost and being attached again (a spawn on it waits for its return)."""

    def placement(self, host: str) -> dict:
        """Where procs of ``host`` connect and what they inherit (``controller``, ``base_env``, ``run_id``, ``master_ip``)."""

    def is_local(self, host: str) -> bool:
        """``host`` names this machine's host agent."""


class ProcMeshesController(Protocol):
    """What :class:`ProcMeshes` uses of its controller (:class:`~.controller.Controller` is one)."""

    @property
    def procs(self) -> dict[str, ProcRecord]:
        """Proc identity -> its record (a new mesh's records are added here)."""

    @property
    def meshes(self) -> dict[str, ProcMeshRecord]:
        """Proc mesh name -> its record."""

    @property
    def hosts(self) -> dict[str, HostRecord]:
        """Host agent name -> its record (its machine and cores, its warm spares)."""

    @property
    def records_lock(self) -> threading.RLock:
        """Guards ``procs`` and ``meshes`` while a mesh's name and records are added, or its rendezvous round renewed."""

    @property
    def host_agents(self) -> HostPlacement:
        """The hosts room: which hosts serve, where their procs connect."""

    @property
    def channel(self) -> Channel:
        """The controller's socket: sends to agents and procs, watches a rendezvous store's listening socket."""

    @property
    def messenger(self) -> Messenger:
        """Fails the calls in flight to procs that stop or restart."""

    @property
    def events(self) -> EventLog:
        """The event log (a restarted proc that does not serve says why with the last event)."""

    def record_event(self, kind: str, rec: ProcRecord, **fields: Any) -> Event:
        """Append an event about ``rec``'s proc to the log."""

    def signal_proc(self, identity: str, signame: str) -> None:
        """Have the proc's host agent send it ``signame`` (``"SIGKILL"``: a stop's last resort, a restart's first step)."""

    def stop_mesh_actors(self, mesh: str) -> None:
        """Proc mesh ``mesh`` is stopping: what its actors own stops first, its actors are marked stopped."""


class ProcMeshes:
    """Spawn, stop and restart the procs of the controller ``ctrl`` (see the module docstring)."""

    def __init__(self, ctrl: ProcMeshesController):
        self.ctrl = ctrl
        self._stores: dict[str, LazyStore] = {}  # mesh -> the store of its current rendezvous round
        self._ids = itertools.count()

    def spawn(self, hosts: list[str], extent: Extent, name: str | None = None, python: str = "", *,
              spares: int = 0, preload: Sequence[str] = ()) -> str:
        """Start ``extent.nelements`` procs (see :meth:`HostMesh.spawn_procs`); return the mesh's name.

        Raises:
            ValueError: ``name`` is not a new identifier, or an unknown host.
            AttachError: a host is lost (being attached again).
            RuntimeError: a proc exited or did not say hello within ``start_timeout_s``.
        """
        ctrl = self.ctrl
        with ctrl.records_lock:
            if name is None:
                name = f"pm{next(self._ids)}"
                while name in ctrl.meshes:
                    name = f"pm{next(self._ids)}"
            elif not name.isidentifier() or name in ctrl.meshes:
                raise ValueError(f"proc mesh name {name!r} must be a new identifier")
        names = [self._serving_host(h) for h in hosts]
        placements = {h: ctrl.host_agents.placement(h) for h in set(names)}
        remote_ips = sorted({p["master_ip"] for p in placements.values()} - {"127.0.0.1"})
        store = LazyStore(host=remote_ips[0] if remote_ips else "127.0.0.1")  # one address every host reaches
        specs = proc_specs(name, extent, names, placements, heartbeat_interval_s=config.heartbeat_interval_s,
                           master=(store.host, store.port), python=python,
                           threads=self._cpu_threads(names, extent.nelements // max(1, len(names))), preload=preload)
        cores = _cores()
        local = sum(1 for s in specs if ctrl.host_agents.is_local(s["host"]))
        if local > 2 * cores:  # a few procs per core is the workshop's normal; dozens thrash
            log.warning("%d procs on %d cores: expect slow steps (heavy imports run %d at a time)", local, cores, cores)
        records = [ProcRecord(s["identity"], name, s["rank"], dict(s["env"]["coords"]), s["host"], s) for s in specs]
        with ctrl.records_lock:
            for rec in records:
                ctrl.procs[rec.identity] = rec
            ctrl.meshes[name] = ProcMeshRecord(name, extent, [r.identity for r in records], supervision=SupervisionPolicy())
            self._stores[name] = store
        ctrl.channel.add_reader(store.fd, lambda _fd: self._start_store(store))
        for host in dict.fromkeys(names):
            batch = [s for s in specs if s["host"] == host]
            ctrl.channel.send(host, {"kind": Kind.SPAWN_PROCS}, json.dumps(batch).encode())
        self._wait_serving(name, records)
        if spares:
            for host in dict.fromkeys(names):
                self._keep_spares(host, name, next(s for s in specs if s["host"] == host), spares, preload)
        return name

    def _serving_host(self, host: str) -> str:
        """The name of ``host``, once it serves: a host lost a moment ago whose worker answers again
        (it is being attached again) is waited for, up to :func:`host_return_s`.

        Raises:
            ValueError: an unknown host.
            AttachError: the host is lost and did not come back in time.
        """
        hosts = self.ctrl.host_agents
        deadline = time.monotonic() + host_return_s()
        while True:
            try:
                return hosts.resolve(host).name
            except AttachError:
                if not hosts.reattaching(host) or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def _wait_serving(self, name: str, records: list[ProcRecord]) -> None:
        """Wait until every proc of the new mesh ``name`` serves. Procs of a host lost meanwhile
        (its agent died as the spawn went out) are started again once the host is attached again.

        Raises:
            AttachError: a host was lost and did not come back within :func:`host_return_s`.
            RuntimeError: a proc exited or did not say hello within ``start_timeout_s``, or the
                mesh was stopped meanwhile (by another thread).
        """
        deadline = time.monotonic() + config.start_timeout_s
        for rec in records:
            while not (rec.ready.wait(0.05) and rec.serving):
                if rec.state in (ProcState.STOPPING, ProcState.STOPPED):
                    raise RuntimeError(f"proc mesh {name} was stopped while its procs started")
                if rec.state == ProcState.FAILED and _lost_with_host(rec):
                    self._respawn_on_returned_host(name, rec.host, records)
                    continue
                if rec.state == ProcState.FAILED or time.monotonic() > deadline:
                    self.stop(name)
                    tail = "\n".join(rec.output_tail) or "(no output)"
                    why = f"exited ({rec.exit_info})" if rec.state == ProcState.FAILED else f"did not start within {config.start_timeout_s} s"
                    raise RuntimeError(f"proc {rec.identity} {why}; its output:\n{tail}")

    def _respawn_on_returned_host(self, name: str, host: str, records: list[ProcRecord]) -> None:
        """``host`` was lost while the procs of mesh ``name`` started there: wait for it to be
        attached again, then start them again (as restarts: same ranks, fresh processes).

        Raises:
            AttachError: it did not come back within :func:`host_return_s` (the mesh is stopped).
        """
        ctrl = self.ctrl
        record = ctrl.hosts.get(host)
        why = next((r.failure.detail for r in records if r.host == host and r.failure is not None), "host lost")
        deadline = time.monotonic() + host_return_s()
        while record is not None and record.state != ProcState.HEALTHY and time.monotonic() < deadline:
            time.sleep(0.05)
        if record is None or record.state != ProcState.HEALTHY:
            self.stop(name)
            raise AttachError(f"host {host} was lost while the procs of {name} started there ({why}) and was not "
                              f"attached again within {host_return_s():.0f} s; spawn again once it is back")
        again = [r for r in records if r.host == host and r.state == ProcState.FAILED]
        for rec in again:
            rec.move(ProcState.RESTARTING, "host returned")  # its hello respawns no actor (none yet) and tells its peers
            rec.restarts += 1
            rec.ready.clear()
            ctrl.record_event("proc_restarting", rec, detail=f"host {host} is back; starting it again", cause="host_returned")
        ctrl.channel.send(host, {"kind": Kind.SPAWN_PROCS}, json.dumps([r.spec for r in again]).encode())

    def _cpu_threads(self, hosts: list[str], per_host: int) -> dict[str, int]:
        """Host -> CPU threads for each of its procs: the cores of its machine shared by the procs of
        this mesh on that machine (``per_host`` on each of ``hosts``). Hosts on one machine (a local job, network namespaces) share its
        cores, however many agents they are: torch's default of one thread per core in every proc
        would oversubscribe it."""
        load = self._machine_load(hosts, per_host)
        return {h: max(1, cores // procs) for h, (procs, cores) in load.items()}

    def _machine_load(self, hosts: list[str], per_host: int) -> dict[str, tuple[int, int]]:
        """Host -> (procs of this mesh on its machine, cores of that machine)."""
        machines: dict[str, str] = {}
        cores: dict[str, int] = {}
        for host in set(hosts):
            record = self.ctrl.hosts.get(host)
            detail = record.detail if record is not None else {}
            machines[host] = str(detail.get("machine") or host)
            cores[host] = int(detail.get("cores") or _cores())
        per_machine: dict[str, int] = {}
        for host in hosts:
            per_machine[machines[host]] = per_machine.get(machines[host], 0) + per_host
        return {h: (per_machine[machines[h]], cores[h]) for h in set(hosts)}

    def procs_per_core(self, mesh: str) -> float:
        """The most procs of ``mesh`` per core on any of its machines (hosts on one machine share
        its cores): above 1, heavy imports take turns, and setting up every rank takes about that
        many times as long as one rank alone.

        Raises:
            ValueError: no such proc mesh.
        """
        record = self.ctrl.meshes.get(mesh)
        if record is None:
            raise ValueError(f"no proc mesh {mesh!r}; meshes: {sorted(self.ctrl.meshes)}")
        hosts = [self.ctrl.procs[i].host for i in record.procs if i in self.ctrl.procs]
        if not hosts:
            return 1.0
        distinct = list(dict.fromkeys(hosts))
        load = self._machine_load(distinct, max(1, len(hosts) // len(distinct)))
        return max(procs / max(1, cores) for procs, cores in load.values())

    def rendezvous_host(self, mesh: str) -> str:
        """The address of the controller's machine that every proc of ``mesh`` reaches.

        Raises:
            ValueError: no such proc mesh (or it was stopped).
        """
        store = self._stores.get(mesh)
        if store is None:
            raise ValueError(f"no proc mesh {mesh!r}; meshes: {sorted(self.ctrl.meshes)}")
        return store.host

    def _start_store(self, store: LazyStore) -> None:
        self.ctrl.channel.remove_reader(store.fd)
        store.start()

    def new_round(self, mesh: str) -> None:
        """The membership of ``mesh`` changed (a proc failed, or is killed to restart): a new
        rendezvous round, as torchrun starts one for every restart. ``env://`` meets on a fresh
        store from now on (one nobody used is kept: it holds no key), so a group formed again never
        reads a dead rank's address; live procs are told (``rendezvous``), restarts take it from
        their spec (``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``). The used store is closed:
        a survivor still waiting in it for the dead rank (``init_process_group`` of a group it
        was joining) is released at once instead of at the rendezvous timeout. IO thread or any."""
        ctrl = self.ctrl
        with ctrl.records_lock:
            record = ctrl.meshes.get(mesh)
            store = self._stores.get(mesh)
            if record is None or record.stopped or store is None:
                return
            record.rendezvous_round += 1
            if store.started:
                fresh = LazyStore(host=store.host)
                self._stores[mesh] = fresh
                ctrl.channel.add_reader(fresh.fd, lambda _fd: self._start_store(fresh))
                store.close()
                store = fresh
            recs = [ctrl.procs[i] for i in record.procs if i in ctrl.procs]
            for rec in recs:
                rec.spec["env"]["extra"].update(MASTER_PORT=str(store.port),
                                                TORCHELASTIC_RESTART_COUNT=str(record.rendezvous_round))
        header: RendezvousHeader = {"kind": Kind.RENDEZVOUS, "addr": store.host, "port": store.port, "round": record.rendezvous_round}
        ctrl.channel.send_many([rec.identity for rec in recs if rec.alive and rec.state != ProcState.RESTARTING],
                               header)  # one message a host where the procs are linked to their agents

    def _keep_spares(self, host: str, mesh: str, spec: dict, count: int, preload: Sequence[str]) -> None:
        """Ask ``host``'s agent to keep ``count`` warm spares for ``mesh`` (0: retire them)."""
        body = {"mesh": mesh, "count": count, "preload": list(preload), "base_env": spec.get("base_env"),
                "proc_env": spare_proc_env(spec["env"]), "cwd": spec.get("cwd"), "python": spec.get("python")}
        self.ctrl.channel.send(host, {"kind": Kind.KEEP_SPARES}, json.dumps(body).encode())

    def stop(self, mesh: str, timeout_s: float | None = None) -> None:
        """Stop the procs of ``mesh``: ask nicely, SIGKILL after ``stop_timeout_s``. Idempotent."""
        ctrl = self.ctrl
        record = ctrl.meshes.get(mesh)
        if record is None or record.stopped:
            return
        ctrl.stop_mesh_actors(mesh)
        record.stopped = True
        records = [ctrl.procs[i] for i in record.procs]
        for host in {r.host for r in records}:
            if ctrl.hosts.get(host, HostRecord(host)).spares.pop(mesh, None) is not None:
                self._keep_spares(host, mesh, records[0].spec, 0, ())
        for rec in records:
            if rec.alive:
                rec.move(ProcState.STOPPING, "stop")
                ctrl.channel.send(rec.identity, {"kind": Kind.STOP})
        deadline = time.monotonic() + (config.stop_timeout_s if timeout_s is None else timeout_s)
        while any(r.alive for r in records) and time.monotonic() < deadline:
            time.sleep(0.01)
        for rec in records:
            if rec.alive:
                ctrl.signal_proc(rec.identity, "SIGKILL")
        deadline = time.monotonic() + 5.0
        while any(r.alive for r in records) and time.monotonic() < deadline:
            time.sleep(0.01)
        ctrl.messenger.fail_calls_to({r.identity for r in records},
                                     lambda t: SupervisionError(t.rank, "stopped", "actor mesh is stopped due to proc mesh shutdown"))
        store = self._stores.pop(mesh, None)
        if store is not None:
            ctrl.channel.remove_reader(store.fd)
            store.close()

    def restart(self, rec: ProcRecord, timeout_s: float) -> None:
        """Restart the proc of ``rec`` in place (see :meth:`Controller.restart_proc`)."""
        self.ctrl.host_agents.resolve(rec.host)  # a lost host cannot start it: say so now, not after timeout_s
        if not rec.restart_lock.acquire(blocking=False):  # a restart is under way: it is the one
            self.ctrl.record_event("restart_skipped", rec, detail=f"already being restarted (restart {rec.restarts})",
                                   cause="restart")
            if not rec.restart_lock.acquire(timeout=timeout_s):
                raise TimeoutError(f"proc {rec.identity} did not come back within {timeout_s} s")
            rec.restart_lock.release()
            if not rec.serving:
                raise RuntimeError(f"proc {rec.identity} was restarted by someone else but is {rec.state}")
            return
        try:
            self._restart_locked(rec, timeout_s)
        finally:
            rec.restart_lock.release()

    def _restart_locked(self, rec: ProcRecord, timeout_s: float) -> None:
        ctrl = self.ctrl
        # a new rendezvous round for the group it will join (an unused store is kept: no cost)
        self.new_round(rec.mesh)
        if rec.state in (ProcState.HEALTHY, ProcState.BUSY, ProcState.HUNG, ProcState.STARTING):
            rec.fenced = rec.fenced or rec.state == ProcState.HUNG
            rec.move(ProcState.RESTARTING, "restart: killing the old incarnation")
            rec.restart_kill_pid = rec.pid
            ctrl.signal_proc(rec.identity, "SIGKILL")
            deadline = time.monotonic() + 5.0
            while rec.exit_info is None and time.monotonic() < deadline:
                time.sleep(0.005)
            ctrl.messenger.proc_failed(rec.identity, SupervisionError(rec.rank, "restarting", "the proc is being restarted"))
        rec.move(ProcState.RESTARTING, "restart")
        rec.restarts += 1
        rec.ready.clear()
        ctrl.record_event("proc_restarting", rec, detail=f"restart {rec.restarts}", cause="restart")
        ctrl.channel.send(rec.host, {"kind": Kind.SPAWN_PROCS}, json.dumps([rec.spec]).encode())
        deadline = time.monotonic() + timeout_s
        while not rec.ready.wait(0.05):
            if rec.state == ProcState.FAILED:  # the new incarnation died before it served
                tail = "\n".join(list(rec.output_tail)[-20:]) or "(no output)"
                raise RuntimeError(f"proc {rec.identity} died while restarting ({rec.exit_info}); its output:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"proc {rec.identity} did not come back within {timeout_s} s")
        if not rec.serving:  # busy: a heartbeat already saw an endpoint running
            raise RuntimeError(f"proc {rec.identity} restarted but is {rec.state}: {ctrl.events.events()[-1].detail}")


def host_return_s() -> float:
    """How long a spawn waits for a host lost a moment ago to be attached again (seconds): its
    loss is seen within the hang timeout, and the controller tries to attach it every second."""
    return max(5.0, 2 * config.hang_timeout_s + 2.0)


def _lost_with_host(rec: ProcRecord) -> bool:
    return rec.failure is not None and getattr(rec.failure, "cause", "") == "host_lost"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
