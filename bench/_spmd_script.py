"""bench/spmd.py's DDP script (the kind a user runs under torchrun): env://, gloo, a DDP MLP.

    python _spmd_script.py STEPS

One line per step: ``t=<wall time> pid=<pid> rank=<rank> attempt=<restart count> step <n>``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for step in range(steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"t={time.time():.6f} pid={os.getpid()} rank={rank} attempt={attempt} step {step}", flush=True)
        time.sleep(0.02)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
