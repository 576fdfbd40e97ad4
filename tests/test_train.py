"""Fault-tolerant training: real procs, real SIGKILL / SIGSTOP, results equal to a fault-free run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading

import numpy as np

import pytest

from monarch_nb.runtime.controller import Controller
from monarch_nb.train import SampleOrder, Workload, start

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
PROCS = 3
FIT = dict(eval_every=0, keep_parameters=True)


@pytest.fixture(scope="module", autouse=True)
def patient_hang_timeout():
    """Workers importing torch on a busy 2-core machine can miss 1 s of heartbeats; these tests
    fence a real SIGSTOP, so a 3 s hang timeout keeps them about training, not about load."""
    import monarch_nb
    from monarch_nb.config import config

    before = config.hang_timeout_s
    monarch_nb.configure(hang_timeout_s=3.0)
    yield
    monarch_nb.configure(hang_timeout_s=before)


# -- bad input: a clear error before any worker starts ---------------------------------------------
def _meshes() -> int:
    controller = Controller.existing()
    return len(controller.meshes) if controller else 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fault", "kill@5:rank=9"], "rank 9 does not exist"),
        (["--fault", "kill@500:rank=1", "--steps", "10"], "never reached"),
        (["--fault", "boom@5:rank=1"], "unknown fault kind"),
        (["--procs", "5000"], "training set has only"),
        (["--workload", "charlm", "--text", "/nonexistent/file.txt"], "does not exist"),
        (["--workload", "charlm", "--text", "EMPTY"], "is empty"),
        (["--fault", "kill@3:rank=0", "--fault", "kill@3:rank=1", "--procs", "2"], "fail every rank"),
    ],
)
def test_cli_bad_inputs(argv, message, capsys, tmp_path):
    from monarch_nb.cli import main

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    before = _meshes()
    assert main(["train", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
    assert _meshes() == before  # nothing was spawned


def test_cli_unknown_workload_is_rejected_by_the_parser(capsys):
    from monarch_nb.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", "--workload", "imagenet"])
    assert info.value.code == 2
    assert "invalid choice: 'imagenet'" in capsys.readouterr().err


# -- real runs --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(no_leaked_processes):
    """The fault-free run every faulty run must match."""
    run = start("digits", procs=PROCS, steps=STEPS, seed=0, **FIT)
    report = run.report(timeout=150)
    assert report.failures == [] and report.steps == STEPS
    return run


def _check_matches_reference(run, reference, *, expect_rejoined: list[int]):
    report = run.report(timeout=150)
    assert report.steps == STEPS and not report.stopped_early
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    for step in range(STEPS):  # the same samples in every step, whoever computed them
        assert sorted(run.ledger.consumed(step)) == sorted(reference.ledger.consumed(step)), step
    # every replica, the rejoined ones included, holds exactly the same parameters ...
    assert report.replicas_identical
    ranks = sorted(run.parameters)
    for rank in expect_rejoined:
        assert rank in ranks, f"rank {rank} did not rejoin: live at the end {ranks}"
    first = run.parameters[ranks[0]]
    for rank in ranks[1:]:
        for name, tensor in first.items():
            assert np.array_equal(tensor.numpy(), run.parameters[rank][name].numpy()), (rank, name)
    # ... equal to the fault-free run's up to the order of the floating-point reduction
    ref = next(iter(reference.parameters.values()))
    for name, tensor in first.items():
        np.testing.assert_allclose(tensor.numpy(), ref[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    return report


def test_step_metrics_carry_the_largest_local_gradient_norm(reference):
    """grad_norm of step 0, recomputed here from the same seed and shards: the largest of the ranks'
    local gradient norms (hip_ext.grad_health on each rank, before the all-reduce)."""
    import torch

    from monarch_nb.train import get_workload

    wl = get_workload("digits", seed=0)
    wl.setup()
    torch.manual_seed(0)
    model = wl.build_model()
    order = SampleOrder(wl.num_train, wl.default_batch, 0)
    norms = []
    for rank in range(PROCS):
        model.zero_grad()
        inputs, targets = wl.train_batch(order.shard(0, list(range(PROCS)), rank))
        wl.loss_sum(model, inputs, targets)[0].backward()
        norms.append(sum(p.grad.double().square().sum().item() for p in model.parameters()) ** 0.5)
    assert reference.metrics[0]["grad_norm"] == pytest.approx(max(norms), rel=1e-5)
    assert all(0 < m["grad_norm"] < float("inf") for m in reference.metrics)
    assert len(reference.report().params_checksum) == 16  # 64 bits in hex, equal on every replica


def test_kill_survivors_redo_the_step_and_the_rank_rejoins(reference):
    run = start("digits", procs=PROCS, steps=STEPS, seed=0, faults=["kill@8:rank=1"], **FIT)
    report = _check_matches_reference(run, reference, expect_rejoined=[1])
    (failure,) = report.failures
    assert (failure["kind"], failure["rank"], failure["step"], failure["cause"]) == ("kill", 1, 8, "SIGKILL")
    assert failure["detection_latency_s"] < 1.0
    assert failure["resume_latency_s"] is not None and failure["resume_latency_s"] < 5.0
    assert failure["rejoin_latency_s"] is not None and failure["replicas_identical_after_rejoin"]
    assert failure["heal_bytes"] > 0
    assert any("failed ranks [1]" in a["outcome"] for a in run.ledger.attempts if a["step"] == 8)


def test_hang_is_fenced_and_survivors_continue(reference):
    run = start("digits", procs=PROCS, steps=STEPS, seed=0, faults=["hang@8:rank=2"], **FIT)
    report = _check_matches_reference(run, reference, expect_rejoined=[2])
    (failure,) = report.failures
    assert failure["kind"] == "hang" and failure["cause"] in ("heartbeat", "hung", "fenced")
    assert failure["resume_latency_s"] is not None


def test_kill_inside_the_collective(reference):
    run = start("digits", procs=PROCS, steps=STEPS, seed=0, faults=["kill@8:rank=1,phase=collective"], **FIT)
    report = _check_matches_reference(run, reference, expect_rejoined=[1])
    (failure,) = report.failures
    assert failure["rank"] == 1 and failure["rejoin_latency_s"] is not None
    # the survivors were inside the reduction (the first bucket went through) when rank 1 died
    assert [a for a in run.ledger.attempts if a["step"] == 8 and "failed ranks [1]" in a["outcome"]]


def test_nan_gradient_is_caught_and_the_step_redone(reference):
    run = start("digits", procs=PROCS, steps=STEPS, seed=0, faults=["nan@8:rank=2"], **FIT)
    _check_matches_reference(run, reference, expect_rejoined=[])
    assert any("nonfinite gradient from ranks [2]" in a["outcome"] for a in run.ledger.attempts if a["step"] == 8)


def test_two_failures_at_once(reference):
    run = start("digits", procs=4, steps=STEPS, seed=0, faults=["kill@8:rank=1", "exit@8:rank=3,code=3"], **FIT)
    report = _check_matches_reference(run, reference, expect_rejoined=[1, 3])
    assert sorted((f["kind"], f["rank"]) for f in report.failures) == [("exit", 3), ("kill", 1)]
    assert all(f["rejoin_latency_s"] is not None for f in report.failures)


def test_failure_during_a_rejoin(reference):
    """Rank 1 is killed, and killed again as soon as its restart serves (before or while it heals)."""
    run = start("digits", procs=PROCS, steps=STEPS, seed=0, faults=["kill@6:rank=1"], **FIT)
    mesh = run.procs.name
    controller = Controller.get()
    fired = threading.Event()

    def kill_again(event):
        if event.mesh == mesh and event.rank == 1 and event.kind == "proc_restarted" and not fired.is_set():
            fired.set()
            run.procs.inject(1, "kill")

    unsubscribe = controller.events.subscribe(kill_again)
    try:
        report = _check_matches_reference(run, reference, expect_rejoined=[1])
    finally:
        unsubscribe()
    assert fired.is_set()
    restarts = [e for e in controller.events.events("proc_restarting") if e.mesh == mesh and e.rank == 1]
    assert len(restarts) >= 2
    assert [f for f in report.failures if f["rank"] == 1 and f["rejoin_latency_s"] is not None]


def test_disk_checkpoint_restarts_the_whole_job(reference, tmp_path):
    """Optional disk checkpoints (not used for single-rank recovery) resume a stopped job."""
    first = start("digits", procs=PROCS, steps=12, seed=0, checkpoint_dir=str(tmp_path), checkpoint_every=6,
                  eval_every=0)
    assert first.report(timeout=150).steps == 12
    assert sorted(os.listdir(tmp_path)) == ["step00000006.pt", "step00000012.pt"]
    run = start("digits", procs=PROCS, steps=STEPS, seed=0, checkpoint_dir=str(tmp_path), resume=True, **FIT)
    report = run.report(timeout=150)
    assert run.metrics[0]["step"] == 12 and report.steps == STEPS - 12
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    ref = next(iter(reference.parameters.values()))
    for name, tensor in next(iter(run.parameters.values())).items():
        np.testing.assert_allclose(tensor.numpy(), ref[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


# -- other workloads --------------------------------------------------------------------------------
def test_charlm_trains_on_a_real_text_file(tmp_path, no_leaked_processes):
    import inspect

    text = tmp_path / "text.txt"
    text.write_bytes(open(inspect.__file__, "rb").read()[:20000])
    run = start("charlm", procs=2, steps=4, seed=0, text=str(text), eval_every=0)
    report = run.report(timeout=150)
    assert report.workload == "charlm" and report.steps == 4
    assert report.final_loss is not None and 0 < report.final_loss < 6.0  # below log(256) = 5.55 + slack
    assert report.test_accuracy is None and report.test_loss is not None


def test_custom_workload_through_the_python_api(no_leaked_processes):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.arange(8.0)).unsqueeze(1)
    workload = Workload.custom(lambda: torch.nn.Linear(8, 1), (x, y), torch.nn.functional.mse_loss,
                               test=(x[:64], y[:64]), lr=0.05, batch_size=32)
    run = start(workload, procs=2, steps=40, seed=0, eval_every=0, faults=["kill@20:rank=1"])
    report = run.report(timeout=150)
    assert report.workload == "custom" and report.steps == 40 and report.samples_lost == 0
    assert report.test_loss < 0.5 * float((y[:64] ** 2).mean())


# -- the README's main job --------------------------------------------------------------------------
def test_readme_main_job_command_runs(tmp_path):
    """`make demo` runs `monarch-nb train` with the issue's faults; run its recipe, shortened."""
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "make demo" in readme and "monarch-nb train" in readme
    out = tmp_path / "report.json"
    args = f"--procs 3 --steps 30 --fault kill@10:rank=2 --fault hang@20:rank=1 --no-progress --report-json {out}"
    dry = subprocess.run(["make", "-n", "-s", "demo", f"DEMO_ARGS={args}"], cwd=REPO, capture_output=True, text=True,
                         check=True)
    recipe = dry.stdout.strip().splitlines()[-1]
    assert "monarch_nb.cli train" in recipe
    argv = shlex.split(recipe)
    argv[0] = sys.executable if argv[0].endswith("python") else argv[0]
    env = dict(os.environ, MONARCH_NB_HANG_TIMEOUT_S="3.0", MONARCH_NB_HEARTBEAT_INTERVAL_S="0.1")
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training report" in proc.stdout and "samples lost        0" in proc.stdout
    report = json.loads(out.read_text())
    assert report["steps"] == 30 and report["steps_lost"] == 0 and report["samples_repeated"] == 0
    assert sorted((f["kind"], f["rank"]) for f in report["failures"]) == [("hang", 1), ("kill", 2)]
    assert all(f["rejoin_latency_s"] is not None for f in report["failures"])
    assert len(report["ledger"]["entries"]) == 30
