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




def test_ledger_of_shards_and_digests_audits_against_the_pure_order():
    from monarch_nb.train.data import digest

    order = SampleOrder(100, 12, seed=1)
    ledger = SampleLedger(order)
    for step in range(5):
        ranks = [0, 1, 3] if step < 3 else [0, 3]  # rank 1 failed after step 2
        digests = {r: digest(order.shard(step, ranks, r)) for r in ranks}
        if step == 4:
            digests[3] = None  # rank 3 died before reporting; the all-reduce proves its part
        ledger.record_shards(step, ranks, digests)
    audit = ledger.audit(order, 5)
    assert (audit["samples_lost"], audit["samples_repeated"], audit["digest_mismatches"]) == (0, 0, 0)
    assert sorted(ledger.consumed(3)) == sorted(order.batch(3).tolist())
    assert list(ledger.by_rank(3)) == [0, 3] and len(ledger) == 5
    # a rank that used other samples than the order says is caught by its digest
    ledger.record_shards(2, [0, 1, 3], {0: 1234, 1: None, 3: None})
    audit = ledger.audit(order, 5)
    assert audit["digest_mismatches"] == 1 and audit["samples_lost"] == len(order.shard(2, [0, 1, 3], 0))
    # a restore from a snapshot of step 3 undoes steps 3 and 4: they are missing until redone
    assert ledger.forget_from(3) == 2 and ledger.steps() == [0, 1, 2]
    assert ledger.audit(order, 5)["steps_missing"] == 2
    assert set(ledger.to_dict()["entries"]) == {"0", "1", "2"}


def test_shard_bounds_match_numpy_array_split():
    from monarch_nb.train.data import shard_bounds

    for n in (0, 1, 7, 64, 65):
        for parts in (1, 2, 3, 4, 7):
            pieces = np.array_split(np.arange(n), parts)
            for i, piece in enumerate(pieces):
                lo, hi = shard_bounds(n, parts, i)
                assert np.array_equal(np.arange(n)[lo:hi], piece), (n, parts, i)


def test_report_reads_back_what_it_wrote(tmp_path):
    from monarch_nb.train.report import GOODPUT_MEANS, TrainReport

    report = TrainReport(final_loss=0.5, test_accuracy=0.9, test_loss=0.4, steps=10, procs=2, workload="digits",
                         backend="gloo", global_batch=64, goodput=0.97, quorums=3,
                         restores=[{"step": 8, "steps_redone": 2, "restore_s": 0.3}])
    path = report.to_json(str(tmp_path / "r.json"))
    again = TrainReport.from_json(path)
    assert again == report and str(again) == str(report)
    assert GOODPUT_MEANS in str(report) and "2 step(s) redone" in str(report)
    old = report.to_dict()
    old["epochs"] = old.pop("quorums")  # a report written before quorums were called so
    assert TrainReport.from_dict(old).quorums == 3
    with pytest.raises(ValueError, match="not a training report"):
        TrainReport.from_dict({"steps": 3})


def test_backend_nccl_needs_a_gpu():
    from monarch_nb import device
    from monarch_nb.train.options import check_backend

    check_backend("gloo")
    check_backend(None)
    with pytest.raises(ValueError, match="backend must be"):
        check_backend("mpi")
    if device.detect_gpus().count == 0:
        with pytest.raises(ValueError, match="use backend 'gloo'"):
            check_backend("nccl")


def test_the_digits_are_scikit_learns_digits_read_without_importing_it():
    """The controller reads the digits' data file itself (importing scikit-learn took 1.5 s
    before any proc started): the same arrays as ``load_digits()``, and scikit-learn not imported."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from monarch_nb.train.workloads import load_digits_arrays\n"
            "images, labels = load_digits_arrays()\n"
            "assert 'sklearn' not in sys.modules\n"
            "from sklearn.datasets import load_digits\n"
            "d = load_digits()\n"
            "assert np.array_equal(images, d.data) and np.array_equal(labels, d.target)\n"
            "assert images.shape == (1797, 64) and labels.dtype == np.int64\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_report_whose_path_went_bad_during_the_run_is_kept(tmp_path):
    """The path is checked before a run starts; if it becomes unusable before the end (here a
    folder made in its place), the finished run's report is kept and the write's error told."""
    from monarch_nb.train.options import make_options
    from monarch_nb.train.report import TrainReport
    from monarch_nb.train.run import TrainingRun

    path = tmp_path / "report.json"
    run = TrainingRun(make_options("digits", procs=2, steps=4, report_json=str(path)))  # nothing is started
    path.mkdir()
    report = TrainReport(final_loss=0.5, test_accuracy=0.9, test_loss=0.4, steps=4, procs=2, workload="digits",
                         backend="gloo", global_batch=64)
    run.set_report(report)
    assert isinstance(run.report_json_error, IsADirectoryError)
    assert run._report is report  # (report() waits for the run's thread, which this test never starts)
