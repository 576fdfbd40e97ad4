"""What the membership needs of a run's procs: a narrow interface, and the one over a real mesh.

:class:`~.recovery.Membership` restarts ranks and waits on their procs; it needs five things of
them (and a sixth, ``own_exit``), not the controller. :class:`RankProcs` names them; :class:`MeshProcs` gives them over a
:class:`~monarch_nb.actor.mesh.ProcMesh` and the controller's records. The unit tests give
their own (no processes), as torchft tests its Manager against a fake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..errors import SupervisionError
from ..supervision.records import ProcState

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh

__all__ = ["RankProcs", "MeshProcs"]


class RankProcs(Protocol):
    """The procs of a run's ranks, as the membership uses them (restart threads and the IO thread call it)."""

    @property
    def name(self) -> str:
        """The proc mesh's name (events of other meshes are not this run's)."""
        ...

    def restart(self, rank: int, timeout_s: float) -> None:
        """Start ``rank``'s proc again (a warm spare takes its place when there is one); block until it serves.

        Raises:
            MeshStoppedError: the mesh was stopped; AttachError: its host is lost; RuntimeError: it did not start.
        """
        ...

    def pid(self, rank: int) -> int | None:
        """The pid of ``rank``'s current incarnation (None if unknown)."""
        ...

    def state(self, rank: int) -> ProcState:
        """``rank``'s proc state as the supervision tree has it."""
        ...

    def host_serving(self, rank: int) -> bool:
        """``rank``'s host serves (not lost, or attached again)."""
        ...

    def own_exit(self, rank: int, pid: int) -> SupervisionError | None:
        """How incarnation ``pid`` of ``rank`` ended, if it died on its own (not killed by a
        restart: a death heard only after a restart of it began is not reported to the
        supervisor, and is found here); None otherwise."""
        ...


class MeshProcs:
    """:class:`RankProcs` over a real proc mesh and the controller's records.

    Args:
        procs: the run's proc mesh.
    """

    def __init__(self, procs: "ProcMesh"):
        self.procs = procs

    @property
    def name(self) -> str:
        return self.procs.name

    def restart(self, rank: int, timeout_s: float) -> None:
        self.procs.restart(rank, timeout_s=timeout_s)

    def pid(self, rank: int) -> int | None:
        from ..runtime.controller import Controller

        try:
            return Controller.get().proc_record(self.procs.name, rank).pid
        except Exception:  # the controller is shutting down
            return None

    def state(self, rank: int) -> ProcState:
        from ..runtime.controller import Controller

        return Controller.get().proc_record(self.procs.name, rank).state

    def own_exit(self, rank: int, pid: int) -> SupervisionError | None:
        from ..runtime.controller import Controller

        for event in reversed(Controller.get().events.events(kind="proc_exited")):
            if event.mesh == self.procs.name and event.rank == rank and event.pid == pid:
                signame = event.cause if event.cause.startswith("SIG") else None
                return SupervisionError(rank, event.cause, event.detail, signame)
        return None

    def host_serving(self, rank: int) -> bool:
        from ..runtime.controller import Controller

        controller = Controller.get()
        record = controller.hosts.get(controller.proc_record(self.procs.name, rank).host)
        return record is None or record.state == ProcState.HEALTHY
