"""The controller's side of the step loop: windows of steps sent ahead, committed from their records.

The controller is off the steps' critical path. It sends every member of the quorum the same
*window* (``Trainer.run_window(quorum, start, count)``), and keeps ``pipeline`` windows in flight,
so a rank starts its next window the moment it finishes one, without waiting for the controller.
Each reply carries one compact record per step (loss, batch accuracy, a digest of the sample ids
the rank used, step time). A step is *committed* when every member reported it: it goes into the
:class:`~monarch_nb.train.data.SampleLedger` and out to subscribers as a metric. Windows last
about ``window_s`` seconds, at most :data:`JOIN_WINDOW_S` while a restarted rank is on its way
back (``window_steps`` fixes their length; ``window_steps=1, pipeline=1`` is the per-step loop:
one round trip per step). They end early where the controller must act at a
precise step: a planned fault, an evaluation, a disk checkpoint, the last step.

The controller steps in only at a boundary (no window in flight), for: a failure (a member died,
hung, raised; the survivors' all-reduce failed), a non-finite gradient, a restarted rank ready to
rejoin, a planned fault, every replica lost. After a failure (see :mod:`.trainer` for why the
survivors are at most one step apart) the survivors agree on the last committed step
(:meth:`~.recovery.Membership.catch_up`), form a new quorum and go on from the next step; a
restarted rank is healed from a live peer and joins at the next boundary; when no replica is
left, restarted ranks load the newest shared-memory snapshot and the steps after it are redone.
Evaluations and disk checkpoints are queued on one member right behind the window that ends at
their step (messages from one sender are FIFO), so they cost no round trip either.
"""

from __future__ import annotations

import logging
import os
import queue
import statistics
import threading
import time
from typing import Any

from ..errors import ActorError, MeshStoppedError
from .boundaries import Boundaries
from .coordinator_state import Window
from .launch import Launch
from .recovery import RankState, TrainingError, own_failure
from .waits import Stopped, wait_all
from .replica_checksum import replica_digests
from .report import build_report
from .checkpoints import checkpoint_path
from .events import CheckpointAnswered, EvalAnswered, RankFailed, RankReady, RestartFailed, RunEvent, Wake, WindowAnswered
from .sharding import SNAPSHOT_EVERY, snapshot_slots
from .trainer_loop import WindowReply, WindowStatus

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)

_MAX_WINDOW = 4096
#: the longest a window lasts (seconds) while a restarted rank is on its way back: it joins at a
#: boundary, after the window in flight, so short windows then keep its wait at most
#: ``JOIN_WINDOW_S`` (or one step, when a step takes longer) whatever ``window_s`` a run chose
#: (default 0.1 s). Meanwhile one window is in flight, not ``pipeline``: with steps longer than
#: that (a window of one step) a second window in flight would add a whole step to the wait
#: (llama-small in groups of 2, steps of ~0.6 s on half the ranks: the group's rejoin p50
#: 1.69 -> see docs/training.md §8), for a round trip of the controller between windows
#: meanwhile.
JOIN_WINDOW_S = 0.1
_CHECKPOINT_TRIES = 3  # failed disk checkpoints in a row that end a run


class Coordinator(Launch, Boundaries):
    """Runs one :class:`~monarch_nb.train.run.TrainingRun` on its training thread: starts it
    (:class:`~.launch.Launch`), sends windows and commits steps (here), acts at boundaries
    (:class:`~.boundaries.Boundaries`), finishes with the report."""

    # -- the run ------------------------------------------------------------------------------------
    def run_all(self) -> None:
        """Set up, train, finish (writes ``run._report``). Raises what ends the run."""
        t0 = time.monotonic()
        try:
            self._spawn()
            self._construct()
            self._resume()
            self.m.form_quorum(initial=self.start_step == 0)
            self.setup_s = time.monotonic() - t0
            self._train()
        except Stopped:
            pass
        self._finish()

    def wake(self) -> None:
        self.events.put(Wake())

    # -- training -------------------------------------------------------------------------------------
    def _train(self) -> None:
        o = self.o
        for fault in o.faults:
            self.planned.setdefault(fault.step, []).append(fault)
        self.run.phase("training")
        self.t_train0 = self.t_last_commit = time.monotonic()
        self.run.t_train0 = self.t_train0
        if o.chaos_mtbf_s:
            from ..faults.chaos import ChaosSchedule

            self.chaos = ChaosSchedule(o.chaos_mtbf_s, kinds=o.chaos_kinds, seed=o.seed).start(self.procs)
        rejoin_deadline = None
        while not self.run.stopping:
            if self.next_commit >= o.steps and not self.windows and not self._needs_recovery():
                # every step is committed; let restarting ranks rejoin (bounded), so that every
                # replica is checked and every latency measured
                if rejoin_deadline is None:
                    rejoin_deadline = time.monotonic() + o.restart_timeout_s
                    waiting = sorted(set(self.m.restarting) | set(self.m.ready))
                    self.run.phase("finishing", waiting_for=waiting, up_to_s=o.restart_timeout_s)
                    if self.chaos is not None:
                        self.chaos.stop()
                if not (self.m.restarting or self.m.ready) or time.monotonic() > rejoin_deadline:
                    break
                if self._needs_boundary():
                    self._boundary()
                else:
                    self._wait_event(0.05)
                continue
            if self._needs_boundary():
                if any(not w.complete for w in self.windows):
                    self._wait_event()
                else:
                    self._boundary()
                continue
            self._dispatch()
            self._wait_event()
        self.t_end = time.monotonic()

    def _needs_recovery(self) -> bool:
        return self.recover or self.nonfinite_at is not None or not self.m.live or self.m.dirty

    def _needs_boundary(self) -> bool:
        m = self.m
        return (self.recover or self.nonfinite_at is not None or m.dirty or bool(m.ready) or not m.live
                or self.next_dispatch in self.planned or self.checkpoint_lost)

    def _in_flight(self) -> int:
        return sum(1 for w in self.windows if not w.complete)

    def _window_size(self) -> int:
        o = self.o
        if o.window_steps:
            return o.window_steps
        if self.step_s is None:
            return 1
        seconds = min(o.window_s, JOIN_WINDOW_S) if self.m.restarting or self.m.ready else o.window_s
        return max(1, min(_MAX_WINDOW, int(seconds / max(self.step_s, 1e-6))))

    def _window_end(self, start: int) -> int:
        o = self.o
        end = min(o.steps, start + self._window_size())
        later = [f for f in self.planned if f > start]
        if later:
            end = min(end, min(later))
        for every in (o.eval_every, o.checkpoint_every):
            if every:
                end = min(end, (start // every + 1) * every)
        return end

    def _dispatch(self) -> None:
        o, m = self.o, self.m
        pipeline = 1 if self.m.restarting or self.m.ready else o.pipeline  # see JOIN_WINDOW_S
        while (self._in_flight() < pipeline and self.next_dispatch < o.steps and not self._needs_boundary()
               and not self.run.stopping):
            start = self.next_dispatch
            end = self._window_end(start)
            win = Window(next(self._wids), m.quorum, m.members, start, end - start)
            split = sorted(s for s in self.split_steps if start <= s < end) or None
            writer = m.members[0]
            snapshots = self._snapshot_orders(writer)
            self.windows.append(win)
            self.history.append((start, end - start, win.members))
            for rank in win.members:
                future = m.trainers[rank].run_window.call_one(m.quorum, start, end - start, split,
                                                              snapshots.get(rank))
                future.add_done_callback(lambda f, w=win, r=rank: self.events.put(WindowAnswered(w, r, f)))
            self.next_dispatch = end
            last = end - 1
            if o.eval_every and end % o.eval_every == 0 and end < o.steps:
                self.run.phase("evaluating")
                self._on_group(writer, lambda t: t.evaluate.call_one()).add_done_callback(
                    lambda f, s=last, r=writer: self.events.put(EvalAnswered(s, r, f)))
            if o.checkpoint_every and end % o.checkpoint_every == 0:
                self.run.phase("checkpointing")
                self._send_checkpoint(writer, end).add_done_callback(
                    lambda f, s=end, r=writer: self.events.put(CheckpointAnswered(s, r, f)))
            if self.run.phase_name != "training":
                self.run.phase("training")

    def _snapshot_orders(self, writer: int) -> dict[int, dict]:
        """``{rank: snapshot order}`` of the ranks that publish snapshots: ``writer``; in a sharded
        run every rank of ``writer``'s group, each its shard into two slots in turn, at the same
        fixed steps (see :func:`~.sharding.snapshot_slots`)."""
        o, layout = self.o, self.m.layout
        if not self.snapshot_path:
            return {}
        if layout.size == 1:
            return {writer: {"path": self.snapshot_path, "every": o.snapshot_every or 0, "budget": o.snapshot_budget}}
        orders = {}
        for rank in layout.members(writer):
            slots = snapshot_slots(self.snapshot_path, layout.shard_of(rank))
            orders[rank] = {"path": slots[0], "slots": slots, "every": o.snapshot_every or SNAPSHOT_EVERY,
                            "budget": o.snapshot_budget, "wait": True}
        return orders

    def _send_checkpoint(self, writer: int, next_step: int) -> Any:
        """Queue the checkpoint before step ``next_step`` on ``writer`` (in a sharded run on every
        rank of its group: each saves its shards); returns ``writer``'s future (the others fail
        with it: a partner's failure fails the group's collective save)."""
        directory = self.o.checkpoint_dir
        if directory is None:
            raise RuntimeError("a checkpoint was due in a run without checkpoint_dir (a bug in the caller)")
        path = checkpoint_path(directory, next_step, self.o.sharded)
        os.makedirs(directory, exist_ok=True)
        return self._on_group(writer, lambda t: t.save_checkpoint.call_one(path, next_step))

    def _on_group(self, writer: int, call: Any) -> Any:
        """``call(trainer)`` on every rank of ``writer``'s replica group (only ``writer`` when
        unsharded): a sharded model's forward and its collective save need the whole group.
        Returns ``writer``'s future."""
        futures = {rank: call(self.m.trainers[rank]) for rank in self.m.layout.members(writer)}
        return futures[writer]

    # -- events ----------------------------------------------------------------------------------------
    def _wait_event(self, timeout_s: float = 1.0) -> None:
        """Handle the next event (and every one already queued); check window deadlines."""
        deadline = self._window_deadline()
        wait = max(0.0, min(timeout_s, deadline - time.monotonic())) if deadline is not None else timeout_s
        try:
            item = self.events.get(timeout=wait)
        except queue.Empty:
            self._check_deadlines()
            return
        self._handle(item)
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                break
            self._handle(item)
        self._check_deadlines()

    def _window_deadline(self) -> float | None:
        pending = [w for w in self.windows if not w.complete]
        if not pending:
            return None
        w = pending[0]
        per_step = max(self.step_s or 0.05, 0.001)
        return w.oldest_since + 10 * w.count * per_step + self.o.collective_timeout_s + 5.0

    def _check_deadlines(self) -> None:
        deadline = self._window_deadline()
        if deadline is None or time.monotonic() < deadline:
            return
        w = next(w for w in self.windows if not w.complete)
        for rank in w.members:
            if rank not in w.replies:
                late = TimeoutError(f"rank {rank}: window of steps {w.start}-{w.start + w.count - 1} did not end in time")
                w.replies[rank] = late
                if self.m.state.get(rank) == RankState.LIVE:
                    self.m.fail_rank(rank, late)
        self.recover = True
        self._window_done(w)

    def _handle(self, event: RunEvent) -> None:
        if isinstance(event, WindowAnswered):
            self._on_reply(event.window, event.rank, event.future)
        elif isinstance(event, RankFailed):
            self._on_failed(event.rank, event.error, event.pid)
        elif isinstance(event, RankReady):
            self.m.on_ready(event.rank)
        elif isinstance(event, RestartFailed):
            self.m.on_restart_failed(event.rank)
            log.warning("rank %d could not be restarted; training goes on without it", event.rank)
        elif isinstance(event, EvalAnswered):
            self._on_eval(event.step, event.rank, event.future)
        elif isinstance(event, CheckpointAnswered):
            self._on_checkpoint(event.next_step, event.rank, event.future)

    def _on_failed(self, rank: int, exc: BaseException, pid: int | None = None) -> None:
        if self.m.own_death_heard(rank, exc, pid):
            return  # taken out already as a failed partner; its record now names its own death
        if pid and pid != self.m.current_pid(rank):
            return  # a stale report about an incarnation already replaced
        if self.m.state.get(rank) in (RankState.LIVE, RankState.READY):
            if rank in self.m.members:
                self.recover = True
            self.m.fail_rank(rank, exc)

    def _on_reply(self, win: Window, rank: int, future: Any) -> None:
        if rank in win.replies:
            return  # already given up on (deadline)
        exc = future.exception(0)
        if exc is None:
            rep: WindowReply = future.get(0)
            win.replies[rank] = rep
            self.rank_next[rank] = rep.next_step
            self.snapshots.extend(rep.snapshots)
            if rep.status == WindowStatus.NONFINITE and self.nonfinite_at is None:
                self.nonfinite_at = rep.failed_step
            elif rep.status != WindowStatus.OK:
                self.recover = True
                if rep.status == WindowStatus.COLLECTIVE_FAILED:
                    self.m.broken = True
            if rep.local_nonfinite:
                self._poisoned(rank)
        else:
            win.replies[rank] = exc
            self.recover = True
            if own_failure(exc) and self.m.state.get(rank) == RankState.LIVE and win.quorum == self.m.quorum:
                self.m.fail_rank(rank, exc)
        if win.complete:
            self._window_done(win)

    def _poisoned(self, rank: int) -> None:
        now = time.monotonic()
        with self.run.lock:
            for rec in self.m.open_for(rank):
                rec.disrupted = True
                self.m.detect(rec, now, "nonfinite gradient")

    def _window_done(self, win: Window) -> None:
        """Every member answered ``win``: commit the steps all of them applied, in order.

        Raises:
            TrainingError: the training function raised the same error on every member: a bug
                of the loop, not a fault (restarting would only raise it again).
        """
        raised = [r for r in win.replies.values() if isinstance(r, ActorError) and "injected fault" not in str(r)]
        same = {(e.exception_type, e.remote.get("message", "")) for e in raised}
        if len(win.members) > 1 and len(raised) == len(win.members) and len(same) == 1:
            raise TrainingError(f"the training function {self.o.name} raised on every rank at step {win.start}: "
                                f"{raised[0]}")
        later = [w for w in self.windows if w is not win and not w.complete and w.id > win.id]
        if later:
            later[0].oldest_since = max(later[0].oldest_since, time.monotonic())
        reps = [r for r in win.replies.values() if isinstance(r, WindowReply)]
        all_ok = len(reps) == len(win.members) and all(r.status == WindowStatus.OK for r in reps)
        if reps and win.start == self.next_commit:
            if all_ok:
                self._learn_step_time(reps[0].step_ms)
            self._commit_upto(win.start + min(r.steps_applied for r in reps))
        if self.next_commit >= win.start + win.count and win in self.windows:
            self.windows.remove(win)
        if not all_ok and self.nonfinite_at is None:
            self.recover = True

    def _learn_step_time(self, step_ms: tuple) -> None:
        if not step_ms:
            return
        s = statistics.median(step_ms) / 1e3
        self.step_s = s if self.step_s is None else 0.7 * self.step_s + 0.3 * s

    # -- commits ---------------------------------------------------------------------------------------
    def _records_for(self, step: int) -> tuple[tuple, dict, WindowReply | None, int, float | None]:
        """``(members, {rank: digest or None}, a reply holding the step's record, its index, the
        largest local gradient norm reported)`` of ``step``."""
        for win in reversed(self.windows):
            if win.start <= step < win.start + win.count:
                digests: dict = {}
                source = None
                norm = None
                i = step - win.start
                for rank in win.members:
                    rep = win.replies.get(rank)
                    if isinstance(rep, WindowReply) and i < rep.steps_applied:
                        digests[rank] = rep.digest[i]
                        source = source or rep
                        norm = rep.grad_norm[i] if norm is None else max(norm, rep.grad_norm[i])
                    else:
                        digests[rank] = None
                return win.members, digests, source, i, norm
        for start, count, members in reversed(self.history):
            if start <= step < start + count:
                return members, {r: None for r in members}, None, 0, None
        raise TrainingError(f"step {step} was committed by no known quorum")

    def _commit_upto(self, upto: int) -> None:
        """Commit steps ``next_commit .. upto-1`` (every one applied by every live member)."""
        if upto <= self.next_commit:
            return
        now = time.monotonic()
        run = self.run
        metrics = []
        while self.next_commit < upto:
            step = self.next_commit
            members, digests, rep, i, norm = self._records_for(step)
            run.sample_ledger().record_shards(step, members, digests)
            metric = {"type": "step", "step": step, "loss": None, "batch_accuracy": None,
                      "time_s": round(now - self.t_train0, 4), "quorum": self.m.quorum, "live_ranks": list(members),
                      "step_ms": None, "grad_norm": None}
            if rep is not None:
                ms = rep.step_ms[i]
                metric.update(loss=rep.loss[i], batch_accuracy=rep.accuracy[i], step_ms=round(ms, 3),
                              grad_norm=norm)
                self.step_ms.append(ms)
                self.productive_s += ms / 1e3
            ev = self.pending_evals.pop(step, None)
            if ev is not None:
                metric.update(test_accuracy=ev["test_accuracy"], test_loss=ev["test_loss"])
            metrics.append(metric)
            self.next_commit += 1
        self.t_last_commit = now
        run.step = self.next_commit
        if self.next_dispatch < self.next_commit:
            self.next_dispatch = self.next_commit
        self.m.mark_resumed(now)
        run.add_metrics(metrics)

    def _on_eval(self, step: int, rank: int, future: Any) -> None:
        exc = future.exception(0)
        if exc is not None:
            if own_failure(exc) and self.m.state.get(rank) == RankState.LIVE:
                self._on_failed(rank, exc)
            return
        ev = future.get(0)
        if ev["next_step"] != step + 1:
            return  # the window before it stopped early: this evaluation is of another step
        if step < self.next_commit:
            self.run.add_eval(step, ev)
        else:
            self.pending_evals[step] = ev

    def _on_checkpoint(self, next_step: int, rank: int, future: Any) -> None:
        exc = future.exception(0)
        if exc is not None:
            self._checkpoint_failed(rank, exc)
        elif future.get(0)["path"] is None:
            self.checkpoint_lost = True
        else:
            self.checkpoint_failures = 0

    def _checkpoint_failed(self, rank: int, exc: BaseException) -> None:
        """A disk checkpoint failed: it is taken again at the next boundary. A save that raised in a
        live proc (the disk; a group partner gone mid-save) fails no rank — restarting it would not
        help — but three such failures in a row end the run; a dead or silent writer is failed.

        Raises:
            TrainingError: the third failed checkpoint in a row.
        """
        self.checkpoint_lost = True
        if isinstance(exc, ActorError):
            self.checkpoint_failures += 1
            if self.checkpoint_failures >= _CHECKPOINT_TRIES:
                raise TrainingError(f"disk checkpoints to {self.o.checkpoint_dir} failed {self.checkpoint_failures} "
                                    f"times in a row (the last on rank {rank}: {exc}); fix the folder (space, "
                                    "permissions) or leave checkpoint_every out")
        elif own_failure(exc) and self.m.state.get(rank) == RankState.LIVE:
            self._on_failed(rank, exc)

    # -- the end ---------------------------------------------------------------------------------------
    def _finish(self) -> None:
        o, m, run = self.o, self.m, self.run
        run.phase("finishing" if not run.stopping else "stopping")
        if self.chaos is not None:
            self.chaos.stop()
        if not m.trainers or run.ledger is None:
            run.set_report(None)
            return
        deadline = time.monotonic() + 2.0 + o.pipeline * o.window_s
        while any(not w.complete for w in self.windows) and time.monotonic() < deadline:
            self._wait_event(0.05)
        if self.t_end is None:
            self.t_end = time.monotonic()
        timeout = 2.0 if run.stopping else o.collective_timeout_s
        stop = threading.Event()  # the final reads run even when the run was asked to stop

        def ask(endpoint: str, ranks: list[int]) -> dict:
            """``{rank: value}`` of ``endpoint`` on ``ranks`` that answered in time; {} once the
            procs are stopped (a stop that did not wait for the run)."""
            try:
                futures = {r: getattr(m.trainers[r], endpoint).call_one() for r in ranks}
            except MeshStoppedError:
                return {}
            return wait_all(futures, timeout, stop)[0]

        values = ask("checksum", m.live)
        digests = replica_digests(values)
        applied = {v.applied_steps for v in values.values()}
        # an interrupted run is evaluated too (within the stop's 2 s), so its report is complete
        first = (m.quorum_ranks or m.live or [-1])[0]  # a sharded model's forward needs its whole group
        evaluated = ask("evaluate", [r for r in m.layout.members(first) if r in m.live])
        ev: dict = evaluated.get(first, {"test_accuracy": None, "test_loss": None})
        mem: dict = {}
        if not run.stopping:
            mem = ask("memory", m.live)
            if o.keep_parameters:
                run.parameters = ask("parameters", m.live)
        run.results = ask("finish", m.live)  # the training functions run to their end (ft.batches stops)
        self.run.set_report(build_report(self, digests, applied, ev, mem))
