"""The mesh that ``%mesh`` / ``%%mesh`` act on: one per kernel, started with ``%mesh start``.

A :class:`MeshSession` owns a proc mesh and a :class:`~.worker.CellExecutor` on every proc,
knows how to address one rank's executor, to interrupt it, and keeps the background cells and
the training run that the magics started. Nothing here imports IPython.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .cells import CellRun, parse_ranks, router_for

__all__ = ["MeshSession", "current", "EXECUTOR_NAME", "NoMeshError"]

log = logging.getLogger(__name__)

#: the actor mesh name of the cell executors (a leading underscore: not the user's)
EXECUTOR_NAME = "_mesh_cells"


class NoMeshError(RuntimeError):
    """A magic that needs a mesh ran before ``%mesh start``."""

    def __init__(self) -> None:
        super().__init__("no mesh is running; start one with `%mesh start 4` (4 CPU procs) or `%mesh start --gpus 8`")


class MeshSession:
    """A proc mesh with cell executors, as driven from a notebook."""

    def __init__(self, procs: Any, *, owned: bool = True) -> None:
        from ..runtime.controller import Controller

        from .worker import CellExecutor

        self.procs = procs
        self.owned = owned
        self.controller = Controller.get()
        self.mesh_name = procs.name
        self.world_size = len(procs)
        router_for(self.controller)
        self.executors = procs.spawn(EXECUTOR_NAME, CellExecutor)
        self._slices: dict[int, Any] = {}
        self.background: list[CellRun] = []
        self.training: Any = None
        self.dashboard: Any = None
        self.tree_widget: Any = None
        self.store: Any = None
        self.dist_backend: str | None = None
        self._lock = threading.Lock()

    # -- addressing ------------------------------------------------------------------------------
    def executor_of(self, rank: int) -> Any:
        """The executor of flat ``rank`` as an actor mesh of one."""
        sl = self._slices.get(rank)
        if sl is None:
            point = self.procs.extent.point(rank)
            sl = self._slices[rank] = self.executors.slice(**dict(point))
        return sl

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

    def interrupt_background(self) -> list[CellRun]:
        """Interrupt every non-blocking cell still running; return them."""
        with self._lock:
            runs = [r for r in self.background if not r.done()]
        for run in runs:
            run.interrupt()
        return runs

    # -- torch.distributed -----------------------------------------------------------------------
    def init_distributed(self, backend: str | None = None) -> str:
        """Initialise ``torch.distributed`` on every rank; the TCPStore lives here, in the kernel."""
        from ..runtime.rendezvous import loopback_store

        if self.store is None:
            self.store = loopback_store(self.world_size)
        backends = self.executors.init_distributed.call("127.0.0.1", self.store.port, backend).get(timeout=120)
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
        for widget in (self.tree_widget, self.dashboard):
            if widget is not None:
                try:
                    widget.close()
                except Exception:
                    pass
        if self.owned:
            self.procs.stop()
        self.store = None


_current: MeshSession | None = None


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
