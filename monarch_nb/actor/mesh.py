"""HostMesh, ProcMesh and ActorMesh: named-dim arrays of hosts, worker processes and actors.

``this_host().spawn_procs(per_host={"gpus": 4})`` starts 4 worker processes on this host and
returns their :class:`ProcMesh`; ``procs.spawn("counters", Counter, 0)`` constructs one
``Counter(0)`` in each and returns an :class:`ActorMesh`, whose endpoints are called through
adverbs (see :mod:`monarch_nb.actor.endpoint`). Meshes slice by dim (``mesh.slice(gpus=0)``) and
actor meshes can be passed to other actors, which then call them directly.
"""

from __future__ import annotations

from typing import Any, Generic, Sequence, TypeVar

from ..errors import MeshStoppedError, UnknownEndpointError
from ..supervision.policy import SupervisionPolicy
from ..supervision.records import proc_identity
from . import backend
from .backend import Target
from .endpoint import Endpoint, EndpointProperty, endpoints_of
from .future import Future
from .shape import Extent, Shape

__all__ = ["MeshBase", "HostMesh", "ProcMesh", "ActorMesh", "proc_identity"]

A = TypeVar("A")


class MeshBase:
    """Dims shared by every mesh: ``extent``, ``size()``, ``sizes``, ``slice()``, ``flatten()``."""

    _shape: Shape

    @property
    def extent(self) -> Extent:
        """Named dims and their sizes, e.g. ``Extent({'gpus': 4})``."""
        return self._shape.extent

    @property
    def sizes(self) -> list[int]:
        return self._shape.extent.sizes

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """Number of members, over all dims or over ``dim`` (a name or several).

        Raises:
            KeyError: an unknown dim.
        """
        if dim is None:
            return len(self._shape)
        dims = [dim] if isinstance(dim, str) else list(dim)
        total = 1
        for name in dims:
            if name not in self.extent:
                raise KeyError(f"unknown dim {name!r}; this mesh has dims {self.extent.labels}")
            total *= self.extent[name]
        return total

    def slice(self, **selection: int | slice):
        """The sub-mesh at ``selection``: an int index drops that dim, a ``slice`` keeps it.

        Raises:
            ValueError: unknown dim or index out of range (the message names the valid range).
        """
        return self._with_shape(self._shape.slice(**selection))

    def flatten(self, name: str):
        """The same members along one dim called ``name``."""
        return self._with_shape(self._shape.flatten(name))

    def _with_shape(self, shape: Shape):
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._shape)


class HostMesh(MeshBase):
    """Hosts that can run procs. ``this_host()`` is the local one."""

    def __init__(self, hosts: list[str], shape: Shape | None = None):
        self._hosts = hosts
        self._shape = shape or (Shape(Extent({"hosts": len(hosts)})) if len(hosts) > 1 else Shape(Extent({})))

    def _with_shape(self, shape: Shape) -> "HostMesh":
        return HostMesh(self._hosts, shape)

    @property
    def host_names(self) -> list[str]:
        """The names of this mesh's hosts (as the supervision tree shows them), in rank order."""
        return [self._hosts[r] for r in self._shape.ranks]

    def spawn_procs(
        self, per_host: dict[str, int] | None = None, *, name: str | None = None, spares: int = 0,
        preload: Sequence[str] = (),
    ) -> "ProcMesh":
        """Start worker processes on each host, ``per_host`` giving their dims (``{"gpus": 4}``).

        Each proc's environment is the controller's at this call plus torchrun's variables (RANK,
        LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT of a
        rendezvous store the controller holds) and its coordinates; on a GPU host, one visible
        device each.

        Args:
            per_host: dims of the procs on each host, e.g. ``{"gpus": 4}``.
            name: the proc mesh's name (default ``pm0``, ``pm1``, ...).
            spares: warm spare procs to keep per host. A spare has already started and imported
                ``preload``; ``restart(rank)`` hands it the rank (same rank and coordinates, new
                pid) instead of starting a new interpreter, and a new spare is started behind it.
            preload: modules a spare imports while it waits, e.g. ``("torch",)``.

        Raises:
            ValueError: a bad ``per_host`` (dims must be identifiers with positive int sizes) or
                a negative ``spares``.
            RuntimeError: a proc failed to start; the message holds its output.
        """
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"spares must be an int >= 0, got {spares!r}")
        dims = dict(per_host or {})
        if len(self._shape.extent):
            dims = {**dict(self._shape.extent), **dims}
        extent = Extent(dims)
        hosts = [self._hosts[r] for r in self._shape.ranks]
        return ProcMesh(backend.current().spawn_procs(hosts, extent, name, spares=spares, preload=tuple(preload)), extent)

    def __repr__(self) -> str:
        return f"<HostMesh {self._hosts} {dict(self.extent)}>"


class ProcMesh(MeshBase):
    """Worker processes with named dims. Use as a context manager to stop them on exit."""

    def __init__(self, name: str, root: Extent, shape: Shape | None = None):
        self._name = name
        self._root = root
        self._shape = shape or Shape(root)

    def _with_shape(self, shape: Shape) -> "ProcMesh":
        return ProcMesh(self._name, self._root, shape)

    @property
    def name(self) -> str:
        return self._name

    def spawn(self, name: str, cls: type[A], *args: Any, **kwargs: Any) -> "ActorMesh[A]":
        """Construct ``cls(*args, **kwargs)`` on every proc of this mesh; block until all are built.

        Raises:
            TypeError: ``cls`` is not an Actor subclass, or the arguments do not fit its constructor.
            ValueError: an actor mesh called ``name`` already lives on these procs.
            ActorError: a constructor raised on some rank.
            MeshStoppedError: the proc mesh was stopped.
        """
        from .endpoint import Actor

        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"spawn needs an Actor subclass, got {cls!r}")
        if not isinstance(name, str) or not name:
            raise ValueError("an actor mesh needs a non-empty name")
        EndpointProperty(cls.__init__).check_arguments(cls.__name__, args, kwargs)
        ranks = list(self._shape.ranks)
        backend.current().spawn_actors(self._name, ranks, name, cls, args, kwargs)
        return ActorMesh(name, cls, self._name, self._root, self._shape)

    def stop(self) -> None:
        """Stop every proc of this mesh (its actors' ``__cleanup__`` runs first). Idempotent."""
        backend.current().stop_procs(self._name)

    def inject(self, rank: int, kind: str, **params: Any) -> None:
        """Make fault ``kind`` happen on the proc at flat ``rank`` (a real SIGKILL, SIGSTOP, ...).

        Kinds and their parameters: kill, segfault, exit(code), hang, stall(seconds), raise,
        nan, slow(ms), partition(seconds) (see :data:`monarch_nb.runtime.protocol.FAULT_KINDS`).
        A ``fault_injected`` event is recorded before it acts, so detection latency can be
        measured from it.

        Raises:
            ValueError: bad kind or params, or a rank outside the mesh.
            RuntimeError: the proc is not alive (already dead, stopped or restarting).
        """
        backend.current().inject(self._name, rank, kind, params)

    def restart(self, rank: int, timeout_s: float = 30.0) -> None:
        """Restart the proc at flat ``rank`` in place (same rank and coordinates, new pid) and
        respawn its actors with their constructor arguments; blocks until it serves again.

        Raises:
            MeshStoppedError: the mesh was stopped.
            TimeoutError: it did not come back within ``timeout_s`` seconds.
            RuntimeError: it came back but an actor constructor failed, or it died while restarting.
        """
        backend.current().restart_proc(self._name, rank, timeout_s)

    def supervise(
        self, policy: str = "escalate", *, max_restarts: int = 3, backoff_s: float = 0.5,
        backoff_max_s: float = 30.0, owner: Any = None,
    ):
        """Set how failures of this mesh's procs are handled (the whole mesh, also from a slice).

        Args:
            policy: ``"escalate"`` (default: calls to the failed rank raise ``SupervisionError``),
                ``"restart"`` (restart it in place after a backoff, up to ``max_restarts`` times per
                rank, then escalate) or ``"isolate"`` (continue without it).
            max_restarts: automatic restarts allowed per rank.
            backoff_s: seconds before a rank's first automatic restart; doubles each time.
            backoff_max_s: cap of the backoff, seconds.
            owner: an object whose ``__supervise__(failure) -> bool`` is asked first (or a callable);
                True means handled. It runs on the supervisor thread and may call ``restart``.

        Returns:
            The :class:`~monarch_nb.supervision.policy.SupervisionPolicy` now in force.

        Raises:
            ValueError: an unknown policy or a negative number.
            TypeError: ``owner`` has no ``__supervise__`` and is not callable.
            MeshStoppedError: the mesh was stopped.

        See :mod:`monarch_nb.supervision.policy` for the semantics.
        """
        chosen = SupervisionPolicy(policy, max_restarts, backoff_s, backoff_max_s, owner)
        return backend.current().supervise(self._name, chosen)

    def tree(self) -> dict:
        """The supervision tree of this mesh's procs (this slice's) and their actors, as plain data:
        the root is the controller, then host agents, procs and actors. See
        :mod:`monarch_nb.supervision.tree` for the keys (state, pid, rank, coords, restarts,
        heartbeat_age_s, endpoint, endpoint_running_s, uptime_s, ...)."""
        return backend.current().tree(self._name, set(self._shape.ranks))

    def __enter__(self) -> "ProcMesh":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _proc_identities(self) -> list[str]:
        return [proc_identity(self._name, r) for r in self._shape.ranks]

    def __repr__(self) -> str:
        return f"<ProcMesh {self._name} {dict(self.extent)}>"


class ActorMesh(MeshBase, Generic[A]):
    """Actors of one class, one per proc of a proc mesh (or of a slice of it).

    Attribute access gives the class's endpoints: ``mesh.incr.call(by=2)``. An unknown name raises
    :class:`~monarch_nb.errors.UnknownEndpointError` listing the endpoints there are.
    """

    def __init__(self, name: str, cls: type, proc_mesh: str, root: Extent, shape: Shape):
        self._name = name
        self._cls = cls
        self._proc_mesh = proc_mesh
        self._root = root
        self._shape = shape
        self._endpoints = endpoints_of(cls)

    def _with_shape(self, shape: Shape) -> "ActorMesh[A]":
        return ActorMesh(self._name, self._cls, self._proc_mesh, self._root, shape)

    def __getattr__(self, attr: str) -> Endpoint:
        if attr.startswith("_"):
            raise AttributeError(attr)
        prop = self._endpoints.get(attr)
        if prop is None:
            raise UnknownEndpointError(
                f"{self._cls.__name__} has no endpoint {attr!r}; its endpoints are "
                f"{sorted(self._endpoints) or 'none'} (mark methods with @endpoint)"
            )
        return Endpoint(self, prop)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._endpoints))

    def __reduce__(self):
        return ActorMesh, (self._name, self._cls, self._proc_mesh, self._root, self._shape)

    @property
    def name(self) -> str:
        return self._name

    def _targets(self) -> list[Target]:
        return [
            Target(proc_identity(self._proc_mesh, g), g, dict(self._root.point(g))) for g in self._shape.ranks
        ]

    def _live_indices(self) -> list[int]:
        runtime = backend.current()
        live = [i for i, t in enumerate(self._targets()) if runtime.failure_of(t.proc) is None]
        return live or list(range(len(self._shape)))

    def _send(
        self, endpoint: str, args: tuple, kwargs: dict, *, targets: list[int] | None, single: bool, want_reply: bool = True
    ) -> Future | None:
        runtime = backend.current()
        if runtime.mesh_stopped(self._proc_mesh):
            raise MeshStoppedError(
                f"proc mesh {self._proc_mesh!r} was stopped; spawn a new one with this_host().spawn_procs(...)"
            )
        everyone = self._targets()
        chosen = everyone if targets is None else [everyone[i] for i in targets]
        return runtime.send(
            chosen, self._name, endpoint, args, kwargs, extent=None if single else self.extent, want_reply=want_reply
        )

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name}: {self._cls.__name__} {dict(self.extent)} on {self._proc_mesh}>"
