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
    from ..errors import SupervisionError
    from ..supervision.policy import SupervisionPolicy
    from .future import Future
    from .shape import Extent

__all__ = ["Target", "Backend", "install", "current", "existing", "set_default"]


@dataclass(frozen=True)
class Target:
    """One actor to reach: its proc's routing identity, its flat rank and its coordinates."""

    proc: str
    rank: int
    coords: dict


class Backend(Protocol):
    """What an actor mesh asks of the runtime. Mesh operations name proc meshes by name."""

    def send(
        self, targets: Sequence[Target], actor: str, endpoint: str, args: tuple, kwargs: dict, *,
        extent: "Extent | None", want_reply: bool = True,
    ) -> "Future | None":
        """Send ``actor.endpoint(*args, **kwargs)`` to each target; a Future of the result
        (a ValueMesh over ``extent``, or one value when ``extent`` is None), None when no reply
        is wanted. Raises SerializationError if an argument cannot be pickled."""

    def failure_of(self, proc: str) -> "SupervisionError | None":
        """The failure of proc ``proc`` as callers see it, or None while it serves."""

    def mesh_stopped(self, mesh: str) -> bool:
        """True once proc mesh ``mesh`` was stopped."""

    def spawn_procs(
        self, hosts: list[str], extent: "Extent", name: str | None, *, spares: int = 0, preload: Sequence[str] = ()
    ) -> str:
        """Start ``extent.nelements`` procs over ``hosts`` (and ``spares`` warm spares per host that
        imported ``preload``); return the new proc mesh's name."""

    def attach_hosts(self, workers: list[str], ca: str | None) -> list[str]:
        """Attach the worker loops at ``workers``; return their host names."""

    def spawn_actors(
        self, mesh: str, ranks: list[int], name: str, cls: type, args: tuple, kwargs: dict
    ) -> None:
        """Construct ``cls(*args, **kwargs)`` on proc ranks ``ranks`` of ``mesh``; block until built."""

    def stop_procs(self, mesh: str) -> None:
        """Stop every proc of ``mesh`` (idempotent)."""

    def restart_proc(self, mesh: str, rank: int, timeout_s: float) -> None:
        """Restart rank ``rank`` of ``mesh`` in place; block until it serves again."""

    def supervise(self, mesh: str, policy: "SupervisionPolicy") -> "SupervisionPolicy":
        """Make ``policy`` the supervision policy of ``mesh``."""

    def tree(self, mesh: str | None, ranks: "set[int] | None") -> dict:
        """The supervision tree as plain data (see :mod:`monarch_nb.supervision.tree`)."""

    def inject(self, mesh: str, rank: int, kind: str, params: dict) -> Any:
        """Make fault ``kind`` happen on rank ``rank`` of ``mesh``."""

    def interrupt(self, mesh: str, rank: int, actor: str) -> None:
        """Interrupt the endpoint that actor ``actor`` runs on rank ``rank`` of ``mesh``."""


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
