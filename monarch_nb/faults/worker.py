"""Worker side of fault injection: the faults that act inside a proc's own code path. Runs in each proc.

Installed into every proc as a plugin (:func:`install`): it handles ``fault`` messages and hooks
every endpoint call. kill and hang are signals sent by the host agent and never reach here;
segfault dereferences NULL, exit calls ``os._exit``, stall holds the GIL in a C call, partition
mutes the proc's socket, and raise, slow and nan change the next calls.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ..device import loaded_torch
from ..runtime.protocol import FaultFiredHeader, FaultHeader, Kind

if TYPE_CHECKING:
    from ..runtime.proc import Proc

__all__ = ["ProcFaults", "install", "take_nan"]

_current: "ProcFaults | None" = None


class ProcFaults:
    """The in-proc faults armed on one proc; a call hook of that proc while a raise, slow or nan
    fault is armed (:meth:`rehook`: with none, a call runs no hook, which a proc of a large mesh
    pays on every message)."""

    def __init__(self, proc: "Proc"):
        self.proc = proc
        self.raise_next = 0
        self.slow_ms = 0.0
        self.slow_reported = True
        self.nan_next = 0
        self._hook_lock = threading.Lock()

    def rehook(self) -> None:
        """Hook the proc's endpoint calls while a fault that acts on them is armed, else unhook
        (after every change of ``raise_next``, ``slow_ms`` or ``nan_next``, on any thread: the state
        is read under the lock, so the last change's call decides)."""
        with self._hook_lock:
            if self.raise_next or self.slow_ms or self.nan_next:
                self.proc.add_call_hook(self)
            else:
                self.proc.remove_call_hook(self)

    def fired(self, kind: str, detail: str) -> None:
        """Tell the controller an injected fault took effect (a ``fault_fired`` event)."""
        header: FaultFiredHeader = {"kind": Kind.FAULT_FIRED, "fault": kind, "detail": detail}
        self.proc.send_to_controller(header)

    def on_message(self, header: FaultHeader, body: Any, buffers: list[memoryview]) -> None:
        """A ``fault`` message (IO thread)."""
        self.apply(header["fault"], header.get("params", {}))

    def apply(self, kind: str, params: dict) -> None:
        if kind == "raise":
            self.raise_next += 1
        elif kind == "slow":
            self.slow_ms = float(params.get("ms", 100.0))
            self.slow_reported = False
        elif kind == "nan":
            self.nan_next += 1
        elif kind == "partition":
            self.proc.channel.muted_until = time.monotonic() + float(params.get("seconds", 5.0))
        elif kind == "stall":
            _hold_gil(float(params.get("seconds", 5.0)))
        elif kind == "exit":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(params.get("code", 1)))
        elif kind == "segfault":
            ctypes.string_at(0)
        elif kind == "clear":  # disarm every pending in-proc fault (faults.inject.clear)
            self.raise_next = self.nan_next = 0
            self.slow_ms = 0.0
        self.rehook()

    def before_call(self, actor: str, endpoint: str) -> None:
        if self.slow_ms:
            if not self.slow_reported:
                self.slow_reported = True
                self.fired("slow", f"{actor}.{endpoint} delayed by {self.slow_ms:g} ms")
            time.sleep(self.slow_ms / 1000.0)
        if self.raise_next:
            self.raise_next -= 1
            self.rehook()
            raise RuntimeError(f"injected fault: raise (rank {self.proc.rank}, {actor}.{endpoint})")

    def after_call(self, result: Any, actor: str, endpoint: str) -> Any:
        if self.nan_next and _is_tensor(result):
            self.nan_next -= 1
            self.rehook()
            result = result.clone()
            result.view(-1)[0] = float("nan")
            self.fired("nan", f"{actor}.{endpoint} result poisoned with NaN")
        return result

    def take_nan(self) -> bool:
        """True once per injected nan fault: training code poisons its next gradient."""
        if self.nan_next:
            self.nan_next -= 1
            self.rehook()
            self.fired("nan", "gradient poisoned with NaN")
            return True
        return False


def install(proc: "Proc") -> None:
    """Arm ``proc`` for in-proc faults (a worker plugin)."""
    global _current
    faults = _current = ProcFaults(proc)
    proc.register(Kind.FAULT, faults.on_message)


def take_nan() -> bool:
    """In worker code: True once per ``nan`` fault injected into this proc (then it is used up).

    Training code asks this before its all-reduce and, if True, poisons its local gradient, so
    the fault acts where a real numerical blow-up would. Outside a worker it returns False.
    """
    return _current.take_nan() if _current is not None else False


def _is_tensor(value: Any) -> bool:
    torch = loaded_torch()
    return torch is not None and isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0


def _hold_gil(seconds: float) -> None:
    """Sleep in C *without* releasing the GIL: every thread of this proc stalls (a stuck C call)."""
    libc = ctypes.PyDLL(None)  # PyDLL: calls keep the GIL
    libc.usleep(ctypes.c_uint(int(min(seconds, 4000.0) * 1e6)))
