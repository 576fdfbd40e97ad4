"""Fault injection: one API used by magics, widgets, tests, training and workshops.

``inject(procs, rank, kind, **params)`` — or ``procs.inject(rank, kind, **params)`` — makes a real
failure happen on one proc of a proc mesh:

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh

__all__ = ["FAULT_KINDS", "inject", "validate", "take_nan"]

#: kind -> (parameter name -> default), the parameters each kind accepts.
FAULT_KINDS: dict[str, dict[str, Any]] = {
    "kill": {},
    "segfault": {},
    "exit": {"code": 1},
    "hang": {},
    "stall": {"seconds": 5.0},
    "raise": {},
    "nan": {},
    "slow": {"ms": 100.0},
    "partition": {"seconds": 5.0},
}

_SIGNAL_KINDS = {"kill": "SIGKILL", "hang": "SIGSTOP"}


def validate(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """Check ``kind`` and ``params``; return the params with defaults filled in.

    Raises:
        ValueError: unknown kind, unknown parameter, or a negative duration; the message lists
            what is valid.
    """
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; valid kinds: {', '.join(FAULT_KINDS)}")
    allowed = FAULT_KINDS[kind]
    unknown = set(params) - set(allowed)
    if unknown:
        accepted = ", ".join(allowed) or "no parameters"
        raise ValueError(f"fault {kind!r} takes {accepted}; got {sorted(unknown)}")
    filled = {**allowed, **params}
    for name, value in filled.items():
        if name == "code":
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"fault {kind!r}: code must be an int, got {value!r}")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"fault {kind!r}: {name} must be a non-negative number, got {value!r}")
    return filled


def inject(procs: "ProcMesh", rank: int, kind: str, **params: Any) -> None:
    """Inject fault ``kind`` into the proc at flat ``rank`` of ``procs``.

    Records a ``fault_injected`` event before acting, so detection latency can be measured from it.

    Raises:
        ValueError: bad kind or params (see :func:`validate`), or a rank outside the mesh.
        RuntimeError: the proc is not alive (already dead, stopped or restarting).
    """
    from ..runtime.controller import Controller

    params = validate(kind, params)
    controller = Controller.get()
    controller.inject_fault(procs.name, rank, kind, params, signal=_SIGNAL_KINDS.get(kind))


def take_nan() -> bool:
    """In worker code: True once per ``nan`` fault injected into this proc (then it is used up).

    Training code asks this before its all-reduce and, if True, poisons its local gradient, so
    the fault acts where a real numerical blow-up would. Outside a worker it returns False.
    """
    from ..runtime import proc

    worker = proc.current()
    return worker.faults.take_nan() if worker is not None else False
