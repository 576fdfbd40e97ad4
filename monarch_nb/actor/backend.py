"""The narrow interface the actor API needs from a runtime, and the slot that holds the one in use.

``monarch_nb.actor`` depends on this :class:`Backend` Protocol, never on ``monarch_nb.runtime``:
the runtime implements it and installs itself (the controller when it starts, a worker proc in
its main), so the client-side actor model can be driven by a real cluster or a stand-in. With no
backend installed, :func:`current` builds the default one from the factory that the top-level
package registers (:func:`set_default`): the controller, on first use.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    import os

    from ..errors import SupervisionError
    from ..supervision.policy import SupervisionPolicy
    from .future import Future
    from .shape import Extent
    from .workspace import WorkspaceSync

__all__ = ["Target", "Backend", "install", "current", "existing", "set_default"]


@dataclass(frozen=True)
class Target:
    """One actor to reach: its proc's routing identity, its flat rank and its coordinates."""

    proc: str
    rank: int
    coords: dict[str, int]


class Backend(Protocol):
    """What an actor mesh asks of the runtime. Proc meshes are named by name, actor meshes by id."""

    def send(
        self, targets: Sequence[Target], actor: str, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any], *,
        extent: "Extent | None", want_reply: bool = True, stream: bool = False, port: Any = None,
        message_extent: "tuple[Extent, list[int]] | None" = None, as_endpoint: bool = False, display: str | None = None,
    ) -> "Future[Any] | list[Future[Any]] | None":
        """Send ``actor.endpoint(*args, **kwargs)`` to each target; a Future of the result (a
        ValueMesh over ``extent``, or one value when ``extent`` is None), a list of Futures in
        arrival order when ``stream``, None when no reply is wanted (or the replies go to
        ``port``). ``message_extent``: the slice's extent and the targets' indices in it, when the
        targets are a slice of the mesh the actors were spawned on (their ``current_rank()``).
        ``display``: how failure texts name the actor mesh. Raises SerializationError if an
        argument cannot be pickled."""

    def failure_of(self, proc: str) -> "SupervisionError | None":
        """The failure of proc ``proc`` as callers see it, or None while it serves."""

    def mesh_stopped(self, mesh: str) -> bool:
        """True once proc mesh ``mesh`` was stopped."""

    def spawn_procs(
        self, hosts: list[str], extent: "Extent", name: str | None, python: str = "", *, spares: int = 0,
        preload: Sequence[str] = (),
    ) -> str:
        """Start ``extent.nelements`` procs over ``hosts`` (with interpreter ``python``, "" for this
        one; and ``spares`` warm spares per host that imported ``preload``); return the new proc
        mesh's name. Blocks until they serve."""

    def sync_workspace(self, path: "str | os.PathLike[str]", *, hosts: Sequence[str] = (), mesh: str | None = None,
                       exclude: Sequence[str] | str | None = (),
                       max_bytes: int = ..., auto_reload: bool = False, timeout_s: float = 60.0,
                       max_files: int = ...) -> "WorkspaceSync":
        """Copy folder ``path`` to ``hosts`` (or proc mesh ``mesh``'s hosts), only what changed;
        with ``auto_reload``, procs there reload their changed modules (see HostMesh.sync_workspace)."""

    def attach_hosts(self, workers: list[str], ca: str | None) -> list[str]:
        """Attach the worker loops at ``workers``; return their host names."""

    def detach_hosts(self, names: list[str]) -> None:
        """Forget attached hosts (their job ended): their agents are told to stop, no re-attach.
        ``names``: host names, or their workers' addresses (``tcp://HOST:PORT``)."""

    def spawn_actors(
        self, mesh: str, ranks: list[int], name: str, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], spawn_extent: "Extent"
    ) -> str:
        """Start constructing ``cls(*args, **kwargs)`` on proc ranks ``ranks`` of ``mesh`` (laid
        out over ``spawn_extent``) and return the new actor mesh's id at once; the caller owns it.
        A constructor that raises fails the actor (a MeshFailure to the owner).
        Raises MeshStoppedError if the proc mesh was stopped."""

    def actor_initialized(self, actor_id: str) -> "Future[None]":
        """A Future that completes when every rank of actor mesh ``actor_id`` is constructed
        (ActorError if a constructor raised, SupervisionError if a proc failed)."""

    def stop_actors(self, actor_id: str) -> None:
        """Stop actor mesh ``actor_id`` on every rank (meshes its actors own first, then their
        ``__cleanup__``); later calls to it raise SupervisionError. Idempotent."""

    def stop_procs(self, mesh: str) -> None:
        """Stop every proc of ``mesh`` (idempotent), running their actors' ``__cleanup__`` and the
        procs' interpreter finalizers."""

    def get_or_spawn_controller(self, name: str, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> "Future[Any]":
        """A Future of the one actor mesh called ``name`` on the client's proc (spawned on first use)."""

    def set_log_level(self, mesh: str, level: int) -> None:
        """Set the level of the root Python logger on every proc of ``mesh``."""

    def open_port(self, receiver: Any) -> tuple[str, str]:
        """Register ``receiver`` (a PortReceiver) here; return (owner identity, port id)."""

    def send_to_port(self, owner: str, port_id: str, ok: bool, value: Any, rank: "int | None") -> None:
        """Deliver ``value`` (an exception when not ``ok``) to port ``port_id`` of process ``owner``."""

    def restart_proc(self, mesh: str, rank: int, timeout_s: float) -> None:
        """Restart rank ``rank`` of ``mesh`` in place; block until it serves again."""

    def supervise(self, mesh: str, policy: "SupervisionPolicy") -> "SupervisionPolicy":
        """Make ``policy`` the supervision policy of ``mesh``."""

    def tree(self, mesh: str | None, ranks: "set[int] | None") -> dict[str, Any]:
        """The supervision tree as plain data (see :mod:`monarch_nb.supervision.tree`)."""

    def inject(self, mesh: str, rank: int, kind: str, params: dict[str, Any]) -> Any:
        """Make fault ``kind`` happen on rank ``rank`` of ``mesh``."""

    def interrupt(self, mesh: str, rank: int, actor: str) -> None:
        """Interrupt the endpoint that actor ``actor`` runs on rank ``rank`` of ``mesh``."""

    def shutdown(self) -> None:
        """Stop every mesh this process started and release the runtime."""


_current: Backend | None = None
_default: Callable[[], Backend] | None = None
_lock = threading.Lock()


def install(backend: Backend | None) -> None:
    """Make ``backend`` the one the actor API uses in this process (None: none)."""
    global _current
    _current = backend


def set_default(factory: Callable[[], Backend]) -> None:
    """Register how to build the backend when none is installed (the controller, on first use)."""
    global _default
    _default = factory


def existing() -> Backend | None:
    """The installed backend, or None (nothing is started)."""
    return _current


def current() -> Backend:
    """The installed backend; builds the default one if none is.

    Raises:
        RuntimeError: none is installed and no default is registered.
    """
    backend = _current
    if backend is not None:
        return backend
    with _lock:
        if _current is None:
            if _default is None:
                raise RuntimeError("no monarch_nb runtime is installed (import monarch_nb first)")
            install(_default())
        assert _current is not None
        return _current
