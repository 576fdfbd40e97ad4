"""A torchrun-style DDP training script (the kind users bring): env:// rendezvous, gloo, DDP.

    python ddp_script.py STEPS [--fail-at RANK:STEP:raise|kill --marker PATH] [--step-s SECONDS]

Prints each step's loss and, at the end, ``done <parameter sum>`` (equal on every rank under
DDP). ``--fail-at`` fails rank RANK at step STEP (raises, or SIGKILLs its own process) unless
``--marker`` exists; it creates the marker first, so a restarted run goes through.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("steps", type=int)
    p.add_argument("--fail-at", default="")
    p.add_argument("--marker", default="")
    p.add_argument("--step-s", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    assert int(os.environ["LOCAL_RANK"]) == rank % int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fail_rank, fail_step, how = (args.fail_at.split(":") + ["", "", ""])[:3] if args.fail_at else ("", "", "")
    print(f"rank {rank} of {world} starts (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')})", flush=True)
    for step in range(args.steps):
        if str(rank) == fail_rank and str(step) == fail_step and not os.path.exists(args.marker):
            open(args.marker, "w").close()
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"rank {rank} fails at step {step} on purpose")
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.step_s)
    total = sum(float(p.detach().sum()) for p in model.parameters())
    print(f"done {total:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
