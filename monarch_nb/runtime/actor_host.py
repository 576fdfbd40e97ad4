"""The actors of one process: routing spawn, call, stop and supervise messages to their runners,
and sending replies (to the caller, a port, or a caller in this same process without a socket).

One :class:`ActorHost` per process that hosts actors: each worker proc, and the client for the
actors spawned on the client's own proc (``this_proc()``, ``get_or_spawn_controller``).

A call that came straight from a proc of the same host (:mod:`monarch_nb.transport.local_peers`)
for an actor not spawned here yet waits for its spawn, up to :data:`HOLD_FOR_SPAWN_S`: the
controller may have spawned it and passed its mesh on in the same breath, and the spawn, which
comes from the controller, not from that peer, may still be on its way (through the controller's
hub the two kept one order). So does one for an actor that was stopped or failed here (a new
mesh may reuse its id). After that it is refused as any call to an actor that is not here (with
the stopped actor's failure, if it was one).
"""


from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..actor.failure import MeshFailure
from ..actor.shape import Extent
from ..transport.serialization import SerializationError, dumps, loads
from ..transport.wire import Header
from .actors import STOP_GRACE_S, ActorRunner, error_info
from .protocol import ActorErrorHeader, ActorFailedHeader, CallHeader, Kind, PortHeader, ReplyHeader

if TYPE_CHECKING:
    from .messenger import Messenger

__all__ = ["ActorHost"]

log = logging.getLogger("monarch_nb.actors")

#: Seconds a peer's call for an actor not spawned yet waits for the spawn before it is refused.
HOLD_FOR_SPAWN_S = 5.0
#: Calls that may wait for spawns at once (more are refused at once).
MAX_HELD_FOR_SPAWN = 10_000


class ActorHost:
    """The actors of one process and the messages addressed to them (IO thread, or a local caller).

    Args:
        identity: this process's routing identity (``"pm0.3"``, or the client's own proc).
        mesh_name / rank / extent: where this process sits.
        send: ``send(dst, header, body, buffers)`` on the process's channel (any thread).
        messenger: the process's messenger (replies to callers in this same process skip the socket).
        to_controller: ``to_controller(header, body)``.
        python: the interpreter procs of this mesh were started with ("" for the default).
    """

    def __init__(self, identity: str, mesh_name: str, rank: int, extent: Extent, send: Callable[..., None],
                 messenger: "Messenger", to_controller: Callable[[Header, bytes], None], python: str = "",
                 lead: Callable[..., bool] | None = None, wake: Callable[[], None] | None = None,
                 call_later: Callable[[float, Callable[[], None]], None] | None = None) -> None:
        self.identity = identity
        self.mesh_name = mesh_name
        self.rank = rank
        self.extent = extent
        self.python = python
        self._send = send
        self.messenger = messenger
        self.lead = lead  # the channel's lead(): idle sync actors receive on their own thread
        self.wake = wake or (lambda: None)
        self._to_controller = to_controller
        self.runners: dict[str, ActorRunner] = {}
        self.call_hooks: tuple = ()  # replaced whole (Proc.add_call_hook): read on every call, unlocked
        self.failure_hooks: list[Callable[[str, str, BaseException], None]] = []
        self._tombstones: dict[str, dict] = {}
        self._stop_waiters: dict[str, list] = {}
        self._lock = threading.Lock()
        self._call_later = call_later  # the channel's (the receiving thread's timers); None: no call waits for a spawn
        self._before_spawn: dict[str, list[tuple]] = {}  # actor -> peers' calls that came before its spawn
        self._held_for_spawn = 0

    # -- messages --------------------------------------------------------------------------------
    def dispatch(self, header: CallHeader, body: Any, buffers: list[memoryview]) -> None:
        """Route one actor message (spawn, call, stop_actors, supervise, port)."""
        kind = header["kind"]
        if kind == Kind.CALL:
            runner = self.runners.get(header["actor"])
            if runner is None:
                if not (header.get("_local_peer") and self._hold_for_spawn(("call", header, body, buffers))):
                    self.refuse(("call", header, body, buffers))
            else:
                runner.post(("call", header, body, buffers))
        elif kind == Kind.SPAWN:
            self.on_spawn(header, body, buffers)
        elif kind == Kind.STOP_ACTORS:
            self.on_stop_actors(header)
        elif kind == Kind.SUPERVISE:
            self.on_supervise(header, body, buffers)

    def on_spawn(self, header: CallHeader, body: Any, buffers: list[memoryview]) -> None:
        name = header["actor"]
        with self._lock:
            if name in self.runners:
                self.reply(header, False, error_info(ValueError(f"an actor with id {name!r} already lives on {self.identity}")))
                return
            self._tombstones.pop(name, None)
            runner = self.runners[name] = ActorRunner(self, name, bool(header.get("async")))
            early = self._before_spawn.pop(name, [])
            self._held_for_spawn -= len(early)
        runner.post(("spawn", header, body, buffers))
        for item in early:  # peers' calls that came before it, in their order, after it
            runner.post(item)

    def _hold_for_spawn(self, item: tuple) -> bool:
        """Keep a peer's call for an actor not spawned here until its spawn (or refuse it after
        :data:`HOLD_FOR_SPAWN_S`); False: refuse it now (too many wait). An actor that was here
        and is gone waits too: a new mesh may take its id, its spawn on the way."""
        name = item[1].get("actor", "")
        if self._call_later is None:
            return False
        with self._lock:
            if self._held_for_spawn >= MAX_HELD_FOR_SPAWN:
                return False
            waiting = self._before_spawn.setdefault(name, [])
            waiting.append(item)
            self._held_for_spawn += 1
            first = len(waiting) == 1
        if first:
            self._call_later(HOLD_FOR_SPAWN_S, lambda: self._spawn_never_came(name, waiting))
        return True

    def _spawn_never_came(self, name: str, waiting: list[tuple]) -> None:
        with self._lock:
            if self._before_spawn.get(name) is not waiting:
                return  # spawned meanwhile (they were posted), or another wait began
            del self._before_spawn[name]
            self._held_for_spawn -= len(waiting)
        log.warning("%d call(s) from peers for actor %r waited %.0f s on %s for its spawn, which did not come; refused",
                    len(waiting), name, HOLD_FOR_SPAWN_S, self.identity)
        for item in waiting:
            self.refuse(item)

    def on_stop_actors(self, header: CallHeader) -> None:
        runner = self.runners.get(header["actor"])
        if runner is None or runner.stopped:
            self.reply(header, True, None)
            return
        if runner.current is not None and runner.current[0] == "__init__" and runner.instance is None:
            runner.abandoned = True  # its constructor may never return: answer now, stop when it does
            self.reply(header, True, None)
            return
        runner.stop(header)
        if self._call_later is not None:
            self._call_later(STOP_GRACE_S, lambda: self._stop_overran(runner, header))

    def _stop_overran(self, runner: ActorRunner, header: CallHeader) -> None:
        """``runner``'s stop has not ended within :data:`STOP_GRACE_S` (an endpoint or its
        ``__cleanup__`` does not return): answer the stop, and every message for the actor from
        now on, as a stopped actor's; its thread is left to finish (a thread cannot be killed)."""
        with self._lock:
            if self.runners.get(runner.name) is not runner:
                return  # it stopped in time
            del self.runners[runner.name]
            self._tombstones[runner.name] = runner.tombstone()
        busy = runner.current[0] if runner.current is not None else "__cleanup__"
        log.warning("actor %s on %s did not stop within %.0f s (its %s has not returned): it is stopped now for its "
                    "callers; the %s goes on in its thread until it returns or the proc exits",
                    runner.name, self.identity, STOP_GRACE_S, busy, busy)
        self.reply(header, True, None)
        runner.close()

    def on_supervise(self, header: CallHeader, body: Any, buffers: list[memoryview]) -> None:
        runner = self.runners.get(header["actor"])
        try:
            failure = loads(body, buffers)
        except SerializationError:
            log.exception("a supervision event could not be read")
            return
        if runner is not None:
            runner.supervise(failure)

    def refuse(self, item: tuple) -> None:
        """A message for an actor that is not here (stopped, failed, or never spawned)."""
        _kind, header, _body, _buffers = item
        tomb = self._tombstones.get(header.get("actor", ""))
        if tomb is not None:
            self.reply_failure(header, tomb)
        else:
            self.reply(header, False, error_info(LookupError(f"no actor {header.get('actor')!r} on proc {self.identity}")))

    # -- replies (any thread) ----------------------------------------------------------------------
    def reply(self, header: CallHeader, ok: bool, value: Any) -> None:
        """Answer ``header``'s call (to its caller, or to the port it named); once per call."""
        if "_done" in header:
            return
        if "cid" not in header and "port" not in header:
            return
        try:
            body, buffers = dumps(value)
        except BaseException as exc:  # noqa: BLE001 - whatever pickling raises, the caller gets an answer
            ok, (body, buffers) = False, dumps(error_info(exc, f"the result of {header.get('ep')} cannot be pickled"))
        header["_done"] = True
        if "port" in header:
            owner, port_id = header["port"]
            rank = header.get("mi", header.get("rank"))
            self.send_port(owner, port_id, ok, body, buffers, rank)
            return
        reply: ReplyHeader = {"kind": Kind.REPLY, "cid": header["cid"], "idx": header["idx"], "ok": ok}
        dst = header["reply_to"]
        if dst == self.messenger.identity:
            self.messenger.on_reply(reply, body, buffers)
        elif "_fanned" in header and "gth" in header:  # a cast's: this host's replies may go as one (Channel.send)
            self._send(dst, reply, body, buffers, gather=header["_fanned"])
        else:
            self._send(dst, reply, body, buffers)

    def reply_failure(self, header: CallHeader, info: dict[str, Any]) -> None:
        self.reply(header, False, info)

    def send_port(self, owner: str, port_id: str, ok: bool, body: bytes, buffers: list[memoryview], rank: int | None) -> None:
        header: PortHeader = {"kind": Kind.PORT, "port": port_id, "ok": ok}
        if rank is not None:
            header["prank"] = rank
        if owner == self.messenger.route:
            self.messenger.on_port(header, body, buffers)
        else:
            self._send(owner, header, body, buffers)

    def stopped_info(self, name: str) -> dict:
        return {"supervision": True, "cause": "stopped", "detail": f"actor {name} was stopped",
                "report": f"The actor {name} and all its descendants have failed:\n  the actor was stopped"}

    # -- lifecycle -------------------------------------------------------------------------------------
    def stopped(self, runner: ActorRunner, header: CallHeader | None) -> None:
        """``runner`` finished stopping (its thread): answer the stop request."""
        with self._lock:
            if self.runners.get(runner.name) is runner:
                del self.runners[runner.name]
                self._tombstones[runner.name] = runner.tombstone()
        if header is not None:
            self.reply(header, True, None)

    def actor_failed(self, runner: ActorRunner, failure: MeshFailure) -> None:
        try:
            body, _ = dumps(failure)
        except SerializationError:
            log.exception("a failure could not be pickled")
            return
        header: ActorFailedHeader = {"kind": Kind.ACTOR_FAILED, "actor": runner.name, "rank": failure.crashed_ranks[0]}
        self._to_controller(header, body)

    def endpoint_failed(self, actor: str, endpoint: str, exc: BaseException, info: dict) -> None:
        for hook in self.failure_hooks:
            try:
                hook(actor, endpoint, exc)
            except Exception:
                log.exception("failure hook %r raised", hook)
        detail = f"{actor}.{endpoint}: {info.get('type')}: {info.get('message')}"
        header: ActorErrorHeader = {"kind": Kind.ACTOR_ERROR, "actor": actor, "ep": endpoint, "detail": detail}
        self._to_controller(header, b"")

    def stop_all(self, timeout_s: float = STOP_GRACE_S) -> None:
        """Stop every actor (their ``__cleanup__`` runs), waiting up to ``timeout_s`` in all."""
        runners = list(self.runners.values())
        for runner in runners:
            if runner.current is not None and runner.current[0] == "__init__" and runner.instance is None:
                continue  # a constructor that never returns
            runner.stop(None)
        deadline = time.monotonic() + timeout_s
        for runner in runners:
            runner.thread.join(max(0.0, deadline - time.monotonic()))
