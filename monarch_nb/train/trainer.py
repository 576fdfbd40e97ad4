"""The Trainer actor: one model replica per proc, gradients averaged per membership epoch.

The controller (see :mod:`monarch_nb.train.loop`) drives it; the trainer never decides
membership. Protocol, per step ``s`` of epoch ``e`` with live ranks ``L``:

1. ``step(s, e, L)`` first *commits* the update of step ``s-1`` if it still holds it (the
   controller only calls step ``s`` once every rank finished ``s-1``), computes the gradient of
   the summed loss over its shard of the step's global batch, and all-reduces (SUM) one flat
   buffer holding the gradients, the loss sum, the sample count and the correct count. Dividing
   by the reduced sample count gives the gradient averaged over the samples actually used, for
   any split of the batch. The averaged gradient is held *pending*, not applied: if a peer fails
   during the collective, some survivors may have finished it and others not, and holding the
   update lets every survivor redo step ``s`` from the same parameters. Before the all-reduce,
   ``hip_ext.grad_health`` reads all of the rank's gradients in one pass: a NaN is found on the
   rank that produced it, and the rank's gradient norm comes with it.
2. A peer failure inside the collective raises :class:`CollectiveError` (the controller reads
   ``ActorError.exception_type == "CollectiveError"``): the trainer is fine and waits for a new
   epoch. Any other error is the trainer's own failure.

Healing streams the committed state (parameters, buffers, optimizer state, step counters, data
position, RNG states) from a donor in chunks of at most ``chunk_bytes``: the donor sends views of
its live tensors (no copy on CPU), the joiner writes them in place and checks a SHA-256 of the
whole stream before loading it; the controller then compares every replica's parameter checksum
(``hip_ext.checksum``, computed where the tensors live).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import pickle
import random
import signal
import sys
import time
from datetime import timedelta
from typing import Any

from ..actor.endpoint import Actor, endpoint
from ..faults.worker import take_nan
from .data import SampleOrder
from .workloads import Workload

__all__ = ["Trainer", "CollectiveError", "EpochAborted"]

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """The all-reduce of a step failed because a peer failed (connection reset, fenced, timeout)."""


class EpochAborted(RuntimeError):
    """The controller abandoned the epoch this trainer was joining (a peer failed meanwhile)."""


class Trainer(Actor):
    """One data-parallel replica.

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
        import hip_ext
        import numpy as np
        import torch

        from .. import device as device_mod

        hip_ext.load()  # compiled grad_health / checksum kernels; the pure-torch ones, with a log line, if none
        world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
        self.rank = int(os.environ.get("RANK", "0"))
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
        self._epoch = -1
        self._world = 0
        self._pg_ready = False
        self.applied_steps = 0  # updates applied to the parameters
        self.next_step = 0  # the step whose update comes next
        self._pending: tuple[int, Any] | None = None  # (step, averaged flat gradient)
        self._kill_in_collective_at: int | None = None
        self._incoming: dict | None = None

    # -- membership -----------------------------------------------------------------------------
    def _store_client(self):
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(
                self.store_host, self.store_port, is_master=False, timeout=timedelta(seconds=self.collective_timeout_s)
            )
        return self._store

    @endpoint
    def init_epoch(self, epoch: int, ranks: list[int]) -> dict:
        """Join membership epoch ``epoch`` of ``ranks`` (sorted proc ranks; this one among them).

        Builds a new process group under the store prefix ``epoch<epoch>/`` after a barrier that
        the controller can abort (key ``epoch<epoch>/abort``). Returns ``{"rank", "epoch",
        "init_ms"}``.

        Raises:
            EpochAborted: the controller aborted the epoch.
            TimeoutError: the others did not arrive within ``collective_timeout_s``.
        """
        import torch.distributed as dist

        t0 = time.monotonic()
        ranks = sorted(ranks)
        self._leave_group()
        store = self._store_client()
        prefix = f"epoch{epoch}/"
        store.add(prefix + "joined", 1)
        deadline = t0 + self.collective_timeout_s
        while int(store.add(prefix + "joined", 0)) < len(ranks):
            if store.check([prefix + "abort"]):
                raise EpochAborted(f"epoch {epoch} was aborted by the controller")
            if time.monotonic() > deadline:
                raise TimeoutError(f"epoch {epoch}: peers {ranks} did not all arrive within {self.collective_timeout_s} s")
            time.sleep(0.002)
        self._epoch, self._world = epoch, len(ranks)
        if len(ranks) > 1:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(prefix + "pg/", store),
                rank=ranks.index(self.rank),
                world_size=len(ranks),
                timeout=timedelta(seconds=self.collective_timeout_s),
            )
            self._pg_ready = True
        return {"rank": self.rank, "epoch": epoch, "init_ms": (time.monotonic() - t0) * 1e3}

    def _leave_group(self) -> None:
        import torch.distributed as dist

        if self._pg_ready:
            self._pg_ready = False
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a peer's death: drop it anyway
                log.debug("destroy_process_group failed", exc_info=True)

    # -- steps ----------------------------------------------------------------------------------
    def _commit_through(self, step: int) -> None:
        """Apply the held update if it belongs to a step <= ``step``; drop it if it is later."""
        if self._pending is None:
            return
        pending_step, flat = self._pending
        self._pending = None
        if pending_step > step:
            return  # an attempt the controller did not commit: it will be redone
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        self.optimizer.step()
        self.applied_steps += 1
        self.next_step = pending_step + 1

    @endpoint
    def step(self, step: int, epoch: int, ranks: list[int], buckets: int = 1) -> dict:
        """Compute and all-reduce step ``step`` over ``ranks``; hold its update until committed.

        Returns:
            ``{"status": "ok" | "nonfinite", "rank", "step", "loss" (float, mean per sample),
            "accuracy" (float or None), "samples" (list of int sample ids this rank used),
            "global_samples" (int), "compute_ms", "reduce_ms", "local_nonfinite" (bool: this rank's
            own gradient had NaN/Inf), "grad_norm" (float: L2 norm of the finite elements of this
            rank's gradient of its summed loss, before averaging)}``.

        Raises:
            CollectiveError: a peer failed during the all-reduce.
            RuntimeError: ``epoch`` is not the epoch this trainer joined.
        """
        import torch
        from hip_ext import grad_health

        self._commit_through(step - 1)
        if epoch != self._epoch:
            raise RuntimeError(f"rank {self.rank} is in epoch {self._epoch}, asked to step in epoch {epoch}")
        t0 = time.monotonic()
        indices = self.order.shard(step, ranks, self.rank)
        self.model.train()
        for p in self.params:
            p.grad = None
        stats = torch.zeros(3, dtype=torch.float32, device=self.device)
        if len(indices):
            inputs, targets = self.workload.train_batch(indices)
            loss_sum, correct = self.workload.loss_sum(self.model, inputs.to(self.device), targets.to(self.device))
            loss_sum.backward()
            stats[0] = loss_sum.detach().float()
            stats[2] = float(correct or 0)
        stats[1] = float(len(indices))
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32) for p in self.params
        ]
        if take_nan() and grads:  # the injected fault poisons this rank's first gradient element
            grads[0][0] = float("nan")
        sum_sq, nonfinite = grad_health(grads).tolist()
        flat = torch.cat(grads + [stats])
        local_nonfinite = nonfinite > 0 or not bool(torch.isfinite(stats).all())
        t1 = time.monotonic()
        self._all_reduce(flat, step, buckets)
        t2 = time.monotonic()
        loss_total, count, correct_total = (float(v) for v in flat[-3:])
        result = {
            "rank": self.rank,
            "step": step,
            "samples": [int(i) for i in indices],
            "global_samples": int(round(count)),
            "compute_ms": (t1 - t0) * 1e3,
            "reduce_ms": (t2 - t1) * 1e3,
            "local_nonfinite": local_nonfinite,
            "grad_norm": math.sqrt(sum_sq),
        }
        if grad_health([flat])[1].item() > 0:
            return dict(result, status="nonfinite", loss=float("nan"), accuracy=None)
        self._pending = (step, flat[:-3] / count)
        accuracy = correct_total / count if self.workload.classification else None
        return dict(result, status="ok", loss=loss_total / count, accuracy=accuracy)

    def _all_reduce(self, flat, step: int, buckets: int) -> None:
        import torch.distributed as dist

        if self._world <= 1:
            return
        pieces = flat.tensor_split(max(1, buckets))
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
            self._leave_group()
            raise CollectiveError(f"rank {self.rank}: all_reduce of step {step} failed: {error}")

    @endpoint
    def arm_kill_in_collective(self, step: int) -> None:
        """SIGKILL this proc in the middle of step ``step``'s gradient reduction (run it with buckets >= 2)."""
        self._kill_in_collective_at = step

    # -- inspection -----------------------------------------------------------------------------
    @endpoint
    def checksum(self, commit_through: int) -> dict:
        """Checksum of the model's parameters and buffers after committing through ``commit_through``.

        Returns ``{"rank", "params_checksum" (str, 16 hex digits: see :func:`_params_checksum`),
        "applied_steps", "next_step"}``. Equal on two replicas exactly when (barring a 64-bit
        collision) their state dicts are bit-identical, on any device.
        """
        self._commit_through(commit_through)
        return {"rank": self.rank, "params_checksum": _params_checksum(self.model.state_dict()),
                "applied_steps": self.applied_steps, "next_step": self.next_step}

    @endpoint
    def parameters(self, commit_through: int) -> dict:
        """The model's state dict (CPU tensors) after committing through ``commit_through``."""
        self._commit_through(commit_through)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    @endpoint
    def evaluate(self, commit_through: int) -> dict:
        """Loss and accuracy on the workload's test set: ``{"test_loss", "test_accuracy" (or None), "test_samples"}``."""
        import torch

        self._commit_through(commit_through)
        self.model.eval()
        loss = correct = n = 0.0
        with torch.no_grad():
            for inputs, targets in self.workload.test_batches():
                ls, c = self.workload.loss_sum(self.model, inputs.to(self.device), targets.to(self.device))
                loss += float(ls)
                correct += float(c or 0)
                n += len(targets)
        if not n:
            return {"test_loss": None, "test_accuracy": None, "test_samples": 0}
        acc = correct / n if self.workload.classification else None
        return {"test_loss": loss / n, "test_accuracy": acc, "test_samples": int(n)}

    # -- healing: donor side --------------------------------------------------------------------
    def _state_tensors(self) -> tuple[list, dict]:
        """Flat list of the state's tensors and the picklable rest (tensors replaced by indices)."""
        import torch

        tensors: list = []

        def strip(obj):
            if isinstance(obj, torch.Tensor):
                tensors.append(obj.detach())
                return _TensorSlot(len(tensors) - 1, tuple(obj.shape), str(obj.dtype).replace("torch.", ""))
            if isinstance(obj, dict):
                return {k: strip(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(strip(v) for v in obj)
            return obj

        skeleton = {"model": strip(self.model.state_dict()), "optimizer": strip(self.optimizer.state_dict())}
        return tensors, skeleton

    @endpoint
    def state_manifest(self, commit_through: int) -> dict:
        """Describe the committed state for a joiner; pins it until :meth:`state_chunk` is done.

        Returns ``{"skeleton", "meta", "nbytes", "chunks", "chunk_bytes", "sha256"}``.
        """
        import numpy as np
        import torch

        self._commit_through(commit_through)
        tensors, skeleton = self._state_tensors()
        self._outgoing = [_bytes_view(t) for t in tensors]
        meta = {
            "applied_steps": self.applied_steps,
            "next_step": self.next_step,
            "data_position": list(self.order.position(self.next_step)),
            "torch_rng": torch.get_rng_state().numpy().tobytes(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
            "donor": self.rank,
        }
        h = hashlib.sha256()
        for view in self._outgoing:
            h.update(view)
        h.update(_meta_digest(meta))
        nbytes = sum(v.nbytes for v in self._outgoing)
        return {"skeleton": skeleton, "meta": meta, "nbytes": nbytes, "chunk_bytes": self.chunk_bytes,
                "chunks": max(1, -(-nbytes // self.chunk_bytes)), "sha256": h.hexdigest()}

    @endpoint
    def state_chunk(self, index: int) -> list:
        """Bytes ``[index*chunk_bytes, (index+1)*chunk_bytes)`` of the state stream, as uint8 array views."""
        return _stream_slice(self._outgoing, index * self.chunk_bytes, (index + 1) * self.chunk_bytes)

    @endpoint
    def state_done(self) -> None:
        self._outgoing = []

    # -- healing: joiner side -------------------------------------------------------------------
    @endpoint
    def load_begin(self, manifest: dict) -> None:
        """Prepare to receive a donor's state: its model tensors land in this model's own tensors."""
        import torch

        self._leave_group()
        self._pending = None
        own = self.model.state_dict()
        targets: list = []

        def collect(skel, live):
            if isinstance(skel, _TensorSlot):
                dtype = getattr(torch, skel.dtype)
                cpu = self.device.type == "cpu"
                if cpu and live is not None and tuple(live.shape) == skel.shape and live.dtype == dtype:
                    targets.append((skel.index, live))
                else:
                    targets.append((skel.index, torch.empty(skel.shape, dtype=dtype)))  # staged on CPU
            elif isinstance(skel, dict):
                for k, v in skel.items():
                    collect(v, live.get(k) if isinstance(live, dict) else None)
            elif isinstance(skel, (list, tuple)):
                for v in skel:
                    collect(v, None)

        collect(manifest["skeleton"]["model"], own)
        collect(manifest["skeleton"]["optimizer"], None)
        targets.sort(key=lambda t: t[0])
        self._incoming = {
            "manifest": manifest,
            "tensors": [t for _, t in targets],
            "views": [_bytes_view(t, writable=True) for _, t in targets],
            "offset": 0,
            "sha": hashlib.sha256(),
        }

    @endpoint
    def load_chunk(self, index: int, pieces: list) -> int:
        """Write chunk ``index`` (uint8 arrays, in stream order); returns bytes received so far."""
        inc = self._incoming
        if inc is None:
            raise RuntimeError("load_chunk before load_begin")
        start = index * inc["manifest"]["chunk_bytes"]
        if start != inc["offset"]:
            raise RuntimeError(f"state chunk {index} out of order: expected byte {inc['offset']}, got {start}")
        for piece in pieces:
            inc["sha"].update(piece)
            _stream_write(inc["views"], inc["offset"], piece)
            inc["offset"] += len(piece)
        return inc["offset"]

    @endpoint
    def load_end(self) -> dict:
        """Verify the stream's SHA-256 and load it; returns ``{"rank", "applied_steps", "next_step", "sha256"}``.

        Raises:
            ValueError: the checksum or the size does not match the donor's manifest.
        """
        import numpy as np
        import torch

        inc, self._incoming = self._incoming, None
        if inc is None:
            raise RuntimeError("load_end before load_begin")
        manifest = inc["manifest"]
        meta = manifest["meta"]
        inc["sha"].update(_meta_digest(meta))
        if inc["offset"] != manifest["nbytes"] or inc["sha"].hexdigest() != manifest["sha256"]:
            raise ValueError(
                f"healing state from rank {meta['donor']} failed its check: {inc['offset']} of {manifest['nbytes']} "
                f"bytes, sha256 {inc['sha'].hexdigest()[:12]} != {manifest['sha256'][:12]}"
            )
        tensors = inc["tensors"]

        def fill(skel):
            if isinstance(skel, _TensorSlot):
                return tensors[skel.index]
            if isinstance(skel, dict):
                return {k: fill(v) for k, v in skel.items()}
            if isinstance(skel, (list, tuple)):
                return type(skel)(fill(v) for v in skel)
            return skel

        self.model.load_state_dict(fill(manifest["skeleton"]["model"]))
        self.optimizer.load_state_dict(fill(manifest["skeleton"]["optimizer"]))
        self.applied_steps, self.next_step = meta["applied_steps"], meta["next_step"]
        torch.set_rng_state(torch.from_numpy(np.frombuffer(meta["torch_rng"], dtype=np.uint8).copy()))
        np.random.set_state(meta["numpy_rng"])
        random.setstate(meta["python_rng"])
        return {"rank": self.rank, "applied_steps": self.applied_steps, "next_step": self.next_step,
                "sha256": manifest["sha256"]}

    # -- disk checkpoints (full-job restarts only) ----------------------------------------------
    @endpoint
    def save_checkpoint(self, path: str, commit_through: int) -> str:
        """``torch.save`` model, optimizer and counters to ``path`` (atomically); returns the path."""
        import torch

        self._commit_through(commit_through)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "applied_steps": self.applied_steps, "next_step": self.next_step}, tmp)
        os.replace(tmp, path)
        return path

    @endpoint
    def load_checkpoint(self, path: str) -> int:
        """Load a :meth:`save_checkpoint` file; returns its next step."""
        import torch

        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.applied_steps, self.next_step = state["applied_steps"], state["next_step"]
        self._pending = None
        return self.next_step

    @endpoint
    def memory(self) -> dict:
        """``{"rss_bytes", "peak_rss_bytes", "state_bytes"}`` of this proc."""
        import resource

        tensors, _ = self._state_tensors()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"rss_bytes": rss, "peak_rss_bytes": peak, "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}

    def __cleanup__(self, exc: Any) -> None:
        self._leave_group()


class _TensorSlot:
    """Stands for tensor ``index`` of the state stream in a skeleton."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: tuple, dtype: str):
        self.index, self.shape, self.dtype = index, shape, dtype

    def __reduce__(self):
        return _TensorSlot, (self.index, self.shape, self.dtype)


def _params_checksum(state: dict) -> str:
    """16 hex digits: BLAKE2b-64 of each tensor's name, dtype, shape and ``hip_ext.checksum`` (a
    64-bit hash of its bytes, computed on its own device, no copy to the host), in order."""
    from hip_ext import checksum

    h = hashlib.blake2b(digest_size=8)
    for name, t in state.items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{checksum(t)}\n".encode())
    return h.hexdigest()


def _meta_digest(meta: dict) -> bytes:
    scalars = {k: meta[k] for k in ("applied_steps", "next_step", "data_position", "donor")}
    return pickle.dumps((scalars, meta["torch_rng"]), protocol=4)


def _bytes_view(tensor, writable: bool = False):
    """A uint8 numpy view of ``tensor``'s bytes (a copy for GPU tensors, which cannot be written)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        if writable:
            raise ValueError("writable byte views need CPU tensors")
        t = t.cpu()
    if not t.is_contiguous():
        if writable:
            raise ValueError("writable byte views need contiguous tensors")
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8).numpy()
    return t.reshape(-1).view(torch.uint8).numpy()


def _stream_slice(views: list, start: int, end: int) -> list:
    out, offset = [], 0
    for view in views:
        lo, hi = max(start, offset), min(end, offset + view.nbytes)
        if lo < hi:
            out.append(view[lo - offset : hi - offset])
        offset += view.nbytes
        if offset >= end:
            break
    return out


def _stream_write(views: list, start: int, piece) -> None:
    import numpy as np

    data = np.frombuffer(piece, dtype=np.uint8) if not isinstance(piece, np.ndarray) else piece
    offset, pos = 0, 0
    end = start + len(data)
    for view in views:
        lo, hi = max(start, offset), min(end, offset + view.nbytes)
        if lo < hi:
            view[lo - offset : hi - offset] = data[pos : pos + (hi - lo)]
            pos += hi - lo
        offset += view.nbytes
        if offset >= end:
            break
