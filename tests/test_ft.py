"""Your own training loop, fault tolerant with ``monarch_nb.ft``: real procs, real faults.

The loop below is what a user writes (BatchNorm, AdamW, an LR scheduler registered with ``ft``),
run by ``mt.start(train, procs=N)``. Faults of every kind during the loop, and every replica
killed at once, end with every step committed, 0 samples lost or repeated, and every replica
bit-identical (parameters, BatchNorm buffers, optimizer and scheduler state).
"""

from __future__ import annotations

import threading
import time

import pytest

import monarch_nb.train as mt
from monarch_nb import Actor, endpoint, ft
from monarch_nb.train import TrainingError, Workload

from .conftest import wait_until

STEPS = 60


pytestmark = pytest.mark.usefixtures("patient_hang_timeout")


def _data(n: int = 1200, seed: int = 3):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def _net():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.BatchNorm1d(24), torch.nn.ReLU(),
                               torch.nn.Linear(24, 2))


def train(steps: int = STEPS, batch_size: int = 48):
    """A user's loop: BatchNorm, AdamW, StepLR (registered), loss and accuracy reported."""
    import torch
    import torch.nn.functional as F

    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ft.wrap(model, opt)
    sched = ft.register("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5))
    for _step, (x, y) in ft.batches(_data(), batch_size=batch_size, steps=steps):
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        ft.step(opt, loss=loss, correct=int((out.argmax(-1) == y).sum()))
        sched.step()  # once per attempt: a redone step's is put back by ft
    return ft.report()


def _check(run, steps: int = STEPS, loss: bool = True):
    report = run.report(timeout=240)
    assert report.steps == steps and not report.stopped_early
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    assert report.replicas_identical, report.failures
    if loss:
        assert 0 < report.final_loss < 1.0
    return report


def test_the_loop_runs_locally_without_a_run():
    """Called directly (no mt.start): a plain single-process loop, the same code."""
    result = train(steps=30)
    assert result.local and result.steps_applied == 30 and result.next_step == 30


def test_each_fault_kind_during_the_users_loop():
    """kill, hang and raise — a death, a silence, an error of the function — one after the other
    (each once the last failed rank is back), on 3 ranks: each rank is restarted, runs the
    function again, is healed (BatchNorm buffers, optimizer, scheduler) and rejoins; no step lost
    or doubled, replicas identical. (segfault and exit end the proc as kill does: the same path,
    run with the others in test_train_faults' every-kind test.)"""
    from monarch_nb.runtime.controller import Controller

    run = mt.start(train, procs=3, args=(1_000_000,), keep_parameters=True)
    kinds = ("kill", "hang", "raise")
    try:
        wait_until(lambda: run.step >= 10 or run.done(), 150, message="training under way")
        ctrl = Controller.get()
        for i, kind in enumerate(kinds):
            rank = 1 + i % 2
            wait_until(lambda r=rank: len(run.live_ranks) == 3 and ctrl.proc_record(run.mesh_name, r).serving
                       or run.done(), 120, message=f"every rank live before the {kind}")
            run.procs.inject(rank, kind)
            wait_until(lambda k=kind: any(f.kind == k and f.rejoined_at for f in run._coordinator.m.failures)
                       or run.done(), 120, message=f"rank {rank} back after its {kind}")
        target = run.step + 10
        wait_until(lambda: run.step >= target or run.done(), 60, message="10 more steps with every rank")
    finally:
        assert run.stop(timeout=20.0)
    report = run.report(timeout=1)
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    assert report.replicas_identical, report.failures
    assert sorted(f["kind"] for f in report.failures) == sorted(kinds), report.failures
    assert all(f["rejoin_latency_s"] is not None for f in report.failures), report.failures
    for f in report.failures:
        assert f["rejoined_by"] == "heal" and f["replicas_identical_after_rejoin"], f


def test_every_replica_killed_restores_the_users_loop_from_the_snapshot():
    run = mt.start(train, procs=2, window_steps=4, snapshot_every=8, keep_parameters=True)
    fired = threading.Event()

    def kill_everyone(item):
        if item.get("type") == "step" and item["step"] >= 30 and not fired.is_set():
            fired.set()
            for rank in range(2):
                run.procs.inject(rank, "kill")
                time.sleep(0.2)

    run.subscribe(kill_everyone)
    report = _check(run)
    assert fired.is_set() and report.restores and report.steps_redone_from_snapshot >= 0


@pytest.mark.parametrize("procs", [2, 3])
def test_batchnorm_replicas_stay_identical_through_a_rejoin(procs):
    """A BatchNorm model through the built-in trainer (Workload.custom): its running statistics
    are averaged with the gradient, so the replicas agree and a rank healed from a peer rejoins
    identical (before, only gradients were reduced: 'replicas differ after rank(s) [1] rejoined')."""
    import torch.nn.functional as F

    workload = Workload.custom(_net, _data(), F.cross_entropy, batch_size=48, classification=True)
    run = mt.start(workload, procs=procs, steps=STEPS, faults=["kill@20:rank=1"], eval_every=0)
    report = _check(run)
    (failure,) = report.failures
    assert failure["replicas_identical_after_rejoin"] and failure["rejoined_by"] == "heal"


class LoopTrainer(Actor):
    """Monarch code whose endpoint holds the training loop: only the ``ft`` lines are added."""

    def __init__(self, lr: float):
        self.lr = lr

    @endpoint
    def train(self, steps: int):
        import torch
        import torch.nn.functional as F

        model = _net()
        model, opt = ft.wrap(model, torch.optim.AdamW(model.parameters(), lr=self.lr))
        for _step, (x, y) in ft.batches(_data(), batch_size=48, steps=steps):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            ft.step(opt, loss=loss)
        return ft.report()


def test_an_actor_endpoint_is_the_training_loop_and_survives_a_kill():
    """``mt.start(LoopTrainer.train, actor_args=(lr,))``: each rank makes its own actor and runs
    the endpoint; a killed rank's new proc makes a new one, is healed and rejoins."""
    run = mt.start(LoopTrainer.train, procs=2, args=(STEPS,), actor_args=(1e-2,), faults=["kill@20:rank=1"],
                   eval_every=0)
    report = _check(run)
    assert report.workload == "LoopTrainer.train"
    (failure,) = report.failures
    assert failure["kind"] == "kill" and failure["rejoined_by"] == "heal" and failure["replicas_identical_after_rejoin"]


def _no_ft_step():
    import torch

    model, opt = ft.wrap(torch.nn.Linear(12, 2), torch.optim.SGD(torch.nn.Linear(12, 2).parameters(), lr=0.1))
    for _step, _batch in ft.batches(_data(), batch_size=48, steps=5):
        pass  # forgot ft.step


def _no_wrap():
    for _step, _batch in ft.batches(_data(), batch_size=48, steps=5):
        pass


def _batch_by_rank():
    import torch

    model = torch.nn.Linear(12, 2)
    ft.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _step, _batch in ft.batches(_data(), batch_size=40 + ft.rank(), steps=5):
        ft.step()


@pytest.mark.parametrize("fn, message", [
    (_no_wrap, "before ft.wrap"),
    (_batch_by_rank, "disagree on (dataset size, batch_size, steps)"),
])
def test_a_loop_that_cannot_run_ends_the_run_with_a_clear_error(fn, message):
    run = mt.start(fn, procs=2, spares=0, restart_timeout_s=20)
    with pytest.raises(TrainingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run.report(timeout=120)


def test_a_step_not_ended_with_ft_step_ends_the_run_saying_so():
    """The same error on every rank at the same step is the loop's own bug, not a fault: the run
    ends at once with it (no restart after restart)."""
    run = mt.start(_no_ft_step, procs=2, spares=0, restart_timeout_s=20)
    with pytest.raises(TrainingError, match=r"raised on every rank at step 0.*call ft.step"):
        run.report(timeout=120)


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match="decides its own batch_size"):
        mt.start(train, procs=2, batch_size=64)
    with pytest.raises(TypeError, match=r"actor_args=/actor_kwargs= are for an actor class's endpoint"):
        mt.start(train, procs=2, actor_args=(1e-2,))
    with pytest.raises(ValueError, match="steps= .* or epochs="):
        next(ft.batches(_data(), batch_size=8))
    with pytest.raises(TypeError, match="cannot take samples from a int"):
        next(ft.batches(5, batch_size=8, steps=2))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        ft.wrap(_net(), object())


def test_a_dataloader_with_workers_is_a_source():
    """A DataLoader with worker processes: its workers load each window's shards ahead."""
    run = mt.start(_loader_loop, procs=2, keep_parameters=True, spares=0)
    report = _check(run, steps=20, loss=False)  # opt.step() reports no loss
    assert report.workload == "_loader_loop"
    wait_until(lambda: run.done(), 30, message="the run ended")


def _loader_loop():
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(*_data()), batch_size=16, num_workers=2, shuffle=True)
    model = _net()
    model, opt = ft.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _step, (x, y) in ft.batches(loader, batch_size=48, steps=20):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # the wrapped optimizer's step is ft.step
    return ft.report()


def _train_sgd_steplr(steps: int = 30):
    """SGD whose StepLR cuts the learning rate tenfold after step 19 (StepLR scales the group's
    current ``lr``: a failed attempt of step 19 has already cut it when the step is redone)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 2))
    model, opt = ft.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = ft.register("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.1))
    for _step, (x, y) in ft.batches(_data(), batch_size=48, steps=steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        ft.step(opt, loss=loss)
        sched.step()
    return opt.param_groups[0]["lr"]


def test_a_step_redone_where_the_scheduler_cuts_the_lr_uses_the_steps_own_lr():
    """A kill inside step 19's all-reduce: the survivors redo step 19 after their loops already
    ran its ``sched.step()`` (which cut the lr); the redo must use step 19's lr, so the run ends
    where the fault-free run ends (to the reduction order's rounding; a wrong lr is ~1e-2 off)."""
    import numpy as np

    reference = mt.start(_train_sgd_steplr, procs=3, keep_parameters=True, spares=0)
    _check(reference, steps=30, loss=False)
    faulted = mt.start(_train_sgd_steplr, procs=3, keep_parameters=True, faults=["kill@19:rank=1,phase=collective"])
    report = _check(faulted, steps=30, loss=False)
    assert [f["kind"] for f in report.failures] == ["kill"], report.failures
    want = next(iter(reference.parameters.values()))
    for rank, params in faulted.parameters.items():
        for name, tensor in want.items():
            np.testing.assert_allclose(params[name].numpy(), tensor.numpy(), rtol=0, atol=1e-5, err_msg=f"rank {rank} {name}")
