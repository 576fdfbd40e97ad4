"""Plain torch DDP baseline for bench/training.py, launched by ``python -m torch.distributed.run``.

The same workload (model, data, sample order, global batch) as ``monarch_nb.train``, with no
fault tolerance: gloo, DistributedDataParallel, and optionally a ``torch.save`` checkpoint every
``--checkpoint-every`` steps that a restarted job (``--max-restarts``) resumes from. ``--kill-at
STEP --kill-rank R`` SIGKILLs rank R at that step in the first attempt only. Rank 0 writes a JSON
summary to ``--out`` (times are ``time.time()`` seconds, so they compare across restarts).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_step(workload, model, opt, idx) -> None:
    """One plain step on this rank's samples ``idx``: the loss is their mean, as ``ft``'s is
    (shared with bench/_hsdp_train.py)."""
    inputs, targets = workload.train_batch(idx)
    opt.zero_grad(set_to_none=True)
    loss_sum, _ = workload.loss_sum(model, inputs, targets)
    (loss_sum / max(1, len(idx))).backward()
    opt.step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="digits")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from monarch_nb.train.data import SampleOrder
    from monarch_nb.train.workloads import get_workload

    t_process = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # A fresh key prefix per restart attempt: the agent's store outlives the workers, and stale
    # addresses of the previous attempt's ranks would otherwise be read by the new ones.
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ddp-bench/attempt{attempt}/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    workload = get_workload(args.workload, seed=args.seed)
    workload.setup()
    batch = args.batch_size or workload.default_batch
    order = SampleOrder(workload.num_train, batch, args.seed)
    torch.manual_seed(args.seed)
    model = DDP(workload.build_model())
    opt = workload.build_optimizer(model.parameters(), args.lr or workload.default_lr)
    start = 0
    ckpt = os.path.join(args.checkpoint_dir, "ddp.pt") if args.checkpoint_dir else None
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["next_step"]
    ranks = list(range(world))
    dist.barrier()
    t_first = time.time()
    if rank == 0 and attempt == 0:
        with open(args.out + ".start", "w") as f:
            json.dump({"t_first_step": t_first, "t_process": t_process}, f)
    step_s = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        if attempt == 0 and step == args.kill_at and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        train_step(workload, model, opt, order.shard(step, ranks, rank))
        step_s.append(time.perf_counter() - t0)
        if ckpt and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            if rank == 0:
                tmp = ckpt + ".tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "next_step": step + 1}, tmp)
                os.replace(tmp, ckpt)
            dist.barrier()
    t_end = time.time()
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        summary = {
            "attempt": attempt, "start_step": start, "steps_run": len(step_s), "t_process": t_process,
            "t_first_step": t_first, "t_end": t_end, "global_batch": batch,
            "step_ms": sorted(s * 1e3 for s in step_s), "peak_rss_bytes": [int(p.item()) for p in peaks],
        }
        out = args.out if attempt == 0 else f"{args.out}.attempt{attempt}"
        with open(out, "w") as f:
            json.dump(summary, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
