"""Live Python stacks of every thread of a rank, for finding out where a busy or hung rank is.

Two ways to get them, tried in this order by :func:`monarch_nb.debug.client.stacks`:

1. **Asked over the channel** (:func:`collect`, run on the proc's IO thread): ``sys._current_frames()``
   with thread names, the actor and endpoint each thread runs, and source lines. This works while
   Python code holds the GIL (a busy loop gives it up every 5 ms) and while C code that released it
   waits (a collective blocked on a peer).
2. **Through a signal** when the IO thread does not answer (a C call that holds the GIL, a partition):
   each proc registers :mod:`faulthandler` for SIGUSR1 at start, writing into an in-memory file
   (``memfd``, named :data:`MEMFD_NAME`). The controller, on the same host, opens that file through
   ``/proc/<pid>/fd``, sends SIGUSR1 and reads what the C-level handler wrote: the stack of every
   thread, without needing the GIL. Thread names are not known then. Like any signal, it makes
   a blocking system call of the proc return early with EINTR (``sleep`` ends early; most C
   libraries retry), which is why it is the fallback and not the first way. That part lives in
   :mod:`monarch_nb.runtime.signal_stacks`: the host agent uses it too, to take a hung proc's
   stacks just before it fences it (they are kept on the proc's record and shown here while the
   rank is dead).

:func:`format_stack` renders a rank's stacks as text, outermost call first like a traceback, with
the runtime's own frames cut off the top; :func:`group_identical` groups ranks whose stacks read
the same, the usual shape of a collective hang being "N-1 ranks in all_reduce, one elsewhere".
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from .. import errors
from ..runtime.signal_stacks import MEMFD_NAME, dump_with_signal, install_faulthandler
from .postmortem import is_runtime_frame

if TYPE_CHECKING:
    from .worker import DebugAgent

__all__ = ["collect", "install_faulthandler", "dump_with_signal", "format_stack", "group_identical", "MEMFD_NAME"]


_PLUMBING_OUTER = ("threading", "monarch_nb.runtime.")
_PLUMBING_INNER = ("pdb", "bdb", "cmd", "code", "queue", "threading", "monarch_nb.debug.")


def _is(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or (p.endswith(".") and module.startswith(p)) for p in prefixes)


# -- worker side -----------------------------------------------------------------------------------
def _frame_row(frame: Any) -> list:
    """``[filename, line, function, source or None]`` of a live frame. ``f_lineno`` is None while a
    frame is at an instruction without a line (CPython 3.11+: e.g. another thread caught between
    two instructions of a call), so is the source then."""
    line = frame.f_lineno
    source = linecache.getline(frame.f_code.co_filename, line, frame.f_globals).strip() if line else ""
    return [frame.f_code.co_filename, line, frame.f_code.co_name, source or None]


def collect(agent: "DebugAgent | None" = None) -> dict:
    """Stacks of every thread of this process, as plain data (call on the proc's IO thread).

    Returns ``{"pid", "source": "live", "threads": [...]}``; each thread has ``name``, ``role``
    (``"io"``, ``"actor"``, ``"debug"`` or ``"other"``), ``actor``, ``endpoint``, ``running_s``,
    ``state`` (``"idle"``, ``"busy"``, ``"paused"`` or ``"running"``), ``hidden`` (plumbing
    frames left out) and ``frames`` (``[filename, line, function, source or None]``, outermost first).
    """
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    runners = agent.runners_by_thread() if agent is not None else {}
    paused = agent.sessions_by_thread() if agent is not None else {}
    now = time.monotonic()
    threads = []
    for ident, top in sys._current_frames().items():
        name = names.get(ident, f"thread {ident:#x}")
        runner = runners.get(ident)
        session = paused.get(ident)
        entry: dict[str, Any] = {"name": name, "role": "other", "actor": None, "endpoint": None,
                                 "running_s": None, "state": "running", "hidden": 0, "frames": []}
        if ident == me:
            entry.update(role="io", state="serving")
            threads.append(entry)
            continue
        if runner is not None:
            current = runner.current
            entry.update(role="actor", actor=runner.name)
            if current is None and session is None:
                entry["state"] = "idle"
                threads.append(entry)
                continue
            if current is not None:
                entry.update(endpoint=current[0], running_s=round(now - current[1], 3), state="busy")
        elif name.startswith("debug-"):
            entry.update(role="debug", state="idle")
            threads.append(entry)
            continue
        frames = []
        frame: FrameType | None = top
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        frames.reverse()
        modules = [str(f.f_globals.get("__name__", "")) for f in frames]
        start, end = 0, len(frames)
        while start < end - 1 and (_is(modules[start], _PLUMBING_OUTER) or is_runtime_frame(frames[start])):
            start += 1
        if session is not None:
            entry["state"] = "paused"
            while end > start + 1 and _is(modules[end - 1], _PLUMBING_INNER):
                end -= 1
        entry["hidden"] = len(frames) - (end - start)
        entry["frames"] = [_frame_row(f) for f in frames[start:end]]
        threads.append(entry)
    order = {"actor": 0, "debug": 1, "other": 2, "io": 3}
    threads.sort(key=lambda t: (order[t["role"]], t["state"] == "idle", t["name"]))
    return {"pid": os.getpid(), "source": "live", "threads": threads}


def format_stack(data: dict, *, times: bool = True, indent: str = "  ") -> str:
    """One rank's stacks (from :func:`collect` or :func:`dump_with_signal`) as text.

    Source lines missing on the worker (code defined in notebook cells) are looked up in this
    process's linecache. ``times=False`` leaves out durations, so equal stacks read the same.
    """
    if data.get("source") == "none":
        return f"{indent}(no stack: {data.get('why')})"
    lines = [f"{indent}({data['kept']})"] if data.get("kept") else []
    if data.get("source") == "faulthandler":
        lines.append(f"{indent}(from faulthandler via SIGUSR1: the proc's IO thread did not answer; thread names unknown)")
    for thread in data.get("threads", []):
        title = thread["name"]
        if thread.get("actor"):
            title += f" (actor {thread['actor']!r})"
        state = thread.get("state")
        if thread["role"] == "io":
            if thread.get("state") == "serving":
                lines.append(f"{indent}Thread {title}: IO loop, serving")
                continue
            title += " (IO loop)"
        if state == "idle":
            what = "waiting for commands" if thread["role"] == "debug" else "idle"
            lines.append(f"{indent}Thread {title}: {what}")
            continue
        facts = []
        if thread.get("endpoint"):
            facts.append(f"in {thread['endpoint']}" + (f" for {thread['running_s']:.1f} s" if times and thread.get("running_s") is not None else ""))
        if state == "paused":
            facts.append("paused in pdb")
        if thread.get("current"):
            facts.append("the thread that took the signal")
        lines.append(f"{indent}Thread {title}" + (f" [{', '.join(facts)}]" if facts else "") + ":")
        if thread.get("hidden"):
            lines.append(f"{indent}  ({thread['hidden']} runtime frame(s) hidden)")
        for filename, lineno, function, source in thread["frames"]:
            lines.append(f'{indent}  File "{filename}", line {lineno}, in {function}')
            source = source or (linecache.getline(filename, lineno).strip() if lineno else "")
            if source:
                lines.append(f"{indent}    {source}")
    return "\n".join(lines)


def group_identical(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    """Group ranks whose stacks read the same: ``[(ranks, text), ...]``, biggest group first."""
    return sorted(errors.group_identical(texts), key=lambda g: (-len(g[0]), g[0][0]))
