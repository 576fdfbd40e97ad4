"""The public face of training: :func:`fit` (blocking), :func:`start` (background) and :class:`TrainingRun`.

A run lives on a background thread (``monarch_nb-train``) that runs its
:class:`~monarch_nb.train.coordinator.Coordinator`; this module holds what callers see while it
runs (metrics, recovery records, the sample ledger, the phase) and the verbs they use on it
(``subscribe``, ``wait``, ``stop``, ``report``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from ..faults.spec import FaultSpec
from .checkpoints import latest_checkpoint
from .data import SampleLedger, SampleOrder
from .options import TrainOptions, make_options
from .recovery import TrainingError
from .report import FailureRecord, TrainReport
from .workloads import Workload

__all__ = ["fit", "start", "TrainingRun", "TrainingError", "latest_checkpoint"]

log = logging.getLogger(__name__)

#: seconds ``stop()`` lets the run wind down by itself before it stops the procs from the caller's thread
STOP_GRACE_S = 3.0


class TrainingRun:
    """A training run in a background thread (see :func:`start`).

    Attributes:
        options: the run's :class:`~monarch_nb.train.options.TrainOptions`.
        metrics: one dict per committed step: ``{"type": "step", "step", "loss" (training loss,
            mean per sample), "batch_accuracy" (accuracy on the step's own batch, or None),
            "time_s" (seconds since training began, when the step was committed), "quorum",
            "live_ranks", "step_ms", "grad_norm"}``, plus ``"test_accuracy"`` / ``"test_loss"``
            (on the held-out test set) on evaluation steps.
        recoveries: one dict per recovery event: ``{"type": "recovery", "event": "failed" |
            "detected" | "resumed" | "rejoined" | "restored", "kind", "rank", "step" (the step
            the run was at when it happened), "fault_step" (the step when the fault happened),
            "latency_s" (since the fault), "time_s"}``.
        ledger: the :class:`~monarch_nb.train.data.SampleLedger`.
        parameters: with ``keep_parameters=True``, ``{rank: state dict of CPU tensors}`` of every
            live replica at the end (else empty).
        phase_name: what the run does now: "spawning", "constructing", "forming quorum",
            "training", "evaluating", "checkpointing", "healing", "restoring", "finishing",
            "stopping", "done".
        mesh_name: the name of the run's proc mesh (known from the start of "spawning").

    Subscribers (:meth:`subscribe`) also receive ``{"type": "phase", "phase", "step", "time_s"}``
    when the phase changes and ``{"type": "eval", "step", "test_accuracy", "test_loss"}`` when an
    evaluation arrives.
    """

    def __init__(self, options: TrainOptions):
        from .coordinator import Coordinator

        self.options = options
        self.metrics: list[dict] = []
        self.recoveries: list[dict] = []
        self.results: dict[int, Any] = {}
        self.order: SampleOrder | None = None
        self.ledger: SampleLedger | None = None
        self.geometry_known = threading.Event()
        if options.steps:  # a built-in workload: known now; a training function's, once set up
            self.learn_geometry(options.num_samples, options.global_batch, options.steps)
        self.parameters: dict[int, dict] = {}
        self.phase_name = "starting"
        self.mesh_name = ""
        self.step = 0
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.t_train0 = time.monotonic()
        self.unsubscribe_events: Callable[[], None] | None = None
        self._subscribers: list[Callable[[dict], None]] = []
        self._done = threading.Event()
        self._procs_ready = threading.Event()
        self._procs: Any = None
        self._error: BaseException | None = None
        self._report: TrainReport | None = None
        #: why the report could not be written to ``report_json`` (the report itself is kept), or None
        self.report_json_error: OSError | None = None
        self._t0 = time.monotonic()
        self._coordinator = Coordinator(self)
        self._thread = threading.Thread(target=self._main, name="monarch_nb-train", daemon=True)

    # -- public face ------------------------------------------------------------------------------
    @property
    def procs(self):
        """The run's ProcMesh; waits until it is spawned (None if the run ended before)."""
        while not self._procs_ready.wait(0.1):
            if self._done.is_set():
                break
        return self._procs

    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``callback(dict)`` with each step metric, recovery record, phase change and
        evaluation (on the training thread; keep it short). Returns a function that unsubscribes."""
        with self.lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self.lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ends; True if it did within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called (or the run is ending)."""
        return self.stop_event.is_set()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop at the next step boundary; the report (``stopped_early``) covers the steps committed
        so far. Returns within ``timeout`` seconds, with every proc of the run stopped (if the run
        does not wind down within a few seconds, its procs are stopped from here). True if the run
        ended."""
        t0 = time.monotonic()
        self.stop_event.set()
        self._coordinator.wake()
        if self._done.wait(min(timeout, STOP_GRACE_S)):
            return True
        self._stop_procs()
        return self._done.wait(max(0.5, timeout - (time.monotonic() - t0)))

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
        if self._report is None:
            raise TrainingError("the run was stopped before any trainer was built; there is nothing to report")
        return self._report

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def live_ranks(self) -> list[int]:
        """The ranks training now: members of the current quorum that have not failed (a healed
        rank counts once the quorum it rejoined is formed)."""
        m = self._coordinator.m
        return sorted(set(m.members) & set(m.live))

    # -- for the coordinator (training thread) --------------------------------------------------------
    def learn_geometry(self, num_samples: int, global_batch: int, steps: int) -> None:
        """The run's data: ``steps`` steps of ``global_batch`` of ``num_samples`` samples (a training
        function's, from its ``ft.batches``). Builds the sample order and the ledger.

        Raises:
            ValueError: see :meth:`TrainOptions.learn_geometry`.
        """
        o = self.options
        if not self.geometry_known.is_set():
            o.learn_geometry(num_samples, global_batch, steps)
            self.order = SampleOrder(num_samples, global_batch, o.seed)
            self.ledger = SampleLedger(self.order)
            self.geometry_known.set()

    def sample_ledger(self) -> SampleLedger:
        """The ledger (training thread, once the data is known).

        Raises:
            RuntimeError: asked before :meth:`learn_geometry` (a bug in the caller).
        """
        if self.ledger is None:
            raise RuntimeError("the run's data is not known yet: no sample ledger before learn_geometry")
        return self.ledger

    def emit(self, item: dict) -> None:
        with self.lock:
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(item)
            except Exception:
                log.exception("training subscriber %r failed", fn)

    def phase(self, name: str, **detail: Any) -> None:
        """Enter phase ``name``; subscribers get ``{"type": "phase", "phase", "step", "time_s", **detail}``."""
        if name == self.phase_name:
            return
        self.phase_name = name
        self.emit({"type": "phase", "phase": name, "step": self.step, "time_s": round(time.monotonic() - self._t0, 4),
                   **detail})

    def recovery(self, event: str, rec: FailureRecord, at: float) -> None:
        item = {"type": "recovery", "event": event, "kind": rec.kind, "rank": rec.rank, "step": self.step,
                "fault_step": rec.step, "latency_s": round(max(0.0, at - rec.injected_at), 4),
                "time_s": round(at - self.t_train0, 4)}
        self.recoveries.append(item)
        self.emit(item)

    def add_recovery(self, item: dict) -> None:
        """A recovery record that is not about one failure (a restore from a snapshot)."""
        self.recoveries.append(item)
        self.emit(item)

    def add_metrics(self, metrics: list[dict]) -> None:
        self.metrics.extend(metrics)
        if self._subscribers:
            for metric in metrics:
                self.emit(metric)

    def add_eval(self, step: int, ev: dict) -> None:
        for metric in reversed(self.metrics):
            if metric["step"] == step:
                metric.update(test_accuracy=ev["test_accuracy"], test_loss=ev["test_loss"])
                break
        self.emit({"type": "eval", "step": step, "test_accuracy": ev["test_accuracy"], "test_loss": ev["test_loss"]})

    def forget_metrics_from(self, step: int) -> None:
        """Steps ``>= step`` are no longer committed (a restore from a snapshot): drop their metrics."""
        with self.lock:
            self.metrics[:] = [m for m in self.metrics if m["step"] < step]

    def procs_ready(self, procs: Any) -> None:
        self._procs = procs
        self._procs_ready.set()

    def set_report(self, report: TrainReport | None) -> None:
        self._report = report
        if report is not None and self.options.report_json:
            try:
                report.to_json(self.options.report_json)
            except OSError as exc:  # the path went bad during the run: the report stays, the error is told
                log.warning("the report could not be written to %s: %s", self.options.report_json, exc)
                self.report_json_error = exc

    # -- the thread ---------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._coordinator.run_all()
        except BaseException as exc:  # reported through report()/error, never kills the kernel
            log.debug("training run failed", exc_info=True)
            self._error = exc
        finally:
            self.stop_event.set()  # from here on, background work ends quietly
            try:
                self._teardown()
            except Exception:
                log.exception("tearing the training run down failed")
            finally:
                self.phase("done")
                self._procs_ready.set()
                self._done.set()

    def _stop_procs(self) -> None:
        from ..runtime.controller import Controller

        controller = Controller.existing()
        if controller is not None and self.mesh_name in controller.meshes:
            try:
                controller.stop_procs(self.mesh_name, timeout_s=1.0)
            except Exception:
                log.debug("stopping the training procs failed", exc_info=True)

    def _teardown(self) -> None:
        c = self._coordinator
        if c.chaos is not None:
            c.chaos.stop()
        if self.unsubscribe_events is not None:
            self.unsubscribe_events()
        self._stop_procs()
        c.m.join_threads(2.0)
        for path in _snapshot_files(c.snapshot_path):
            try:
                os.unlink(path)
            except OSError:
                pass
        c.m.store = None


def _snapshot_files(path: str) -> list[str]:
    """The published snapshot ``path``, a sharded run's slots named from it (``<n>`` and two more
    digits, see :func:`~.sharding.snapshot_slots`), and the temporary files their writers left."""
    import glob

    if not path:
        return []
    folder, name = os.path.split(path)
    prefix, _pid, n = name.rsplit("-", 2)
    return [p for pattern in (f"{prefix}-*-{n}", f"{prefix}-*-{n}[0-9][0-9]")
            for p in glob.glob(os.path.join(folder, pattern))]


def start(
    workload: "str | Workload | Callable[..., Any]" = "digits",
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
            exist, more procs than training samples, bad sizes, backend "nccl" without a GPU.
        FileNotFoundError: the ``text`` file does not exist.
        TypeError: ``hosts`` is not a HostMesh.
    """
    run = TrainingRun(make_options(workload, procs, steps, faults, seed, **options))
    run._thread.start()
    return run


def fit(
    workload: "str | Workload | Callable[..., Any]" = "digits",
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
        workload: "digits" (default), "charlm", "llama" (needs ``monarch_nb[llm]``), a :class:`~monarch_nb.train.workloads.Workload`
            (e.g. ``Workload.custom(model_fn, (x, y), torch.nn.functional.cross_entropy)``), or
            your own training function written with :mod:`monarch_nb.ft` (``ft.wrap``,
            ``ft.batches``, ``ft.step``), run on every rank with ``args=`` / ``kwargs=``; its
            ``ft.batches`` decides the steps and the global batch. Or an actor class's endpoint
            written with ``ft`` (``MyTrainer.train``): each rank makes its own
            ``MyTrainer(*actor_args, **actor_kwargs)`` and runs the endpoint with ``args=`` /
            ``kwargs=`` (a restarted rank makes a new one).
        procs: number of worker processes (data-parallel ranks); per host with ``hosts``.
        steps: optimizer steps to commit (a built-in workload's; a function's are its own).
        faults: fault specs (``"kill@120:rank=2"``, see :mod:`monarch_nb.faults.spec`).
        seed: seeds the model init, the data order and the chaos schedule.
        progress: show a tqdm progress bar on stderr.
        **options: ``lr``, ``batch_size`` (global, samples per step), ``text`` (charlm / llama file),
            ``backend`` ("gloo" / "nccl" / None = automatic), ``chaos_mtbf_s`` and
            ``chaos_kinds``, ``eval_every`` (steps, 0 = only at the end),
            ``collective_timeout_s``, ``restart_timeout_s``, ``chunk_bytes`` (heal chunk size),
            ``spares`` (warm spare procs per host that take a failed rank's place, default 1, 0
            for none), ``window_s`` (seconds of steps the ranks run between two words from the
            controller, default 0.1; at most 0.1 while a restarted rank is on its way back)
            or ``window_steps`` (a fixed number), ``pipeline`` (windows in flight, default 2; ``window_steps=1, pipeline=1`` is the per-step loop),
            ``snapshot_every`` (steps between shared-memory snapshots; None: as often as costs
            ``snapshot_budget`` = 0.5% of step time, every 20 steps in a sharded run; 0: none), ``checkpoint_dir`` /
            ``checkpoint_every`` / ``resume`` (disk checkpoints for full-job restarts),
            ``report_json`` (path to write the report to), ``keep_parameters`` (fetch every
            replica's final parameters into ``run.parameters``), ``hosts`` (a HostMesh from
            :func:`~monarch_nb.attach_to_workers` or ``job.state().trainers``: ``procs`` ranks
            on each of its hosts, numbered host by host; the run's rendezvous store listens on
            the controller's address those hosts reach; the ranks of a lost host are failed
            ranks that wait for their host to be attached again, then rejoin), ``group_size`` and
            ``parallelism`` (``"fsdp"``: FSDP2 inside replica groups of ``group_size`` ranks,
            HSDP across them, fault tolerance across groups; or a callable
            ``parallelize(model, device_mesh)``; see :mod:`monarch_nb.train.sharding`).

    Returns:
        The :class:`TrainReport` (also written as JSON to ``report_json`` if given).

    Raises:
        ValueError, FileNotFoundError, TypeError: bad inputs (see :func:`start`), before any worker starts.
        TrainingError: the run could not go on (e.g. every rank failed and nothing could be restored).
        KeyboardInterrupt: interrupted; the run was stopped first (``run.report()`` of
            :func:`start` gives the partial report).

    Example::

        report = monarch_nb.train.fit("digits", procs=4, steps=300, faults=["kill@120:rank=2"])
        print(report)
    """
    from .progress import follow

    run = start(workload, procs, steps, faults, seed, **options)
    follow(run, progress=progress)
    return run.report()
