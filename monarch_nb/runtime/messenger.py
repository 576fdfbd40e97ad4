"""The calling side of a process: send endpoint calls, match replies, ports, fail calls to dead procs.

Every process that calls endpoints has one :class:`Messenger`: the controller, and each proc
(actors call other actors). A call to a mesh slice sends one message per member and returns a
:class:`~monarch_nb.actor.future.Future` that completes when every member replied (a
:class:`~monarch_nb.actor.value_mesh.ValueMesh`) or when one failed (the error, with the other
ranks' errors attached); a ``stream`` call returns one Future per member, the n-th completed by
the n-th reply. Ports opened here (``Channel.open()``) receive values through :meth:`on_port`.
When the controller learns that a proc died it tells every messenger; in-flight calls to it fail
with :class:`~monarch_nb.errors.SupervisionError`, later calls fail fast until the proc is
restarted, and receives on ports held only by dead procs fail.

Calls to actors hosted in this same process (``local`` deliveries) skip the socket.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable, Mapping, Sequence, cast

from ..actor.backend import Target
from ..actor.future import Future
from ..actor.ports import Port, collect_pickled_ports
from ..actor.shape import Extent
from ..actor.value_mesh import ValueMesh
from ..errors import ActorError, SupervisionError, error_from_reply
from ..transport.channel import Channel
from ..transport.serialization import SerializationError, dumps, loads
from ..transport.wire import columns_at, fields_at, route_id
from .protocol import CallHeader, ControlHeader, Handler, Kind, PortHeader, RepliesHeader, ReplyHeader, SpawnFlags

__all__ = ["Messenger"]

log = logging.getLogger(__name__)

_EMPTY_ARGS = dumps(((), {}))


class _PendingCall:
    __slots__ = ("targets", "actor", "endpoint", "extent", "future", "values", "outstanding", "errors", "streams", "display")

    def __init__(self, targets: list[Target], actor: str, endpoint: str, extent: Extent | None, future: Future[Any] | None,
                 streams: list[Future[Any]] | None = None) -> None:
        self.targets = targets
        self.actor = actor
        self.endpoint = endpoint
        self.extent = extent  # None: a single value (call_one / choose)
        self.future = future
        self.values: list[Any] = [None] * len(targets)
        self.outstanding = set(range(len(targets)))
        self.errors: list[BaseException] = []
        self.streams = streams  # stream(): Futures completed in arrival order
        self.display = actor  # "module.Class name" of the actors called, for failure texts


class Messenger:
    """Issues calls over ``channel`` and completes their futures from replies (thread-safe).

    Args:
        channel: the process's channel.
        local: routing identity -> ``deliver(header, body, buffers)`` for actors hosted in this
            process (their messages skip the socket).
    """

    def __init__(self, channel: Channel, local: dict[str, Handler] | None = None) -> None:
        self.channel = channel
        self.identity = channel.identity
        self.route = route_id(channel.identity)
        self.local = dict(local or {})
        self._pending: dict[str, _PendingCall] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._failed: dict[str, SupervisionError] = {}
        self._ports: dict[str, Any] = {}
        self._port_ids = itertools.count()

    # -- calling --------------------------------------------------------------------------------
    def send(
        self,
        targets: Sequence[Target],
        actor: str,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        extent: Extent | None,
        want_reply: bool = True,
        stream: bool = False,
        port: Any = None,
        message_extent: tuple[Extent, list[int]] | None = None,
        as_endpoint: bool = False,
        display: str | None = None,
    ) -> Future[Any] | list[Future[Any]] | None:
        """Send ``actor.endpoint(*args, **kwargs)`` to each target.

        Args:
            extent: the result's extent (a ValueMesh), or None for one bare value.
            want_reply: False for ``broadcast`` (fire and forget); returns None then.
            stream: return one Future per target, completed in arrival order.
            port: a Port that gets each target's reply (tagged with its rank) instead.
            message_extent: ``(extent, indices)`` of the slice the call goes to, when the targets
                are not exactly the mesh the actors were spawned on.

        Raises:
            SerializationError: an argument cannot be pickled; nothing was sent.
        """
        if args or kwargs:
            with collect_pickled_ports() as ports:
                try:
                    body, buffers = dumps((args, kwargs))
                except SerializationError as exc:  # say whose arguments ("cannot pickle tuple value" says nothing)
                    cause = exc.__cause__
                    raise SerializationError(f"the arguments of {endpoint}() cannot be pickled: "
                                             f"{type(cause).__name__}: {cause}") from cause
            if ports:
                self._note_port_holders(ports, targets)
        else:
            body, buffers = _EMPTY_ARGS
        header: CallHeader = {"kind": Kind.CALL, "actor": actor, "ep": endpoint}
        if as_endpoint:
            header["asep"] = 1
        if message_extent is not None:
            ext, indices = message_extent
            header["mx"] = [list(ext.labels), list(ext.sizes)]
        if port is not None:
            header["port"] = [port.owner, port.port_id]
            self._deliver_to(targets, self._live(targets), header, body, buffers,
                             mi=message_extent[1] if message_extent is not None else list(range(len(targets))))
            return None
        if not want_reply:
            self._deliver_to(targets, self._live(targets), header, body, buffers,
                             mi=message_extent[1] if message_extent is not None else None)
            return None
        return self._call(targets, header, body, buffers, extent, stream, message_extent, display=display)

    def send_raw(
        self,
        targets: Sequence[Target],
        kind: str,
        actor: str,
        body: bytes,
        buffers: list[memoryview],
        *,
        extent: Extent | None,
        endpoint: str = "__init__",
        want_reply: bool = True,
        even_if_failed: bool = False,
        extra: SpawnFlags | None = None,
    ) -> Future[Any] | None:
        """Send an already-pickled ``kind`` message (a spawn, a plugin's request) to each target.

        ``even_if_failed`` sends to procs marked failed (respawning actors on a restarted proc).
        """
        header: CallHeader = {"kind": kind, "actor": actor, "ep": endpoint}
        if extra:
            header.update(extra)
        if not want_reply:
            self._deliver_to(targets, None if even_if_failed else self._live(targets), header, body, buffers)
            return None
        future = self._call(targets, header, body, buffers, extent, False, None, even_if_failed)
        assert not isinstance(future, list)  # not a stream
        return future

    def control(self, dst: str, op: str, payload: Any) -> Future[Any]:
        """Ask process ``dst`` (the controller) to do ``op`` with ``payload``; a Future of its answer.

        Raises:
            SerializationError: ``payload`` cannot be pickled.
        """
        body, buffers = dumps(payload)
        target = Target(dst, -1, {})
        header: ControlHeader = {"kind": Kind.CONTROL, "op": op, "actor": "", "ep": op}
        future = self._call([target], header, body, buffers, None, False, None, True)
        assert isinstance(future, Future)
        return future

    def _call(self, targets: Sequence[Target], header: CallHeader, body: bytes, buffers: list[memoryview], extent: Extent | None,
              stream: bool, message_extent: tuple[Extent, list[int]] | None, even_if_failed: bool = False,
              display: str | None = None) -> Future[Any] | list[Future[Any]]:
        cid = f"{self.identity}:{next(self._ids)}"
        streams: list[Future[Any]] | None = None
        future: Future[Any] | None = None
        if stream:
            streams = [Future(on_cancel=lambda: self._forget(cid), lead=self.channel.lead) for _ in targets]
        else:
            future = Future(on_cancel=lambda: self._forget(cid), lead=self.channel.lead)
        pending = _PendingCall(list(targets), header["actor"], header["ep"], extent, future, streams)
        if display:
            pending.display = display
        header["cid"] = cid
        header["reply_to"] = self.identity
        if streams is None and len(targets) > 1:
            header["gth"] = 1  # the future takes every reply at once: their host agents may gather them
        with self._lock:
            self._pending[cid] = pending
        live, failures = (None, {}) if even_if_failed else self._split_failed(targets)
        for index, failure in failures.items():
            self._complete(cid, index, error=self._proc_error(pending, targets[index], failure))
        self._deliver_to(targets, live, header, body, buffers, idx=True,
                         mi=message_extent[1] if message_extent is not None else None)
        if not targets and future is not None:
            future._inner.set_result(ValueMesh(extent, []) if extent is not None else None)
        if streams is not None:
            return streams
        assert future is not None
        return future

    def _deliver(self, dst: str, header: CallHeader | PortHeader, body: bytes, buffers: list[memoryview]) -> None:
        local = self.local.get(dst)
        if local is not None:
            header["src"] = self.identity
            header["dst"] = dst
            local(header, body, buffers)
        else:
            self.channel.send(dst, header, body, buffers)

    def _live(self, targets: Sequence[Target]) -> list[int] | None:
        """The indices of ``targets`` whose procs have not failed; None: all of them."""
        return self._split_failed(targets)[0]

    def _split_failed(self, targets: Sequence[Target]) -> tuple[list[int] | None, dict[int, SupervisionError]]:
        """``(live indices or None for all, {index: its proc's failure})`` of ``targets``, read
        at once (a proc may recover on another thread meanwhile)."""
        failed = self._failed
        if not failed:
            return None, {}
        live: list[int] = []
        failures: dict[int, SupervisionError] = {}
        for index, target in enumerate(targets):
            failure = failed.get(route_id(target.proc))
            if failure is None:
                live.append(index)
            else:
                failures[index] = failure
        return live, failures

    def _deliver_to(self, targets: Sequence[Target], chosen: list[int] | None, header: CallHeader, body: bytes,
                    buffers: list[memoryview], *, idx: bool = False, mi: Sequence[int] | None = None) -> None:
        """Deliver ``header`` to ``targets[i]`` for each ``i`` of ``chosen`` (None: all), with
        its ``rank``, its ``idx`` (``i``) when ``idx``, and ``mi[i]`` when ``mi`` is given."""
        if chosen is None and len(targets) == 1:  # a call_one: its fields set at once (``header`` is this call's own)
            header["rank"] = targets[0].rank
            if idx:
                header["idx"] = 0
            if mi is not None:
                header["mi"] = mi[0]
            self._deliver(targets[0].proc, header, body, buffers)
            return
        if chosen is not None:
            targets = [targets[index] for index in chosen]
        each: dict[str, Sequence[Any]] = {"rank": [target.rank for target in targets]}
        if idx:
            each["idx"] = range(len(targets)) if chosen is None else chosen
        if mi is not None:
            each["mi"] = mi if chosen is None else [mi[index] for index in chosen]
        self._deliver_many([target.proc for target in targets], header, body, buffers, each)

    def _deliver_many(self, dsts: list[str], header: CallHeader, body: bytes, buffers: list[memoryview],
                      each: Mapping[str, Sequence[Any]]) -> None:
        """Deliver ``header`` plus each destination's own fields (``each[name][i]`` is
        ``dsts[i]``'s) to each of ``dsts``: local actors directly, the rest in one
        :meth:`Channel.send_many` (one message per host agent where the procs are linked to theirs)."""
        local = self.local
        if local and not local.keys().isdisjoint(dsts):
            remote = []
            for index, dst in enumerate(dsts):
                if dst in local:
                    self._deliver(dst, cast(CallHeader, fields_at(each, index, header)), body, buffers)
                else:
                    remote.append(index)
            dsts = [dsts[index] for index in remote]
            each = columns_at(each, remote)
        if len(dsts) == 1:
            self.channel.send(dsts[0], cast(CallHeader, fields_at(each, 0, header)), body, buffers)
        elif dsts:
            self.channel.send_many(dsts, header, body, buffers, each)

    def _forget(self, cid: str) -> None:
        with self._lock:
            self._pending.pop(cid, None)

    # -- replies --------------------------------------------------------------------------------
    def on_reply(self, header: ReplyHeader, body: Any, buffers: list[memoryview]) -> None:
        """Handle a ``reply`` message (IO thread, or a local actor's thread)."""
        cid = header.get("cid")
        pending = self._pending.get(cid)
        if pending is None:
            return  # cancelled or already failed: drop the late reply
        index = header.get("idx")
        if type(index) is not int or not 0 <= index < len(pending.targets):
            log.warning("dropped a reply of %s to call %s: index %r is not one of the call's", header.get("src"), cid, index)
            return
        self._take_reply(pending, cid, index, bool(header.get("ok")), body, buffers)

    def on_replies(self, header: RepliesHeader, body: Any, buffers: list[memoryview]) -> None:
        """Handle a host agent's ``replies`` (its procs' replies to one call, gathered; a relay's
        hold its hosts'; the channel checked that each is from a proc linked to that agent, or to
        any when the agent serves as a relay, and marked those it
        dropped with ``gk`` None: skipped here, their bytes passed over). A reply from another
        proc than the call's target at its index is dropped."""
        cid = header["cid"]
        pending = self._pending.get(cid)
        if pending is None:
            return
        view, offset = memoryview(body), 0
        targets = pending.targets
        results: list[tuple[int, Any, BaseException | None]] = []
        for item in header["gathered"]:
            if len(item) != 5 or type(item[4]) is not int or item[4] < 0 or offset + item[4] > len(view):
                log.warning("dropped the rest of gathered replies to call %s: a malformed item %r", cid, item)
                break
            src, gk, index, ok, nbytes = item
            chunk, offset = view[offset:offset + nbytes], offset + nbytes
            if gk is None:  # the channel dropped it (another incarnation's, or one it had)
                continue
            if type(index) is not int or not 0 <= index < len(targets) or route_id(targets[index].proc) != route_id(str(src)):
                log.warning("dropped a gathered reply of %s for index %r of call %s: not that call's target", src, index, cid)
                continue
            results.append((index, *self._reply_result(pending, index, bool(ok), chunk, [])))
        self._complete_many(cid, results)

    def _take_reply(self, pending: _PendingCall, cid: str, index: int, ok: bool, body: Any, buffers: list[memoryview]) -> None:
        self._complete_many(cid, [(index, *self._reply_result(pending, index, ok, body, buffers))])

    def _reply_result(self, pending: _PendingCall, index: int, ok: bool, body: Any,
                      buffers: list[memoryview]) -> tuple[Any, BaseException | None]:
        """``(value, None)`` or ``(None, error)`` of target ``index``'s reply."""
        try:
            payload = loads(body, buffers)
        except SerializationError as exc:
            return None, exc
        if ok:
            return payload, None
        target = pending.targets[index]
        return None, error_from_reply(payload, target.rank, target.coords, pending.actor, pending.endpoint)

    def _complete(self, cid: str, index: int, value: Any = None, error: BaseException | None = None) -> None:
        self._complete_many(cid, [(index, value, error)])

    def _complete_many(self, cid: str, results: Sequence[tuple[int, Any, BaseException | None]]) -> None:
        """Take ``(index, value, error)`` of each target that answered call ``cid`` (one taking
        of the lock for a host's gathered replies); complete its future(s) when due."""
        done: list[tuple[Future[Any], Any, BaseException | None]] = []  # stream slots to complete
        with self._lock:
            pending = self._pending.get(cid)
            if pending is None:
                return
            outstanding = pending.outstanding
            for index, value, error in results:
                if index not in outstanding:
                    continue
                outstanding.discard(index)
                if pending.streams is not None:
                    done.append((pending.streams[len(pending.targets) - len(outstanding) - 1], value, error))
                elif error is not None:
                    pending.errors.append(error)
                else:
                    pending.values[index] = value
            finished = not outstanding
            if finished:
                del self._pending[cid]
        for slot, value, error in done:
            inner = slot._inner
            if not inner.done():
                inner.set_exception(error) if error is not None else inner.set_result(value)
        if pending.streams is not None or not finished:
            return
        assert pending.future is not None  # not a stream: one Future for every reply
        inner = pending.future._inner
        if inner.done():
            return
        if pending.errors:
            first = sorted(pending.errors, key=lambda e: getattr(e, "rank", 0))[0]
            if isinstance(first, ActorError):
                first.others = [e for e in pending.errors if e is not first and isinstance(e, ActorError)]
            inner.set_exception(first)
        elif pending.extent is None:
            inner.set_result(pending.values[0])
        else:
            inner.set_result(ValueMesh(pending.extent, pending.values))

    # -- ports ----------------------------------------------------------------------------------
    def open_port(self, receiver: Any) -> tuple[str, str]:
        """Register ``receiver``; return (this process's routing identity, the port's id)."""
        port_id = f"p{next(self._port_ids)}"
        self._ports[port_id] = receiver
        receiver._lead = self.channel.lead
        return self.route, port_id

    def send_to_port(self, owner: str, port_id: str, ok: bool, value: Any, rank: int | None) -> None:
        """Deliver ``value`` to port ``port_id`` of ``owner`` (any thread).

        Raises:
            SerializationError: ``value`` cannot be pickled.
        """
        if owner == self.route:
            receiver = self._ports.get(port_id)
            if receiver is not None:
                receiver._deliver(ok, value, rank)
            return
        if not ok:
            try:
                body, buffers = dumps(value)
            except SerializationError:
                body, buffers = dumps(RuntimeError(f"{type(value).__name__}: {value}"))
        else:
            body, buffers = dumps(value)
        header: PortHeader = {"kind": Kind.PORT, "port": port_id, "ok": ok}
        if rank is not None:
            header["prank"] = rank
        self._deliver(owner, header, body, buffers)

    def on_port(self, header: PortHeader, body: Any, buffers: list[memoryview]) -> None:
        """Handle a ``port`` message: a value (or an error) for a port opened here."""
        receiver = self._ports.get(header.get("port", ""))
        if receiver is None:
            return
        try:
            value = loads(body, buffers)
        except SerializationError as exc:
            receiver._deliver(False, exc, header.get("prank"))
            return
        ok = bool(header.get("ok", True))
        if not ok and isinstance(value, dict) and ("type" in value or "supervision" in value):  # a reply's error
            value = error_from_reply(value, header.get("prank", -1), {}, "port", header.get("port", ""))
        receiver._deliver(ok, value, header.get("prank"))

    def _note_port_holders(self, ports: list[Port[Any]], targets: Sequence[Target]) -> None:
        procs = {route_id(t.proc) for t in targets}
        for port in ports:
            if port.owner == self.route:
                receiver = self._ports.get(port.port_id)
                if receiver is not None:
                    receiver._add_holders(procs)

    # -- supervision ----------------------------------------------------------------------------
    def proc_failed(self, proc: str, error: SupervisionError) -> None:
        """Fail in-flight calls to ``proc`` with ``error``; fail later calls fast."""
        proc = route_id(proc)
        self._failed[proc] = error
        with self._lock:
            hits = [
                (cid, i, p)
                for cid, p in self._pending.items()
                for i in p.outstanding
                if route_id(p.targets[i].proc) == proc
            ]
        for cid, index, pending in hits:
            self._complete(cid, index, error=self._proc_error(pending, pending.targets[index], error))
        if self._ports:
            failed = dict(self._failed)
            for receiver in list(self._ports.values()):
                receiver._holders_failed(failed)

    @staticmethod
    def _proc_error(pending: _PendingCall, target: Target, error: SupervisionError) -> SupervisionError:
        """The error a call to ``target`` gets when its proc failed."""
        where = "{" + ", ".join(f"'{k}': {v}" for k, v in target.coords.items()) + "}"
        return SupervisionError(target.rank, error.cause, error.detail, error.signal, f"{pending.actor}.{pending.endpoint}",
                                actor=f"<{pending.display}{where}>" if pending.actor and pending.endpoint != "__init__" else None)

    def proc_recovered(self, proc: str) -> None:
        self._failed.pop(route_id(proc), None)

    def failure_of(self, proc: str) -> SupervisionError | None:
        return self._failed.get(route_id(proc))

    def failed_procs(self) -> dict[str, SupervisionError]:
        """Procs known failed now (routing identity -> the error), not yet recovered."""
        return dict(self._failed)

    def fail_all(self, error_factory: Callable[[Target], BaseException]) -> None:
        """Fail every in-flight call (the channel is closing)."""
        with self._lock:
            hits = [(cid, i) for cid, p in self._pending.items() for i in p.outstanding]
        for cid, index in hits:
            pending = self._pending.get(cid)
            if pending is not None:
                self._complete(cid, index, error=error_factory(pending.targets[index]))

    def fail_calls_to(self, procs: set[str], error_factory: Callable[[Target], BaseException]) -> None:
        """Fail the in-flight calls to ``procs`` (a mesh was stopped)."""
        procs = {route_id(p) for p in procs}
        with self._lock:
            hits = [(cid, i) for cid, p in self._pending.items() for i in p.outstanding
                    if route_id(p.targets[i].proc) in procs]
        for cid, index in hits:
            pending = self._pending.get(cid)
            if pending is not None:
                self._complete(cid, index, error=error_factory(pending.targets[index]))
