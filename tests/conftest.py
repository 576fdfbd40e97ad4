"""Shared fixtures: real meshes with short heartbeats, and a check that no test leaks a process."""

from __future__ import annotations

import time

import pytest

import monarch_nb
from monarch_nb.runtime.controller import Controller

monarch_nb.configure(heartbeat_interval_s=0.1, hang_timeout_s=1.0)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


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


def _known_pids(controller: Controller) -> set[int]:
    pids = {rec.pid for rec in controller.procs.values() if rec.pid}
    pids |= {agent.popen.pid for agent in controller.agents.values() if agent.popen is not None}
    return pids


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes():
    """After the session, every worker and host agent any test started must be gone."""
    seen: set[int] = set()
    yield seen
    controller = Controller.existing()
    if controller is not None:
        seen |= _known_pids(controller)
        controller.shutdown()
    wait_until(lambda: not [p for p in seen if pid_alive(p)], 5.0, message=f"no leaked process among {sorted(seen)}")


@pytest.fixture
def procs4(no_leaked_processes):
    """Four local worker procs with dims {"gpus": 4}; stopped after the test."""
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 4})
    yield procs
    controller = Controller.existing()
    if controller is not None:
        no_leaked_processes |= _known_pids(controller)
    procs.stop()
