"""Worker side: pdb driven by messages, so a notebook cell can debug a rank.

A :class:`Session` is a :class:`RemotePdb` (a ``pdb.Pdb``) whose stdin and stdout are the
session itself: ``write`` collects pdb's output, and ``readline`` hands the collected output,
split into text and prompt, to the request that waits for it (an ``attach`` or a command sent
by the controller), then blocks until the next command arrives. So each request is answered
with exactly what pdb printed in response, ending at its next prompt.

Two kinds of session:

- ``"post-mortem"``: pdb on a recorded failure (:mod:`monarch_nb.debug.postmortem`), run on a
  thread of its own (the actor's thread is idle and keeps serving calls). It ends with ``q``,
  ``c`` or any command that would resume execution.
- ``"breakpoint"``: ``breakpoint()`` in actor code pauses the actor's own thread in pdb. The
  proc reports the pause in its heartbeats (so it is shown as paused and never judged hung: the
  heartbeats come from the IO thread). ``c`` resumes it; ``q`` also resumes it (the endpoint
  goes on, instead of being aborted by ``BdbQuit`` as in a terminal); ``n`` / ``s`` step.

``interact`` opens a console that also reads from the session (type ``exit()`` to return).
An interrupt that reaches the paused thread (the notebook's stop button on a ``%%mesh`` cell)
ends the pause and raises ``KeyboardInterrupt`` in the endpoint, as it would have unpaused.
"""

from __future__ import annotations

import code
import io
import pdb
import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from .postmortem import is_runtime_frame

if TYPE_CHECKING:
    from ..runtime.protocol import CallHeader
    from .worker import DebugAgent
    from .postmortem import Failure

__all__ = ["RemotePdb", "Session", "SKIP_MODULES"]

#: Modules pdb never stops in: the runtime's plumbing around an endpoint.
SKIP_MODULES = ["monarch_nb.runtime.*", "monarch_nb.debug.*", "monarch_nb.actor.*", "threading", "asyncio.*", "concurrent.*"]

_EXIT_LINES = ("exit()", "quit()", "exit", "quit")


class RemotePdb(pdb.Pdb):
    """pdb whose input and output are a :class:`Session`."""

    def __init__(self, session: "Session"):
        # a Session reads and writes like a text file (readline, write, flush): all pdb uses of one
        super().__init__(stdin=session, stdout=session, skip=SKIP_MODULES, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.session = session
        self.prompt = "(Pdb) "

    def stop_here(self, frame) -> bool:
        if is_runtime_frame(frame):  # never stop in the actor runner around an endpoint
            return False
        return super().stop_here(frame)

    def dispatch_return(self, frame, arg):
        result = super().dispatch_return(frame, arg)
        caller = frame.f_back
        if (self.session.kind == "breakpoint" and self.session.state == "running" and not self.quitting
                and _outside_user_code(caller)):
            # Stepping left the endpoint: back in the actor runner there is nothing to step
            # through (the next stop would be inside the runtime), so the rank just continues.
            self.set_continue()
            self.session.leave(True)
        return result

    def get_stack(self, f, t):
        """pdb's stack without the thread start-up and actor-runner frames above the endpoint."""
        stack, index = super().get_stack(f, t)
        cut = 0
        while cut < min(index, len(stack) - 1) and _plumbing(stack[cut][0]):
            cut += 1
        return stack[cut:], index - cut

    def interaction(self, frame, traceback) -> None:
        session = self.session
        session.enter()
        try:
            super().interaction(frame, traceback)
        finally:
            resumed = session.kind == "post-mortem" or self.quitting or self.stoplineno == -1
            session.leave(resumed)
        if session.interrupted:  # the stop button while paused: the endpoint stops, as it would unpaused
            session.interrupted = False
            raise KeyboardInterrupt

    def _cmdloop(self) -> None:
        while True:
            try:
                self.allow_kbdint = True
                self.cmdloop()
                self.allow_kbdint = False
                break
            except KeyboardInterrupt:
                if self.session.kind != "breakpoint":
                    self.message("--KeyboardInterrupt--")
                    continue
                self.session.interrupted = True  # see interaction(): the endpoint gets it
                self.set_continue()
                break

    def print_header(self) -> None:
        """The session's banner: which rank, actor and failure this is, and the device."""
        for line in self.session.agent.banner(self.session):
            self.message(line)

    def do_quit(self, arg: str) -> Any:
        if self.session.kind != "breakpoint":
            return super().do_quit(arg)
        # A notebook user who quits expects the call to go on, not to die of BdbQuit.
        self.message("quit: detaching; the rank continues (breakpoint() calls stop it again)")
        self.breaks = {}
        self.set_continue()
        return 1

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> Any:
        self.message("")
        return self.do_quit(arg)

    def do_interact(self, arg: str) -> None:
        """interact
        Start an interactive console in the current frame's namespace (globals and locals);
        type exit() to return to pdb.
        """
        frame = self.curframe
        assert frame is not None  # a command runs at a frame
        namespace = {**frame.f_globals, **self.curframe_locals}
        _Console(self.session, namespace).interact(
            banner="*interactive* (exit() returns to pdb)", exitmsg="*back in pdb*"
        )


def _outside_user_code(frame) -> bool:
    """True if a frame returning to ``frame`` leaves the endpoint (for the runner, or for the event
    loop that runs an async endpoint)."""
    if frame is None or is_runtime_frame(frame):
        return True
    module = str(frame.f_globals.get("__name__", ""))
    return module.startswith(("asyncio.", "concurrent."))


def _plumbing(frame) -> bool:
    return is_runtime_frame(frame) or frame.f_globals.get("__name__") == "threading"


class _Console(code.InteractiveConsole):
    """``interact``: a Python console reading and writing through the session."""

    def __init__(self, session: "Session", namespace: dict):
        super().__init__(namespace, filename="<interact>")
        self.session = session

    def raw_input(self, prompt: str = "") -> str:
        self.session.write(prompt)
        line = self.session.readline()
        if not line or line.strip() in _EXIT_LINES:
            raise EOFError
        return line.rstrip("\n")

    def write(self, data: str) -> None:
        self.session.write(data)

    def runcode(self, code_obj) -> None:
        saved = sys.stdout, sys.stderr, sys.displayhook
        sys.stdout = sys.stderr = self.session
        sys.displayhook = _displayhook_to(self.session)
        try:
            exec(code_obj, self.locals)
        except SystemExit:
            self.write("(SystemExit ignored; type exit() to leave the console)\n")
        except BaseException:
            self.showtraceback()
        finally:
            sys.stdout, sys.stderr, sys.displayhook = saved


def _displayhook_to(session: "Session") -> Callable[[Any], None]:
    def hook(value: Any) -> None:
        if value is not None:
            session.write(repr(value) + "\n")

    return hook


class Session:
    """One pdb session on this proc, and the text channel between it and the controller.

    Attributes:
        id: number of the session in this proc.
        kind: ``"post-mortem"`` or ``"breakpoint"``.
        actor / endpoint: the actor and endpoint it debugs (thread name and None outside actors).
        failure: the recorded failure (post-mortem sessions).
        state: ``"starting"``, ``"prompt"`` (waiting for a command), ``"running"`` (running one,
            or stepping) or ``"ended"``.
        thread_ident: the thread pdb runs on.
    """

    def __init__(self, agent: "DebugAgent", session_id: int, kind: str, actor: str, endpoint: str | None,
                 failure: "Failure | None" = None):
        self.agent = agent
        self.id = session_id
        self.kind = kind
        self.actor = actor
        self.endpoint = endpoint
        self.failure = failure
        self.state = "starting"
        self.thread_ident: int | None = None
        self.paused_since = time.time()
        self.namespaces: dict = {}
        self.interrupted = False  # an interrupt (the notebook's stop button) arrived while paused
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._out = io.StringIO()
        self._pending: CallHeader | None = None  # the request header awaiting pdb's next prompt
        self._attaching = False
        self._announce = False  # tell the controller at the first prompt (pdb knows the frame then)
        self._lock = threading.Lock()
        self.pdb = RemotePdb(self)

    # -- file-like side, used by pdb on the session's thread --------------------------------------
    def write(self, text: str) -> int:
        self._out.write(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        """pdb wants a line: answer the waiting request with the output so far, then wait."""
        self._deliver("prompt")
        while True:
            try:  # wake up now and then, so an interrupt raised in this thread can land
                op, payload, header = self._inbox.get(timeout=0.25)
            except queue.Empty:
                continue
            if op == "attach":
                with self._lock:
                    self._pending = header
                self.pdb.print_header()
                if self.pdb.stack:
                    self.pdb.print_stack_entry(self.pdb.stack[self.pdb.curindex])
                self.write(self.pdb.prompt)
                self._deliver("prompt")
                continue
            with self._lock:
                self._pending = header
                self.state = "running"
            return payload + "\n"

    # -- lifecycle, on the session's thread --------------------------------------------------------
    def enter(self) -> None:
        """pdb is about to take commands (a pause begins, or a post-mortem session starts)."""
        with self._lock:
            first = self.state in ("starting", "ended")
            self.state = "running"
            self.thread_ident = threading.get_ident()
            attaching, self._attaching = self._attaching, False
        if first:
            self.paused_since = time.time()
            self._announce = True
            self.agent.session_started(self)
        if attaching:
            self.pdb.print_header()

    def leave(self, resumed: bool) -> None:
        """pdb returned control to the program: if ``resumed`` the session ends, else it steps."""
        if not resumed:
            return  # ``n`` / ``s`` / ``r`` / ``unt``: the answer is pdb's next stop
        if self.interrupted:
            self.write("(interrupted: the endpoint stops with KeyboardInterrupt)\n")
        elif self.kind == "breakpoint":
            self.write("(the rank continues)\n")
        else:
            self.write("(post-mortem session ended)\n")
        with self._lock:
            self.state = "ended"
        self._deliver("ended")
        self.agent.session_ended(self)
        while True:  # answer requests that raced with the end
            try:
                _, _, header = self._inbox.get_nowait()
            except queue.Empty:
                break
            self.agent.reply(header, {"session": self.id, "output": "", "prompt": "", "state": "ended"})

    # -- requests, from the proc's IO thread ------------------------------------------------------
    def post(self, op: str, payload: Any, header: CallHeader) -> bool:
        """Queue an ``"attach"`` or a ``"line"`` for the session; False if it has ended."""
        with self._lock:
            if self.state == "ended":
                return False
            if op == "attach" and self.state == "starting":
                self._pending, self._attaching = header, True
                return True
            self._inbox.put((op, payload, header))
        return True

    def run_post_mortem(self) -> None:
        """Body of a post-mortem session's thread."""
        assert self.failure is not None
        try:
            self.pdb.reset()
            self.pdb.interaction(None, self.failure.tb)
        except BaseException as exc:  # never let a debugger bug take the proc down
            self.write(f"*** the debugger failed: {type(exc).__name__}: {exc}\n")
            if self.state != "ended":
                with self._lock:
                    self.state = "ended"
                self._deliver("ended")
                self.agent.session_ended(self)

    def _deliver(self, state: str) -> None:
        output = self._out.getvalue()
        self._out = io.StringIO()
        if state == "prompt" and not output.endswith("\n"):
            text, _, prompt = output.rpartition("\n")
            text = text + "\n" if text else ""
        else:
            text, prompt = output, ""
        with self._lock:
            header, self._pending = self._pending, None
            if state == "prompt":
                self.state = "prompt"
        if header is not None:
            self.agent.reply(header, {"session": self.id, "output": text, "prompt": prompt, "state": state})
        if state == "prompt" and self._announce:
            self._announce = False
            self.agent.notify()

    # -- facts ----------------------------------------------------------------------------------
    def current_frame(self):
        """The frame pdb has selected (``up`` / ``down`` move it), or None."""
        return getattr(self.pdb, "curframe", None)

    def info(self) -> dict:
        frame = self.current_frame()
        where: dict = {}
        if frame is not None:
            try:
                lineno = self.pdb.stack[self.pdb.curindex][1]
            except (AttributeError, IndexError):  # pdb is between stops
                lineno = frame.f_lineno
            where = {"function": frame.f_code.co_name, "filename": frame.f_code.co_filename, "line": lineno}
        return {
            "session": self.id,
            "kind": self.kind,
            "state": self.state,
            "actor": self.actor,
            "endpoint": self.endpoint,
            "failure": self.failure.id if self.failure is not None else None,
            "since": self.paused_since,
            **where,
        }
