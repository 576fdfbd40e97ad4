"""The mesh that ``%mesh`` / ``%%mesh`` act on: one per kernel, started with ``%mesh start``.

A :class:`MeshSession` owns a proc mesh with a :class:`~.worker.CellExecutor` and a
:class:`~.worker.MeshProbe` on every proc, knows how to address one rank's executor, to
interrupt it, and keeps the background cells and the training run that the magics started.
:class:`MeshProcs` is the proc mesh ``%mesh start`` returns: a ``ProcMesh`` with the session's
verbs as methods (``push``, ``pull``, ``scatter``, ``gather``, ``barrier``, ``status``). Nothing
here imports IPython.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Literal, overload

from ..actor.mesh import ProcMesh
from . import values as values_mod
from .cells import CellRun
from .ranks import parse_ranks
from .routing import router_for

__all__ = ["MeshSession", "MeshProcs", "current", "set_current", "training_run", "set_training_run", "EXECUTOR_NAME",
           "PROBE_NAME", "NoMeshError"]

log = logging.getLogger(__name__)

#: the actor mesh names of the cell executors and status probes (a leading underscore: not the user's)
EXECUTOR_NAME = "_mesh_cells"
PROBE_NAME = "_mesh_probe"
#: how long ``%mesh status`` waits for a rank's figures
STATS_TIMEOUT_S = 2.0


class NoMeshError(RuntimeError):
    """A magic that needs a mesh ran before ``%mesh start``."""

    def __init__(self) -> None:
        super().__init__("no mesh is running; start one with `%mesh start 4` (4 CPU procs) or `%mesh start --gpus 8`")


class MeshSession:
    """A proc mesh with cell executors, as driven from a notebook."""

    def __init__(self, procs: Any, *, owned: bool = True, attached_hosts: list[str] | None = None) -> None:
        from ..runtime.controller import Controller

        from .worker import CellExecutor, MeshProbe

        self.controller = Controller.get()
        self.mesh_name = procs.name
        self.world_size = len(procs)
        self.procs = MeshProcs(procs.name, procs.extent, self)
        self.owned = owned
        self.attached_hosts = list(attached_hosts or [])  # hosts attached for this mesh: detached by stop()
        router_for(self.controller)
        self.executors = procs.spawn(EXECUTOR_NAME, CellExecutor)
        self.probes = procs.spawn(PROBE_NAME, MeshProbe)
        self._slices: dict[tuple[str, int], Any] = {}
        self.background: list[CellRun] = []
        self.foreground: CellRun | None = None
        self.training: Any = None
        self.dashboard: Any = None
        self.tree_widget: Any = None
        self.dist_backend: str | None = None
        self._lock = threading.Lock()

    # -- addressing ------------------------------------------------------------------------------
    def _slice(self, mesh: Any, rank: int) -> Any:
        key = (mesh.name, rank)
        sl = self._slices.get(key)
        if sl is None:
            sl = self._slices[key] = mesh.slice(**dict(self.procs.extent.point(rank)))
        return sl

    def executor_of(self, rank: int) -> Any:
        """The executor of flat ``rank`` as an actor mesh of one."""
        return self._slice(self.executors, rank)

    def ranks(self, spec: str | None) -> list[int]:
        return parse_ranks(spec, self.world_size)

    def record(self, rank: int) -> Any:
        return self.controller.proc_record(self.mesh_name, rank)

    def interrupt_rank(self, rank: int) -> None:
        """Ask rank ``rank``'s proc to interrupt the cell it runs (handled on its IO thread)."""
        self.controller.interrupt(self.mesh_name, rank, EXECUTOR_NAME)

    # -- cells -----------------------------------------------------------------------------------
    def run_cell(self, source: str, ranks: list[int], **options: Any) -> CellRun:
        run = CellRun(self, source, ranks, **options).start()
        with self._lock:
            self.background = [r for r in self.background if not r.done()]
        return run

    def add_background(self, run: CellRun) -> None:
        with self._lock:
            self.background.append(run)

    def running(self) -> list[CellRun]:
        """The cells running now: background ones and the blocking one."""
        with self._lock:
            runs = [r for r in self.background if not r.done()]
        if self.foreground is not None and not self.foreground.done():
            runs.append(self.foreground)
        return runs

    def interrupt_background(self) -> list[CellRun]:
        """Interrupt every non-blocking cell still running; return them."""
        with self._lock:
            runs = [r for r in self.background if not r.done()]
        for run in runs:
            run.interrupt()
        return runs

    def idle_check(self, ranks: list[int] | None = None) -> Callable[[], bool]:
        """Ask each selected rank to answer once its queued cells are done; return a function
        that is True when all answered and the output of their cells is shown.

        The function raises what a rank's answer raised (SupervisionError for a dead rank).
        """
        targets = list(range(self.world_size)) if ranks is None else list(ranks)
        futures = [self.executor_of(r).idle.call_one() for r in targets]
        runs = [run for run in self.running() if set(run.ranks) & set(targets)]

        def check() -> bool:
            for future in futures:
                if not future.done():
                    return False
                error = future.exception()
                if error is not None:
                    raise error
            return all(run.done() for run in runs)

        return check

    def barrier(self, ranks: list[int] | None = None, timeout_s: float | None = None) -> float:
        """Wait until every selected rank has finished the cells queued on it; return the seconds
        waited.

        Raises:
            TimeoutError: still busy after ``timeout_s``.
            SupervisionError: a selected rank is dead.
        """
        from .waiting import wait_until

        t0 = time.monotonic()
        if not wait_until(self.idle_check(ranks), timeout_s):
            raise TimeoutError(f"ranks still busy after {timeout_s} s")
        return time.monotonic() - t0

    def stats(self, timeout_s: float = STATS_TIMEOUT_S) -> dict[int, dict | None]:
        """rank -> :meth:`~.worker.MeshProbe.stats` (None for a rank that is dead or silent)."""
        futures = {}
        for rank in range(self.world_size):
            try:
                futures[rank] = self._slice(self.probes, rank).stats.call_one()
            except Exception:
                futures[rank] = None
        deadline = time.monotonic() + timeout_s
        out: dict[int, dict | None] = {}
        for rank, future in futures.items():
            try:
                out[rank] = values_mod._only(future.get(timeout=max(0.0, deadline - time.monotonic()))) if future else None
            except Exception:
                out[rank] = None
        return out

    # -- torch.distributed -----------------------------------------------------------------------
    def init_distributed(self, backend: str | None = None) -> str:
        """Initialise ``torch.distributed`` on every rank, through the proc mesh's rendezvous store
        (held by the controller, here in the kernel, at an address every host of the mesh reaches:
        the procs' ``MASTER_ADDR`` / ``MASTER_PORT``); return the backend."""
        backends = self.executors.init_distributed.call(None, None, backend).get(timeout=120)
        self.dist_backend = backends.values()[0] if hasattr(backends, "values") else str(backends)
        return self.dist_backend

    # -- lifecycle -------------------------------------------------------------------------------
    def alive(self) -> bool:
        mesh = self.controller.meshes.get(self.mesh_name)
        return mesh is not None and not mesh.stopped and not self.controller.closed

    def stop(self) -> None:
        for run in self.interrupt_background():
            run.wait(2.0)
        if self.training is not None:
            try:
                self.training.stop()
            except Exception:
                log.exception("stopping the training run failed")
        if self.owned:
            self.procs.stop()
        if self.attached_hosts:  # their worker loops wait for the next controller again
            self.controller.detach_hosts(self.attached_hosts)
            self.attached_hosts = []


class MeshProcs(ProcMesh):
    """The proc mesh of a notebook session (what ``procs = %mesh start 4`` gives): a ``ProcMesh``
    (spawn actors, inject faults, restart ranks) plus the ``%mesh`` verbs as methods.

    ``ranks`` arguments are lists of flat ranks (None: all); ``timeout_s`` is in seconds (None:
    wait as long as it takes; an interrupt stops waiting). A slice of it is a plain ``ProcMesh``.
    """

    def __init__(self, name: str, extent: Any, session: MeshSession) -> None:
        super().__init__(name, extent)
        self._session = session

    def push(self, mapping: dict | None = None, /, *, ranks: list[int] | None = None,
             timeout_s: float | None = None, **names: Any) -> list[int]:
        """Bind names in the ranks' ``%%mesh`` namespaces: ``procs.push({"lr": 0.1})`` or
        ``procs.push(lr=0.1)``; returns the ranks."""
        return values_mod.push(self._session, {**(mapping or {}), **names}, ranks, timeout_s)

    def pull(self, name: str, /, *, ranks: list[int] | None = None, timeout_s: float | None = None) -> Any:
        """``name`` from every rank as a ValueMesh (a dict rank -> value with ``ranks``)."""
        return values_mod.pull(self._session, name, ranks, timeout_s)

    def scatter(self, name: str, value: Any, /, *, ranks: list[int] | None = None, timeout_s: float | None = None) -> dict:
        """Split ``value`` (a sequence, array or tensor) along its first dimension over the ranks."""
        return values_mod.scatter(self._session, name, value, ranks, timeout_s)

    def gather(self, name: str, /, *, ranks: list[int] | None = None, timeout_s: float | None = None) -> Any:
        """``name`` from every rank, joined in rank order (``torch.cat``, ``numpy.concatenate``, ...)."""
        return values_mod.gather(self._session, name, ranks, timeout_s)

    def barrier(self, *, ranks: list[int] | None = None, timeout_s: float | None = None) -> float:
        """Wait until every rank is idle (no cell running or queued); return the seconds waited."""
        return self._session.barrier(ranks, timeout_s)

    def status(self) -> str:
        """What ``%mesh status`` prints for this mesh."""
        from .status import status_text

        return status_text(self._session)


_current: MeshSession | None = None
_training: dict[str, Any] = {}


def training_run() -> Any:
    """The training run ``%mesh train`` started in this kernel (or None)."""
    return _training.get("run")


def set_training_run(run: Any, dashboard: Any) -> None:
    _training["run"] = run
    _training["dashboard"] = dashboard
    if _current is not None:
        _current.training = run
        _current.dashboard = dashboard


@overload
def current(required: Literal[True] = True) -> MeshSession: ...
@overload
def current(required: bool) -> MeshSession | None: ...


def current(required: bool = True) -> MeshSession | None:
    """The kernel's mesh session; with ``required``, raise :class:`NoMeshError` if there is none."""
    global _current
    if _current is not None and not _current.alive():
        _current = None
    if _current is None and required:
        raise NoMeshError()
    return _current


def set_current(session: MeshSession | None) -> None:
    global _current
    _current = session
