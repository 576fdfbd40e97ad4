"""Procs forked from a fork server (a mesh that names modules to preload): they are the host
agent's children with their own environment, session and pipes; and a server that fails, at
start or later, costs speed, never a proc."""

from __future__ import annotations

import os
import signal
import sys

import pytest

import monarch_nb
from monarch_nb.runtime.controller import Controller
from monarch_nb.runtime.hosts import LOCAL
from monarch_nb.supervision.records import ProcState

from .actors import Whereabouts
from .conftest import live_processes, pid_alive, wait_until


def _forkservers(agent_pid: int) -> list[int]:
    """Pids of the fork servers that ``agent_pid`` started (a forked proc rewrites its command line)."""
    return [pid for pid, ppid, argv in live_processes() if ppid == agent_pid and b"--forkserver" in argv]


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """A module ``forkserver_probe`` on the controller's sys.path (procs share it); returns its file."""
    path = tmp_path / "forkserver_probe.py"
    path.write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def test_forked_procs_are_the_agents_children_with_their_own_rank_environment_and_output(no_leaked_processes, probe_module,
                                                                                          monkeypatch):
    monkeypatch.setenv("MONARCH_NB_TEST_MARKER", "set-before-spawn")
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 3}, preload=("json.tool", "forkserver_probe"))
    ctrl = Controller.get()
    agent = ctrl.hosts[LOCAL].pid
    try:
        servers = _forkservers(agent)
        assert len(servers) == 1, f"one fork server for the mesh, found {servers}"
        no_leaked_processes.update(servers)
        where = procs.spawn("w", Whereabouts).where.call().get(timeout=30).values()
        assert [w["rank"] for w in where] == [0, 1, 2]
        for w in where:
            with open(f"/proc/{w['pid']}/cmdline", "rb") as f:
                assert f.read().rstrip(b"\0").split(b"\0")[1:] == [b"-m", b"monarch_nb.proc_main", f"{procs.name}.{w['rank']}".encode()]
        for w in where:
            assert w["ppid"] == agent, "a forked proc is reparented to its host agent"
            assert w["own_session"] and w["marker"] == "set-before-spawn" and w["cwd"] == os.getcwd()
            assert w["preloaded"] == ["forkserver_probe", "json.tool"], "imported by the server, before the fork"
        assert len({w["numpy_draw"] for w in where}) == 3 and len({w["random_draw"] for w in where}) == 3, \
            "each forked proc seeds numpy's and Python's generators afresh"
        wait_until(lambda: all(any("says hello" in line for line in ctrl.proc_record(procs.name, r).output_tail)
                               for r in range(3)), 10, message="each rank's output forwarded")

        old = where[1]["pid"]
        procs.inject(1, "kill")
        wait_until(lambda: ctrl.proc_record(procs.name, 1).state == ProcState.FAILED, 10, message="rank 1 failed")
        assert "SIGKILL" in str(ctrl.proc_record(procs.name, 1).exit_info), "the agent reaped it and read its signal"
        procs.restart(1)
        again = procs.spawn("w2", Whereabouts).where.call().get(timeout=30).values()
        assert again[1]["pid"] != old and again[1]["ppid"] == agent and again[1]["preloaded"] == where[1]["preloaded"]
        assert _forkservers(agent) == servers, "the restart was forked from the same server"
    finally:
        no_leaked_processes.update(r.pid for r in ctrl.mesh_records(procs.name))
        procs.stop()


def test_a_fork_server_that_dies_at_start_or_later_costs_speed_not_procs(no_leaked_processes, probe_module):
    probe_module.write_text("import os\nos._exit(3)  # kills whoever imports it: the fork server\n")
    ctrl = Controller.get()
    agent = ctrl.hosts[LOCAL].pid
    before = set(_forkservers(agent))  # an earlier mesh's server lives on, for the next mesh like it
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2}, preload=("forkserver_probe",))
    try:
        where = procs.spawn("w", Whereabouts).where.call().get(timeout=30).values()
        assert [w["preloaded"] for w in where] == [[], []], "started as fresh interpreters"
        assert all(w["ppid"] == agent for w in where)
        assert set(_forkservers(agent)) <= before
    finally:
        no_leaked_processes.update(r.pid for r in ctrl.mesh_records(procs.name))
        procs.stop()

    probe_module.write_text("LOADED = True\n")
    sys.modules.pop("forkserver_probe", None)
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2}, preload=("json.tool", "forkserver_probe"))
    try:
        servers = wait_until(lambda: sorted(set(_forkservers(agent)) - before), 10, message="a fork server for the second mesh")
        no_leaked_processes.update(servers)
        os.kill(servers[0], signal.SIGKILL)
        wait_until(lambda: not pid_alive(servers[0]), 10, message="the fork server gone")
        procs.inject(0, "kill")
        wait_until(lambda: ctrl.proc_record(procs.name, 0).state == ProcState.FAILED, 10, message="rank 0 failed")
        procs.restart(0)
        where = procs.spawn("w", Whereabouts).where.call().get(timeout=30).values()
        assert where[0]["preloaded"] == [] and where[1]["preloaded"] == ["forkserver_probe", "json.tool"], \
            "rank 0 restarted as a fresh interpreter; rank 1 still the forked one"
    finally:
        no_leaked_processes.update(r.pid for r in ctrl.mesh_records(procs.name))
        procs.stop()
