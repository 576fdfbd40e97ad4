"""The controller: root of the supervision tree, owner of every mesh, hub of the messages between hosts.

One per process that drives meshes (the notebook kernel, a script); it implements the actor
API's :class:`~monarch_nb.actor.backend.Backend` and installs itself when it starts. It binds a
ROUTER socket; host agents and procs connect to it. Messages between procs of different hosts
(an actor calling another actor) are forwarded here unchanged (still signed by their sender);
those between procs of one host go straight (:mod:`monarch_nb.transport.local_peers`). Incoming messages are
dispatched by kind (:class:`~monarch_nb.runtime.protocol.Kind`) from one table. The work is done
in rooms beside it: proc meshes are started, stopped and restarted by :mod:`.proc_meshes`, actor
meshes by :mod:`.actor_meshes`, hosts attached and lost by :mod:`.hosts`; liveness
(:mod:`.liveness`) turns hellos, heartbeats and exits into states and events, the supervisor
thread (:mod:`.supervisor`) applies policies. Each room takes not this class but a Protocol of
its own module naming what it uses of it (e.g. :class:`~.proc_meshes.ProcMeshesController`),
which mypy checks this class satisfies where it builds the room; what one room asks of another
goes through a method here that names the act (:meth:`Controller.stop_mesh_actors`,
:meth:`Controller.report_failure`, :meth:`Controller.fail_host_procs`,
:meth:`Controller.new_rendezvous_round`). The controller never exits or interrupts the main
thread because of a fault: it is a notebook kernel.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

from ..actor import backend
from ..actor.context import context as current_context
from ..actor.backend import Target
from ..actor.context import CLIENT_MESH
from ..actor.future import Future
from ..actor.shape import Extent
from ..actor.workspace import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES, WorkspaceSync
from ..config import config
from ..errors import MeshStoppedError, SupervisionError
from ..supervision.events import Event, EventLog
from ..supervision.policy import SupervisionPolicy
from ..supervision.records import ActorSpawn, HostRecord, ProcMeshRecord, ProcRecord, ProcTable, proc_identity
from ..supervision.tree import snapshot
from ..transport import shm
from ..transport.channel import Channel
from ..transport.wire import Header, Signer, route_id
from .actor_host import ActorHost
from .actor_meshes import LOCAL_PROC, ActorMeshes
from .hosts import Hosts
from .launch import RUN_DIR_PREFIX, sweep_stale_run_dirs
from .liveness import Liveness
from .messenger import Messenger
from .output import LineAssembler, OutputLine, deliver, print_output
from .protocol import (CONTROLLER, FAULT_KINDS, ActorErrorHeader, ActorFailedHeader, AgentHeartbeatHeader, AgentHelloHeader,
                       CallHeader, FaultFiredHeader, FaultHeader, Handler, HeartbeatFields, InterruptHeader, Kind, LogLevelHeader,
                       OutputHeader, ProcExitedHeader, ProcSpawnedHeader, ProcStacksHeader, QuietMember, SignalHeader, SparesHeader, validate_fault)
from .proc_meshes import ProcMeshes
from .supervisor import Supervisor
from .workspaces import Workspaces

__all__ = ["Controller", "OutputLine", "print_output"]

log = logging.getLogger(__name__)

class Controller:
    """Owns host agents, proc meshes and the event log. Use :meth:`get`; there is one per process.

    Attributes:
        events: the :class:`~monarch_nb.supervision.events.EventLog` of every supervision event.
        procs: proc identity -> :class:`~monarch_nb.supervision.records.ProcRecord`.
        meshes: proc mesh name -> :class:`~monarch_nb.supervision.records.ProcMeshRecord`.
        hosts: host agent name -> :class:`~monarch_nb.supervision.records.HostRecord`.
        records_lock: the lock guarding the records of ``procs`` and ``meshes`` while a room adds
            or renews them (a new mesh's name and records, a rendezvous round).
        host_agents: the :class:`~monarch_nb.runtime.hosts.Hosts` room: starts, attaches, loses
            and fences the host agents behind ``hosts``.
        output_sinks: callables given each :class:`~monarch_nb.runtime.output.OutputLine`.
    """

    _instance: "Controller | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> "Controller":
        """The running controller; started on first use (or after a shutdown)."""
        with cls._instance_lock:
            if cls._instance is None or cls._instance.closed:
                cls._instance = cls()
            return cls._instance

    @classmethod
    def existing(cls) -> "Controller | None":
        """The running controller, or None."""
        inst = cls._instance
        return inst if inst is not None and not inst.closed else None

    def __init__(self) -> None:
        self.config = config
        self.signer = Signer(secrets.token_bytes(32), sign_buffers=config.sign_buffers)
        sweep_stale_run_dirs()  # of controllers and agents killed before they could clean up
        shm.sweep_stale()
        self.run_dir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
        self.run_id = secrets.token_hex(8)
        same_host = config.transport != "tcp"
        self.channel = Channel(CONTROLLER, self.signer, self._on_message, router=True,
                               shm_run_id=self.run_id if same_host else None)
        if config.transport == "tcp":
            self.address = self.channel.bind(f"tcp://{config.bind_host}:0")
        else:
            self.address = self.channel.bind(f"ipc://{self.run_dir}/controller")
        self.messenger = Messenger(self.channel)
        self.local_host = ActorHost(LOCAL_PROC, CLIENT_MESH, 0, Extent({}), self.channel.send, self.messenger,
                                    self._from_local_host)
        self.messenger.local[LOCAL_PROC] = self.local_host.dispatch
        self.events = EventLog()
        self.procs = ProcTable()
        self.meshes: dict[str, ProcMeshRecord] = {}
        self.hosts: dict[str, HostRecord] = {}
        self.output_sinks: list[Callable[[OutputLine], None]] = [print_output]
        self._lines = LineAssembler()
        self.records_lock = threading.RLock()
        self._closed = False
        self.started_at = time.monotonic()
        self.host_agents = Hosts(self)
        self.liveness = Liveness(self)
        self.supervisor = Supervisor(self)
        self._handlers: dict[str, Handler] = {
            Kind.REPLY: self.messenger.on_reply,
            Kind.REPLIES: self.messenger.on_replies,
            Kind.HEARTBEAT: self._from_proc(self.liveness.on_heartbeat),
            Kind.HELLO: self._from_proc(self.liveness.on_hello),
            Kind.OUTPUT: self._on_output,
            Kind.PROC_SPAWNED: self._on_proc_spawned,
            Kind.PROC_EXITED: self._on_proc_exited,
            Kind.PROC_STACKS: self._on_proc_stacks,
            Kind.ACTOR_ERROR: self._from_proc(self._on_actor_error),
            Kind.FAULT_FIRED: self._from_proc(self._on_fault_fired),
            Kind.AGENT_HELLO: self._on_agent_hello,
            Kind.AGENT_HEARTBEAT: self._on_agent_heartbeat,
            Kind.AGENT_EXITING: lambda header, body, buffers: self.host_agents.on_agent_exiting(header),
            Kind.RELAY_READY: lambda header, body, buffers: self.host_agents.on_relay_ready(header),
            Kind.RELAY_UNREACHED: lambda header, body, buffers: self.host_agents.on_relay_unreached(header),
            Kind.SPARES: self._on_spares,
            Kind.PORT: self.messenger.on_port,
        }
        self.actor_meshes = ActorMeshes(self)
        self.proc_meshes = ProcMeshes(self)
        self.workspaces = Workspaces(self)
        self._handlers[Kind.WORKSPACE_SYNCED] = lambda header, body, buffers: self.workspaces.on_synced(header)
        self._handlers[Kind.ACTOR_FAILED] = self.actor_meshes.on_actor_failed
        self._handlers[Kind.CONTROL] = self.actor_meshes.on_control
        self.channel.every(config.heartbeat_interval_s, self._tick)
        self.channel.every(self._lines.quiet_s / 2, self._emit_quiet_lines)
        self.channel.start(name="monarch_nb-controller-io")
        backend.install(self)
        atexit.register(self.shutdown)

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` ran."""
        return self._closed

    # -- the actor API's backend -------------------------------------------------------------------
    def send(self, targets: Sequence[Target], actor: str, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any], *,
             extent: Extent | None, want_reply: bool = True, **how: Any) -> Any:
        return self.messenger.send(targets, actor, endpoint, args, kwargs, extent=extent, want_reply=want_reply, **how)

    def failure_of(self, proc: str) -> SupervisionError | None:
        return self.messenger.failure_of(proc)

    def mesh_stopped(self, mesh: str) -> bool:
        record = self.meshes.get(mesh)
        return record is not None and record.stopped

    def spawn_procs(self, hosts: list[str], extent: Extent, name: str | None = None, python: str = "", *,
                    spares: int = 0, preload: Sequence[str] = ()) -> str:
        """Start procs (see :meth:`HostMesh.spawn_procs` and :meth:`ProcMeshes.spawn`), owned by
        the calling actor or the client; return the mesh's name."""
        name = self.proc_meshes.spawn(hosts, extent, name, python, spares=spares, preload=preload)
        self.actor_meshes.own_procs(_caller_owner(), name)
        return name

    def attach_hosts(self, workers: list[str], ca: str | None = None) -> list[str]:
        """Attach the worker loops at ``workers``; return their host names (see :func:`attach_to_workers`)."""
        return self.host_agents.attach(list(workers), ca)

    def detach_hosts(self, names: list[str]) -> None:
        """Forget attached hosts whose job ended (see :meth:`monarch_nb.runtime.hosts.Hosts.detach`):
        host names, or the addresses of their workers (``tcp://HOST:PORT``; one not attached here is
        skipped). Proc meshes with procs on them are stopped first: their end is the job's, not a
        failure."""
        names = self.host_agents.named(list(names))
        gone = set(names)
        for mesh, record in list(self.meshes.items()):
            if not record.stopped and any(self.procs[i].host in gone for i in record.procs if i in self.procs):
                self.stop_procs(mesh)
        self.host_agents.detach(list(names))

    def sync_workspace(self, path: "str | os.PathLike[str]", *, hosts: Sequence[str] = (), mesh: str | None = None,
                       exclude: Sequence[str] | str | None = (),
                       max_bytes: int = DEFAULT_MAX_BYTES, auto_reload: bool = False, timeout_s: float = 60.0,
                       max_files: int = DEFAULT_MAX_FILES) -> WorkspaceSync:
        """Copy folder ``path`` to ``hosts`` (or to the hosts of proc mesh ``mesh``); with
        ``auto_reload``, the serving procs there (of ``mesh`` only, when given) reload their
        changed modules. See :class:`~.workspaces.Workspaces`."""
        if mesh is not None:
            procs = self.mesh_records(mesh)
            hosts = [rec.host for rec in procs]
        else:
            procs = list(self.procs.values())  # the room keeps those of the hosts it synced
        return self.workspaces.sync(list(hosts), path, exclude, max_bytes, timeout_s, procs if auto_reload else [], max_files)

    def resolve_host(self, host: str) -> HostRecord:
        """The record of serving host ``host`` (see :meth:`.hosts.Hosts.resolve`)."""
        return self.host_agents.resolve(host)

    def spawn_actors(self, mesh: str, ranks: list[int], name: str, cls: type, args: tuple, kwargs: dict,
                     spawn_extent: Extent | None = None) -> str:
        """Start constructing ``cls(*args, **kwargs)`` on ``ranks`` of proc mesh ``mesh`` (or on the
        client's own proc); return the actor mesh's id at once. The calling actor (or the client)
        owns it. See :class:`~monarch_nb.runtime.actor_meshes.ActorMeshes`.

        Raises:
            MeshStoppedError: the proc mesh was stopped.
        """
        inst = current_context().actor_instance
        extent = spawn_extent if spawn_extent is not None else Extent({"gpus": len(ranks)}) if len(ranks) > 1 else Extent({})
        return self.actor_meshes.spawn(mesh, ranks, name, cls, args, kwargs, extent, _caller_owner(), inst)

    def actor_initialized(self, actor_id: str) -> Future:
        return self.actor_meshes.initialized(actor_id)

    def stop_actors(self, actor_id: str) -> None:
        self.actor_meshes.stop(actor_id)

    def get_or_spawn_controller(self, name: str, cls: type, args: tuple, kwargs: dict) -> Future:
        return self.actor_meshes.get_or_spawn_controller(name, cls, args, kwargs)

    def set_log_level(self, mesh: str, level: int) -> None:
        for rec in self.mesh_records(mesh):
            if rec.alive:
                header: LogLevelHeader = {"kind": Kind.LOG_LEVEL, "level": int(level)}
                self.channel.send(rec.identity, header)

    def open_port(self, receiver: Any) -> tuple[str, str]:
        return self.messenger.open_port(receiver)

    def send_to_port(self, owner: str, port_id: str, ok: bool, value: Any, rank: int | None) -> None:
        self.messenger.send_to_port(owner, port_id, ok, value, rank)

    def stop_procs(self, mesh: str, timeout_s: float | None = None) -> None:
        """Stop the procs of ``mesh``: ask nicely, SIGKILL after ``stop_timeout_s``. Idempotent."""
        self.proc_meshes.stop(mesh, timeout_s)

    def restart_proc(self, mesh: str, rank: int, timeout_s: float = 30.0) -> None:
        """Restart one proc in place: same rank and coordinates, new pid, its actors respawned
        with their constructor arguments. Blocks until it serves again.

        Raises:
            ValueError: no such mesh or rank.
            MeshStoppedError: its mesh was stopped.
            AttachError: its host is lost (retry once the host is back: ``host_returned`` event).
            TimeoutError: it did not come back within ``timeout_s``.
            RuntimeError: it came back but an actor constructor failed, or it died meanwhile.
        """
        rec = self.proc_record(mesh, rank)
        self._mesh(rec.mesh)
        self.proc_meshes.restart(rec, timeout_s)

    def supervise(self, mesh: str, policy: SupervisionPolicy) -> SupervisionPolicy:
        """Make ``policy`` the supervision policy of proc mesh ``mesh`` (see :meth:`ProcMesh.supervise`)."""
        self._mesh(mesh).supervision = policy
        return policy

    def tree(self, mesh: str | None = None, ranks: set[int] | None = None) -> dict:
        """The supervision tree as plain data (see :func:`monarch_nb.supervision.tree.snapshot`)."""
        return snapshot(self.hosts.values(), self.meshes, self.procs, closed=self._closed,
                        started_at=self.started_at, mesh=mesh, ranks=ranks)

    def inject(self, mesh: str, rank: int, kind: str, params: dict) -> Event:
        """Make fault ``kind`` happen on one proc; records ``fault_injected`` first (see
        :meth:`ProcMesh.inject`).

        Raises:
            ValueError: a bad kind or params, or no such rank.
            RuntimeError: the proc is not serving (dead, stopped, restarting).
        """
        params = validate_fault(kind, params)
        rec = self.proc_record(mesh, rank)
        if not rec.serving:
            raise RuntimeError(f"rank {rank} of {mesh!r} is {rec.state}; faults go to live procs (restart it first)")
        detail = f"{kind} {params}" if params else kind
        event = self.record_event("fault_injected", rec, detail=detail, cause=kind)
        signame = FAULT_KINDS[kind].signal
        if signame is not None:
            self.signal_proc(rec.identity, signame)
        else:
            header: FaultHeader = {"kind": Kind.FAULT, "fault": kind, "params": params}
            self.channel.send(rec.identity, header)
        return event

    def clear_faults(self, mesh: str, rank: int) -> None:
        """Disarm the in-proc faults (raise, slow, nan) still pending on rank ``rank`` of ``mesh``."""
        rec = self.proc_record(mesh, rank)
        if rec.alive:
            header: FaultHeader = {"kind": Kind.FAULT, "fault": "clear", "params": {}}
            self.channel.send(rec.identity, header)

    def interrupt(self, mesh: str, rank: int, actor: str) -> None:
        """Interrupt the endpoint that ``actor`` runs on rank ``rank`` of ``mesh`` (its ``__interrupt__``)."""
        rec = self.proc_record(mesh, rank)
        if rec.alive:
            header: InterruptHeader = {"kind": Kind.INTERRUPT, "actor": actor}
            self.channel.send(rec.identity, header)

    # -- for features: records, events, signals -----------------------------------------------------
    def rendezvous_host(self, mesh: str) -> str:
        """The address of this machine that every proc of ``mesh`` reaches (its ``MASTER_ADDR``):
        127.0.0.1 on this machine alone, the controller's address on the cluster's network when
        the mesh spans attached hosts.

        Raises:
            ValueError: no such proc mesh.
        """
        return self.proc_meshes.rendezvous_host(mesh)

    def new_rendezvous_round(self, mesh: str) -> None:
        """Give ``mesh``'s procs a fresh rendezvous store (``MASTER_PORT``) before they form a
        process group again, as torchrun does for each restart (see
        :meth:`.proc_meshes.ProcMeshes.new_round`); a no-op for a stopped or unknown mesh."""
        self.proc_meshes.new_round(mesh)

    def procs_per_core(self, mesh: str) -> float:
        """See :meth:`.proc_meshes.ProcMeshes.procs_per_core`."""
        return self.proc_meshes.procs_per_core(mesh)

    def set_replica_groups(self, mesh: str, group_size: int) -> None:
        """Mark ``mesh``'s ranks as replica groups of ``group_size`` consecutive ranks (a sharded
        training run): the supervision tree then gives each proc its ``group``.

        Raises:
            ValueError: no such mesh, or ``group_size`` does not divide its procs.
        """
        record = self._mesh(mesh)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or len(record.procs) % group_size:
            raise ValueError(f"group_size {group_size!r} must be a positive divisor of the {len(record.procs)} procs of {mesh!r}")
        record.replica_group_size = group_size

    def proc_record(self, mesh: str, rank: int) -> ProcRecord:
        """The record of rank ``rank`` of proc mesh ``mesh``.

        Raises:
            ValueError: no such mesh or rank (the message gives the valid range).
        """
        record = self.meshes.get(mesh)
        if record is None:
            raise ValueError(f"no proc mesh {mesh!r}; meshes: {sorted(self.meshes)}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(record.procs):
            raise ValueError(f"rank {rank!r} is not in proc mesh {mesh!r}: valid ranks are 0..{len(record.procs) - 1}")
        return self.procs[record.procs[rank]]

    def pids(self) -> list[int]:
        """The pids of every proc and host agent this controller started (for leak checks)."""
        return sorted({rec.pid for rec in self.procs.values() if rec.pid} | {h.pid for h in self.hosts.values() if h.pid})

    def mesh_records(self, mesh: str) -> list[ProcRecord]:
        """The records of proc mesh ``mesh``'s procs, in rank order.

        Raises:
            ValueError: no such mesh.
        """
        record = self.meshes.get(mesh)
        if record is None:
            raise ValueError(f"no proc mesh {mesh!r}; meshes: {sorted(self.meshes)}")
        return [self.procs[i] for i in record.procs]

    def record_host_event(self, kind: str, host: HostRecord, **fields: Any) -> Event:
        """Append an event about host agent ``host`` (``host_lost``, ``host_returned``)."""
        return self.events.append(Event(kind, pid=host.pid, host=host.name, **fields))

    def record_event(self, kind: str, rec: ProcRecord, **fields: Any) -> Event:
        """Append an event about ``rec``'s proc to the log (see :data:`~monarch_nb.supervision.events.EVENT_KINDS`)."""
        return self.events.append(Event(kind, rank=rec.rank, coords=rec.coords, pid=rec.pid, mesh=rec.mesh, host=rec.host,
                                        **fields))

    def signal_proc(self, identity: str, signame: str, *, stacks_first: bool = False) -> None:
        """Have the proc's host agent send it ``signame`` (``"SIGKILL"``, ``"SIGSTOP"``, ...);
        ``stacks_first``: a SIGKILL that fences a hung proc, its Python stacks taken first
        (:meth:`_on_proc_stacks`; the kill waits for them up to
        :data:`~.host_agent.HUNG_STACKS_TIMEOUT_S`)."""
        rec = self.procs[route_id(identity)]
        header: SignalHeader = {"kind": Kind.SIGNAL, "proc": rec.identity, "signal": signame}
        if stacks_first:
            header["stacks_first"] = True
        self.channel.send(rec.host, header)

    def send_request(self, rec: ProcRecord, kind: Kind, body: bytes, buffers: list, op: str) -> Future:
        """Send a request of a plugin's ``kind`` (e.g. ``Kind.DEBUG``) to ``rec``'s proc; a Future
        of its reply, failed with SupervisionError if the proc dies first."""
        future = self.messenger.send_raw([self.target(rec.mesh, rec.rank)], kind, "", body, buffers,
                                         extent=None, endpoint=op)
        assert future is not None
        return future

    def emit_lines(self, rec: ProcRecord | None, stream: str, lines: list[str], *, mesh: str = "", rank: int = -1,
                   partial: bool = False) -> None:
        """Hand ``lines`` of ``rec``'s proc (or of mesh/rank when no record is known) to every sink;
        ``partial``: the current content of an unfinished line (see :mod:`.output`)."""
        if rec is not None:
            mesh, rank = rec.mesh, rec.rank
        for text in lines:
            if rec is not None and not partial:
                rec.output_tail.append(text)
            deliver(self.output_sinks, OutputLine(mesh, rank, stream, text, partial),
                    lambda sink: log.exception("output sink %r failed", sink))

    def flush_output(self, rec: ProcRecord) -> None:
        """Emit the partial lines ``rec``'s proc left unterminated (it exited)."""
        for stream in ("stdout", "stderr"):
            self.emit_lines(rec, stream, self._lines.flush((rec.identity, stream)))

    def respawn_actors(self, rec: ProcRecord) -> list[Future]:
        """Construct every actor of ``rec``'s rank again (a restarted proc); one Future each."""
        spawns = [s for s in self.meshes[rec.mesh].actors if rec.rank in s.ranks]
        target = Target(rec.identity, rec.rank, rec.coords)
        return [self._send_spawn([target], s, None, even_if_failed=True) for s in spawns]

    # -- for the rooms: what one room asks of another ------------------------------------------------
    def stop_mesh_actors(self, mesh: str) -> None:
        """Proc mesh ``mesh`` is stopping: what its actors own stops first, its actors are marked
        stopped (see :meth:`.actor_meshes.ActorMeshes.before_stop_procs`)."""
        self.actor_meshes.before_stop_procs(mesh)

    def report_failure(self, rec: ProcRecord, cause: str, detail: str, signame: str | None, *, handle: bool = True) -> None:
        """Hand ``rec``'s failure to the supervisor thread; not ``handle``: recorded only (see
        :meth:`.supervisor.Supervisor.on_failure`). Any thread, never blocks."""
        self.supervisor.on_failure(rec, cause, detail, signame, handle=handle)

    def fail_host_procs(self, host: str, why: str) -> None:
        """Host ``host`` is lost: every proc of it fails with cause ``host_lost`` (see
        :meth:`.liveness.Liveness.host_lost`)."""
        self.liveness.host_lost(host, why)

    def target(self, mesh: str, rank: int) -> Target:
        """Where a message to rank ``rank`` of proc mesh ``mesh`` goes (its proc's identity and coordinates)."""
        rec = self.procs[proc_identity(mesh, rank)]
        return Target(rec.identity, rec.rank, dict(rec.coords))

    # -- internals ------------------------------------------------------------------------------------
    def _mesh(self, name: str) -> ProcMeshRecord:
        mesh = self.meshes.get(name)
        if mesh is None:
            raise KeyError(f"no proc mesh {name!r}")
        if mesh.stopped:
            raise MeshStoppedError(f"proc mesh {name!r} was stopped; spawn a new one with this_host().spawn_procs(...)")
        return mesh

    def _send_spawn(self, targets: list[Target], spawn: ActorSpawn, extent: Extent | None, even_if_failed: bool = False) -> Future:
        future = self.messenger.send_raw(
            targets, Kind.SPAWN, spawn.name, spawn.body, spawn.buffers, extent=extent, even_if_failed=even_if_failed
        )
        assert future is not None
        return future

    def _tick(self) -> None:
        self.host_agents.tick()  # first: a silent host fails its procs as host_lost, not one by one as hung
        self.liveness.check_heartbeats()

    # -- incoming messages (IO thread) ---------------------------------------------------------------
    def _on_message(self, header: Header, body: memoryview, buffers: list[memoryview], frames: list[Any]) -> None:
        if header["dst"] != CONTROLLER:
            if header["dst"] == LOCAL_PROC:  # an actor hosted in this process: a CALL, SPAWN, ...
                self.local_host.dispatch(cast(CallHeader, header), body, buffers)
            else:
                self.channel.forward(header["dst"], frames)
            return
        handler = self._handlers.get(header["kind"])
        if handler is None:
            log.warning("unknown message kind %r from %s", header["kind"], header["src"])
            return
        handler(header, body, buffers)

    def _from_proc(self, fn: Callable[[ProcRecord, Any], None]) -> Handler:
        """A handler for messages a proc sends about itself (its record found from ``src``)."""
        def handle(header: Header, body: Any, buffers: list[memoryview]) -> None:
            rec = self.procs.get(route_id(header["src"]))
            if rec is not None:
                fn(rec, header)
        return handle

    def _on_output(self, header: OutputHeader, body: Any, buffers: list[memoryview]) -> None:
        rec = self.procs.get(route_id(header["proc"]))
        key = (header["proc"], header["stream"])
        lines = self._lines.feed(key, bytes(body))
        self.emit_lines(rec, header["stream"], lines, rank=header["rank"])
        redrawn = self._lines.redrawn(key)
        if redrawn is not None and rec is not None:
            self.emit_lines(rec, header["stream"], [redrawn], partial=True)

    def _emit_quiet_lines(self) -> None:
        """Unfinished lines that stopped changing (IO thread timer): hand them out as partial."""
        for (proc, stream), text in self._lines.quiet():
            rec = self.procs.get(route_id(proc))
            if rec is not None:
                self.emit_lines(rec, stream, [text], partial=True)

    def _on_proc_spawned(self, header: ProcSpawnedHeader, body: Any, buffers: list[memoryview]) -> None:
        rec = self.procs.get(route_id(header["proc"]))
        if rec is not None:
            rec.pid = header["pid"]
            rec.on_spare = bool(header.get("spare"))

    def _on_proc_stacks(self, header: ProcStacksHeader, body: Any, buffers: list[memoryview]) -> None:
        """A hung proc's Python stacks, taken by its agent just before the fencing SIGKILL: kept on
        its record (:attr:`ProcRecord.hung_stacks`, what ``%mesh stack`` shows while it is dead)
        and written where its output goes, as its stderr, as faulthandler's own dumps are."""
        rec = self.procs.get(route_id(header["proc"]))
        if rec is None or rec.pid != header["pid"]:
            return  # another incarnation's
        try:
            stacks = json.loads(bytes(body))
            if not isinstance(stacks, dict):
                raise ValueError(f"not a dict: {type(stacks).__name__}")
        except ValueError as exc:
            log.warning("dropped the stacks of hung proc %s: %s", rec.identity, exc)
            return
        rec.hung_stacks = stacks
        text = stacks.get("text") if stacks.get("source") == "faulthandler" else None
        said = str(text).rstrip().splitlines() if text else [f"  (none: {stacks.get('why', 'no dump')})"]
        self.emit_lines(rec, "stderr", [f"[monarch_nb] rank {rec.rank} (pid {rec.pid}) was judged hung; its Python "
                                        f"stacks before it was fenced (most recent call first):", *said])

    def _on_agent_heartbeat(self, header: AgentHeartbeatHeader, body: Any, buffers: list[memoryview]) -> None:
        name = route_id(header["src"])
        host = self.host_agents.on_heartbeat(name, header.get("load", 0.0), left=header.get("relay_left", ""))
        if host is not None:
            self._host_heard(host, header.get("stopped", ()), header.get("heard", ()), header.get("changed", {}))
        for entry in header.get("members", ()):  # a relay's: the heartbeats of its members (monarch_nb.runtime.relay)
            try:
                member = self.host_agents.on_heartbeat(route_id(entry["src"]), entry["load"], via=name)
                if member is not None:
                    self._host_heard(member, entry["stopped"], entry["heard"], entry["changed"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # one bad entry costs only itself
                log.warning("dropped a malformed relayed heartbeat from %s: %r", name, exc)
        quiet_rows = header.get("quiet")
        if quiet_rows:  # ... and those with nothing new to say: all their procs heard (~2,000 a second at 1,024 idle hosts)
            now, on_heartbeat, heard_all = time.monotonic(), self.host_agents.on_heartbeat, self.liveness.on_host_heard_all
            for row in quiet_rows:
                try:
                    quiet = QuietMember.from_wire(row)
                except (TypeError, ValueError) as exc:
                    log.warning("dropped a malformed relayed heartbeat from %s: %r", name, exc)
                    continue
                member = on_heartbeat(route_id(quiet.src), quiet.load, via=name, now=now)
                if member is not None:
                    if member.stopped:
                        self._host_heard(member, (), (), {})
                    heard_all(member.name, quiet.procs, now)

    def _host_heard(self, host: HostRecord, stopped_procs: Iterable[str], heard: Iterable[str],
                    changed: Mapping[str, HeartbeatFields]) -> None:
        """What a host agent's heartbeat says of its procs: stopped ones, and those heard."""
        stopped = frozenset(stopped_procs)
        for identity in stopped ^ host.stopped:  # only what changed: not every proc per host heartbeat
            rec = self.procs.get(route_id(identity))
            if rec is not None and rec.host == host.name:
                rec.os_stopped = identity in stopped
        host.stopped = stopped
        self.liveness.on_host_heartbeats(host.name, heard, changed)

    def _on_spares(self, header: SparesHeader, body: Any, buffers: list[memoryview]) -> None:
        host = self.hosts.get(route_id(header["src"]))
        if host is not None and not self.mesh_stopped(header["mesh"]):
            host.spares[header["mesh"]] = list(header["spares"])

    def _on_proc_exited(self, header: ProcExitedHeader, body: Any, buffers: list[memoryview]) -> None:
        rec = self.procs.get(route_id(header["proc"]))
        if rec is not None:
            self.liveness.on_exit(rec, header)

    def _on_actor_error(self, rec: ProcRecord, header: ActorErrorHeader) -> None:
        self.record_event("actor_error", rec, detail=header.get("detail", ""), cause="exception")

    def _on_fault_fired(self, rec: ProcRecord, header: FaultFiredHeader) -> None:
        self.record_event("fault_fired", rec, detail=header.get("detail", ""), cause=header.get("fault", ""))

    def _on_agent_hello(self, header: AgentHelloHeader, body: Any, buffers: list[memoryview]) -> None:
        self.host_agents.on_hello(header)
        self.workspaces.on_agent_hello(route_id(header["src"]))

    # -- actors' requests (the client's own proc, and control requests from procs) ------------------
    def _from_local_host(self, header: Header, body: bytes) -> None:
        """A message the client's own proc sends "to the controller": handled here, no socket."""
        header["src"], header["dst"] = LOCAL_PROC, CONTROLLER
        if header["kind"] == Kind.ACTOR_FAILED:
            self.actor_meshes.on_actor_failed(cast(ActorFailedHeader, header), body, [])  # its kind says so

    # -- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every mesh and host agent, close the socket, remove the run folder. Runs at
        interpreter exit; idempotent."""
        if self._closed:
            return
        for name in list(self.meshes):
            try:
                self.stop_procs(name, timeout_s=2.0)
            except Exception:
                log.exception("stopping %s failed", name)
        self.host_agents.shutdown()
        self.local_host.stop_all(timeout_s=2.0)
        self.actor_meshes.close()
        self._closed = True
        self.supervisor.close()
        self.channel.close()
        shm.remove_orphans(self.run_id)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if backend.existing() is self:
            backend.install(None)


def _caller_owner() -> tuple | None:
    """The owner of what the calling code spawns: the client-hosted actor running it, or the client."""
    inst = current_context().actor_instance
    return (LOCAL_PROC, inst.mesh_id) if inst.class_name else None
