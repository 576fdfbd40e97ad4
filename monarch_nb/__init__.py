"""monarch_nb: a Jupyter-native, fault-tolerant distributed training environment (PyTorch Monarch's API).

    from monarch_nb import Actor, endpoint, this_host
    from monarch_nb.actor import Actor, endpoint, this_host   # the same objects, Monarch's import path

Names load lazily, so ``import monarch_nb`` imports neither torch, IPython nor ipywidgets.
In IPython: ``%load_ext monarch_nb`` registers the ``%mesh`` / ``%%mesh`` magics.

This package's ``__init__`` is the composition root of the controller side: it tells the actor
API (which never imports the runtime) how to start the runtime when first needed.
``monarch_nb.proc_main`` is its twin inside each worker proc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._lazy import lazy_exports
from .actor import backend as _backend

__version__ = "0.1.0"


def _start_controller() -> "_backend.Backend":
    """The actor API's default backend: this process's controller, started on first use."""
    from .runtime.controller import Controller

    return Controller.get()


_backend.set_default(_start_controller)

_EXPORTS = {
    "Actor": "monarch_nb.actor.endpoint",
    "endpoint": "monarch_nb.actor.endpoint",
    "Endpoint": "monarch_nb.actor.endpoint",
    "Future": "monarch_nb.actor.future",
    "ValueMesh": "monarch_nb.actor.value_mesh",
    "Extent": "monarch_nb.actor.shape",
    "Point": "monarch_nb.actor.shape",
    "HostMesh": "monarch_nb.actor.mesh",
    "ProcMesh": "monarch_nb.actor.mesh",
    "ActorMesh": "monarch_nb.actor.mesh",
    "this_host": "monarch_nb.actor.context",
    "attach_to_workers": "monarch_nb.actor.host_attach",
    "run_worker_loop_forever": "monarch_nb.runtime.worker_loop",
    "this_proc": "monarch_nb.actor.context",
    "context": "monarch_nb.actor.context",
    "current_rank": "monarch_nb.actor.context",
    "current_size": "monarch_nb.actor.context",
    "Accumulator": "monarch_nb.actor.endpoint",
    "as_endpoint": "monarch_nb.actor.endpoint",
    "concurrent_endpoint": "monarch_nb.actor.endpoint",
    "send": "monarch_nb.actor.endpoint",
    "Channel": "monarch_nb.actor.ports",
    "Port": "monarch_nb.actor.ports",
    "PortReceiver": "monarch_nb.actor.ports",
    "MeshFailure": "monarch_nb.actor.failure",
    "current_actor_name": "monarch_nb.actor.context",
    "get_or_spawn_controller": "monarch_nb.actor.singletons",
    "shutdown_context": "monarch_nb.actor.singletons",
    "ActorError": "monarch_nb.errors",
    "SupervisionError": "monarch_nb.errors",
    "MeshStoppedError": "monarch_nb.errors",
    "UnknownEndpointError": "monarch_nb.errors",
    "configure": "monarch_nb.config",
    "Event": "monarch_nb.supervision.events",
    "WorkspaceSync": "monarch_nb.actor.workspace",
    "WorkspaceSyncError": "monarch_nb.actor.workspace",
    "WorkspaceTooLarge": "monarch_nb.runtime.workspace_files",
}

__all__ = sorted(_EXPORTS) + ["load_ipython_extension", "unload_ipython_extension"]

if TYPE_CHECKING:
    from .actor.host_attach import attach_to_workers
    from .actor.context import context, current_actor_name, current_rank, current_size, this_host, this_proc
    from .actor.endpoint import Accumulator, Actor, Endpoint, as_endpoint, concurrent_endpoint, endpoint, send
    from .actor.failure import MeshFailure
    from .actor.ports import Channel, Port, PortReceiver
    from .actor.singletons import get_or_spawn_controller, shutdown_context
    from .runtime.worker_loop import run_worker_loop_forever
    from .actor.future import Future
    from .actor.mesh import ActorMesh, HostMesh, ProcMesh
    from .actor.shape import Extent, Point
    from .actor.value_mesh import ValueMesh
    from .config import configure
    from .errors import ActorError, MeshStoppedError, SupervisionError, UnknownEndpointError
    from .supervision.events import Event
    from .actor.workspace import WorkspaceSync, WorkspaceSyncError
    from .runtime.workspace_files import WorkspaceTooLarge


__getattr__, __dir__ = lazy_exports('monarch_nb', _EXPORTS, globals())


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext monarch_nb``: register the ``%mesh`` and ``%%mesh`` magics."""
    from .jupyter.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .jupyter.magics import unload_ipython_extension as unload

    unload(ipython)
