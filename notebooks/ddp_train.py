"""A plain torchrun DDP script (the quickstart runs it with `%mesh run ddp_train.py 20`).

    torchrun --nproc-per-node=4 ddp_train.py STEPS      # the same script, under torchrun
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE come from the launcher
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(steps):
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step * world + rank))
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0 or step == steps - 1:
        print(f"step {step}: loss {loss.item():.3f}")
dist.destroy_process_group()
