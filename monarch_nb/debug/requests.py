"""How the controller reaches a rank's debugger: find the mesh and the rank, send a request, explain a dead rank.

The plumbing under :mod:`monarch_nb.debug.client` and :mod:`monarch_nb.debug.magic`. Requests travel
as ``debug`` messages to the procs (:mod:`monarch_nb.debug.worker`) and come back as replies of the
controller's messenger, so a rank that dies while being asked answers with a clear error.
"""

from __future__ import annotations

import linecache
import os
from typing import TYPE_CHECKING, Any

from ..errors import MonarchError, SupervisionError
from ..supervision.records import ProcState

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh
    from .client import DebugTarget
    from ..runtime.controller import Controller
    from ..supervision.records import ProcRecord

__all__ = ["DebugError", "QUICK_TIMEOUT_S", "COMMAND_TIMEOUT_S", "get_controller", "resolve_mesh", "mesh_records",
           "rank_record", "send_request", "dead_reason", "ask", "cell_sources", "short_path"]

#: Seconds a quick request (list, attach, stack) may take before the rank counts as not answering.
QUICK_TIMEOUT_S = 3.0
#: Seconds a pdb command may run before the caller gets "still running" (the command goes on).
COMMAND_TIMEOUT_S = 30.0
_MAX_SOURCE_BYTES = 8 << 20


class DebugError(MonarchError, LookupError):
    """A rank cannot be debugged as asked: unknown, dead, or nothing to debug there.

    The message says what is available instead. Attributes: ``rank`` (int or None) and
    ``available`` (the :class:`DebugTarget` list at the time).
    """

    def __init__(self, message: str, rank: int | None = None, available: list["DebugTarget"] | None = None):
        super().__init__(message)
        self.rank = rank
        self.available = list(available or [])


def get_controller() -> "Controller":
    from ..runtime.controller import Controller

    controller = Controller.existing()
    if controller is None or not controller.meshes:
        raise DebugError("nothing to debug: no proc mesh was started (%mesh start 4, or this_host().spawn_procs(...))")
    return controller


def resolve_mesh(mesh: "ProcMesh | str | None") -> str:
    controller = get_controller()
    if mesh is not None and not isinstance(mesh, str):
        mesh = mesh.name
    if mesh is not None:
        if mesh not in controller.meshes:
            raise DebugError(f"no proc mesh {mesh!r}; meshes: {sorted(controller.meshes)}")
        return mesh
    live = [name for name, record in controller.meshes.items() if not record.stopped]
    if not live:
        raise DebugError(f"nothing to debug: every proc mesh was stopped ({sorted(controller.meshes)})")
    return live[-1]


def mesh_records(mesh: str) -> list["ProcRecord"]:
    return get_controller().mesh_records(mesh)


def rank_record(mesh: str, rank: Any) -> "ProcRecord":
    found = mesh_records(mesh)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(found):
        raise DebugError(f"no rank {rank!r} in proc mesh {mesh!r} (ranks 0..{len(found) - 1})", None)
    return found[rank]


def send_request(rec: "ProcRecord", request: dict):
    """Send one debug request to ``rec``'s proc; a Future of the reply."""
    from ..runtime.protocol import Kind
    from ..transport.serialization import dumps

    body, buffers = dumps(request)
    return get_controller().send_request(rec, Kind.DEBUG, body, buffers, str(request.get("op")))


def dead_reason(rec: "ProcRecord") -> str:
    info = rec.exit_info or {}
    if rec.fenced:
        how = "fenced (killed after a hang)"
    elif info.get("signal"):
        how = f"killed by {info['signal']}"
    elif info:
        how = f"exited with code {info.get('returncode')}"
    else:
        how = rec.state
    return f"{how}; its failures died with it (restart it with procs.restart({rec.rank}))"


def ask(rec: "ProcRecord", request: dict, timeout_s: float = QUICK_TIMEOUT_S) -> dict:
    if not rec.alive or rec.state == ProcState.HUNG:
        raise DebugError(f"rank {rec.rank} is {'hung' if rec.state == ProcState.HUNG else 'dead'}: {dead_reason(rec)}", rec.rank)
    future = send_request(rec, request)
    try:
        return future.get(timeout_s)
    except SupervisionError as exc:
        raise DebugError(f"rank {rec.rank} is dead: {exc}", rec.rank) from None
    except TimeoutError:
        raise DebugError(
            f"rank {rec.rank} did not answer within {timeout_s} s (hung? try %mesh stack {rec.rank})", rec.rank
        ) from None


def cell_sources() -> dict[str, list[str]]:
    """Source text this process knows but the workers cannot read: notebook cells."""
    out: dict[str, list[str]] = {}
    total = 0
    caches = [linecache.cache, getattr(linecache, "_ipython_cache", {})]
    for cache in caches:
        for filename, entry in list(cache.items()):
            if filename in out or not isinstance(entry, tuple) or len(entry) != 4 or entry[1] is not None:
                continue
            lines = entry[2]
            if not lines or os.path.exists(filename):
                continue
            size = sum(len(x) for x in lines)
            if total + size > _MAX_SOURCE_BYTES:
                continue
            total += size
            out[filename] = list(lines)
    return out


def short_path(filename: str | None) -> str:
    if not filename:
        return "?"
    return os.path.basename(filename) or filename
