"""HostMesh, ProcMesh and ActorMesh: named-dim arrays of hosts, worker processes and actors.

``this_host().spawn_procs(per_host={"gpus": 4})`` starts 4 worker processes on this host and
returns their :class:`ProcMesh`; ``procs.spawn("counters", Counter, 0)`` constructs one
``Counter(0)`` in each and returns an :class:`ActorMesh`, whose endpoints are called through
adverbs (see :mod:`monarch_nb.actor.endpoint`). Meshes slice by dim (``mesh.slice(gpus=0)``) and
actor meshes can be passed to other actors, which then call them directly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Generic, Sequence, TypeVar

from ..errors import MeshStoppedError, UnknownEndpointError
from ..supervision.policy import SupervisionPolicy
from ..supervision.records import proc_identity
from . import backend
from .backend import Target
from .context import CLIENT_MESH, context
from .endpoint import Endpoint, EndpointProperty, NotAnEndpoint, check_actor_class, endpoints_of
from .failure import note_client_loop
from .future import Future
from .shape import Extent, Shape
from .workspace import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES

if TYPE_CHECKING:
    import os

    from typing_extensions import Self  # typing.Self from Python 3.11

    from .ports import Port
    from .workspace import WorkspaceSync

__all__ = ["MeshBase", "HostMesh", "ProcMesh", "ActorMesh", "proc_identity"]

#: ActorMesh's own attributes: an endpoint may not take one of these names.
_MESH_ATTRIBUTES = {"stop", "initialized", "slice", "flatten", "size", "sizes", "extent", "name", "split", "rename"}

A = TypeVar("A")


class MeshBase:
    """Dims shared by every mesh: ``extent``, ``size()``, ``sizes``, ``slice()``, ``flatten()``."""

    _shape: Shape

    @property
    def extent(self) -> Extent:
        """Named dims and their sizes, e.g. ``Extent({'gpus': 4})``."""
        return self._shape.extent

    @property
    def sizes(self) -> dict[str, int]:
        """dim -> size (a dict, as in Monarch)."""
        return dict(self._shape.extent)

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

    def slice(self, **selection: int | slice) -> Self:
        """The sub-mesh at ``selection``: an int index drops that dim, a ``slice`` keeps it.

        Raises:
            ValueError: unknown dim or index out of range (the message names the valid range).
        """
        return self._with_shape(self._shape.slice(**selection))

    def flatten(self, name: str) -> Self:
        """The same members along one dim called ``name``."""
        return self._with_shape(self._shape.flatten(name))

    def _with_shape(self, shape: Shape) -> Self:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._shape)


class HostMesh(MeshBase):
    """Hosts that can run procs. ``this_host()`` is the local one."""

    def __init__(self, hosts: list[str], shape: Shape | None = None, python: str = "") -> None:
        self._hosts = hosts
        self._shape = shape or (Shape(Extent({"hosts": len(hosts)})) if len(hosts) > 1 else Shape(Extent({})))
        self._python = python

    def _with_shape(self, shape: Shape) -> "HostMesh":
        return HostMesh(self._hosts, shape, self._python)

    @property
    def host_names(self) -> list[str]:
        """The names of this mesh's hosts (as the supervision tree shows them), in rank order."""
        return [self._hosts[r] for r in self._shape.ranks]

    @property
    def is_fake_in_process(self) -> bool:
        """False: procs of a HostMesh are real OS processes."""
        return False

    def with_python_executable(self, python_executable: str) -> "HostMesh":
        """The same hosts, whose procs start with ``python_executable`` (a wrapper script that
        execs Python works); procs spawned by those procs' actors use it too."""
        return HostMesh(self._hosts, self._shape, python_executable)

    def spawn_procs(
        self, per_host: dict[str, int] | None = None, bootstrap: Any = None, *, name: str | None = None,
        spares: int = 0, preload: Sequence[str] = (),
    ) -> "ProcMesh":
        """Start worker processes on each host, ``per_host`` giving their dims (``{"gpus": 4}``).
        Blocks until they serve (about half a second for 4 procs).

        Each proc's environment is the controller's at this call plus torchrun's variables (RANK,
        LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT of a
        rendezvous store the controller holds) and its coordinates; on a GPU host, one visible
        device each. Inside an actor the new procs are owned by that actor (stopped with it).

        Args:
            per_host: dims of the procs on each host, e.g. ``{"gpus": 4}``.
            bootstrap: not supported (Monarch's; run that code in an actor's ``__init__``).
            name: the proc mesh's name (default ``pm0``, ``pm1``, ...).
            spares: warm spare procs to keep per host. A spare has already started and imported
                ``preload``; ``restart(rank)`` hands it the rank (same rank and coordinates, new
                pid) instead of starting a new interpreter, and a new spare is started behind it.
            preload: modules every proc of the mesh needs, e.g. ``("torch",)``. On Linux the
                host agent starts a fork server that imports them once and forks the procs (and
                spares) from it: milliseconds per proc instead of seconds of ``import torch``
                each (see :mod:`monarch_nb.runtime.forkserver`); the server is kept for the next
                mesh like it. Without one (another OS, or it failed), spares import them while
                they wait.

        Raises:
            ValueError: a bad ``per_host`` (dims must be identifiers with positive int sizes) or
                a negative ``spares``.
            RuntimeError: a proc failed to start; the message holds its output.
            NotImplementedError: ``bootstrap`` (run it in an actor's constructor instead).
        """
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"spares must be an int >= 0, got {spares!r}")
        if bootstrap is not None:
            raise NotImplementedError("spawn_procs(bootstrap=...) is not supported; run that code in an actor's __init__")
        note_client_loop()
        dims = dict(per_host or {})
        if len(self._shape.extent):
            dims = {**dict(self._shape.extent), **dims}
        extent = Extent(dims)
        hosts = [self._hosts[r] for r in self._shape.ranks]
        return ProcMesh(backend.current().spawn_procs(hosts, extent, name, self._python, spares=spares,
                                                      preload=tuple(preload)), extent)

    def sync_workspace(self, workspace: "str | os.PathLike[str]" = ".", *, auto_reload: bool = False,
                       exclude: Sequence[str] | str = (), max_bytes: int = DEFAULT_MAX_BYTES, max_files: int = DEFAULT_MAX_FILES,
                       timeout_s: float = 60.0) -> "WorkspaceSync":
        """Copy a local folder's files to every host of this mesh, only those that changed
        (SHA-256 per file), through the mesh's own channel (signed; CurveZMQ between hosts), into
        a folder that is first on ``sys.path`` of every proc started there afterwards (restarts
        and warm spares included): a module next to the notebook imports on hosts that never had
        it. Syncing again replaces the copy (files gone from the folder are removed). As
        Monarch's ``HostMesh.sync_workspace``, blocking here (no ``await``); one folder per
        controller.

        Args:
            workspace: the local folder (default: the working directory, a notebook's folder).
            auto_reload: also have the serving procs there reload the modules of the workspace
                that changed (:mod:`monarch_nb.runtime.workspace_reload`); their reports are in
                the result's ``reloads``.
            exclude: more patterns not to copy, in ``.gitignore`` syntax (``"data/*.bin"``; one
                pattern or a list). ``.gitignore`` files in the folder count, and caches,
                ``.git``, virtual environments and notebook checkpoints are never copied.
            max_bytes: the most the copied files may hold together, bytes (default 64 MiB).
            max_files: the most files (default 10,000).
            timeout_s: how long to wait for every host's answer, seconds.

        Raises:
            TypeError, ValueError: a bad argument, or an unknown host (nothing was sent).
            NotADirectoryError: ``workspace`` is not a folder.
            WorkspaceTooLarge: over ``max_bytes`` or ``max_files``; names the largest files.
            WorkspaceError: a file that cannot be read or named on every host, a bad pattern.
            WorkspaceSyncError: a host is lost or refused the copy (the others were synced).
        """
        return backend.current().sync_workspace(workspace, hosts=self.host_names, exclude=exclude, max_bytes=max_bytes,
                                                max_files=max_files, auto_reload=auto_reload, timeout_s=timeout_s)

    def __repr__(self) -> str:
        return f"<HostMesh {self._hosts} {dict(self.extent)}>"


class ProcMesh(MeshBase):
    """Worker processes with named dims. ``async with`` (or ``with``) stops them on exit."""

    def __init__(self, name: str, root: Extent, shape: Shape | None = None) -> None:
        self._name = name
        self._root = root
        self._shape = shape or Shape(root)

    def _with_shape(self, shape: Shape) -> "ProcMesh":
        return ProcMesh(self._name, self._root, shape)

    @property
    def name(self) -> str:
        return self._name

    @property
    def initialized(self) -> Future[bool]:
        """A Future of True: the procs serve (``spawn_procs`` returns once they do)."""
        done: Future[bool] = Future.completed(True)
        return done

    @property
    def host_mesh(self) -> HostMesh:
        """The host of these procs (this machine)."""
        return HostMesh(["localhost"])

    def sync_workspace(self, workspace: "str | os.PathLike[str]" = ".", *, auto_reload: bool = False,
                       exclude: Sequence[str] | str = (), max_bytes: int = DEFAULT_MAX_BYTES, max_files: int = DEFAULT_MAX_FILES,
                       timeout_s: float = 60.0) -> "WorkspaceSync":
        """Copy a local folder to the hosts of these procs, as :meth:`HostMesh.sync_workspace`
        (the same arguments, result and errors); ``auto_reload`` reloads the changed modules in
        this mesh's procs (every rank, whatever the slice)."""
        return backend.current().sync_workspace(workspace, mesh=self._name, exclude=exclude, max_bytes=max_bytes,
                                                max_files=max_files, auto_reload=auto_reload, timeout_s=timeout_s)

    def spawn(self, name: str, cls: type[A], /, *args: Any, **kwargs: Any) -> "ActorMesh[A]":
        """Start constructing ``cls(*args, **kwargs)`` on every proc of this mesh; return at once.

        Calls on the returned mesh queue behind the construction. A constructor that raises
        fails that actor: its owner (the actor or client calling ``spawn``) is told with a
        MeshFailure (``__supervise__`` or ``monarch_nb.actor.unhandled_fault_hook``), and calls
        to the mesh raise SupervisionError; ``mesh.initialized.get()`` waits for construction and
        raises the constructor's ActorError. The same name may be spawned again.

        Raises:
            TypeError: ``cls`` is not an Actor subclass, or the arguments do not fit its constructor.
            ValueError: ``cls`` mixes sync and async endpoints, or an endpoint is named like an
                ActorMesh attribute (``stop``, ``slice``, ...).
            MeshStoppedError: the proc mesh was stopped.
        """
        from .endpoint import Actor

        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"spawn needs an Actor subclass, got {cls!r}")
        if not isinstance(name, str) or not name:
            raise ValueError("an actor mesh needs a non-empty name")
        check_actor_class(cls)
        clash = _MESH_ATTRIBUTES & set(endpoints_of(cls))
        if clash:
            raise ValueError(f"ActorMesh has an attribute that collides with an endpoint name: {sorted(clash)}")
        EndpointProperty(cls.__init__).check_arguments(cls.__name__, args, kwargs)
        note_client_loop()
        actor_id = backend.current().spawn_actors(self._name, list(self._shape.ranks), name, cls, args, kwargs, self._shape.extent)
        return ActorMesh(name, cls, self._name, self._root, self._shape, actor_id=actor_id)

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop every proc of this mesh: the actors' meshes' owned meshes first, then each
        actor's ``__cleanup__``, then the procs exit through normal interpreter finalization
        (module finalizers run). Returns a completed Future (``await procs.stop()`` and
        ``procs.stop().get()`` both work). Idempotent.

        Raises:
            ValueError: this is a slice (stop the mesh it came from), or the client's own proc.
        """
        if self._name == CLIENT_MESH:
            raise ValueError("the client's own proc cannot be stopped; stop the actors on it instead")
        if len(self._shape) != self._root.nelements:
            raise ValueError("ProcMesh is not owned; must be stopped by an owner (stop the mesh this slice came from)")
        try:
            backend.current().stop_procs(self._name)
        except BaseException as exc:  # noqa: BLE001 - delivered through the Future
            return Future.completed(error=exc)
        return Future.completed(None)

    async def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: float | None = None,
                             level: int = logging.INFO) -> None:
        """Set the level of the procs' root Python logger (``await procs.logging_option(level=...)``).

        Worker output always streams to the client, each line prefixed with its rank;
        ``stream_to_client`` and ``aggregate_window_sec`` are accepted for Monarch compatibility.

        Raises:
            ValueError: an aggregation window without streaming.
        """
        if aggregate_window_sec is not None and not stream_to_client:
            raise ValueError("aggregate_window_sec needs stream_to_client=True")
        backend.current().set_log_level(self._name, int(level))

    def inject(self, rank: int, kind: str, /, **params: Any) -> None:
        """Make fault ``kind`` happen on the proc at flat ``rank`` (a real SIGKILL, SIGSTOP, ...).

        Kinds and their parameters: kill, segfault, exit(code), hang, stall(seconds), raise,
        nan, slow(ms), partition(seconds) (see :data:`monarch_nb.runtime.protocol.FAULT_KINDS`).
        A ``fault_injected`` event is recorded before it acts, so detection latency can be
        measured from it.

        Raises:
            ValueError: bad kind or params, or a rank outside the mesh.
            RuntimeError: the proc is not alive (already dead, stopped or restarting).
        """
        note_client_loop()
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
    ) -> SupervisionPolicy:
        """Set how failures of this mesh's procs are handled (the whole mesh, also from a slice).

        Args:
            policy: ``"escalate"`` (default: calls to the failed rank raise ``SupervisionError``
                and the owners of its actors get a MeshFailure), ``"restart"`` (restart it in place
                after a backoff, up to ``max_restarts`` times per rank, then escalate) or
                ``"isolate"`` (continue without it).
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

    def tree(self) -> dict[str, Any]:
        """The supervision tree of this mesh's procs (this slice's) and their actors, as plain data:
        the root is the controller, then host agents, procs and actors. See
        :mod:`monarch_nb.supervision.tree` for the keys (state, pid, rank, coords, restarts,
        heartbeat_age_s, endpoint, endpoint_running_s, uptime_s, ...)."""
        return backend.current().tree(self._name, set(self._shape.ranks))

    def __enter__(self) -> "ProcMesh":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    async def __aenter__(self) -> "ProcMesh":
        if backend.current().mesh_stopped(self._name):
            raise MeshStoppedError("`ProcMesh` has already been stopped")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.stop()

    def _proc_identities(self) -> list[str]:
        return [proc_identity(self._name, r) for r in self._shape.ranks]

    def __repr__(self) -> str:
        return f"<ProcMesh {self._name} {dict(self.extent)}>"


class ActorMesh(MeshBase, Generic[A]):
    """Actors of one class, one per proc of a proc mesh (or of a slice of it).

    Attribute access gives the class's endpoints: ``mesh.incr.call(by=2)``. An unknown name raises
    :class:`~monarch_nb.errors.UnknownEndpointError` listing the endpoints there are. Picklable:
    pass it to another actor, which can then call it (and slice it).

    Attributes:
        name: the name given to ``spawn``.
    """

    def __init__(self, name: str, cls: type, proc_mesh: str, root: Extent, shape: Shape, *,
                 actor_id: str | None = None, spawn_shape: Shape | None = None) -> None:
        self._name = name
        self._id = actor_id or name
        self._cls = cls
        self._proc_mesh = proc_mesh
        self._root = root
        self._shape = shape
        self._spawn = spawn_shape or shape
        self._endpoints = endpoints_of(cls)
        self._target_list: list[Target] | None = None
        self._display = f"{cls.__module__}.{cls.__qualname__} {name}"  # for failure texts
        self._sliced = not (self._shape.ranks == self._spawn.ranks and dict(self._shape.extent) == dict(self._spawn.extent))

    def _with_shape(self, shape: Shape) -> "ActorMesh[A]":
        return ActorMesh(self._name, self._cls, self._proc_mesh, self._root, shape, actor_id=self._id, spawn_shape=self._spawn)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        prop = self._endpoints.get(attr)
        if prop is None:
            plain = getattr(self._cls, attr, None)
            if callable(plain):
                return NotAnEndpoint(self, attr, plain)
            raise UnknownEndpointError(
                f"{self._cls.__name__} has no endpoint {attr!r}; its endpoints are "
                f"{sorted(self._endpoints) or 'none'} (mark methods with @endpoint)"
            )
        return Endpoint(self, prop)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._endpoints))

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_actor_mesh, (self._name, self._cls, self._proc_mesh, self._root, self._shape, self._id, self._spawn)

    @property
    def name(self) -> str:
        return self._name

    @property
    def initialized(self) -> Future[None]:
        """A Future that completes when every actor of the mesh is constructed.

        Raises (from ``get``): ActorError if a constructor raised, SupervisionError if a proc failed,
        MeshStoppedError if the proc mesh was stopped."""
        return backend.current().actor_initialized(self._id)

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop these actors on every rank: meshes they own first, then their ``__cleanup__``.
        Later calls raise SupervisionError (the actor "was stopped"); other actor meshes on the
        same procs are not affected. Returns a completed Future. Idempotent."""
        try:
            backend.current().stop_actors(self._id)
        except BaseException as exc:  # noqa: BLE001 - delivered through the Future
            return Future.completed(error=exc)
        return Future.completed(None)

    def _targets(self) -> list[Target]:
        targets = self._target_list
        if targets is None:
            targets = self._target_list = [
                Target(proc_identity(self._proc_mesh, g), g, dict(self._root.point(g))) for g in self._shape.ranks
            ]
        return targets

    def _live_indices(self) -> list[int]:
        runtime = backend.current()
        live = [i for i, t in enumerate(self._targets()) if runtime.failure_of(t.proc) is None]
        return live or list(range(len(self._shape)))

    def _send(
        self, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, targets: list[int] | None, single: bool,
        want_reply: bool = True, stream: bool = False, port: "Port[Any] | None" = None, as_endpoint: bool = False,
    ) -> Any:
        runtime = backend.current()
        if runtime.mesh_stopped(self._proc_mesh):
            raise MeshStoppedError(
                f"Endpoint call {self._name}.{endpoint}() failed, actor mesh is stopped due to proc mesh shutdown: "
                f"`ProcMesh` {self._proc_mesh!r} has already been stopped; spawn a new one with this_host().spawn_procs(...)"
            )
        everyone = self._targets()
        chosen = everyone if targets is None else [everyone[i] for i in targets]
        message = None
        if self._sliced:
            message = (self._shape.extent, list(range(len(everyone))) if targets is None else list(targets))
        note_client_loop()
        sent = runtime.send(
            chosen, self._id, endpoint, args, kwargs, extent=None if single else self.extent, want_reply=want_reply,
            stream=stream, port=port, message_extent=message, as_endpoint=as_endpoint, display=self._display,
        )
        me = context().actor_instance
        if me.mesh_id == self._id and me._waits_on_itself is not None and sent is not None and port is None \
                and me.proc_mesh_name == self._proc_mesh and any(t.rank == me.proc_rank for t in chosen):
            for future in sent if isinstance(sent, list) else (sent,):  # a call to itself: its wait is refused
                future._waits_on_itself = me._waits_on_itself
        return sent

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name}: {self._cls.__name__} {dict(self.extent)} on {self._proc_mesh}>"


def _rebuild_actor_mesh(name: str, cls: type, proc_mesh: str, root: Extent, shape: Shape, actor_id: str,
                        spawn_shape: Shape) -> ActorMesh[Any]:
    return ActorMesh(name, cls, proc_mesh, root, shape, actor_id=actor_id, spawn_shape=spawn_shape)
