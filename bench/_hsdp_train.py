"""Native HSDP baseline (torch's FSDP2 on a 2-D device mesh, no fault tolerance), launched by
``python -m torch.distributed.run``.

The same workload (model, data, sample order, global batch) as ``monarch_nb.train`` with
``parallelism="fsdp", group_size=G``: ranks ``g*G .. g*G+G-1`` are replica ``g`` (the mesh
``("replicate", "shard")`` of shape ``(world/G, G)``), ``fully_shard`` on the whole model, gloo.
``--group-size`` equal to the world is plain FSDP2 (a 1-D mesh over every rank).
Each rank runs its contiguous part of every global batch (``SampleOrder.shard``), as a run does.
Rank 0 writes a JSON summary to ``--out`` (``cpu_s``: each rank's CPU time, seconds, after each
step); with ``--shards-dir`` every rank saves its local parameter shards (``{name: tensor}``) to
``rank<R>.pt`` there, for a bit-for-bit comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def bench_workload(name: str, seed: int = 0):
    """A built-in workload by name, or ``"llama-small"``: the llama workload's benchmark size
    (3,033,344 parameters; ``"llama"`` is the tests' tiny one)."""
    from monarch_nb.train.workloads import LlamaWorkload, default_text_path, get_workload

    if name == "llama-small":
        return LlamaWorkload(default_text_path(), size="small")
    return get_workload(name, seed=seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="digits", help="digits, charlm, llama or llama-small")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=2, help="ranks per replica (the shard dimension)")
    p.add_argument("--lr", type=float)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--out", required=True)
    p.add_argument("--shards-dir")
    p.add_argument("--evaluate", action="store_true",
                   help="the test set's loss at the end, as a monarch_nb run's final evaluation (same memory)")
    args = p.parse_args()

    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from _ddp_train import train_step

    from monarch_nb.train.data import SampleOrder

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if args.group_size == world:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh("cpu", (world // args.group_size, args.group_size), mesh_dim_names=("replicate", "shard"))
    workload = bench_workload(args.workload, seed=args.seed)
    workload.setup()
    batch = args.batch_size or workload.default_batch
    order = SampleOrder(workload.num_train, batch, args.seed)
    torch.manual_seed(args.seed)
    model = workload.build_model()
    fully_shard(model, mesh=mesh)
    opt = workload.build_optimizer([p for p in model.parameters() if p.requires_grad], args.lr or workload.default_lr)
    ranks = list(range(world))
    dist.barrier()
    step_s, times, cpu = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        train_step(workload, model, opt, order.shard(step, ranks, rank))
        step_s.append(time.perf_counter() - t0)
        times.append(time.time())
        cpu.append(time.process_time())
    if args.evaluate:
        model.eval()
        with torch.no_grad():
            for inputs, targets in workload.test_batches():
                workload.loss_sum(model, inputs, targets)
    if args.shards_dir:
        shards = {name: t.to_local().detach().clone() for name, t in model.state_dict().items()}
        torch.save(shards, os.path.join(args.shards_dir, f"rank{rank}.pt"))
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)
    cpus = [torch.zeros(len(cpu), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(cpus, torch.tensor(cpu, dtype=torch.float64))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"steps_run": len(step_s), "global_batch": batch, "step_ms": sorted(s * 1e3 for s in step_s),
                       "times": times, "peak_rss_bytes": [int(p.item()) for p in peaks],
                       "cpu_s": [c.tolist() for c in cpus]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
