"""The controller's supervisor thread: carries out supervision decisions off the IO thread.

The controller hands it each proc failure (:meth:`Supervisor.on_failure`, any thread, never
blocks); failures are handled one at a time, in the order they happened. For each, the mesh's
policy decides (:func:`monarch_nb.supervision.policy.decide`, which asks the owner's
``__supervise__`` first) and this thread records the ``supervised`` / ``escalated`` event and,
for the restart policy, waits out the backoff and restarts the proc. Of its controller it sees
only :class:`SupervisorController`: the meshes' records, the event log, a restart.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..supervision.policy import Failure, decide
from ..supervision.records import ProcRecord, ProcState

if TYPE_CHECKING:
    from ..supervision.events import Event
    from ..supervision.records import ProcMeshRecord

__all__ = ["Supervisor", "SupervisorController"]

log = logging.getLogger(__name__)


class SupervisorController(Protocol):
    """What :class:`Supervisor` uses of its controller (:class:`~.controller.Controller` is one)."""

    @property
    def meshes(self) -> dict[str, ProcMeshRecord]:
        """Proc mesh name -> its record (its supervision policy, whether it was stopped)."""

    def record_event(self, kind: str, rec: ProcRecord, **fields: Any) -> Event:
        """Append an event about ``rec``'s proc to the log (``supervised``, ``escalated``)."""

    def restart_proc(self, mesh: str, rank: int, timeout_s: float = 30.0) -> None:
        """Restart rank ``rank`` of ``mesh`` in place; blocks until it serves again (raises if it does not)."""


class Supervisor:
    """Runs owners' handlers and policies for ``controller``'s meshes on a thread of its own."""

    def __init__(self, controller: SupervisorController):
        self.controller = controller
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="monarch_nb-supervisor", daemon=True)
        self._thread.start()

    def on_failure(self, rec: ProcRecord, cause: str, detail: str, signame: str | None, *, handle: bool = True) -> None:
        """Record and queue the first failure of ``rec``'s current incarnation; later ones (e.g. the
        exit of a proc already reported hung) are the same failure and are ignored here. Not
        ``handle``: recorded only (a proc that never served: its ``spawn_procs`` deals with it)."""
        if rec.failure is not None:
            return
        rec.failure = Failure(rec.mesh, rec.rank, dict(rec.coords), rec.pid, cause, signame, detail, time.time(), rec.restarts)
        if handle:
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

    def _current(self, rec: ProcRecord, failure: Failure) -> bool:
        """The failure still stands: nobody restarted the proc meanwhile, its mesh runs."""
        mesh = self.controller.meshes.get(rec.mesh)
        return (rec.failure is failure and mesh is not None and not mesh.stopped
                and rec.state in (ProcState.FAILED, ProcState.HUNG))

    def _handle(self, rec: ProcRecord, failure: Failure) -> None:
        ctrl = self.controller
        mesh = ctrl.meshes.get(rec.mesh)
        if mesh is None or mesh.stopped:
            return
        assert mesh.supervision is not None  # every proc mesh gets one when it is spawned
        decision = decide(mesh.supervision, failure)
        if decision.action == "escalate":
            self._escalate(rec, failure, decision.detail)
            return
        ctrl.record_event("supervised", rec, detail=decision.detail, cause=failure.cause)
        if decision.action != "restart":
            return
        time.sleep(decision.wait_s)
        if not self._current(rec, failure):
            return
        try:
            ctrl.restart_proc(rec.mesh, rec.rank)
        except Exception as exc:
            self._escalate(rec, failure, f"{failure.detail} (automatic restart failed: {exc})")

    def _escalate(self, rec: ProcRecord, failure: Failure, detail: str) -> None:
        log.info("unhandled failure of rank %d of %s (%s): %s", rec.rank, rec.mesh, failure.cause, detail)
        self.controller.record_event("escalated", rec, detail=detail, cause=failure.cause)
