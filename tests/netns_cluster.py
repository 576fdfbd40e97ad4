"""Test helper: hosts as Linux network namespaces on this machine, each running a real worker loop.

A bridge in the root namespace (the controller's side) and, per host, a namespace joined to it by
a veth pair, with addresses in a /24 of 10.x.y chosen from this process's pid (two concurrent runs
do not collide). ``cut(i)`` / ``restore(i)`` take host i's link down and up (a partition). Every
namespace, link and process made here is removed by :meth:`NetnsCluster.close`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

PORT = 26600


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def namespaces_unavailable() -> str | None:
    """Why this machine cannot run namespace hosts, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"mnbprobe{os.getpid()}"
    try:
        result = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if result.returncode != 0:
        return f"the kernel refuses network namespaces: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsCluster:
    """``hosts`` namespaces with a worker loop each (see the module docstring).

    Args:
        hosts: how many hosts.
        ca: the key folder or file the workers trust (``monarch-nb keys``).
        hide: folders that the hosts do not have: each worker loop (and so its agent and procs)
            runs in a mount namespace of its own where an empty tmpfs covers them, as on a
            machine that shares no filesystem with the controller.
    """

    def __init__(self, hosts: int, ca: str, workers: bool = True, hide: tuple[str, ...] = ()):
        self.tag = f"mn{os.getpid() % 10000:04d}"
        self.subnet = f"10.{100 + os.getpid() % 100}.{(os.getpid() // 100) % 250}"
        self.bridge = f"{self.tag}b"
        self.bridge_ip = f"{self.subnet}.1"
        self.hosts = hosts
        self.ca = ca
        self.start_workers = workers
        self.hide = tuple(hide)
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.workers: list[subprocess.Popen] = []
        self.addresses: list[str] = []

    def namespace(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def host_ip(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def veth(self, i: int) -> str:
        return f"{self.tag}v{i}"

    def start(self, timeout_s: float = 60.0) -> "NetnsCluster":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.links.append(self.bridge)
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.hosts):
                ns, veth, peer = self.namespace(i), self.veth(i), f"{self.tag}p{i}"
                _ip("netns", "add", ns)
                self.namespaces.append(ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
                self.links.append(veth)
                _ip("link", "set", peer, "netns", ns)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", ns, "addr", "add", f"{self.host_ip(i)}/24", "dev", peer)
                _ip("-n", ns, "link", "set", peer, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            for i in range(self.hosts if self.start_workers else 0):
                self.workers.append(self._start_worker(i))
            deadline = time.monotonic() + timeout_s
            for worker in self.workers:
                line = self._first_line(worker, deadline)
                self.addresses.append(json.loads(line)["address"])
        except BaseException:
            self.close()
            raise
        return self

    def _start_worker(self, i: int) -> subprocess.Popen:
        address = f"tcp://{self.host_ip(i)}:{PORT}"
        flag = "--curve-keys" if os.path.isdir(self.ca) else "--key-file"
        hiding: list[str] = []
        if self.hide:  # mount tmpfs over each folder, then exec the worker (its pid stays the Popen's)
            hiding = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                      'while [ "$1" != -- ]; do mount -t tmpfs -o size=1m tmpfs "$1" || exit 97; shift; done; shift; exec "$@"',
                      "sh", *self.hide, "--"]
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(i), *hiding, sys.executable, "-m", "monarch_nb.cli", "worker",
             "--address", address, flag, self.ca, "--name", f"ns{i}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )

    @staticmethod
    def _first_line(worker: subprocess.Popen, deadline: float) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(worker.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited ({worker.returncode}): {worker.stderr.read()}")
            if sel.select(0.1):
                return worker.stdout.readline()
        raise TimeoutError("a worker did not start in time")

    def run_in(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``i``'s namespace (a daemon such as sshd); stopped by close()."""
        popen = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *argv], start_new_session=True, **kwargs)
        self.workers.append(popen)
        return popen

    def kill_worker(self, i: int) -> None:
        """SIGKILL host ``i``'s worker loop (not what it started)."""
        worker = self.workers[i]
        worker.kill()
        worker.wait()

    def start_worker_again(self, i: int, timeout_s: float = 60.0) -> None:
        """Start host ``i``'s worker loop again, at the same address."""
        self.workers[i] = self._start_worker(i)
        self._first_line(self.workers[i], time.monotonic() + timeout_s)

    def cut(self, i: int) -> None:
        """Partition host ``i``: its link goes down."""
        _ip("link", "set", self.veth(i), "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def pids_in(self, i: int) -> list[int]:
        """Pids of the processes running in host ``i``'s namespace."""
        out = _ip("netns", "pids", self.namespace(i), check=False).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGTERM)
        for worker in self.workers:
            try:
                worker.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
            for pipe in (worker.stdout, worker.stderr):
                if pipe is not None:
                    pipe.close()
        for ns in self.namespaces:  # anything left inside (an agent, a proc) ends with its namespace's hosts
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)
        for link in reversed(self.links):
            _ip("link", "del", link, check=False)
        self.namespaces, self.links, self.workers = [], [], []


def require_namespaces() -> None:
    why = namespaces_unavailable()
    if why is not None:
        print(f"SKIPPED multi-host namespace tests: {why}", file=sys.stderr)
        pytest.skip(why)
