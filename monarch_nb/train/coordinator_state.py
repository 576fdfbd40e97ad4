"""What the coordinator's rooms share: one run's step-loop state, declared and set up in one place.

The coordinator of a run is one object on the run's training thread, built from rooms that each
own a concern: :class:`~.launch.Launch` (spawn, build, resume), :class:`~.boundaries.Boundaries`
(act between windows) and :class:`~.coordinator.Coordinator` (send windows, commit steps). They
all read and write the fields below, and only from that thread (the other threads reach the
coordinator through its event queue, see :mod:`.events`). :func:`~.report.build_report` reads
them when the run ends.
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING, Any, Iterator

from ..faults.spec import FaultSpec
from .events import RunEvent
from .recovery import Membership
from .trainer_loop import WindowReply

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh
    from ..actor.future import Future
    from ..faults.chaos import ChaosSchedule
    from .options import TrainOptions
    from .run import TrainingRun

__all__ = ["CoordinatorState", "Window"]


class Window:
    """Steps ``start .. start+count-1``, sent to ``members`` of ``quorum``; replies by rank."""

    __slots__ = ("id", "quorum", "members", "start", "count", "replies", "oldest_since")

    def __init__(self, wid: int, quorum: int, members: list[int], start: int, count: int):
        self.id, self.quorum, self.members, self.start, self.count = wid, quorum, tuple(members), start, count
        self.replies: dict[int, WindowReply | BaseException] = {}  # the rank's reply, or why there is none
        self.oldest_since = time.monotonic()

    @property
    def complete(self) -> bool:
        return len(self.replies) == len(self.members)


class CoordinatorState:
    """The fields of one run's coordinator (see the module docstring), in their initial state.

    Args:
        run: the run it drives.
    """

    procs: "ProcMesh"  #: the run's proc mesh (set by Launch._spawn)
    store_host: str  #: where the run's rendezvous store listens (set by Launch._spawn)

    def __init__(self, run: "TrainingRun"):
        self.run = run
        self.o: "TrainOptions" = run.options
        self.events: "queue.SimpleQueue[RunEvent]" = queue.SimpleQueue()  # see .events: who puts what
        self.m = Membership(run, self.events)
        self.mesh_name = ""
        self.spares = 0
        self.windows: list[Window] = []  # in flight or answered, not yet committed
        self.history: list[tuple[int, int, tuple[int, ...]]] = []  # (start, count, members) of every window sent
        self._wids: Iterator[int] = iter(range(1 << 62))
        self.next_commit = 0  # the first step not committed yet
        self.next_dispatch = 0  # the first step not sent yet
        self.start_step = 0  # where this run started (> 0 when resumed)
        self.recover = False  # a failure waits for the next boundary
        self.nonfinite_at: int | None = None  # a step whose gradient was not finite, to redo
        self.rank_next: dict[int, int] = {}  # rank -> the next step it reported running
        self.planned: dict[int, list[FaultSpec]] = {}  # step -> the faults injected before it
        self.split_steps: set[int] = set()  # steps whose batch is split (a redo after a non-finite gradient)
        self.step_s: float | None = None  # the measured time of one step, seconds
        self.step_ms: list[float] = []
        self.productive_s = 0.0  # seconds of committed steps
        self.attempts_failed = 0
        self.pending_evals: dict[int, dict[str, Any]] = {}  # step -> its evaluation's metrics, once answered
        self.checkpoint_lost = False  # a disk checkpoint's writer failed before it answered
        self.checkpoint_failures = 0  # in a row (see Coordinator._checkpoint_failed)
        self.snapshot_path = ""
        self.snapshots: list[dict[str, Any]] = []
        self.restores: list[dict[str, Any]] = []
        self.redone_from_snapshot = 0
        self.chaos: "ChaosSchedule | None" = None
        self.t_train0 = time.monotonic()
        self.t_last_commit = self.t_train0
        self.t_end: float | None = None  # training ended: the last rejoin waited for, or the stop seen
        self.fresh_replicas = False  # the next quorum's members are untrained: they take one's model first
        self.setup_s = 0.0

    # -- what the step loop implements, for the rooms that call it (see Coordinator) -------------------
    def _wait_event(self, timeout_s: float = 1.0) -> None:
        raise NotImplementedError

    def _commit_upto(self, upto: int) -> None:
        raise NotImplementedError

    def _send_checkpoint(self, writer: int, next_step: int) -> "Future[Any]":
        raise NotImplementedError

    def _checkpoint_failed(self, rank: int, exc: BaseException) -> None:
        raise NotImplementedError
