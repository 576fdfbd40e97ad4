"""Supervision events: typed records of what happened to procs and actors, in one ordered log.

Every failure, recovery and lifecycle change becomes an :class:`Event`. The controller appends
them to its :class:`EventLog`; widgets, the training loop and user callbacks subscribe.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time as _time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

__all__ = ["Event", "EventLog", "EVENT_KINDS"]

log = logging.getLogger(__name__)

#: kind -> meaning
EVENT_KINDS = {
    "proc_started": "a proc said hello and is serving",
    "proc_exited": "a proc exited while it was meant to run (exit code, signal, OOM kill)",
    "proc_stopped": "a proc exited because it was stopped",
    "proc_hung": "a proc missed heartbeats for longer than hang_timeout_s",
    "proc_fenced": "a hung proc was killed so that its peers are released",
    "proc_restarting": "a failed proc is being restarted in place",
    "proc_restarted": "a restarted proc is serving again, its actors respawned",
    "restart_skipped": "a restart was asked for a proc already being restarted: the one under way serves",
    "proc_paused": "a user holds one of the proc's actors at breakpoint() (paused, never fenced)",
    "proc_continued": "the proc's actors left breakpoint()",
    "proc_resumed": "a proc reported hung sent heartbeats again (fencing off): it is serving",
    "actor_error": "an endpoint raised; the proc is still alive",
    "host_lost": "a host agent went silent (killed, cut off): every proc of the host failed with cause host_lost",
    "host_returned": "a lost host serves again (attached again, or its old agent heard again and its procs fenced)",
    "fault_injected": "a fault was injected on purpose",
    "fault_fired": "an injected in-proc fault took effect (a call delayed by 'slow', a result poisoned by 'nan')",
    "supervised": "a failure was handled: by the owner's __supervise__, or by the restart / isolate policy",
    "escalated": "a failure nobody handled: calls to the rank raise SupervisionError",
}


@dataclass
class Event:
    """One supervision event.

    Attributes:
        kind: one of :data:`EVENT_KINDS`.
        rank: flat rank of the proc in its proc mesh (-1 if none).
        coords: its coordinates, dim -> index.
        pid: OS pid of the proc (0 if unknown).
        time: wall-clock seconds since the epoch when the controller recorded it.
        detail: a human-readable line.
        cause: machine-readable cause: "SIGKILL", "SIGSEGV", "exit 3", "heartbeat" (a hang),
            "fenced", "exception" (an endpoint raised), a fault kind ("nan", "slow"), ...
        mesh: the proc mesh's name.
        host: the host agent's name, for host events (``host_lost``, ``host_returned``).
        seq: position in the log (0-based), set by the log.
        monotonic: ``time.monotonic()`` at record time, for latency measurements.
    """

    kind: str
    rank: int = -1
    coords: dict[str, int] = field(default_factory=dict)
    pid: int = 0
    time: float = field(default_factory=_time.time)
    detail: str = ""
    cause: str = ""
    mesh: str = ""
    host: str = ""
    seq: int = -1
    monotonic: float = field(default_factory=_time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EventLog:
    """Append-only, ordered, thread-safe; subscribers are called on the appending thread."""

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: list[Event] = []
        self._lock = threading.Condition()
        self._subscribers: list[Callable[[Event], None]] = []
        self._seq = itertools.count()
        self.max_events = max_events

    def append(self, event: Event) -> Event:
        with self._lock:
            event.seq = next(self._seq)
            self._events.append(event)
            if len(self._events) > self.max_events:
                del self._events[: len(self._events) - self.max_events]
            subscribers = list(self._subscribers)
            self._lock.notify_all()
        for fn in subscribers:
            try:
                fn(event)
            except Exception:
                log.exception("event subscriber %r failed", fn)
        return event

    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``fn(event)`` for every new event; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    def events(self, kind: str | None = None, since_seq: int = 0) -> list[Event]:
        with self._lock:
            return [e for e in self._events if e.seq >= since_seq and (kind is None or e.kind == kind)]

    def wait_for(self, predicate: Callable[[Event], bool], timeout: float, since_seq: int = 0) -> Event | None:
        """Block until an event with ``seq >= since_seq`` satisfies ``predicate``; None on timeout."""
        deadline = _time.monotonic() + timeout
        with self._lock:
            while True:
                for event in self._events:
                    if event.seq >= since_seq and predicate(event):
                        return event
                left = deadline - _time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._events[-1].seq + 1 if self._events else 0

    def __len__(self) -> int:
        return len(self._events)
