"""Fault injection from controller code: one API for magics, widgets, tests, training and workshops.

``inject(procs, rank, kind, **params)`` — the same as ``procs.inject(rank, kind, **params)`` —
makes a real failure happen on one proc of a proc mesh:

=========  ==========================================  ====================================
kind       what happens                                params
=========  ==========================================  ====================================
kill       SIGKILL from the host agent                 —
segfault   the proc dereferences NULL (SIGSEGV)        —
exit       ``os._exit(code)`` in the proc              code (int, default 1)
hang       SIGSTOP: the proc freezes                   —
stall      a C call holds the GIL for N s              seconds (default 5)
raise      the next endpoint call raises               —
nan        the next tensor result / gradient is NaN    —
slow       every endpoint call sleeps N ms first       ms (default 100)
partition  all messages to and from it are dropped     seconds (default 5)
=========  ==========================================  ====================================

The catalogue itself is part of the process contract
(:data:`monarch_nb.runtime.protocol.FAULT_KINDS`); the in-proc half runs in
:mod:`monarch_nb.faults.worker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..runtime.protocol import FAULT_KINDS, validate_fault

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh

__all__ = ["FAULT_KINDS", "inject", "validate", "clear"]

#: Same as :func:`monarch_nb.runtime.protocol.validate_fault`.
validate = validate_fault


def inject(procs: "ProcMesh", rank: int, kind: str, **params: Any) -> None:
    """Inject fault ``kind`` into the proc at flat ``rank`` of ``procs`` (see :meth:`ProcMesh.inject`).

    Raises:
        ValueError: bad kind or params, or a rank outside the mesh.
        RuntimeError: the proc is not alive (already dead, stopped or restarting).
    """
    procs.inject(rank, kind, **params)


def clear(procs: "ProcMesh", rank: int) -> None:
    """Disarm the in-proc faults (raise, slow, nan) still pending on ``rank`` of ``procs``."""
    from ..runtime.controller import Controller

    Controller.get().clear_faults(procs.name, rank)
