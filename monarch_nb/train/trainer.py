"""The Trainer actor: one replica per proc, running the training function window by window. Runs in procs.

The controller (see :mod:`monarch_nb.train.coordinator`) decides membership; the trainer never
does. The training *function* — the user's own loop written with :mod:`monarch_nb.train.ft`, or a
built-in workload's (:mod:`.workload_loop`), which is the same kind of loop — runs on a loop thread
of its own (:mod:`.trainer_loop`): :meth:`Trainer.setup` starts it and returns once it asks
``ft.batches`` for its first step. From then on the controller sends *windows* of consecutive
steps (:meth:`Trainer.run_window`): the loop thread runs the function's loop body for each step of
the window — ``ft.batches`` yields this rank's part of the step's global batch (the quorum and the
data order are pure functions it already knows), ``ft.step`` reduces and applies it
(:mod:`.trainer_step`) — and parks at the window's end with one compact record per step. The
controller never sits between two steps.

The trainer joins *quorums* (:meth:`~.trainer_quorum.QuorumEndpoints.init_quorum`: one process
group of the live ranks) and moves its state for heals, snapshots and checkpoints
(:mod:`.trainer_state`): all of that runs on the actor thread while the loop thread is parked at a
step boundary.

A peer failure inside the collective ends the window with status ``"collective_failed"`` (the
trainer is fine and waits for a new quorum); a later window of the old quorum is skipped. An
error of the function itself ends its loop thread; the controller sees it as this rank's failure
(an ``ActorError`` with the function's traceback) and restarts the rank.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import sys
import time
from typing import Any, Callable

from ..actor.endpoint import Actor, endpoint
from . import current
from .data import SampleOrder, digest, shard_bounds
from .replica_checksum import ReplicaChecksum, state_checksum
from .trainer_loop import FINISH, LoopDriver, WindowOrder, WindowReply, WindowStatus
from .sharding import GroupCollectiveError, GroupLayout, broke_the_group, form_group, local, parallelize
from .quorum_watch import QuorumWatch
from .trainer_quorum import CollectiveError, QuorumAborted, QuorumEndpoints
from .trainer_state import StateEndpoints
from .trainer_step import Stepping

__all__ = ["Trainer", "TrainingLoop", "EndpointLoop", "CollectiveError", "QuorumAborted"]

log = logging.getLogger(__name__)


class TrainingLoop:
    """What a Trainer runs: ``fn(*args, **kwargs)``, a loop written with ``ft`` (pickled to the
    procs; cloudpickle takes a function defined in a notebook cell by value).

    Args:
        fn: the training function.
        args, kwargs: its arguments.
        name: for messages and the report (default: the function's name).
    """

    def __init__(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, name: str = ""):
        if not callable(fn):
            raise TypeError(f"a training function must be callable, got {type(fn).__name__}")
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs or {})
        self.name = name or getattr(fn, "__name__", "train")


class EndpointLoop:
    """An actor's endpoint as the training function (``mt.start(MyTrainer.train, ...)``): on each
    rank, and again on a restarted one, a fresh ``MyTrainer(*actor_args, **actor_kwargs)`` is made
    in the proc and the endpoint's body runs on it with the run's ``args`` / ``kwargs`` (an async
    endpoint on an event loop of the loop thread). So Monarch code whose endpoint holds the
    training loop keeps its class: the loop's ``ft`` lines make it fault tolerant.

    Raises:
        TypeError: the endpoint takes an explicit response port, or its class is not an Actor.
    """

    def __init__(self, prop: Any, actor_args: tuple = (), actor_kwargs: dict | None = None):
        cls = prop.owner
        if cls is None or not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"{prop.name} is not an endpoint of an Actor class")
        if prop.explicit_response_port:
            raise TypeError(f"{cls.__name__}.{prop.name} answers through a response port: a training "
                            "endpoint returns its result (ft.report())")
        self.cls, self.method = cls, prop.name
        self.actor_args, self.actor_kwargs = tuple(actor_args), dict(actor_kwargs or {})
        self.__name__ = f"{cls.__name__}.{prop.name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import asyncio
        import inspect

        actor = self.cls(*self.actor_args, **self.actor_kwargs)
        result = getattr(actor, self.method)(*args, **kwargs)
        return asyncio.run(result) if inspect.iscoroutine(result) else result


def release_freed_memory() -> bool:
    """Give the C heap's freed memory back to the system (glibc's ``malloc_trim(0)``); False where
    the C library has none (musl, macOS).

    Training frees its activations into the allocator, which keeps them; an evaluation's larger
    batches then grow the process past that instead of into it. Trimming first took the peak
    RSS of an evaluating llama-small rank (3,033,344 parameters, FSDP2 in groups of 2, 4 ranks)
    from ~900 MiB to ~815 MiB here; torch's native HSDP ranks evaluating the same test set peak at
    790-900 MiB. Costs a walk of the heap (milliseconds), once per evaluation."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None; looked up once (``find_library`` runs ``ldconfig``)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


class _Window:
    """The window the loop thread runs: steps ``start .. start+count-1`` and their records."""

    def __init__(self, rank: int, order: WindowOrder, writer: Any):
        self.rank, self.order, self.writer = rank, order, writer
        self.cursor, self.end = order.start, order.start + order.count
        self.finished = False
        self.t_step = 0.0
        self.status, self.error, self.local_nonfinite = WindowStatus.OK, "", False
        self.failed_step: int | None = None
        self.loss: list = []
        self.accuracy: list = []
        self.digest: list = []
        self.step_ms: list = []
        self.grad_norm: list = []

    def end_with(self, status: WindowStatus, step: int | None, error: str, local_nonfinite: bool = False) -> None:
        self.status, self.failed_step, self.error, self.local_nonfinite = status, step, error, local_nonfinite
        self.finished = True

    def reply(self, next_step: int, applied_steps: int, snapshots: list) -> WindowReply:
        o = self.order
        return WindowReply(self.rank, o.quorum, o.start, self.status, self.failed_step, self.error, self.local_nonfinite,
                           tuple(self.loss), tuple(self.accuracy), tuple(self.digest), tuple(self.step_ms),
                           tuple(self.grad_norm), next_step, applied_steps, tuple(snapshots))


class Trainer(QuorumEndpoints, StateEndpoints, Stepping, Actor):
    """One data-parallel replica running a :class:`TrainingLoop`. Built light on every proc;
    :meth:`setup` starts the loop. Joining quorums is :class:`~.trainer_quorum.QuorumEndpoints`;
    heal, snapshot and checkpoint endpoints are :class:`~.trainer_state.StateEndpoints`; the
    step itself is :class:`~.trainer_step.Stepping`.

    Args:
        loop: what to run.
        seed: seeds torch, numpy and random before the function starts (so every replica builds
            the same model), and the data order.
        store_host, store_port: the controller's rendezvous TCPStore.
        backend: "gloo", "nccl" or None (gloo on CPU, nccl on CUDA and on ROCm where nccl is RCCL).
        collective_timeout_s: timeout of rendezvous and collectives, seconds.
        chunk_bytes: largest piece of state sent per heal message, bytes.
        group_size, parallelism: the replica groups and how the model is split inside one (see
            :mod:`.sharding`; 1 and "ddp": every rank a whole replica).
    """

    def __init__(self, loop: TrainingLoop, seed: int, store_host: str, store_port: int, backend: str | None = None,
                 collective_timeout_s: float = 10.0, chunk_bytes: int = 4 << 20, group_size: int = 1,
                 parallelism: Any = "ddp"):
        # Light on purpose: the actor is built on every proc at once (and again by a restart); the
        # function starts in :meth:`setup`, a call like any other that can fail on one rank.
        self._config = (loop, seed, backend)
        self.store_host, self.store_port = store_host, store_port
        self.collective_timeout_s = collective_timeout_s
        self.chunk_bytes = chunk_bytes
        self.rank = int(os.environ.get("RANK", "0"))
        self.layout = GroupLayout(group_size)
        self.parallelism = parallelism
        self._sharded = group_size > 1 or parallelism != "ddp"
        self._group_generation = 0
        self._ready = False
        self.watch = QuorumWatch()

    def peer_failed(self, rank: int) -> None:
        """The runtime says proc rank ``rank`` of this mesh failed (the proc's IO thread, through
        :class:`~.group_worker.GroupFollower`): a collective of the quorum it belongs to stops
        waiting for it (see :mod:`.quorum_watch`)."""
        if self.watch.lose(rank):
            log.info("rank %d: quorum member %d failed; the quorum's collectives give up on it", self.rank, rank)

    @endpoint
    def setup(self, group_generation: int = 0) -> dict:
        """Start the training function; return once it asks ``ft.batches`` for its first step.
        ``group_generation``: in a sharded run, the incarnation of this rank's replica group
        (its partners' ``ft.wrap`` meet under it). Idempotent. Returns ``{"rank", "setup_ms", "next_step", "num_samples", "global_batch",
        "steps", "evaluator" (bool), "name"}``: what the function's ``ft.batches`` asked for.

        Raises:
            the function's own error, if it fails before its first step;
            RuntimeError: it did not call ``ft.wrap`` before ``ft.batches``, or returned first.
        """
        import hip_ext
        import numpy as np
        import torch

        from .. import device as device_mod

        t0 = time.monotonic()
        if self._ready:
            return self._setup_info(t0)
        loop, seed, backend = self._config
        self._group_generation = group_generation
        hip_ext.load()  # compiled grad_health / checksum kernels; the pure-torch ones, with a log line, if none
        # the runtime shares each machine's cores among the procs on it (hosts on one machine too)
        threads = os.environ.get("MONARCH_NB_CPU_THREADS")
        world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // max(1, world)))
        self.backend = backend or device_mod.backend()
        self.device = device_mod.device() if self.backend == "nccl" else torch.device("cpu")
        if self.backend == "gloo" and sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # collectives stay on 127.0.0.1
        self.seed = seed
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (2**32))
        self._store = None
        self._quorum, self._ranks, self._pos, self._world = -1, [], 0, 0
        self._pg_ready = False
        self._broken = True  # no quorum yet
        self.model = self.optimizer = None
        self.registered = {}
        self.evaluator: Callable[[], dict] | None = None
        self.order: SampleOrder | None = None
        self._data: Any = None
        self._steps = 0
        self._window: _Window | None = None
        self._pending: int | None = None
        self._pending_samples = 0
        self._step_ms_avg: float | None = None
        self._incoming = None
        self._outgoing = []
        self._writer = None
        current.trainer = self
        self._driver = LoopDriver(loop.fn, loop.args, loop.kwargs, loop.name)
        self._driver.start(self._setup_timeout_s())
        if self.model is None:
            raise RuntimeError("the training function asked ft.batches for a step before ft.wrap(model, optimizer)")
        self._ready = True
        return self._setup_info(t0)

    def _setup_timeout_s(self) -> float:
        """How long the function may take to reach its first step, seconds (heavy imports, a
        data set to load, partners of a replica group that start cold)."""
        return self.collective_timeout_s * 6 + 60.0

    def _setup_info(self, t0: float) -> dict:
        return {"rank": self.rank, "setup_ms": (time.monotonic() - t0) * 1e3, "next_step": self.next_step,
                "num_samples": self.order.num_samples if self.order else 0,
                "global_batch": self.order.global_batch if self.order else 0, "steps": self._steps,
                "evaluator": self.evaluator is not None, "name": self._driver.name}

    # -- the loop thread's side (called from ft) ----------------------------------------------------
    def _split(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        """``ft.wrap`` of a sharded run: join this rank's replica group, split the model over it."""
        form_group(self.store_host, self.store_port, self.layout, self.rank, self._group_generation, self.backend,
                   self._setup_timeout_s(), self.collective_timeout_s)
        return parallelize(model, optimizer, self.parallelism, self.device.type)

    def _group_weight(self) -> int | None:
        """The samples of a step on this rank's replica group in this quorum (None in an unsharded
        run): FSDP averaged the local gradient over the group's ranks."""
        if not self._sharded:
            return None
        total = 0
        for r in self.layout.members(self.rank):
            lo, hi = shard_bounds(self._bound_order().global_batch, self._world, self._ranks.index(r))
            total += hi - lo
        return total

    def _bind_data(self, data: Any, global_batch: int, steps: int) -> None:
        if self._data is not None:
            raise RuntimeError("one ft.batches loop per run of the training function")
        self._data, self._steps = data, steps
        self.order = SampleOrder(data.num_samples, global_batch, self.seed)

    def _bound_order(self) -> SampleOrder:
        """The data order of the function's ``ft.batches`` loop.

        Raises:
            RuntimeError: the function has not called ``ft.batches`` yet.
        """
        if self.order is None:
            raise RuntimeError("no ft.batches loop yet: the function asks for batches after ft.wrap")
        return self.order

    def _shard(self, step: int) -> Any:
        batch = self._bound_order().batch(step)
        lo, hi = shard_bounds(len(batch), self._world, self._pos)
        return batch[lo:hi]

    def _next_step(self) -> int | None:
        """The next step for ``ft.batches`` to yield; parks at a window's end; None once the run ends."""
        if self._pending is not None:
            raise RuntimeError(f"step {self._pending} was not ended: call ft.step(optimizer) once for every "
                               "batch ft.batches gives")
        while True:
            w = self._window
            if w is None or w.finished:
                order = self._driver.park(self._reply(w) if w is not None else None)
                if order == FINISH:
                    self._window = None
                    return None
                self._window = self._open(order)
                continue
            if w.cursor >= w.end:
                w.finished = True
                continue
            step = w.cursor
            if w.writer is not None and w.writer.due(step):
                self._snapshot(w.writer)
            w.t_step = time.perf_counter()
            self._begin_step(step)
            self._pending = step
            return step

    def _open(self, order: WindowOrder) -> _Window:
        w = _Window(self.rank, order, self._snapshot_writer(order.snapshot))
        if order.quorum != self._quorum or self._broken or order.start != self.next_step:
            w.end_with(WindowStatus.SKIPPED, None, f"rank {self.rank} is in quorum {self._quorum} (broken: {self._broken}) at "
                                        f"step {self.next_step}; asked for quorum {order.quorum} at step {order.start}")
        else:
            self._data.prefetch([self._shard(s) for s in range(order.start, order.start + order.count)])
        return w

    def _end_step(self, loss: float | None, correct: int | None) -> None:
        """``ft.step``: reduce and apply the pending step, record it in the window."""
        step, self._pending = self._pending, None
        if step is None:
            raise RuntimeError("ft.step without a batch: call it once per (step, batch) of ft.batches")
        w = self._window
        if w is None:
            raise RuntimeError("ft.step outside a window: the loop gives batches only inside one")
        indices = self._shard(step)
        try:
            rec = self._reduce_and_apply(step, len(indices), loss, correct, step in w.order.split,
                                         self._group_weight())
        except CollectiveError as exc:
            w.end_with(WindowStatus.COLLECTIVE_FAILED, step, str(exc))
            return
        if rec is None:
            w.end_with(WindowStatus.NONFINITE, step, f"the reduced gradient of step {step} is not finite",
                       self._local_nonfinite)
            return
        ms = (time.perf_counter() - w.t_step) * 1e3
        self._step_ms_avg = ms if self._step_ms_avg is None else 0.9 * self._step_ms_avg + 0.1 * ms
        w.loss.append(rec[0])
        w.accuracy.append(rec[1])
        w.digest.append(digest(indices))
        w.grad_norm.append(rec[2])
        w.step_ms.append(ms)
        w.cursor = step + 1

    def _reply(self, w: _Window) -> WindowReply:
        return w.reply(self.next_step, self.applied_steps,
                       self._writer.take_published() if self._writer is not None else [])

    # -- the controller's side ---------------------------------------------------------------------
    @endpoint
    def run_window(self, quorum: int, start: int, count: int, split: list | None = None,
                   snapshot: dict | None = None) -> WindowReply:
        """Run steps ``start .. start+count-1`` of the training function in quorum ``quorum``.

        Args:
            split: steps whose all-reduce goes in two pieces (every member gets the same list).
            snapshot: ``{"path", "every", "budget"}`` if this rank publishes its host's snapshots.

        Returns:
            this rank's :class:`~.trainer_loop.WindowReply` (status ``SKIPPED``: not this rank's
            quorum any more, or not its next step: a window queued behind one that stopped).

        Raises:
            GroupCollectiveError: a sharded run's step failed in a collective of the replica group
                (a partner died inside FSDP's all-gather or reduce-scatter).
            the training function's own error (it raised in this window, or before).
        """
        order = WindowOrder(quorum, start, count, frozenset(split or ()), snapshot)
        try:
            return self._driver.run(order, timeout_s=self.collective_timeout_s + 10 * count + 60.0)
        except RuntimeError as exc:
            if self._sharded and broke_the_group(exc):
                raise GroupCollectiveError(f"rank {self.rank}: a collective of replica group "
                                           f"{self.layout.group_of(self.rank)} failed inside step: {exc}") from exc
            raise

    @endpoint
    def finish(self) -> Any:
        """End the run here: ``ft.batches`` stops, the function runs to its end; returns what it
        returned (e.g. ``ft.report()``), or None if that cannot be pickled."""
        value = self._driver.run(FINISH, timeout_s=self.collective_timeout_s + 30.0)
        try:
            import cloudpickle

            cloudpickle.dumps(value)
        except Exception:
            return None
        return value

    @endpoint
    def status(self) -> dict:
        """``{"rank", "next_step", "applied_steps", "quorum", "broken"}``."""
        return {"rank": self.rank, "next_step": self.next_step, "applied_steps": self.applied_steps,
                "quorum": self._quorum, "broken": self._broken}

    @endpoint
    def checksum(self) -> ReplicaChecksum:
        """Checksum of the replica: parameters, buffers, optimizer state, registered state, part
        by part (see :mod:`.replica_checksum`). Two ranks of one shard index have one digest
        exactly when (barring a 64-bit collision) all of that is bit-identical, on any device."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "registered": {name: obj.state_dict() for name, obj in self.registered.items()}}
        digest, parts = state_checksum(state)
        return ReplicaChecksum(rank=self.rank, digest=digest, applied_steps=self.applied_steps,
                               next_step=self.next_step, shard=self.layout.shard_of(self.rank), parts=parts)

    @endpoint
    def parameters(self) -> dict:
        """The model's state dict (CPU tensors; in a sharded run, this rank's shards)."""
        return {k: local(v).detach().cpu().clone() for k, v in self.model.state_dict().items()}

    @endpoint
    def evaluate(self) -> dict:
        """The registered evaluator's figures (``ft.evaluator``): ``{"test_loss", "test_accuracy"
        (or None), "next_step"}``; None figures when the function registered none. The evaluator
        runs on the loop thread, parked at a step boundary (``LoopDriver.call``): where the user's
        loop set its device, grad mode and autocast."""
        if self.evaluator is None:
            return {"test_loss": None, "test_accuracy": None, "next_step": self.next_step}
        evaluator, model = self.evaluator, self.model

        def run() -> dict:
            import torch

            release_freed_memory()
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    return dict(evaluator())
            finally:
                model.train(was_training)

        figures = self._driver.call(run, self._setup_timeout_s())
        return {"test_loss": figures.get("test_loss"), "test_accuracy": figures.get("test_accuracy"),
                "next_step": self.next_step}

    def __cleanup__(self, exc: Any) -> None:
        if not self._ready:
            return
        if self._writer is not None:
            self._writer.wait_idle(2.0)
        self._leave_replica_group()
