"""Worker side: the per-proc store of recent endpoint failures, kept for post-mortem debugging.

When an endpoint (or an actor constructor) raises, the proc's actor runner calls
:meth:`FailureStore.record`. The store keeps the exception *with its traceback*, and so the
frames and their locals stay alive: a later ``%mesh debug RANK`` opens pdb on them. Memory is
bounded: only the newest ``MONARCH_NB_DEBUG_KEEP_FAILURES`` (default 5) failures are kept, and
``%mesh debug clear`` drops them (a frame can hold large tensors, GPU memory included).

Frames of the runtime itself (the actor runner in :mod:`monarch_nb.runtime.proc`) are cut from
the top of the kept traceback, so pdb's ``up`` stops at the endpoint, unless nothing else is
left (an error raised by the runtime, such as a wrong endpoint name, keeps its full traceback).
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

__all__ = ["Failure", "FailureStore", "DEFAULT_KEEP", "user_traceback", "describe_frame", "is_runtime_frame"]

#: How many failures a proc keeps unless MONARCH_NB_DEBUG_KEEP_FAILURES says otherwise.
DEFAULT_KEEP = 5

#: Frames of files in this folder are the runtime's plumbing, not the user's code. (By file, not
#: module name: a worker runs ``monarch_nb.runtime.proc`` as ``__main__``.)
RUNTIME_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime") + os.sep


def is_runtime_frame(frame: FrameType) -> bool:
    """True for frames of :mod:`monarch_nb.runtime` code."""
    return frame.f_code.co_filename.startswith(RUNTIME_DIR)


@dataclass
class Failure:
    """One recorded failure: the exception, its (trimmed) traceback and where it happened.

    Attributes:
        id: number of the failure in this proc, counting from 1.
        actor: the actor mesh's name.
        endpoint: the endpoint that raised (``"__init__"`` for a constructor).
        exc: the exception object (its ``__traceback__`` keeps the frames alive).
        tb: the traceback pdb starts from (runtime frames cut off the top).
        time: wall-clock seconds since the epoch.
        namespaces: ``%%mesh --frame`` namespaces built from its frames, by frame id.
    """

    id: int
    actor: str
    endpoint: str
    exc: BaseException
    tb: TracebackType | None
    time: float = field(default_factory=time.time)
    namespaces: dict = field(default_factory=dict)

    def innermost_frame(self) -> FrameType | None:
        tb = self.tb
        if tb is None:
            return None
        while tb.tb_next is not None:
            tb = tb.tb_next
        return tb.tb_frame

    def info(self) -> dict:
        """Plain data for the controller: ids, exception, and the innermost frame's location."""
        where = {}
        tb = self.tb
        if tb is not None:
            while tb.tb_next is not None:
                tb = tb.tb_next
            where = describe_frame(tb.tb_frame, tb.tb_lineno)
        return {
            "failure": self.id,
            "actor": self.actor,
            "endpoint": self.endpoint,
            "type": type(self.exc).__qualname__,
            "message": str(self.exc),
            "time": self.time,
            **where,
        }


def describe_frame(frame: FrameType, lineno: int | None = None) -> dict:
    """``{"function", "filename", "line"}`` of ``frame`` (at ``lineno`` if given)."""
    return {
        "function": frame.f_code.co_name,
        "filename": frame.f_code.co_filename,
        "line": lineno if lineno is not None else frame.f_lineno,
    }


_DEBUGGER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_debugger_frame(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_DEBUGGER_DIR) or frame.f_globals.get("__name__") in ("bdb", "pdb", "cmd")


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its leading runtime frames (``tb`` itself if only runtime frames remain),
    and without trailing debugger frames (an interrupt raised while paused in pdb)."""
    start = tb
    while start is not None and is_runtime_frame(start.tb_frame):
        start = start.tb_next
    if start is None:
        return tb
    last_user = None
    entry: TracebackType | None = start
    while entry is not None:
        if not _is_debugger_frame(entry.tb_frame):
            last_user = entry
        entry = entry.tb_next
    if last_user is not None and last_user.tb_next is not None and all(
        _is_debugger_frame(e.tb_frame) for e in _walk(last_user.tb_next)
    ):
        last_user.tb_next = None
    return start


def _walk(tb: TracebackType | None):
    while tb is not None:
        yield tb
        tb = tb.tb_next


class FailureStore:
    """The newest failures of this proc (thread-safe). ``keep`` bounds how many are kept."""

    def __init__(self, keep: int | None = None):
        if keep is None:
            keep = int(os.environ.get("MONARCH_NB_DEBUG_KEEP_FAILURES", DEFAULT_KEEP))
        self.keep = max(0, keep)
        self._failures: collections.deque[Failure] = collections.deque(maxlen=self.keep or 1)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def record(self, actor: str, endpoint: str, exc: BaseException) -> Failure | None:
        """Keep ``exc`` (raised by ``actor.endpoint``) and its frames; drop the oldest beyond ``keep``."""
        if self.keep == 0:
            return None
        failure = Failure(0, actor, endpoint, exc, user_traceback(exc.__traceback__))
        with self._lock:
            failure.id = next(self._ids)
            self._failures.append(failure)
        return failure

    def failures(self) -> list[Failure]:
        """Kept failures, oldest first."""
        with self._lock:
            return list(self._failures)

    def get(self, failure_id: int | None = None) -> Failure | None:
        """Failure ``failure_id``, or the newest one when None; None if it is not kept."""
        with self._lock:
            if not self._failures:
                return None
            if failure_id is None:
                return self._failures[-1]
            for failure in self._failures:
                if failure.id == failure_id:
                    return failure
        return None

    def clear(self) -> int:
        """Drop every kept failure (and the frames they hold); return how many there were."""
        with self._lock:
            count = len(self._failures)
            self._failures.clear()
        return count

    def __len__(self) -> int:
        return len(self._failures)


def frame_dict(failure: Failure, frame: FrameType) -> dict[str, Any]:
    """A namespace for running code "inside" ``frame``: its globals overlaid with its locals.

    The same dict is returned for the same frame every time, so names a ``%%mesh --frame`` cell
    defines are there for the next one. Assignments do not write back into the (finished) frame.
    """
    key = id(frame)
    namespace = failure.namespaces.get(key)
    if namespace is None:
        namespace = dict(frame.f_globals)
        namespace.update(frame.f_locals)
        failure.namespaces[key] = namespace
    return namespace
