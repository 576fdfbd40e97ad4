"""LocalJob: worker loops on this machine, one per host of each mesh (tests, a laptop, one big box)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .base import Job, read_announcement

__all__ = ["LocalJob"]


class LocalJob(Job):
    """Worker loops on this machine's loopback, each its own "host" of a mesh.

    Args:
        meshes: mesh name -> number of hosts, e.g. ``{"trainers": 2}``.
        ca: the cluster's keys (optional on loopback).
        python: the interpreter that runs the workers.

    Example::

        job = LocalJob({"trainers": 2})
        procs = job.state().trainers.spawn_procs(per_host={"gpus": 2})   # dims {"hosts": 2, "gpus": 2}
        ...
        job.kill()
    """

    def __init__(self, meshes: dict[str, int], ca: str | None = None, python: str = sys.executable,
                 start_timeout_s: float = 60.0):
        super().__init__(meshes, ca, start_timeout_s)
        self.python = python

    def spec(self) -> dict:
        return {"meshes": self.meshes, "ca": self.ca, "python": self.python, "start_timeout_s": self.start_timeout_s}

    def _start(self) -> dict:
        deadline = time.monotonic() + self.start_timeout_s
        started: list[subprocess.Popen] = []
        try:
            for mesh, count in self.meshes.items():
                for i in range(count):
                    argv = [self.python, "-m", "monarch_nb.cli", "worker", "--address", "tcp://127.0.0.1:0",
                            "--name", f"{mesh}{i}"]
                    if self.ca:
                        argv += ["--curve-keys" if os.path.isdir(self.ca) else "--key-file", self.ca]
                    started.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                                    start_new_session=True))
            addresses = iter([read_announcement(_first_line(p, deadline))["address"] for p in started])
            workers = {mesh: [next(addresses) for _ in range(count)] for mesh, count in self.meshes.items()}
        except BaseException:
            for p in started:
                p.kill()
            raise
        finally:
            for p in started:
                if p.stdout is not None:
                    p.stdout.close()
        return {"workers": workers, "pids": [p.pid for p in started]}

    def _alive(self, running: dict) -> bool:
        return all(_pid_alive(pid) for pid in running["pids"])

    def _workers(self, running: dict, deadline: float) -> dict[str, list[str]]:
        return running["workers"]

    def _kill(self, running: dict) -> None:
        for pid in running["pids"]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for pid in running["pids"]:
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _first_line(popen: subprocess.Popen, deadline: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(popen.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if sel.select(0.1):
            return popen.stdout.readline()
        if popen.poll() is not None:
            return popen.stdout.read() or f"(exited with {popen.returncode})"
    raise TimeoutError("a worker did not announce itself in time")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
