"""Replica checksums name what differs (``monarch_nb.train.replica_checksum``): the state of a
real BatchNorm model, its AdamW and a StepLR, hashed part by part, as ``Trainer.checksum`` does.
No processes."""

from __future__ import annotations

import copy

import torch

from monarch_nb.train.replica_checksum import ReplicaChecksum, describe_divergence, replica_digests, state_checksum


def _replica(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _checksum(rank: int, model, opt, sched, shard: int = 0) -> ReplicaChecksum:
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "registered": {"sched": sched.state_dict()}}
    digest, parts = state_checksum(state)
    return ReplicaChecksum(rank=rank, digest=digest, applied_steps=1, next_step=1, shard=shard, parts=parts)


def test_identical_replicas_have_one_digest_and_every_part_named():
    a, b = _replica(), _replica()
    sums = {0: _checksum(0, *a), 1: _checksum(1, *b)}
    assert sums[0].digest == sums[1].digest and len(sums[0].digest) == 16
    assert len(replica_digests(sums)) == 1
    assert describe_divergence(sums) == "identical"
    names = [n for n, _ in sums[0].parts]
    assert "model.1.running_mean" in names and "optimizer.state.0" in names
    assert "optimizer.param_groups" in names and "registered.sched" in names


def test_a_buffer_and_one_parameters_optimizer_state_that_differ_are_named():
    a, b, c = _replica(), _replica(), _replica()
    b[0][1].running_mean.add_(1e-7)  # a BatchNorm buffer off by a rounding error on rank 1
    opt_c = c[1]
    first = opt_c.param_groups[0]["params"][2]  # the BatchNorm weight's exp_avg on rank 2
    opt_c.state[first]["exp_avg"].mul_(1.5)
    sums = {0: _checksum(0, *a), 1: _checksum(1, *b), 2: _checksum(2, *c), 3: _checksum(3, *copy.deepcopy(a))}
    assert len(replica_digests(sums)) == 3
    text = describe_divergence(sums)
    assert text.startswith("ranks [0, 3] | [1] | [2] differ in ")
    assert set(text.split(" differ in ")[1].split(", ")) == {"model.1.running_mean", "optimizer.state.2"}


def test_shards_are_compared_only_with_their_own_index():
    a, b = _replica(0), _replica(1)  # two shard indices hold different tensors: that is not a divergence
    sums = {0: _checksum(0, *a, shard=0), 1: _checksum(1, *b, shard=1),
            2: _checksum(2, *copy.deepcopy(a), shard=0), 3: _checksum(3, *copy.deepcopy(b), shard=1)}
    assert len(replica_digests(sums)) == 1
    b2 = copy.deepcopy(b)
    b2[2].last_epoch += 1  # the scheduler of rank 3 ran one step more
    sums[3] = _checksum(3, *b2, shard=1)
    assert describe_divergence(sums) == "shard 1: ranks [1] | [3] differ in registered.sched"
