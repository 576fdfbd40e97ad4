"""Shared fixtures: the suite's settings, real meshes with short heartbeats, and leak checks.

Tiers: tests under ``tests/unit/`` start no process and run alone with ``pytest -m "not
cluster"``; every other test is marked ``cluster`` here (kernel and browser tests carry their own
markers too). Fixtures are written to be overridden: a module that defines its own ``transport``
or ``procs4`` fixture runs the same tests on another set-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import tempfile
import time
from typing import Any, Iterator

import pytest

import monarch_nb
from monarch_nb.config import config

#: The suite's runtime settings: short heartbeats so hangs are found quickly.
SUITE_SETTINGS = {"heartbeat_interval_s": 0.1, "hang_timeout_s": 1.0}

_UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit") + os.sep


def pytest_ignore_collect(collection_path, config: pytest.Config):
    """With ``-m "not cluster"``, do not even import the cluster modules (they import torch): the
    unit tier then runs in a few seconds."""
    if config.getoption("markexpr", "").replace(" ", "") == "notcluster" and collection_path.suffix == ".py":
        if not str(collection_path).startswith(_UNIT_DIR) and collection_path.name != "conftest.py":
            return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not str(item.path).startswith(_UNIT_DIR):
            item.add_marker(pytest.mark.cluster)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def live_processes() -> list[tuple[int, int, list[bytes]]]:
    """``(pid, parent pid, command line)`` of every live (not zombie) process of this machine."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                after = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
        except (OSError, IndexError):
            continue
        if after[0] not in ("Z", "X"):
            found.append((int(entry), int(after[1]), argv))
    return found


def wait_until(predicate, timeout_s: float, interval_s: float = 0.01, message: str = "condition"):
    """Poll ``predicate`` until it is truthy or ``timeout_s`` passes; return its value or fail."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {message}")
        time.sleep(interval_s)


def hang_deadline_s() -> float:
    """How long finding a hang may take under the current settings, with slack for a loaded machine."""
    return config.hang_timeout_s + 2 * config.heartbeat_interval_s + 3.0


def _controller():
    from monarch_nb.runtime.controller import Controller

    return Controller.existing()


def _known_pids(controller) -> set[int]:
    return set(controller.pids())


def _owner(name: str, field: int) -> int:
    parts = name.split("-")
    return int(parts[field]) if len(parts) > field and parts[field].isdigit() else -1


def _run_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "monarch_nb-*")))


#: run folders (and worker status files) that were there before this session: another program's
#: (a user's script SIGKILLed last week), not the suite's to judge
_BEFORE = _run_dirs()


def _leftovers(pids: set[int]) -> tuple[list[str], list[str]]:
    """Run folders made during this session by this process or by dead controllers (kernels the
    tests started), and shared-memory files written by this process or by its procs."""
    dirs = [d for d in sorted(_run_dirs() - _BEFORE)
            if _owner(os.path.basename(d), 1) == os.getpid()
            or (_owner(os.path.basename(d), 1) > 0 and not pid_alive(_owner(os.path.basename(d), 1)))]
    shm = [f for f in glob.glob("/dev/shm/monarch_nb-*") if _owner(os.path.basename(f), 2) in pids | {os.getpid()}]
    return dirs, shm


@pytest.fixture(scope="module")
def patient_hang_timeout():
    """A 3 s hang timeout for a training module (``pytestmark = pytest.mark.usefixtures(...)``):
    workers importing torch on a busy 2-core machine can miss 1 s of heartbeats; the tests fence a
    real SIGSTOP, so 3 s keeps them about training, not about load."""
    before = config.hang_timeout_s
    monarch_nb.configure(hang_timeout_s=3.0)
    yield
    monarch_nb.configure(hang_timeout_s=before)


@pytest.fixture(scope="session", autouse=True)
def suite_settings():
    """The suite's settings, set once before any mesh starts (never at import time)."""
    saved = dataclasses.asdict(config)
    monarch_nb.configure(**SUITE_SETTINGS)
    yield config
    monarch_nb.configure(**saved)


@pytest.fixture(autouse=True)
def restore_settings(suite_settings):
    """A test that changes settings (``monarch_nb.configure``) cannot leak them into the next."""
    saved = dataclasses.asdict(config)
    yield
    changed = {k: v for k, v in saved.items() if getattr(config, k) != v}
    if changed:
        monarch_nb.configure(**changed)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes(suite_settings):
    """After the session, every worker and host agent any test started must be gone, and with
    them the run folders and shared-memory files of this process's controllers."""
    seen: set[int] = set()
    yield seen
    controller = _controller()
    if controller is not None:
        seen |= _known_pids(controller)
        controller.shutdown()
    wait_until(lambda: not [p for p in seen if pid_alive(p)], 5.0, message=f"no leaked process among {sorted(seen)}")
    # fork servers are the host agents' children, unknown to the controller: one whose agent is gone is a leak
    wait_until(lambda: not [pid for pid, ppid, argv in live_processes() if b"--forkserver" in argv and ppid == 1], 5.0,
               message="no orphaned fork server")
    wait_until(lambda: _leftovers(seen) == ([], []), 5.0, message=f"no run folder or /dev/shm file left: {_leftovers(seen)}")


@contextlib.contextmanager
def local_hosts(no_leaked_processes: set[int], hosts: int, gpus: int) -> Iterator[tuple[Any, Any, Any]]:
    """A LocalJob of ``hosts`` local hosts (real host agents) with ``gpus`` procs each: yields
    (the controller, the hosts' mesh, the procs); the procs are stopped and the job killed after,
    its agents known to ``no_leaked_processes``."""
    from monarch_nb.job import LocalJob
    from monarch_nb.runtime.controller import Controller

    job = LocalJob({"trainers": hosts})
    try:
        host_mesh = job.state().trainers
        procs = host_mesh.spawn_procs(per_host={"gpus": gpus})
        ctrl = Controller.get()
        no_leaked_processes.update(h.pid for h in ctrl.hosts.values() if h.name in host_mesh.host_names)
        yield ctrl, host_mesh, procs
        procs.stop()
    finally:
        job.kill()


@pytest.fixture
def transport() -> str:
    """The controller's transport for cluster fixtures; a module may parametrise it."""
    return config.transport


@pytest.fixture
def procs4(no_leaked_processes, transport):
    """Four local worker procs with dims {"gpus": 4}; stopped after the test."""
    if transport != config.transport:  # a new controller on the other transport
        old = _controller()
        if old is not None:
            no_leaked_processes.update(_known_pids(old))
            old.shutdown()
        monarch_nb.configure(transport=transport)
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 4})
    yield procs
    controller = _controller()
    if controller is not None:
        no_leaked_processes |= _known_pids(controller)
    procs.stop()
    if transport != "ipc" and controller is not None:
        controller.shutdown()  # the next test starts on the suite's transport again
