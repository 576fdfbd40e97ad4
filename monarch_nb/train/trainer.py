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

Healing and snapshots stream the committed state (see :mod:`.trainer_state`).
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta
from typing import Any

from ..actor.endpoint import Actor, endpoint
from ..faults.worker import take_nan
from .data import SampleOrder, digest, shard_bounds
from .trainer_state import (Incoming, SnapshotWriter, bytes_view, capture, manifest, read_snapshot,
                            stream_slice)
from .workloads import Workload

__all__ = ["Trainer", "CollectiveError", "QuorumAborted"]

log = logging.getLogger(__name__)

#: reduced statistics at the end of the flat buffer: loss sum, samples, correct, non-finite count
_STATS = 4


class CollectiveError(RuntimeError):
    """The all-reduce of a step failed because a peer failed (connection reset, fenced, timeout)."""


class QuorumAborted(RuntimeError):
    """The controller abandoned the quorum this trainer was joining (a peer failed meanwhile)."""


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


def _abortable_store(real, base, abort_key: str, timeout_s: float):
    """A c10d Store over ``real`` whose blocking reads give up as soon as ``abort_key`` appears in
    ``base``: a process group being formed with a peer that died after the barrier fails at once
    (the controller sets the key) instead of waiting for the rendezvous timeout."""
    import torch.distributed as dist

    class AbortableStore(dist.Store):
        def _wait_for(self, keys: list) -> None:
            deadline = time.monotonic() + timeout_s
            while not real.check(keys):
                if base.check([abort_key]):
                    raise QuorumAborted("the quorum was aborted by the controller while its process group formed")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"keys {keys} did not appear within {timeout_s} s")
                time.sleep(0.002)

        def set(self, key, value):
            real.set(key, value)

        def get(self, key):
            self._wait_for([key])
            return real.get(key)

        def add(self, key, value):
            return real.add(key, value)

        def check(self, keys):
            return real.check(keys)

        def wait(self, keys, timeout=None):
            self._wait_for(list(keys))

        def compare_set(self, key, expected, desired):
            return real.compare_set(key, expected, desired)

        def delete_key(self, key):
            return real.delete_key(key)

        def num_keys(self):
            return real.num_keys()

    return AbortableStore()


class Trainer(Actor):
    """One data-parallel replica. Built light on every proc; :meth:`setup` makes it a replica.

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
        world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
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

    # -- quorums --------------------------------------------------------------------------------
    def _store_client(self):
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(
                self.store_host, self.store_port, is_master=False, timeout=timedelta(seconds=self.collective_timeout_s)
            )
        return self._store

    @endpoint
    def init_quorum(self, quorum: int, ranks: list[int]) -> dict:
        """Join quorum ``quorum`` of ``ranks`` (proc ranks; this one among them).

        Builds a new process group under the store prefix ``quorum<quorum>/`` after a barrier; the
        controller can abort both (key ``quorum<quorum>/abort``), so a peer that fails meanwhile
        never holds the others for the rendezvous timeout. Returns ``{"rank", "quorum",
        "init_ms", "next_step"}``.

        Raises:
            QuorumAborted: the controller aborted the quorum.
            TimeoutError: the others did not arrive within ``collective_timeout_s``.
        """
        import torch.distributed as dist

        t0 = time.monotonic()
        ranks = sorted(ranks)
        self._leave_group()
        self._broken = True
        store = self._store_client()
        prefix = f"quorum{quorum}/"
        store.add(prefix + "joined", 1)
        deadline = t0 + self.collective_timeout_s
        while int(store.add(prefix + "joined", 0)) < len(ranks):
            if store.check([prefix + "abort"]):
                raise QuorumAborted(f"quorum {quorum} was aborted by the controller")
            if time.monotonic() > deadline:
                raise TimeoutError(f"quorum {quorum}: peers {ranks} did not all arrive within {self.collective_timeout_s} s")
            time.sleep(0.002)
        if len(ranks) > 1:
            dist.init_process_group(
                self.backend,
                store=_abortable_store(dist.PrefixStore(prefix + "pg/", store), store, prefix + "abort",
                                       self.collective_timeout_s),
                rank=ranks.index(self.rank),
                world_size=len(ranks),
                timeout=timedelta(seconds=self.collective_timeout_s),
            )
            self._pg_ready = True
        self._quorum, self._ranks = quorum, ranks
        self._pos, self._world = ranks.index(self.rank), len(ranks)
        self._broken = False
        return {"rank": self.rank, "quorum": quorum, "init_ms": (time.monotonic() - t0) * 1e3, "next_step": self.next_step}

    def _leave_group(self) -> None:
        import torch.distributed as dist

        if self._pg_ready:
            self._pg_ready = False
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a peer's death: drop it anyway
                log.debug("destroy_process_group failed", exc_info=True)

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
        import torch

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

    # -- healing: donor side --------------------------------------------------------------------
    @endpoint
    def state_manifest(self) -> dict:
        """Describe this rank's state for a joiner (see :func:`~.trainer_state.manifest`); pins it
        until :meth:`state_done`."""
        tensors, skeleton, meta = capture(self.model, self.optimizer, self.applied_steps, self.next_step, self.rank)
        self._outgoing = [bytes_view(t) for t in tensors]
        return manifest(self._outgoing, skeleton, meta, self.chunk_bytes)

    @endpoint
    def state_chunk(self, index: int) -> list:
        """Bytes ``[index*chunk_bytes, (index+1)*chunk_bytes)`` of the state stream, as uint8 array views."""
        return stream_slice(self._outgoing, index * self.chunk_bytes, (index + 1) * self.chunk_bytes)

    @endpoint
    def state_done(self) -> None:
        self._outgoing = []

    # -- healing: joiner side -------------------------------------------------------------------
    @endpoint
    def load_begin(self, manifest: dict) -> None:
        """Prepare to receive a donor's state: its model tensors land in this model's own tensors."""
        self._leave_group()
        self._broken = True
        self._incoming = Incoming(manifest, self.model, self.device)

    @endpoint
    def load_chunk(self, index: int, pieces: list) -> int:
        """Write chunk ``index`` (uint8 arrays, in stream order); returns bytes received so far."""
        if self._incoming is None:
            raise RuntimeError("load_chunk before load_begin")
        return self._incoming.write(index * self._incoming.manifest["chunk_bytes"], pieces)

    @endpoint
    def load_end(self) -> dict:
        """Verify the stream's SHA-256 and load it; returns ``{"rank", "applied_steps", "next_step", "sha256"}``.

        Raises:
            ValueError: the checksum or the size does not match the donor's manifest.
        """
        inc, self._incoming = self._incoming, None
        if inc is None:
            raise RuntimeError("load_end before load_begin")
        meta = inc.finish(self.model, self.optimizer)
        return self._loaded(meta, inc.manifest["sha256"])

    def _loaded(self, meta: dict, sha256: str) -> dict:
        self.applied_steps, self.next_step = meta["applied_steps"], meta["next_step"]
        self._reduced_step = [-1, -1]
        return {"rank": self.rank, "applied_steps": self.applied_steps, "next_step": self.next_step, "sha256": sha256}

    # -- snapshots (outside the trainers, in shared memory) -------------------------------------
    def _snapshot_writer(self, snapshot: dict | None) -> SnapshotWriter | None:
        if snapshot is None:
            return None
        w = self._writer
        if w is None or w.path != snapshot["path"]:
            w = self._writer = SnapshotWriter(snapshot["path"], snapshot.get("every", 0), snapshot.get("budget", 0.005))
        return w

    def _snapshot(self, writer: SnapshotWriter) -> None:
        t0 = time.perf_counter()
        tensors, skeleton, meta = capture(self.model, self.optimizer, self.applied_steps, self.next_step, self.rank)
        try:
            writer.capture(tensors, skeleton, meta, self._step_ms_avg, t_begin=t0)
        except OSError as exc:  # /dev/shm full or gone: training goes on without this snapshot
            log.warning("rank %d: snapshot of step %d not written: %s", self.rank, self.next_step, exc)

    @endpoint
    def restore_snapshot(self, path: str) -> dict:
        """Load the snapshot published at ``path`` (checked); returns ``{"rank", "applied_steps",
        "next_step", "sha256", "restore_ms"}``.

        Raises:
            FileNotFoundError: there is none.
            ValueError: it is incomplete or fails its SHA-256.
        """
        t0 = time.monotonic()
        man, payload = read_snapshot(path)
        self._leave_group()
        self._broken = True
        inc = Incoming(man, self.model, self.device)
        inc.write(0, [payload])
        meta = inc.finish(self.model, self.optimizer)
        return dict(self._loaded(meta, man["sha256"]), restore_ms=(time.monotonic() - t0) * 1e3)

    # -- disk checkpoints (full-job restarts only) ----------------------------------------------
    @endpoint
    def save_checkpoint(self, path: str, next_step: int | None = None) -> dict:
        """``torch.save`` model, optimizer and counters to ``path`` (atomically); returns
        ``{"path" (None if not saved), "next_step"}``. With ``next_step``, saves only if this rank
        is at that step (a checkpoint queued behind a window that stopped early is skipped)."""
        import torch

        if next_step is not None and next_step != self.next_step:
            return {"path": None, "next_step": self.next_step}

        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "applied_steps": self.applied_steps, "next_step": self.next_step}, tmp)
        os.replace(tmp, path)
        return {"path": path, "next_step": self.next_step}

    @endpoint
    def load_checkpoint(self, path: str) -> int:
        """Load a :meth:`save_checkpoint` file; returns its next step."""
        import torch

        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.applied_steps, self.next_step = state["applied_steps"], state["next_step"]
        self._reduced_step = [-1, -1]
        return self.next_step

    @endpoint
    def memory(self) -> dict:
        """``{"rss_bytes", "peak_rss_bytes", "state_bytes"}`` of this proc."""
        import resource

        tensors, _, _ = capture(self.model, self.optimizer, self.applied_steps, self.next_step, self.rank)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"rss_bytes": rss, "peak_rss_bytes": peak, "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}

    def __cleanup__(self, exc: Any) -> None:
        if not self._ready:
            return
        if self._writer is not None:
            self._writer.wait_idle(2.0)
        self._leave_group()
