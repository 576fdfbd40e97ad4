"""``monarch_nb.actor``: Monarch's ``monarch.actor`` names, so Monarch code ports by changing an import.

    from monarch_nb.actor import Actor, endpoint, this_host, Channel, Port, MeshFailure

This package is also the client-side actor model (Actor, endpoint, meshes, ValueMesh, Future,
ports, slicing); it reaches processes only through the
:class:`~monarch_nb.actor.backend.Backend` Protocol that the runtime implements and installs.

Two attributes are settings, replaced by assignment as in Monarch and read at each use:
``unhandled_fault_hook`` (called with a :class:`MeshFailure` the client's actors did not handle;
see :mod:`monarch_nb.actor.failure` for the notebook-friendly default) and
``config.prefix_python_logs_with_actor``.

May import: ``supervision``, ``transport``, ``config``, ``errors``. Never ``runtime`` or a feature.
"""

from __future__ import annotations

import types as _types

from ..errors import ActorError, SupervisionError
from .context import Context, Instance, context, current_actor_name, current_rank, current_size, this_host, this_proc
from .endpoint import Accumulator, Actor, Endpoint, as_endpoint, concurrent_endpoint, endpoint, send
from .failure import MeshFailure, default_unhandled_fault_hook
from .future import Future
from .mesh import ActorMesh, HostMesh, ProcMesh
from .ports import Channel, Port, PortReceiver, RankedPortReceiver
from .shape import Extent, Point
from .singletons import get_or_spawn_controller, shutdown_context
from .value_mesh import ValueMesh

#: Called with each MeshFailure that reached the client unhandled. Replace it by assignment.
unhandled_fault_hook = default_unhandled_fault_hook

#: Run-time switches, as Monarch's ``monarch.actor.config``.
config = _types.SimpleNamespace(prefix_python_logs_with_actor=True)

__all__ = [
    "Accumulator", "Actor", "ActorError", "ActorMesh", "Channel", "Context", "Endpoint", "Extent", "Future",
    "HostMesh", "Instance", "MeshFailure", "Point", "Port", "PortReceiver", "ProcMesh", "RankedPortReceiver",
    "SupervisionError", "ValueMesh", "as_endpoint", "concurrent_endpoint", "config", "context",
    "current_actor_name", "current_rank", "current_size", "endpoint", "get_or_spawn_controller", "send",
    "shutdown_context", "this_host", "this_proc", "unhandled_fault_hook",
]
