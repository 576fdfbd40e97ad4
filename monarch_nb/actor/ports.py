"""Ports and channels: send any number of values to whoever opened the port, in order.

``port, receiver = Channel.open()`` opens a port on the calling process (the controller, or the
proc of the actor that calls it). The :class:`Port` is picklable: pass it to any actor as an
endpoint argument, and ``port.send(value)`` from there (any thread) delivers ``value`` to
``receiver.recv()`` (a :class:`~monarch_nb.actor.future.Future`), in the order each sender sent
them. ``port.exception(err)`` makes the next ``recv()`` raise ``err``. ``Channel.open(once=True)``
opens a port that takes one value. ``Channel.open_ranked()`` gives a receiver of ``(rank,
value)`` pairs, for ports that the runtime fills with replies (``send(endpoint, ..., port=port)``).

Beyond Monarch: a ``recv()`` on a port whose every holder (the procs it was passed to in a call)
has died raises :class:`~monarch_nb.errors.SupervisionError` instead of waiting forever.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Generic, Iterable, TypeVar

from ..errors import SupervisionError
from . import backend
from .future import Future

__all__ = ["Port", "PortReceiver", "RankedPortReceiver", "Channel", "collect_pickled_ports"]

R = TypeVar("R")

_collect = threading.local()


class collect_pickled_ports:
    """``with collect_pickled_ports() as ports:`` lists the Ports pickled on this thread meanwhile
    (the runtime learns which procs a port was handed to)."""

    def __enter__(self) -> list[Port[Any]]:
        self.saved = getattr(_collect, "ports", None)
        ports: list[Port[Any]] = []
        _collect.ports = ports
        return ports

    def __exit__(self, *exc: Any) -> None:
        _collect.ports = self.saved


class Port(Generic[R]):
    """The sending end of a channel. Picklable; ``send`` works from any thread of any process.

    Attributes:
        owner: routing identity of the process that holds the receiver.
        port_id: the port's id there.
        once: the port takes one value.
    """

    def __init__(self, owner: str, port_id: str, once: bool = False, rank: int | None = None) -> None:
        self.owner = owner
        self.port_id = port_id
        self.once = once
        self.rank = rank
        self._used = False

    def send(self, obj: R) -> None:
        """Deliver ``obj`` to the receiver (fire and forget; in order per sender).

        Raises:
            ValueError: a once-port was already used.
            SerializationError: ``obj`` cannot be pickled.
        """
        self._use()
        backend.current().send_to_port(self.owner, self.port_id, True, obj, self.rank)

    def exception(self, exc: BaseException) -> None:
        """Make the receiver's next ``recv()`` raise ``exc``."""
        self._use()
        backend.current().send_to_port(self.owner, self.port_id, False, exc, self.rank)

    def _use(self) -> None:
        if self.once:
            if self._used:
                raise ValueError("OncePort is already used")
            self._used = True

    @property
    def return_undeliverable(self) -> bool:
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        ports = getattr(_collect, "ports", None)
        if ports is not None:
            ports.append(self)
        return Port, (self.owner, self.port_id, self.once, self.rank)

    def __repr__(self) -> str:
        return f"<Port {self.port_id} of {self.owner}{' (once)' if self.once else ''}>"


class PortReceiver(Generic[R]):
    """The receiving end: ``recv()`` is a Future of the next value, in arrival order."""

    def __init__(self, once: bool = False) -> None:
        self.once = once
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[bool, Any, int | None]] = collections.deque()  # (ok, value, rank)
        self._waiters: collections.deque[Future[R]] = collections.deque()
        self._holders: set[str] = set()
        self._orphaned: SupervisionError | None = None
        self.port_id = ""
        self._lead: Callable[..., bool] | None = None  # the runtime's lead(): a recv() waits by receiving on its own thread

    def recv(self) -> "Future[R]":
        """A Future of the next value (raises what ``port.exception`` sent, or SupervisionError
        when every proc holding the port died with nothing left to receive)."""
        with self._lock:
            if self._items:
                return self._finish(Future(), *self._items.popleft())
            if self._orphaned is not None:
                return Future.completed(error=self._orphaned)
            fut: Future[R] = Future(lead=self._lead)
            self._waiters.append(fut)
            return fut

    def _finish(self, fut: Future[R], ok: bool, value: Any, rank: int | None) -> Future[R]:
        value = self._shape(value, rank) if ok else value
        if ok:
            fut._inner.set_result(value)
        else:
            fut._inner.set_exception(value if isinstance(value, BaseException) else RuntimeError(str(value)))
        return fut

    def _shape(self, value: Any, rank: int | None) -> Any:
        return value

    # -- the runtime's side -------------------------------------------------------------------
    def _deliver(self, ok: bool, value: Any, rank: int | None) -> None:
        with self._lock:
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    break
            else:
                self._items.append((ok, value, rank))
                return
        self._finish(fut, ok, value, rank)

    def _add_holders(self, procs: Iterable[str]) -> None:
        with self._lock:
            self._holders.update(procs)

    def _holders_failed(self, failed: dict[str, SupervisionError]) -> None:
        """Every holder in ``failed`` (proc -> error): pending and later receives fail."""
        with self._lock:
            if not self._holders or not self._holders <= set(failed):
                return
            error = failed[sorted(self._holders)[0]]
            self._orphaned = SupervisionError(error.rank, error.cause, f"every sender of port {self.port_id} died: {error.detail}",
                                              error.signal)
            waiters, self._waiters = list(self._waiters), collections.deque()
        for fut in waiters:
            if not fut.done():
                fut._inner.set_exception(self._orphaned)


class RankedPortReceiver(PortReceiver[R]):
    """Receives ``(rank, value)``; every value must have come with a rank."""

    def _shape(self, value: Any, rank: int | None) -> Any:
        if rank is None:
            raise ValueError("RankedPort receiver got a message without a rank: values sent with "
                             "port.send() carry none; use Channel.open() for those")
        return rank, value

    def _finish(self, fut: Future[R], ok: bool, value: Any, rank: int | None) -> Future[R]:
        if ok:
            try:
                value = self._shape(value, rank)
            except ValueError as exc:
                fut._inner.set_exception(exc)
                return fut
            fut._inner.set_result(value)
            return fut
        return super()._finish(fut, ok, value, rank)


class Channel(Generic[R]):
    """Opens ports: ``port, receiver = Channel.open()`` (``Channel[int].open()`` works too)."""

    @staticmethod
    def open(once: bool = False) -> "tuple[Port[R], PortReceiver[R]]":
        """A new port on this process and its receiver; ``once=True``: the port takes one value."""
        return _open(PortReceiver(once))

    @staticmethod
    def open_ranked(once: bool = False) -> "tuple[Port[R], RankedPortReceiver[R]]":
        """A new port whose receiver gives ``(rank, value)`` (values must carry a rank)."""
        return _open(RankedPortReceiver(once))


_Receiver = TypeVar("_Receiver", bound=PortReceiver[Any])


def _open(receiver: _Receiver) -> tuple[Port[Any], _Receiver]:
    owner, port_id = backend.current().open_port(receiver)
    receiver.port_id = port_id
    return Port(owner, port_id, receiver.once), receiver
