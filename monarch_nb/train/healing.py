"""How a training run's ranks get the replica's state again: heals, catch-ups, snapshot restores.

:class:`Healing` is a part of :class:`~monarch_nb.train.recovery.Membership` (a mixin: it works
on the membership's states, on the run's training thread). A restarted rank is *healed* from a
live donor (its state streamed through the controller, checked); after a failure the survivors
one step behind *catch up* with a peer's reduced gradient of that step; when every replica was
lost, restarted ranks *restore* the newest shared-memory snapshot.

In a sharded run (:mod:`.sharding`) each of these goes shard by shard: a rank's donor is the rank
with the same shard index in a live replica group, and a restarted group is healed only once all
of its ranks are back (a group with a member missing cannot run a step).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import ActorError, SupervisionError
from .waits import Stopped, wait_all

if TYPE_CHECKING:
    from .recovery import RankState

__all__ = ["Healing"]

log = logging.getLogger(__name__)


class Healing:
    """Heals, catch-ups and restores (see the module docstring), a room of the
    :class:`~.recovery.Membership`, which provides the fields and methods declared below."""

    run: Any
    options: Any
    trainers: dict
    state: dict
    layout: Any
    _open: dict

    # -- provided by the membership -----------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        raise NotImplementedError

    @property
    def ready(self) -> list[int]:
        raise NotImplementedError

    @property
    def quorum_ranks(self) -> list[int]:
        raise NotImplementedError

    def move(self, rank: int, new: "RankState") -> None:
        raise NotImplementedError

    def fail_rank(self, rank: int, exc: BaseException | None = None) -> bool:
        raise NotImplementedError

    # -- heals ------------------------------------------------------------------------------------
    def _donor_for(self, rank: int, candidates: list[int]) -> int | None:
        """The first of ``candidates`` holding ``rank``'s shard (any of them, unsharded)."""
        shard = self.layout.shard_of(rank)
        return next((r for r in candidates if self.layout.shard_of(r) == shard), None)

    def heal_ready(self) -> list[int]:
        """Heal every ready rank from a live donor (the ranks are idle at a step boundary); returns
        the ranks that are live again (a quorum must then be formed). In a sharded run, only the
        ranks of groups whose every member is ready, each from its shard's donor."""
        from .recovery import RankState

        joined: list[int] = []
        whole = [r for r in self.ready if all(self.state.get(p) == RankState.READY for p in self.layout.members(r))]
        for rank in whole:  # (a group with a member still restarting waits)
            if not self.live:
                break
            if self.state.get(rank) != RankState.READY:
                continue  # its group failed again meanwhile
            donor = self._donor_for(rank, self.quorum_ranks or self.live)
            if donor is None:
                continue
            self.run.phase("healing")
            t0 = time.monotonic()
            try:
                info = self.heal(rank, donor)
            except Stopped:
                raise
            except BaseException as exc:
                culprit = getattr(exc, "rank", None)
                if culprit == donor and isinstance(exc, (SupervisionError, ActorError)):
                    self.fail_rank(donor, exc)  # the joiner stays ready: healed from another donor next
                else:
                    log.warning("healing rank %d failed: %s; restarting it again", rank, exc)
                    self.fail_rank(rank, exc)
                continue
            self.move(rank, RankState.LIVE)
            with self.run.lock:
                for rec in self._open.get(rank, []):
                    if rec.restarted and rec.heal_ms is None:
                        rec.heal_ms = (time.monotonic() - t0) * 1e3
                        rec.heal_bytes, rec.heal_chunks = info["nbytes"], info["chunks"]
            joined.append(rank)
        return [r for r in joined if self.state.get(r) == RankState.LIVE]

    def heal(self, rank: int, donor: int) -> dict:
        """Stream ``donor``'s state to ``rank`` through the controller, chunk by chunk, checked."""
        timeout = self.options.collective_timeout_s
        donor_t, joiner_t = self.trainers[donor], self.trainers[rank]
        manifest = self._get(donor_t.state_manifest.call_one(), timeout)
        try:
            self._get(joiner_t.load_begin.call_one(manifest), timeout)
            for i in range(manifest["chunks"]):
                pieces = self._get(donor_t.state_chunk.call_one(i), timeout)
                self._get(joiner_t.load_chunk.call_one(i, pieces), timeout)
        finally:
            try:
                self._get(donor_t.state_done.call_one(), timeout)
            except Stopped:
                raise
            except Exception:
                log.debug("releasing the donor's state failed", exc_info=True)
        result = self._get(joiner_t.load_end.call_one(), timeout)
        return {**result, "nbytes": manifest["nbytes"], "chunks": manifest["chunks"]}

    def _get(self, future: Any, timeout_s: float) -> Any:
        """``future.get`` with a deadline that gives up at once when the run stops."""
        values, errors = wait_all({0: future}, timeout_s, self.run.stop_event)
        if errors:
            raise errors[0]
        return values[0]

    # -- catching up after a failure ----------------------------------------------------------------
    def catch_up(self, next_steps: dict[int, int]) -> int:
        """Make the live ranks agree after a failure: the ranks one step behind apply the last
        step's averaged gradient from a rank that applied it (of the same shard, sharded).
        Returns the agreed next step.

        ``next_steps``: each live rank's next step. A rank more than one step behind (not
        possible with windows of one quorum) is restarted and healed.
        """
        from .recovery import RankState, own_failure

        if not next_steps:
            return 0
        ahead = max(next_steps.values())
        behind = [r for r, s in next_steps.items() if s == ahead - 1]
        for r, s in next_steps.items():
            if s < ahead - 1:
                log.warning("rank %d is at step %d, %d behind; healing it", r, s, ahead - s)
                self.fail_rank(r, RuntimeError(f"rank {r} fell {ahead - s} steps behind"))
        if not behind:
            return ahead
        donors = [r for r, s in next_steps.items() if s == ahead and self.state.get(r) == RankState.LIVE]
        timeout = self.options.collective_timeout_s
        grads: dict[int, Any] = {}  # shard index -> that shard's reduced gradient of the last step
        for shard in sorted({self.layout.shard_of(r) for r in behind}):
            for donor in [d for d in donors if self.layout.shard_of(d) == shard]:
                try:
                    grads[shard] = self._get(self.trainers[donor].gradient.call_one(ahead - 1), timeout)
                    break
                except Stopped:
                    raise
                except Exception as exc:
                    if own_failure(exc):
                        self.fail_rank(donor, exc)
            else:  # every rank that applied the last step is gone: the others have not, redo it
                return ahead - 1
        futures = {r: self.trainers[r].apply_gradient.call_one(ahead - 1, grads[self.layout.shard_of(r)])
                   for r in behind}
        _, errors = wait_all(futures, timeout, self.run.stop_event)
        for r, error in errors.items():
            self.fail_rank(r, error)
        return ahead

    # -- restore from a snapshot --------------------------------------------------------------------
    def restore(self, paths: dict[int, str]) -> dict[int, dict]:
        """Load snapshot ``paths[rank]`` into each ready rank (a sharded run: its shard's); returns
        ``{rank: result}`` of the ranks that loaded it (they are live now). Ranks that fail are
        restarted again.

        Raises:
            TrainingError: no rank could load it (the message says why).
        """
        from .recovery import RankState, TrainingError

        self.run.phase("restoring")
        futures = {r: self.trainers[r].restore_snapshot.call_one(paths[r]) for r in self.ready if r in paths}
        values, errors = wait_all(futures, self.options.collective_timeout_s + 5.0, self.run.stop_event)
        bad_snapshot = [e for e in errors.values() if isinstance(e, ActorError)
                        and e.exception_type in ("ValueError", "FileNotFoundError")]
        if not values and bad_snapshot:
            raise TrainingError(f"every rank failed at once, and the snapshot cannot be used: {bad_snapshot[0]}")
        for r, exc in errors.items():
            self.fail_rank(r, exc)
        if not values:
            raise TrainingError("every rank failed at once, and no restarted rank could load the snapshot")
        step = max(v["next_step"] for v in values.values())
        for r, v in values.items():
            if v["next_step"] == step:
                self.move(r, RankState.LIVE)
        return {r: v for r, v in values.items() if v["next_step"] == step}
