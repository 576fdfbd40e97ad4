"""The user's training function on a thread of its own, run window by window. Runs in procs.

The Trainer actor (its thread serves the controller's calls) starts the training function on a
*loop thread* (:class:`LoopDriver`). The function runs until its ``ft.batches`` needs a step it
has not been given: there the loop thread *parks* (:meth:`LoopDriver.park`) with the result of
the window it just ran, and waits for the next order. The actor thread hands it one
(:meth:`LoopDriver.run`: a window of steps, or the end) and waits until it parks again (or the
function raises or returns). So every other call of the controller — join a quorum, heal, give a
gradient, checksum — runs on the actor thread while the loop thread is parked at a step
boundary, and the two never touch the replica at once; an evaluation is handed to the parked loop
thread itself (:meth:`LoopDriver.call`), which runs it and parks again. Messages from one sender are FIFO, so the
next window is usually waiting when the loop parks: ranks go from window to window without the
controller in between.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

__all__ = ["LoopDriver", "LoopState", "WindowOrder", "WindowStatus", "WindowReply", "FINISH", "LoopCall"]


class LoopState(str, Enum):
    """Where the user's function is."""

    IDLE = "idle"  # not started
    RUNNING = "running"  # the loop thread runs user code (or a window's steps)
    PARKED = "parked"  # waiting in ft.batches for the next order, at a step boundary
    RETURNED = "returned"  # the function returned
    RAISED = "raised"  # the function raised


@dataclass(frozen=True)
class WindowOrder:
    """Run steps ``start .. start+count-1`` in quorum ``quorum`` (see ``Trainer.run_window``)."""

    quorum: int
    start: int
    count: int
    split: frozenset
    snapshot: dict | None


class LoopCall:
    """A callable run on the parked loop thread (:meth:`LoopDriver.call`), with its outcome."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # the caller's to raise, on the actor thread: the loop goes on
            self.error = exc


class WindowStatus(str, Enum):
    """How a window ended on one rank (``WindowReply.status``)."""

    OK = "ok"  # every step of it applied
    COLLECTIVE_FAILED = "collective_failed"  # a step's all-reduce failed: a peer is gone; later steps not run
    NONFINITE = "nonfinite"  # a step's reduced gradient was not finite: not applied, later steps not run
    SKIPPED = "skipped"  # not this rank's quorum any more, or not its next step (queued behind one that stopped)


@dataclass(frozen=True)
class WindowReply:
    """What one rank tells the controller about a window (``Trainer.run_window``'s result).

    Attributes:
        rank, quorum, start: whose reply, in which quorum, for the window starting at which step.
        status: :class:`WindowStatus`. failed_step: the step that ended it early (None if none).
        error: why it ended early ("" if it did not). local_nonfinite: this rank's own gradient
            was not finite (``NONFINITE`` only: the culprit is this rank).
        loss, accuracy, digest, step_ms, grad_norm: one item per step applied in the window: mean
            loss per sample (or None), batch accuracy (or None),
            :func:`~monarch_nb.train.data.digest` of this rank's sample ids, milliseconds from the
            batch to the applied update, L2 norm of this rank's local gradient.
        next_step, applied_steps: the rank's counters after the window.
        snapshots: the snapshots it published since its last reply (dicts of the snapshot writer).
    """

    rank: int
    quorum: int
    start: int
    status: WindowStatus
    failed_step: int | None
    error: str
    local_nonfinite: bool
    loss: tuple
    accuracy: tuple
    digest: tuple
    step_ms: tuple
    grad_norm: tuple
    next_step: int
    applied_steps: int
    snapshots: tuple

    @property
    def steps_applied(self) -> int:
        return len(self.loss)


#: the order that ends ``ft.batches`` (the run is over)
FINISH = "finish"

_MOVES = {
    LoopState.IDLE: {LoopState.RUNNING},
    LoopState.RUNNING: {LoopState.PARKED, LoopState.RETURNED, LoopState.RAISED},
    LoopState.PARKED: {LoopState.RUNNING},
    LoopState.RETURNED: set(),
    LoopState.RAISED: set(),
}


class LoopDriver:
    """Runs ``fn(*args, **kwargs)`` on a loop thread and hands it orders at its boundaries.

    The loop thread calls :meth:`park`; the actor thread calls :meth:`start`, :meth:`run`,
    :meth:`finish`. The state moves only through :meth:`_move`, which checks the move.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, name: str):
        self.fn, self.args, self.kwargs, self.name = fn, args, kwargs, name
        self.state = LoopState.IDLE
        self.result: Any = None  # the parked window's result, then the function's return value
        self.error: BaseException | None = None
        self._order: Any = None
        self._cv = threading.Condition()

    def _move(self, new: LoopState) -> None:
        """The one place the state changes (under ``_cv``): a move the table does not allow is a bug."""
        if new not in _MOVES[self.state]:
            raise RuntimeError(f"training loop: {self.state.value} -> {new.value} is not a legal move")
        self.state = new
        self._cv.notify_all()

    # -- actor thread ------------------------------------------------------------------------------
    def start(self, timeout_s: float) -> None:
        """Start the function; return once it parks at its first boundary (its first ``ft.batches``).

        Raises:
            the function's own exception, if it raised before its first step;
            RuntimeError: it returned before asking for a step;
            TimeoutError: it did not get there within ``timeout_s``.
        """
        with self._cv:
            self._move(LoopState.RUNNING)
        threading.Thread(target=self._main, name=f"monarch_nb-loop-{self.name}", daemon=True).start()
        self._wait_off_running(timeout_s, "reach its first step")
        if self.state == LoopState.RETURNED:
            raise RuntimeError(f"the training function {self.name} returned before its first step: it must loop "
                               "over ft.batches(...)")

    def run(self, order: Any, timeout_s: float) -> Any:
        """Hand ``order`` (a :class:`WindowOrder` or :data:`FINISH`) to the parked loop; return the
        result it parks with next (or, after FINISH, the function's return value).

        Raises:
            the function's exception, if it raised meanwhile (or had raised before);
            RuntimeError: the function had already returned (a window after the end);
            TimeoutError: the loop neither parked nor ended within ``timeout_s``.
        """
        with self._cv:
            if self.state == LoopState.RAISED:
                raise self.error  # type: ignore[misc]
            if self.state == LoopState.RETURNED:
                if order == FINISH:
                    return self.result
                raise RuntimeError(f"the training function {self.name} has returned: ft.batches ended early "
                                   "(a break out of the loop?)")
            if self.state != LoopState.PARKED:
                raise RuntimeError(f"training loop is {self.state.value}, not parked at a step boundary")
            self._order = order
            self._move(LoopState.RUNNING)
        self._wait_off_running(timeout_s, "finish its window")
        return self.result

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """``fn()`` on the loop thread while it is parked at a step boundary (the thread the user's
        loop runs on, so ``fn`` sees the thread-local settings the loop made: the current
        CUDA/HIP device, grad mode, autocast); on the calling thread when the loop is not parked
        (not started, or its function has ended). Returns what ``fn`` returns.

        Raises:
            what ``fn`` raised (the loop stays parked, unharmed);
            TimeoutError: ``fn`` did not return within ``timeout_s``.
        """
        with self._cv:
            parked = self.state == LoopState.PARKED
            if parked:
                order = LoopCall(fn)
                self._order = order
                self._move(LoopState.RUNNING)
        if not parked:
            return fn()
        self._wait_off_running(timeout_s, "finish a call at its step boundary")
        if order.error is not None:
            raise order.error
        return order.value

    def _wait_off_running(self, timeout_s: float, what: str) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self.state != LoopState.RUNNING, timeout_s):
                raise TimeoutError(f"the training function did not {what} within {timeout_s:.0f} s")
            if self.state == LoopState.RAISED:
                raise self.error  # type: ignore[misc]

    # -- loop thread --------------------------------------------------------------------------------
    def park(self, result: Any) -> Any:
        """At a step boundary: report ``result`` (the window just run, or None) and wait for the
        next order; returns it. A :class:`LoopCall` handed in meanwhile runs here, and the loop
        parks again."""
        while True:
            with self._cv:
                self.result = result
                self._order = None
                self._move(LoopState.PARKED)
                self._cv.wait_for(lambda: self.state == LoopState.RUNNING)
                order = self._order
            if not isinstance(order, LoopCall):
                return order
            order.run()  # then park again at the same boundary, with the same result

    def _main(self) -> None:
        try:
            value = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # the user's error: the next call of the actor thread raises it
            with self._cv:
                self.error = exc
                self.result = None
                self._move(LoopState.RAISED)
            return
        finally:
            sys.stdout.flush()
        with self._cv:
            self.result = value
            self._move(LoopState.RETURNED)
