"""A job's lifecycle (apply, state, kill), its state file, and JobState, as in Monarch's ``monarch.job``.

Subclasses say how to start worker loops and how to tell whether they still run; this module
attaches them, keeps the state file, and re-attaches a running allocation found in it.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

from ..actor import backend
from ..actor.host_attach import attach_to_workers
from ..actor.mesh import HostMesh

__all__ = ["Job", "JobState", "job_load", "DEFAULT_STATE_PATH", "read_announcement", "worker_argv", "start_announced",
           "pid_alive"]

log = logging.getLogger(__name__)

#: Where ``state()`` keeps the running allocation (relative to the working directory).
DEFAULT_STATE_PATH = ".monarch/job_state.json"


class JobState:
    """The host meshes of a running job, one attribute per requested mesh (``state.trainers``)."""

    def __init__(self, hosts: dict[str, HostMesh]):
        self._hosts = dict(hosts)

    def __getattr__(self, name: str) -> HostMesh:
        try:
            return self._hosts[name]
        except KeyError:
            raise AttributeError(f"{name!r} is not a host mesh of this job; its meshes: {', '.join(sorted(self._hosts))}") from None

    @property
    def names(self) -> list[str]:
        return list(self._hosts)

    def __repr__(self) -> str:
        return f"JobState({self._hosts})"


class Job(ABC):
    """A specification of hosts and, once applied, the running allocation.

    Args:
        meshes: mesh name -> number of hosts (worker loops), e.g. ``{"trainers": 4}``.
        ca: what the cluster trusts (a ``monarch-nb keys`` folder or file), passed to every
            worker and to ``attach_to_workers``; None only for workers on this machine's loopback.
        start_timeout_s: how long ``state()`` waits for every worker to announce itself.
    """

    def __init__(self, meshes: dict[str, int], ca: str | None = None, start_timeout_s: float = 300.0):
        if not meshes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in meshes.values()):
            raise ValueError(f"meshes maps names to a positive number of hosts, e.g. {{'trainers': 2}}; got {meshes!r}")
        bad = [name for name in meshes if not name.isidentifier()]
        if bad:
            raise ValueError(f"mesh names must be identifiers (they become attributes of job.state()); got {bad}")
        self.meshes = dict(meshes)
        self.ca = os.path.abspath(ca) if ca else None
        self.start_timeout_s = start_timeout_s
        self.running: dict | None = None
        self._attached: list[str] = []  # host names this job attached (detached when it is killed)

    # -- what subclasses say ----------------------------------------------------------------------
    @abstractmethod
    def spec(self) -> dict:
        """The constructor's arguments, as JSON (a cached allocation is reused only for the same spec)."""

    @abstractmethod
    def _start(self) -> dict:
        """Start the worker loops; return the running allocation (JSON-able)."""

    @abstractmethod
    def _alive(self, running: dict) -> bool:
        """The allocation still runs."""

    @abstractmethod
    def _workers(self, running: dict, deadline: float) -> dict[str, list[str]]:
        """mesh -> worker addresses, waiting until ``deadline`` (``time.monotonic()``) for them.

        Raises:
            TimeoutError: the workers did not all announce themselves in time.
        """

    @abstractmethod
    def _kill(self, running: dict) -> None:
        """End the allocation."""

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.running is not None and self._alive(self.running)

    def apply(self) -> "Job":
        """Bring the job into existence; a no-op while it runs. Returns self."""
        if not self.active:
            self.running = self._start()
        return self

    def state(self, cached_path: str | None = DEFAULT_STATE_PATH) -> JobState:
        """Attach the job's hosts: a JobState with one host mesh per requested mesh.

        A running allocation of the same spec found in ``cached_path`` is re-attached instead of
        applying a new one (a restarted kernel); otherwise the job is applied and written there.

        Raises:
            TimeoutError: the workers did not start within ``start_timeout_s``.
            AttachError: a worker could not be attached.
        """
        if not self.active and cached_path and os.path.exists(cached_path):
            try:
                cached = job_load(cached_path)
            except (ValueError, KeyError, OSError) as exc:
                log.warning("ignoring the job state in %s: %s", cached_path, exc)
            else:
                if type(cached) is type(self) and cached.spec() == self.spec() and cached.active:
                    log.info("re-attaching the running job found in %s", cached_path)
                    self.running = cached.running
        if not self.active:
            self.apply()
            if cached_path:
                self.dump(cached_path)
        assert self.running is not None  # apply() started it, or the cached job runs
        workers = self._workers(self.running, time.monotonic() + self.start_timeout_s)
        state = JobState({name: attach_to_workers(addresses, ca=self.ca) for name, addresses in workers.items()})
        self._attached = [h for name in state.names for h in getattr(state, name).host_names]
        return state

    def kill(self, cached_path: str | None = DEFAULT_STATE_PATH) -> None:
        """End the allocation (idempotent) and forget it in ``cached_path``."""
        # forget its hosts first: their loss is the job's end, not a failure to heal. Also those
        # another object of this job attached (job_load(path).kill() after a LocalJob(...).state()):
        # a controller left holding a dead worker's host would try to attach it again forever, and
        # take whatever worker listens at its address next.
        from ..runtime.controller import Controller

        existing = backend.existing()
        workers = [a for addresses in ((self.running or {}).get("workers") or {}).values() for a in addresses]
        if not isinstance(existing, Controller):  # a worker's backend: no host is attached there
            workers = []
        if existing is not None and (self._attached or workers):
            existing.detach_hosts(list(self._attached) + workers)
        self._attached = []
        if self.running is not None:
            self._kill(self.running)
            self.running = None
        if cached_path and os.path.exists(cached_path):
            try:
                if job_load(cached_path).spec() == self.spec():
                    os.remove(cached_path)
            except (ValueError, KeyError, OSError):
                pass

    # -- the state file ------------------------------------------------------------------------------
    def dump(self, path: str) -> None:
        """Write the spec and the running allocation to ``path`` (JSON)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"kind": type(self).__name__, "spec": self.spec(), "running": self.running}, f, indent=1)
        os.replace(tmp, path)

    def __repr__(self) -> str:
        state = "running" if self.active else "not running"
        return f"{type(self).__name__}({self.spec()}, {state})"


def job_load(path: str = DEFAULT_STATE_PATH) -> Job:
    """The job written to ``path`` by ``state()`` / ``dump()``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a job state file.
    """
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    from .local import LocalJob
    from .slurm import SlurmJob
    from .ssh import SSHJob

    kinds = {cls.__name__: cls for cls in (LocalJob, SSHJob, SlurmJob)}
    kind = data.get("kind")
    cls = kinds.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"{path} is not a monarch_nb job state file (kind {data.get('kind')!r})")
    job = cls(**data["spec"])
    job.running = data.get("running")
    return job


def read_announcement(line: str) -> dict:
    """A worker's announcement (``{"worker", "address", "pid", ...}``), the JSON line it prints first.

    Raises:
        ValueError: the line is not one (the worker failed to start: the line is its error).
    """
    try:
        data = json.loads(line)
    except ValueError:
        raise ValueError(f"a worker did not start: {line.strip() or '(no output)'}") from None
    if not isinstance(data, dict) or "address" not in data:
        raise ValueError(f"a worker did not start: {line.strip()}")
    return data


def worker_argv(python: str, address: str, name: str, ca: str | None) -> list[str]:
    """The command line of a worker loop (``monarch-nb worker``) listening on ``address`` as host
    ``name``, trusting ``ca`` (a key folder: CurveZMQ; a key file: HMAC only; None: loopback)."""
    argv = [python, "-m", "monarch_nb.cli", "worker", "--address", address, "--name", name]
    if ca:
        argv += ["--curve-keys" if os.path.isdir(ca) else "--key-file", ca]
    return argv


def start_announced(starters: list[Callable[[], subprocess.Popen]], deadline: float) -> tuple[list[subprocess.Popen], list[dict]]:
    """Start worker loops and read each one's announcement (its first stdout line).

    Args:
        starters: each starts one worker process with ``stdout=PIPE, text=True`` (directly, or
            through ssh) and returns it.
        deadline: ``time.monotonic()`` by which every worker must have announced itself.

    Returns:
        The processes and their announcements (``{"worker", "address", "pid", ...}``), in order.
        Their stdout is closed: a worker prints nothing else there.

    Raises:
        TimeoutError: a worker did not announce itself in time.
        ValueError: a worker failed to start (the message is what it printed).
        Either way, every worker started is killed first.
    """
    started: list[subprocess.Popen] = []
    try:
        for start in starters:
            started.append(start())
        announced = [read_announcement(first_line(p, deadline)) for p in started]
    except BaseException:
        for p in started:
            p.kill()
        raise
    finally:
        for p in started:
            if p.stdout is not None:
                p.stdout.close()
    return started, announced


def first_line(popen: subprocess.Popen, deadline: float) -> str:
    """The first line ``popen`` writes to its stdout (what it wrote, if it exits first).

    Raises:
        TimeoutError: nothing by ``deadline`` (``time.monotonic()``).
    """
    stdout = popen.stdout
    assert stdout is not None  # started with stdout=PIPE, text=True
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if sel.select(0.1):
                return stdout.readline()
            if popen.poll() is not None:
                return stdout.read() or f"(exited with {popen.returncode})"
    finally:
        sel.close()
    raise TimeoutError("a worker did not announce itself in time")


def pid_alive(pid: int) -> bool:
    """``pid`` exists on this machine and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
