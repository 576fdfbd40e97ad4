"""A quorum's collective gives up when the runtime says a member died (monarch_nb.train.quorum_watch),
on a real gloo group of two processes whose other member never joins the collective (as gloo's
ring all-reduce was seen waiting in ``waitSend`` on a pair closed under it: see the module)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import threading
import time

import pytest

from monarch_nb.train.quorum_watch import CHECK_EVERY_S, QuorumWatch
from monarch_nb.train.trainer_quorum import CollectiveError

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _absent_peer(port: int, joined: "multiprocessing.synchronize.Event", done: "multiprocessing.synchronize.Event") -> None:
    """Rank 1: forms the group, takes part in one all-reduce, then never in the next."""
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=10))
    dist.all_reduce(torch.ones(4))
    joined.set()
    done.wait(30)
    os._exit(0)  # no teardown: the other side has given up on it


@pytest.fixture
def group_of_two(no_leaked_processes):
    """This process as rank 0 of a gloo group whose rank 1 (another process) stops taking part
    after one all-reduce; torn down (the peer gone, the group destroyed) after the test."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    joined, done = ctx.Event(), ctx.Event()
    peer = ctx.Process(target=_absent_peer, args=(port, joined, done), daemon=True)
    peer.start()
    no_leaked_processes.add(peer.pid)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=10))
    try:
        assert dist.all_reduce(torch.ones(4)) is None
        assert joined.wait(30)
        yield dist.group.WORLD
    finally:
        done.set()
        peer.join(30)
        if peer.is_alive():
            peer.kill()
            peer.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + 15
        while [t for t in threading.enumerate() if t.name == "monarch_nb-abandoned-collective"]:
            assert time.monotonic() < deadline, "the abandoned collective ends once its peer is gone"
            time.sleep(0.05)


def test_a_collective_waiting_on_a_member_said_dead_gives_up_within_a_check(group_of_two):
    """Rank 1 is alive but never joins: gloo would wait its 10 s; the watch gives up within a
    check of hearing that rank 1 died."""
    watch = QuorumWatch()
    watch.begin([0, 1])
    work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 never joins it
    heard_at: list[float] = []

    def runtime_says_rank_1_died() -> None:
        time.sleep(0.3)
        heard_at.append(time.monotonic())
        assert watch.lose(1)

    threading.Thread(target=runtime_says_rank_1_died).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 1 of the quorum died"):
        watch.wait(work, group_of_two)
    assert time.monotonic() - t0 < 3.0, "not gloo's 10 s timeout"
    assert time.monotonic() - heard_at[0] < CHECK_EVERY_S + 0.5
    assert watch.abandoned == 1 and not work.is_completed()
    # the group is left at once (the abandoned work and the group held off this thread), and let
    # go once the work ends (its peer gone)
    t0 = time.monotonic()
    dist.destroy_process_group()
    assert time.monotonic() - t0 < 1.0
    [holder] = [t for t in threading.enumerate() if t.name == "monarch_nb-abandoned-collective"]
    assert holder.is_alive()
    del work
    # (the fixture's teardown ends the peer: its closed connection ends the work)
