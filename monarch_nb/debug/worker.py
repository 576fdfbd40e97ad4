"""Worker side of the debugger: one proc's failures, pdb sessions and stacks. Runs in each proc.

Installed into every proc as a plugin (:func:`install`): one :class:`DebugAgent` per proc. It owns the
store of recent failures, the pdb sessions of the proc, ``breakpoint()`` (``sys.breakpointhook``
and ``pdb.set_trace`` are pointed at it) and the SIGUSR1 stack dump. Requests arrive on the
proc's IO thread (:meth:`on_message`) and never block it: pdb runs on the actor's thread
(breakpoints) or on a thread of its own (post-mortem), and answers from there.

Requests (``op`` in the body, answered through the caller's pending call):

=========  =====================================================  ==========================================
op         arguments                                              answer
=========  =====================================================  ==========================================
list       —                                                      ``{"failures", "sessions", "pid", "device"}``
attach     ``session``, ``failure`` (ids or None), ``sources``    pdb's banner up to its prompt
cmd        ``session``, ``line``                                  pdb's output up to its next prompt
stack      —                                                      :func:`monarch_nb.debug.stacks.collect`
clear      —                                                      ``{"cleared": n}``
=========  =====================================================  ==========================================

pdb answers are ``{"session", "output", "prompt", "state"}`` with state ``"prompt"`` or
``"ended"``; a request that cannot be served is answered ``{"error": ..., **listing}``.
"""

from __future__ import annotations

import bdb
import itertools
import linecache
import logging
import os
import pdb
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..runtime.protocol import CallHeader, HeartbeatFields, Kind
from ..transport.serialization import loads
from . import stacks
from .postmortem import FailureStore, frame_dict
from .remote_pdb import Session

if TYPE_CHECKING:
    from ..runtime.proc import Proc

__all__ = ["DebugAgent", "install", "current", "record_failure", "frame_namespace"]

log = logging.getLogger(__name__)

_current: "DebugAgent | None" = None


def current() -> "DebugAgent | None":
    """This process's agent (None outside a worker proc)."""
    return _current


def record_failure(exc: BaseException, actor: str = "", endpoint: str = "") -> None:
    """Keep ``exc`` for post-mortem debugging on this proc, as if an endpoint had raised it.

    For code that catches an exception to report it itself (the ``%%mesh`` cell executor turns
    a failed cell into a result), so ``%mesh debug RANK`` and ``%%mesh --frame`` still reach its
    frames. Outside a worker proc it does nothing.
    """
    agent = _current
    if agent is not None:
        agent.record_failure(actor or threading.current_thread().name, endpoint or "?", exc)


class DebugAgent:
    """The debugger side of a proc.

    Args:
        proc: the proc (its ``rank``, ``identity``, ``actors`` and ``reply`` are used).
        notify: called (from any thread) when the set of paused sessions changes, so the proc
            sends a heartbeat at once.
    """

    def __init__(self, proc: "Proc", notify: Callable[[], None]):
        self.proc = proc
        self.notify = notify
        self.failures = FailureStore()
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self.stack_fd = stacks.install_faulthandler()
        sys.breakpointhook = self.breakpoint_hook
        pdb.set_trace = self._set_trace

    # -- hooks called by the runtime and by user code --------------------------------------------
    def record_failure(self, actor: str, endpoint: str, exc: BaseException) -> None:
        """An endpoint of ``actor`` raised ``exc`` (actor thread): keep it for post-mortem."""
        if isinstance(exc, bdb.BdbQuit):
            return
        try:
            self.failures.record(actor, endpoint, exc)
        except Exception:  # keeping a failure must never break error reporting
            log.exception("could not record a failure")

    def breakpoint_hook(self, *args: Any, **kwargs: Any) -> None:
        """``breakpoint()`` in a worker: pause this thread in a remote pdb session."""
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return
        self._set_trace(sys._getframe(1))

    def _set_trace(self, frame: Any = None, *, header: str | None = None) -> None:
        if frame is None:
            frame = sys._getframe(1)
        if threading.current_thread() is threading.main_thread():
            log.warning("breakpoint() on the proc's IO thread is ignored: it would stop the proc from serving")
            return
        ident = threading.get_ident()
        with self._lock:
            session = next((s for s in self._sessions.values() if s.kind == "breakpoint" and s.thread_ident == ident), None)
            if session is None:
                actor, endpoint = self._actor_of(ident)
                session = Session(self, next(self._ids), "breakpoint", actor, endpoint)
                session.thread_ident = ident
                self._sessions[session.id] = session
        session.pdb.set_trace(frame)

    # -- called by sessions -------------------------------------------------------------------------
    def session_started(self, session: Session) -> None:
        with self._lock:
            self._sessions[session.id] = session

    def session_ended(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
        self.notify()

    def reply(self, header: CallHeader, value: Any) -> None:
        self.proc.reply(header, True, value)

    def banner(self, session: Session) -> list[str]:
        """The first lines of a session: where it is and what this rank's device holds."""
        coords = ", ".join(f"{k}={v}" for k, v in self.proc_coords().items())
        where = f"rank {self.proc.rank}" + (f" ({coords})" if coords else "") + f", pid {os.getpid()}"
        what = f"{session.actor}.{session.endpoint}" if session.endpoint else session.actor
        if session.kind == "post-mortem" and session.failure is not None:
            failure = session.failure
            kept = self.failures.failures()
            age = time.time() - failure.time
            lines = [
                f"{where}: post-mortem of failure {failure.id} ({len(kept)} kept, {age:.1f} s ago): "
                f"{failure.actor}.{failure.endpoint} raised {type(failure.exc).__name__}: {failure.exc}"
            ]
        else:
            lines = [f"{where}: paused at breakpoint() in {what}"]
        lines.append(f"device: {describe_device()}")
        return lines

    def proc_coords(self) -> dict:
        point = self.proc.extent.point(self.proc.rank) if len(self.proc.extent) else {}
        return dict(point)

    # -- facts ----------------------------------------------------------------------------------
    def _actor_of(self, ident: int) -> tuple[str, str | None]:
        for runner in list(self.proc.actors.values()):
            if runner.thread.ident == ident:
                return runner.name, runner.current[0] if runner.current else None
        return threading.current_thread().name, None

    def runners_by_thread(self) -> dict:
        return {r.thread.ident: r for r in list(self.proc.actors.values())}

    def sessions_by_thread(self) -> dict[int, Session]:
        with self._lock:
            return {s.thread_ident: s for s in self._sessions.values()
                    if s.kind == "breakpoint" and s.thread_ident is not None and s.state != "ended"}

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def paused(self) -> list[dict]:
        """Breakpoint sessions that hold an actor's thread now (for heartbeats)."""
        return [s.info() for s in self.sessions() if s.kind == "breakpoint" and s.state != "ended"]

    def listing(self) -> dict:
        return {
            "pid": os.getpid(),
            "failures": [f.info() for f in self.failures.failures()],
            "sessions": [s.info() for s in self.sessions()],
        }

    # -- requests (IO thread) --------------------------------------------------------------------
    def on_message(self, header: CallHeader, body: Any, buffers: list[memoryview]) -> None:
        """Handle one ``debug`` message (on the proc's IO thread; never blocks)."""
        try:
            request = loads(body, buffers) if body else {}
            op = request.get("op")
            if op == "list":
                self.reply(header, self.listing())
            elif op == "attach":
                self._attach(header, request)
            elif op == "cmd":
                session = self._session(request.get("session"))
                if session is None or not session.post("line", str(request.get("line", "")), header):
                    self.reply(header, {"error": f"session {request.get('session')} has ended", **self.listing()})
            elif op == "stack":
                self.reply(header, stacks.collect(self))
            elif op == "clear":
                self.reply(header, {"cleared": self.failures.clear()})
            else:
                self.reply(header, {"error": f"unknown debug op {op!r}"})
        except Exception as exc:
            from ..errors import capture_traceback

            log.exception("debug request failed")
            self.proc.reply(header, False, capture_traceback(exc))

    def _session(self, session_id: Any) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def _attach(self, header: CallHeader, request: dict[str, Any]) -> None:
        install_sources(request.get("sources") or {})
        session = None
        if request.get("session") is not None:
            session = self._session(request["session"])
            if session is None:
                self.reply(header, {"error": f"session {request['session']} has ended", **self.listing()})
                return
        failure_id = request.get("failure")
        if session is None and failure_id is None:
            live = [s for s in self.sessions() if s.state != "ended"]
            live.sort(key=lambda s: (s.kind != "breakpoint", -s.id))
            session = live[0] if live else None
        if session is None:
            failure = self.failures.get(failure_id)
            if failure is None:
                what = f"failure {failure_id} is not kept" if failure_id is not None else "no failure or breakpoint to debug"
                self.reply(header, {"error": what, **self.listing()})
                return
            with self._lock:
                session = next((s for s in self._sessions.values() if s.failure is failure), None)
                if session is None:
                    session = Session(self, next(self._ids), "post-mortem", failure.actor, failure.endpoint, failure)
                    self._sessions[session.id] = session
                    session.post("attach", None, header)
                    threading.Thread(target=session.run_post_mortem, name=f"debug-{session.id}", daemon=True).start()
                    return
        if not session.post("attach", None, header):
            self.reply(header, {"error": f"session {session.id} has ended", **self.listing()})

    # -- %%mesh --frame ------------------------------------------------------------------------------
    def frame_namespace(self) -> dict:
        """A namespace for running code in the frame being debugged on this proc.

        The frame is the one selected in an open session (``up`` / ``down`` move it; a paused
        breakpoint first), else the innermost frame of the newest failure.

        Raises:
            LookupError: this proc has no failure and no session.
        """
        live = [s for s in self.sessions() if s.state != "ended" and s.current_frame() is not None]
        live.sort(key=lambda s: (s.kind != "breakpoint", -s.id))
        if live:
            session = live[0]
            frame = session.current_frame()
            owner = session.failure if session.failure is not None else session
            return frame_dict(owner, frame)  # type: ignore[arg-type]
        failure = self.failures.get()
        innermost = failure.innermost_frame() if failure is not None else None
        if failure is None or innermost is None:
            raise LookupError(
                f"rank {self.proc.rank} has no failed frame to run in: no endpoint raised here "
                f"(kept failures: {len(self.failures)}) and no breakpoint is paused"
            )
        return frame_dict(failure, innermost)


def install_sources(sources: dict) -> None:
    """Put source text the controller sent (notebook cells) into this process's linecache."""
    for filename, lines in sources.items():
        if not isinstance(filename, str) or os.path.exists(filename):
            continue
        entry = linecache.cache.get(filename)
        if entry is not None and len(entry) == 4 and entry[2]:
            continue
        linecache.cache[filename] = (sum(len(x) for x in lines), None, list(lines), filename)


def describe_device() -> str:
    """The rank's device in one line; torch is only asked if the proc already imported it."""
    from ..device import loaded_torch

    torch = loaded_torch()
    if torch is None:
        return "cpu (torch is not loaded in this proc)"
    try:
        if torch.cuda.is_available() and not torch.cuda.is_initialized():  # asking would create a context
            kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
            return f"{kind} available, not used by this proc yet (no GPU memory in use; torch {torch.__version__})"
        from .. import device

        info = device.describe()
    except Exception as exc:  # a broken driver must not break the debugger
        return f"unknown ({type(exc).__name__}: {exc})"
    if info.get("kind") == "cpu":
        return f"cpu (torch {info.get('torch')})"
    gib = 1024 ** 3
    return (
        f"{info['kind']} {info.get('name')}: {info.get('memory_allocated_bytes', 0) / gib:.2f} GiB allocated, "
        f"{info.get('memory_reserved_bytes', 0) / gib:.2f} GiB reserved (torch {info.get('torch')})"
    )


def install(proc: "Proc") -> None:
    """Give ``proc`` a debugger (a worker plugin): debug requests, paused sessions in heartbeats,
    failures kept for post-mortem."""
    global _current
    agent = _current = DebugAgent(proc, notify=proc.heartbeat)
    proc.register(Kind.DEBUG, agent.on_message)
    proc.add_failure_hook(agent.record_failure)

    def paused() -> HeartbeatFields:
        sessions = agent.paused()  # breakpoint sessions: paused, not hung
        return {"paused": sessions} if sessions else {}

    proc.add_heartbeat_field(paused)


def frame_namespace() -> dict:
    """On a worker (``%%mesh --ranks 3 --frame``): the namespace to run a cell in.

    The namespace is the debugged frame's globals overlaid with its locals: the frame selected in
    an open pdb session on this proc (a paused ``breakpoint()`` first; ``up`` / ``down`` in a
    post-mortem session move it), else the innermost frame of the proc's newest failure. Names a
    cell defines stay there for the next ``--frame`` cell on the same frame.

    Raises:
        LookupError: this rank has no failure and no paused breakpoint.
        RuntimeError: called outside a worker proc.
    """
    if _current is None:
        raise RuntimeError("frame_namespace runs on a worker proc (through %%mesh --frame), not on the controller")
    return _current.frame_namespace()
