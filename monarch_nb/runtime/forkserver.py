"""A fork server: a process that imported torch once, from which a host agent forks its procs.

Why: a proc of a training mesh spends about 5 s of CPU importing torch, ``torch._dynamo`` and
the trainer (2-core machine, torch 2.13 CPU build), so four ranks and a spare on two cores wait
about 12 s before their first step, and every spare refilled during training takes that CPU from
the ranks. A fork of a process that has imported them takes milliseconds and shares its pages.
The design is that of Python's ``multiprocessing`` "forkserver" start method (and of Android's
zygote): a clean process that only imports, and forks on request.

Two sides:

- :class:`ForkServer` (in the host agent): starts ``python -m monarch_nb.proc_main --forkserver
  SOCK READY MODULE...`` with the environment a warm spare of the mesh would get, and sends it
  fork requests over a ``SOCK_SEQPACKET`` socket pair: the new proc's whole environment and
  working directory as JSON, its stdin, stdout and stderr pipes as file descriptors
  (``SCM_RIGHTS``). The reply is the new proc's pid. Requests are answered in order, and the
  agent reads the replies in its event loop (it never blocks on the server).
- :func:`serve` (in the server): imports, says so on ``READY``, then for each request forks
  twice (server -> A -> B, A exits at once), so that B is reparented to the host agent, which is
  a child subreaper (``PR_SET_CHILD_SUBREAPER``, :func:`become_subreaper`). The agent thus stays
  the parent of every proc: it reaps it, reads its exit status and sees it stopped through
  ``/proc``, as for a proc it started itself. B takes its pipes as 0, 1 and 2, a session of its
  own, the proc's environment (replacing the server's) and working directory, rereads
  :mod:`monarch_nb.config`, reseeds numpy's global generator (fresh processes each seed it from
  the OS), waits until it is the agent's child, and returns from :func:`serve` to become a proc.

What the server must never do: run torch compute (a fork of a process whose OpenMP pool has
run can hang in the child), open a ZeroMQ context, or start a thread of its own. Only what is read
at import time comes from the server's environment, so :func:`server_key` keys a server by
interpreter, working directory, modules and environment; a proc whose key has no ready
server is started as before (``subprocess.Popen``), so a server that fails costs speed, never a proc.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import IO, Any, Callable, Sequence

log = logging.getLogger("monarch_nb.forkserver")

__all__ = ["ForkServer", "ForkedProc", "ServerState", "become_subreaper", "retitle", "server_key", "serve"]

PR_SET_CHILD_SUBREAPER = 36
#: The largest fork request (the proc's environment as JSON), bytes; a bigger one is started without the server.
MAX_REQUEST_BYTES = 200_000
_PID = struct.Struct("=i")
#: How long a forked proc waits to be reparented to its host agent, seconds (it takes microseconds).
REPARENT_TIMEOUT_S = 5.0


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux): orphaned descendants are reparented to it.

    Returns:
        True when the kernel agreed; False elsewhere (then procs are not forked from a server).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def retitle(args: Sequence[str]) -> bool:
    """Rewrite this process's command line (``/proc/self/cmdline``, what ``ps`` and ``py-spy``
    show) in place, as ``setproctitle`` does: a forked proc says ``python -m monarch_nb.proc_main
    pm0.3`` like a proc started fresh, not its server's arguments. Linux only; the new line must
    fit in the old one's bytes.

    Returns:
        False when it could not (another OS, or too long): the line stays as it was.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            after_name = f.read().rsplit(b")", 1)[1].split()
        start, end = int(after_name[45]), int(after_name[46])  # fields 48 and 49: arg_start, arg_end
        text = b"\0".join(a.encode() for a in args) + b"\0"
        if len(text) > end - start:
            return False
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(text.ljust(end - start, b"\0"))
        return True
    except (OSError, IndexError, ValueError):
        return False


#: variables left out of a server's key: they change from one test (or cell) to the next and no
#: import reads them (the forked proc still gets their current value)
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})


def server_key(python: str, cwd: str | None, preload: Sequence[str], env: dict[str, str]) -> str:
    """What a server's imports depend on, as a short hex digest: procs with equal keys share one."""
    text = json.dumps([python, cwd or "", list(preload), sorted((k, v) for k, v in env.items() if k not in _VOLATILE)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ServerState(enum.Enum):
    """A fork server's lifecycle: STARTING -> READY -> DEAD, or STARTING -> DEAD."""

    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"


_MOVES = {ServerState.STARTING: {ServerState.READY, ServerState.DEAD}, ServerState.READY: {ServerState.DEAD},
          ServerState.DEAD: set()}


class ForkedProc:
    """A proc forked by a server: the part of :class:`subprocess.Popen` the host agent uses.

    Attributes:
        pid: the proc's pid (a child of the host agent once reparented).
        stdin: the write end of its stdin (a binary file).
        stdout / stderr: the read ends of its output pipes (binary files).
        returncode: set by the host agent when it reaps the proc.
    """

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]):
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None


@dataclass(frozen=True)
class _Pending:
    """A request sent, its reply not read yet: what the agent keeps of the new proc's pipes."""

    tag: Any
    stdin_w: int
    stdout_r: int
    stderr_r: int


class ForkServer:
    """The host agent's handle on one fork server process (see the module docstring).

    Args:
        key: its :func:`server_key`.
        python: the interpreter.
        env: its environment (a warm spare's: the proc's variables of rank -1).
        cwd: its working directory (None: the agent's).
        preload: the modules it imports before it says it is ready.

    Raises:
        OSError: the process could not be started.
    """

    def __init__(self, key: str, python: str, env: dict[str, str], cwd: str | None, preload: Sequence[str]):
        self.key = key
        self.preload = list(preload)
        self.state = ServerState.STARTING
        self.last_used = time.monotonic()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ready_r, ready_w = os.pipe()
        try:
            self.popen = subprocess.Popen(
                [python, "-m", "monarch_nb.proc_main", "--forkserver", str(theirs.fileno()), str(ready_w), *preload],
                env=env, cwd=cwd or None, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, pass_fds=(theirs.fileno(), ready_w),
            )
        except OSError:
            self.sock.close()
            os.close(ready_r)
            raise
        finally:
            theirs.close()
            os.close(ready_w)
        self.ready_fd = ready_r
        os.set_blocking(ready_r, False)
        self.sock.setblocking(False)
        self._pending: deque[_Pending] = deque()
        #: what the host agent waits to ask until the server is ready (its rank specs)
        self.held: list[Any] = []

    @property
    def pid(self) -> int:
        return self.popen.pid

    def move(self, new: ServerState) -> None:
        """Change state; only the moves of :class:`ServerState`'s docstring are legal.

        Raises:
            ValueError: an illegal move (a bug in the caller).
        """
        if new not in _MOVES[self.state]:
            raise ValueError(f"fork server {self.pid}: {self.state.value} -> {new.value} is not a legal move")
        self.state = new

    def on_ready(self) -> None:
        """Its ready pipe became readable: one byte (ready) or EOF (it died first)."""
        try:
            data = os.read(self.ready_fd, 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        os.close(self.ready_fd)
        self.ready_fd = -1
        if self.state == ServerState.STARTING:
            self.move(ServerState.READY if data else ServerState.DEAD)

    def fork(self, env: dict[str, str], cwd: str | None, tag: Any) -> bool:
        """Ask for a new proc with environment ``env``; its reply comes through :meth:`replies`.

        Returns:
            False when the request could not be sent (too big, or the server is gone): start the
            proc another way.
        """
        data = json.dumps({"env": env, "cwd": cwd, "agent_pid": os.getpid()}).encode()
        if self.state != ServerState.READY or len(data) > MAX_REQUEST_BYTES:
            return False
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        try:
            self.sock.setblocking(True)
            socket.send_fds(self.sock, [data], [stdin_r, stdout_w, stderr_w])
        except OSError as exc:
            log.warning("fork server %d does not take requests (%s): procs start without it", self.pid, exc)
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            self.move(ServerState.DEAD)
            return False
        finally:
            self.sock.setblocking(False)
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
        self._pending.append(_Pending(tag, stdin_w, stdout_r, stderr_r))
        self.last_used = time.monotonic()
        return True

    def replies(self) -> list[tuple[Any, ForkedProc | None]]:
        """Read the replies that arrived: (tag, the new proc, or None where the fork failed)."""
        out: list[tuple[Any, ForkedProc | None]] = []
        while self._pending:
            try:
                data = self.sock.recv(_PID.size)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if len(data) != _PID.size:  # the server died: what is still pending fails
                if self.state != ServerState.DEAD:
                    self.move(ServerState.DEAD)
                break
            out.append(self._answer(self._pending.popleft(), _PID.unpack(data)[0]))
        if self.state == ServerState.DEAD:
            out.extend(self._answer(p, 0) for p in list(self._pending))
            self._pending.clear()
        return out

    @staticmethod
    def _answer(pending: _Pending, pid: int) -> tuple[Any, ForkedProc | None]:
        if pid <= 0:
            for fd in (pending.stdin_w, pending.stdout_r, pending.stderr_r):
                os.close(fd)
            return pending.tag, None
        return pending.tag, ForkedProc(pid, os.fdopen(pending.stdin_w, "wb", buffering=0),
                                       os.fdopen(pending.stdout_r, "rb", buffering=0), os.fdopen(pending.stderr_r, "rb", buffering=0))

    def pending_tags(self) -> list[Any]:
        return [p.tag for p in self._pending]

    def kill(self) -> None:
        """Kill the server (its procs live on), dead from now on: its exit, when reaped, is expected."""
        if self.state != ServerState.DEAD:
            self.move(ServerState.DEAD)
        try:
            self.popen.kill()
        except OSError:
            pass

    def close(self) -> list[tuple[Any, ForkedProc | None]]:
        """Kill the server (its procs live on); return the requests it will not answer, failed."""
        self.kill()
        failed = self.replies()
        self.sock.close()
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1
        return failed


# -- the server process ------------------------------------------------------------------------------
def serve(sock_fd: int, ready_fd: int, preload: Callable[[], None]) -> None:
    """Run as a fork server: ``preload()``, say so on ``ready_fd``, then fork on each request.

    Returns only in a forked proc, set up as the module docstring says; the server itself exits
    when its host agent closes the socket (or dies: the server has its parent-death signal).
    """
    sock = socket.socket(fileno=sock_fd)
    preload()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a preloaded module touched the GPU:
        os._exit(2)  # its children could not use it ("Cannot re-initialize CUDA in forked subprocess")
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    # Python 3.12+ warns of fork() in a process with threads; numpy's OpenBLAS pool is one, and it
    # is fork-safe (pthread_atfork)
    warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning)
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST_BYTES + 1, 3)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)  # the agent closed its end
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            first = os.fork()
        except OSError:
            _close(fds)
            sock.send(_PID.pack(0))
            continue
        if first == 0:
            try:
                second = os.fork()
            except OSError:
                sock.send(_PID.pack(0))
                os._exit(0)
            if second == 0:
                sock.close()
                _become_proc(request, fds)
                return
            sock.send(_PID.pack(second))
            os._exit(0)
        _close(fds)
        os.waitpid(first, 0)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _become_proc(request: dict, fds: list[int]) -> None:
    """In the forked proc: its pipes, session, environment, settings; then wait to be reparented."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    _close([fd for fd in fds if fd > 2])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("cwd"):
        os.chdir(request["cwd"])
    from .. import config as config_module

    fresh = config_module.Config.from_env()
    for name, value in vars(fresh).items():
        setattr(config_module.config, name, value)
    retitle([sys.executable, "-m", "monarch_nb.proc_main", "--forked"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    agent = int(request["agent_pid"])
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != agent:  # A exits right after the fork
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0005)
