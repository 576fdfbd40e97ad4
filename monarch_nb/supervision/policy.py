"""Supervision policies: who handles a proc's failure, and how (``__supervise__``, restart, isolate).

This module is the decision (:func:`decide`); the runtime's supervisor thread
(:mod:`monarch_nb.runtime.supervisor`) carries it out and records the events.

A proc mesh is supervised by its owner, the controller-side code that spawned it. When one of its
procs fails (it exited, was killed, or was reported hung), the controller

1. fails the calls in flight to that proc with :class:`~monarch_nb.errors.SupervisionError`
   (naming rank, cause and signal) and makes later calls to it fail fast, while calls to healthy
   ranks keep working. A dead process cannot answer, so this happens whatever the policy: as in
   Monarch, handling a failure decides whether it *propagates*, not whether lost work comes back;
2. asks the owner, on the supervisor thread (never the IO thread), ``owner.__supervise__(failure)``
   (or ``owner(failure)`` for a plain callable). ``True`` means handled: a ``supervised`` event is
   recorded and nothing else happens (the owner may restart the rank itself, ``procs.restart(r)``,
   which may block: it runs off the IO thread);
3. otherwise applies the mesh's policy:

   - ``"escalate"`` (default): an ``escalated`` event (and an INFO log line). The controller is a
     notebook kernel, so escalation never exits the process nor interrupts the main thread: it
     surfaces as ``SupervisionError`` in the calls to the failed rank and as the event, which the
     tree widget and subscribers see;
   - ``"restart"``: wait ``backoff_s * 2**k`` seconds (k = automatic restarts of this rank so far,
     capped at ``backoff_max_s``) and restart the proc in place (same rank and coordinates, new
     pid, actors respawned); after ``max_restarts`` automatic restarts of a rank, escalate;
   - ``"isolate"``: continue without the rank (handled, a ``supervised`` event; it stays failed
     until someone restarts it).

Example::

    procs = this_host().spawn_procs(per_host={"gpus": 4})
    procs.supervise("restart", max_restarts=3, backoff_s=0.5)

    class Trainer:
        def __supervise__(self, failure: Failure) -> bool:
            print(f"rank {failure.rank} failed: {failure.cause}")
            return failure.cause != "SIGSEGV"      # handled, except segfaults

    procs.supervise("escalate", owner=Trainer())
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import SupervisionError

__all__ = ["Failure", "SupervisionPolicy", "Decision", "decide", "POLICIES"]

log = logging.getLogger(__name__)

#: policy name -> meaning
POLICIES = {
    "escalate": "the failure surfaces as SupervisionError in calls to the rank and as an 'escalated' event",
    "restart": "restart the proc in place after a backoff, up to max_restarts times per rank, then escalate",
    "isolate": "continue without the failed rank (it stays failed until restarted by hand)",
}


@dataclass(frozen=True)
class Failure:
    """What ``__supervise__`` receives: one proc of a mesh failed.

    Attributes:
        mesh: the proc mesh's name.
        rank: the failed proc's flat rank.
        coords: its coordinates, dim -> index.
        pid: its OS pid (0 if it never started).
        cause: ``"SIGKILL"``, ``"SIGSEGV"``, ``"exit 3"``, ``"hung"``, ``"fenced"``, ...
        signal: the signal that ended it, or None.
        detail: a human-readable line.
        time: wall-clock seconds since the epoch when the controller saw it.
        restarts: how many times this rank was restarted before.
    """

    mesh: str
    rank: int
    coords: dict[str, int]
    pid: int
    cause: str
    signal: str | None
    detail: str
    time: float
    restarts: int

    def error(self) -> SupervisionError:
        """The :class:`SupervisionError` callers see for this failure."""
        return SupervisionError(self.rank, self.cause, self.detail, self.signal)


@dataclass
class SupervisionPolicy:
    """How a proc mesh's failures are handled; set with :meth:`ProcMesh.supervise`.

    Attributes:
        policy: ``"escalate"`` (default), ``"restart"`` or ``"isolate"`` (see :data:`POLICIES`).
        max_restarts: automatic restarts allowed per rank (restart policy), >= 0.
        backoff_s: seconds before the first automatic restart of a rank; doubles each time.
        backoff_max_s: the backoff's cap, seconds.
        owner: an object with ``__supervise__(failure) -> bool``, or a callable ``f(failure) -> bool``,
            asked first; None for none.
    """

    policy: str = "escalate"
    max_restarts: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    owner: Any = None
    auto_restarts: dict[int, int] = field(default_factory=dict)  # rank -> automatic restarts so far

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown supervision policy {self.policy!r}; valid: {', '.join(POLICIES)}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        for name in ("backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.owner is not None and self.handler() is None:
            raise TypeError(f"owner {self.owner!r} has no __supervise__ method and is not callable")

    def handler(self) -> Callable[[Failure], Any] | None:
        """The owner's ``__supervise__`` (or the owner itself if it is a plain callable)."""
        if self.owner is None:
            return None
        method: Callable[[Failure], Any] | None = getattr(self.owner, "__supervise__", None)
        if callable(method):
            return method
        owner: Callable[[Failure], Any] | None = self.owner if callable(self.owner) else None
        return owner

    def backoff_for(self, rank: int) -> float:
        """Seconds to wait before the next automatic restart of ``rank``."""
        return min(self.backoff_max_s, self.backoff_s * (2.0 ** self.auto_restarts.get(rank, 0)))


@dataclass(frozen=True)
class Decision:
    """What to do about one failure (see :func:`decide`).

    Attributes:
        action: ``"handled"`` (the owner handled it), ``"isolate"``, ``"restart"`` or ``"escalate"``.
        detail: a human-readable line for the event the runtime records.
        wait_s: with ``"restart"``, seconds to wait before restarting.
    """

    action: str
    detail: str
    wait_s: float = 0.0


def decide(policy: SupervisionPolicy, failure: Failure) -> Decision:
    """Ask the owner, then apply ``policy`` to ``failure`` (see the module docstring).

    The owner's ``__supervise__`` runs here, on the caller's thread (the runtime's supervisor
    thread); an owner that raises counts as not handled. A ``"restart"`` decision counts against
    ``max_restarts`` of the failed rank.
    """
    handler = policy.handler()
    if handler is not None:
        try:
            handled = handler(failure) is True
        except Exception as exc:
            log.exception("%r.__supervise__ raised; escalating", policy.owner)
            handled, why = False, f"__supervise__ raised {type(exc).__name__}: {exc}"
        else:
            why = "__supervise__ returned False"
        if handled:
            return Decision("handled", f"handled by {_name(policy.owner)}")
    else:
        why = "no owner handled it"
    if policy.policy == "isolate":
        return Decision("isolate", f"isolate policy: continuing without rank {failure.rank}")
    if policy.policy == "restart":
        done = policy.auto_restarts.get(failure.rank, 0)
        if done >= policy.max_restarts:
            return Decision("escalate", f"{failure.detail} ({why}; max_restarts={policy.max_restarts} reached)")
        wait_s = policy.backoff_for(failure.rank)
        policy.auto_restarts[failure.rank] = done + 1
        return Decision("restart", f"restart policy: restart {done + 1}/{policy.max_restarts} in {wait_s:.2f} s", wait_s)
    return Decision("escalate", f"{failure.detail} ({why})")


def _name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or type(owner).__qualname__
