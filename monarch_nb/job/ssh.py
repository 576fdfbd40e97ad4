"""SSHJob: worker loops started on named hosts through the system ``ssh``."""

from __future__ import annotations

import functools
import os
import shlex
import signal
import subprocess
import time

from .base import Job, pid_alive, start_announced, worker_argv

__all__ = ["SSHJob"]


class SSHJob(Job):
    """Start ``monarch-nb worker`` on each host with ``ssh HOST -n ...`` and attach them.

    The hosts need monarch_nb installed (``python`` names the interpreter there) and the
    cluster's keys at the same path as ``ca``. Each worker listens on ``tcp://HOST:port``, so
    ``HOST`` must be an address of that host that this machine reaches.

    Args:
        hosts: the hosts (names or addresses as ssh and the controller reach them).
        mesh: the name of the host mesh in ``job.state()`` (default ``"hosts"``).
        ca: the cluster's key folder or file (required for hosts off this machine).
        port: the port each worker listens on.
        python: the interpreter on the hosts.
        ssh_args: extra arguments for ssh (``["-i", KEY, "-p", "2222", "-o", "..."]``).

    Example::

        job = SSHJob(["gpu1", "gpu2"], ca="/shared/monarch-keys")
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 8})
    """

    def __init__(self, hosts: list[str], mesh: str = "hosts", ca: str | None = None, port: int = 26600,
                 python: str = "python3", ssh_args: list[str] | tuple = (), start_timeout_s: float = 120.0):
        if isinstance(hosts, str) or not hosts:
            raise ValueError(f"hosts is a non-empty list of host names, got {hosts!r}")
        super().__init__({mesh: len(hosts)}, ca, start_timeout_s)
        self.hosts, self.mesh, self.port, self.python, self.ssh_args = list(hosts), mesh, port, python, list(ssh_args)

    def spec(self) -> dict:
        return {"hosts": self.hosts, "mesh": self.mesh, "ca": self.ca, "port": self.port, "python": self.python,
                "ssh_args": self.ssh_args, "start_timeout_s": self.start_timeout_s}

    def _ssh(self, host: str, command: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ssh", *self.ssh_args, "-n", host, command], stdin=subprocess.DEVNULL, **kwargs)

    def _start(self) -> dict:
        started, announced = start_announced(
            [functools.partial(self._ssh, host, "exec " + shlex.join(worker_argv(self.python, f"tcp://{host}:{self.port}",
                                                                                 host, self.ca)),
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
             for host in self.hosts],
            time.monotonic() + self.start_timeout_s)
        return {"workers": {self.mesh: [a["address"] for a in announced]}, "ssh_pids": [p.pid for p in started],
                "remote_pids": [a["pid"] for a in announced]}

    def _alive(self, running: dict) -> bool:
        return all(pid_alive(pid) for pid in running["ssh_pids"])

    def _workers(self, running: dict, deadline: float) -> dict[str, list[str]]:
        return running["workers"]

    def _kill(self, running: dict) -> None:
        stoppers = [self._ssh(host, f"kill {int(pid)}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for host, pid in zip(self.hosts, running["remote_pids"])]
        for p in stoppers:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for pid in running["ssh_pids"]:
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
