"""The calling side of a process: send endpoint calls, match replies, fail calls to dead procs.

Every process that calls endpoints has one :class:`Messenger`: the controller, and each proc
(actors call other actors). A call to a mesh slice sends one message per member and returns a
:class:`~monarch_nb.actor.future.Future` that completes when every member replied (a
:class:`~monarch_nb.actor.value_mesh.ValueMesh`) or when one failed (the error, with the other
ranks' errors attached). When the controller learns that a proc died it tells every messenger;
in-flight calls to it fail with :class:`~monarch_nb.errors.SupervisionError` and later calls
fail fast until the proc is restarted.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..actor.backend import Target
from ..actor.future import Future
from ..actor.shape import Extent
from ..actor.value_mesh import ValueMesh
from ..errors import ActorError, SupervisionError, error_from_reply
from ..transport.channel import Channel
from ..transport.serialization import SerializationError, dumps, loads
from ..transport.wire import route_id
from .protocol import Kind

__all__ = ["Messenger"]

log = logging.getLogger(__name__)


@dataclass
class _PendingCall:
    targets: list[Target]
    actor: str
    endpoint: str
    extent: Extent | None  # None: a single value (call_one / choose)
    future: Future
    values: list = field(default_factory=list)
    outstanding: set = field(default_factory=set)
    errors: list = field(default_factory=list)


class Messenger:
    """Issues calls over ``channel`` and completes their futures from replies (thread-safe)."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.identity = channel.identity
        self._pending: dict[str, _PendingCall] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._failed: dict[str, SupervisionError] = {}

    # -- calling --------------------------------------------------------------------------------
    def send(
        self,
        targets: Sequence[Target],
        actor: str,
        endpoint: str,
        args: tuple,
        kwargs: dict,
        *,
        extent: Extent | None,
        want_reply: bool = True,
    ) -> Future | None:
        """Send ``actor.endpoint(*args, **kwargs)`` to each target.

        Args:
            extent: the result's extent (a ValueMesh), or None for one bare value.
            want_reply: False for ``broadcast`` (fire and forget); returns None then.

        Raises:
            SerializationError: an argument cannot be pickled; nothing was sent.
        """
        body, buffers = dumps((args, kwargs))
        return self.send_raw(targets, Kind.CALL, actor, body, buffers, extent=extent, endpoint=endpoint, want_reply=want_reply)

    def send_raw(
        self,
        targets: Sequence[Target],
        kind: str,
        actor: str,
        body: bytes,
        buffers: list,
        *,
        extent: Extent | None,
        endpoint: str = "__init__",
        want_reply: bool = True,
        even_if_failed: bool = False,
    ) -> Future | None:
        """Send an already-pickled ``kind`` message ("call" or "spawn") to each target.

        ``even_if_failed`` sends to procs marked failed (respawning actors on a restarted proc).
        """
        header = {"kind": kind, "actor": actor, "ep": endpoint}
        if not want_reply:
            for target in targets:
                if route_id(target.proc) not in self._failed:
                    self.channel.send(target.proc, dict(header, rank=target.rank), body, buffers)
            return None
        cid = f"{self.identity}:{next(self._ids)}"
        future: Future = Future(on_timeout=lambda: self._forget(cid))
        pending = _PendingCall(list(targets), actor, endpoint, extent, future, [None] * len(targets))
        pending.outstanding = set(range(len(targets)))
        header["cid"] = cid
        header["reply_to"] = self.identity
        with self._lock:
            self._pending[cid] = pending
        for index, target in enumerate(targets):
            failure = None if even_if_failed else self._failed.get(route_id(target.proc))
            if failure is not None:
                self._complete(cid, index, error=SupervisionError(target.rank, failure.cause, failure.detail, failure.signal))
                continue
            self.channel.send(target.proc, dict(header, idx=index, rank=target.rank), body, buffers)
        return future

    def _forget(self, cid: str) -> None:
        with self._lock:
            self._pending.pop(cid, None)

    # -- replies --------------------------------------------------------------------------------
    def on_reply(self, header: dict, body: Any, buffers: list) -> None:
        """Handle a ``reply`` message (IO thread)."""
        cid, index = header.get("cid"), header.get("idx")
        if cid not in self._pending:
            return  # timed out or already failed: drop the late reply
        try:
            payload = loads(body, buffers)
        except SerializationError as exc:
            self._complete(cid, index, error=exc)
            return
        if header.get("ok"):
            self._complete(cid, index, value=payload)
        else:
            pending = self._pending.get(cid)
            if pending is None:
                return
            target = pending.targets[index]
            self._complete(cid, index, error=error_from_reply(payload, target.rank, target.coords, pending.actor, pending.endpoint))

    def _complete(self, cid: str, index: int, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            pending = self._pending.get(cid)
            if pending is None or index not in pending.outstanding:
                return
            pending.outstanding.discard(index)
            if error is not None:
                pending.errors.append(error)
            else:
                pending.values[index] = value
            if pending.outstanding:
                return
            del self._pending[cid]
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

    # -- supervision ----------------------------------------------------------------------------
    def proc_failed(self, proc: str, error: SupervisionError) -> None:
        """Fail in-flight calls to ``proc`` with ``error``; fail later calls fast."""
        proc = route_id(proc)
        self._failed[proc] = error
        with self._lock:
            hits = [
                (cid, i)
                for cid, p in self._pending.items()
                for i in p.outstanding
                if route_id(p.targets[i].proc) == proc
            ]
        for cid, index in hits:
            target = self._pending[cid].targets[index] if cid in self._pending else None
            rank = target.rank if target else error.rank
            self._complete(cid, index, error=SupervisionError(rank, error.cause, error.detail, error.signal))

    def proc_recovered(self, proc: str) -> None:
        self._failed.pop(route_id(proc), None)

    def failure_of(self, proc: str) -> SupervisionError | None:
        return self._failed.get(route_id(proc))

    def fail_all(self, error_factory) -> None:
        """Fail every in-flight call (the channel is closing)."""
        with self._lock:
            hits = [(cid, i) for cid, p in self._pending.items() for i in p.outstanding]
        for cid, index in hits:
            pending = self._pending.get(cid)
            if pending is not None:
                self._complete(cid, index, error=error_factory(pending.targets[index]))


