"""Training's pure parts: the sample order, the shards of a step, the ledger's audit."""

from __future__ import annotations

import numpy as np
import pytest

from monarch_nb.train import SampleLedger, SampleOrder
from monarch_nb.train.data import shard


def test_sample_order_is_a_pure_function_and_shards_cover_the_batch():
    a, b = SampleOrder(100, 16, seed=3), SampleOrder(100, 16, seed=3)
    assert a.steps_per_epoch == 6
    for step in (0, 5, 6, 40):
        assert np.array_equal(a.batch(step), b.batch(step))
    assert not np.array_equal(a.batch(0), SampleOrder(100, 16, seed=4).batch(0))
    epoch0 = np.concatenate([a.batch(s) for s in range(6)])
    assert len(set(epoch0.tolist())) == 96  # no sample twice within a data epoch
    for live in ([0, 1, 2, 3], [0, 3], [2]):
        parts = [shard(a.batch(7), live, r) for r in live]
        assert sorted(np.concatenate(parts).tolist()) == sorted(a.batch(7).tolist())
    with pytest.raises(ValueError, match="not among the live ranks"):
        shard(a.batch(0), [0, 1], 2)


def test_ledger_audit_counts_lost_and_repeated_samples():
    order = SampleOrder(50, 10, seed=0)
    ledger = SampleLedger()
    for s in range(3):
        batch = order.batch(s).tolist()
        ledger.record(s, {0: batch[:5], 1: batch[5:]})
    assert ledger.audit(order, 3)["samples_lost"] == 0
    ledger.record(1, {0: order.batch(1).tolist()[:9] + [order.batch(1).tolist()[0]]})
    audit = ledger.audit(order, 3)
    assert (audit["samples_lost"], audit["samples_repeated"]) == (1, 1)


