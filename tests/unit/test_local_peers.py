"""Messages between procs of one host, straight (monarch_nb.transport.local_peers): real ZeroMQ
sockets in one process (a controller's ROUTER, a host agent's link driven by the test's thread,
procs' channels with their inboxes); and a peer's call that comes before its actor's spawn
waiting for it (monarch_nb.runtime.actor_host)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from monarch_nb.actor import Actor, endpoint
from monarch_nb.actor.shape import Extent
from monarch_nb.runtime import actor_host
from monarch_nb.runtime.actor_host import HOLD_FOR_SPAWN_S
from monarch_nb.runtime.actors import STOP_GRACE_S
from monarch_nb.runtime.actor_host import ActorHost
from monarch_nb.runtime.proc_link import AgentLink, link_to_agent
from monarch_nb.transport.channel import Channel
from monarch_nb.transport.local_peers import LocalPeers, inbox_address
from monarch_nb.transport.serialization import dumps, loads
from monarch_nb.transport.wire import Signer, encode

KEY = b"0123456789abcdef0123456789abcdef"


class Inbox:
    """A channel's received messages, in arrival order."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, header: Any, body: memoryview, buffers: list, frames: list) -> None:
        with self.lock:
            self.items.append(dict(header))

    def calls(self) -> list[dict[str, Any]]:
        with self.lock:
            return [h for h in self.items if h["kind"] == "call"]


class Host:
    """A controller, a host agent's link (pumped by :meth:`until`, on the test's thread: the
    link's socket is used by one thread) and procs with inboxes, each linked and said hello."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.signer = Signer(KEY)
        self.inbox: dict[str, Inbox] = {"controller": Inbox()}
        self.controller = Channel("controller", self.signer, self.inbox["controller"], router=True)
        self.address = self.controller.bind(f"ipc://{tmp_path}/ctl")
        self.controller.start()
        self.link = AgentLink(str(tmp_path))
        self.procs: dict[str, Channel] = {}

    def until(self, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Run the agent's link until ``condition()``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.link.on_readable()
            if time.monotonic() > deadline:
                raise AssertionError("not true within the deadline")
            time.sleep(0.002)

    def add_proc(self, name: str, pid: int, linked: bool = True, inbox: bool = True) -> Channel:
        self.inbox.setdefault(name, Inbox())
        proc = self.procs[name] = Channel(f"{name}#{pid}", self.signer, self.inbox[name], hub="controller")
        if linked:
            peers = LocalPeers(str(self.tmp_path), name)
            assert peers.open() if inbox else True
            proc.add_local_peers(peers)
            got: list[Any] = []
            thread = threading.Thread(target=lambda: got.append(link_to_agent(self.link.address, name, 5, pid=pid, inbox=inbox)))
            thread.start()
            self.until(lambda: not thread.is_alive())
            assert got[0] is not None, "the agent answered the link"
            proc.add_link(got[0])
        proc.connect(self.address)
        proc.start()
        hellos = len(self.inbox["controller"].items)
        proc.send("controller", {"kind": "hello"})
        self.until(lambda: len(self.inbox["controller"].items) > hellos)
        return proc

    def close(self) -> None:
        for channel in [*self.procs.values(), self.controller]:
            channel.close()
        self.link.close()


@pytest.fixture
def host(tmp_path) -> Iterator[Host]:
    h = Host(tmp_path)
    try:
        yield h
    finally:
        h.close()


def _known(proc: Channel, route: str) -> Callable[[], bool]:
    peers = proc.local_peers
    assert peers is not None
    return lambda: route.encode() in peers._here


def test_a_message_to_a_proc_of_the_same_host_goes_straight_to_its_inbox(host):
    a, b = host.add_proc("pm0.0", 100), host.add_proc("pm0.1", 101)
    host.until(_known(a, "pm0.1"))
    for n in range(50):
        a.send("pm0.1#101", {"kind": "call", "n": n})
    host.until(lambda: len(host.inbox["pm0.1"].calls()) == 50)
    got = host.inbox["pm0.1"].calls()
    assert [h["n"] for h in got] == list(range(50)), "in the order sent"
    assert all(h["src"] == "pm0.0#100" and h.get("_local_peer") == 1 for h in got)
    assert host.controller.forwarded == 0, "the controller passed none of them on"
    assert a.local_peers.sent == 50 and not b.dropped


def test_a_route_first_sent_through_the_hub_stays_there_until_its_proc_leaves(host):
    """pm0.1 is not linked when pm0.0 first sends it: through the controller, and still after
    a new incarnation of pm0.1 links on this host (a straight message could overtake one still on
    its way); once the agent says that one left, and the next links, straight."""
    a = host.add_proc("pm0.0", 100)
    host.add_proc("pm0.1", 101, linked=False)
    a.send("pm0.1#101", {"kind": "call", "n": 0})
    host.until(lambda: len(host.inbox["pm0.1"].calls()) == 1)
    assert host.controller.forwarded == 1
    host.procs.pop("pm0.1").close()
    alive = os.getpid()  # the new incarnation's pid: a live process (this one)
    host.add_proc("pm0.1", alive)
    host.until(_known(a, "pm0.1"))
    for n in range(1, 20):
        a.send(f"pm0.1#{alive}", {"kind": "call", "n": n})
    host.until(lambda: len(host.inbox["pm0.1"].calls()) == 20)
    assert [h["n"] for h in host.inbox["pm0.1"].calls()] == list(range(20))
    assert host.controller.forwarded == 20 and a.local_peers.sent == 0 and a.local_peers.through_hub == 19
    # the exit of an older incarnation (pid 101, reaped late) changes nothing: the one linked is
    # another, alive; its own exit unpins, and the next link goes straight
    host.link.leave("pm0.1", 101)
    assert host.link.announced == 2  # +pm0.1 to pm0.0, +pm0.0 to pm0.1
    host.link.leave("pm0.1", alive)
    host.until(lambda: not _known(a, "pm0.1")())
    host.procs.pop("pm0.1").close()
    host.inbox["pm0.1"].items.clear()
    host.add_proc("pm0.1", 103)
    host.until(_known(a, "pm0.1"))
    a.send("pm0.1#103", {"kind": "call", "n": 20})
    host.until(lambda: len(host.inbox["pm0.1"].calls()) == 1)
    assert host.controller.forwarded == 20 and a.local_peers.sent == 1
    assert host.link.announced == 5  # and -pm0.1, then +pm0.1 and +pm0.0 again


def test_a_proc_without_an_inbox_sends_straight_and_is_reached_through_the_hub(host):
    """pm0.1's inbox did not bind: it is not announced, so pm0.0 reaches it through the
    controller; pm0.1 is told of pm0.0's inbox and sends there straight."""
    a = host.add_proc("pm0.0", 100)
    b = host.add_proc("pm0.1", 101, inbox=False)
    host.until(_known(b, "pm0.0"))
    a.send("pm0.1#101", {"kind": "call", "n": 1})
    b.send("pm0.0#100", {"kind": "call", "n": 2})
    host.until(lambda: host.inbox["pm0.1"].calls() and host.inbox["pm0.0"].calls())
    assert host.controller.forwarded == 1 and b.local_peers.sent == 1 and a.local_peers.sent == 0


def test_an_inbox_drops_what_is_not_its_own(host):
    """A message at pm0.1's inbox for another proc, or numbered by the controller (only its
    socket numbers), or not signed with the cluster key: dropped and counted."""
    import zmq

    b = host.add_proc("pm0.1", 101)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(inbox_address(str(host.tmp_path), "pm0.1"))
    try:
        base = {"kind": "call", "src": "pm0.0#100"}
        sock.send_multipart(encode(host.signer, {**base, "dst": "pm0.2#1", "seq": 1}, b""))
        sock.send_multipart(encode(host.signer, {**base, "dst": "pm0.1#101", "seq": 2, "pseq": [101, 1]}, b""))
        sock.send_multipart(encode(Signer(b"x" * 32), {**base, "dst": "pm0.1#101", "seq": 3}, b""))
        sock.send_multipart(encode(host.signer, {**base, "dst": "pm0.1#101", "seq": 4, "n": "ok"}, b""))
        host.until(lambda: len(host.inbox["pm0.1"].calls()) == 1)
    finally:
        sock.close()
    assert host.inbox["pm0.1"].calls()[0]["n"] == "ok"
    assert b.dropped["not ours"] == 2 and b.dropped["bad"] == 1


# -- a peer's call before its actor's spawn -----------------------------------------------------------
class Echo(Actor):
    @endpoint
    def echo(self, value):
        return value


class _Messenger:
    identity = route = "controller"


class Actors:
    """An :class:`ActorHost` whose replies and timers the test reads and runs."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, bool, Any]] = []
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.lock = threading.Lock()
        self.host = ActorHost("pm0.1", "pm0", 1, Extent({"gpus": 2}), self._send, _Messenger(),  # type: ignore[arg-type]
                              lambda header, body: None, call_later=lambda delay, fn: self.timers.append((delay, fn)))

    def _send(self, dst: str, header: dict, body: bytes, buffers: list, **_: Any) -> None:
        with self.lock:
            self.replies.append((header["idx"], header["ok"], loads(body, buffers)))

    def spawn(self, name: str) -> None:
        body, buffers = dumps((Echo, (), {}, Extent({"gpus": 2}), [0, 1], {"creator_display": "t", "name": name}))
        self.host.dispatch({"kind": "spawn", "actor": name, "ep": "__init__", "cid": "c:spawn", "idx": -1,
                            "reply_to": "elsewhere"}, body, list(buffers))

    def call(self, name: str, n: int, local_peer: bool = True) -> None:
        body, buffers = dumps(((n,), {}))
        header = {"kind": "call", "actor": name, "ep": "echo", "cid": f"c:{n}", "idx": n, "reply_to": "pm0.0#1"}
        if local_peer:
            header["_local_peer"] = 1
        self.host.dispatch(header, body, list(buffers))

    def answered(self) -> list[tuple[int, bool, Any]]:
        with self.lock:
            return [r for r in self.replies if r[0] >= 0]


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not true within the deadline"
        time.sleep(0.005)


def test_a_peers_call_before_the_spawn_waits_for_it_and_runs_after_it_in_order():
    actors = Actors()
    with contextlib.ExitStack() as stack:
        stack.callback(actors.host.stop_all, 2.0)
        for n in range(3):
            actors.call("echo0", n)
        assert actors.answered() == [] and len(actors.timers) == 1, "held, one timer for the actor"
        actors.spawn("echo0")
        _wait(lambda: len(actors.answered()) == 3)
        assert actors.answered() == [(0, True, 0), (1, True, 1), (2, True, 2)]
        actors.timers[0][1]()  # its timer fires after the spawn: nothing left to refuse
        assert len(actors.answered()) == 3


def test_a_peers_call_for_a_stopped_actor_waits_for_a_new_spawn_of_its_id():
    """An actor stopped here, then a new mesh under the same id: a peer's call that comes before
    the new spawn runs on the new actor (not refused with the old one's failure)."""
    actors = Actors()
    with contextlib.ExitStack() as stack:
        stack.callback(actors.host.stop_all, 2.0)
        actors.spawn("c")
        actors.call("c", 1)
        _wait(lambda: len(actors.answered()) == 1)
        actors.host.dispatch({"kind": "stop_actors", "actor": "c", "ep": "", "cid": "c:stop", "idx": -2,
                              "reply_to": "elsewhere"}, b"", [])
        _wait(lambda: "c" in actors.host._tombstones)
        assert [delay for delay, _ in actors.timers] == [STOP_GRACE_S]  # the stop's grace (it stopped in time)
        actors.call("c", 2)
        assert len(actors.answered()) == 1 and [delay for delay, _ in actors.timers] == [STOP_GRACE_S, HOLD_FOR_SPAWN_S], \
            "held for a spawn"
        actors.spawn("c")
        _wait(lambda: len(actors.answered()) == 2)
        assert actors.answered()[1] == (2, True, 2)


def test_a_peers_call_whose_spawn_never_comes_is_refused_when_its_wait_ends():
    actors = Actors()
    actors.call("nobody", 7)
    [(delay, give_up)] = actors.timers
    assert delay == actor_host.HOLD_FOR_SPAWN_S and actors.answered() == []
    give_up()
    [(idx, ok, info)] = actors.answered()
    assert (idx, ok) == (7, False) and "no actor 'nobody'" in info["message"]
    # not from a peer of the host (through the controller, which kept the spawn's order): refused at once
    actors.call("nobody", 8, local_peer=False)
    assert [r[:2] for r in actors.answered()] == [(7, False), (8, False)] and len(actors.timers) == 1
