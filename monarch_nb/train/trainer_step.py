"""One step of a replica: its gradient and buffers reduced over the quorum, then applied. Runs in procs.

:class:`Stepping` (a part of :class:`~monarch_nb.train.trainer.Trainer`) holds what ``ft.wrap``
and ``ft.register`` hand it — the model, the optimizer, registered objects — and does what
``ft.step`` asks at the end of a step:

1. the step's gradient is in one flat float32 buffer (each parameter's ``.grad`` is a view of it,
   as DDP's ``gradient_as_bucket_view``; a parameter whose ``.grad`` was replaced is copied in);
   its health is read in one pass (``hip_ext.grad_health``: sum of squares, non-finite count: a
   NaN is found on the rank that produced it);
2. the gradient (the mean over this rank's ``n`` samples) is scaled by ``n``, and the model's
   persistent floating-point buffers (BatchNorm's running statistics), scaled by ``n`` too, sit
   after it in the same buffer with four statistics (loss sum, samples, correct, non-finite);
   one all-reduce (SUM) over the quorum, divided by the reduced sample count, gives the gradient
   averaged over the samples actually used and the buffers averaged the same way (every
   replica's running statistics weighted by its samples: closer to the global batch's than
   DDP's broadcast of rank 0's, and no extra collective); the buffers are set to it;
3. if the reduced statistics say a gradient was not finite, nothing is applied and the window
   ends (status ``"nonfinite"``): every member sees the same values and stops at the same step;
   otherwise the optimizer applies it at once.

A step that does not commit is undone: at its start the persistent buffers, the registered
objects' state, the optimizer's hyperparameters (each param group's ``lr`` and the rest: an LR
scheduler sets them, and StepLR and most others scale the group's current ``lr``, so a scheduler's
state alone does not give them back) and the RNG states are kept, and when the same step is run
again (redone by a new quorum) they are put back, so code in the loop body after ``ft.step``
(``scheduler.step()``) may run once per attempt and still leaves no trace of a failed one. A rank
that catches up on a step it attempted applies it with the hyperparameters kept at its start, as
the ranks that committed it did, then keeps those its loop has set since.

**Commit.** Step ``s`` is committed as soon as one member's all-reduce of ``s`` completed (see
:mod:`monarch_nb.train.coordinator`). The two flat buffers alternate between steps, so a member
still holds step ``s``'s reduced gradient and buffers while it works on ``s+1``; a survivor that
is behind receives them (:meth:`Stepping.gradient` / :meth:`Stepping.apply_gradient`) and applies
the very same update: replicas stay bit-identical.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import signal
import time
from typing import Any

from ..actor.endpoint import endpoint
from ..faults.worker import take_nan
from .sharding import all_reduce_sum, grad_like, local
from .trainer_quorum import CollectiveError
from .trainer_fields import TrainerFields

__all__ = ["Stepping", "STATS", "grad_health", "persistent_buffers"]

log = logging.getLogger(__name__)

#: reduced statistics at the end of the flat buffer: loss sum, samples, correct, non-finite count
STATS = 4


def grad_health(grads: list) -> tuple[float, int]:
    """``(sum of squares of the finite elements, number of non-finite elements)`` of ``grads``
    (a list of float tensors), read before the all-reduce: ``hip_ext.grad_health``, one pass."""
    from hip_ext import grad_health as kernel

    sum_sq, nonfinite = kernel(grads).tolist()
    return sum_sq, int(nonfinite)


def persistent_buffers(model) -> list:
    """The tensors of ``model``'s persistent buffers (those in its state dict), each once."""
    seen: set[int] = set()
    found = []
    for module in model.modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip and id(buf) not in seen:
                seen.add(id(buf))
                found.append(buf)
    return found


class Stepping(TrainerFields):
    """The replica's state and its step (see the module docstring). A room of
    :class:`~monarch_nb.train.trainer.Trainer` (its shared fields: :class:`~.trainer_fields.TrainerFields`)."""

    applied_steps = 0  # updates applied to the parameters
    next_step = 0  # the step whose update comes next
    _attempt_step = -1  # the step whose start state is kept (see _begin_step)
    _cross: Any = None  # the shard index's process group across groups (sharded runs)

    def _adopt(self, model, optimizer) -> None:
        """Take ``model`` and ``optimizer`` (``ft.wrap``): flat buffers for gradients and buffers."""
        import torch

        self.model, self.optimizer = model, optimizer
        self.optimizer_faces = [optimizer]
        self.registered = {}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._all_buffers = persistent_buffers(model)
        self._avg_buffers = [b for b in self._all_buffers if b.is_floating_point()]
        self._n = sum(local(p).numel() for p in self.params)
        self._nb = sum(b.numel() for b in self._avg_buffers)
        self._direct = not self._sharded and all(p.dtype == torch.float32 and p.is_contiguous() for p in self.params)
        device = local(self.params[0]).device if self.params else torch.device("cpu")
        self._bufs = [torch.zeros(self._n + self._nb + STATS, dtype=torch.float32, device=device) for _ in range(2)]
        self._views = [self._param_views(buf) for buf in self._bufs]
        self._reduced_step = [-1, -1]  # which step's reduced gradient each buffer holds
        self._stats = torch.zeros(STATS, dtype=torch.float32)
        self._stats_np = self._stats.numpy()
        self._attempt_step = -1
        self._local_nonfinite = False
        self._kill_in_collective_at: int | None = None
        self.applied_steps = self.next_step = 0
        self._point_grads(0)

    def _replace_buffer(self, which: int) -> None:
        """A fresh flat buffer ``which`` (zeros; the parameters' ``.grad`` point to it at the
        next step's start), the old one left to the abandoned collective that holds it."""
        old = self._bufs[which]
        self._bufs[which] = old.new_zeros(old.shape)
        self._views[which] = self._param_views(self._bufs[which])
        self._reduced_step[which] = -1  # it no longer holds a reduced step

    def _param_views(self, buf) -> list:
        views, offset = [], 0
        for p in self.params:
            views.append(buf[offset : offset + p.numel()].view_as(p) if self._direct else None)
            offset += p.numel()
        return views

    def _point_grads(self, which: int) -> None:
        """Every parameter's ``.grad`` is a view of flat buffer ``which`` (or None, gathered later)."""
        if self._direct:
            for p, view in zip(self.params, self._views[which]):
                p.grad = view
        else:
            for p in self.params:
                p.grad = None

    def zero_grad(self) -> None:
        """Zero the current step's gradients in place (``optimizer.zero_grad()`` of a wrapped loop)."""
        which = self.next_step & 1
        self._bufs[which][: self._n].zero_()
        if self._direct:
            self._point_grads(which)
        else:
            for p in self.params:
                p.grad = None

    # -- a step's start: kept, or put back for a redo -------------------------------------------
    def _begin_step(self, step: int) -> None:
        which = step & 1
        self._bufs[which].zero_()
        self._point_grads(which)
        if step == self._attempt_step:
            self._put_back()
        else:
            self._keep(step)

    def _keep(self, step: int) -> None:
        import numpy as np
        import torch

        self._attempt_step = step
        self._kept_buffers = [b.detach().clone() for b in self._all_buffers]
        self._kept_registered = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.registered.items()}
        self._kept_hyperparameters = self._hyperparameters()
        self._kept_rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    def _put_back(self) -> None:
        import numpy as np
        import torch

        for buf, kept in zip(self._all_buffers, self._kept_buffers):
            buf.copy_(kept)
        for name, obj in self.registered.items():
            obj.load_state_dict(copy.deepcopy(self._kept_registered[name]))
        self._set_hyperparameters(self._kept_hyperparameters)
        torch_rng, numpy_rng, python_rng = self._kept_rng
        torch.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)
        random.setstate(python_rng)

    def _hyperparameters(self) -> list[dict]:
        """A copy of every param group's settings but its parameters (``lr``, betas, ...)."""
        return [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def _set_hyperparameters(self, kept: list[dict]) -> None:
        for group, values in zip(self.optimizer.param_groups, kept):
            group.update(copy.deepcopy(values))

    def _forget_attempt(self) -> None:
        """The replica's state was replaced (heal, restore, catch-up): no kept start is valid."""
        self._attempt_step = -1

    # -- a step's end ------------------------------------------------------------------------------
    def _reduce_and_apply(self, step: int, samples: int, loss: float | None, correct: int | None,
                          split: bool, weight: int | None = None) -> tuple | None:
        """End step ``step`` (``ft.step``): reduce over the quorum, apply. Returns ``(mean loss,
        batch accuracy or None, local gradient norm)``, or None if the reduced gradient is not
        finite (nothing applied). ``weight``: the samples the local gradient stands for (default
        ``samples``; in a sharded run the group's, since FSDP already averaged it over the group).

        Raises:
            CollectiveError: a peer failed during the all-reduce.
        """
        which = step & 1
        buf = self._bufs[which]
        grads, bufsec, tail = buf[: self._n], buf[self._n : self._n + self._nb], buf[self._n + self._nb :]
        if not self._direct:
            self._gather_grads(grads)
        if take_nan():
            grads[0] = float("nan")
        sum_sq, nonfinite = grad_health([grads])
        self._local_nonfinite = nonfinite > 0
        weight = samples if weight is None else weight
        if weight:
            grads.mul_(weight)  # the mean over the samples it stands for -> their sum
        else:
            grads.zero_()
        if self._nb:
            torch_cat = __import__("torch").cat
            bufsec.copy_(torch_cat([b.detach().reshape(-1).float() for b in self._avg_buffers])).mul_(samples)
        stats = self._stats_np  # a numpy view of a CPU tensor: four assignments cost no torch call
        loss_sum = 0.0 if loss is None or not samples else float(loss) * samples
        stats[0], stats[1], stats[2], stats[3] = loss_sum, samples, correct or 0, nonfinite
        tail.copy_(self._stats)
        self._all_reduce(buf, step, split)
        loss_total, count, correct_total, nonfinite_total = tail.tolist()
        if nonfinite_total > 0 or not math.isfinite(loss_total):
            return None
        buf[: self._n + self._nb].div_(count)
        self._apply(which, step, set_grads=not self._direct)
        accuracy = correct_total / count if correct is not None else None
        return (loss_total / count if loss is not None else None), accuracy, math.sqrt(sum_sq)

    def _gather_grads(self, grads) -> None:
        offset = 0
        for p in self.params:
            n = local(p).numel()
            if p.grad is not None:
                grads[offset : offset + n].copy_(local(p.grad).reshape(-1))
            offset += n

    def _apply(self, which: int, step: int, set_grads: bool = True) -> None:
        """Apply the reduced gradient and buffers in flat buffer ``which`` as step ``step``'s update."""
        buf = self._bufs[which]
        if not set_grads:
            pass
        elif self._direct:
            self._point_grads(which)
        else:
            offset = 0
            for p in self.params:
                n = local(p).numel()
                if self._sharded and p.grad is not None:  # in place: no new DTensor per parameter
                    local(p.grad).copy_(buf[offset : offset + n].view(local(p.grad).shape))
                else:
                    p.grad = grad_like(p, buf[offset : offset + n])
                offset += n
        offset = self._n
        for b in self._avg_buffers:
            n = b.numel()
            b.copy_(buf[offset : offset + n].view(b.shape))
            offset += n
        self._optimizer_step()
        self._reduced_step[which] = step
        self.applied_steps += 1
        self.next_step = step + 1

    def _optimizer_step(self) -> None:
        """The optimizer's own step (not a wrapper's: ``ft.wrap`` routes its ``step`` here)."""
        for face in self.optimizer_faces:  # an LR scheduler built on it does not warn that step was skipped
            face._opt_called = True
        type(self.optimizer).step(self.optimizer)

    def _all_reduce(self, buf, step: int, split: bool) -> None:
        if self._sharded:
            self._all_reduce_sharded(buf, step, split)
            return
        if self._world <= 1:
            return
        abandoned = self.watch.abandoned
        error = self._reduce_pieces(buf, step, split, lambda piece: self._watched_all_reduce(piece))
        if error is not None:
            self._collective_failed(step, error, orphan=self.watch.abandoned != abandoned)

    def _watched_all_reduce(self, tensor, members: Any = None) -> None:
        """``dist.all_reduce`` (SUM) over the default group; with gloo it gives up as soon as the
        runtime says one of ``members`` (default: the quorum) died (see :mod:`.quorum_watch`)."""
        import torch.distributed as dist

        if self.backend != "gloo":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            return
        self.watch.wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True), dist.group.WORLD, members)

    def _reduce_pieces(self, buf, step: int, split: bool, reduce: Any) -> str | None:
        """``reduce`` each piece of ``buf`` (two with ``split``); the error's text, or None."""
        pieces = buf.tensor_split(2) if split else (buf,)
        try:
            for i, piece in enumerate(pieces):
                if i == 1 and self._kill_in_collective_at == step:
                    os.kill(os.getpid(), signal.SIGKILL)  # a real death between buckets of the reduction
                reduce(piece)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _collective_failed(self, step: int, error: str, orphan: bool = False) -> None:
        # Close this group's connections now: in a ring only the dead rank's neighbours see the
        # reset, the others wait on them and are released by this close. The exception's
        # traceback holds the group, so it is dropped (the caller's except block ended) before
        # the group is destroyed (freed by refcount: no gc.collect, which costs ~0.4 s here).
        # ``orphan``: a collective on this step's buffer was abandoned (quorum_watch) and may
        # still write into it: the buffer is left to it and a fresh one takes its place.
        if orphan:
            self._replace_buffer(step & 1)
        self._broken = True
        self._leave_group()
        raise CollectiveError(f"rank {self.rank}: all_reduce of step {step} failed: {error}")

    def _all_reduce_sharded(self, buf, step: int, split: bool) -> None:
        """A sharded run's reduction: every shard (with its rank's buffers and statistics) summed
        with the same shard of the other live groups (:attr:`_cross`), then one all-reduce in
        the replica group (its default group) of a failure flag with the buffers and statistics:
        it sums those over the group's shard indices too (so over every rank), and is the vote:
        if any member's reduction failed, no member applies the step, so a group never holds
        half an update. One collective more per step than native HSDP's, and it is 5+ floats."""
        import torch
        import torch.distributed as dist

        error = None
        abandoned = self.watch.abandoned
        if self._cross is not None:
            peers = [r for r in self._ranks if self.layout.shard_of(r) == self.layout.shard_of(self.rank)]
            wait = (lambda work, group: self.watch.wait(work, group, peers)) if self.backend == "gloo" else None
            error = self._reduce_pieces(buf, step, split, lambda piece: all_reduce_sum(self._cross, piece, wait))
        if dist.get_world_size() > 1:
            flag = torch.full((1,), 1.0 if error else 0.0, device=buf.device)  # on the GPU for nccl/RCCL
            vote = torch.cat([flag, buf[self._n :]])
            try:
                self._watched_all_reduce(vote, self.layout.members(self.rank))
            except Exception as exc:
                error = error or f"{type(exc).__name__}: {exc} (its replica group's vote)"
            else:
                if vote[0].item() > 0:
                    error = error or "a partner in its replica group could not reduce its shard"
                buf[self._n :].copy_(vote[1:])
        if error is not None:
            self._collective_failed(step, error, orphan=self.watch.abandoned != abandoned)

    @endpoint
    def arm_kill_in_collective(self, step: int) -> None:
        """SIGKILL this proc in the middle of step ``step``'s gradient reduction (the step must be
        in the window's ``split`` list)."""
        self._kill_in_collective_at = step

    # -- catching up after a failure ------------------------------------------------------------
    @endpoint
    def gradient(self, step: int):
        """The reduced gradient and buffers this rank applied as step ``step`` (a flat float32 CPU
        tensor).

        Raises:
            LookupError: it no longer holds it (only the last two steps' are kept).
        """
        which = step & 1
        if self._reduced_step[which] != step:
            raise LookupError(f"rank {self.rank} no longer holds the gradient of step {step}")
        return self._bufs[which][: self._n + self._nb].detach().cpu().clone()

    @endpoint
    def apply_gradient(self, step: int, flat) -> dict:
        """Apply ``flat`` (from :meth:`gradient` of a peer) as step ``step``, the next one here.

        Returns ``{"rank", "next_step", "applied_steps"}``.

        Raises:
            RuntimeError: ``step`` is not this rank's next step.
        """
        if step != self.next_step:
            raise RuntimeError(f"rank {self.rank} is at step {self.next_step}; cannot apply step {step}")
        t0 = time.perf_counter()
        which = step & 1
        self._bufs[which][: self._n + self._nb].copy_(flat.to(self._bufs[which].device))
        since = None
        if step == self._attempt_step:  # its loop ran past the failed attempt (a scheduler's step):
            since = self._hyperparameters()  # apply with the step's own settings, as its committers did
            self._set_hyperparameters(self._kept_hyperparameters)
        self._apply(which, step)
        if since is not None:
            self._set_hyperparameters(since)
        self._forget_attempt()
        log.debug("rank %d applied step %d from a peer in %.2f ms", self.rank, step, (time.perf_counter() - t0) * 1e3)
        return {"rank": self.rank, "next_step": self.next_step, "applied_steps": self.applied_steps}
