"""``monarch_nb.actor``: Monarch's ``monarch.actor`` names, so Monarch code ports by changing an import.

    from monarch_nb.actor import Actor, endpoint, this_host, Channel, Port, MeshFailure

Names load on first use (``import monarch_nb`` stays fast). This package is also the client-side
actor model (Actor, endpoint, meshes, ValueMesh, Future, ports, slicing); it reaches processes
only through the :class:`~monarch_nb.actor.backend.Backend` Protocol that the runtime implements
and installs.

Two attributes are settings, replaced by assignment as in Monarch and read at each use:
``unhandled_fault_hook`` (called with a :class:`MeshFailure` the client's actors did not handle;
see :mod:`monarch_nb.actor.failure` for the notebook-friendly default) and
``config.prefix_python_logs_with_actor``.

May import: ``supervision``, ``transport``, ``config``, ``errors``. Never ``runtime`` or a feature.
"""

from __future__ import annotations

import types as _types
from typing import TYPE_CHECKING

from .._lazy import lazy_exports
# two names are also submodules: load those first, then bind the package attribute to the function
from .context import context
from .endpoint import endpoint
from .failure import default_unhandled_fault_hook

_EXPORTS = {
    **dict.fromkeys(["Accumulator", "Actor", "Endpoint", "as_endpoint", "concurrent_endpoint", "send"],
                    "monarch_nb.actor.endpoint"),
    **dict.fromkeys(["Context", "Instance", "current_actor_name", "current_rank", "current_size",
                     "this_host", "this_proc"], "monarch_nb.actor.context"),
    **dict.fromkeys(["ActorMesh", "HostMesh", "ProcMesh"], "monarch_nb.actor.mesh"),
    **dict.fromkeys(["Channel", "Port", "PortReceiver", "RankedPortReceiver"], "monarch_nb.actor.ports"),
    **dict.fromkeys(["Extent", "Point"], "monarch_nb.actor.shape"),
    **dict.fromkeys(["get_or_spawn_controller", "shutdown_context"], "monarch_nb.actor.singletons"),
    **dict.fromkeys(["ActorError", "SupervisionError"], "monarch_nb.errors"),
    "Future": "monarch_nb.actor.future",
    "attach_to_workers": "monarch_nb.actor.host_attach",
    # the facade re-exports Monarch's name for the worker loop; no actor module imports the runtime
    "run_worker_loop_forever": "monarch_nb.runtime.worker_loop",
    "MeshFailure": "monarch_nb.actor.failure",
    "ValueMesh": "monarch_nb.actor.value_mesh",
}

#: Called with each MeshFailure that reached the client unhandled. Replace it by assignment.
unhandled_fault_hook = default_unhandled_fault_hook

#: Run-time switches, as Monarch's ``monarch.actor.config``.
config = _types.SimpleNamespace(prefix_python_logs_with_actor=True)

__all__ = sorted([*_EXPORTS, "config", "context", "endpoint", "unhandled_fault_hook"])

if TYPE_CHECKING:
    from ..errors import ActorError, SupervisionError
    from .context import Context, Instance, current_actor_name, current_rank, current_size, this_host, this_proc
    from .endpoint import Accumulator, Actor, Endpoint, as_endpoint, concurrent_endpoint, send
    from .failure import MeshFailure
    from .future import Future
    from .mesh import ActorMesh, HostMesh, ProcMesh
    from .ports import Channel, Port, PortReceiver, RankedPortReceiver
    from .shape import Extent, Point
    from .singletons import get_or_spawn_controller, shutdown_context
    from .value_mesh import ValueMesh
    from .host_attach import attach_to_workers

_HOSTS = "hosts are started by worker loops (`monarch-nb worker`) and jobs (monarch_nb.job), then attach_to_workers"
#: Monarch's names with no counterpart here, and what to use instead (README's table).
_NOT_PROVIDED = {
    **dict.fromkeys(["attach", "default_bootstrap_cmd", "hosts_from_config"], _HOSTS),
    **dict.fromkeys(["enable_transport", "ChannelTransport"], 'monarch_nb.configure(transport="tcp") for TCP on one host'),
    "debug_controller": "debugging is %mesh debug (post-mortem and live pdb, stacks)",
    **dict.fromkeys(["get_meter", "span", "traced"], "Monarch's telemetry has no counterpart"),
    **dict.fromkeys(["ProcId", "Uid"], "Rust runtime identities have no counterpart"),
    "returns_future": "every adverb already returns a Future (get() or await it)",
}

__getattr__, __dir__ = lazy_exports("monarch_nb.actor", _EXPORTS, globals(), _NOT_PROVIDED)
