"""The Python stacks of a local proc through a signal: faulthandler writes them, whatever holds the GIL.

Each proc registers :mod:`faulthandler` for SIGUSR1 at start (:func:`install_faulthandler`, from
the debugger's worker plugin), writing into an in-memory file (``memfd``, named
:data:`MEMFD_NAME`). A process of the same user on the same host (the controller for a local
proc, the proc's host agent for any) opens that file through ``/proc/<pid>/fd``, sends SIGUSR1 and
reads what the C-level handler wrote: the stack of every thread, without the GIL, so it works
while a C call holds it (:func:`dump_with_signal`). Thread names are not known then. Like any
signal, it makes a blocking system call of the proc return early with EINTR.

Two users: ``%mesh stack`` for a rank whose IO thread does not answer
(:mod:`monarch_nb.debug.stacks`, which renders the result), and the host agent, which takes a hung
proc's stacks just before the SIGKILL that fences it (``proc_stacks``).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time

__all__ = ["install_faulthandler", "dump_with_signal", "parse_faulthandler", "os_state", "MEMFD_NAME", "STACK_SIGNAL"]

MEMFD_NAME = "monarch_nb-stacks"
STACK_SIGNAL = signal.SIGUSR1

_PLUMBING_FILES = ("/threading.py", "/monarch_nb/runtime/")


def install_faulthandler() -> int | None:
    """Make SIGUSR1 dump every thread's stack into an in-memory file; return its fd (None if
    this platform has no ``memfd_create``)."""
    create = getattr(os, "memfd_create", None)
    if create is None:
        return None
    try:
        fd = create(MEMFD_NAME)
        faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return None
    return fd


def os_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (R running, S sleeping, T stopped, Z zombie, ...),
    ``"?"`` when it cannot be read (no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


def _find_memfd(pid: int) -> str | None:
    base = f"/proc/{pid}/fd"
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for entry in entries:
        try:
            target = os.readlink(f"{base}/{entry}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{MEMFD_NAME}"):
            return f"{base}/{entry}"
    return None


def dump_with_signal(pid: int, timeout_s: float = 2.0, settle_s: float = 0.05) -> dict:
    """Stacks of local process ``pid`` through its faulthandler (see the module docstring): the
    dump is read once its file has not grown for ``settle_s`` seconds (faulthandler writes it
    in the signal handler, thread by thread), or at ``timeout_s``.

    Returns ``{"pid", "source": "faulthandler", "threads": [...], "text"}`` (``threads`` like
    :func:`monarch_nb.debug.stacks.collect`'s, thread names unknown; ``text`` what faulthandler
    wrote, innermost call first), or ``{"pid", "source": "none", "why": ...}`` when no dump could
    be had: the process is gone, stopped (SIGSTOP; the signal waits until it continues), or has
    no dump file.
    """
    state = os_state(pid)
    if state in ("?", "Z", "X"):
        return {"pid": pid, "source": "none", "why": "the process is gone"}
    if state in ("T", "t"):
        return {"pid": pid, "source": "none", "why": "the process is stopped (SIGSTOP); it has no stack to show until it continues"}
    path = _find_memfd(pid)
    if path is None:
        return {"pid": pid, "source": "none", "why": "the process has no faulthandler dump file (not a monarch_nb proc, or another host)"}
    try:
        with open(path, "rb") as f:
            start = os.fstat(f.fileno()).st_size
            os.kill(pid, STACK_SIGNAL)
            deadline = time.monotonic() + timeout_s
            size, stable_since = start, time.monotonic()
            while time.monotonic() < deadline:
                now_size = os.fstat(f.fileno()).st_size
                if now_size != size:
                    size, stable_since = now_size, time.monotonic()
                elif size > start and time.monotonic() - stable_since > settle_s:
                    break
                time.sleep(0.005)
            f.seek(start)
            text = f.read(size - start).decode("utf-8", "replace")
    except (OSError, ProcessLookupError) as exc:
        return {"pid": pid, "source": "none", "why": f"could not read its dump: {exc}"}
    if not text:
        return {"pid": pid, "source": "none", "why": f"no dump within {timeout_s} s"}
    return {"pid": pid, "source": "faulthandler", "threads": parse_faulthandler(text), "text": text}


_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[dict]:
    """faulthandler's text dump as thread entries like :func:`monarch_nb.debug.stacks.collect`'s
    (outermost frame first; the runtime's own frames at the top cut, counted in ``hidden``)."""
    threads: list[dict] = []
    current: dict | None = None
    for line in text.splitlines():
        head = _THREAD_RE.match(line)
        if head:
            current = {"name": f"thread {head.group(2)}", "role": "other", "actor": None, "endpoint": None,
                       "running_s": None, "state": "running", "hidden": 0, "frames": [],
                       "current": head.group(1) == "Current thread"}
            threads.append(current)
            continue
        frame = _FRAME_RE.match(line)
        if frame and current is not None:
            current["frames"].append([frame.group(1), int(frame.group(2)), frame.group(3), None])
    for thread in threads:
        frames = list(reversed(thread["frames"]))
        start = 0
        while start < len(frames) - 1 and any(p in frames[start][0] for p in _PLUMBING_FILES):
            start += 1
        thread["hidden"] = start
        thread["frames"] = frames[start:]
        if thread["frames"] and thread["frames"][0][2] == "main" and any("/monarch_nb/runtime/proc.py" in f[0] for f in frames):
            thread["role"] = "io"
    return threads
