"""Failures, restarts, quorums and heals of a training run: who is live, and how ranks come back.

:class:`Membership` runs on the run's training thread (the coordinator's), except for three
entry points called by other threads, which only queue or record: :meth:`Membership.on_event`
(the controller's event log: opens and times failure records), :meth:`Membership.supervise`
(the mesh owner's ``__supervise__``) and the restart threads. Every other decision is taken on
the training thread, so a rank's state changes in one place:

    live ──fail──> restarting ──restart done──> ready ──heal──> live
                       ▲                           │
                       └───────────fail────────────┘

One restart per failure: a failure reported for a rank that is already restarting (the same
incarnation seen twice: its exit and the error of a call in flight, or a stale report of a
replaced incarnation) is ignored. A restart is tried three times, each within
``restart_timeout_s``; then the rank stays out and the run goes on without it. When the run
stops, restart threads end quietly (no traceback after the run's last word).

A *quorum* is one process group of the live ranks (torchft's term; "epoch" means a pass over the
data only). Forming one is a barrier in the controller's rendezvous store that the controller
aborts if a member fails meanwhile; it is retried without the failed ranks.

A rank's state (:class:`RankState`) changes only in :meth:`Membership.move`, which checks the
move against the diagram's table. Rank states, failure records, restarts and quorums are one state
machine driven from one thread, so they stay in one module; waiting on every rank's reply is
:mod:`.waits`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ActorError, MeshStoppedError, SupervisionError
from ..supervision.records import ProcState
from .events import RankFailed, RankReady, RestartFailed, RunEvent
from .healing import Healing
from .rank_procs import RankProcs
from .replica_checksum import ReplicaChecksum
from .report import FailureRecord
from .sharding import GroupLayout
from .waits import wait_all

if TYPE_CHECKING:
    from .run import TrainingRun

__all__ = ["Membership", "TrainingError", "RankState"]

log = logging.getLogger(__name__)

_PEER_ERRORS = ("CollectiveError", "QuorumAborted")
_RESTART_ATTEMPTS = 3


class TrainingError(RuntimeError):
    """The run cannot go on (every rank failed and nothing can restore it, or no quorum forms)."""


class GroupFailed(RuntimeError):
    """A rank is taken out because a partner of its replica group failed (a sharded run: the
    group's collectives cannot go on without it, so the whole group restarts)."""


class RankState(str, Enum):
    """A training rank's state in its run (see the module docstring's diagram)."""

    LIVE = "live"
    RESTARTING = "restarting"
    READY = "ready"  # restarted, waiting to be healed and join a quorum
    OUT = "out"  # its restarts failed; the run goes on without it


#: the moves :meth:`Membership.move` allows (None: a rank the run has not constructed yet)
_MOVES: dict[RankState | None, frozenset[RankState]] = {
    None: frozenset({RankState.LIVE, RankState.RESTARTING}),
    RankState.LIVE: frozenset({RankState.RESTARTING}),
    RankState.RESTARTING: frozenset({RankState.READY, RankState.OUT}),
    RankState.READY: frozenset({RankState.LIVE, RankState.RESTARTING}),
    RankState.OUT: frozenset(),
}


def own_failure(exc: BaseException) -> bool:
    """True if ``exc`` means the rank itself failed (not a peer's failure seen from it)."""
    if isinstance(exc, ActorError):
        return exc.exception_type not in _PEER_ERRORS
    return True  # SupervisionError, TimeoutError, anything else


def kind_of(exc: BaseException | None) -> str:
    if isinstance(exc, GroupFailed) or (isinstance(exc, ActorError) and exc.exception_type == "GroupCollectiveError"):
        return "group"
    if isinstance(exc, SupervisionError):
        return "host_lost" if getattr(exc, "cause", "") == "host_lost" else "crash"
    if isinstance(exc, ActorError):
        return "error"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "failure"


def cause_of(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    if isinstance(exc, SupervisionError):
        return getattr(exc, "cause", "") or "supervision"
    if isinstance(exc, ActorError):
        return f"raised {exc.exception_type}"
    return type(exc).__name__


class Membership(Healing):
    """The ranks of one run: their states, failure records, restarts, quorums (and heals:
    :class:`~.healing.Healing`).

    Args:
        run: the :class:`~monarch_nb.train.run.TrainingRun` (its lock, stop flag, recovery records).
        events: the coordinator's event queue: restart threads put :class:`~.events.RankReady` and
            :class:`~.events.RestartFailed`; :meth:`supervise` puts :class:`~.events.RankFailed`.
    """

    def __init__(self, run: "TrainingRun", events: "queue.SimpleQueue[RunEvent]"):
        self.run = run
        self.options = run.options
        self.events = events
        self.procs: RankProcs | None = None  # set once the run's procs serve (see .rank_procs)
        self.trainers: dict[int, Any] = {}
        self.state: dict[int, RankState] = {}  # changed only by move()
        self.quorum = 0
        self.members: list[int] = []
        self.broken = True  # no quorum yet
        self.failures: list[FailureRecord] = []
        self._open: dict[int, list[FailureRecord]] = {}
        self._threads: list[threading.Thread] = []
        self.store: Any = None
        self.layout = GroupLayout(getattr(self.options, "group_size", 1))
        self.generation: dict[int, int] = {}  # replica group -> its incarnation (a sharded run)

    # -- views ------------------------------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        return sorted(r for r, s in self.state.items() if s == RankState.LIVE)

    @property
    def ready(self) -> list[int]:
        return sorted(r for r, s in self.state.items() if s == RankState.READY)

    @property
    def restarting(self) -> list[int]:
        return sorted(r for r, s in self.state.items() if s == RankState.RESTARTING)

    @property
    def quorum_ranks(self) -> list[int]:
        """The live ranks a quorum may have: those whose whole replica group is live (every live
        rank, unsharded)."""
        return self.layout.whole_groups(self.live)

    @property
    def dirty(self) -> bool:
        """The live ranks are not exactly the members of an intact quorum."""
        return self.broken or self.quorum_ranks != self.members

    # -- rank states (training thread, or under the run's lock) ------------------------------------
    def move(self, rank: int, new: RankState) -> None:
        """The one place a rank's state changes.

        Raises:
            RuntimeError: the move is not in the table (a bug: say which).
        """
        old = self.state.get(rank)
        if new not in _MOVES[old]:
            raise RuntimeError(f"rank {rank}: {old.value if old else 'not started'} -> {new.value} is not a legal move")
        self.state[rank] = new

    # -- failure records (any thread, under the run's lock) ----------------------------------------
    def open_record(self, kind: str, rank: int, at: float, cause: str = "", pid: int | None = None) -> FailureRecord:
        rec = FailureRecord(kind, rank, self.run.step, at, cause=cause, pid=pid)
        with self.run.lock:
            self.failures.append(rec)
            self._open.setdefault(rank, []).append(rec)
        self.run.recovery("failed", rec, at)
        return rec

    def open_for(self, rank: int) -> list[FailureRecord]:
        """Records of ``rank`` not yet closed (not resumed, or restarted and not rejoined)."""
        return [r for r in self._open.get(rank, []) if r.resumed_at is None or (r.restarted and r.rejoined_at is None)]

    def detect(self, rec: FailureRecord, at: float, cause: str) -> None:
        if rec.detected_at is None:
            rec.detected_at = at
            rec.cause = cause
            self.run.recovery("detected", rec, at)

    def mark_resumed(self, at: float) -> None:
        """Survivors committed a step at ``at``: every disrupted, detected failure has resumed."""
        with self.run.lock:
            for recs in self._open.values():
                for rec in recs:
                    if rec.disrupted and rec.detected_at is not None and rec.resumed_at is None:
                        rec.resumed_at = at
                        self.run.recovery("resumed", rec, at)

    def mark_rejoined(self, rank: int, at: float, how: str, identical: bool | None = None) -> None:
        with self.run.lock:
            for rec in self._open.get(rank, []):
                if rec.restarted and rec.rejoined_at is None:
                    rec.rejoined_at = at
                    rec.replicas_identical = identical
                    rec.how = how
                    self.run.recovery("rejoined", rec, at)

    def on_event(self, event) -> None:
        """The controller's event log (IO thread): open records for injected faults, time detections."""
        procs = self.procs
        if procs is None or event.mesh != procs.name:
            return
        if event.kind == "fault_injected":
            kind = (event.cause or event.detail.split(" ")[0]) or "fault"
            self.open_record(kind, event.rank, event.monotonic, cause="injected", pid=event.pid)
        elif event.kind in ("proc_exited", "proc_hung"):
            with self.run.lock:
                opened = self._open.get(event.rank, [])
                recs = [r for r in opened if r.detected_at is None]
                # the exit of a proc already known failed (a hung proc fenced) is the same failure
                known = any(r.pid == event.pid for r in opened if r.pid)
            if not recs and not known and event.kind == "proc_exited" and not self.run.stopping:
                recs = [self.open_record("crash", event.rank, event.monotonic, pid=event.pid)]
            with self.run.lock:
                for rec in recs:
                    if rec.pid is None:
                        rec.pid = event.pid
                    self.detect(rec, event.monotonic, event.cause or event.kind)

    # -- failures ---------------------------------------------------------------------------------
    def supervise(self, failure: Any) -> bool:
        """The mesh owner's ``__supervise__`` (supervisor thread): hand the failure to the
        training thread; always handled (this run restarts and heals its ranks)."""
        if not self.run.stopping:
            error = SupervisionError(failure.rank, failure.cause, failure.detail, failure.signal)
            self.events.put(RankFailed(failure.rank, error, failure.pid))
        return True

    def current_pid(self, rank: int) -> int | None:
        return self.procs.pid(rank) if self.procs is not None else None

    def _procs(self) -> RankProcs:
        if self.procs is None:
            raise RuntimeError("the run's procs are not known yet: restarts come after they serve")
        return self.procs

    def fail_rank(self, rank: int, exc: BaseException | None = None) -> bool:
        """Take ``rank`` out and restart it in the background, once per failure. Returns False
        if it was already being restarted (the same failure reported twice). In a sharded run
        the other ranks of its replica group are taken out too, and the group restarts as one
        (:meth:`_restart_group`)."""
        if not self._take_out(rank, exc):
            return False
        ranks = [rank]
        if self.layout.size > 1:
            g = self.layout.group_of(rank)
            for partner in self.layout.members(rank):
                if partner != rank and self.state.get(partner) in (RankState.LIVE, RankState.READY):
                    why = GroupFailed(f"rank {partner}: rank {rank} of its replica group {g} failed "
                                      f"({cause_of(exc) or 'failure'})")
                    if self._take_out(partner, why):
                        ranks.append(partner)
        if self.run.stopping:
            return True
        target: Callable[..., None]
        args: tuple[Any, ...]
        if self.layout.size > 1:
            target, args, name = self._restart_group, (sorted(ranks),), f"group-{self.layout.group_of(rank)}"
        else:
            target, args, name = self._restart, (rank,), str(rank)
        thread = threading.Thread(target=target, args=args, name=f"monarch_nb-restart-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return True

    def own_death_heard(self, rank: int, exc: BaseException, pid: int | None) -> bool:
        """``rank`` was taken out as a failed rank's partner (its record's kind is ``group``) and
        now its own death is heard: the death is the cause. A partner's death our own group
        restart caused is never reported (the controller knows the pid it killed), so a
        supervision failure of the incarnation the record was opened for (``pid``) is a death of
        its own, heard after the partner's error (a SIGKILLed rank's exit can reach the
        controller after its partner's collective error). Returns True if a record was
        relabeled (then there is nothing else to do: the rank is already restarting)."""
        if pid is None or not isinstance(exc, SupervisionError):
            return False
        with self.run.lock:
            recs = [rec for rec in self.open_for(rank) if rec.kind == "group" and rec.pid == pid and rec.restarted]
            for rec in recs:
                rec.kind, rec.cause = kind_of(exc), cause_of(exc)
        return bool(recs)

    def _take_out(self, rank: int, exc: BaseException | None) -> bool:
        """Record ``rank``'s failure and move it to restarting; False if it already was (or is out)."""
        now = time.monotonic()
        with self.run.lock:
            state = self.state.get(rank)
            recs = self.open_for(rank)
        if not recs and not self.run.stopping and state != RankState.RESTARTING:
            recs = [self.open_record(kind_of(exc), rank, now, pid=self.current_pid(rank))]
        with self.run.lock:
            for rec in recs:
                rec.disrupted = True
                self.detect(rec, now, cause_of(exc))
            if state in (RankState.RESTARTING, RankState.OUT):
                return False
            if rank in self.members:
                self.broken = True
            self.move(rank, RankState.RESTARTING)
            for rec in recs:
                rec.restarted = True
        return True

    def _restart_group(self, ranks: list[int]) -> None:
        """A restart thread of a sharded run: restart ``ranks`` (a replica group's) together, then
        set them up under a new incarnation of the group (each attempt a new one, so a new group
        never meets a dead incarnation's keys); any failure restarts them all again."""
        from ..runtime.hosts import AttachError

        g = self.layout.group_of(ranks[0])
        last: BaseException | None = None
        attempt = 0
        while attempt < _RESTART_ATTEMPTS and not self.run.stopping:
            self.generation[g] = generation = self.generation.get(g, 0) + 1
            try:
                with ThreadPoolExecutor(len(ranks), thread_name_prefix="monarch_nb-restart-proc") as pool:
                    for done in [pool.submit(self._restart_proc, r) for r in ranks]:
                        done.result()
                futures = {r: self.trainers[r].setup.call_one(generation) for r in ranks if r in self.trainers}
                _, errors = wait_all(futures, self.options.restart_timeout_s, self.run.stop_event)
                if errors:
                    raise next(iter(errors.values()))
                for r in ranks:
                    self.events.put(RankReady(r))
                return
            except MeshStoppedError:
                return
            except AttachError as exc:
                last = exc
                self._wait_for_host(ranks[0])
            except Exception as exc:
                if self.run.stopping:
                    return
                attempt += 1
                last = exc
                log.warning("restarting replica group %d (ranks %s) failed (attempt %d of %d): %s", g, ranks, attempt,
                            _RESTART_ATTEMPTS, (str(exc).splitlines() or [type(exc).__name__])[0])
        if not self.run.stopping:
            for r in ranks:
                self.events.put(RestartFailed(r, last))

    def _restart_proc(self, rank: int) -> None:
        self._wait_until_dead(rank)
        procs = self._procs()
        procs.restart(rank, timeout_s=self.options.restart_timeout_s)
        # taken out as a partner, it may have died on its own first (its exit heard only after the
        # restart had begun, so never reported): its record names that death, not the partner's
        for rec in [r for r in self.open_for(rank) if r.kind == "group"]:
            pid = rec.pid
            death = procs.own_exit(rank, pid) if pid is not None else None
            if death is not None:
                self.own_death_heard(rank, death, pid)

    def _wait_until_dead(self, rank: int, timeout_s: float = 5.0) -> None:
        """A hung rank is being fenced: let its exit be seen before restarting it, so the fence's
        exit and the restart do not race."""
        procs = self._procs()
        deadline = time.monotonic() + timeout_s
        while procs.state(rank) == ProcState.HUNG and time.monotonic() < deadline and not self.run.stopping:
            time.sleep(0.005)

    def _restart(self, rank: int) -> None:
        """A restart thread: restart ``rank`` (a warm spare takes its place when there is one).
        While the rank's host is lost, wait for it to be attached again (not an attempt)."""
        from ..runtime.hosts import AttachError

        last: BaseException | None = None
        attempt = 0
        while attempt < _RESTART_ATTEMPTS:
            if self.run.stopping:
                return
            try:
                self._wait_until_dead(rank)
                self._procs().restart(rank, timeout_s=self.options.restart_timeout_s)
                trainer = self.trainers.get(rank)
                if trainer is not None:  # the restart built a light Trainer again: make it a replica
                    trainer.setup.call_one().get(self.options.restart_timeout_s)
                self.events.put(RankReady(rank))
                return
            except MeshStoppedError:
                return
            except AttachError as exc:
                if last is None or not isinstance(last, AttachError):
                    log.warning("rank %d waits for its host to be attached again before it restarts (%s)", rank, exc)
                last = exc
                self._wait_for_host(rank)
                continue
            except Exception as exc:
                if self.run.stopping:
                    return
                attempt += 1
                last = exc
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("restarting rank %d failed (attempt %d of %d): %s", rank, attempt, _RESTART_ATTEMPTS,
                            first_line)
        if not self.run.stopping:
            self.events.put(RestartFailed(rank, last))

    def _wait_for_host(self, rank: int) -> None:
        """Until the host of ``rank`` serves again (attached again after it was lost) or the run stops."""
        procs = self._procs()
        while not self.run.stopping and not procs.host_serving(rank):
            self.run.stop_event.wait(0.2)

    def on_ready(self, rank: int) -> None:
        if self.state.get(rank) == RankState.RESTARTING:
            self.move(rank, RankState.READY)

    def on_restart_failed(self, rank: int) -> None:
        if self.state.get(rank) == RankState.RESTARTING:
            self.move(rank, RankState.OUT)

    def join_threads(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- quorums ----------------------------------------------------------------------------------
    def form_quorum(self, initial: bool = False) -> None:
        """Form a new quorum of the live ranks; retries without ranks that fail meanwhile. If every
        live rank fails meanwhile, returns with no quorum (the run then restores a snapshot).
        ``initial``: the run's first quorum: its members take the lowest rank's model state.

        Raises:
            TrainingError: no quorum after 20 tries.
            Stopped: the run was stopped.
        """
        o = self.options
        self.run.phase("forming quorum")
        for _ in range(20):
            ranks = self.quorum_ranks
            if not ranks:
                self.broken = True
                return
            self.quorum += 1
            quorum = self.quorum
            aborted = threading.Event()

            def abort(rank: int, exc: BaseException, aborted: threading.Event = aborted, quorum: int = quorum) -> None:
                if own_failure(exc) and not aborted.is_set():
                    aborted.set()
                    self.store.set(f"quorum{quorum}/abort", "1")

            source = ranks[0] if initial else None
            futures = {r: self.trainers[r].init_quorum.call_one(quorum, ranks, source) for r in ranks}
            values, errors = wait_all(futures, o.collective_timeout_s + 5.0, self.run.stop_event, abort)
            if not errors:
                self.members, self.broken = ranks, False
                return
            if not aborted.is_set():
                self.store.set(f"quorum{quorum}/abort", "1")
            for r, e in errors.items():
                if own_failure(e):
                    self.fail_rank(r, e)
            log.info("quorum %d of %s failed (%s); forming another", quorum, ranks,
                     ", ".join(f"{r}: {type(e).__name__}" for r, e in errors.items()))
        raise TrainingError("could not form a quorum after 20 tries")

    def checksums(self, timeout_s: float | None = None) -> dict[int, ReplicaChecksum]:
        """The live ranks' replica checksums (ranks that fail to answer are failed)."""
        futures = {r: self.trainers[r].checksum.call_one() for r in self.live}
        values, errors = wait_all(futures, timeout_s or self.options.collective_timeout_s, self.run.stop_event)
        for rank, exc in errors.items():
            self.fail_rank(rank, exc)
        return values

