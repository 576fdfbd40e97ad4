"""Data order and sharding for fault-tolerant data parallelism: a pure function, and a ledger that proves it.

The global order of samples is a pure function of ``(seed, data epoch, step)``: data epoch ``e`` is
one permutation of the training set drawn from ``numpy.random.default_rng((seed, e))``, and step
``s`` takes the ``s % steps_per_epoch``-th block of ``global_batch`` samples of data epoch
``s // steps_per_epoch`` (the ragged tail of a permutation is dropped). Each step's global batch
is split into contiguous shards over the ranks of the quorum that ran the step, in rank order,
so a failure that changes the quorum changes who computes a sample, never which samples a step
uses.

Ranks report a :func:`digest` (CRC-32) of the sample ids they actually used in each step rather
than the ids themselves; the :class:`SampleLedger` records, per committed step, the quorum and
those digests, and its :meth:`~SampleLedger.audit` checks them against the pure order.
"""

from __future__ import annotations

import collections
import threading
import zlib
from typing import Iterable, Mapping

import numpy as np

__all__ = ["SampleOrder", "shard", "shard_bounds", "digest", "SampleLedger"]


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


def shard_bounds(batch_len: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``batch_len`` items are split into ``parts`` contiguous,
    near-equal parts, the first ``batch_len % parts`` one item longer (``numpy.array_split``)."""
    q, r = divmod(batch_len, parts)
    lo = index * q + min(index, r)
    return lo, lo + q + (1 if index < r else 0)


def shard(batch: np.ndarray, ranks: Iterable[int], rank: int) -> np.ndarray:
    """Contiguous near-equal share of ``batch`` for ``rank`` among ``ranks`` (taken in sorted order).

    Raises:
        ValueError: ``rank`` is not in ``ranks``.
    """
    ordered = sorted(ranks)
    if rank not in ordered:
        raise ValueError(f"rank {rank} is not among the live ranks {ordered}")
    lo, hi = shard_bounds(len(batch), len(ordered), ordered.index(rank))
    return batch[lo:hi]


def digest(indices: np.ndarray) -> int:
    """CRC-32 of sample ids (as little-endian int64): what a rank reports instead of the ids."""
    return zlib.crc32(np.ascontiguousarray(indices, dtype="<i8").tobytes())


class SampleLedger:
    """Every sample consumed by every committed step.

    A step is recorded either with its ids (:meth:`record`) or, as training does, with the quorum
    that ran it and each rank's :func:`digest` of the ids it used (:meth:`record_shards`); the ids
    are then the pure order's shards, and :meth:`audit` checks the digests. Only committed steps
    are recorded: an attempt that failed and was redone is kept in ``attempts`` with its outcome.
    Steps undone by a restore from a snapshot are dropped (:meth:`forget_from`) and recorded again
    when they are redone.

    Args:
        order: the run's :class:`SampleOrder` (needed for :meth:`record_shards`).
    """

    def __init__(self, order: SampleOrder | None = None):
        self.order = order
        self.attempts: list[dict] = []
        self._ids: dict[int, dict[int, list[int]]] = {}
        self._shards: dict[int, tuple[tuple[int, ...], dict]] = {}
        self._lock = threading.Lock()

    # -- recording ----------------------------------------------------------------------------------
    def record(self, step: int, by_rank: Mapping[int, Iterable[int]]) -> None:
        """Record committed step ``step`` with the sample ids each rank used."""
        with self._lock:
            self._shards.pop(step, None)
            self._ids[step] = {int(r): [int(i) for i in ids] for r, ids in sorted(by_rank.items())}

    def record_shards(self, step: int, ranks: Iterable[int], digests: Mapping[int, int | None]) -> None:
        """Record committed step ``step`` as run by ``ranks``, with each rank's digest of the ids it
        used (None: the rank died before reporting; its contribution is proven by the completed
        all-reduce, its ids are the pure order's).

        Raises:
            ValueError: the ledger has no sample order.
        """
        if self.order is None:
            raise ValueError("record_shards needs a ledger made with the run's SampleOrder")
        with self._lock:
            self._ids.pop(step, None)
            self._shards[step] = (tuple(sorted(ranks)), dict(digests))

    def record_attempt(self, step: int, quorum: int, ranks: list[int], outcome: str) -> None:
        """Note a failed attempt of ``step`` by quorum ``quorum`` of ``ranks`` (not committed)."""
        with self._lock:
            self.attempts.append({"step": step, "quorum": quorum, "ranks": list(ranks), "outcome": outcome})

    def forget_from(self, step: int) -> int:
        """Drop committed steps ``>= step`` (they will be redone); returns how many were dropped."""
        with self._lock:
            gone = [s for s in set(self._ids) | set(self._shards) if s >= step]
            for s in gone:
                self._ids.pop(s, None)
                self._shards.pop(s, None)
        return len(gone)

    # -- reading ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ids) + len(self._shards)

    def __contains__(self, step: object) -> bool:
        return step in self._ids or step in self._shards

    def steps(self) -> list[int]:
        """The committed steps, sorted."""
        with self._lock:
            return sorted(set(self._ids) | set(self._shards))

    def by_rank(self, step: int) -> dict[int, list[int]]:
        """``{rank: sample ids}`` of committed step ``step`` (empty if not committed)."""
        with self._lock:
            if step in self._ids:
                return {r: list(ids) for r, ids in self._ids[step].items()}
            entry = self._shards.get(step)
        if entry is None:
            return {}
        ranks, _ = entry
        assert self.order is not None, "shards are recorded only by a ledger with an order"
        batch = self.order.batch(step)
        return {r: [int(i) for i in shard(batch, ranks, r)] for r in ranks}

    @property
    def entries(self) -> dict[int, dict[int, list[int]]]:
        """``{step: {rank: [sample ids]}}`` of every committed step."""
        return {s: self.by_rank(s) for s in self.steps()}

    def consumed(self, step: int) -> list[int]:
        """Sample ids of committed step ``step``, in rank order."""
        return [i for ids in self.by_rank(step).values() for i in ids]

    def audit(self, order: SampleOrder, steps: int, start: int = 0) -> dict:
        """Compare the ledger with what steps ``start..steps-1`` should have consumed.

        Returns:
            ``{"samples_expected", "samples_consumed", "samples_lost", "samples_repeated",
            "steps_missing", "digest_mismatches"}`` (ints): lost = expected but not consumed,
            repeated = consumed more often than expected, counted as multisets per step; a shard
            whose reported digest does not match the pure order's counts as lost.
        """
        lost = repeated = expected_total = consumed_total = missing = mismatches = 0
        with self._lock:
            ids, shards = dict(self._ids), dict(self._shards)
        for step in range(start, steps):
            batch = order.batch(step)
            expected_total += len(batch)
            if step in shards:
                ranks, digests = shards[step]
                consumed_total += len(batch)  # the shards of a quorum partition the batch
                for rank in ranks:
                    reported = digests.get(rank)
                    part = shard(batch, ranks, rank)
                    if reported is not None and reported != digest(part):
                        mismatches += 1
                        lost += len(part)
                continue
            if step not in ids:
                missing += 1
                lost += len(batch)
                continue
            want = collections.Counter(int(i) for i in batch)
            got = collections.Counter(i for part in ids[step].values() for i in part)
            consumed_total += sum(got.values())
            lost += sum((want - got).values())
            repeated += sum((got - want).values())
        extra = [s for s in set(ids) | set(shards) if s >= steps or s < start]
        repeated += sum(len(self.consumed(s)) for s in extra)
        return {
            "samples_expected": expected_total,
            "samples_consumed": consumed_total,
            "samples_lost": lost,
            "samples_repeated": repeated,
            "steps_missing": missing,
            "digest_mismatches": mismatches,
        }

    def to_dict(self) -> dict:
        """``{"entries": {step: {rank: ids}}, "attempts": [...]}`` with string keys (for JSON)."""
        entries = {str(s): {str(r): ids for r, ids in v.items()} for s, v in self.entries.items()}
        with self._lock:
            return {"entries": entries, "attempts": list(self.attempts)}
