"""The actor API over real worker processes: adverbs, slicing, errors, ordering, tensors."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from monarch_nb import ActorError, MeshStoppedError, SupervisionError, UnknownEndpointError, ValueMesh
from monarch_nb.runtime.controller import Controller
from monarch_nb.transport.channel import FAN_MIN_HOSTS, FAN_MIN_PROCS
from monarch_nb.transport.serialization import SerializationError, dumps

from .actors import AsyncCounter, Caller, Counter, Worker
from .conftest import wait_until


@pytest.fixture(params=["ipc", "tcp"])
def transport(request) -> str:
    """Every test of this module runs over unix sockets and over TCP on 127.0.0.1."""
    return request.param


def test_every_adverb(procs4):
    counters = procs4.spawn("counters", Counter, 10)
    counters.incr.broadcast(by=5)
    values = counters.incr.call(by=2).get(timeout=10)
    assert isinstance(values, ValueMesh)
    assert values.values() == [17, 17, 17, 17]
    assert values.item(gpus=3) == 17
    assert [dict(p) for p, _ in values.items()] == [{"gpus": i} for i in range(4)]
    assert counters.slice(gpus=0).incr.call_one().get(timeout=10) == 18
    assert counters.incr.choose(by=0).get(timeout=10) in (17, 18)
    assert sorted(f.get(timeout=10) for f in counters.incr.stream(by=0)) == [17, 17, 17, 18]
    async_counters = procs4.spawn("async_counters", AsyncCounter, 1)
    assert async_counters.incr.call(by=1).get(timeout=10).values() == [2, 2, 2, 2]


def test_a_long_endpoint_leaves_the_other_actors_of_its_proc_answering(procs4, tmp_path):
    """While one actor of a proc runs a long endpoint, another actor of that proc still answers
    within a second: the proc's IO thread takes the receive lease over, though a stream of short
    calls has backed its looks off (channel._IO_RECHECK_MAX_S, 0.16 s). The other actor is async
    (its thread never receives for the proc), so only the IO thread can take over; without it the
    call waits for the long endpoint's end (2 s)."""
    workers, counters = procs4.spawn("workers", Worker), procs4.spawn("counters", AsyncCounter)
    worker, counter = workers.slice(gpus=1), counters.slice(gpus=1)
    stream_until = time.monotonic() + 0.5
    while time.monotonic() < stream_until:  # short calls: the lease changes hands; the IO thread backs off
        assert worker.echo.call_one(7).get(timeout=10) == 7
    started = tmp_path / "started"
    blocked = worker.block.call_one(str(started), 2.0)
    wait_until(started.exists, 10, message="the long endpoint to start")
    t0 = time.monotonic()
    assert counter.incr.call_one().get(timeout=10) == 1
    waited_s = time.monotonic() - t0
    assert waited_s < 1.0, f"another actor of the proc answered after {waited_s:.2f} s, behind the long endpoint"
    assert blocked.get(timeout=20) == 2.0


def test_call_one_on_many_is_a_clear_error(procs4):
    counters = procs4.spawn("counters", Counter)
    with pytest.raises(ValueError, match="exactly 1 actor.*has 4"):
        counters.incr.call_one()


def test_slicing_and_geometry(procs4):
    counters = procs4.spawn("counters", Counter)
    assert counters.size() == 4 and dict(counters.extent) == {"gpus": 4}
    pair = counters.slice(gpus=slice(1, 3))
    assert dict(pair.extent) == {"gpus": 2}
    infos = pair.whoami.call().get(timeout=10).values()
    assert [i["rank"] for i in infos] == [0, 1]  # current_rank(): the place in the slice called, as in Monarch
    assert all(i["size"] == {"gpus": 2} for i in infos)
    assert [i["mesh_rank"] for i in infos] == [1, 2]  # context().actor_instance.rank: the place in the mesh
    assert [i["env_rank"] for i in infos] == [1, 2]
    assert all(i["world"] == 4 for i in infos)
    # the same procs through another slice of the same size, then the first again: each call its own place
    assert [i["rank"] for i in counters.slice(gpus=slice(0, 2)).whoami.call().get(timeout=10).values()] == [0, 1]
    assert counters.slice(gpus=slice(0, 2)).slice(gpus=1).whoami.call_one().get(timeout=10)["mesh_rank"] == 1
    assert [i["rank"] for i in pair.whoami.call().get(timeout=10).values()] == [0, 1]
    one = counters.slice(gpus=-1)
    assert len(one.extent) == 0 and one.whoami.call_one().get(timeout=10)["mesh_coords"] == {"gpus": 3}
    flat = counters.flatten("all")
    assert dict(flat.extent) == {"all": 4}
    with pytest.raises(ValueError, match="out of range 0..3"):
        counters.slice(gpus=4)
    with pytest.raises(ValueError, match="unknown dim"):
        counters.slice(hosts=0)


def test_worker_environment_and_distinct_pids(procs4):
    workers = procs4.spawn("w", Worker)
    pids = workers.pid.call().get(timeout=10).values()
    assert len(set(pids)) == 4 and os.getpid() not in pids
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"monarch_nb" in f.read()  # identifiable in ps


def test_1000_broadcasts_then_call_are_ordered(procs4):
    counters = procs4.spawn("counters", Counter)
    for _ in range(1000):
        counters.incr.broadcast()
    assert counters.get_value.call().get(timeout=30).values() == [1000] * 4


def test_a_broadcast_is_one_message_through_the_host_agent_and_a_later_call_never_overtakes_it(procs4):
    """Issue 25, step 2: a broadcast to the 4 procs of a host is one message of the controller's,
    through the host agent; a call_one goes straight to its proc, and one sent after a broadcast
    is served after it (the proc delivers the controller's messages in the order sent)."""
    channel = Controller.get().channel
    assert {channel.routed_via(f"{procs4.name}.{r}") for r in range(4)} == {"host0"}
    channel.fan_min_procs, channel.fan_min_hosts = 4, 1  # the defaults (8 procs, 2 hosts) send these straight
    try:
        counters = procs4.spawn("counters", Counter)
        before = channel.sent_via_agents
        for n in range(1, 101):
            counters.incr.broadcast()
            assert counters.slice(gpus=n % 4).get_value.call_one().get(timeout=10) == n
        assert channel.sent_via_agents - before == 100, "each broadcast: one message through the agent; the calls straight"
        assert counters.get_value.call().get(timeout=30).values() == [100] * 4
    finally:
        channel.fan_min_procs, channel.fan_min_hosts = FAN_MIN_PROCS, FAN_MIN_HOSTS


def test_a_failure_and_a_recovery_reach_the_peers_in_one_message_through_their_host_agent(procs4):
    """A proc's failure (and its return) is told to every live peer; where the peers are linked to
    their agent that is one message a host, as a cast is. The peers act on it: a call to the dead
    rank from inside an endpoint fails at once, and works again once the rank is back."""
    ctrl = Controller.get()
    channel = ctrl.channel
    channel.fan_min_procs, channel.fan_min_hosts = 2, 1  # the defaults (8 procs, 2 hosts) send these straight
    try:
        counters = procs4.spawn("counters", Counter)
        callers = procs4.spawn("callers", Caller, counters)
        assert callers.slice(gpus=0).sum_of_peers.call_one().get(timeout=10) == 0
        since, before = ctrl.events.next_seq, channel.sent_via_agents
        os.kill(ctrl.proc_record(procs4.name, 3).pid, signal.SIGKILL)
        assert ctrl.events.wait_for(lambda e: e.kind == "proc_exited" and e.rank == 3, 10, since) is not None
        wait_until(lambda: channel.sent_via_agents > before, 10, message="the peers told through host0's agent")
        with pytest.raises(ActorError, match="rank 3"):
            callers.slice(gpus=0).sum_of_peers.call_one().get(timeout=10)
        before = channel.sent_via_agents
        procs4.restart(3, timeout_s=30)  # returns once the peers were told it serves again
        assert channel.sent_via_agents > before, "its return told through host0's agent"
        assert callers.slice(gpus=0).sum_of_peers.call_one().get(timeout=10) == 0
    finally:
        channel.fan_min_procs, channel.fan_min_hosts = FAN_MIN_PROCS, FAN_MIN_HOSTS


def test_a_call_to_alls_replies_come_back_through_the_host_agent_as_the_call_went(procs4):
    """Where a call to all reaches a host's procs through their agent, their replies come back
    through it too, gathered (issue 25): the values, the errors (each rank's) and a tensor (it
    comes straight, the agent told) are what they were, and no reply came by itself."""
    channel = Controller.get().channel
    channel.fan_min_procs, channel.fan_min_hosts = 2, 1  # the defaults (8 procs, 2 hosts) send these straight
    try:
        workers = procs4.spawn("w", Worker)
        assert workers.echo.call(0).get(timeout=10).values() == [0, 0, 0, 0]
        bundles, straight = channel.received["replies"], channel.received["reply"]
        assert workers.echo.call(7).get(timeout=10).values() == [7, 7, 7, 7]
        with pytest.raises(ActorError) as info:
            workers.fail.call("boom").get(timeout=10)
        assert info.value.rank == 0 and sorted(e.rank for e in info.value.others) == [1, 2, 3] and "boom" in str(info.value)
        assert channel.received["reply"] == straight, "every reply came gathered"
        assert 2 <= channel.received["replies"] - bundles <= 8, "one message a call (more if a rank answered late)"
        x = torch.randn(64, 64)
        values = workers.echo.call(x).get(timeout=10).values()
        assert all(torch.equal(v, x) for v in values)
        assert channel.received["reply"] == straight + 4, "a tensor reply goes straight"
        assert workers.slice(gpus=2).echo.call_one(3).get(timeout=10) == 3
        assert not channel.dropped
    finally:
        channel.fan_min_procs, channel.fan_min_hosts = FAN_MIN_PROCS, FAN_MIN_HOSTS


def test_tensors_round_trip_without_copy_into_stream(procs4):
    workers = procs4.spawn("w", Worker)
    x = torch.randn(512, 512)  # 1 MiB
    stream, buffers = dumps(((x,), {}))
    assert len(stream) < 1024 and sum(memoryview(b).nbytes for b in buffers) == x.numel() * 4
    y = workers.slice(gpus=2).echo.call_one(x).get(timeout=10)
    assert torch.equal(x, y) and y.dtype == x.dtype
    y += 1  # a received tensor is writable
    for dtype in (torch.bfloat16, torch.int64, torch.bool):
        t = (torch.rand(300, 300) > 0.5).to(dtype)
        assert torch.equal(workers.slice(gpus=0).echo.call_one(t).get(timeout=10), t)
    strided = torch.arange(20.0).reshape(4, 5).t()
    assert torch.equal(workers.slice(gpus=0).echo.call_one(strided).get(timeout=10), strided)


def test_endpoint_that_raises_gives_remote_traceback(procs4):
    workers = procs4.spawn("w", Worker)
    with pytest.raises(ActorError) as info:
        workers.fail.call("boom").get(timeout=10)
    err = info.value
    assert err.rank == 0 and err.endpoint == "fail" and err.exception_type == "ValueError"
    assert sorted(e.rank for e in err.others) == [1, 2, 3]
    text = str(err)
    assert "raise ValueError(message)" in text and "boom" in text and "actors.py" in text
    assert workers.echo.call(1).get(timeout=10).values() == [1, 1, 1, 1]  # still usable
    events = Controller.get().events.events("actor_error")
    assert events and "boom" in events[-1].detail


def test_bad_calls_are_clear_errors_and_leave_mesh_usable(procs4):
    workers = procs4.spawn("w", Worker)
    with pytest.raises(UnknownEndpointError, match="no endpoint 'nope'.*echo"):
        workers.nope  # noqa: B018 (the attribute's lookup raises)
    with pytest.raises(TypeError, match=r"Worker.echo\(value\).*missing"):
        workers.echo.call()
    with pytest.raises(TypeError, match="unexpected keyword"):
        workers.echo.call(1, bogus=2)
    with pytest.raises(SerializationError, match=r"the arguments of echo\(\) cannot be pickled: TypeError: cannot pickle .*lock"):
        workers.echo.call(__import__("threading").Lock())
    with pytest.raises(ActorError, match="cannot be pickled"):
        workers.slice(gpus=0).unpicklable_result.call_one().get(timeout=10)
    with pytest.raises(TypeError, match="through an adverb"):
        workers.echo(1)
    assert workers.echo.call(2).get(timeout=10).values() == [2] * 4


def test_timeout_leaves_mesh_usable(procs4):
    workers = procs4.spawn("w", Worker)
    one = workers.slice(gpus=1)
    with pytest.raises(TimeoutError):
        one.sleep.call_one(1.0).get(timeout=0.1)
    assert one.echo.call_one("after").get(timeout=10) == "after"


def test_actor_calls_actor_with_get_inside_endpoint(procs4):
    counters = procs4.spawn("counters", Counter, 1)
    callers = procs4.spawn("callers", Caller, counters)  # a mesh passed as an argument
    assert callers.sum_of_peers.call().get(timeout=10).values() == [4, 4, 4, 4]
    # same-proc call: the caller and the callee live in one process
    assert callers.call_peer_of_same_rank.call().get(timeout=10).values() == [2, 2, 2, 2]


def test_same_name_twice_and_bad_constructor_arguments(procs4):
    first = procs4.spawn("counters", Counter, 1)
    second = procs4.spawn("counters", Counter, 10)  # as in Monarch: two meshes, one name
    assert first.incr.call(by=0).get(timeout=10).values() == [1] * 4
    assert second.incr.call(by=0).get(timeout=10).values() == [10] * 4
    with pytest.raises(TypeError, match="Counter.__init__"):
        procs4.spawn("c2", Counter, 1, 2, 3)


def test_output_from_four_ranks_complete_and_ordered(procs4):
    controller = Controller.get()
    lines = []
    controller.output_sinks.append(lines.append)
    try:
        workers = procs4.spawn("w", Worker)
        assert workers.write_output.call(50).get(timeout=30).values() == [50] * 4

        def complete():
            return all(
                sum(1 for ln in lines if ln.rank == r and ln.text.startswith(kind)) == 50
                for r in range(4)
                for kind in ("print", "fd", "WARNING")
            )

        wait_until(complete, 10, message="150 lines from each rank")
        for r in range(4):
            for kind, stream in (("print", "stdout"), ("fd", "stdout"), ("WARNING", "stderr")):
                got = [ln.text for ln in lines if ln.rank == r and ln.text.startswith(kind)]
                assert all(ln.stream == stream for ln in lines if ln.rank == r and ln.text.startswith(kind))
                assert [int(t.rsplit("i=", 1)[1]) for t in got] == list(range(50))  # in order, no dup
    finally:
        controller.output_sinks.remove(lines.append)


def test_output_written_just_before_death_arrives(procs4):
    controller = Controller.get()
    lines = []
    controller.output_sinks.append(lines.append)
    try:
        workers = procs4.spawn("w", Worker)
        with pytest.raises(SupervisionError, match="rank 2.*exit 3"):
            workers.slice(gpus=2).print_then_die.call_one("dying words").get(timeout=10)
        texts = [(ln.rank, ln.stream, ln.text) for ln in lines]
        assert (2, "stdout", "dying words") in texts
        assert (2, "stderr", "last words on stderr") in texts
        # the healthy slice keeps answering; the dead rank fails fast
        assert workers.slice(gpus=0).echo.call_one(5).get(timeout=10) == 5
        with pytest.raises(SupervisionError):
            workers.slice(gpus=2).echo.call_one(5).get(timeout=1)
    finally:
        controller.output_sinks.remove(lines.append)


def test_stop_and_context_manager(no_leaked_processes):
    from monarch_nb import this_host

    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        workers = procs.spawn("w", Worker)
        pids = workers.pid.call().get(timeout=10).values()
        no_leaked_processes.update(pids)
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}/stat") and _alive(p) for p in pids), 5, message="stopped procs to exit")
    with pytest.raises(MeshStoppedError, match="spawn a new one"):
        workers.echo.call(1)
    procs.stop()  # idempotent


def _alive(pid: int) -> bool:
    from .conftest import pid_alive

    return pid_alive(pid)


def test_futures_await_and_report_state(procs4):
    import asyncio

    counters = procs4.spawn("counters", Counter, 7)

    async def main():
        one = await counters.slice(gpus=3).incr.call_one(1)
        every = await counters.get_value.call()
        return one, every.values()

    assert asyncio.run(main()) == (8, [7, 7, 7, 8])
    fut = counters.slice(gpus=0).incr.call_one(2)
    assert fut.result(timeout=10) == 9 and fut.done() and fut.exception() is None
    failing = procs4.spawn("w", Worker).slice(gpus=0).fail.call_one("nope")
    assert isinstance(failing.exception(timeout=10), ActorError)
