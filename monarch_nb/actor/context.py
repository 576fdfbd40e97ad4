"""Where code is running: ``context()``, ``current_rank()``, ``current_size()``,
``current_actor_name()``, ``this_host()``, ``this_proc()``.

Inside an endpoint these describe the actor that runs it and the message it handles (a context
variable, so concurrent endpoints on one actor each see their own); on the controller (the
client), the root: ``str(context().actor_instance) == "<root>"`` and ``this_proc()`` is the
client's own proc, where actors can be spawned too (they run in the client process).
"""

from __future__ import annotations

import contextvars
import os
from typing import TYPE_CHECKING, Any, Callable

from .shape import Extent, Point

if TYPE_CHECKING:
    from .mesh import HostMesh, ProcMesh

__all__ = ["Instance", "Context", "context", "current_rank", "current_size", "current_actor_name",
           "this_host", "this_proc", "CLIENT_MESH", "ActorContext"]

#: The proc mesh name of the client's own proc (actors spawned on ``this_proc()`` at the client).
CLIENT_MESH = "@client"


class Instance:
    """The running actor (``context().actor_instance``).

    Attributes:
        name: its actor mesh's name (``"root"`` on the client).
        actor_id: a unique id of this instance (differs per rank and per mesh).
        mesh_id: the actor mesh's unique id (what the runtime routes by).
        rank: its fixed Point in the mesh it was spawned on.
        class_name: ``"module.QualName"`` of its class (None on the client).
        creator: the Instance that spawned its mesh (None on the client).
        proc_mesh_name: name of the proc mesh it lives on.
        proc_rank: flat rank of its proc there.
        proc_extent: the dims of that proc mesh.
        pid: OS process id.
    """

    def __init__(self, name: str, mesh_id: str, rank: Point, class_name: str | None, creator: "Instance | None",
                 proc_mesh_name: str, proc_rank: int, proc_extent: Extent, display: str, python: str = ""):
        self.name = name
        self.mesh_id = mesh_id
        self.rank = rank
        self.class_name = class_name
        self.creator = creator
        self.proc_mesh_name = proc_mesh_name
        self.proc_rank = proc_rank
        self.proc_extent = proc_extent
        self.pid = os.getpid()
        self.python = python
        self._display = display
        self._abort: Callable[[str | None], None] | None = None  # set by the runtime: abort(reason)
        #: set by the runtime: ``waits_on_itself(awaiting)``, True if a wait for a reply now, on
        #: the calling thread (awaiting: in the calling task), holds up this actor's next message
        self._waits_on_itself: Callable[[bool], bool] | None = None

    @property
    def actor_id(self) -> str:
        return f"{self.mesh_id}[{self.rank.rank}]@{self.proc_mesh_name}.{self.proc_rank}"

    @property
    def proc_mesh(self) -> "ProcMesh":
        """The proc mesh this actor was spawned on (the client's proc on the client)."""
        from .mesh import ProcMesh

        return ProcMesh(self.proc_mesh_name, self.proc_extent)

    @property
    def proc(self) -> "ProcMesh":
        """The proc this actor runs on, as a ProcMesh of one."""
        from .mesh import ProcMesh
        from .shape import Shape

        return ProcMesh(self.proc_mesh_name, self.proc_extent, Shape(Extent({}), [self.proc_rank]))

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor now (its owner is told, with ``reason`` or "no reason provided")."""
        if self._abort is None:
            raise RuntimeError("the client cannot abort itself; raise an exception instead")
        self._abort(reason)

    def __reduce__(self) -> tuple[Any, ...]:  # travels as plain data (e.g. a creator returned from an endpoint)
        return Instance, (self.name, self.mesh_id, self.rank, self.class_name, self.creator,
                          self.proc_mesh_name, self.proc_rank, self.proc_extent, self._display, self.python)

    def __str__(self) -> str:
        return self._display

    def __repr__(self) -> str:
        return f"<Instance {self._display}>"


class Context:
    """What an endpoint knows: ``actor_instance`` and ``message_rank`` (its Point in the slice
    the message was sent to)."""

    def __init__(self, instance: Instance, message_rank: Point):
        self.actor_instance = instance
        self.message_rank = message_rank

    # names of the earlier ActorContext, kept for code written against them
    @property
    def actor_name(self) -> str:
        return self.actor_instance.mesh_id if self.actor_instance.class_name else ""

    @property
    def rank(self) -> Point:
        return self.message_rank

    @property
    def proc_rank(self) -> int:
        return self.actor_instance.proc_rank

    @property
    def pid(self) -> int:
        return self.actor_instance.pid

    @property
    def proc_extent(self) -> Extent:
        return self.actor_instance.proc_extent


ActorContext = Context  # the earlier name

_ROOT_POINT = Point({}, 0, Extent({}))
_ROOT = Context(Instance("root", "root", _ROOT_POINT, None, None, CLIENT_MESH, 0, Extent({}), "<root>"), _ROOT_POINT)
_current: contextvars.ContextVar[Context | None] = contextvars.ContextVar("monarch_nb_context", default=None)
_default = _ROOT


def _set(ctx: Context | None) -> Any:
    """Make ``ctx`` the context of this thread / task (None: the process's default). Returns a reset token."""
    return _current.set(ctx)


def _set_default(ctx: Context) -> None:
    """The context of code outside any actor in this process (a worker proc's own threads)."""
    global _default
    _default = ctx


def context() -> Context:
    """The calling actor's context (on the client: the root)."""
    return _current.get() or _default


def current_rank() -> Point:
    """The Point of the calling actor in the mesh (or slice) the current message was sent to:
    ``current_rank().rank`` is the flat rank, ``mesh.slice(**current_rank())`` selects it.
    The actor's fixed rank in the mesh it was spawned on is ``context().actor_instance.rank``."""
    return context().message_rank


def current_size() -> dict[str, int]:
    """The extent of the mesh (or slice) the current message was sent to, as dim -> size."""
    return dict(context().message_rank.extent)


def current_actor_name() -> str:
    """A name unique to the calling actor instance (differs per rank and per mesh)."""
    return context().actor_instance.actor_id


def this_host() -> "HostMesh":
    """The host this code runs on, as a HostMesh (no dims): ``this_host().spawn_procs(per_host={"gpus": 4})``.
    Inside an actor whose procs were started with ``with_python_executable``, the same executable."""
    from .mesh import HostMesh

    return HostMesh(["localhost"], python=context().actor_instance.python or os.environ.get("MONARCH_NB_PYTHON", ""))


def this_proc() -> "ProcMesh":
    """The proc that runs the calling code, as a ProcMesh of one: inside an actor its proc; on the
    client the client's own proc (actors spawned there run in the client process)."""
    return context().actor_instance.proc
