"""Replies gathered per host with real host agents (monarch_nb.runtime.reply_gather): a LocalJob
of 2 hosts x 4 procs, so a call to all (8 procs on 2 hosts) goes through the agents with the
default thresholds, and comes back one message a host."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from monarch_nb import SupervisionError

from .actors import Worker
from .conftest import local_hosts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def two_hosts(no_leaked_processes):
    """A Worker on each of 4 procs on each of 2 local hosts."""
    with local_hosts(no_leaked_processes, hosts=2, gpus=4) as (ctrl, _, procs):
        workers = procs.spawn("w", Worker)
        assert workers.echo.call(0).get(timeout=60).values() == [0] * 8
        yield ctrl, procs, workers


def test_a_call_to_all_across_hosts_comes_back_one_message_a_host_and_a_killed_rank_fails_it(two_hosts):
    ctrl, procs, workers = two_hosts
    channel = ctrl.channel
    casts, bundles, straight = channel.sent_via_agents, channel.received["replies"], channel.received["reply"]
    assert workers.echo.call(5).get(timeout=30).values() == [5] * 8
    assert channel.sent_via_agents == casts + 2, "the call went one message a host"
    assert channel.received["reply"] == straight, "no reply came by itself"
    assert 2 <= channel.received["replies"] - bundles <= 8, "they came gathered, one message a host (more if a rank was late)"
    # a rank killed while the call runs: its host's other replies still come (the agent does not
    # wait for the dead one past its exit), and the call fails naming that rank
    victim = ctrl.proc_record(procs.name, 6).pid
    call = workers.sleep.call(1.0)
    killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(SupervisionError, match="rank 6"):
            call.get(timeout=30)
    finally:
        killer.join()
    assert not channel.dropped, dict(channel.dropped)
