"""Supervision policies: who handles a proc's failure, and how (``__supervise__``, restart, isolate).

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
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..errors import SupervisionError

if TYPE_CHECKING:
    from ..runtime.controller import Controller, ProcRecord

__all__ = ["Failure", "SupervisionPolicy", "Supervisor", "POLICIES"]

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
    coords: dict
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
    auto_restarts: dict = field(default_factory=dict)  # rank -> automatic restarts so far

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
        method = getattr(self.owner, "__supervise__", None)
        if callable(method):
            return method
        return self.owner if callable(self.owner) else None

    def backoff_for(self, rank: int) -> float:
        """Seconds to wait before the next automatic restart of ``rank``."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** self.auto_restarts.get(rank, 0)))


class Supervisor:
    """The controller's supervisor thread: runs owners' handlers and policies off the IO thread.

    The controller calls :meth:`on_failure` (any thread, never blocks); failures are handled one
    at a time, in the order they happened.
    """

    def __init__(self, controller: "Controller"):
        self.controller = controller
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="monarch_nb-supervisor", daemon=True)
        self._thread.start()

    def on_failure(self, rec: "ProcRecord", cause: str, detail: str, signame: str | None) -> None:
        """Queue the first failure of ``rec``'s current incarnation; later ones (e.g. the exit of a
        proc already reported hung) are the same failure and are ignored here."""
        if rec.failure is not None:
            return
        rec.failure = Failure(rec.mesh, rec.rank, dict(rec.coords), rec.pid, cause, signame, detail, time.time(), rec.restarts)
        self._queue.put((rec, rec.failure))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            rec, failure = item
            try:
                self._handle(rec, failure)
            except Exception:
                log.exception("supervising %s failed", rec.identity)

    def _current(self, rec: "ProcRecord", failure: Failure) -> bool:
        """The failure still stands: nobody restarted the proc meanwhile, its mesh runs."""
        mesh = self.controller.meshes.get(rec.mesh)
        return rec.failure is failure and mesh is not None and not mesh.stopped and rec.state in ("failed", "hung")

    def _handle(self, rec: "ProcRecord", failure: Failure) -> None:
        ctrl = self.controller
        mesh = ctrl.meshes.get(rec.mesh)
        if mesh is None or mesh.stopped:
            return
        policy: SupervisionPolicy = mesh.supervision
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
                ctrl._event("supervised", rec, detail=f"handled by {_name(policy.owner)}", cause=failure.cause)
                return
        else:
            why = "no owner handled it"
        if policy.policy == "isolate":
            ctrl._event("supervised", rec, detail=f"isolate policy: continuing without rank {rec.rank}", cause=failure.cause)
            return
        if policy.policy == "restart":
            done = policy.auto_restarts.get(rec.rank, 0)
            if done >= policy.max_restarts:
                self._escalate(rec, failure, f"{why}; max_restarts={policy.max_restarts} reached")
                return
            wait_s = policy.backoff_for(rec.rank)
            policy.auto_restarts[rec.rank] = done + 1
            ctrl._event(
                "supervised", rec, cause=failure.cause,
                detail=f"restart policy: restart {done + 1}/{policy.max_restarts} in {wait_s:.2f} s",
            )
            time.sleep(wait_s)
            if not self._current(rec, failure):
                return
            try:
                ctrl.restart_proc(rec.identity)
            except Exception as exc:
                self._escalate(rec, failure, f"automatic restart failed: {exc}")
            return
        self._escalate(rec, failure, why)

    def _escalate(self, rec: "ProcRecord", failure: Failure, why: str) -> None:
        log.info("unhandled failure of rank %d of %s (%s): %s; %s", rec.rank, rec.mesh, failure.cause, failure.detail, why)
        self.controller._event("escalated", rec, detail=f"{failure.detail} ({why})", cause=failure.cause)


def _name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or type(owner).__qualname__
