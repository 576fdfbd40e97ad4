"""The relay tree with real host agents (monarch_nb.runtime.relay): a LocalJob of 4 hosts grouped
in pairs, so two agents heartbeat through the other two and get casts through them; a relay's
agent SIGKILLed, or SIGSTOPped holding a cast."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Iterator

import pytest

import monarch_nb
from monarch_nb.config import config
from monarch_nb.supervision.records import ProcState

from .actors import Counter, Worker
from .conftest import hang_deadline_s, local_hosts, pid_alive, wait_until

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def _paired(no_leaked_processes: set[int], gpus: int) -> Iterator[tuple[Any, Any, Any, Any, dict[str, str]]]:
    """4 local hosts in relay pairs (fan-in 2), ``gpus`` procs each, a Counter on each proc:
    (controller, hosts, procs, counters, member -> its relay) once the tree formed."""
    monarch_nb.configure(relay_fan_in=2, relay_min_hosts=2)
    with local_hosts(no_leaked_processes, hosts=4, gpus=gpus) as (ctrl, hosts, procs):
        counters = procs.spawn("c", Counter)
        counters.initialized.get(timeout=60)  # its replies in: a test's counts start after them
        members = lambda: {h.name: h.via_relay for h in ctrl.hosts.values() if h.name in hosts.host_names and h.via_relay}  # noqa: E731
        wait_until(lambda: len(members()) == 2, 30, message="two hosts heartbeating through the other two")
        yield ctrl, hosts, procs, counters, members()


@pytest.fixture
def paired_hosts(no_leaked_processes):
    """:func:`_paired`, one proc a host."""
    with _paired(no_leaked_processes, gpus=1) as paired:
        yield paired


def test_hosts_heard_through_relays_stay_healthy_and_answer(paired_hosts):
    ctrl, hosts, procs, counters, members = paired_hosts
    assert set(members.values()).isdisjoint(members) and len(set(members.values())) == 2  # two relays, one member each
    since = ctrl.events.next_seq
    agents = {name: ctrl.hosts[name].pid for name in hosts.host_names}
    # three hang timeouts through the tree: the members' heartbeats reach the controller, and the
    # relays' beats tell the members it is alive (they would leave it after twice the hang timeout)
    deadline, calls = time.monotonic() + 3 * config.hang_timeout_s, 0
    while time.monotonic() < deadline:
        counters.incr.call().get(timeout=10)
        calls += 1
        time.sleep(config.heartbeat_interval_s)
    assert ctrl.events.events("host_lost", since_seq=since) == [] and ctrl.events.events("proc_hung", since_seq=since) == []
    assert {name: ctrl.hosts[name].pid for name in hosts.host_names} == agents  # no agent left or was replaced
    assert {name: h.via_relay for name, h in ctrl.hosts.items() if h.via_relay} == members
    assert counters.get_value.call().get(timeout=10).values() == [calls] * 4

def test_a_killed_relay_loses_only_its_own_host_and_its_member_goes_straight(paired_hosts):
    ctrl, hosts, procs, counters, members = paired_hosts
    member, relay = next(iter(members.items()))
    rank_on = {ctrl.proc_record(procs.name, r).host: r for r in range(4)}
    since = ctrl.events.next_seq
    agent = ctrl.hosts[relay].pid
    member_agent = ctrl.hosts[member].pid
    os.kill(agent, signal.SIGKILL)
    lost = ctrl.events.wait_for(lambda e: e.kind == "host_lost" and e.host == relay, hang_deadline_s() + 1, since)
    assert lost is not None
    # the member heard straight again, never lost, its agent the same, its proc answering
    wait_until(lambda: ctrl.hosts[member].via_relay == "" and ctrl.hosts[member].state == ProcState.HEALTHY, 10,
               message=f"{member} heartbeating straight")
    assert [e.host for e in ctrl.events.events("host_lost", since_seq=since)] == [relay]
    assert ctrl.hosts[member].pid == member_agent
    assert counters.slice(hosts=rank_on[member]).incr.call_one(5).get(timeout=10) == 5
    # the relay's host comes back (a fresh agent from its worker loop); its rank restarts there
    wait_until(lambda: ctrl.hosts[relay].state == ProcState.HEALTHY and ctrl.hosts[relay].pid not in (0, agent), 30,
               message=f"{relay} attached again")
    wait_until(lambda: not pid_alive(agent), 10, message="the killed agent gone")
    procs.restart(rank_on[relay], timeout_s=60)
    values = counters.incr.call(1).get(timeout=30).values()
    assert values[rank_on[relay]] == 1 and values[rank_on[member]] == 6
    assert [e.host for e in ctrl.events.events("host_lost", since_seq=since)] == [relay]


def test_idle_members_are_heard_on_their_relays_word_and_a_stopped_proc_there_is_still_hung(paired_hosts):
    ctrl, hosts, procs, counters, members = paired_hosts
    member = sorted(members)[0]
    rank = {ctrl.proc_record(procs.name, r).host: r for r in range(4)}[member]
    rec = ctrl.proc_record(procs.name, rank)
    since = ctrl.events.next_seq
    # idle for two hang timeouts: the member's agent has nothing new to say, its relay passes on its
    # name and count alone (QuietMember), and that is what keeps the member's proc healthy
    start = time.monotonic()
    wait_until(lambda: time.monotonic() - start > 2 * config.hang_timeout_s
               and time.monotonic() - ctrl.procs.host_heard(member).at < config.hang_timeout_s / 2, 30,
               message=f"{member}'s relay vouching for its procs for two hang timeouts")
    assert ctrl.events.events("proc_hung", since_seq=since) == [] and ctrl.events.events("host_lost", since_seq=since) == []
    assert rec.state == ProcState.HEALTHY and ctrl.hosts[member].via_relay == members[member]
    # a SIGSTOPped proc on that host: its agent says so (news, passed on whole), no more word that
    # all were heard, and the hang check judges it: hung and fenced within the usual deadline
    os.kill(rec.pid, signal.SIGSTOP)
    hung = ctrl.events.wait_for(lambda e: e.kind == "proc_hung" and e.rank == rank, hang_deadline_s(), since)
    assert hung is not None, f"rank {rank} on {member} SIGSTOPped, not reported hung"
    assert [e.rank for e in ctrl.events.events("proc_hung", since_seq=since)] == [rank]
    wait_until(lambda: rec.state == ProcState.FAILED, 10, message="the hung proc fenced (SIGKILL) and its exit seen")
    assert counters.slice(hosts=[r for r in range(4) if r != rank][0]).incr.call_one(2).get(timeout=10) == 2


@pytest.fixture
def paired_hosts_of_two(no_leaked_processes):
    """:func:`_paired`, two procs a host (a cast to all 8 goes through the agents)."""
    with _paired(no_leaked_processes, gpus=2) as paired:
        yield paired


def test_a_cast_goes_down_the_tree_one_message_a_relay(paired_hosts_of_two):
    ctrl, hosts, procs, counters, members = paired_hosts_of_two
    before, straight, up = ctrl.channel.sent_via_relays, ctrl.channel.received["reply"], ctrl.channel.replies_via_relays
    assert counters.incr.call(1).get(timeout=10).values() == [1] * 8
    assert ctrl.channel.sent_via_relays - before == 2  # one message a relay: its own procs' part and its member's
    assert ctrl.channel.received["reply"] == straight, "every reply gathered by its host's agent"
    assert ctrl.channel.replies_via_relays - up == 4, "the members' procs' replies came up through their relays"
    counters.incr.broadcast(2)
    assert counters.get_value.call().get(timeout=10).values() == [3] * 8
    assert ctrl.channel.sent_via_relays - before == 6 and ctrl.channel.resent_relayed == 0  # three casts


def test_a_cast_held_by_a_stopped_relay_reaches_its_member_straight(paired_hosts_of_two):
    ctrl, hosts, procs, counters, members = paired_hosts_of_two
    member, relay = sorted(members.items())[0]
    host_index = {ctrl.proc_record(procs.name, r).host: r // 2 for r in range(8)}
    since = ctrl.events.next_seq
    agent = ctrl.hosts[relay].pid
    os.kill(agent, signal.SIGSTOP)  # the relay takes the cast in and passes nothing on
    try:
        sent = ctrl.channel.sent_via_relays
        counters.incr.broadcast(5)
        assert ctrl.channel.sent_via_relays == sent + 2
        # the member leaves its silent relay (~3 intervals) and the controller sends it its part
        # straight; the call after the cast waits on the member's procs until the cast came
        values = counters.slice(hosts=host_index[member]).get_value.call().get(timeout=hang_deadline_s())
        assert values.values() == [5, 5]
        assert ctrl.hosts[member].via_relay == "" and ctrl.channel.resent_relayed >= 1
    finally:
        os.kill(agent, signal.SIGKILL)
    lost = ctrl.events.wait_for(lambda e: e.kind == "host_lost" and e.host == relay, hang_deadline_s() + 1, since)
    assert lost is not None
    assert [e.host for e in ctrl.events.events("host_lost", since_seq=since)] == [relay]
    wait_until(lambda: ctrl.hosts[relay].state == ProcState.HEALTHY and ctrl.hosts[relay].pid not in (0, agent), 30,
               message=f"{relay} attached again")
    wait_until(lambda: not pid_alive(agent), 10, message="the killed agent gone")


def test_replies_held_by_a_stopped_relay_reach_the_controller_straight(paired_hosts_of_two):
    ctrl, hosts, procs, counters, members = paired_hosts_of_two
    member, relay = sorted(members.items())[0]
    host_index = {ctrl.proc_record(procs.name, r).host: r // 2 for r in range(8)}
    workers = procs.spawn("w", Worker)
    workers.initialized.get(timeout=60)
    workers = workers.slice(hosts=host_index[member])
    straight = ctrl.channel.received["reply"]
    agent = ctrl.hosts[relay].pid
    fan_min = ctrl.channel.fan_min_procs, ctrl.channel.fan_min_hosts
    ctrl.channel.fan_min_procs = ctrl.channel.fan_min_hosts = 1  # a call to one host's two procs goes through its agent
    call = workers.sleep.call(0.1)  # the member's two procs answer after 0.1 s: its agent sends their replies up
    os.kill(agent, signal.SIGSTOP)  # ... to a relay that takes them in and passes nothing on
    try:
        # the member leaves its silent relay (3 intervals) and sends the replies it sent through it straight
        assert call.get(timeout=hang_deadline_s()).values() == [0.1, 0.1]
        wait_until(lambda: ctrl.hosts[member].via_relay != relay, 10, message="the member heard straight, not through its relay")
        assert ctrl.channel.received["reply"] == straight, "gathered by the member's agent, not sent by each proc"
    finally:
        ctrl.channel.fan_min_procs, ctrl.channel.fan_min_hosts = fan_min
        os.kill(agent, signal.SIGKILL)
    wait_until(lambda: ctrl.hosts[relay].state == ProcState.HEALTHY and ctrl.hosts[relay].pid not in (0, agent), 30,
               message=f"{relay} attached again")
    wait_until(lambda: not pid_alive(agent), 10, message="the killed agent gone")
