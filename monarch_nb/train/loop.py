"""The single-controller training loop: drives steps, survives failures, heals restarted ranks.

Built on the public actor API only (``spawn_procs``, ``spawn``, ``call_one``, ``inject``,
``restart``, the controller's event log). Per step ``s`` the loop sends ``Trainer.step`` to every
live rank of the current membership epoch and waits for all replies. Then:

- all ok: step ``s`` is committed (recorded in the sample ledger), the loop goes to ``s+1``;
- the reduced gradient is not finite (a ``nan`` fault): step ``s`` is redone in the same epoch;
- a rank failed (its proc died or was fenced: ``SupervisionError``; its own endpoint raised:
  ``ActorError`` other than :class:`~monarch_nb.train.trainer.CollectiveError`, after which it is
  fenced; no reply in time): it leaves the live set and is restarted in a background thread
  (``procs.restart`` blocks); the survivors, released from the collective by a peer error, form
  a new epoch (a new process group under a new store prefix) and redo step ``s``.

At each step boundary, ranks whose restart finished are healed from a live donor (state streamed
in chunks through the controller, SHA-256 checked), a new epoch including them is formed, and all
replicas' parameter checksums (``hip_ext.checksum`` per tensor) are compared. The rendezvous
TCPStore lives here, in the controller.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ActorError, MeshStoppedError, SupervisionError
from ..supervision.records import ProcState
from .data import SampleLedger, SampleOrder
from ..faults.spec import FaultSpec, check_faults, parse_fault
from .report import FailureRecord, TrainReport
from .workloads import Workload, get_workload

__all__ = ["fit", "start", "TrainingRun", "TrainingError"]

log = logging.getLogger(__name__)

CHAOS_KINDS = ("kill", "hang", "exit", "segfault", "raise", "nan")
_PEER_ERRORS = ("CollectiveError", "EpochAborted")


class TrainingError(RuntimeError):
    """The run cannot go on (every rank failed, or membership could not be formed)."""


@dataclass
class _Options:
    workload: Workload
    procs: int
    steps: int
    faults: list
    seed: int
    lr: float
    global_batch: int
    backend: str | None
    chaos_mtbf_s: float | None
    chaos_kinds: tuple
    eval_every: int
    collective_timeout_s: float
    restart_timeout_s: float
    chunk_bytes: int
    checkpoint_dir: str | None
    checkpoint_every: int
    resume: bool
    report_json: str | None
    keep_parameters: bool


class TrainingRun:
    """A training run in a background thread (see :func:`start`).

    Attributes:
        metrics: one dict per committed step: ``{"type": "step", "step", "loss", "accuracy"
            (batch accuracy or None), "time_s" (since training began), "epoch", "live_ranks",
            "step_ms", "grad_norm" (the largest L2 norm of a live rank's local gradient, before
            averaging)}`` plus ``"test_accuracy"``/``"test_loss"`` on evaluation steps.
        recoveries: one dict per recovery event: ``{"type": "recovery", "event": "failed" |
            "detected" | "resumed" | "rejoined", "kind", "rank", "step", "latency_s", "time_s"}``.
        ledger: the :class:`~monarch_nb.train.data.SampleLedger`.
        parameters: with ``keep_parameters=True``, ``{rank: state dict of CPU tensors}`` of every
            live replica at the end (else empty).
    """

    def __init__(self, options: _Options):
        self.options = options
        self.metrics: list[dict] = []
        self.recoveries: list[dict] = []
        self.ledger = SampleLedger()
        self.parameters: dict[int, dict] = {}
        self.order = SampleOrder(options.workload.num_train, options.global_batch, options.seed)
        self._subscribers: list[Callable[[dict], None]] = []
        self._stop = threading.Event()
        self._done = threading.Event()
        self._procs_ready = threading.Event()
        self._error: BaseException | None = None
        self._report: TrainReport | None = None
        self._procs = None
        self._lock = threading.RLock()
        self._failures: list[FailureRecord] = []
        self._open: dict[int, list[FailureRecord]] = {}
        self._live: list[int] = []
        self._restarting: set[int] = set()
        self._ready: "queue.Queue[int]" = queue.Queue()
        self._joined_pending: list[FailureRecord] = []
        self._epoch = 0
        self._dirty = False
        self._step = 0
        self._committed_through = -1
        self._productive_s = 0.0
        self._attempts_failed = 0
        self._step_ms: list[float] = []
        self._t_train0 = time.monotonic()
        self._thread = threading.Thread(target=self._main, name="monarch_nb-train", daemon=True)

    # -- public face ------------------------------------------------------------------------------
    @property
    def procs(self):
        """The run's ProcMesh (waits up to the start timeout for it to be spawned)."""
        self._procs_ready.wait(120.0)
        return self._procs

    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``callback(dict)`` with each step metric and each recovery record (on the training
        thread; keep it short). Returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ends; True if it did within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        return self._done.is_set()

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop at the next step boundary and wait for the run to wind down (procs stopped)."""
        self._stop.set()
        self._done.wait(timeout)

    def report(self, timeout: float | None = None) -> TrainReport:
        """Wait for the run and return its report.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            TrainingError (or the original error): the run failed.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the training run is still going after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def step(self) -> int:
        """The step being run (number of committed steps)."""
        return self._step

    @property
    def live_ranks(self) -> list[int]:
        return list(self._live)

    # -- plumbing ---------------------------------------------------------------------------------
    def _emit(self, item: dict) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(item)
            except Exception:
                log.exception("training subscriber %r failed", fn)

    def _recovery(self, event: str, rec: FailureRecord, at: float) -> None:
        item = {"type": "recovery", "event": event, "kind": rec.kind, "rank": rec.rank, "step": rec.step,
                "latency_s": round(max(0.0, at - rec.injected_at), 4), "time_s": round(at - self._t_train0, 4)}
        self.recoveries.append(item)
        self._emit(item)

    def _on_event(self, event) -> None:
        """Controller event log subscriber (IO thread): open and detect failure records."""
        procs = self._procs
        if procs is None or event.mesh != procs.name:
            return
        with self._lock:
            if event.kind == "fault_injected":
                kind = (event.cause or event.detail.split(" ")[0]) or "fault"
                rec = FailureRecord(kind, event.rank, self._step, event.monotonic, cause="injected")
                self._failures.append(rec)
                self._open.setdefault(event.rank, []).append(rec)
                self._recovery("failed", rec, event.monotonic)
            elif event.kind in ("proc_exited", "proc_hung"):
                recs = [r for r in self._open.get(event.rank, []) if r.detected_at is None]
                if not recs and event.kind == "proc_exited" and not self._stop.is_set() and event.rank not in self._restarting:
                    rec = FailureRecord("crash", event.rank, self._step, event.monotonic)
                    self._failures.append(rec)
                    self._open.setdefault(event.rank, []).append(rec)
                    recs = [rec]
                for rec in recs:
                    self._detect(rec, event.monotonic, event.cause or event.kind)

    def _supervise(self, failure: Any) -> bool:
        """The mesh owner's ``__supervise__``: a rank failed; take it out and restart it."""
        if self._stop.is_set():
            return True
        self._fail_rank(failure.rank, SupervisionError(failure.rank, failure.cause, failure.detail, failure.signal))
        return True

    def _detect(self, rec: FailureRecord, at: float, cause: str) -> None:
        if rec.detected_at is None:
            rec.detected_at = at
            rec.cause = cause
            self._recovery("detected", rec, at)

    def _open_for(self, rank: int) -> list[FailureRecord]:
        return [r for r in self._open.get(rank, []) if r.resumed_at is None or (r.restarted and r.rejoined_at is None)]

    # -- main -------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._setup()
            self._train()
            self._finish()
        except BaseException as exc:  # reported through report()/error, never kills the kernel
            log.debug("training run failed", exc_info=True)
            self._error = exc
        finally:
            try:
                self._teardown()
            except Exception:
                log.exception("tearing the training run down failed")
            finally:
                self._procs_ready.set()
                self._done.set()

    def _setup(self) -> None:
        from ..actor.context import this_host
        from ..runtime.controller import Controller
        from ..runtime.rendezvous import loopback_store
        from .trainer import Trainer

        o = self.options
        t0 = time.monotonic()
        self._store = loopback_store(timeout_s=o.collective_timeout_s)  # here, never in a worker
        self._procs = this_host().spawn_procs(per_host={"gpus": o.procs})
        self._procs_ready.set()
        self._unsubscribe = Controller.get().events.subscribe(self._on_event)
        supervise = getattr(self._procs, "supervise", None)
        if supervise is not None:  # this loop owns the mesh's failures: it restarts and heals ranks
            supervise("escalate", owner=self._supervise)
        args = (o.workload, o.seed, o.lr, o.global_batch, "127.0.0.1", self._store.port, o.backend,
                o.collective_timeout_s, o.chunk_bytes)
        for attempt in range(3):
            try:
                self._trainers = self._procs.spawn("trainer" if not attempt else f"trainer{attempt}", Trainer, *args)
                self._trainers.initialized.get()  # spawn returns at once; training starts from built trainers
                break
            except SupervisionError as exc:  # a proc died or looked hung while starting: restart it, retry
                if attempt == 2:
                    raise
                log.warning("starting trainers failed on rank %s (%s); restarting it", exc.rank, exc)
                self._wait_until_dead(exc.rank)
                self._procs.restart(exc.rank, timeout_s=o.restart_timeout_s)
        self._one = {r: self._trainers.slice(gpus=r) for r in range(o.procs)}
        self._backend = o.backend or _default_backend()
        self._live = list(range(o.procs))
        start_step = 0
        if o.resume and o.checkpoint_dir:
            path = _latest_checkpoint(o.checkpoint_dir)
            if path:
                steps = [self._one[r].load_checkpoint.call_one(path) for r in self._live]
                start_step = min(f.get(o.collective_timeout_s) for f in steps)
                self._committed_through = start_step - 1
        self._step = self._start_step = start_step
        self._form_epoch()
        self._setup_s = time.monotonic() - t0
        self._chaos = None
        if o.chaos_mtbf_s:
            from ..faults.chaos import ChaosSchedule

            self._chaos = ChaosSchedule(o.chaos_mtbf_s, kinds=o.chaos_kinds, seed=o.seed)

    def _train(self) -> None:
        o = self.options
        planned: dict[int, list[FaultSpec]] = {}
        for f in o.faults:
            planned.setdefault(f.step, []).append(f)
        self._t_train0 = time.monotonic()
        self._t_last_commit = self._t_train0
        if self._chaos is not None:
            self._chaos.start(self._procs)
        while self._step < o.steps and not self._stop.is_set():
            step = self._step
            for fault in planned.pop(step, []):
                self._inject(fault)
            self._heal_ready(step)
            if self._dirty:
                self._form_epoch()
            if self._attempt(step):
                self._step = step + 1
                if o.checkpoint_dir and o.checkpoint_every and self._step % o.checkpoint_every == 0:
                    self._checkpoint(step)

    def _inject(self, fault: FaultSpec) -> None:
        if fault.rank not in self._live:
            log.warning("fault %s skipped: rank %d is not live", fault, fault.rank)
            return
        if fault.phase == "collective":
            self._one[fault.rank].arm_kill_in_collective.call_one(fault.step).get(self.options.collective_timeout_s)
            with self._lock:
                rec = FailureRecord("kill", fault.rank, fault.step, time.monotonic(), cause="in collective")
                self._failures.append(rec)
                self._open.setdefault(fault.rank, []).append(rec)
                self._arm_step = fault.step
                self._recovery("failed", rec, rec.injected_at)
            return
        self._procs.inject(fault.rank, fault.kind, **fault.params)

    # -- one step ---------------------------------------------------------------------------------
    def _gather(self, futures: dict, timeout_s: float, on_error: Callable[[int, BaseException], None] | None = None):
        """Wait for every future; ``on_error(rank, exc)`` runs as soon as one fails. Returns
        ``(values, errors)`` dicts by rank; a future still pending at the deadline is a TimeoutError."""
        done: "queue.Queue[int]" = queue.Queue()
        for rank, fut in futures.items():
            fut.add_done_callback(lambda _f, r=rank: done.put(r))
        values, errors = {}, {}
        deadline = time.monotonic() + timeout_s
        while len(values) + len(errors) < len(futures):
            try:
                rank = done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                for rank in futures:
                    if rank not in values and rank not in errors:
                        errors[rank] = TimeoutError(f"rank {rank}: no reply within {timeout_s} s")
                        if on_error:
                            on_error(rank, errors[rank])
                break
            exc = futures[rank].exception(0)
            if exc is None:
                values[rank] = futures[rank].get(0)
            else:
                errors[rank] = exc
                if on_error:
                    on_error(rank, exc)
        return values, errors

    def _own_failure(self, exc: BaseException) -> bool:
        """True if ``exc`` means the rank itself failed (not a peer's failure seen from it)."""
        if isinstance(exc, ActorError):
            return exc.exception_type not in _PEER_ERRORS
        return True  # SupervisionError, TimeoutError, anything else

    def _attempt(self, step: int) -> bool:
        o = self.options
        live = sorted(self._live)
        if not live:
            self._wait_for_any_ready()
        epoch = self._epoch
        buckets = 2 if getattr(self, "_arm_step", None) == step else 1
        t0 = time.monotonic()
        futures = {r: self._one[r].step.call_one(step, epoch, live, buckets) for r in live}

        def fence_now(rank: int, exc: BaseException) -> None:
            if self._own_failure(exc):
                self._fail_rank(rank, exc)

        values, errors = self._gather(futures, o.collective_timeout_s + 5.0, fence_now)
        t1 = time.monotonic()
        if not errors and all(v["status"] == "ok" for v in values.values()):
            self._commit(step, epoch, live, values, t0, t1)
            return True
        self._attempts_failed += 1
        if not errors:  # non-finite reduced gradient: a poisoned rank; redo in the same epoch
            poisoned = [r for r, v in values.items() if v.get("local_nonfinite")]
            with self._lock:
                for r in poisoned:
                    for rec in self._open_for(r):
                        rec.disrupted = True
                        self._detect(rec, t1, "nonfinite gradient")
            self.ledger.record_attempt(step, epoch, live, f"nonfinite gradient from ranks {poisoned}")
            if self._attempts_failed > 50 * max(1, o.steps):
                raise TrainingError("gradients stay non-finite; giving up")
            return False
        failed = sorted(r for r, e in errors.items() if self._own_failure(e))
        self.ledger.record_attempt(step, epoch, live, f"failed ranks {failed}; " + "; ".join(
            f"{r}: {type(e).__name__}" for r, e in sorted(errors.items())))
        with self._lock:
            for r in failed:
                for rec in self._open_for(r):
                    rec.disrupted = True
        if not failed:  # only peer errors: the group broke without a culprit (e.g. a timeout); re-form
            log.warning("step %d: collective failed on %s without a failed rank; re-forming", step, sorted(errors))
        self._dirty = True
        return False

    def _commit(self, step: int, epoch: int, live: list[int], values: dict, t0: float, t1: float) -> None:
        o = self.options
        self._committed_through = step
        self.ledger.record(step, {r: v["samples"] for r, v in values.items()})
        self._productive_s += t1 - t0
        self._step_ms.append((t1 - t0) * 1e3)
        self._t_last_commit = t1
        first = values[live[0]]
        metric = {"type": "step", "step": step, "loss": first["loss"], "accuracy": first["accuracy"],
                  "time_s": round(t1 - self._t_train0, 4), "epoch": epoch, "live_ranks": list(live),
                  "step_ms": round((t1 - t0) * 1e3, 3), "grad_norm": max(v["grad_norm"] for v in values.values())}
        if o.eval_every and ((step + 1) % o.eval_every == 0) and step + 1 < o.steps:
            ev = self._evaluate(step)
            if ev is not None:
                metric.update(test_accuracy=ev["test_accuracy"], test_loss=ev["test_loss"])
        with self._lock:
            for r in list(self._open):
                for rec in self._open[r]:
                    if rec.disrupted and rec.detected_at is not None and rec.resumed_at is None:
                        rec.resumed_at = t1
                        self._recovery("resumed", rec, t1)
        self.metrics.append(metric)
        self._emit(metric)

    def _evaluate(self, commit_through: int) -> dict | None:
        """Test metrics from the first live rank that answers; a rank that fails here is failed."""
        for rank in sorted(self._live):
            try:
                return self._one[rank].evaluate.call_one(commit_through).get(self.options.collective_timeout_s)
            except (SupervisionError, ActorError, TimeoutError) as exc:
                self._fail_rank(rank, exc)
        return None

    def _checksums(self, commit_through: int) -> dict:
        """Parameter checksums of the live ranks (ranks that fail to answer are failed)."""
        values, errors = self._gather(
            {r: self._one[r].checksum.call_one(commit_through) for r in self._live}, self.options.collective_timeout_s)
        for rank, exc in errors.items():
            self._fail_rank(rank, exc)
        return values

    # -- membership -------------------------------------------------------------------------------
    def _fail_rank(self, rank: int, exc: BaseException | None = None) -> None:
        """Take ``rank`` out of the live set and restart it in the background (once)."""
        with self._lock:
            if rank in self._live:
                self._live.remove(rank)
                self._dirty = True
            recs = self._open_for(rank)
            if not recs and not self._stop.is_set():
                rec = FailureRecord(_kind_of(exc), rank, self._step, time.monotonic())
                self._failures.append(rec)
                self._open.setdefault(rank, []).append(rec)
                recs = [rec]
            now = time.monotonic()
            for rec in recs:
                rec.disrupted = True
                self._detect(rec, now, _cause_of(exc))
            if rank in self._restarting:
                return
            self._restarting.add(rank)
            for rec in recs:
                rec.restarted = True
        threading.Thread(target=self._restart, args=(rank,), name=f"monarch_nb-restart-{rank}", daemon=True).start()

    def _wait_until_dead(self, rank: int, timeout_s: float = 5.0) -> None:
        """A hung rank is being fenced by the controller: let its exit be seen before restarting it,
        so the fence's exit and the restart do not race."""
        from ..runtime.controller import Controller

        rec = Controller.get().proc_record(self._procs.name, rank)
        deadline = time.monotonic() + timeout_s
        while rec.state == ProcState.HUNG and time.monotonic() < deadline:
            time.sleep(0.005)

    def _restart(self, rank: int) -> None:
        o = self.options
        for attempt in range(3):
            if self._stop.is_set() and self._done.is_set():
                return
            try:
                self._wait_until_dead(rank)
                self._procs.restart(rank, timeout_s=o.restart_timeout_s)
                self._ready.put(rank)
                return
            except MeshStoppedError:
                return
            except Exception:
                log.warning("restarting rank %d failed (attempt %d)", rank, attempt + 1, exc_info=True)
        with self._lock:
            self._restarting.discard(rank)

    def _form_epoch(self) -> None:
        """Form a new membership epoch of the live ranks; retries without ranks that fail meanwhile."""
        o = self.options
        for _ in range(20):
            if not self._live:
                self._wait_for_any_ready()
            ranks = sorted(self._live)
            self._epoch += 1
            epoch = self._epoch
            aborted = threading.Event()

            def abort(rank: int, exc: BaseException) -> None:
                if self._own_failure(exc) and not aborted.is_set():
                    aborted.set()
                    self._store.set(f"epoch{epoch}/abort", "1")
                    self._fail_rank(rank, exc)

            futures = {r: self._one[r].init_epoch.call_one(epoch, ranks) for r in ranks}
            values, errors = self._gather(futures, o.collective_timeout_s + 5.0, abort)
            if not errors:
                self._dirty = False
                return
            for r, e in errors.items():
                if self._own_failure(e):
                    self._fail_rank(r, e)
            log.info("epoch %d of %s failed (%s); forming another", epoch, ranks,
                     ", ".join(f"{r}: {type(e).__name__}" for r, e in errors.items()))
        raise TrainingError("could not form a membership epoch after 20 tries")

    def _wait_for_any_ready(self) -> None:
        raise TrainingError(
            "every rank failed at once: no live replica holds the training state to heal from "
            "(use checkpoint_dir/checkpoint_every and resume=True for full-job restarts)"
        )

    def _heal_ready(self, step: int) -> None:
        """Heal every rank whose restart finished, then form an epoch that includes them."""
        joined: list[int] = []
        while True:
            try:
                rank = self._ready.get_nowait()
            except queue.Empty:
                break
            if rank in self._live:
                continue
            if not self._live:
                self._ready.put(rank)
                break
            donor = min(self._live)
            t0 = time.monotonic()
            try:
                info = self._heal(rank, donor, step - 1)
            except BaseException as exc:
                culprit = getattr(exc, "rank", None)
                with self._lock:
                    self._restarting.discard(rank)
                if culprit == donor and isinstance(exc, (SupervisionError, ActorError)):
                    self._fail_rank(donor, exc)
                    self._ready.put(rank)  # heal it from another donor at the next boundary
                    with self._lock:
                        self._restarting.add(rank)
                else:
                    log.warning("healing rank %d failed: %s; restarting it again", rank, exc)
                    self._fail_rank(rank, exc)
                continue
            with self._lock:
                self._restarting.discard(rank)
                self._live.append(rank)
                for rec in self._open.get(rank, []):
                    if rec.restarted and rec.heal_ms is None:
                        rec.heal_ms = (time.monotonic() - t0) * 1e3
                        rec.heal_bytes, rec.heal_chunks = info["nbytes"], info["chunks"]
            joined.append(rank)
        if not joined:
            return
        self._form_epoch()
        now = time.monotonic()
        sums = self._checksums(step - 1)
        identical = len({v["params_checksum"] for v in sums.values()}) <= 1
        with self._lock:
            for rank in joined:
                if rank not in self._live:
                    continue
                for rec in self._open.get(rank, []):
                    if rec.restarted and rec.rejoined_at is None:
                        rec.rejoined_at = now
                        rec.replicas_identical = identical
                        self._recovery("rejoined", rec, now)
        if not identical:
            raise TrainingError(f"replicas differ after rank(s) {joined} rejoined: {sums}")

    def _heal(self, rank: int, donor: int, commit_through: int) -> dict:
        timeout = self.options.collective_timeout_s
        manifest = self._one[donor].state_manifest.call_one(commit_through).get(timeout)
        self._one[rank].load_begin.call_one(manifest).get(timeout)
        for i in range(manifest["chunks"]):
            pieces = self._one[donor].state_chunk.call_one(i).get(timeout)
            self._one[rank].load_chunk.call_one(i, pieces).get(timeout)
        self._one[donor].state_done.call_one().get(timeout)
        result = self._one[rank].load_end.call_one().get(timeout)
        return {**result, "nbytes": manifest["nbytes"], "chunks": manifest["chunks"]}

    def _checkpoint(self, step: int) -> None:
        o = self.options
        os.makedirs(o.checkpoint_dir, exist_ok=True)
        path = os.path.join(o.checkpoint_dir, f"step{step + 1:08d}.pt")
        self._one[min(self._live)].save_checkpoint.call_one(os.path.abspath(path), step).get(o.collective_timeout_s)

    # -- the end ----------------------------------------------------------------------------------
    def _finish(self) -> None:
        o = self.options
        t_end = self._t_last_commit
        if self._chaos is not None:
            self._chaos.stop()
        # let ranks still restarting rejoin, so every replica is checked and every latency measured
        deadline = time.monotonic() + o.restart_timeout_s
        while not self._stop.is_set() and self._restarting and time.monotonic() < deadline:
            self._heal_ready(self._step)
            if self._dirty:
                self._form_epoch()
            time.sleep(0.01)
        self._heal_ready(self._step)
        if self._dirty:
            self._form_epoch()
        last = self._committed_through
        timeout = o.collective_timeout_s
        sums = self._checksums(last)
        digests = {v["params_checksum"] for v in sums.values()}
        applied = {v["applied_steps"] for v in sums.values()}
        ev = self._evaluate(last) or {"test_accuracy": None, "test_loss": None}
        mem = self._gather({r: self._one[r].memory.call_one() for r in self._live}, timeout)[0]
        if o.keep_parameters:
            self.parameters = self._gather({r: self._one[r].parameters.call_one(last) for r in self._live}, timeout)[0]
        audit = self.ledger.audit(self.order, self._step, start=self._start_step)
        wall = max(1e-9, t_end - self._t_train0)
        committed_samples = sum(len(self.ledger.consumed(s)) for s in self.ledger.entries)
        expected_applied = self._step
        steps_lost = max(abs(a - expected_applied) for a in applied) if applied else self._step
        self._step_ms.sort()
        failures = [r.to_dict() for r in self._failures]
        self._report = TrainReport(
            final_loss=self.metrics[-1]["loss"] if self.metrics else None,
            test_accuracy=ev["test_accuracy"],
            test_loss=ev["test_loss"],
            steps=len(self.ledger.entries),
            procs=o.procs,
            workload=o.workload.name,
            backend=self._backend,
            global_batch=o.global_batch,
            failures=failures,
            steps_lost=int(steps_lost + audit["steps_missing"]),
            steps_redone=self._attempts_failed,
            samples_lost=audit["samples_lost"],
            samples_repeated=audit["samples_repeated"],
            goodput=round(min(1.0, self._productive_s / wall), 4),
            wall_time_s=round(wall, 3),
            setup_time_s=round(self._setup_s, 3),
            throughput_samples_per_s=round(committed_samples / wall, 1),
            epochs=self._epoch,
            replicas_identical=len(digests) == 1,
            params_checksum=next(iter(digests)) if len(digests) == 1 else "",
            step_time_ms_median=round(self._step_ms[len(self._step_ms) // 2], 3) if self._step_ms else 0.0,
            stopped_early=self._step < o.steps,
            worker_peak_rss_bytes=[mem[r]["peak_rss_bytes"] for r in sorted(mem)],
            ledger=self.ledger.to_dict(),
        )
        if o.report_json:
            self._report.to_json(o.report_json)

    def _teardown(self) -> None:
        self._stop.set()
        if getattr(self, "_chaos", None) is not None:
            self._chaos.stop()
        unsub = getattr(self, "_unsubscribe", None)
        if unsub is not None:
            unsub()
        if self._procs is not None:
            try:
                self._procs.stop()
            except Exception:
                log.exception("stopping the training procs failed")
        self._store = None


def _default_backend() -> str:
    try:
        from .. import device

        return device.backend()
    except Exception:
        return "gloo"


def _kind_of(exc: BaseException | None) -> str:
    if isinstance(exc, SupervisionError):
        return "crash"
    if isinstance(exc, ActorError):
        return "error"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "failure"


def _cause_of(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    if isinstance(exc, SupervisionError):
        return getattr(exc, "cause", "") or "supervision"
    if isinstance(exc, ActorError):
        return f"raised {exc.exception_type}"
    return type(exc).__name__


def _latest_checkpoint(directory: str) -> str | None:
    if not os.path.isdir(directory):
        return None
    names = sorted(n for n in os.listdir(directory) if n.startswith("step") and n.endswith(".pt"))
    return os.path.abspath(os.path.join(directory, names[-1])) if names else None


def _options(
    workload: "str | Workload" = "digits",
    procs: int = 4,
    steps: int = 300,
    faults: "list[str | FaultSpec | dict] | None" = None,
    seed: int = 0,
    *,
    lr: float | None = None,
    batch_size: int | None = None,
    text: str | None = None,
    backend: str | None = None,
    chaos_mtbf_s: float | None = None,
    chaos_kinds: "tuple[str, ...]" = CHAOS_KINDS,
    eval_every: int = 50,
    collective_timeout_s: float | None = None,
    restart_timeout_s: float = 60.0,
    chunk_bytes: int = 4 << 20,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    report_json: str | None = None,
    keep_parameters: bool = False,
) -> _Options:
    from ..config import config

    for name, value in (("procs", procs), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' (RCCL on ROCm) or None for automatic, got {backend!r}")
    wl = get_workload(workload, text=text, seed=seed)
    if procs > wl.num_train:
        raise ValueError(f"{procs} procs but the {wl.name} training set has only {wl.num_train} samples; use fewer procs")
    global_batch = batch_size or wl.default_batch
    if global_batch < 1:
        raise ValueError(f"batch_size must be positive, got {global_batch}")
    if global_batch > wl.num_train:
        raise ValueError(f"batch_size {global_batch} is larger than the {wl.name} training set ({wl.num_train} samples)")
    specs = [parse_fault(f) for f in (faults or [])]
    check_faults(specs, procs, steps)
    if chaos_mtbf_s is not None and not chaos_mtbf_s > 0:
        raise ValueError(f"chaos_mtbf_s must be a positive number of seconds, got {chaos_mtbf_s!r}")
    if collective_timeout_s is None:
        collective_timeout_s = max(10.0, 4 * config.hang_timeout_s)
    return _Options(
        workload=wl, procs=procs, steps=steps, faults=specs, seed=seed, lr=lr or wl.default_lr,
        global_batch=global_batch, backend=backend, chaos_mtbf_s=chaos_mtbf_s, chaos_kinds=tuple(chaos_kinds),
        eval_every=eval_every, collective_timeout_s=collective_timeout_s, restart_timeout_s=restart_timeout_s,
        chunk_bytes=chunk_bytes, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
        report_json=report_json, keep_parameters=keep_parameters,
    )


def start(
    workload: "str | Workload" = "digits",
    procs: int = 4,
    steps: int = 300,
    faults: "list[str | FaultSpec | dict] | None" = None,
    seed: int = 0,
    **options: Any,
) -> TrainingRun:
    """Start fault-tolerant data-parallel training in a background thread; returns at once.

    Takes the same arguments as :func:`fit` (except ``progress``). Inputs are checked before any
    worker starts. Use ``run.metrics``, ``run.subscribe(cb)``, ``run.wait()``, ``run.report()``,
    ``run.stop()`` and ``run.procs`` (e.g. ``run.procs.inject(2, "kill")`` from a notebook).

    Raises:
        ValueError: unknown workload, bad fault spec, fault at a rank or step that does not
            exist, more procs than training samples, bad sizes.
        FileNotFoundError: the ``text`` file does not exist.
    """
    run = TrainingRun(_options(workload, procs, steps, faults, seed, **options))
    run._thread.start()
    return run


def fit(
    workload: "str | Workload" = "digits",
    procs: int = 4,
    steps: int = 300,
    faults: "list[str | FaultSpec | dict] | None" = None,
    seed: int = 0,
    *,
    progress: bool = True,
    **options: Any,
) -> TrainReport:
    """Train with fault tolerance on a local mesh of ``procs`` worker processes; block until done.

    Args:
        workload: "digits" (default), "charlm", or a :class:`~monarch_nb.train.workloads.Workload`
            (e.g. ``Workload.custom(model_fn, (x, y), torch.nn.functional.cross_entropy)``).
        procs: number of worker processes (data-parallel ranks).
        steps: optimizer steps to commit.
        faults: fault specs (``"kill@120:rank=2"``, see :mod:`monarch_nb.faults.spec`).
        seed: seeds the model init, the data order and the chaos schedule.
        progress: show a tqdm progress bar on stderr.
        **options: ``lr``, ``batch_size`` (global, samples per step), ``text`` (charlm file),
            ``backend`` ("gloo" / "nccl" / None = automatic), ``chaos_mtbf_s`` and
            ``chaos_kinds``, ``eval_every`` (steps, 0 = only at the end),
            ``collective_timeout_s``, ``restart_timeout_s``, ``chunk_bytes`` (heal chunk size),
            ``checkpoint_dir`` / ``checkpoint_every`` / ``resume`` (disk checkpoints for full-job
            restarts), ``report_json`` (path to write the report to), ``keep_parameters``
            (fetch every replica's final parameters into ``run.parameters``).

    Returns:
        The :class:`TrainReport` (also written as JSON to ``report_json`` if given).

    Raises:
        ValueError, FileNotFoundError: bad inputs (see :func:`start`), before any worker starts.
        TrainingError: the run could not go on (e.g. every rank failed at once).

    Example::

        report = monarch_nb.train.fit("digits", procs=4, steps=300, faults=["kill@120:rank=2"])
        print(report)
    """
    run = start(workload, procs, steps, faults, seed, **options)
    bar = None
    restore_sinks = None
    if progress:
        bar, restore_sinks = _progress(run, steps)
    try:
        while not run.wait(0.5):
            pass
    except KeyboardInterrupt:
        run.stop()
        raise
    finally:
        if bar is not None:
            bar.close()
        if restore_sinks is not None:
            restore_sinks()
    return run.report()


def _progress(run: TrainingRun, steps: int):
    """A tqdm bar fed by the run's metrics; worker output goes through ``tqdm.write``."""
    from tqdm import tqdm

    from ..runtime.controller import Controller, print_output

    bar = tqdm(total=steps, unit="step", dynamic_ncols=True, desc="train")
    failures = [0]

    def on_item(item: dict) -> None:
        if item.get("type") == "step":
            bar.update(1)
            post = {"loss": f"{item['loss']:.4f}", "live": len(item["live_ranks"]), "epoch": item["epoch"]}
            if item.get("test_accuracy") is not None:
                post["test_acc"] = f"{item['test_accuracy']:.3f}"
            if failures[0]:
                post["failures"] = failures[0]
            bar.set_postfix(post, refresh=False)
        elif item.get("type") == "recovery":
            if item["event"] == "failed":
                failures[0] += 1
            what = {
                "failed": "rank {rank} failed ({kind})",
                "detected": "rank {rank}'s {kind} detected after {latency_s:.3f} s",
                "resumed": "survivors committed the next step {latency_s:.3f} s after rank {rank}'s {kind}",
                "rejoined": "rank {rank} rejoined {latency_s:.3f} s after its {kind}",
            }.get(item["event"], "rank {rank} {event} ({kind})")
            bar.write(f"  step {item['step']}: " + what.format(**item))

    run.subscribe(on_item)
    controller = Controller.get()

    def sink(line) -> None:
        bar.write(f"[{line.rank}] {line.text}")

    if print_output in controller.output_sinks:
        controller.output_sinks[controller.output_sinks.index(print_output)] = sink

        def restore() -> None:
            if sink in controller.output_sinks:
                controller.output_sinks[controller.output_sinks.index(sink)] = print_output

        return bar, restore
    return bar, None
