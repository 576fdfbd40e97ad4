"""One user training loop, under three runtimes, for bench/own_loop.py: ``monarch_nb.ft``, plain
torch DDP (launched by torchrun), and torchft 0.2.0 (Manager + its DDP + ProcessGroupGloo).

The loop body is the same everywhere — the model, the optimizer, the loss, the samples of each
step (the pure order of :class:`monarch_nb.train.data.SampleOrder`) — and only the lines each
runtime needs differ:

- :func:`ft_loop`: ``ft.wrap`` / ``ft.batches`` / ``ft.step`` (run by ``mt.start``);
- ``python -m torch.distributed.run ... _user_loop.py ddp ...``: ``DistributedDataParallel``, each
  rank takes its part of the step's global batch;
- ``_user_loop.py torchft-driver ...``: a lighthouse in this process, one replica group of one
  process per rank (``_user_loop.py torchft-worker``), each group's TCPStore hosted here (it
  outlives the worker, as torchrun's agent would). torchft trains each step on the groups present:
  a missing group's part of a step is never trained (counted as samples lost).

Data: ``digits`` from a ``.npz`` the benchmark writes (so the peers' venv needs no
scikit-learn), ``charlm`` from a text file. Every process writes one JSON line of step records.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data(kind: str, path: str):
    """``(num_samples, batch(indices) -> (x, y), model factory, lr)``."""
    import numpy as np
    import torch

    if kind == "digits":
        arrays = np.load(path)
        x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])

        def batch(indices):
            idx = torch.as_tensor(indices, dtype=torch.int64)
            return x[idx], y[idx]

        def model():
            return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

        return len(y), batch, model, 3e-3
    from monarch_nb.train.workloads import CharLMWorkload

    workload = CharLMWorkload(path)
    workload.setup()
    return workload.num_train, workload.train_batch, workload.build_model, 1e-3


def _loss(model, x, y):
    import torch.nn.functional as F

    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# -- monarch_nb.ft ---------------------------------------------------------------------------------
def ft_loop(kind: str, path: str, steps: int, batch_size: int, step_sleep_s: float = 0.0,
            times_out: str | None = None):
    """The loop with ``ft`` (``mt.start(ft_loop, procs=N, args=(...))``). With ``times_out``,
    rank 0 writes the wall time after each step there, as the DDP loop does (the same measure)."""
    import torch

    from monarch_nb import ft

    n, batch, make_model, lr = _data(kind, path)
    model = make_model()
    model, opt = ft.wrap(model, torch.optim.Adam(model.parameters(), lr=lr))
    times = []
    for _step, (x, y) in ft.batches(batch, batch_size, steps, num_samples=n):
        loss = _loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        ft.step(opt, loss=loss)
        times.append(time.time())
        if step_sleep_s:
            time.sleep(step_sleep_s)
    if times_out and ft.rank() == 0:
        with open(times_out, "w") as f:
            json.dump({"times": times, "global_batch": batch_size}, f)
    return ft.report()


# -- plain DDP (torchrun) ----------------------------------------------------------------------------
def ddp_main(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from monarch_nb.train.data import SampleOrder

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("user-loop/", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    n, batch, make_model, lr = _data(args.data, args.path)
    order = SampleOrder(n, args.batch_size, 0)
    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    times = []
    for step in range(args.steps):
        x, y = batch(order.shard(step, list(range(world)), rank))
        loss = _loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.time())
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "global_batch": args.batch_size}, f)
    dist.destroy_process_group()


# -- torchft ------------------------------------------------------------------------------------------
def torchft_worker(args) -> None:
    from datetime import timedelta

    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from monarch_nb.train.data import SampleOrder

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), args.groups
    torch.set_num_threads(1)
    n, batch, make_model, lr = _data(args.data, args.path)
    order = SampleOrder(n, args.batch_size, 0)
    torch.manual_seed(0)
    net = make_model()
    inner = torch.optim.Adam(net.parameters(), lr=lr)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))

    def state_dict():
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"user_loop_{group}", timeout=timedelta(seconds=30), hostname="127.0.0.1",
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")))
    model = DistributedDataParallel(manager, net)
    opt = Optimizer(manager, inner)
    records = []
    while manager.current_step() < args.steps:
        step = manager.current_step()
        if step == args.kill_at and group == args.kill_group:
            with open(f"{args.out}.kill", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()  # starts the step's quorum
        x, y = batch(order.shard(step, list(range(groups)), group))  # this group's part, whoever is present
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()  # applies the update only if the step's quorum committed it
        records.append((time.time(), step, manager.num_participants(), manager.current_step() > step))
    with open(f"{args.out}.{group}", "w") as f:
        json.dump({"records": records}, f)
    manager.shutdown(wait=False)


def torchft_driver(args) -> None:
    """A lighthouse and one store per group here; ``groups`` worker processes; one summary."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
              for _ in range(args.groups)]
    workers = []
    for group, store in enumerate(stores):
        env = dict(os.environ, REPLICA_GROUP_ID=str(group), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   RANK="0", WORLD_SIZE="1", TORCHFT_LIGHTHOUSE=lighthouse.address(), RUST_LOG="warn",
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "torchft-worker", *sys.argv[2:]]
        workers.append(subprocess.Popen(cmd, env=env))
    for w in workers:
        w.wait(timeout=1800)
    lighthouse.shutdown()
    summary: dict = {"groups": {}, "kill_time": None}
    if os.path.exists(f"{args.out}.kill"):
        summary["kill_time"] = float(open(f"{args.out}.kill").read())
        os.unlink(f"{args.out}.kill")
    for group in range(args.groups):
        path = f"{args.out}.{group}"
        if os.path.exists(path):
            summary["groups"][group] = json.load(open(path))["records"]
            os.unlink(path)
    with open(args.out, "w") as f:
        json.dump(summary, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("ddp", "torchft-driver", "torchft-worker"))
    p.add_argument("--data", choices=("digits", "charlm"), required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-group", type=int, default=-1)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    {"ddp": ddp_main, "torchft-driver": torchft_driver, "torchft-worker": torchft_worker}[args.mode](args)


if __name__ == "__main__":
    main()
