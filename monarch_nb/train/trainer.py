"""The Trainer actor: one model replica per proc, running windows of steps on its own. Runs in procs.

The controller (see :mod:`monarch_nb.train.coordinator`) decides membership; the trainer never
does. It joins *quorums* (:meth:`Trainer.init_quorum`: one process group of the live ranks) and
runs *windows* of consecutive steps without the controller in between (:meth:`Trainer.run_window`):
the quorum and the data order are pure functions it already knows. Per step ``s``:

1. compute the gradient of the summed loss over its shard of step ``s``'s global batch, straight
   into a flat buffer (the parameters' ``.grad`` are views of it, as DDP's
   ``gradient_as_bucket_view``), read its health in one pass (:func:`_grad_health`, that is
   ``hip_ext.grad_health``: sum of squares, count of non-finite elements; a NaN is found on the rank
   that produced it), and all-reduce (SUM) the buffer with four statistics at its end: loss
   sum, sample count, correct count, non-finite count;
2. if the reduced statistics say a rank's gradient was not finite, apply nothing and end the
   window (status ``"nonfinite"``): every member sees the same reduced values, so every member
   stops at the same step and the controller has them redo it;
3. otherwise divide by the reduced sample count (the gradient averaged over the samples actually
   used, for any split of the batch) and apply the update at once.

**Commit.** Step ``s`` is committed as soon as one member's all-reduce of ``s`` completed: that
proves every member computed and contributed its part of ``s``. A peer's failure during the
all-reduce of ``s`` can leave the survivors one step apart (some completed ``s``, the others did
not), never more: none can complete ``s+1`` without all the others. The two flat buffers
alternate between steps, so a member still holds step ``s``'s reduced gradient while it works on
``s+1``; a survivor that is behind receives it (:meth:`gradient` / :meth:`apply_gradient`) and
applies the very same update — replicas stay bit-identical. If no survivor completed ``s``, the
new quorum redoes ``s`` from the same parameters.

A peer failure inside the collective ends the window with status ``"collective_failed"`` (the
trainer is fine and waits for a new quorum); a later window of the old quorum is skipped. Any
other error is the trainer's own failure and raises.

Healing, snapshots and checkpoints move the state as one stream (:mod:`.trainer_state`,
:mod:`.trainer_stream`, :mod:`.trainer_snapshot`).
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import sys
import time
from typing import Any

from ..actor.endpoint import Actor, endpoint
from ..faults.worker import take_nan
from .data import SampleOrder, digest, shard_bounds
from .trainer_quorum import CollectiveError, QuorumAborted, QuorumEndpoints
from .trainer_snapshot import SnapshotWriter
from .trainer_state import StateEndpoints
from .trainer_stream import Incoming
from .workloads import Workload

__all__ = ["Trainer", "CollectiveError", "QuorumAborted"]

log = logging.getLogger(__name__)

#: reduced statistics at the end of the flat buffer: loss sum, samples, correct, non-finite count
_STATS = 4


def _grad_health(grads: list) -> tuple[float, int]:
    """``(sum of squares of the finite elements, number of non-finite elements)`` of ``grads``
    (a list of float tensors), read before the all-reduce: ``hip_ext.grad_health``, one pass."""
    from hip_ext import grad_health

    sum_sq, nonfinite = grad_health(grads).tolist()
    return sum_sq, int(nonfinite)


def _params_checksum(state: dict) -> str:
    """16 hex digits: BLAKE2b-64 of each tensor's name, dtype, shape and ``hip_ext.checksum`` (a
    64-bit hash of its bytes, computed on its own device, no copy to the host), in order."""
    import hashlib

    from hip_ext import checksum

    h = hashlib.blake2b(digest_size=8)
    for name, t in state.items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{checksum(t)}\n".encode())
    return h.hexdigest()


class Trainer(QuorumEndpoints, StateEndpoints, Actor):
    """One data-parallel replica. Built light on every proc; :meth:`setup` makes it a replica.
    Joining quorums is :class:`~.trainer_quorum.QuorumEndpoints`; its heal, snapshot and checkpoint
    endpoints are :class:`~.trainer_state.StateEndpoints`.

    Args:
        workload: what to train (pickled from the controller).
        seed: seeds torch before the model is built, so every replica starts identical.
        lr: learning rate.
        global_batch: samples per step over all ranks.
        store_host, store_port: the controller's rendezvous TCPStore.
        backend: "gloo", "nccl" or None (gloo on CPU, nccl on CUDA and on ROCm where nccl is RCCL).
        collective_timeout_s: timeout of rendezvous and collectives, seconds.
        chunk_bytes: largest piece of state sent per heal message, bytes.
    """

    def __init__(
        self,
        workload: Workload,
        seed: int,
        lr: float,
        global_batch: int,
        store_host: str,
        store_port: int,
        backend: str | None = None,
        collective_timeout_s: float = 10.0,
        chunk_bytes: int = 4 << 20,
    ):
        # Light on purpose: the actor is built on every proc at once (and again by a restart), the
        # heavy part (torch, data, model) is :meth:`setup`, a call like any other that can fail
        # on one rank without the others.
        self._config = (workload, seed, lr, global_batch, store_host, store_port, backend, collective_timeout_s,
                        chunk_bytes)
        self.rank = int(os.environ.get("RANK", "0"))
        self._ready = False

    @endpoint
    def setup(self) -> dict:
        """Load the data, build the model and optimizer (seeded: every replica starts identical).
        Idempotent. Returns ``{"rank", "setup_ms", "next_step"}``."""
        import hip_ext
        import numpy as np
        import torch

        from .. import device as device_mod

        t0 = time.monotonic()
        if self._ready:
            return {"rank": self.rank, "setup_ms": 0.0, "next_step": self.next_step}
        (workload, seed, lr, global_batch, store_host, store_port, backend, collective_timeout_s,
         chunk_bytes) = self._config
        hip_ext.load()  # compiled grad_health / checksum kernels; the pure-torch ones, with a log line, if none
        # the runtime shares each machine's cores among the procs on it (hosts on one machine too)
        threads = os.environ.get("MONARCH_NB_CPU_THREADS")
        world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // max(1, world)))
        self.backend = backend or device_mod.backend()
        self.device = device_mod.device() if self.backend == "nccl" else torch.device("cpu")
        if self.backend == "gloo" and sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # collectives stay on 127.0.0.1
        self.workload = workload
        workload.setup()
        self.order = SampleOrder(workload.num_train, global_batch, seed)
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (2**32))
        self.model = workload.build_model().to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = workload.build_optimizer(self.params, lr)
        self.store_host, self.store_port = store_host, store_port
        self.collective_timeout_s = collective_timeout_s
        self.chunk_bytes = chunk_bytes
        self._store = None
        self._quorum = -1
        self._ranks: list[int] = []
        self._pos = 0
        self._world = 0
        self._pg_ready = False
        self._broken = True  # no quorum yet
        self.applied_steps = 0  # updates applied to the parameters
        self.next_step = 0  # the step whose update comes next
        # two flat gradient buffers, alternating by step parity; .grad of each parameter is a view
        self._n = sum(p.numel() for p in self.params)
        self._direct = all(p.dtype == torch.float32 and p.is_contiguous() for p in self.params)
        self._bufs = [torch.zeros(self._n + _STATS, dtype=torch.float32, device=self.device) for _ in range(2)]
        self._views = [self._param_views(buf) for buf in self._bufs]
        self._reduced_step = [-1, -1]  # which step's averaged gradient each buffer holds
        self._grads = [buf[: self._n] for buf in self._bufs]
        self._tails = [buf[self._n :] for buf in self._bufs]
        self._stats = torch.zeros(_STATS, dtype=torch.float32)
        self._stats_np = self._stats.numpy()
        self._step_ms_avg: float | None = None
        self._local_nonfinite = False
        self._kill_in_collective_at: int | None = None
        self._incoming: Incoming | None = None
        self._outgoing: list = []
        self._writer: SnapshotWriter | None = None
        self._ready = True
        return {"rank": self.rank, "setup_ms": (time.monotonic() - t0) * 1e3, "next_step": self.next_step}

    def _param_views(self, buf) -> list:
        views, offset = [], 0
        for p in self.params:
            views.append(buf[offset : offset + p.numel()].view_as(p) if self._direct else None)
            offset += p.numel()
        return views

    # -- windows of steps -----------------------------------------------------------------------
    @endpoint
    def run_window(self, quorum: int, start: int, count: int, split: list | None = None,
                   snapshot: dict | None = None) -> dict:
        """Run steps ``start .. start+count-1`` in quorum ``quorum``, applying each at once.

        Args:
            split: steps whose all-reduce goes in two pieces (every member gets the same list).
            snapshot: ``{"path", "every", "budget"}`` if this rank publishes its host's snapshots.

        Returns:
            ``{"rank", "quorum", "start", "status": "ok" | "collective_failed" | "nonfinite" |
            "skipped", "failed_step" (int or None), "error" (str), "local_nonfinite" (bool: this
            rank's own gradient was not finite), "next_step", "applied_steps", "loss", "accuracy",
            "digest", "step_ms", "grad_norm" (lists, one item per step applied in this window:
            mean loss per sample, batch accuracy or None, :func:`~monarch_nb.train.data.digest`
            of this rank's sample ids, milliseconds, L2 norm of this rank's local gradient),
            "snapshots" (published since the last window)}``. ``"skipped"``: not this rank's
            quorum any more, or not its next step (a window queued behind one that stopped).
        """
        out: dict[str, Any] = {"rank": self.rank, "quorum": quorum, "start": start, "status": "ok",
                               "failed_step": None, "error": "", "local_nonfinite": False}
        losses: list = []
        accuracies: list = []
        digests: list = []
        step_ms: list = []
        norms: list = []
        if quorum != self._quorum or self._broken or start != self.next_step:
            out["status"] = "skipped"
            out["error"] = (f"rank {self.rank} is in quorum {self._quorum} (broken: {self._broken}) at step "
                            f"{self.next_step}; asked for quorum {quorum} at step {start}")
        else:
            writer = self._snapshot_writer(snapshot)
            splits = set(split or ())
            self.model.train()
            for step in range(start, start + count):
                if writer is not None and writer.due(step):
                    self._snapshot(writer)
                t0 = time.perf_counter()
                try:
                    rec = self._step(step, step in splits)
                except CollectiveError as exc:
                    out.update(status="collective_failed", failed_step=step, error=str(exc))
                    break
                if rec is None:
                    out.update(status="nonfinite", failed_step=step, local_nonfinite=self._local_nonfinite,
                               error=f"the reduced gradient of step {step} is not finite")
                    break
                ms = (time.perf_counter() - t0) * 1e3
                self._step_ms_avg = ms if self._step_ms_avg is None else 0.9 * self._step_ms_avg + 0.1 * ms
                losses.append(rec[0])
                accuracies.append(rec[1])
                digests.append(rec[2])
                norms.append(rec[3])
                step_ms.append(ms)
        out.update(next_step=self.next_step, applied_steps=self.applied_steps, loss=losses, accuracy=accuracies,
                   digest=digests, step_ms=step_ms, grad_norm=norms,
                   snapshots=self._writer.take_published() if self._writer is not None else [])
        return out

    def _step(self, step: int, split: bool) -> tuple | None:
        """One step; returns ``(loss, batch accuracy, digest, grad norm)``, or None if the reduced
        gradient is not finite (nothing applied).

        Raises:
            CollectiveError: a peer failed during the all-reduce.
        """
        which = step & 1
        buf, grads, tail = self._bufs[which], self._grads[which], self._tails[which]
        batch = self.order.batch(step)
        lo, hi = shard_bounds(len(batch), self._world, self._pos)
        indices = batch[lo:hi]
        buf.zero_()
        if self._direct:
            for p, view in zip(self.params, self._views[which]):
                p.grad = view
        else:
            for p in self.params:
                p.grad = None
        loss_value, correct = 0.0, 0
        if len(indices):
            inputs, targets = self.workload.train_batch(indices)
            loss_sum, correct = self.workload.loss_sum(self.model, inputs.to(self.device), targets.to(self.device))
            loss_sum.backward()
            loss_value = loss_sum.detach().item()
        if not self._direct:
            self._gather_grads(grads)
        if take_nan():
            grads[0] = float("nan")
        sum_sq, nonfinite = _grad_health([grads])
        self._local_nonfinite = nonfinite > 0
        stats = self._stats_np  # a numpy view of a CPU tensor: four assignments cost no torch call
        stats[0], stats[1], stats[2], stats[3] = loss_value, len(indices), correct or 0, nonfinite
        tail.copy_(self._stats)
        self._all_reduce(buf, step, split)
        loss_total, count, correct_total, nonfinite_total = tail.tolist()
        if nonfinite_total > 0 or not math.isfinite(loss_total):
            return None
        grads.div_(count)
        self._apply(which, step, set_grads=not self._direct)
        accuracy = correct_total / count if self.workload.classification else None
        return loss_total / count, accuracy, digest(indices), math.sqrt(sum_sq)

    def _gather_grads(self, grads) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                grads[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n

    def _apply(self, which: int, step: int, set_grads: bool = True) -> None:
        """Apply the averaged gradient in buffer ``which`` as step ``step``'s update."""
        if not set_grads:
            pass
        elif self._direct:
            for p, view in zip(self.params, self._views[which]):
                p.grad = view
        else:
            grads, offset = self._bufs[which], 0
            for p in self.params:
                n = p.numel()
                p.grad = grads[offset : offset + n].view(p.shape).to(p.dtype)
                offset += n
        self.optimizer.step()
        self._reduced_step[which] = step
        self.applied_steps += 1
        self.next_step = step + 1

    def _all_reduce(self, buf, step: int, split: bool) -> None:
        import torch.distributed as dist

        if self._world <= 1:
            return
        pieces = buf.tensor_split(2) if split else (buf,)
        error = None
        try:
            for i, piece in enumerate(pieces):
                if i == 1 and self._kill_in_collective_at == step:
                    os.kill(os.getpid(), signal.SIGKILL)  # a real death between buckets of the reduction
                dist.all_reduce(piece, op=dist.ReduceOp.SUM)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            # Close this group's connections now: in a ring only the dead rank's neighbours see the
            # reset, the others wait on them and are released by this close. The exception's
            # traceback holds the group, so it is dropped (end of the except block) before the
            # group is destroyed (freed by refcount: no gc.collect, which costs ~0.4 s here).
            self._broken = True
            self._leave_group()
            raise CollectiveError(f"rank {self.rank}: all_reduce of step {step} failed: {error}")

    @endpoint
    def arm_kill_in_collective(self, step: int) -> None:
        """SIGKILL this proc in the middle of step ``step``'s gradient reduction (the step must be
        in the window's ``split`` list)."""
        self._kill_in_collective_at = step

    # -- catching up after a failure ------------------------------------------------------------
    @endpoint
    def gradient(self, step: int):
        """The averaged gradient this rank applied as step ``step`` (a flat float32 CPU tensor).

        Raises:
            LookupError: it no longer holds it (only the last two steps' are kept).
        """
        which = step & 1
        if self._reduced_step[which] != step:
            raise LookupError(f"rank {self.rank} no longer holds the gradient of step {step}")
        return self._bufs[which][: self._n].detach().cpu().clone()

    @endpoint
    def apply_gradient(self, step: int, flat) -> dict:
        """Apply ``flat`` (from :meth:`gradient` of a peer) as step ``step``, the next one here.

        Returns ``{"rank", "next_step", "applied_steps"}``.

        Raises:
            RuntimeError: ``step`` is not this rank's next step.
        """
        if step != self.next_step:
            raise RuntimeError(f"rank {self.rank} is at step {self.next_step}; cannot apply step {step}")
        which = step & 1
        self._bufs[which][: self._n].copy_(flat.to(self.device))
        self._apply(which, step)
        return {"rank": self.rank, "next_step": self.next_step, "applied_steps": self.applied_steps}

    # -- inspection -----------------------------------------------------------------------------
    @endpoint
    def status(self) -> dict:
        """``{"rank", "next_step", "applied_steps", "quorum", "broken"}``."""
        return {"rank": self.rank, "next_step": self.next_step, "applied_steps": self.applied_steps,
                "quorum": self._quorum, "broken": self._broken}

    @endpoint
    def checksum(self) -> dict:
        """Checksum of the model's parameters and buffers.

        Returns ``{"rank", "params_checksum" (str, 16 hex digits: see :func:`_params_checksum`),
        "applied_steps", "next_step"}``. Equal on two replicas exactly when (barring a 64-bit
        collision) their state dicts are bit-identical, on any device.
        """
        return {"rank": self.rank, "params_checksum": _params_checksum(self.model.state_dict()),
                "applied_steps": self.applied_steps, "next_step": self.next_step}

    @endpoint
    def parameters(self) -> dict:
        """The model's state dict (CPU tensors)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    @endpoint
    def evaluate(self) -> dict:
        """Loss and accuracy on the workload's test set: ``{"test_loss", "test_accuracy" (or None),
        "test_samples", "next_step"}``."""
        import torch

        self.model.eval()
        loss = correct = n = 0.0
        with torch.no_grad():
            for inputs, targets in self.workload.test_batches():
                ls, c = self.workload.loss_sum(self.model, inputs.to(self.device), targets.to(self.device))
                loss += float(ls)
                correct += float(c or 0)
                n += len(targets)
        self.model.train()
        if not n:
            return {"test_loss": None, "test_accuracy": None, "test_samples": 0, "next_step": self.next_step}
        acc = correct / n if self.workload.classification else None
        return {"test_loss": loss / n, "test_accuracy": acc, "test_samples": int(n), "next_step": self.next_step}

    def __cleanup__(self, exc: Any) -> None:
        if not self._ready:
            return
        if self._writer is not None:
            self._writer.wait_idle(2.0)
        self._leave_group()
