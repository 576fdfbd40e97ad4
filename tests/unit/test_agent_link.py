"""The controller's messages through a host agent (monarch_nb.runtime.proc_link): real ZeroMQ
sockets (a controller's ROUTER, an agent's DEALER and link, procs' DEALERs and links) in one
process, no worker processes."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import zmq

from monarch_nb.runtime.proc_link import AgentLink, link_to_agent
from monarch_nb.transport.channel import Channel, read_tree_routing
from monarch_nb.transport.wire import INLINE_BODY_MAX, Signer, encode

KEY = b"0123456789abcdef0123456789abcdef"


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("not true within the deadline")
        time.sleep(0.005)


class Inbox:
    """A channel's received messages: ``(kind, header)`` in arrival order."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, header: Any, body: memoryview, buffers: list, frames: list) -> None:
        with self.lock:
            self.items.append({**header, "body": bytes(body)})

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [h for h in self.items if h["kind"] == kind]


class Gate:
    """The agent's ``on_routed``: passes casts on, or holds them while closed (a slow agent); the
    first cast after it opens passes the held ones first (all on the agent's IO thread)."""

    def __init__(self, link: AgentLink) -> None:
        self.link, self.open, self.waiting = link, threading.Event(), []
        self.open.set()

    def __call__(self, routes: list[bytes], frames: list) -> None:
        if not self.open.is_set():
            self.waiting.append((routes, frames))
            return
        for held in self.waiting:
            self.link.forward(*held)
        self.waiting.clear()
        self.link.forward(routes, frames)


@contextlib.contextmanager
def one_host(tmp_path, controller_name: str = "controller") -> Iterator[tuple[Channel, Channel, AgentLink, dict[str, Channel], dict[str, Inbox]]]:
    """A controller, one host agent with its link (its ``on_routed`` and the link's
    ``on_gathered`` for the caller to set), procs pm0.0 and pm0.1 linked to it and pm0.2 not
    linked; each has said hello, so the controller's ROUTER knows them. Yields (controller,
    agent, link, procs, inboxes); closes them all."""
    signer = Signer(KEY)
    inbox: dict[str, Inbox] = {name: Inbox() for name in (controller_name, "host0", "pm0.0", "pm0.1", "pm0.2")}
    controller = Channel(controller_name, signer, inbox[controller_name], router=True)
    address = controller.bind(f"ipc://{tmp_path}/ctl")
    controller.start()
    agent = Channel("host0#1", signer, inbox["host0"])
    link = AgentLink(str(tmp_path))
    agent.add_reader(link.fd, link.on_readable)
    agent.connect(address)
    agent.start()
    procs: dict[str, Channel] = {}
    channels = [controller, agent]
    try:
        agent.send(controller_name, {"kind": "agent_hello"})
        for rank in range(3):
            name = f"pm0.{rank}"
            proc = procs[name] = Channel(f"{name}#{100 + rank}", signer, inbox[name])
            channels.append(proc)
            if rank < 2:
                sock = link_to_agent(link.address, name, timeout_s=5)
                assert sock is not None, "the agent answered the link"
                proc.add_link(sock)
            proc.connect(address)
            proc.start()
            proc.send(controller_name, {"kind": "hello"})
        wait_for(lambda: len(inbox[controller_name].items) == 4)
        controller.route_via("pm0.0", "host0", 100)
        controller.route_via("pm0.1", "host0", 101)
        yield controller, agent, link, procs, inbox
    finally:
        for channel in channels:
            channel.close()
        link.close()


@contextlib.contextmanager
def hub_peer(tmp_path, identity: bytes) -> Iterator[zmq.Socket]:
    """A bare DEALER connected to :func:`one_host`'s controller as ``identity``: sends frames of
    its choosing (a forged or buggy message) through the hub. Closed on exit."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"ipc://{tmp_path}/ctl")
    try:
        yield sock
    finally:
        sock.close()


@pytest.fixture
def cluster(tmp_path):
    """:func:`one_host`, the agent passing casts on through a :class:`Gate`, casts to 2 procs of
    the one host through it."""
    with one_host(tmp_path) as (controller, agent, link, procs, inbox):
        controller.fan_min_procs, controller.fan_min_hosts = 2, 1  # one host of 2 linked procs: casts to both through it
        agent.on_routed = gate = Gate(link)
        yield controller, link, procs, inbox, gate


def test_a_cast_to_the_procs_of_a_host_is_one_message_through_its_agent(cluster):
    controller, link, procs, inbox, gate = cluster
    controller.send_many([f"pm0.{r}" for r in range(3)], {"kind": "call", "actor": "a", "ep": "f"}, b"the body",
                         each={"rank": [0, 1, 2], "idx": [0, 1, 2]})
    wait_for(lambda: all(inbox[f"pm0.{r}"].of_kind("call") for r in range(3)))
    for rank in range(3):
        [got] = inbox[f"pm0.{rank}"].of_kind("call")
        assert (got["rank"], got["idx"], got["body"], got["ep"]) == (rank, rank, b"the body", "f"), got
        assert got["dst"] == f"pm0.{rank}" and "fan" not in got
    assert controller.sent_via_agents == 1, "pm0.0 and pm0.1 in one message; pm0.2 (not linked) straight"
    assert link.forwarded == 2 and link.unreachable == 0
    assert not inbox["host0"].items, "the agent passed it on unread"


def test_a_cast_to_the_same_procs_goes_the_way_their_links_say_now(cluster):
    """The way a cast takes is planned once per list of destinations and made again when a
    proc is linked or unlinked or a threshold changes: the same cast goes straight, through the
    agent, straight again."""
    controller, link, procs, inbox, gate = cluster
    dsts = ["pm0.0", "pm0.1"]
    controller.route_direct("pm0.1")  # as if its hello had not said it was linked
    controller.send_many(dsts, {"kind": "call", "n": 1})
    wait_for(lambda: all(len(inbox[d].of_kind("call")) == 1 for d in dsts))
    assert controller.sent_via_agents == 0, "one linked proc on the host: each straight"
    controller.route_via("pm0.1", "host0", 101)
    controller.send_many(dsts, {"kind": "call", "n": 2})
    wait_for(lambda: all(len(inbox[d].of_kind("call")) == 2 for d in dsts))
    assert controller.sent_via_agents == 1, "both linked now: one message through the agent"
    controller.fan_min_hosts = 2
    controller.send_many(dsts, {"kind": "call", "n": 3})
    wait_for(lambda: all(len(inbox[d].of_kind("call")) == 3 for d in dsts))
    assert controller.sent_via_agents == 1, "one host is fewer than the threshold now: straight"
    controller.fan_min_hosts = 1
    controller.route_direct("pm0.1")
    controller.send_many(dsts, {"kind": "call", "n": 4})
    wait_for(lambda: all(len(inbox[d].of_kind("call")) == 4 for d in dsts))
    assert controller.sent_via_agents == 1
    for dst in dsts:
        assert [h["n"] for h in inbox[dst].of_kind("call")] == [1, 2, 3, 4]
        assert not procs[dst].dropped, procs[dst].dropped


def test_a_proc_named_twice_in_a_cast_gets_it_twice_and_nothing_waits(cluster):
    """Its second copy goes straight (one fan entry a proc), numbered after the first."""
    controller, link, procs, inbox, gate = cluster
    controller.send_many(["pm0.0", "pm0.1", "pm0.0"], {"kind": "call"}, each={"rank": [0, 1, 2]})
    wait_for(lambda: len(inbox["pm0.0"].of_kind("call")) == 2 and len(inbox["pm0.1"].of_kind("call")) == 1)
    assert sorted(h["rank"] for h in inbox["pm0.0"].of_kind("call")) == [0, 2]
    controller.send("pm0.0", {"kind": "call", "rank": 3})
    wait_for(lambda: len(inbox["pm0.0"].of_kind("call")) == 3)
    assert procs["pm0.0"].held == 0 and not procs["pm0.0"].dropped


def test_a_signed_cast_whose_fan_does_not_add_up_is_dropped_and_counted(cluster, tmp_path):
    """A column shorter than the routes, or routes that are not a list (a bug in a sender
    holding the key): the proc drops it as bad, and the next cast still arrives."""
    controller, link, procs, inbox, gate = cluster
    with hub_peer(tmp_path, b"buggy") as sender:
        bad = encode(Signer(KEY), {"kind": "call", "src": "buggy", "dst": "host0", "seq": 1,
                                   "fan": {"to": ["pm0.0", "pm0.1"], "rank": [0]}})
        sender.send_multipart([b"host0", b"@pm0.0,pm0.1", *bad])
        wait_for(lambda: procs["pm0.1"].dropped["bad"] == 1)
        as_text = encode(Signer(KEY), {"kind": "call", "src": "buggy", "dst": "host0", "seq": 2,  # found as a substring
                                       "fan": {"to": "pm0.10,pm0.1", "rank": "ab"}})
        sender.send_multipart([b"host0", b"@pm0.1", *as_text])
        wait_for(lambda: procs["pm0.1"].dropped["bad"] == 2)
    assert procs["pm0.0"].dropped["bad"] == 0 and inbox["pm0.0"].of_kind("call")[0]["rank"] == 0, "its entry was there"
    controller.send_many(["pm0.0", "pm0.1"], {"kind": "call", "n": 2}, each={"rank": [0, 1]})
    wait_for(lambda: [h.get("n") for h in inbox["pm0.1"].of_kind("call")] == [2])


def test_a_message_that_overtakes_a_cast_waits_for_it(cluster):
    """A cast goes through the agent, a message to one proc straight to it: the later one may
    arrive first, and waits (in the proc's channel) until the cast is delivered."""
    controller, link, procs, inbox, gate = cluster
    gate.open.clear()  # the agent is slow
    controller.send_many(["pm0.0", "pm0.1"], {"kind": "call", "n": 1})
    wait_for(lambda: len(gate.waiting) == 1)
    controller.send("pm0.0", {"kind": "call", "n": 2})
    wait_for(lambda: procs["pm0.0"].held == 1)
    assert not inbox["pm0.0"].of_kind("call"), "n=2 waits for n=1"
    gate.open.set()
    controller.send_many(["pm0.0", "pm0.1"], {"kind": "call", "n": 3})
    wait_for(lambda: len(inbox["pm0.0"].of_kind("call")) == 3 and len(inbox["pm0.1"].of_kind("call")) == 2)
    assert [h["n"] for h in inbox["pm0.0"].of_kind("call")] == [1, 2, 3]
    assert [h["n"] for h in inbox["pm0.1"].of_kind("call")] == [1, 3]
    assert procs["pm0.0"].held == 0 and not procs["pm0.0"].dropped


def test_a_peers_message_passed_on_after_a_cast_waits_for_the_cast(cluster):
    """The controller's socket keeps the order in which it sends a proc its own messages and
    those it passes on from peers (before the link they shared one pipe): a peer's call to an
    actor the controller just spawned by a cast must not find it missing."""
    controller, link, procs, inbox, gate = cluster
    gate.open.clear()
    controller.send_many(["pm0.0", "pm0.1"], {"kind": "spawn", "n": 1})
    wait_for(lambda: len(gate.waiting) == 1)
    procs["pm0.2"].send("pm0.0", {"kind": "call", "n": 2})  # through the controller's hub
    wait_for(lambda: procs["pm0.0"].held == 1)
    assert not inbox["pm0.0"].items
    gate.open.set()
    controller.send_many(["pm0.0", "pm0.1"], {"kind": "call", "n": 3})
    wait_for(lambda: len(inbox["pm0.0"].items) == 3)
    assert [(h["kind"], h["n"], h["src"]) for h in inbox["pm0.0"].items] == [
        ("spawn", 1, "controller"), ("call", 2, "pm0.2#102"), ("call", 3, "controller")]


def test_a_message_numbered_for_another_incarnation_is_dropped(cluster):
    """Sent to a proc's name before its new incarnation's hello was heard: not for this one."""
    controller, link, procs, inbox, gate = cluster
    controller.route_via("pm0.0", "host0", 99)  # what the controller believes
    controller.send("pm0.0", {"kind": "call"})
    wait_for(lambda: procs["pm0.0"].dropped["other incarnation"] == 1)
    controller.route_via("pm0.0", "host0", 100)  # its hello
    controller.send("pm0.0", {"kind": "call", "n": 1})
    wait_for(lambda: len(inbox["pm0.0"].of_kind("call")) == 1)
    assert inbox["pm0.0"].of_kind("call")[0]["n"] == 1


def test_the_controllers_messages_to_a_linked_proc_keep_their_order(cluster):
    """FIFO from the controller to a proc across its single messages (straight) and casts
    (through the agent): 300 messages, more than one turn of the proc's loop reads from either
    socket (64)."""
    controller, link, procs, inbox, gate = cluster
    for n in range(300):
        if n % 3:
            controller.send("pm0.0", {"kind": "call", "n": n})
        else:
            controller.send_many(["pm0.0", "pm0.1"], {"kind": "call", "n": n})
    wait_for(lambda: len(inbox["pm0.0"].of_kind("call")) == 300 and len(inbox["pm0.1"].of_kind("call")) == 100)
    assert [h["n"] for h in inbox["pm0.0"].of_kind("call")] == list(range(300))
    assert [h["n"] for h in inbox["pm0.1"].of_kind("call")] == list(range(0, 300, 3))
    assert not procs["pm0.0"].dropped and not procs["pm0.1"].dropped


def test_a_forged_message_routed_through_the_agent_is_dropped_by_the_proc(cluster, tmp_path):
    """Anyone who reaches the controller's hub can have a message routed through an agent; the
    proc verifies it as any other (the agent reads only the routing frame)."""
    controller, link, procs, inbox, gate = cluster
    with hub_peer(tmp_path, b"forger") as forger:
        forged = encode(Signer(b"another key of 32 bytes........."), {"kind": "stop", "src": "controller", "dst": "pm0.0", "seq": 10**9})
        forger.send_multipart([b"host0", b"@pm0.0", *forged])
        wait_for(lambda: procs["pm0.0"].dropped["bad"] == 1)
    assert not inbox["pm0.0"].of_kind("stop")
    controller.send("pm0.0", {"kind": "call"})  # and the path still works
    wait_for(lambda: len(inbox["pm0.0"].of_kind("call")) == 1)


def test_a_message_for_a_proc_that_is_not_linked_is_dropped_and_counted_by_the_agent(cluster):
    controller, link, procs, inbox, gate = cluster
    controller.route_via("pm0.9", "host0", 109)  # gone, or never linked
    controller.send_many(["pm0.9", "pm0.1"], {"kind": "call"}, each={"rank": [9, 1]})
    wait_for(lambda: link.unreachable == 1)
    wait_for(lambda: len(inbox["pm0.1"].of_kind("call")) == 1)
    assert inbox["pm0.1"].of_kind("call")[0]["rank"] == 1, "the agent goes on with the others"


def test_a_link_that_no_agent_answers_is_given_up_on(tmp_path):
    started = time.monotonic()
    assert link_to_agent(f"ipc://{tmp_path}/nobody", "pm0.0", timeout_s=0.2) is None
    assert time.monotonic() - started < 2.0
    assert AgentLink(str(tmp_path), enabled=False).address == "", "config.messages_via_agents off: no link"


def test_a_procs_message_to_the_hub_names_no_destination_and_arrives_whole(tmp_path):
    """A proc's channel made with ``hub=`` sends its messages to the controller without a
    destination frame (one frame less each way); the controller reads such a message, and its
    zero-copy buffer, as it reads one that names it, and still passes a message for a peer on."""
    signer = Signer(KEY)
    got: dict[str, list[tuple[dict, list[bytes]]]] = {"controller": [], "pm0.1": []}

    def receiver(name: str) -> Callable[..., None]:
        return lambda header, body, buffers, frames: got[name].append((dict(header), [bytes(b) for b in buffers]))

    controller = Channel("controller", signer, receiver("controller"), router=True)
    address = controller.bind(f"ipc://{tmp_path}/ctl")
    controller.start()
    procs = [Channel(f"pm0.{r}#{100 + r}", signer, receiver(f"pm0.{r}") if r else (lambda *a: None), hub="controller")
             for r in range(2)]
    sent: list[list[Any]] = []
    try:
        for proc in procs:
            proc.connect(address)
            proc.start()
            proc.send("controller", {"kind": "hello"})
        wait_for(lambda: len(got["controller"]) == 2)
        original = procs[0]._send_locked
        procs[0]._send_locked = lambda frames, link=None: (sent.append(frames), original(frames, link))  # type: ignore[method-assign]
        tensor = bytes(range(256)) * 1024  # 256 KiB: a zero-copy buffer
        procs[0].send("controller", {"kind": "report"}, b"small", [tensor])
        procs[0].send("pm0.1", {"kind": "call"}, b"for a peer")
        wait_for(lambda: len(got["controller"]) == 3 and len(got["pm0.1"]) == 1)
        header, buffers = got["controller"][2]
        assert header["kind"] == "report" and buffers == [tensor]
        assert got["pm0.1"][0][0]["src"] == "pm0.0#100", "the hub passed the peer's message on"
        assert sent[0][0][:4] == b"MNB2", "to the hub: the envelope first, no destination frame"
        assert sent[1][0] == b"pm0.1", "to a peer: its route first, for the hub to forward"
        assert not controller.dropped and not procs[1].dropped
    finally:
        for channel in (*procs, controller):
            channel.close()


def test_a_cast_down_the_relay_tree_is_one_message_and_a_member_gets_its_part_straight_once(cluster, tmp_path):
    """Hosts heard through one relay: a cast to procs of both is one message to the relay
    (``@@CAST;HOST=ROUTES;...``, the signed message once); the relay holding it, the controller
    sends the member its part straight (a member that left its relay), and the procs drop a part
    that comes twice; a part holds its host's procs alone (their replies gathered by that count)."""
    controller, link, procs, inbox, gate = cluster
    controller.fan_min_hosts = 2
    controller.route_via("pm9.0", "relay0", 900)  # a linked proc of the relay's own host (never connected here)
    with hub_peer(tmp_path, b"relay0") as relay:
        relay.send_multipart(encode(Signer(KEY), {"kind": "agent_hello", "src": "relay0#1", "dst": "controller", "seq": 1}))
        wait_for(lambda: any(h["src"] == "relay0#1" for h in inbox["controller"].of_kind("agent_hello")))  # connected
        controller.cast_through("host0", "relay0")
        controller.send_many(["pm0.0", "pm0.1", "pm9.0"], {"kind": "call", "gth": 1}, each={"rank": [0, 1, 2]})
        assert relay.poll(5000), "the relay got the cast"
        frames = relay.recv_multipart()
        assert read_tree_routing(frames[0]) == (1, [(b"host0", [b"pm0.0", b"pm0.1"]), (b"relay0", [b"pm9.0"])])
        assert controller.sent_via_relays == 1 and controller.sent_via_agents == 0, "one message, to the relay"
        assert controller.resend_relayed("relay0", ["host0", "relay0"]) == 1, "the member's part; the relay's own is not resent"
        wait_for(lambda: all(inbox[f"pm0.{r}"].of_kind("call") for r in range(2)))
        for rank in range(2):
            [got] = inbox[f"pm0.{rank}"].of_kind("call")
            assert (got["rank"], got["_fanned"], got["dst"]) == (rank, 2, f"pm0.{rank}")
        assert controller.resend_relayed("relay0", ["host0"], cast=1) == 1
        wait_for(lambda: procs["pm0.0"].dropped["replayed"] == 1 and procs["pm0.1"].dropped["replayed"] == 1)
        assert controller.resend_relayed("relay0", ["host0"], cast=2) == 0, "no such cast"
        assert controller.resend_relayed("relay0", ["relay0"], cast=1) == 1, "the relay could not split it: its own part too"
        assert relay.poll(5000) and relay.recv_multipart()[0] == b"@pm9.0"
        # a cast planned before host0 left the relay is not sent down the tree (nothing would resend it)
        plan = controller._fan_plan(["pm0.0", "pm0.1", "pm9.0"])
        controller.cast_through("host0", None)
        assert not controller._send_tree(plan.trees[0], plan.version, {"kind": "call"}, {}, b"")
        assert controller.sent_via_relays == 1
        controller.cast_through("host0", None)
        controller.send_many(["pm0.0", "pm0.1", "pm9.0"], {"kind": "call", "n": 2}, each={"rank": [0, 1, 2]})
        wait_for(lambda: all(len(inbox[f"pm0.{r}"].of_kind("call")) == 2 for r in range(2)))
        assert controller.sent_via_relays == 1 and controller.sent_via_agents == 1, "straight through host0's agent again"
        controller.cast_through("host0", "relay0")
        large = b"x" * (INLINE_BODY_MAX + 1)  # not kept for a resend: one message a host
        controller.send_many(["pm0.0", "pm0.1", "pm9.0"], {"kind": "call", "n": 3}, large, each={"rank": [0, 1, 2]})
        wait_for(lambda: all(len(inbox[f"pm0.{r}"].of_kind("call")) == 3 for r in range(2)))
        assert inbox["pm0.0"].of_kind("call")[-1]["body"] == large
        assert relay.poll(5000) and relay.recv_multipart()[0] == b"@pm9.0", "the relay's own part, as any agent's"
        assert controller.sent_via_relays == 1 and controller.sent_via_agents == 3


def test_a_relay_routing_frame_that_is_not_one_is_refused():
    assert read_tree_routing(b"@@7;h1=a,b;h2=c") == (7, [(b"h1", [b"a", b"b"]), (b"h2", [b"c"])])
    for bad in (b"@a,b", b"@@x;h1=a", b"@@1;h1", b"@@1;=a", b"@@1;h1="):
        with pytest.raises(ValueError):
            read_tree_routing(bad)
