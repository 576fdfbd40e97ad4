"""Sharded training under fault tolerance: FSDP2 inside replica groups, HSDP across them. Real procs.

``parallelism="fsdp", group_size=2`` on 4 ranks is two replicas of two shards each. Fault free,
every rank's shards are bit-identical to torch's own HSDP (``fully_shard`` on a 2-D mesh under
torchrun, same seed and batches). A shard holder killed inside FSDP's reduce-scatter and another
killed inside the cross-group all-reduce: the run commits every step, loses no sample, restarts
the failed group and heals it shard by shard, and every shard ends identical across the groups.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

import monarch_nb.train as mt
from monarch_nb import ft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12

pytestmark = pytest.mark.usefixtures("patient_hang_timeout")


def _native_hsdp_shards(tmp_path, steps: int) -> dict:
    """``{rank: {name: local shard}}`` after ``steps`` steps of torch's HSDP (bench/_hsdp_train.py)."""
    import torch

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(REPO, "bench", "_hsdp_train.py"), "--steps", str(steps), "--group-size", "2",
           "--out", str(tmp_path / "hsdp.json"), "--shards-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(4)}


def test_fsdp_in_groups_of_two_is_bit_identical_to_native_hsdp(tmp_path):
    import numpy as np

    run = mt.start("digits", procs=4, steps=STEPS, group_size=2, parallelism="fsdp", eval_every=0,
                   keep_parameters=True, spares=0)
    report = run.report(timeout=240)
    assert report.steps == STEPS and report.replicas_identical and not report.failures
    native = _native_hsdp_shards(tmp_path, STEPS)
    assert sorted(run.parameters) == [0, 1, 2, 3]
    for rank, shards in run.parameters.items():
        assert sorted(shards) == sorted(native[rank]), rank
        for name, tensor in shards.items():
            assert tensor.shape == native[rank][name].shape, (rank, name)
            assert np.array_equal(tensor.numpy(), native[rank][name].numpy()), (rank, name)
    # a replica is split in two: each rank holds half of each weight matrix's rows
    full = sum(t.numel() for t in native[0].values()) + sum(t.numel() for t in native[1].values())
    assert sum(t.numel() for t in run.parameters[0].values()) < full


def test_every_group_killed_at_once_restores_the_sharded_snapshot():
    """Both groups die within a second: the ranks restarted first load their shard's snapshot of
    the newest step every shard has, the steps after it are redone, nothing is lost."""
    import threading
    import time

    run = mt.start("digits", procs=4, steps=80, group_size=2, parallelism="fsdp", snapshot_every=8, window_steps=4,
                   eval_every=0)
    fired = threading.Event()

    def kill_everyone(item):
        if item.get("type") == "step" and item["step"] >= 30 and not fired.is_set():
            fired.set()
            for rank in (0, 2, 1, 3):
                try:
                    run.procs.inject(rank, "kill")
                except RuntimeError:  # its group's restart already took it down
                    pass
                time.sleep(0.1)

    run.subscribe(kill_everyone)
    report = run.report(timeout=300)
    assert fired.is_set() and report.restores, report.failures
    assert report.steps == 80
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    assert report.replicas_identical
    # a group back first loads the snapshot; one back later is healed from it
    by = {f["rank"]: f["rejoined_by"] for f in report.failures}
    assert sorted(by) == [0, 1, 2, 3] and set(by.values()) <= {"snapshot", "heal"}, report.failures
    assert by[0] == by[1] and by[2] == by[3] and "snapshot" in by.values(), report.failures
    from monarch_nb.runtime.controller import Controller

    leftover = glob.glob(f"/dev/shm/monarch_nb-{Controller.get().run_id}-*-77*")
    assert not leftover, "the run's snapshot slots must be removed when it ends"


def _data(n: int = 960, seed: int = 5):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, 0] - 0.5 * x[:, 2] > 0).long()
    return x, y


def sharded_train(steps: int, marker_dir: str):
    """A user's loop (BatchNorm, AdamW) in which rank 1 dies inside FSDP's reduce-scatter of step
    8, then, once every group is back (the quorum has 4 ranks again), rank 2 dies inside the
    cross-group all-reduce (once each: a marker file is written first)."""
    import signal
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from monarch_nb.train import trainer_step

    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 2))
    model, opt = ft.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    reduce_scatter, cross_all_reduce = dist.reduce_scatter_single, trainer_step.all_reduce_sum

    def dying(where: str):
        def die(*args, **kwargs):
            with open(os.path.join(marker_dir, where), "w") as f:
                f.write(f"rank {ft.rank()} killed in the {where}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return die

    def once(where: str) -> bool:
        return not os.path.exists(os.path.join(marker_dir, where))

    for step, (x, y) in ft.batches(_data(), batch_size=32, steps=steps):
        in_rs = step == 8 and ft.rank() == 1 and once("reduce-scatter")
        in_ar = step >= 16 and ft.rank() == 2 and ft.world_size() == 4 and not once("reduce-scatter") and \
            once("all-reduce")
        dist.reduce_scatter_single = dying("reduce-scatter") if in_rs else reduce_scatter
        trainer_step.all_reduce_sum = dying("all-reduce") if in_ar else cross_all_reduce
        if not once("reduce-scatter") and once("all-reduce") and ft.world_size() < 4:
            time.sleep(0.05)  # the survivors' steps paced while the first group restarts (seconds on a loaded
            # machine, ~0.2 s idle): it is back well before the run's last step, where the second kill waits for it
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        ft.step(opt, loss=loss, correct=int((out.argmax(-1) == y).sum()))
    return ft.report()


def test_shard_holders_killed_in_the_reduce_scatter_and_in_the_cross_group_all_reduce(tmp_path):
    steps = 120
    run = mt.start(sharded_train, procs=4, group_size=2, parallelism="fsdp", args=(steps, str(tmp_path)),
                   spares=2, window_steps=4)
    report = run.report(timeout=300)
    assert (tmp_path / "reduce-scatter").exists(), "rank 1 never reached its reduce-scatter kill"
    assert (tmp_path / "all-reduce").exists(), "the first group was not back before the run ended"
    assert report.steps == steps
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    assert report.replicas_identical, report.failures
    # each dead rank's partner is taken out with it, and each group restarts as one
    kinds = sorted((f["rank"], f["kind"]) for f in report.failures)
    assert kinds == [(0, "group"), (1, "crash"), (2, "crash"), (3, "group")], report.failures
    for f in report.failures:
        assert f["rejoined_by"] == "heal" and f["replicas_identical_after_rejoin"], f


def _whole(parameters: dict, group_size: int) -> dict:
    """``{name: full tensor}`` of one replica: the shards of ranks ``0..group_size-1`` (FSDP2
    splits dim 0 in rank order)."""
    import torch

    return {name: torch.cat([parameters[r][name] for r in range(group_size)]) for name in parameters[0]}


def test_a_checkpoint_saved_in_groups_of_two_resumes_in_one_group_of_four(tmp_path):
    """DCP checkpoints of a sharded run load into another layout: a run in a group of 2 saves at
    steps 12 and 24; a run in one group of 4, and an unsharded one, resume from step 12 and end
    where the first ended (same model, optimizer state and samples; the sums are grouped
    differently, so to rounding)."""
    import shutil

    import numpy as np

    first = mt.start("digits", procs=2, steps=24, group_size=2, parallelism="fsdp", eval_every=0,
                     checkpoint_dir=str(tmp_path / "a"), checkpoint_every=12, keep_parameters=True, spares=0)
    assert first.report(timeout=240).steps == 24
    assert sorted(os.listdir(tmp_path / "a")) == ["step00000012.dcp", "step00000024.dcp"]
    shutil.copytree(tmp_path / "a" / "step00000012.dcp", tmp_path / "b" / "step00000012.dcp")
    second = mt.start("digits", procs=4, steps=24, group_size=4, parallelism="fsdp", eval_every=0,
                      checkpoint_dir=str(tmp_path / "b"), resume=True, keep_parameters=True, spares=0)
    report = second.report(timeout=240)
    assert second.metrics[0]["step"] == 12 and report.steps == 12
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    ended, resumed = _whole(first.parameters, 2), _whole(second.parameters, 4)
    assert sorted(ended) == sorted(resumed)
    for name, tensor in resumed.items():
        np.testing.assert_allclose(tensor.numpy(), ended[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    # and into an unsharded run (one whole replica): whole tensors, the same Adam state
    shutil.copytree(tmp_path / "a" / "step00000012.dcp", tmp_path / "c" / "step00000012.dcp")
    third = mt.start("digits", procs=1, steps=24, eval_every=0, checkpoint_dir=str(tmp_path / "c"), resume=True,
                     keep_parameters=True, spares=0)
    assert third.report(timeout=240).steps == 12 and third.metrics[0]["step"] == 12
    for name, tensor in third.parameters[0].items():
        np.testing.assert_allclose(tensor.numpy(), ended[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("options, message", [
    (dict(procs=3, group_size=2, parallelism="fsdp"), "does not divide the 3 procs"),
    (dict(procs=4, group_size=2), "parallelism='fsdp'"),
    (dict(procs=4, group_size=2, parallelism="zero3"), "parallelism must be"),
])
def test_a_layout_that_cannot_work_is_refused_before_anything_starts(options, message):
    with pytest.raises(ValueError, match=message):
        mt.start("digits", steps=5, **options)


def test_a_llama_in_groups_of_two_trains_through_a_killed_shard_holder():
    """The ``llama`` workload (transformers' LlamaForCausalLM, tiny) under FSDP2 in groups of 2:
    rank 1 is killed mid-run; its group restarts and heals, and the loss goes down from a byte
    model's start (ln 256 = 5.55 nats)."""
    pytest.importorskip("transformers")
    from monarch_nb.runtime.controller import Controller
    from monarch_nb.supervision.tree import find

    run = mt.start("llama", procs=4, steps=40, group_size=2, parallelism="fsdp", eval_every=0,
                   faults=["kill@20:rank=1"])
    tree_groups: dict = {}

    def on_item(item):  # the supervision tree marks each proc's replica group while it trains
        if item.get("type") == "step" and not tree_groups:
            tree_groups.update({p["rank"]: p["group"] for p in find(Controller.get().tree(run.mesh_name), "proc")})

    run.subscribe(on_item)
    report = run.report(timeout=300)
    assert tree_groups == {0: 0, 1: 0, 2: 1, 3: 1}
    assert report.workload == "llama" and report.steps == 40
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    assert report.replicas_identical, report.failures
    assert sorted((f["rank"], f["kind"]) for f in report.failures) == [(0, "group"), (1, "kill")]
    # the report names the groups: the first restarted (a new incarnation), both live at the end
    assert [(g["ranks"], g["state"], g["incarnations"] > 1, g["failures"]) for g in report.groups] == [
        ([0, 1], "live", True, 2), ([2, 3], "live", False, 0)]
    assert "group 0: ranks 0-1  live" in str(report) and "2 of 2 ranks (fsdp inside" in str(report)
    first = run.metrics[0]["loss"]
    assert 5.0 < first < 6.0 and report.final_loss < first - 1.0, (first, report.final_loss)


def test_the_llama_workload_without_transformers_says_how_to_get_it(monkeypatch):
    import importlib.util

    from monarch_nb.train.workloads import get_workload

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'monarch_nb\[llm\]'"):
        get_workload("llama")
