"""The controller: root of the supervision tree, owner of every mesh, hub of all messages.

One per process that drives meshes (the notebook kernel, a script). It binds a ROUTER socket;
host agents and procs connect to it. Messages between procs (an actor calling another actor) are
forwarded here unchanged (still signed by their sender). The controller learns of proc exits from
host agents, of hangs from missing heartbeats, of endpoint errors from procs, and records each as
an :class:`~monarch_nb.supervision.events.Event`. It never exits or interrupts the main thread
because of a fault: it is a notebook kernel.
"""

from __future__ import annotations

import atexit
import codecs
import collections
import itertools
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..actor.mesh import ActorMesh, ProcMesh, proc_identity
from ..actor.shape import Extent
from ..config import config
from ..errors import MeshStoppedError, SupervisionError
from ..supervision.events import Event, EventLog
from ..supervision.policy import SupervisionPolicy, Supervisor
from ..transport import shm
from ..transport.channel import Channel, route_id
from ..transport.serialization import dumps
from ..transport.wire import Signer
from . import messenger as messenger_mod
from .messenger import Messenger, Target

__all__ = ["Controller", "ProcRecord", "OutputLine"]

log = logging.getLogger(__name__)

IDENTITY = "ctrl"


@dataclass
class OutputLine:
    """One line a proc wrote. ``stream`` is "stdout" or "stderr"; ``text`` has no newline."""

    mesh: str
    rank: int
    stream: str
    text: str


@dataclass
class ProcRecord:
    """What the controller knows of one proc: a node of the supervision tree."""

    identity: str
    mesh: str
    rank: int
    coords: dict
    host: str
    spec: dict
    state: str = "starting"  # starting, healthy, busy, hung, failed, restarting, stopping, stopped
    pid: int = 0
    restarts: int = 0
    last_heartbeat: float = 0.0
    busy: dict = field(default_factory=dict)
    output_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    exit_info: dict | None = None
    fenced: bool = False
    loading: list = field(default_factory=list)  # heavy imports in progress (GIL held): see import_grace
    restart_kill_pid: int = 0  # the pid restart_proc killed on purpose: its exit is no failure
    paused: list = field(default_factory=list)  # breakpoint() sessions holding its actors (debugger)
    ready: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0  # monotonic time of this incarnation's hello
    failure: Any = None  # the supervision Failure of this incarnation, once it failed

    @property
    def alive(self) -> bool:
        return self.state in ("starting", "healthy", "busy", "hung", "restarting", "stopping")


@dataclass
class ActorSpawn:
    """How an actor mesh was built, kept to respawn it on a restarted proc."""

    name: str
    cls: type
    body: bytes
    buffers: list
    ranks: list[int]


@dataclass
class ProcMeshRecord:
    name: str
    extent: Extent
    procs: list[str]
    actors: list[ActorSpawn] = field(default_factory=list)
    stopped: bool = False
    supervision: SupervisionPolicy = field(default_factory=SupervisionPolicy)


@dataclass
class AgentRecord:
    name: str
    popen: subprocess.Popen | None
    ready: threading.Event = field(default_factory=threading.Event)
    pid: int = 0
    started_at: float = field(default_factory=time.monotonic)


class _LineAssembler:
    """Turns (proc, stream) byte chunks into whole lines, decoding UTF-8 across chunk edges."""

    def __init__(self) -> None:
        self._decoders: dict = {}
        self._partial: dict = {}

    def feed(self, key: tuple, data: bytes) -> list[str]:
        decoder = self._decoders.setdefault(key, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        text = self._partial.pop(key, "") + decoder.decode(data)
        lines = text.split("\n")
        if lines[-1]:
            self._partial[key] = lines[-1]
        return lines[:-1]

    def flush(self, key: tuple) -> list[str]:
        decoder = self._decoders.pop(key, None)
        rest = self._partial.pop(key, "") + (decoder.decode(b"", final=True) if decoder else "")
        return [rest] if rest else []


def print_output(line: OutputLine) -> None:
    """Default output sink: ``[rank] text`` on the controller's stdout or stderr."""
    stream = sys.stderr if line.stream == "stderr" else sys.stdout
    print(f"[{line.rank}] {line.text}", file=stream, flush=True)


class Controller:
    """Owns host agents, proc meshes and the event log. Use :meth:`get`; there is one per process."""

    _instance: "Controller | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> "Controller":
        with cls._instance_lock:
            if cls._instance is None or cls._instance._closed:
                cls._instance = cls()
            return cls._instance

    @classmethod
    def existing(cls) -> "Controller | None":
        inst = cls._instance
        return inst if inst is not None and not inst._closed else None

    def __init__(self) -> None:
        self.config = config
        self.signer = Signer(secrets.token_bytes(32), sign_buffers=config.sign_buffers)
        self.run_dir = tempfile.mkdtemp(prefix="monarch_nb-")
        self.run_id = secrets.token_hex(8)
        same_host = config.transport != "tcp"
        self.channel = Channel(IDENTITY, self.signer, self._on_message, router=True, shm_run_id=self.run_id if same_host else None)
        if config.transport == "tcp":
            self.address = self.channel.bind(f"tcp://{config.bind_host}:0")
        else:
            self.address = self.channel.bind(f"ipc://{self.run_dir}/controller")
        self.messenger = Messenger(self.channel)
        self.messenger.stopped_meshes = set()  # type: ignore[attr-defined]
        messenger_mod.install(self.messenger)
        self.events = EventLog()
        self.procs: dict[str, ProcRecord] = {}
        self.meshes: dict[str, ProcMeshRecord] = {}
        self.agents: dict[str, AgentRecord] = {}
        self.output_sinks: list[Callable[[OutputLine], None]] = [print_output]
        self._lines = _LineAssembler()
        self._mesh_ids = itertools.count()
        self._lock = threading.RLock()
        self._closed = False
        self.started_at = time.monotonic()
        self.supervisor = Supervisor(self)
        self.channel.every(config.heartbeat_interval_s, self._check_heartbeats)
        self.channel.start(name="monarch_nb-controller-io")
        atexit.register(self.shutdown)

    # -- host agents ------------------------------------------------------------------------------
    def _agent(self, host: str) -> AgentRecord:
        if host not in ("localhost", "127.0.0.1"):
            raise ValueError(f"host {host!r}: only the local host is supported here; start remote hosts with `monarch-nb host`")
        name = "host0"
        with self._lock:
            agent = self.agents.get(name)
            if agent is not None and agent.popen is not None and agent.popen.poll() is None:
                return agent
            env = dict(os.environ)
            env.update(
                MONARCH_NB_KEY=self.signer._key.hex(),
                MONARCH_NB_CONTROLLER=self.address,
                MONARCH_NB_CONTROLLER_PID=str(os.getpid()),
                MONARCH_NB_RUN_ID=self.run_id if self.channel.shm_run_id else "",
                MONARCH_NB_ORPHAN_CHECK_S=str(config.orphan_check_s),
                PYTHONPATH=os.pathsep.join(p for p in [_package_root(), env.get("PYTHONPATH", "")] if p),
            )
            popen = subprocess.Popen(
                [sys.executable, "-m", "monarch_nb.runtime.host_agent", name],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            agent = self.agents[name] = AgentRecord(name, popen)
        if not agent.ready.wait(config.start_timeout_s):
            raise RuntimeError(f"host agent {name} did not connect within {config.start_timeout_s} s")
        return agent

    # -- procs ------------------------------------------------------------------------------------
    def spawn_procs(self, hosts: list[str], extent: Extent, *, name: str | None = None) -> ProcMesh:
        """Start ``extent.nelements`` procs (see :meth:`HostMesh.spawn_procs`)."""
        from .. import device

        with self._lock:
            if name is None:
                name = f"pm{next(self._mesh_ids)}"
                while name in self.meshes:
                    name = f"pm{next(self._mesh_ids)}"
            elif not name.isidentifier() or name in self.meshes:
                raise ValueError(f"proc mesh name {name!r} must be a new identifier")
        agent = self._agent(hosts[0])
        world = extent.nelements
        per_host = world // max(1, len(hosts))
        inventory = device.detect_gpus()
        specs = []
        records = []
        for point in extent.points():
            identity = proc_identity(name, point.rank)
            local_rank = point.rank % per_host
            env = {
                "RANK": str(point.rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(per_host),
                "MONARCH_NB_COORDS": json.dumps(dict(point)),
                "MONARCH_NB_EXTENT": json.dumps(dict(extent)),
                "MONARCH_NB_CONTROLLER": self.address,
                "MONARCH_NB_HEARTBEAT_INTERVAL_S": str(config.heartbeat_interval_s),
                "MONARCH_NB_SYS_PATH": json.dumps([p for p in sys.path if p]),
                **device.visibility_env(local_rank, inventory),
            }
            spec = {"identity": identity, "rank": point.rank, "env": env, "cwd": os.getcwd()}
            specs.append(spec)
            records.append(ProcRecord(identity, name, point.rank, dict(point), agent.name, spec))
        with self._lock:
            for rec in records:
                self.procs[identity_key(rec.identity)] = rec
            self.meshes[name] = ProcMeshRecord(name, extent, [r.identity for r in records])
        self.channel.send(agent.name, {"kind": "spawn_procs"}, json.dumps(specs).encode())
        deadline = time.monotonic() + config.start_timeout_s
        for rec in records:
            while not rec.ready.wait(0.05):
                if rec.state == "failed" or time.monotonic() > deadline:
                    self.stop_procs(name)
                    tail = "\n".join(rec.output_tail) or "(no output)"
                    why = f"exited ({rec.exit_info})" if rec.state == "failed" else f"did not start within {config.start_timeout_s} s"
                    raise RuntimeError(f"proc {rec.identity} {why}; its output:\n{tail}")
        return ProcMesh(name, extent)

    def spawn_actors(self, procs: ProcMesh, name: str, cls: type, args: tuple, kwargs: dict) -> ActorMesh:
        from ..actor.endpoint import EndpointProperty

        if not isinstance(name, str) or not name:
            raise ValueError("an actor mesh needs a non-empty name")
        mesh = self._mesh(procs.name)
        if any(a.name == name for a in mesh.actors):
            raise ValueError(f"an actor mesh named {name!r} already lives on proc mesh {procs.name!r}; pick another name")
        EndpointProperty(cls.__init__).check_arguments(cls.__name__, args, kwargs)
        ranks = list(procs._shape.ranks)
        body, buffers = dumps((cls, args, kwargs, procs.extent, ranks))
        spawn = ActorSpawn(name, cls, body, buffers, ranks)
        mesh.actors.append(spawn)
        targets = [Target(proc_identity(procs.name, r), r, dict(mesh.extent.point(r))) for r in ranks]
        future = self._send_spawn(targets, spawn, procs.extent)
        try:
            future.get()
        except BaseException:
            mesh.actors.remove(spawn)
            raise
        return ActorMesh(name, cls, procs.name, mesh.extent, procs._shape)

    def _send_spawn(self, targets: list[Target], spawn: ActorSpawn, extent: Extent | None, even_if_failed: bool = False):
        return self.messenger.send_raw(
            targets, "spawn", spawn.name, spawn.body, spawn.buffers, extent=extent, even_if_failed=even_if_failed
        )

    def _mesh(self, name: str) -> ProcMeshRecord:
        mesh = self.meshes.get(name)
        if mesh is None:
            raise KeyError(f"no proc mesh {name!r}")
        if mesh.stopped:
            raise MeshStoppedError(f"proc mesh {name!r} was stopped; spawn a new one with this_host().spawn_procs(...)")
        return mesh

    def stop_procs(self, name: str, timeout_s: float | None = None) -> None:
        """Stop the procs of mesh ``name``: ask nicely, SIGKILL after ``stop_timeout_s``. Idempotent."""
        mesh = self.meshes.get(name)
        if mesh is None or mesh.stopped:
            return
        mesh.stopped = True
        self.messenger.stopped_meshes.add(name)  # type: ignore[attr-defined]
        records = [self.procs[identity_key(i)] for i in mesh.procs]
        for rec in records:
            if rec.alive:
                rec.state = "stopping"
                self.channel.send(rec.identity, {"kind": "stop"})
        deadline = time.monotonic() + (config.stop_timeout_s if timeout_s is None else timeout_s)
        while any(r.alive for r in records) and time.monotonic() < deadline:
            time.sleep(0.01)
        for rec in records:
            if rec.alive:
                self.signal_proc(rec.identity, "SIGKILL")
        deadline = time.monotonic() + 5.0
        while any(r.alive for r in records) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.messenger.fail_all(lambda t: SupervisionError(t.rank, "stopped", "the proc mesh was stopped"))

    def signal_proc(self, identity: str, signame: str) -> None:
        rec = self.procs[identity_key(identity)]
        self.channel.send(rec.host, {"kind": "signal", "proc": rec.identity, "signal": signame})

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
        return self.procs[identity_key(record.procs[rank])]

    def inject_fault(self, mesh: str, rank: int, kind: str, params: dict, signal: str | None) -> Event:
        """Make fault ``kind`` happen on one proc (see :mod:`monarch_nb.faults.inject`)."""
        rec = self.proc_record(mesh, rank)
        if rec.state not in ("healthy", "busy"):
            raise RuntimeError(f"rank {rank} of {mesh!r} is {rec.state}; faults go to live procs (restart it first)")
        detail = f"{kind} {params}" if params else kind
        event = self._event("fault_injected", rec, detail=detail, cause=kind)
        if signal is not None:
            self.signal_proc(rec.identity, signal)
        else:
            self.channel.send(rec.identity, {"kind": "fault", "fault": kind, "params": params})
        return event

    def tree(self, mesh: str | None = None, ranks: set[int] | None = None) -> dict:
        """The supervision tree as plain data (see :func:`monarch_nb.supervision.tree.snapshot`)."""
        from ..supervision.tree import snapshot

        return snapshot(self, mesh, ranks)

    def supervise(self, mesh: str, policy: SupervisionPolicy) -> SupervisionPolicy:
        """Make ``policy`` the supervision policy of proc mesh ``mesh`` (see :meth:`ProcMesh.supervise`)."""
        self._mesh(mesh).supervision = policy
        return policy

    # -- incoming messages (IO thread) -------------------------------------------------------------
    def _on_message(self, header: dict, body: Any, buffers: list, frames: list) -> None:
        if header["dst"] != IDENTITY:
            self.channel.forward(header["dst"], frames)
            return
        kind = header["kind"]
        if kind == "reply":
            self.messenger.on_reply(header, body, buffers)
        elif kind == "hb":
            self._on_heartbeat(header)
        elif kind == "output":
            self._on_output(header, bytes(body))
        elif kind == "hello":
            self._on_hello(header)
        elif kind == "proc_spawned":
            rec = self.procs.get(identity_key(header["proc"]))
            if rec is not None:
                rec.pid = header["pid"]
        elif kind == "proc_exited":
            self._on_exit(header)
        elif kind == "actor_error":
            rec = self.procs.get(identity_key(route_id(header["src"])))
            if rec is not None:
                self._event("actor_error", rec, detail=header.get("detail", ""), cause="exception")
        elif kind == "fault_fired":
            rec = self.procs.get(identity_key(route_id(header["src"])))
            if rec is not None:
                self._event("fault_fired", rec, detail=header.get("detail", ""), cause=header.get("fault", ""))
        elif kind == "agent_hello":
            agent = self.agents.get(route_id(header["src"]))
            if agent is not None:
                agent.pid = header["pid"]
                agent.ready.set()
        else:
            log.warning("unknown message kind %r from %s", kind, header["src"])

    def _event(self, kind: str, rec: ProcRecord, **fields: Any) -> Event:
        return self.events.append(Event(kind, rank=rec.rank, coords=rec.coords, pid=rec.pid, mesh=rec.mesh, **fields))

    def _on_hello(self, header: dict) -> None:
        rec = self.procs.get(identity_key(route_id(header["src"])))
        if rec is None:
            return
        rec.pid = header["pid"]
        rec.last_heartbeat = time.monotonic()
        rec.exit_info = None
        rec.fenced = False
        rec.failure = None
        rec.started_at = rec.last_heartbeat
        restarting = rec.state == "restarting"
        rec.state = "healthy"
        if restarting:
            self._respawn_actors(rec)
        else:
            self._event("proc_started", rec, detail=f"pid {rec.pid}")
            rec.ready.set()

    def _on_heartbeat(self, header: dict) -> None:
        rec = self.procs.get(identity_key(route_id(header["src"])))
        if rec is None:
            return
        rec.last_heartbeat = time.monotonic()
        rec.busy = header.get("busy", {})
        rec.loading = header.get("loading", [])
        paused = header.get("paused", [])
        if bool(paused) != bool(rec.paused):  # a user is debugging it: paused, not hung
            where = ", ".join(f"{p.get('actor')}.{p.get('function')}:{p.get('line')}" for p in paused)
            self._event("proc_paused" if paused else "proc_continued", rec, detail=where or "continued", cause="debugger")
            if paused:  # a hint where the user looks: the rank's output, in the notebook
                self._emit_lines(rec.mesh, rec.rank, "stderr", [f"paused at breakpoint() in {where}: %mesh debug attaches"], None)
        rec.paused = paused
        if rec.state in ("healthy", "busy"):
            rec.state = "busy" if rec.busy else "healthy"
        elif rec.state == "hung" and not rec.fenced:  # it was only slow (fencing off): serving again
            rec.state = "busy" if rec.busy else "healthy"
            rec.failure = None
            self.messenger.proc_recovered(rec.identity)
            for other in self.procs.values():
                if other is not rec and other.alive and other.state != "starting":
                    self.channel.send(other.identity, {"kind": "proc_recovered", "proc": rec.identity})
            self._event("proc_resumed", rec, detail="heartbeats resumed", cause="heartbeat")

    def _on_output(self, header: dict, data: bytes) -> None:
        rec = self.procs.get(identity_key(header["proc"]))
        mesh = rec.mesh if rec else ""
        key = (header["proc"], header["stream"])
        self._emit_lines(mesh, header["rank"], header["stream"], self._lines.feed(key, data), rec)

    def _emit_lines(self, mesh: str, rank: int, stream: str, lines: list[str], rec: ProcRecord | None) -> None:
        for text in lines:
            if rec is not None:
                rec.output_tail.append(text)
            line = OutputLine(mesh, rank, stream, text)
            for sink in list(self.output_sinks):
                try:
                    sink(line)
                except Exception:
                    log.exception("output sink %r failed", sink)

    def _on_exit(self, header: dict) -> None:
        rec = self.procs.get(identity_key(header["proc"]))
        if rec is None:
            return
        for stream in ("stdout", "stderr"):
            self._emit_lines(rec.mesh, rec.rank, stream, self._lines.flush((header["proc"], stream)), rec)
        rec.exit_info = {"returncode": header["returncode"], "signal": header.get("signal")}
        rec.busy = {}
        rec.paused = []
        if rec.state == "stopping":
            rec.state = "stopped"
            self._event("proc_stopped", rec, detail=f"exit {header['returncode']}", cause="stopped")
            return
        if rec.state == "restarting" and header.get("pid") == rec.restart_kill_pid:  # restart_proc killed it
            self._event("proc_stopped", rec, detail="killed to restart in place", cause="restart")
            return
        signame = header.get("signal")
        if rec.fenced:
            cause = "fenced"
        elif signame:
            cause = signame
        else:
            cause = f"exit {header['returncode']}"
        detail = header.get("detail") or (f"killed by {signame}" if signame else f"exited with code {header['returncode']}")
        rec.state = "failed"
        self._event("proc_exited", rec, detail=detail, cause=cause)
        self._fail_proc(rec, cause, detail, signame)

    def _fail_proc(self, rec: ProcRecord, cause: str, detail: str, signame: str | None) -> None:
        error = SupervisionError(rec.rank, cause, detail, signame)
        self.messenger.proc_failed(rec.identity, error)
        note = json.dumps({"rank": rec.rank, "cause": cause, "detail": detail, "signal": signame}).encode()
        for other in self.procs.values():
            if other is not rec and other.alive and other.state != "starting":
                self.channel.send(other.identity, {"kind": "proc_failed", "proc": rec.identity}, note)
        self.supervisor.on_failure(rec, cause, detail, signame)

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for rec in list(self.procs.values()):
            allowed_s = max(config.hang_timeout_s, config.import_grace_s) if rec.loading else config.hang_timeout_s
            if rec.state in ("healthy", "busy") and now - rec.last_heartbeat > allowed_s:
                rec.state = "hung"
                silent = now - rec.last_heartbeat
                self._event("proc_hung", rec, detail=f"no heartbeat for {silent:.2f} s", cause="heartbeat")
                self._fail_proc(rec, "hung", f"no heartbeat for {silent:.2f} s", None)
                if config.fence_hung:
                    rec.fenced = True
                    self.signal_proc(rec.identity, "SIGKILL")
                    self._event("proc_fenced", rec, detail="SIGKILL after hang", cause="fencing")

    # -- restart ----------------------------------------------------------------------------------
    def _respawn_actors(self, rec: ProcRecord) -> None:
        mesh = self.meshes[rec.mesh]
        spawns = [s for s in mesh.actors if rec.rank in s.ranks]
        target = Target(rec.identity, rec.rank, rec.coords)
        futures = [self._send_spawn([target], s, None, even_if_failed=True) for s in spawns]

        def finish() -> None:
            errors = [f.exception() for f in futures]
            failed = [e for e in errors if e is not None]
            if failed:
                rec.state = "failed"
                self._event("proc_exited", rec, detail=f"actor respawn failed: {failed[0]}", cause="respawn")
                rec.ready.set()
                return
            self.messenger.proc_recovered(rec.identity)
            for other in self.procs.values():
                if other is not rec and other.alive:
                    self.channel.send(other.identity, {"kind": "proc_recovered", "proc": rec.identity})
            self._event("proc_restarted", rec, detail=f"pid {rec.pid}, restart {rec.restarts}", cause="restart")
            rec.ready.set()

        threading.Thread(target=finish, name="respawn", daemon=True).start()

    def restart_proc(self, identity: str, timeout_s: float = 30.0) -> None:
        """Restart one proc in place: same rank and coordinates, new pid, its actors respawned
        with their constructor arguments. Blocks until it serves again.

        Raises:
            MeshStoppedError: its mesh was stopped.
            TimeoutError: it did not come back within ``timeout_s``.
            RuntimeError: it came back but an actor constructor failed.
        """
        rec = self.procs[identity_key(identity)]
        self._mesh(rec.mesh)
        if rec.state in ("healthy", "busy", "hung", "starting"):
            rec.fenced = rec.fenced or rec.state == "hung"
            rec.state = "restarting"
            rec.restart_kill_pid = rec.pid
            self.signal_proc(rec.identity, "SIGKILL")
            deadline = time.monotonic() + 5.0
            while rec.exit_info is None and time.monotonic() < deadline:
                time.sleep(0.005)
            self.messenger.proc_failed(rec.identity, SupervisionError(rec.rank, "restarting", "the proc is being restarted"))
        rec.state = "restarting"
        rec.restarts += 1
        rec.ready.clear()
        self._event("proc_restarting", rec, detail=f"restart {rec.restarts}", cause="restart")
        self.channel.send(rec.host, {"kind": "spawn_procs"}, json.dumps([rec.spec]).encode())
        deadline = time.monotonic() + timeout_s
        while not rec.ready.wait(0.05):
            if rec.state == "failed":  # the new incarnation died before it served
                tail = "\n".join(list(rec.output_tail)[-20:]) or "(no output)"
                raise RuntimeError(f"proc {identity} died while restarting ({rec.exit_info}); its output:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"proc {identity} did not come back within {timeout_s} s")
        if rec.state not in ("healthy", "busy"):  # busy: a heartbeat already saw an endpoint running
            raise RuntimeError(f"proc {identity} restarted but is {rec.state}: {self.events.events()[-1].detail}")

    # -- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every mesh and host agent and close the socket. Runs at interpreter exit."""
        if self._closed:
            return
        for name in list(self.meshes):
            try:
                self.stop_procs(name, timeout_s=2.0)
            except Exception:
                log.exception("stopping %s failed", name)
        for agent in self.agents.values():
            self.channel.send(agent.name, {"kind": "shutdown"})
        for agent in self.agents.values():
            if agent.popen is not None:
                try:
                    agent.popen.wait(timeout=3.0)
                except subprocess.TimeoutExpired:
                    agent.popen.kill()
                    agent.popen.wait()
        self._closed = True
        self.supervisor.close()
        self.channel.close()
        shm.remove_orphans(self.run_id)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        messenger_mod.install(None)


def identity_key(identity: str) -> str:
    return route_id(identity)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
