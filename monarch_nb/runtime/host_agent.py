"""Host agent main: spawns this host's procs, forwards their output, reports their exits at once.

Runs in the host agent process, started by the controller as ``python -m
monarch_nb.runtime.host_agent <name>`` (environment: :class:`~.protocol.AgentEnv`). It is the parent
of every proc on its host, so it learns of a proc's death from the OS (SIGCHLD -> waitpid) with
no polling, and it owns the procs' stdout/stderr pipes, so output written just before a crash is
still read and forwarded — before the exit report, on the same socket, so in order.

It exits, taking its procs with it (they have PR_SET_PDEATHSIG), when its controller goes away:
checked every ``orphan_check_s`` through the parent pid.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..transport import shm
from ..transport.channel import Channel
from ..transport.wire import Signer
from .protocol import CONTROLLER, AgentEnv, Kind, ProcEnv

log = logging.getLogger("monarch_nb.host_agent")

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP, "SIGCONT": signal.SIGCONT, "SIGTERM": signal.SIGTERM, "SIGSEGV": signal.SIGSEGV, "SIGINT": signal.SIGINT}


@dataclass
class ChildProc:
    identity: str
    rank: int
    popen: subprocess.Popen
    fds: dict = field(default_factory=dict)  # fd -> stream name
    seq: dict = field(default_factory=lambda: {"stdout": 0, "stderr": 0})


class HostAgent:
    def __init__(self, name: str, env: AgentEnv):
        self.name = name
        self.env = env
        self.channel = Channel(f"{name}#{os.getpid()}", Signer(bytes.fromhex(env.key_hex)), self._on_message)
        self._handlers = {
            Kind.SPAWN_PROCS: lambda header, body: [self._spawn(spec) for spec in json.loads(bytes(body))],
            Kind.SIGNAL: lambda header, body: self._signal(header["proc"], header["signal"]),
            Kind.SHUTDOWN: lambda header, body: self.shutdown(),
        }
        self.children: dict[int, ChildProc] = {}  # pid -> child
        self._sigchld_r, self._sigchld_w = os.pipe()
        os.set_blocking(self._sigchld_r, False)
        os.set_blocking(self._sigchld_w, False)

    # -- messages from the controller ----------------------------------------------------------------
    def _on_message(self, header: dict, body: Any, buffers: list, frames: list) -> None:
        handler = self._handlers.get(header["kind"])
        if handler is None:
            log.warning("unknown message kind %r from %s", header["kind"], header["src"])
            return
        handler(header, body)

    def _spawn(self, spec: dict) -> None:
        """Start one proc from its spec (see :func:`monarch_nb.runtime.launch.proc_specs`)."""
        proc_env = ProcEnv.from_json(spec["env"])
        proc_env.key_hex = self.env.key_hex
        proc_env.agent_pid = os.getpid()
        base = spec.get("base_env")
        env = dict(base) if base is not None else dict(os.environ)
        env.update(proc_env.to_env())
        env["PYTHONUNBUFFERED"] = "1"
        try:
            popen = subprocess.Popen(
                [spec.get("python") or sys.executable, "-m", "monarch_nb.proc_main", spec["identity"]],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a terminal's Ctrl-C goes to the controller, not to workers
                cwd=spec.get("cwd") or None,
            )
        except OSError as exc:
            self.channel.send(CONTROLLER, {"kind": Kind.PROC_EXITED, "proc": spec["identity"], "pid": 0, "returncode": 127,
                                           "signal": None, "detail": f"could not start: {exc}"})
            return
        child = ChildProc(spec["identity"], spec["rank"], popen)
        for stream, pipe in (("stdout", popen.stdout), ("stderr", popen.stderr)):
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            child.fds[fd] = stream
            self.channel.add_reader(fd, self._read_output)
        self.children[popen.pid] = child
        self.channel.send(CONTROLLER, {"kind": Kind.PROC_SPAWNED, "proc": spec["identity"], "pid": popen.pid})

    def _signal(self, identity: str, signame: str) -> None:
        for pid, child in self.children.items():
            if child.identity == identity:
                try:
                    os.kill(pid, SIGNALS[signame])
                except ProcessLookupError:
                    pass

    # -- output --------------------------------------------------------------------------------------
    def _child_of_fd(self, fd: int) -> ChildProc | None:
        for child in self.children.values():
            if fd in child.fds:
                return child
        return None

    def _read_output(self, fd: int) -> None:
        child = self._child_of_fd(fd)
        if child is None:
            self.channel.remove_reader(fd)
            return
        self._drain(child, fd)

    def _drain(self, child: ChildProc, fd: int) -> None:
        """Read and forward everything buffered in ``fd``; close it at EOF."""
        stream = child.fds[fd]
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    log.warning("read from %s failed: %s", child.identity, exc)
                data = b""
            if not data:
                self.channel.remove_reader(fd)
                del child.fds[fd]
                os.close(fd)
                return
            child.seq[stream] += 1
            self.channel.send(
                CONTROLLER,
                {"kind": Kind.OUTPUT, "proc": child.identity, "rank": child.rank, "stream": stream, "oseq": child.seq[stream]},
                data,
            )

    # -- exits ---------------------------------------------------------------------------------------
    def _on_sigchld(self, _fd: int) -> None:
        try:
            os.read(self._sigchld_r, 4096)
        except BlockingIOError:
            pass
        self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            for fd in list(child.fds):  # output written before death goes out before the exit report
                self._drain(child, fd)
            for fd in list(child.fds):  # a grandchild may hold the pipe: stop reading it
                self.channel.remove_reader(fd)
                os.close(fd)
            child.fds.clear()
            returncode = os.waitstatus_to_exitcode(status)
            child.popen.returncode = returncode
            signame = signal.Signals(-returncode).name if returncode < 0 else None
            self.channel.send(
                CONTROLLER,
                {"kind": Kind.PROC_EXITED, "proc": child.identity, "pid": pid, "returncode": returncode, "signal": signame, "time": time.time()},
            )

    def _check_parent(self) -> None:
        if self.env.controller_pid and os.getppid() != self.env.controller_pid:
            self.shutdown()

    def shutdown(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2.0
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.005)
        self.channel.close()
        if self.env.run_id:  # files of messages that were never received (their receiver died)
            shm.remove_orphans(self.env.run_id)
        os._exit(0)

    def main(self) -> None:
        signal.set_wakeup_fd(self._sigchld_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.channel.add_reader(self._sigchld_r, self._on_sigchld)
        self.channel.connect(self.env.controller)
        self.channel.every(self.env.orphan_check_s, self._check_parent)
        self.channel.send(CONTROLLER, {"kind": Kind.AGENT_HELLO, "pid": os.getpid(), "host": self.name})
        self._check_parent()
        self.channel.run_forever()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    HostAgent(sys.argv[1], AgentEnv.from_env(os.environ)).main()


if __name__ == "__main__":
    main()
