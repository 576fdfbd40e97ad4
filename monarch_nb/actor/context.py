"""Where code is running: ``current_rank()``, ``current_size()``, ``context()``, ``this_host()``, ``this_proc()``.

Inside an endpoint these describe the actor that runs it (each actor runs on its own thread, so
they are per thread); on the controller, a mesh of one.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .shape import Extent, Point

if TYPE_CHECKING:
    from .mesh import HostMesh, ProcMesh

__all__ = ["ActorContext", "context", "current_rank", "current_size", "this_host", "this_proc"]

_local = threading.local()


@dataclass
class ActorContext:
    """What an endpoint knows about itself.

    Attributes:
        actor_name: the actor mesh's name ("" on the controller).
        rank: this actor's Point in its actor mesh.
        proc_mesh: name of the proc mesh it lives on ("" on the controller).
        proc_rank: flat rank of its proc in that proc mesh.
        pid: OS process id.
        proc_extent: the dims of its proc mesh.
    """

    actor_name: str
    rank: Point
    proc_mesh: str
    proc_rank: int
    pid: int
    proc_extent: Extent = field(default_factory=Extent)

    @property
    def actor_instance(self) -> "ActorContext":  # Monarch spells it context().actor_instance
        return self


_CONTROLLER = ActorContext("", Point({}, 0, Extent({})), "", 0, os.getpid())


def _set(ctx: ActorContext | None) -> None:
    _local.ctx = ctx


def context() -> ActorContext:
    """The calling actor's context (on the controller: a single-member context)."""
    return getattr(_local, "ctx", None) or _CONTROLLER


def current_rank() -> Point:
    """This actor's Point in its mesh: ``current_rank().rank`` is the flat rank, and
    ``mesh.slice(**current_rank())`` selects this actor."""
    return context().rank


def current_size() -> dict[str, int]:
    """The extent of the calling actor's mesh, as a dict of dim -> size."""
    return dict(context().rank.extent)


def this_host() -> "HostMesh":
    """The local host as a HostMesh (no dims): ``this_host().spawn_procs(per_host={"gpus": 4})``."""
    from .mesh import HostMesh

    return HostMesh(["localhost"])


def this_proc() -> "ProcMesh":
    """The proc that runs the calling actor, as a ProcMesh of one.

    Raises:
        RuntimeError: called on the controller (spawn procs with ``this_host().spawn_procs()``).
    """
    from .mesh import ProcMesh
    from .shape import Shape

    ctx = context()
    if not ctx.proc_mesh:
        raise RuntimeError("this_proc() is for code running in an actor; on the controller use this_host().spawn_procs()")
    return ProcMesh(ctx.proc_mesh, ctx.proc_extent, Shape(Extent({}), [ctx.proc_rank]))
