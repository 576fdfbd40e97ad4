"""LocalJob: worker loops on this machine, one per host of each mesh (tests, a laptop, one big box)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

from .base import Job, pid_alive, start_announced, worker_argv

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
        names = [(mesh, f"{mesh}{i}") for mesh, count in self.meshes.items() for i in range(count)]
        started, announced = start_announced(
            [functools.partial(subprocess.Popen, worker_argv(self.python, "tcp://127.0.0.1:0", name, self.ca),
                               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
             for _mesh, name in names],
            time.monotonic() + self.start_timeout_s)
        workers: dict[str, list[str]] = {mesh: [] for mesh in self.meshes}
        for (mesh, _name), announcement in zip(names, announced):
            workers[mesh].append(announcement["address"])
        return {"workers": workers, "pids": [p.pid for p in started]}

    def _alive(self, running: dict) -> bool:
        return all(pid_alive(pid) for pid in running["pids"])

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
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

