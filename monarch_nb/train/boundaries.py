"""What the controller does at a step boundary (no window in flight): recover, restore, inject, heal.

:class:`Boundaries` is a part of :class:`~monarch_nb.train.coordinator.Coordinator` (a mixin:
it works on the coordinator's state, on the run's training thread), kept here so that each room
does one thing. After a failure the survivors, at most one step apart, agree on the last
committed step (:meth:`~.recovery.Membership.catch_up`) and form a new quorum; a non-finite
gradient is redone in the same quorum; a planned fault is injected at its exact step; restarted
ranks are healed and join; when no replica is left, restarted ranks load the newest shared-memory
snapshot and the steps after it are redone.
"""

from __future__ import annotations

import logging
import os
import time

from ..faults.spec import FaultSpec
from .recovery import RankState, TrainingError
from .replica_checksum import describe_divergence, replica_digests
from .sharding import snapshot_slots
from .trainer_loop import WindowReply, WindowStatus
from .waits import Stopped, wait_all
from .coordinator_state import CoordinatorState

__all__ = ["Boundaries"]

log = logging.getLogger(__name__)


class Boundaries(CoordinatorState):
    """The coordinator's step-boundary work (see the module docstring)."""

    def _boundary(self) -> None:
        """Nothing is in flight: recover, restore, inject, heal, re-form, as needed."""
        m = self.m
        if self.recover or self.nonfinite_at is not None:
            self._recover()
        if not m.live:
            self._restore()
            return
        for fault in self.planned.pop(self.next_commit, []) if self.next_dispatch == self.next_commit else []:
            self._inject(fault)
        joined = m.heal_ready() if m.ready and m.live else []
        if m.dirty and m.live:
            m.form_quorum(initial=self.fresh_replicas)
            self.fresh_replicas = False
            for rank in m.members:
                self.rank_next[rank] = self.next_commit
        if joined:
            self._rejoined(joined)
        if self.checkpoint_lost and m.live and not m.dirty:
            self.checkpoint_lost = False
            self._checkpoint_now()

    def _recover(self) -> None:
        """After a failure or a non-finite gradient: agree on the last committed step."""
        m = self.m
        nonfinite, self.nonfinite_at = self.nonfinite_at, None
        self.recover = False
        self.attempts_failed += 1
        failed_step = nonfinite if nonfinite is not None else self.next_commit
        outcome = self._outcome()
        self.run.sample_ledger().record_attempt(failed_step, m.quorum, list(m.members), outcome)
        if self.attempts_failed > 50 * max(1, self.o.steps):
            raise TrainingError("steps keep failing (e.g. gradients stay non-finite); giving up")
        live = m.live
        if not live:
            self.windows.clear()
            return
        missing = [r for r in live if r not in self.rank_next]
        if missing:
            values, errors = wait_all({r: m.trainers[r].status.call_one() for r in missing},
                                      self.o.collective_timeout_s, self.run.stop_event)
            for r, v in values.items():
                self.rank_next[r] = v["next_step"]
            for r, exc in errors.items():
                m.fail_rank(r, exc)
        next_steps = {r: self.rank_next[r] for r in m.live if r in self.rank_next}
        agreed = m.catch_up(next_steps) if m.broken else (max(next_steps.values()) if next_steps else self.next_commit)
        agreed = max(agreed, self.next_commit)
        self._commit_upto(agreed)
        for r in m.live:
            self.rank_next[r] = agreed
        self.windows.clear()
        self.next_dispatch = self.next_commit

    def _outcome(self) -> str:
        parts = []
        failed = set()
        for win in self.windows:
            for rank, rep in sorted(win.replies.items()):
                if isinstance(rep, WindowReply):
                    if rep.status == WindowStatus.NONFINITE and rep.local_nonfinite:
                        parts.append(f"nonfinite gradient from rank {rank}")
                    elif rep.status == WindowStatus.COLLECTIVE_FAILED:
                        parts.append(f"{rank}: CollectiveError")
                else:
                    failed.add(rank)
                    parts.append(f"{rank}: {type(rep).__name__}")
        failed |= {r for r in self.m.members if self.m.state.get(r) != RankState.LIVE}
        poisoned = sorted({int(p.split()[-1]) for p in parts if p.startswith("nonfinite")})
        head = f"nonfinite gradient from ranks {poisoned}" if poisoned else f"failed ranks {sorted(failed)}"
        return head + ("; " + "; ".join(dict.fromkeys(parts)) if parts else "")

    def _inject(self, fault: FaultSpec) -> None:
        if fault.rank not in self.m.live:
            log.warning("fault %s skipped: rank %d is not live", fault, fault.rank)
            return
        if fault.phase == "collective":
            try:
                self.m._get(self.m.trainers[fault.rank].arm_kill_in_collective.call_one(fault.step),
                            self.o.collective_timeout_s)
            except Stopped:
                raise
            except Exception as exc:
                self.m.fail_rank(fault.rank, exc)
                return
            self.split_steps.add(fault.step)
            self.m.open_record("kill", fault.rank, time.monotonic(), cause="in collective")
            return
        try:
            self.procs.inject(fault.rank, fault.kind, **fault.params)
        except RuntimeError as exc:
            log.warning("fault %s skipped: %s", fault, exc)

    def _rejoined(self, joined: list[int]) -> None:
        sums = self.m.checksums()
        identical = len(replica_digests(sums)) <= 1
        now = time.monotonic()
        for rank in joined:
            if self.m.state.get(rank) == RankState.LIVE:
                self.m.mark_rejoined(rank, now, "heal", identical)
        if not identical:
            raise TrainingError(f"replicas differ after rank(s) {joined} rejoined: {describe_divergence(sums)}")

    def _checkpoint_now(self) -> None:
        rank = self.m.live[0]
        self.run.phase("checkpointing")
        try:
            saved = self.m._get(self._send_checkpoint(rank, self.next_commit), self.o.collective_timeout_s)
        except Stopped:
            raise
        except Exception as exc:
            self._checkpoint_failed(rank, exc)
        else:
            if saved["path"] is not None:
                self.checkpoint_failures = 0

    def _snapshot_to_restore(self) -> dict[int, str] | None:
        """``{ready rank: snapshot path}`` to restore, or None if there is none. In a sharded run,
        each shard's slot of the newest step that every shard has (asked of one ready rank per
        shard: the slots are files on its host), or None if some shard has no ready rank."""
        m = self.m
        if not self.snapshot_path:
            return None
        if m.layout.size == 1:
            if not (self.snapshots or os.path.exists(self.snapshot_path)):
                return None
            return {r: self.snapshot_path for r in m.ready}
        asker: dict[int, int] = {}
        for rank in m.ready:
            asker.setdefault(m.layout.shard_of(rank), rank)
        if len(asker) < m.layout.size:
            return None
        futures = {s: m.trainers[r].snapshot_steps.call_one(snapshot_slots(self.snapshot_path, s)) for s, r in asker.items()}
        values, errors = wait_all(futures, self.o.collective_timeout_s, self.run.stop_event)
        if errors or not values:
            return None
        common = set.intersection(*(set(steps.values()) for steps in values.values()))
        if not common:
            return None
        step = max(common)
        by_shard = {s: next(path for path, at in steps.items() if at == step) for s, steps in values.items()}
        return {r: by_shard[m.layout.shard_of(r)] for r in m.ready}

    def _restore(self) -> None:
        """No live replica: wait for restarted ranks, then load the newest snapshot into them."""
        m, o = self.m, self.o
        self.windows.clear()
        deadline = time.monotonic() + o.restart_timeout_s * 2
        while not m.ready:
            if not m.restarting:
                raise TrainingError("every rank failed and none could be restarted")
            if time.monotonic() > deadline:
                raise TrainingError(f"every rank failed and none came back within {o.restart_timeout_s * 2:.0f} s")
            if self.run.stopping:
                raise Stopped()
            self._wait_event(0.1)
        settle = time.monotonic() + 1.0  # let the other restarts finish too: restore them together
        while m.restarting and time.monotonic() < settle and not self.run.stopping:
            self._wait_event(0.05)
        paths = self._snapshot_to_restore()
        if paths is None:
            if self.next_commit == self.start_step == 0:  # nothing trained yet: fresh trainers are the state
                for rank in m.ready:
                    m.move(rank, RankState.LIVE)
                m.broken = True
                self.fresh_replicas = True  # their next quorum makes them identical (the lowest rank's model)
                return
            raise TrainingError(
                "every rank failed at once and no snapshot had been published yet: nothing holds the training "
                "state (use checkpoint_dir/checkpoint_every and resume=True for full-job restarts)")
        t0 = time.monotonic()
        restored = m.restore(paths)
        step = next(iter(restored.values()))["next_step"]
        redone = 0
        if step < self.next_commit:
            redone = self.next_commit - step
            self.run.sample_ledger().forget_from(step)
            self.run.forget_metrics_from(step)
            self.next_commit = step
            self.run.step = step
        elif step > self.next_commit:
            self._commit_upto(step)
        self.next_dispatch = self.next_commit
        for rank in restored:
            self.rank_next[rank] = step
        self.redone_from_snapshot += redone
        took = time.monotonic() - t0
        self.restores.append({"step": step, "steps_redone": redone, "restore_s": round(took, 4),
                              "ranks": sorted(restored)})
        self.run.add_recovery({"type": "recovery", "event": "restored", "step": step, "steps_redone": redone,
                       "restore_s": round(took, 4), "ranks": sorted(restored),
                       "time_s": round(time.monotonic() - self.t_train0, 4)})
        now = time.monotonic()
        for rank in restored:
            m.mark_rejoined(rank, now, "snapshot")
        m.broken = True
