"""Data order and sharding for fault-tolerant data parallelism: a pure function, and a ledger that proves it.

The global order of samples is a pure function of ``(seed, data epoch, step)``: data epoch ``e`` is
one permutation of the training set drawn from ``numpy.random.default_rng((seed, e))``, and step
``s`` takes the ``s % steps_per_epoch``-th block of ``global_batch`` samples of data epoch
``s // steps_per_epoch`` (the ragged tail of a permutation is dropped). Each step's global batch
is split into contiguous shards over the ranks live at that step, in rank order, so a failure
that changes the live ranks changes who computes a sample, never which samples a step uses.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SampleOrder", "shard", "SampleLedger"]


class SampleOrder:
    """Which training samples each step uses.

    Args:
        num_samples: size of the training set (int > 0).
        global_batch: samples per step over all ranks (0 < global_batch <= num_samples).
        seed: the run's seed.

    Raises:
        ValueError: a non-positive size, or a batch larger than the training set.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if num_samples <= 0:
            raise ValueError(f"the training set is empty (num_samples={num_samples})")
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        if global_batch > num_samples:
            raise ValueError(f"global_batch {global_batch} is larger than the training set ({num_samples} samples)")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = num_samples // global_batch
        self._cache: dict[int, np.ndarray] = {}

    def position(self, step: int) -> tuple[int, int]:
        """``(data epoch, step within it)`` of global step ``step``."""
        return divmod(step, self.steps_per_epoch)

    def permutation(self, data_epoch: int) -> np.ndarray:
        """The sample order of one data epoch: int64 array of shape ``(num_samples,)``."""
        perm = self._cache.get(data_epoch)
        if perm is None:
            perm = np.random.default_rng((self.seed, data_epoch)).permutation(self.num_samples)
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[data_epoch] = perm
        return perm

    def batch(self, step: int) -> np.ndarray:
        """Sample indices of global step ``step``: int64 array of shape ``(global_batch,)``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        data_epoch, within = self.position(step)
        start = within * self.global_batch
        return self.permutation(data_epoch)[start : start + self.global_batch]

    def shard(self, step: int, ranks: list[int], rank: int) -> np.ndarray:
        """The part of step ``step``'s batch that ``rank`` computes when ``ranks`` are live."""
        return shard(self.batch(step), ranks, rank)


def shard(batch: np.ndarray, ranks: list[int], rank: int) -> np.ndarray:
    """Contiguous near-equal share of ``batch`` for ``rank`` among sorted ``ranks``.

    Raises:
        ValueError: ``rank`` is not in ``ranks``.
    """
    ordered = sorted(ranks)
    if rank not in ordered:
        raise ValueError(f"rank {rank} is not among the live ranks {ordered}")
    return np.array_split(batch, len(ordered))[ordered.index(rank)]


@dataclass
class SampleLedger:
    """Every sample consumed by every committed step: ``entries[step] = {rank: [sample ids]}``.

    Only committed steps are recorded (a step attempt that failed and was redone is kept in
    ``attempts`` with its outcome, not in ``entries``).
    """

    entries: dict = field(default_factory=dict)
    attempts: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, step: int, by_rank: dict[int, list[int]]) -> None:
        with self._lock:
            self.entries[step] = {int(r): [int(i) for i in ids] for r, ids in sorted(by_rank.items())}

    def record_attempt(self, step: int, epoch: int, ranks: list[int], outcome: str) -> None:
        with self._lock:
            self.attempts.append({"step": step, "epoch": epoch, "ranks": list(ranks), "outcome": outcome})

    def consumed(self, step: int) -> list[int]:
        """Sample ids of committed step ``step``, in rank order."""
        return [i for ids in self.entries.get(step, {}).values() for i in ids]

    def audit(self, order: SampleOrder, steps: int, start: int = 0) -> dict:
        """Compare the ledger with what steps ``start..steps-1`` should have consumed.

        Returns:
            ``{"samples_expected", "samples_consumed", "samples_lost", "samples_repeated",
            "steps_missing"}`` (ints): lost = expected but not consumed, repeated = consumed more
            often than expected, counted as multisets per step.
        """
        lost = repeated = expected_total = consumed_total = missing = 0
        for step in range(start, steps):
            want = collections.Counter(int(i) for i in order.batch(step))
            got = collections.Counter(self.consumed(step))
            if step not in self.entries:
                missing += 1
            expected_total += sum(want.values())
            consumed_total += sum(got.values())
            lost += sum((want - got).values())
            repeated += sum((got - want).values())
        extra = [s for s in self.entries if s >= steps or s < start]
        repeated += sum(len(self.consumed(s)) for s in extra)
        return {
            "samples_expected": expected_total,
            "samples_consumed": consumed_total,
            "samples_lost": lost,
            "samples_repeated": repeated,
            "steps_missing": missing,
        }

    def to_dict(self) -> dict:
        with self._lock:
            return {"entries": {str(s): {str(r): ids for r, ids in v.items()} for s, v in self.entries.items()},
                    "attempts": list(self.attempts)}
