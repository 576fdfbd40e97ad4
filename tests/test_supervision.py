"""Supervision: each fault kind is detected as a typed event, failures stay isolated, policies,
``__supervise__``, restart in place, fencing, chaos schedules and bad injections.

Real procs, real signals. One 4-proc mesh serves the module; after each test every rank that is
not healthy is restarted and in-proc faults are cleared, so tests stay independent and fast.
"""

from __future__ import annotations

import time

import pytest
import torch

import monarch_nb
from monarch_nb import ActorError, SupervisionError
from monarch_nb.config import config
from monarch_nb.debug import format_stacks
from monarch_nb.faults.chaos import ChaosSchedule
from monarch_nb.runtime.controller import Controller
from monarch_nb.runtime.heartbeat_relay import IDLE_HEARTBEAT_EVERY
from monarch_nb.runtime.protocol import Kind
from monarch_nb.supervision.records import ProcState
from monarch_nb.supervision.policy import Failure
from monarch_nb.supervision.tree import find, render

from .actors import Counter, Worker
from .conftest import pid_alive, wait_until

DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def mesh(no_leaked_processes):
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 4})
    workers = procs.spawn("w", Worker)
    counters = procs.spawn("c", Counter, 5)
    yield procs, workers, counters
    ctrl = Controller.get()
    no_leaked_processes |= {rec.pid for rec in ctrl.procs.values() if rec.pid}
    procs.stop()


@pytest.fixture
def m(mesh, no_leaked_processes):
    """The module's mesh, all ranks healthy, policy escalate, no in-proc fault armed."""
    procs, workers, counters = mesh
    ctrl = Controller.get()
    yield procs, workers, counters, ctrl
    procs.supervise("escalate")
    for rank in range(4):
        rec = ctrl.proc_record(procs.name, rank)
        no_leaked_processes.add(rec.pid)
        if rec.state == ProcState.RESTARTING:
            rec.ready.wait(DEADLINE_S)
        if rec.state not in (ProcState.HEALTHY, ProcState.BUSY):
            procs.restart(rank, timeout_s=30)
        ctrl.clear_faults(procs.name, rank)
        no_leaked_processes.add(rec.pid)
    assert workers.echo.call(0).get(timeout=DEADLINE_S).values() == [0] * 4


def wait_event(ctrl: Controller, procs, kind: str, rank: int, since: int, timeout: float = DEADLINE_S):
    event = ctrl.events.wait_for(lambda e: e.kind == kind and e.mesh == procs.name and e.rank == rank, timeout, since)
    assert event is not None, f"no {kind} event for rank {rank} within {timeout} s; events: {ctrl.events.events(since_seq=since)}"
    return event


def injected_at(ctrl: Controller, procs, rank: int, since: int) -> float:
    return wait_event(ctrl, procs, "fault_injected", rank, since).monotonic


# -- one test per fault kind ------------------------------------------------------------------------
def test_kill_fails_in_flight_call_and_keeps_healthy_slice(m):
    procs, workers, _, ctrl = m
    since = ctrl.events.next_seq
    old_pid = ctrl.proc_record(procs.name, 1).pid
    in_flight = workers.slice(gpus=1).sleep.call_one(30.0)
    wait_until(lambda: ctrl.proc_record(procs.name, 1).state == "busy", 5, message="rank 1 busy in sleep")
    procs.inject(1, "kill")
    event = wait_event(ctrl, procs, "proc_exited", 1, since)
    assert event.cause == "SIGKILL" and event.pid == old_pid and event.coords == {"gpus": 1}
    assert injected_at(ctrl, procs, 1, since) <= event.monotonic  # seen from the OS, not a timeout:
    assert event.monotonic - injected_at(ctrl, procs, 1, since) < config.hang_timeout_s  # bench/detection.py has the figure
    with pytest.raises(SupervisionError, match=r"rank 1 failed \(SIGKILL\)") as info:
        in_flight.get(timeout=DEADLINE_S)
    assert info.value.rank == 1 and info.value.signal == "SIGKILL"
    later = workers.slice(gpus=1).echo.call_one(1)
    assert later.done()  # fails fast: completed when made, nothing sent to a dead rank
    with pytest.raises(SupervisionError, match="rank 1"):
        later.get(timeout=0)
    healthy = workers.slice(gpus=slice(2, 4))
    for i in range(5):
        assert healthy.echo.call(i).get(timeout=DEADLINE_S).values() == [i, i]
    assert workers.slice(gpus=0).echo.call_one("ok").get(timeout=DEADLINE_S) == "ok"
    wait_until(lambda: not pid_alive(old_pid), 5, message="the killed pid to be gone")
    assert ctrl.events.wait_for(lambda e: e.kind == "escalated" and e.rank == 1, DEADLINE_S, since) is not None


def test_segfault(m):
    procs, _, _, ctrl = m
    since = ctrl.events.next_seq
    procs.inject(2, "segfault")
    event = wait_event(ctrl, procs, "proc_exited", 2, since)
    assert event.cause == "SIGSEGV" and "SIGSEGV" in event.detail


def test_exit_code(m):
    procs, workers, _, ctrl = m
    since = ctrl.events.next_seq
    procs.inject(3, "exit", code=7)
    event = wait_event(ctrl, procs, "proc_exited", 3, since)
    assert event.cause == "exit 7" and event.coords == {"gpus": 3}
    with pytest.raises(SupervisionError, match=r"rank 3 failed \(exit 7\)"):
        workers.slice(gpus=3).echo.call_one(1).get(timeout=DEADLINE_S)


def test_hang_is_detected_then_fenced(m):
    procs, workers, _, ctrl = m
    since = ctrl.events.next_seq
    pid = ctrl.proc_record(procs.name, 0).pid
    in_flight = workers.slice(gpus=0).sleep.call_one(30.0)
    wait_until(lambda: ctrl.proc_record(procs.name, 0).state == "busy", 5, message="rank 0 busy in sleep")
    procs.inject(0, "hang")
    hung = wait_event(ctrl, procs, "proc_hung", 0, since)
    assert hung.cause == "heartbeat" and hung.pid == pid
    assert hung.monotonic - injected_at(ctrl, procs, 0, since) <= config.hang_timeout_s + 1.0
    fenced = wait_event(ctrl, procs, "proc_fenced", 0, since)
    assert fenced.cause == "fencing"
    exited = wait_event(ctrl, procs, "proc_exited", 0, since)
    assert exited.cause == "fenced"
    wait_until(lambda: not pid_alive(pid), 5, message="the stopped proc to be killed")
    with pytest.raises(SupervisionError, match="rank 0 failed"):
        in_flight.get(timeout=DEADLINE_S)
    assert workers.slice(gpus=1).echo.call_one(1).get(timeout=DEADLINE_S) == 1


def test_stall_holding_the_gil_is_a_hang_and_its_stacks_are_kept_before_the_fencing(m):
    procs, _, _, ctrl = m
    since = ctrl.events.next_seq
    printed: list = []
    ctrl.output_sinks.append(printed.append)
    try:
        procs.inject(1, "stall", seconds=4.0)
        hung = wait_event(ctrl, procs, "proc_hung", 1, since)
        assert hung.cause == "heartbeat"
        assert hung.monotonic - injected_at(ctrl, procs, 1, since) <= config.hang_timeout_s + 1.0
        assert wait_event(ctrl, procs, "proc_exited", 1, since).cause == "fenced"
    finally:
        ctrl.output_sinks.remove(printed.append)
    # where it hung: its agent took the stacks through faulthandler (the GIL held) before the
    # SIGKILL, on the socket the exit report took after, so they are here by the exit event
    stderr = "\n".join(line.text for line in printed if line.rank == 1 and line.stream == "stderr")
    assert "was judged hung" in stderr and "in _hold_gil" in stderr, stderr
    shown = format_stacks(procs, [1])
    assert "just before it was fenced" in shown and "_hold_gil" in shown, shown


def test_a_hung_rank_restarted_at_once_still_has_its_stacks_taken_before_the_kill(m):
    """The restart's own SIGKILL, sent right behind the fencing (no backoff), waits for the
    stacks: they are printed before the rank is back."""
    procs, workers, _, ctrl = m
    procs.supervise("restart", max_restarts=1, backoff_s=0.0)
    since = ctrl.events.next_seq
    printed: list = []
    ctrl.output_sinks.append(printed.append)
    try:
        procs.inject(2, "stall", seconds=10.0)
        wait_event(ctrl, procs, "proc_hung", 2, since)
        wait_event(ctrl, procs, "proc_restarted", 2, since)
    finally:
        ctrl.output_sinks.remove(printed.append)
    stderr = "\n".join(line.text for line in printed if line.rank == 2 and line.stream == "stderr")
    assert "was judged hung" in stderr and "in _hold_gil" in stderr, stderr
    assert workers.slice(gpus=2).echo.call_one(2).get(timeout=DEADLINE_S) == 2


def test_raise_gives_actor_error_and_proc_lives(m):
    procs, workers, _, ctrl = m
    since = ctrl.events.next_seq
    one = workers.slice(gpus=2)
    pid = one.pid.call_one().get(timeout=DEADLINE_S)
    procs.inject(2, "raise")
    with pytest.raises(ActorError, match="injected fault: raise") as info:
        one.echo.call_one(1).get(timeout=DEADLINE_S)
    assert info.value.rank == 2
    event = wait_event(ctrl, procs, "actor_error", 2, since)
    assert event.cause == "exception" and "injected fault: raise" in event.detail
    assert one.pid.call_one().get(timeout=DEADLINE_S) == pid  # the next call works, same process
    assert ctrl.proc_record(procs.name, 2).state in ("healthy", "busy")


def test_nan_poisons_the_next_tensor_result(m):
    procs, workers, _, ctrl = m
    since = ctrl.events.next_seq
    one = workers.slice(gpus=3)
    procs.inject(3, "nan")
    poisoned = one.echo.call_one(torch.ones(8)).get(timeout=DEADLINE_S)
    assert torch.isnan(poisoned[0]) and torch.equal(poisoned[1:], torch.ones(7))
    event = wait_event(ctrl, procs, "fault_fired", 3, since)
    assert event.cause == "nan" and "w.echo" in event.detail
    assert torch.equal(one.echo.call_one(torch.ones(8)).get(timeout=DEADLINE_S), torch.ones(8))  # once only


def test_slow_makes_a_straggler(m):
    procs, workers, _, ctrl = m
    since = ctrl.events.next_seq
    procs.inject(1, "slow", ms=1000)
    t0 = time.monotonic()
    assert workers.echo.call(1).get(timeout=DEADLINE_S).values() == [1] * 4
    assert time.monotonic() - t0 >= 1.0
    event = wait_event(ctrl, procs, "fault_fired", 1, since)
    assert event.cause == "slow" and "1000 ms" in event.detail
    straggler = workers.slice(gpus=1).echo.call_one(2)
    assert workers.slice(gpus=0).echo.call_one(1).get(timeout=DEADLINE_S) == 1
    assert not straggler.done()  # the others are not slowed: rank 0 answered while rank 1 still waits
    assert straggler.get(timeout=DEADLINE_S) == 2


def test_partition_looks_hung_and_is_fenced(m):
    procs, workers, _, ctrl = m
    since = ctrl.events.next_seq
    procs.inject(2, "partition", seconds=5.0)
    hung = wait_event(ctrl, procs, "proc_hung", 2, since)
    assert hung.cause == "heartbeat"
    assert hung.monotonic - injected_at(ctrl, procs, 2, since) <= config.hang_timeout_s + 1.0
    assert wait_event(ctrl, procs, "proc_exited", 2, since).cause == "fenced"
    assert workers.slice(gpus=3).echo.call_one(3).get(timeout=DEADLINE_S) == 3


def test_heartbeats_reach_the_controller_as_one_message_per_host(m):
    """Procs heartbeat to their host agent, which sums them up in its own heartbeat: the
    controller's messages per interval grow with hosts, not procs (issue 25)."""
    procs, workers, _, ctrl = m
    recs = [ctrl.proc_record(procs.name, rank) for rank in range(4)]
    before = dict(ctrl.channel.received)
    start = time.monotonic()
    wait_until(lambda: time.monotonic() - start >= 2.0 and all(r.last_heartbeat > start + 1.0 for r in recs), 10,
               message="every proc heard through its agent for 2 s")
    seconds = time.monotonic() - start
    got = {kind: n - before.get(kind, 0) for kind, n in ctrl.channel.received.items()}
    assert got.get(Kind.HEARTBEAT, 0) == 0, "no proc heartbeats to the controller itself"
    intervals = seconds / config.heartbeat_interval_s  # an idle agent beats every IDLE_HEARTBEAT_EVERY-th
    assert 0.5 * intervals / IDLE_HEARTBEAT_EVERY <= got.get(Kind.AGENT_HEARTBEAT, 0) <= 1.5 * intervals * len(ctrl.hosts)
    assert all(r.state == ProcState.HEALTHY for r in recs)


# -- tree, restart, fencing policy ------------------------------------------------------------------
def test_tree_snapshot_is_plain_data(m):
    procs, workers, _, ctrl = m
    call = workers.slice(gpus=2).sleep.call_one(1.0)

    def busy_tree():
        # one snapshot where the actor runs sleep and its proc is busy (a heartbeat sets the one,
        # then the other); the assertions below read that snapshot, not a later one
        tree = procs.tree()
        nodes = find(tree, "actor", name="w", rank=2)
        return (nodes and nodes[0]["endpoint"] == "sleep" and find(tree, "proc", rank=2)[0]["state"] == "busy"
                and tree)

    tree = wait_until(busy_tree, 5, message="rank 2's actor busy in sleep")
    node = find(tree, "actor", name="w", rank=2)[0]
    assert tree["kind"] == "controller" and tree["state"] == "healthy" and tree["pid"] > 0
    hosts = [h for h in tree["children"] if h["children"]]  # the host running this mesh (others may be known)
    assert [h["kind"] for h in hosts] == ["host"] and hosts[0]["state"] == "healthy"
    proc_nodes = find(tree, "proc")
    assert [p["rank"] for p in proc_nodes] == [0, 1, 2, 3]
    for p in proc_nodes:
        rec = ctrl.proc_record(procs.name, p["rank"])
        assert p["pid"] == rec.pid and p["coords"] == {"gpus": p["rank"]} and p["uptime_s"] > 0
        assert 0 <= p["heartbeat_age_s"] < config.hang_timeout_s
        assert sorted(a["name"] for a in p["children"]) == ["c", "w"]
    assert node["state"] == "busy" and node["endpoint_running_s"] >= 0
    assert find(tree, "proc", rank=2)[0]["state"] == "busy"
    assert find(procs.slice(gpus=1).tree(), "proc")[0]["rank"] == 1
    assert "proc pm" in render(tree) and "actor w" in render(tree)
    assert call.get(timeout=DEADLINE_S) == 1.0
    import json

    json.dumps(tree)  # plain data


def test_restart_in_place_respawns_actors(m):
    procs, workers, counters, ctrl = m
    since = ctrl.events.next_seq
    one = counters.slice(gpus=1)
    assert one.incr.call_one(10).get(timeout=DEADLINE_S) == 15
    old_pid = ctrl.proc_record(procs.name, 1).pid
    restarts = ctrl.proc_record(procs.name, 1).restarts
    procs.inject(1, "kill")
    wait_event(ctrl, procs, "proc_exited", 1, since)
    procs.restart(1)
    rec = ctrl.proc_record(procs.name, 1)
    assert rec.pid != old_pid and rec.restarts == restarts + 1 and rec.state in (ProcState.HEALTHY, ProcState.BUSY)
    assert ctrl.channel.routed_via(rec.identity) == rec.host, "the new incarnation linked to its host agent again"
    assert wait_event(ctrl, procs, "proc_restarted", 1, since).cause == "restart"
    assert one.incr.call_one(1).get(timeout=DEADLINE_S) == 6  # constructed again with Counter(5)
    info = one.whoami.call_one().get(timeout=DEADLINE_S)
    assert info["mesh_coords"] == {"gpus": 1} and info["pid"] == rec.pid and info["env_rank"] == 1
    node = find(procs.tree(), "proc", rank=1)[0]
    assert node["pid"] == rec.pid and node["restarts"] == restarts + 1 and node["coords"] == {"gpus": 1}
    assert counters.get_value.call().get(timeout=DEADLINE_S).values()[1] == 6


def test_restarting_a_healthy_proc_is_not_a_failure(m):
    procs, _, counters, ctrl = m
    since = ctrl.events.next_seq
    old_pid = ctrl.proc_record(procs.name, 2).pid
    procs.restart(2)
    events = [(e.kind, e.cause) for e in ctrl.events.events(since_seq=since) if e.rank == 2 and e.mesh == procs.name]
    assert ("proc_stopped", "restart") in events and ("proc_restarted", "restart") in events
    assert not [k for k, _ in events if k in ("proc_exited", "escalated")], events
    rec = ctrl.proc_record(procs.name, 2)
    assert rec.pid != old_pid and rec.state in (ProcState.HEALTHY, ProcState.BUSY)
    assert counters.slice(gpus=2).get_value.call_one().get(timeout=DEADLINE_S) == 5


def test_hung_proc_comes_back_when_fencing_is_off(m, monkeypatch):
    procs, workers, _, ctrl = m
    monkeypatch.setattr(config, "fence_hung", False)
    since = ctrl.events.next_seq
    pid = ctrl.proc_record(procs.name, 3).pid
    procs.inject(3, "stall", seconds=2.0)
    wait_event(ctrl, procs, "proc_hung", 3, since)
    assert find(procs.tree(), "proc", rank=3)[0]["state"] == "hung"
    resumed = wait_event(ctrl, procs, "proc_resumed", 3, since)
    assert resumed.pid == pid and pid_alive(pid)
    assert not ctrl.events.events("proc_fenced", since_seq=since)
    assert find(procs.tree(), "proc", rank=3)[0]["state"] in ("healthy", "busy")
    assert workers.slice(gpus=3).echo.call_one(3).get(timeout=DEADLINE_S) == 3


# -- policies and __supervise__ ---------------------------------------------------------------------
class Owner:
    def __init__(self, procs, handle: bool):
        self.procs = procs
        self.handle = handle
        self.failures: list[Failure] = []

    def __supervise__(self, failure: Failure) -> bool:
        self.failures.append(failure)
        if self.handle:
            self.procs.restart(failure.rank)  # blocking is fine: this is the supervisor thread
        return self.handle


def test_supervise_handled_restarts_and_calls_succeed(m):
    procs, workers, _, ctrl = m
    owner = Owner(procs, handle=True)
    procs.supervise(owner=owner)
    since = ctrl.events.next_seq
    procs.inject(2, "kill")
    event = wait_event(ctrl, procs, "supervised", 2, since)
    assert event.cause == "SIGKILL" and "Owner" in event.detail
    failure = owner.failures[0]
    assert (failure.rank, failure.cause, failure.signal, failure.coords) == (2, "SIGKILL", "SIGKILL", {"gpus": 2})
    wait_event(ctrl, procs, "proc_restarted", 2, since)
    assert workers.slice(gpus=2).echo.call_one("back").get(timeout=DEADLINE_S) == "back"
    assert not ctrl.events.events("escalated", since_seq=since)


def test_supervise_escalated_raises_supervision_error(m):
    procs, workers, _, ctrl = m
    owner = Owner(procs, handle=False)
    procs.supervise(owner=owner)
    since = ctrl.events.next_seq
    in_flight = workers.slice(gpus=0).sleep.call_one(30.0)
    wait_until(lambda: ctrl.proc_record(procs.name, 0).state == "busy", 5, message="rank 0 busy in sleep")
    procs.inject(0, "kill")
    with pytest.raises(SupervisionError, match=r"rank 0 failed \(SIGKILL\)") as info:
        in_flight.get(timeout=DEADLINE_S)
    assert (info.value.rank, info.value.cause, info.value.signal) == (0, "SIGKILL", "SIGKILL")
    event = wait_event(ctrl, procs, "escalated", 0, since)
    assert event.cause == "SIGKILL" and "__supervise__ returned False" in event.detail
    assert len(owner.failures) == 1
    assert not ctrl.events.events("supervised", since_seq=since)
    with pytest.raises(SupervisionError):
        workers.slice(gpus=0).echo.call_one(1).get(timeout=DEADLINE_S)
    assert workers.slice(gpus=1).echo.call_one(1).get(timeout=DEADLINE_S) == 1


def test_a_supervisor_that_raises_escalates(m):
    procs, _, _, ctrl = m
    seen = []

    def broken(failure: Failure) -> bool:  # a plain callable works as an owner too
        seen.append(failure.cause)
        raise RuntimeError("handler bug")

    procs.supervise(owner=broken)
    since = ctrl.events.next_seq
    procs.inject(1, "segfault")
    event = wait_event(ctrl, procs, "escalated", 1, since)
    assert event.cause == "SIGSEGV" and "__supervise__ raised RuntimeError: handler bug" in event.detail
    assert seen == ["SIGSEGV"]


def test_restart_policy_with_max_restarts(m):
    procs, _, counters, ctrl = m
    policy = procs.supervise("restart", max_restarts=1, backoff_s=0.05)
    assert policy.policy == "restart"
    since = ctrl.events.next_seq
    old_pid = ctrl.proc_record(procs.name, 3).pid
    procs.inject(3, "kill")
    assert "restart 1/1" in wait_event(ctrl, procs, "supervised", 3, since).detail
    wait_event(ctrl, procs, "proc_restarted", 3, since)
    assert ctrl.proc_record(procs.name, 3).pid != old_pid
    assert counters.slice(gpus=3).get_value.call_one().get(timeout=DEADLINE_S) == 5
    since = ctrl.events.next_seq
    procs.inject(3, "kill")
    assert "max_restarts=1 reached" in wait_event(ctrl, procs, "escalated", 3, since).detail
    assert ctrl.proc_record(procs.name, 3).state == "failed"


def test_isolate_policy_continues_without_the_rank(m):
    procs, workers, _, ctrl = m
    procs.supervise("isolate")
    since = ctrl.events.next_seq
    procs.inject(1, "exit", code=2)
    assert "isolate" in wait_event(ctrl, procs, "supervised", 1, since).detail
    assert ctrl.proc_record(procs.name, 1).state == "failed"
    assert workers.slice(gpus=slice(2, 4)).echo.call(2).get(timeout=DEADLINE_S).values() == [2, 2]


def test_bad_policy_arguments(m):
    procs = m[0]
    with pytest.raises(ValueError, match="unknown supervision policy 'retry'.*escalate, restart, isolate"):
        procs.supervise("retry")
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
        procs.supervise("restart", max_restarts=-1)
    with pytest.raises(ValueError, match="backoff_s must be a non-negative"):
        procs.supervise("restart", backoff_s=-0.5)
    with pytest.raises(TypeError, match="no __supervise__"):
        procs.supervise(owner=object())


# -- chaos and bad input ----------------------------------------------------------------------------
def test_chaos_schedule_is_reproducible(m):
    procs, workers, _, ctrl = m
    kinds = ("raise", "slow")
    plan = ChaosSchedule(0.5, kinds, seed=11).plan(20, world=4)
    assert [f.key() for f in plan] == [f.key() for f in ChaosSchedule(0.5, kinds, seed=11).plan(20, world=4)]
    assert [f.key() for f in plan] != [f.key() for f in ChaosSchedule(0.5, kinds, seed=12).plan(20, world=4)]
    gaps = [b.at_s - a.at_s for a, b in zip([plan[0]] + plan, plan)]
    assert all(g >= 0 for g in gaps)

    runs = []
    for _ in range(2):
        since = ctrl.events.next_seq
        chaos = ChaosSchedule(0.02, kinds, seed=5, params={"slow": {"ms": 1.0}}, max_faults=6).start(procs)
        assert chaos.wait(DEADLINE_S)
        done = chaos.history()
        assert len(done) == 6 and all(f.status == "injected" for f in done)
        injected = [(e.rank, e.cause) for e in ctrl.events.events("fault_injected", since_seq=since) if e.mesh == procs.name]
        assert injected == [(f.rank, f.kind) for f in done]
        runs.append([f.key() for f in done])
        for rank in range(4):
            ctrl.clear_faults(procs.name, rank)
    assert runs[0] == runs[1]
    stopped = ChaosSchedule(60.0, ("kill",), seed=1).start(procs)
    stopped.stop()
    assert not stopped.running and stopped.injected == []
    with pytest.raises(ValueError, match="unknown fault kind"):
        ChaosSchedule(1.0, ("explode",))
    with pytest.raises(ValueError, match="mtbf_s must be a positive"):
        ChaosSchedule(0, ("kill",))


def test_bad_injections_change_nothing(m):
    procs, workers, _, ctrl = m
    pids = [ctrl.proc_record(procs.name, r).pid for r in range(4)]
    since = ctrl.events.next_seq
    with pytest.raises(ValueError, match=r"rank 4 is not in proc mesh .* valid ranks are 0..3"):
        procs.inject(4, "kill")
    with pytest.raises(ValueError, match="valid ranks are 0..3"):
        procs.inject(-1, "kill")
    with pytest.raises(ValueError, match="valid ranks are 0..3"):
        procs.inject("1", "kill")
    with pytest.raises(ValueError, match="unknown fault kind 'explode'; valid kinds: kill"):
        procs.inject(1, "explode")
    with pytest.raises(ValueError, match="seconds must be a non-negative number, got -1"):
        procs.inject(1, "stall", seconds=-1)
    with pytest.raises(ValueError, match="ms must be a non-negative"):
        procs.inject(1, "slow", ms=-5)
    with pytest.raises(ValueError, match="takes seconds; got \\['ms'\\]"):
        procs.inject(1, "partition", ms=5)
    changed = ("fault_injected", "proc_exited", "proc_hung", "proc_fenced", "proc_restarting")
    assert [e for e in ctrl.events.events(since_seq=since) if e.kind in changed] == []
    assert [ctrl.proc_record(procs.name, r).pid for r in range(4)] == pids and all(map(pid_alive, pids))
    procs.inject(2, "kill")
    wait_event(ctrl, procs, "proc_exited", 2, since)
    since = ctrl.events.next_seq
    with pytest.raises(RuntimeError, match="rank 2 of .* is failed"):
        procs.inject(2, "kill")
    assert [e for e in ctrl.events.events(since_seq=since) if e.kind == "fault_injected"] == []
    assert workers.slice(gpus=1).echo.call_one(1).get(timeout=DEADLINE_S) == 1
