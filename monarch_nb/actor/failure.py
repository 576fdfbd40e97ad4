"""MeshFailure (what an owner is told when an actor it owns fails) and the client's fault hook.

An actor fails when its constructor raises, when an endpoint called with no reply port
(``broadcast``, ``send`` without a port, an ``explicit_response_port`` endpoint) raises, when
any endpoint raises a ``BaseException``, when it calls ``context().actor_instance.abort()``, or
when its proc dies. The failure goes to the *owner* of its mesh, the actor (or the client) whose
code called ``spawn``: an actor's ``__supervise__(failure)`` returning True handles it; otherwise
the owner fails too and its own owner is told, up to the client, where
``monarch_nb.actor.unhandled_fault_hook(failure)`` is called (looked up at each call, so it can
be replaced by assignment, as in Monarch).

The default hook keeps a notebook kernel alive: inside an IPython kernel it prints the failure's
report in the cell that ran last; in a script it prints to stderr and the script goes on. A hook
that raises asks for more: in a script the main thread gets ``KeyboardInterrupt`` (so ``atexit``
handlers run and the process exits 1, as Monarch's default does; where SIGINT is ignored, SIGTERM
ends it); in a kernel the error is printed.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

__all__ = ["MeshFailure", "default_unhandled_fault_hook", "deliver_unhandled", "note_client_loop"]

log = logging.getLogger(__name__)


class MeshFailure:
    """A failure of one or more ranks of a mesh, as given to ``__supervise__`` and the fault hook.

    ``str(failure)`` is ``MeshFailure(mesh_name=..., crashed_ranks=[...], event=...)``;
    :meth:`report` is ``"The actor <owner chain> and all its descendants have failed:\\n  <why>"``,
    where the chain and the reason are those of the root cause (the deepest failed actor).

    Attributes:
        mesh_name: the failed mesh's name (what was given to ``spawn``).
        crashed_ranks: flat ranks that failed.
        mesh: always None (as in Monarch; the mesh itself is not carried).
        cause: machine-readable cause: ``"init"``, ``"exception"``, ``"abort"``, ``"SIGKILL"``, ...
    """

    mesh = None

    def __init__(self, mesh_name: str, crashed_ranks: list[int], actor_display: str, reason: str,
                 cause: str = "", root_report: str | None = None):
        self.mesh_name = mesh_name
        self.crashed_ranks = list(crashed_ranks)
        self.actor_display = actor_display
        self.reason = reason
        self.cause = cause
        self._report = root_report or f"The actor {actor_display} and all its descendants have failed:\n  {reason}"

    def report(self) -> str:
        """The human-readable account of what failed and why (multi-line)."""
        return self._report

    @property
    def event(self) -> str:
        return f"actor {self.actor_display} failed: {self.reason}"

    def __str__(self) -> str:
        return f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={self.crashed_ranks}, event={self.event})"

    __repr__ = __str__


# -- the client's hook ----------------------------------------------------------------------------
def _kernel() -> Any:
    """The running IPython kernel, or None (a script, a plain IPython terminal)."""
    ipykernel = sys.modules.get("ipykernel.kernelapp")
    if ipykernel is None:
        return None
    app = getattr(ipykernel.IPKernelApp, "_instance", None)
    return getattr(app, "kernel", None)


_last_cell: dict[str, Any] = {}  # the parent header of the notebook cell that last spawned or called


def _print_in_last_cell(text: str) -> bool:
    """Print ``text`` to stderr as output of the cell that last used the actor API (the one that
    caused the failure, as a rule); False if not in a kernel."""
    if _kernel() is None:
        return False
    try:
        stream = sys.stderr
        if hasattr(stream, "set_parent") and _last_cell:
            stream.set_parent(_last_cell)
        stream.write(text)
        stream.flush()
    except Exception:  # noqa: BLE001 - printing must not fail delivery
        log.warning("%s", text)
    return True


_last_printed: list[Any] = [None, None, 0.0]  # the mesh and the reason of the failure printed last, and when
#: a failure of another mesh, or of more ranks, with the same reason this soon after (seconds) is the same event
SAME_EVENT_S = 5.0


def default_unhandled_fault_hook(failure: MeshFailure) -> None:
    """Print the failure (in the notebook cell that used the actor API last, or to stderr) and go
    on. What follows from the same event right after (the same reason within
    :data:`SAME_EVENT_S`: the mesh on further ranks, the other meshes of a proc that died) is one
    line each; the runtime's own meshes (a name with a leading underscore: the notebook's cell
    executors and probes, whose failures the cells and ``%mesh status`` report) print nothing."""
    import time

    now = time.monotonic()
    same_event = failure.reason == _last_printed[1] and now - _last_printed[2] < SAME_EVENT_S
    if failure.mesh_name.startswith("_"):
        return
    if same_event:
        text = f"monarch_nb: {failure.mesh_name} failed the same way on rank(s) {failure.crashed_ranks}\n"
    else:
        text = f"monarch_nb: unhandled failure of {failure.mesh_name} (ranks {failure.crashed_ranks}):\n{failure.report()}\n"
    _last_printed[:] = [failure.mesh_name, failure.reason, now]
    if not _print_in_last_cell(text):
        sys.stderr.write(text)
        sys.stderr.flush()


_loops: "weakref.WeakSet[asyncio.AbstractEventLoop]" = weakref.WeakSet()  # noqa: F821


def note_client_loop() -> None:
    """Called where client code spawns or sends: remember the asyncio loop running on this thread,
    so that state a fault hook changes from another thread (an ``asyncio.Event``) is seen at once,
    and, in a notebook, the cell running now, where a failure it causes is printed."""
    aio = sys.modules.get("asyncio")  # not imported: no loop can be running (keeps imports light)
    loop = aio._get_running_loop() if aio is not None else None
    if loop is not None:
        _loops.add(loop)
    kernel = _kernel()
    if kernel is not None:
        try:
            parent = kernel.get_parent("shell")
        except Exception:  # noqa: BLE001 - an older or newer ipykernel: print in the current cell
            parent = None
        if parent:
            _last_cell.clear()
            _last_cell.update(parent)


def deliver_unhandled(failure: MeshFailure) -> None:
    """Give ``failure`` to ``monarch_nb.actor.unhandled_fault_hook`` (runtime thread). Never raises."""
    facade = sys.modules.get("monarch_nb.actor")
    hook = getattr(facade, "unhandled_fault_hook", default_unhandled_fault_hook)
    try:
        hook(failure)
    except BaseException as exc:  # noqa: BLE001 - the hook asked for the failure to be fatal
        import datetime
        import socket

        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        text = (f"Unhandled monarch error on the root actor, hostname={socket.gethostname()}, PID={os.getpid()} "
                f"at time {stamp}:\n{failure.report()}\n(the fault hook raised {type(exc).__name__}: {exc})\n")
        if not _print_in_last_cell(text):
            sys.stderr.write(text)
            sys.stderr.flush()
            _end_main_thread()
    finally:
        for loop in list(_loops):
            if loop.is_running() and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(lambda: None)
                except RuntimeError:
                    pass


def _end_main_thread() -> None:
    """End the script: ``KeyboardInterrupt`` in its main thread, so ``finally`` blocks and
    ``atexit`` run; where SIGINT is not handled by Python (a script started as a background job of
    a non-interactive shell inherits it ignored), that would do nothing, so SIGTERM ends it."""
    if callable(signal.getsignal(signal.SIGINT)):
        _thread.interrupt_main()
        return
    sys.stderr.write("(SIGINT is ignored in this process: ending it with SIGTERM)\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)


def run_hook_thread() -> "HookThread":
    return HookThread()


class HookThread:
    """Delivers failures to the client's hook one at a time, in order, on a thread of its own."""

    def __init__(self) -> None:
        import queue

        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="monarch_nb-fault-hook", daemon=True)
        self._thread.start()

    def put(self, failure: MeshFailure) -> None:
        self._queue.put(failure)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            failure = self._queue.get()
            if failure is None:
                return
            deliver_unhandled(failure)
