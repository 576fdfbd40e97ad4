"""Fault tolerance for your own training loop, with a few added lines (``monarch_nb.ft``).

    import torch, torch.nn.functional as F
    import monarch_nb.train as mt
    from monarch_nb import ft

    def train():
        model, opt = ft.wrap(Net(), torch.optim.AdamW(params_of_net, lr=1e-3))   # or build opt on model
        for step, (x, y) in ft.batches(train_set, batch_size=64, steps=300):      # resumes at the committed step
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            ft.step(opt, loss=loss)              # commit over the live ranks; joiners are healed here
        return ft.report()

    run = mt.start(train, procs=4)               # or mt.fit(train, procs=4): a TrainReport

Inside a run (``mt.start``/``mt.fit``), every rank runs the function; ``ft`` makes it a replica of
the run (the same guarantees as the built-in workloads, which are loops written with ``ft``):

- ``batch_size`` is the **global** batch: the samples of one step over all live ranks, in an order
  that is a pure function of the run's seed and the step. Each live rank gets its contiguous part
  (``ft.batches`` yields ``(step, batch)`` with this rank's part). A failure changes who computes a
  sample, never which samples a step uses: 0 samples lost or repeated (the run's ledger checks).
- ``ft.step`` averages the gradient over the samples actually used (the loss is the mean over
  this rank's part, as usual) and the model's floating-point buffers (BatchNorm's running
  statistics) the same way, in one all-reduce, then applies the optimizer. Replicas stay
  bit-identical (the report's ``replicas_identical`` compares parameters, buffers, optimizer
  state and registered state).
- When a peer fails, the step is redone by the survivors' new quorum: ``ft.batches`` yields the
  same step again, and what ``ft`` keeps — buffers, registered state (``ft.register``), RNG — is
  first put back to the step's start, so code after ``ft.step`` (``scheduler.step()``) may run
  once per attempt. Survivors never wait out a collective timeout.
- A failed rank is restarted (a warm spare), runs the function again from the top, and is healed
  from a live peer — parameters, buffers, optimizer, registered state, RNG and data position —
  at its first ``ft.batches`` step; it joins at the next step boundary.

Outside a run (the function called directly, in a notebook cell), ``ft`` runs it as a plain
single-process loop: the same code, nothing to heal, handy to debug it first.

Runs in procs (and in the controller for a local run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .data import SampleOrder, shard_bounds
from .sources import data_source

__all__ = ["wrap", "batches", "step", "register", "evaluator", "report", "device", "rank", "world_size", "RankReport"]


@dataclass(frozen=True)
class RankReport:
    """What one rank saw of its run (the run's full report is the controller's ``TrainReport``).

    Attributes:
        rank: this proc's rank. steps_applied: updates this replica applied. next_step: the step
        it would run next (the data position). quorum: the last quorum it joined. local: True if
        the loop ran outside a training run (one process, no fault tolerance).
    """

    rank: int
    steps_applied: int
    next_step: int
    quorum: int
    local: bool


def _trainer() -> Any:
    """The Trainer of this proc's run, or None outside one."""
    from . import current

    return current.trainer


def _local() -> "_LocalLoop":
    global _LOCAL
    if _LOCAL is None:
        _LOCAL = _LocalLoop()
    return _LOCAL


def wrap(model: Any, optimizer: Any, *, device: Any = None) -> tuple[Any, Any]:
    """Make ``model`` and ``optimizer`` this rank's replica of the run (call it once, first).

    Args:
        model: a ``torch.nn.Module``; moved to ``device`` (in place) if given.
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters.
        device: where the model lives (default: where it is; ``ft.device()`` is this rank's GPU
            on a GPU host, the CPU elsewhere).

    In a run with ``parallelism`` (``mt.fit(..., group_size=2, parallelism="fsdp")``) the model
    is split over this rank's replica group first (FSDP2's ``fully_shard``, or the run's
    ``parallelize(model, device_mesh)``) and the optimizer pointed at its sharded parameters
    (see :mod:`monarch_nb.train.sharding`): use the two returned, not the ones passed in.

    Returns:
        ``(model, optimizer)``: the same model (split, in a sharded run), and the optimizer wrapped so that its
        ``zero_grad()`` keeps the flat gradient buffer and its ``step()`` is ``ft.step(opt)``
        (it passes ``isinstance(opt, torch.optim.Optimizer)``; LR schedulers take it).

    Raises:
        RuntimeError: called twice in one run of the function.
        TypeError: the model has no trainable parameter, or ``optimizer`` is not an optimizer.
    """
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ft.wrap(model, optimizer): optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if device is not None:
        model.to(device)
    if not any(p.requires_grad for p in model.parameters()):
        raise TypeError("ft.wrap: the model has no trainable parameter")
    inner = getattr(optimizer, "inner", optimizer)
    t = _trainer()
    if t is None:
        return _local().wrap(model, inner)
    if t.model is not None:
        raise RuntimeError("ft.wrap was called twice in this run of the training function: wrap one model once")
    if t._sharded:  # the run's parallelism: the model split over this rank's replica group
        model, inner = t._split(model, inner)
    t._adopt(model, inner)
    wrapped = _wrapped(inner, t)
    t.optimizer_faces.append(wrapped)  # an LR scheduler built on either sees its step called
    return model, wrapped


def register(name: str, obj: Any) -> Any:
    """Keep ``obj`` (anything with ``state_dict()`` / ``load_state_dict()``: an LR scheduler, a
    GradScaler, a stateful sampler) as part of the replica: healed, snapshotted, checkpointed,
    checksummed, and put back when a step is redone. Returns ``obj``.

    Raises:
        TypeError: ``obj`` has no ``state_dict`` / ``load_state_dict``.
        ValueError: ``name`` is taken, or this is called before ``ft.wrap``.
    """
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"ft.register({name!r}, ...): {type(obj).__name__} has no state_dict()/load_state_dict()")
    t = _trainer()
    if t is None:
        return obj
    if t.model is None:
        raise ValueError("ft.register: call ft.wrap(model, optimizer) first")
    if name in t.registered:
        raise ValueError(f"ft.register: {name!r} is registered already")
    t.registered[name] = obj
    return obj


def evaluator(fn: Callable[[], dict]) -> Callable[[], dict]:
    """Register ``fn() -> {"test_loss": float, "test_accuracy": float or None}``, run on one
    live rank every ``eval_every`` steps and at the end, at a step boundary (under no_grad is
    your choice). Returns ``fn`` (usable as a decorator)."""
    t = _trainer()
    if t is not None:
        t.evaluator = fn
    return fn


def batches(source: Any, batch_size: int, steps: int | None = None, *, epochs: int | None = None,
            num_samples: int | None = None, collate_fn: Callable | None = None) -> Iterator[tuple[int, Any]]:
    """This rank's part of each step's global batch: yields ``(step, batch)``.

    Args:
        source: a tuple of tensors (samples along dim 0), a map-style dataset, a
            ``torch.utils.data.DataLoader`` (its dataset and collate_fn; with ``num_workers > 0``
            its workers load a window of steps ahead; its own sampler is not used), or a
            function ``fn(indices) -> batch`` with ``num_samples``. See :mod:`.sources`.
        batch_size: the **global** batch: samples per step over all live ranks.
        steps: optimizer steps in the run; or ``epochs`` passes over the data (whole steps).
        num_samples: the dataset's size, for a function source.
        collate_fn: for a map-style dataset (default: torch's ``default_collate``).

    The first step is the run's next one: 0, a resumed checkpoint's, or — on a rank restarted
    after a failure — the step it joins at (after it was healed). A step may be yielded twice
    when it is redone after a failure (see the module docstring).

    Raises:
        ValueError: neither or both of ``steps`` and ``epochs``; a batch larger than the data.
        RuntimeError: a step was not ended with ``ft.step`` before the next was asked for.
    """
    data = data_source(source, num_samples=num_samples, collate_fn=collate_fn)
    if (steps is None) == (epochs is None):
        raise ValueError("ft.batches: give steps= (optimizer steps) or epochs= (passes over the data), one of them")
    if not isinstance(batch_size, int) or batch_size < 1 or batch_size > data.num_samples:
        raise ValueError(f"ft.batches: batch_size must be an integer from 1 to the dataset's size "
                         f"({data.num_samples}), got {batch_size!r}")
    total = steps if steps is not None else (epochs or 0) * (data.num_samples // batch_size)
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"ft.batches: steps must be a positive integer, got {total!r}")
    t = _trainer()
    if t is None:
        yield from _local().batches(data, batch_size, total)
        return
    t._bind_data(data, batch_size, total)
    try:
        while True:
            s = t._next_step()
            if s is None:
                return
            yield s, data.fetch(t._shard(s))
    finally:
        data.close()


def step(optimizer: Any = None, *, loss: Any = None, correct: int | None = None) -> None:
    """End this step: average the gradient (and floating-point buffers) over the samples the live
    ranks used, then apply ``optimizer``'s update; a peer's failure makes the step be redone.

    Args:
        optimizer: the optimizer ``ft.wrap`` returned (optional: the run knows it).
        loss: this step's loss on this rank (a 0-d tensor or float, the mean over its batch), for
            the run's metrics and report.
        correct: correct predictions on this rank's batch, for the batch accuracy in the metrics.

    Raises:
        RuntimeError: no batch of ``ft.batches`` is pending (a second ``ft.step`` for one batch).
    """
    t = _trainer()
    if t is None:
        _local().step()
        return
    if loss is not None and hasattr(loss, "detach"):
        loss = loss.detach()
    t._end_step(None if loss is None else float(loss), correct)


def report() -> RankReport:
    """This rank's view of its run (the run's report is ``run.report()`` on the controller)."""
    t = _trainer()
    if t is None:
        loop = _local()
        return RankReport(0, loop.applied, loop.next_step, 0, True)
    return RankReport(t.rank, t.applied_steps, t.next_step, t._quorum, False)


def device() -> Any:
    """This rank's device: its GPU (``cuda:N``; ROCm's too) on a GPU host, else the CPU."""
    import torch

    t = _trainer()
    if t is not None:
        return t.device
    from .. import device as device_mod

    return device_mod.device() if device_mod.detect_gpus().count else torch.device("cpu")


def rank() -> int:
    """This proc's rank in the run (0 outside one)."""
    t = _trainer()
    return 0 if t is None else t.rank


def world_size() -> int:
    """How many ranks the current quorum has (1 outside a run)."""
    t = _trainer()
    return 1 if t is None else max(1, t._world)


def _wrapped(inner: Any, trainer: Any) -> Any:
    """``inner`` behind an Optimizer whose ``zero_grad`` keeps the flat gradient buffer and whose
    ``step`` is ``ft.step``; everything else is ``inner``'s (as torchft's OptimizerWrapper)."""
    import torch

    class FTOptimizer(torch.optim.Optimizer):
        def __init__(self, inner: Any) -> None:  # no super().__init__: the state is inner's
            self.inner = inner

        @property
        def param_groups(self):  # type: ignore[override]
            return self.inner.param_groups

        @property
        def state(self):  # type: ignore[override]
            return self.inner.state

        @property
        def defaults(self):  # type: ignore[override]
            return self.inner.defaults

        def zero_grad(self, set_to_none: bool = True) -> None:
            trainer.zero_grad()

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            if closure is not None:
                raise TypeError("ft: optimizers that take a closure (LBFGS) are not supported")
            step(self)

        def state_dict(self) -> dict:
            return self.inner.state_dict()

        def load_state_dict(self, state_dict: dict) -> None:
            self.inner.load_state_dict(state_dict)

        def add_param_group(self, param_group: dict) -> None:
            raise RuntimeError("ft: add parameter groups before ft.wrap (the flat gradient buffer is built there)")

        def __repr__(self) -> str:
            return f"ft({self.inner!r})"

    return FTOptimizer(inner)


class _LocalLoop:
    """``ft`` outside a run: one process, the plain loop (optimizer.step, zero_grad)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.optimizer: Any = None
        self.applied = 0
        self.next_step = 0
        self.t0 = time.monotonic()

    def wrap(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        self.model, self.optimizer, self.applied, self.next_step = model, optimizer, 0, 0
        return model, optimizer

    def batches(self, data: Any, batch_size: int, steps: int) -> Iterator[tuple[int, Any]]:
        order = SampleOrder(data.num_samples, batch_size, 0)
        for s in range(steps):
            self.next_step = s
            batch = order.batch(s)
            lo, hi = shard_bounds(len(batch), 1, 0)
            yield s, data.fetch(batch[lo:hi])

    def step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("ft.step: call ft.wrap(model, optimizer) first")
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.applied += 1
        self.next_step += 1


_LOCAL: _LocalLoop | None = None
