"""Actor meshes on the controller: who owns what, spawning, stopping, and where failures go.

Every actor mesh and proc mesh has an *owner*: the actor instance whose code spawned it (a
``(proc, actor mesh id)`` pair), or the client. :class:`ActorMeshes` keeps that tree. Spawning is
non-blocking: the constructors run while the caller goes on, and calls queue behind them on each
proc. An actor's failure (reported by its proc as ``actor_failed``, or the escalated failure of
its proc) becomes a :class:`~monarch_nb.actor.failure.MeshFailure` delivered to the owner: an
actor owner's ``__supervise__`` (a ``supervise`` message to its proc), or, for the client, the
fault hook (on a thread of its own). Each failed rank is delivered once. Stopping a mesh stops
the meshes its actors own first. A constructor that fails removes the mesh from every rank, so
the same name can be spawned again (any name can be spawned again: ids are made unique).

``get_or_spawn_controller`` singletons live on the client's own proc and belong to the runtime;
a failed one is reported on the next lookup.

Of its controller :class:`ActorMeshes` sees only :class:`ActorMeshesController` (and of the proc
meshes room only :class:`ProcSpawner`).
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from ..actor.backend import Target
from ..actor.context import CLIENT_MESH
from ..actor.endpoint import is_async_actor
from ..actor.failure import HookThread, MeshFailure
from ..actor.future import Future
from ..actor.mesh import ActorMesh
from ..actor.shape import Extent, Shape
from ..errors import MeshStoppedError
from ..supervision.events import Event
from ..supervision.records import ActorSpawn, proc_identity
from ..transport.serialization import SerializationError, dumps, loads
from .actors import error_info
from .protocol import ActorFailedHeader, CallHeader, ControlHeader, Kind, ReplyHeader

if TYPE_CHECKING:
    from ..supervision.events import EventLog
    from ..supervision.records import ProcMeshRecord
    from ..transport.channel import Channel
    from .actor_host import ActorHost
    from .messenger import Messenger

__all__ = ["ActorMeshes", "ActorMeshesController", "ProcSpawner", "ActorMeshRecord", "LOCAL_PROC"]

log = logging.getLogger(__name__)

#: Routing identity of the client's own proc (actors spawned on ``this_proc()`` at the client).
LOCAL_PROC = proc_identity(CLIENT_MESH, 0)

Owner = tuple  # (proc identity, actor mesh id); None is the client
_CONTROLLERS = ("@controllers", "")  # owner of get_or_spawn_controller singletons


@dataclass
class ActorMeshRecord:
    """One spawned actor mesh, as the controller knows it."""

    id: str
    name: str
    proc_mesh: str
    ranks: list[int]
    extent: Extent
    class_name: str
    owner: Owner | None
    creator_display: str
    spawn: ActorSpawn
    initialized: Future
    failed: dict = field(default_factory=dict)  # rank in the mesh -> MeshFailure
    delivered: set = field(default_factory=set)
    stopped: bool = False

    def display(self, index: int) -> str:
        return f"{self.creator_display}.<{self.class_name} {self.name}{self.extent.point(index)!r}>"

    def instances(self) -> list[Owner]:
        return [(proc_identity(self.proc_mesh, r), self.id) for r in self.ranks]


class ProcSpawner(Protocol):
    """What :class:`ActorMeshes` uses of the proc meshes room (:class:`~.proc_meshes.ProcMeshes` is one)."""

    def spawn(self, hosts: list[str], extent: Extent, name: str | None = None, python: str = "", *,
              spares: int = 0, preload: Sequence[str] = ()) -> str:
        """Start ``extent.nelements`` procs over ``hosts``; return the new mesh's name. Blocks until they serve."""


class ActorMeshesController(Protocol):
    """What :class:`ActorMeshes` uses of its controller (:class:`~.controller.Controller` is one)."""

    @property
    def meshes(self) -> dict[str, ProcMeshRecord]:
        """Proc mesh name -> its record (the actors spawned on it, for restarts)."""

    @property
    def events(self) -> EventLog:
        """The event log: an ``escalated`` proc failure fails the actors it held."""

    @property
    def channel(self) -> Channel:
        """The controller's socket: answers control requests, sends ``supervise`` to owners."""

    @property
    def messenger(self) -> Messenger:
        """Sends constructors and stops to procs, a Future of their replies."""

    @property
    def local_host(self) -> ActorHost:
        """The client's own proc (``LOCAL_PROC``): its actors are reached without a socket."""

    @property
    def proc_meshes(self) -> ProcSpawner:
        """The proc meshes room, to spawn the procs an actor asks for."""

    def target(self, mesh: str, rank: int) -> Target:
        """Where a message to rank ``rank`` of proc mesh ``mesh`` goes."""

    def mesh_stopped(self, mesh: str) -> bool:
        """True once proc mesh ``mesh`` was stopped."""

    def stop_procs(self, mesh: str, timeout_s: float | None = None) -> None:
        """Stop the procs of ``mesh`` (what an owner owned, an actor's request). Idempotent, blocks."""

    def set_log_level(self, mesh: str, level: int) -> None:
        """Set the logging level of ``mesh``'s live procs (an actor's request)."""


class ActorMeshes:
    """The controller's actor meshes and the ownership tree (thread-safe)."""

    def __init__(self, ctrl: ActorMeshesController):
        self.ctrl = ctrl
        self.records: dict[str, ActorMeshRecord] = {}
        self.owned: dict[Owner | None, list[tuple[str, str]]] = {}  # owner -> [("actors", id) | ("procs", name)]
        self.controllers: dict[str, ActorMesh] = {}
        self.controller_failures: dict[str, MeshFailure] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self.hook = HookThread()
        self._unsubscribe = ctrl.events.subscribe(self._on_event)

    # -- spawning ------------------------------------------------------------------------------
    def _new_id(self, proc_mesh: str, name: str) -> str:
        taken = {r.id for r in self.records.values() if r.proc_mesh == proc_mesh and not r.stopped}
        if name not in taken:
            return name
        while True:
            candidate = f"{name}-{next(self._ids)}"
            if candidate not in taken:
                return candidate

    def _targets(self, mesh: str, ranks: list[int]) -> list[Target]:
        if mesh == CLIENT_MESH:
            return [Target(LOCAL_PROC, 0, {})]
        return [self.ctrl.target(mesh, r) for r in ranks]

    def spawn(self, mesh: str, ranks: list[int], name: str, cls: type, args: tuple, kwargs: dict,
              spawn_extent: Extent, owner: Owner | None, creator: Any) -> str:
        """Send the constructors to ``ranks`` of ``mesh``; return the new actor mesh's id at once.

        Raises:
            MeshStoppedError: the proc mesh was stopped.
            SerializationError: the class or an argument cannot be pickled.
        """
        if mesh != CLIENT_MESH:
            record = self.ctrl.meshes.get(mesh)
            if record is None:
                raise KeyError(f"no proc mesh {mesh!r}")
            if record.stopped:
                raise MeshStoppedError(f"`ProcMesh` has already been stopped: proc mesh {mesh!r} was stopped; "
                                       "spawn a new one with this_host().spawn_procs(...)")
        creator_display = str(creator) if creator is not None else "<root>"
        meta = {"name": name, "creator_display": creator_display, "creator": creator}
        with self._lock:
            actor_id = self._new_id(mesh, name)
            body, buffers = dumps((cls, args, kwargs, spawn_extent, ranks, meta))
            spawn = ActorSpawn(actor_id, cls, body, buffers, ranks)
            raw = self.ctrl.messenger.send_raw(self._targets(mesh, ranks), Kind.SPAWN, actor_id, body, buffers,
                                               extent=spawn_extent, extra={"async": 1} if is_async_actor(cls) else None)
            assert raw is not None
            initialized: Future = Future()
            rec = ActorMeshRecord(actor_id, name, mesh, list(ranks), spawn_extent, f"{cls.__module__}.{cls.__qualname__}",
                                  owner, creator_display, spawn, initialized)
            self.records[actor_id] = rec
            self.owned.setdefault(owner, []).append(("actors", actor_id))
            if mesh != CLIENT_MESH:
                self.ctrl.meshes[mesh].actors.append(spawn)
        raw.add_done_callback(lambda f: self._initialized(rec, f))
        return actor_id

    def _initialized(self, rec: ActorMeshRecord, raw: Future) -> None:
        error = raw.exception()
        if error is None:
            rec.initialized._inner.set_result(None)
        else:
            rec.initialized._inner.set_exception(error)

    def own_procs(self, owner: Owner | None, mesh: str) -> None:
        """Record that ``owner`` spawned proc mesh ``mesh`` (stopped with it)."""
        with self._lock:
            self.owned.setdefault(owner, []).append(("procs", mesh))

    def initialized(self, actor_id: str) -> Future:
        rec = self.records.get(actor_id)
        if rec is None:
            return Future.completed(error=KeyError(f"no actor mesh {actor_id!r}"))
        return rec.initialized

    # -- get_or_spawn_controller -----------------------------------------------------------------
    def get_or_spawn_controller(self, name: str, cls: type, args: tuple, kwargs: dict) -> Future:
        with self._lock:
            failure = self.controller_failures.get(name)
            if failure is not None:
                return Future.completed(error=ValueError(f"Failure on {name}: {failure}"))
            mesh = self.controllers.get(name)
            if mesh is None:
                from ..actor.endpoint import check_actor_class

                check_actor_class(cls)
                actor_id = self.spawn(CLIENT_MESH, [0], name, cls, args, kwargs, Extent({}), _CONTROLLERS, None)
                mesh = ActorMesh(name, cls, CLIENT_MESH, Extent({}), Shape(Extent({}), [0]), actor_id=actor_id)
                self.controllers[name] = mesh
            elif _class_name(mesh._cls) != _class_name(cls):  # (by name: a class from a proc comes back a copy)
                return Future.completed(error=TypeError(
                    f"the controller {name!r} is a {_class_name(mesh._cls)}, not a {_class_name(cls)}: "
                    f"get_or_spawn_controller finds one actor per name; give this one another name"))
            return Future.completed(mesh)

    # -- requests from actors in procs (``control`` messages) --------------------------------------
    def on_control(self, header: ControlHeader, body: Any, buffers: list[memoryview]) -> None:
        """A request an actor made of the runtime (spawn, stop, ...): run it on a thread of its own
        (it may block, e.g. until procs start), then answer the asking actor."""
        threading.Thread(target=self._control, args=(header, body, buffers), name="monarch_nb-control", daemon=True).start()

    def _control(self, header: ControlHeader, body: Any, buffers: list[memoryview]) -> None:
        try:
            payload = loads(body, buffers)
            owner = tuple(payload["owner"]) if payload.get("owner") else None
            value = self._control_op(header["op"], payload, owner)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - the asking actor gets the error
            ok, value = False, error_info(exc)
        try:
            reply_body, reply_buffers = dumps(value)
        except SerializationError as exc:
            ok, (reply_body, reply_buffers) = False, dumps(error_info(exc))
        reply: ReplyHeader = {"kind": Kind.REPLY, "cid": header["cid"], "idx": header["idx"], "ok": ok}
        self.ctrl.channel.send(header["reply_to"], reply, reply_body, reply_buffers)

    def _control_op(self, op: str, payload: dict, owner: Owner | None) -> Any:
        ctrl = self.ctrl
        if op == "spawn_procs":
            name = ctrl.proc_meshes.spawn(payload["hosts"], payload["extent"], payload["name"], payload.get("python", ""),
                                          spares=payload.get("spares", 0), preload=payload.get("preload", ()))
            self.own_procs(owner, name)
            return name
        if op == "spawn_actors":
            return self.spawn(payload["mesh"], payload["ranks"], payload["name"], payload["cls"], payload["args"],
                              payload["kwargs"], payload["spawn_extent"], owner, payload.get("creator"))
        if op == "initialized":
            return self.initialized(payload["actor"]).get()
        if op == "stop_actors":
            return self.stop(payload["actor"])
        if op == "stop_procs":
            return ctrl.stop_procs(payload["mesh"])
        if op == "get_or_spawn_controller":
            return self.get_or_spawn_controller(payload["name"], payload["cls"], payload["args"], payload["kwargs"]).get()
        if op == "set_log_level":
            return ctrl.set_log_level(payload["mesh"], payload["level"])
        raise ValueError(f"unknown control request {op!r}")

    # -- failures --------------------------------------------------------------------------------
    def on_actor_failed(self, header: ActorFailedHeader, body: Any, buffers: list[memoryview]) -> None:
        """An ``actor_failed`` message from a proc (IO thread)."""
        rec = self.records.get(header.get("actor", ""))
        try:
            failure = loads(body, buffers)
        except SerializationError:
            log.exception("an actor failure could not be read")
            return
        if rec is None or (rec.stopped and not rec.failed):  # stopped on purpose: no failure
            return
        self.deliver(rec, failure)
        if failure.cause == "init":  # a failed spawn removes what it built on every rank
            threading.Thread(target=self._remove_failed_spawn, args=(rec,), name="failed-spawn", daemon=True).start()

    def _remove_failed_spawn(self, rec: ActorMeshRecord) -> None:
        try:
            self.stop(rec.id)
        except Exception:  # noqa: BLE001 - best effort: a dead proc has nothing left to remove
            log.debug("removing failed spawn %s", rec.id, exc_info=True)

    def deliver(self, rec: ActorMeshRecord, failure: MeshFailure) -> None:
        """Give ``failure`` to ``rec``'s owner, once per failed rank."""
        with self._lock:
            key = tuple(failure.crashed_ranks)
            if key in rec.delivered:
                return
            rec.delivered.add(key)
            for r in failure.crashed_ranks:
                rec.failed[r] = failure
        owner = rec.owner
        if owner is None:
            self.hook.put(failure)
        elif owner == _CONTROLLERS:
            self.controller_failures[rec.name] = failure
        else:
            proc, actor_id = owner
            body, buffers = dumps(failure)
            header: CallHeader = {"kind": Kind.SUPERVISE, "actor": actor_id}
            if proc == LOCAL_PROC:
                header["src"], header["dst"] = "ctrl", LOCAL_PROC
                self.ctrl.local_host.dispatch(header, body, buffers)
            else:
                self.ctrl.channel.send(proc, header, body, buffers)

    def _on_event(self, event: Event) -> None:
        """An escalated proc failure fails the actors it held (subscriber: supervisor thread)."""
        if event.kind != "escalated":
            return
        reason = f"the process this actor was running on failed: {_process_status(event.cause, event.detail)}"
        hit = False
        with self._lock:
            records = [r for r in self.records.values() if r.proc_mesh == event.mesh and event.rank in r.ranks and not r.stopped]
        for rec in records:
            index = rec.ranks.index(event.rank)
            hit = True
            self.deliver(rec, MeshFailure(rec.name, [index], rec.display(index), reason, event.cause))
        if not hit:
            owner = next((o for o, kids in self.owned.items() if ("procs", event.mesh) in kids), None)
            failure = MeshFailure(event.mesh, [event.rank], f"<proc {event.mesh}.{event.rank}>", reason, event.cause)
            if owner is None:
                self.hook.put(failure)
            elif owner != _CONTROLLERS:
                proc, actor_id = owner
                body, buffers = dumps(failure)
                supervise: CallHeader = {"kind": Kind.SUPERVISE, "actor": actor_id}
                self.ctrl.channel.send(proc, supervise, body, buffers)

    # -- stopping --------------------------------------------------------------------------------
    def stop(self, actor_id: str) -> None:
        """Stop actor mesh ``actor_id``: what its actors own, then the actors (their cleanups). Blocks."""
        with self._lock:
            rec = self.records.get(actor_id)
            if rec is None or rec.stopped:
                return
            rec.stopped = True
        self.stop_owned(rec.instances())
        targets = self._targets(rec.proc_mesh, rec.ranks)
        if rec.proc_mesh != CLIENT_MESH and self.ctrl.mesh_stopped(rec.proc_mesh):
            targets = []
        if targets:
            fut = self.ctrl.messenger.send_raw(targets, Kind.STOP_ACTORS, rec.id, b"", [], extent=None, endpoint="__stop__")
            assert fut is not None  # a reply is wanted
            try:
                fut.get(timeout=30.0)
            except Exception:  # noqa: BLE001 - a dead proc's actors are stopped already
                log.debug("stopping %s", rec.id, exc_info=True)
        proc_record = self.ctrl.meshes.get(rec.proc_mesh)
        if proc_record is not None and rec.spawn in proc_record.actors:
            proc_record.actors.remove(rec.spawn)

    def stop_owned(self, owners: list[Owner]) -> None:
        """Stop every mesh owned by one of ``owners`` (recursively, deepest first)."""
        for owner in owners:
            with self._lock:
                kids = self.owned.pop(owner, [])
            for kind, name in reversed(kids):
                try:
                    if kind == "actors":
                        self.stop(name)
                    else:
                        self.ctrl.stop_procs(name)
                except Exception:  # noqa: BLE001 - stopping goes on
                    log.exception("stopping %s %s owned by %s failed", kind, name, owner)

    def before_stop_procs(self, mesh: str) -> None:
        """Proc mesh ``mesh`` is stopping: what its actors own stops first; its actors are stopped."""
        with self._lock:
            records = [r for r in self.records.values() if r.proc_mesh == mesh and not r.stopped]
            for rec in records:
                rec.stopped = True
        for rec in records:
            self.stop_owned(rec.instances())

    def close(self) -> None:
        self._unsubscribe()
        self.hook.close()


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _process_status(cause: str, detail: str) -> str:
    """``"SIGKILL"`` -> ``"Killed(sig=9)"``, ``"exit 3"`` -> ``"Exited(3)"``, a hang -> ``"Hung"``."""
    if cause.startswith("SIG"):
        number = getattr(signal, cause, None)
        return f"Killed(sig={int(number)})" if number is not None else f"Killed({cause})"
    if cause.startswith("exit"):
        return f"Exited({cause.split()[-1]})"
    if cause in ("heartbeat", "fenced", "hung"):
        return f"Hung ({detail})" if detail else "Hung"
    return f"{cause}: {detail}" if detail else cause
