"""Shared-memory snapshots: a writer SIGKILLed at any moment never leaves one that looks complete."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

WRITER = r"""
import os, sys, time
import torch
from monarch_nb.train.trainer_state import SnapshotWriter, capture

path, start = sys.argv[1], int(sys.argv[2])
model = torch.nn.Linear(1024, 2048)           # 8 MB of parameters, 16 MB more of Adam state
opt = torch.optim.Adam(model.parameters())
model(torch.ones(1, 1024)).sum().backward()
opt.step()
writer = SnapshotWriter(path, every=1)
print("ready", flush=True)
step = start
while True:
    with torch.no_grad():
        for t in list(model.state_dict().values()) + [s for st in opt.state.values() for s in st.values()]:
            t.fill_(step)                     # every element of the state says which step it is
    tensors, skeleton, meta = capture(model, opt, step, step, 0)
    writer.capture(tensors, skeleton, meta, 1.0)
    writer.wait_idle(10.0)
    step += 1
"""


def test_a_writer_killed_at_any_moment_never_leaves_a_snapshot_that_looks_complete(tmp_path):
    import torch

    from monarch_nb.train.trainer_state import Incoming, read_snapshot

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = str(tmp_path / f"monarch_nb-0123abcd-{os.getpid()}-7")
    rng = random.Random(0)
    seen_steps = []
    start = 1
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(start)], stdout=subprocess.PIPE,
                                env=dict(os.environ, PYTHONPATH=repo), text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.6))  # somewhere inside a copy, a hash, a rename
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        try:
            manifest, payload = read_snapshot(path)
        except FileNotFoundError:
            assert not seen_steps, "a published snapshot disappeared"
            continue
        step = manifest["meta"]["next_step"]
        assert step >= (seen_steps[-1] if seen_steps else start - 1)  # never older than one seen before
        model = torch.nn.Linear(1024, 2048)
        opt = torch.optim.Adam(model.parameters())
        incoming = Incoming(manifest, model, torch.device("cpu"))
        incoming.write(0, [payload])
        incoming.finish(model, opt)  # checks the SHA-256 again
        for t in list(model.state_dict().values()) + [s for st in opt.state.values() for s in st.values()
                                                      if s.dim()]:
            assert torch.all(t == step), f"trial {trial}: a tensor of the snapshot of step {step} is torn"
        seen_steps.append(step)
        start = step + 1000  # the next writer's steps are distinguishable
    assert seen_steps, "no snapshot was ever published"
    leftovers = [n for n in os.listdir(tmp_path) if n != os.path.basename(path)]
    assert all(n.startswith("monarch_nb-0123abcd-") for n in leftovers)  # temporaries the runtime's clean-up covers


def test_a_corrupted_snapshot_is_refused(tmp_path):
    import torch

    from monarch_nb.train.trainer_state import SnapshotWriter, capture, read_snapshot

    path = str(tmp_path / f"monarch_nb-0123abcd-{os.getpid()}-8")
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    writer = SnapshotWriter(path, every=1)
    writer.capture(*capture(model, opt, 3, 3, 0), 1.0)
    writer.wait_idle()
    assert read_snapshot(path)[0]["meta"]["next_step"] == 3
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match="SHA-256"):
        read_snapshot(path)
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(ValueError, match="incomplete"):
        read_snapshot(path)
