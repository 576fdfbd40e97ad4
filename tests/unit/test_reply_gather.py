"""Replies gathered per host (monarch_nb.runtime.reply_gather) and their order against a proc's
other messages (monarch_nb.transport.channel): real ZeroMQ sockets (a controller's ROUTER, an
agent's DEALER and link, procs' DEALERs and links) in one process, no worker processes; and the
gatherer alone, driven by hand."""

from __future__ import annotations

from typing import Any

import pytest

from monarch_nb.runtime import reply_gather
from monarch_nb.runtime.protocol import CONTROLLER, Kind
from monarch_nb.runtime.reply_gather import ReplyGather
from monarch_nb.transport import channel as channel_module
from monarch_nb.transport.channel import Channel
from monarch_nb.transport.wire import Signer, encode

from .test_agent_link import KEY, Inbox, one_host, wait_for


def reply(cid: str, idx: int, ok: bool = True) -> dict[str, Any]:
    return {"kind": Kind.REPLY, "cid": cid, "idx": idx, "ok": ok}


@pytest.fixture
def cluster(tmp_path):
    """test_agent_link's :func:`one_host` (the controller named as the runtime names it), its agent
    gathering its procs' replies. The agent's linger is long (30 s): a test that wants it short
    sets ``gather.linger_s``."""
    with one_host(tmp_path, CONTROLLER) as (controller, agent, link, procs, inbox):
        gather = ReplyGather(Signer(KEY), lambda header, body: agent.send(CONTROLLER, header, body), agent.call_later, linger_s=30.0)
        link.on_gathered = gather.on_link_message
        yield controller, gather, procs, inbox[CONTROLLER]


def test_the_replies_of_a_hosts_procs_to_a_call_reach_the_controller_as_one_message(cluster):
    controller, gather, procs, inbox = cluster
    procs["pm0.0"].send(CONTROLLER, reply("c1", 0), b"zero", gather=2)
    procs["pm0.1"].send(CONTROLLER, reply("c1", 1), b"one!", gather=2)
    procs["pm0.2"].send(CONTROLLER, reply("c1", 2), b"two", gather=2)  # not linked: straight
    wait_for(lambda: inbox.of_kind("replies") and inbox.of_kind("reply"))
    [gathered] = inbox.of_kind("replies")
    assert gathered["cid"] == "c1" and gathered["src"] == "host0#1"
    assert gathered["gathered"] == [["pm0.0#100", 1, 0, True, 4], ["pm0.1#101", 1, 1, True, 4]]
    assert gathered["body"] == b"zeroone!"
    assert [h["src"] for h in inbox.of_kind("reply")] == ["pm0.2#102"]
    assert (gather.sent, gather.gathered, gather.dropped) == (1, 2, 0)


def test_a_message_sent_after_a_gathered_reply_waits_at_the_controller_until_it_came(cluster):
    """The agent holds pm0.0's reply (pm0.1's is not in yet); what pm0.0 sends the controller
    straight after it (here an actor failure) must not overtake it, and does not."""
    controller, gather, procs, inbox = cluster
    procs["pm0.0"].send(CONTROLLER, reply("c1", 0), b"ok", gather=2)
    procs["pm0.0"].send(CONTROLLER, {"kind": "actor_failed", "actor": "a", "rank": 0})
    procs["pm0.1"].send(CONTROLLER, {"kind": "actor_error", "actor": "a"})  # pm0.1 gathered nothing: not held
    wait_for(lambda: inbox.of_kind("actor_error") and controller._waiting)
    assert not inbox.of_kind("actor_failed") and not inbox.of_kind("replies")
    procs["pm0.1"].send(CONTROLLER, reply("c1", 1), b"ok", gather=2)  # the agent's gathering is complete
    wait_for(lambda: inbox.of_kind("actor_failed"))
    kinds = [h["kind"] for h in inbox.items if h["src"].startswith("pm0.0") or h["kind"] == "replies"]
    assert kinds[-2:] == ["replies", "actor_failed"], kinds
    assert inbox.of_kind("actor_failed")[0]["after"] == 1
    assert not controller._waiting and not controller.dropped


def test_a_reply_that_cannot_be_gathered_goes_straight_and_the_agent_waits_for_one_fewer(cluster):
    controller, gather, procs, inbox = cluster
    procs["pm0.0"].send(CONTROLLER, reply("c1", 0), b"a tensor's pickle", [b"its memory"], gather=2)  # a buffer: straight
    procs["pm0.1"].send(CONTROLLER, reply("c1", 1), b"small", gather=2)
    wait_for(lambda: inbox.of_kind("replies") and inbox.of_kind("reply"))  # at once, not after the 30 s linger
    assert [item[0] for item in inbox.of_kind("replies")[0]["gathered"]] == ["pm0.1#101"]
    assert inbox.of_kind("reply")[0]["src"] == "pm0.0#100"


def test_a_call_whose_last_reply_does_not_come_has_the_others_sent_after_the_linger(cluster):
    controller, gather, procs, inbox = cluster
    gather.linger_s = 0.05
    procs["pm0.0"].send(CONTROLLER, reply("c1", 0), b"ok", gather=2)
    wait_for(lambda: inbox.of_kind("replies"), timeout_s=5)
    assert [item[0] for item in inbox.of_kind("replies")[0]["gathered"]] == ["pm0.0#100"]
    procs["pm0.1"].send(CONTROLLER, reply("c1", 1), b"late", gather=2)  # the rest as it comes
    wait_for(lambda: len(inbox.of_kind("replies")) == 2, timeout_s=5)
    assert inbox.of_kind("replies")[1]["body"] == b"late"


def test_a_reply_for_another_proc_is_dropped_by_the_agent_and_one_for_a_proc_of_another_agent_by_the_controller(cluster, tmp_path):
    controller, gather, procs, inbox = cluster
    signer = Signer(KEY)
    # pm0.0's link carries a reply signed as pm0.1's: a proc speaks only for itself
    forged = encode(signer, {**reply("c1", 1), "src": "pm0.1#101", "dst": CONTROLLER, "seq": 10**6, "gk": 1})
    procs["pm0.0"]._to_link([b"%2", *forged])
    wait_for(lambda: gather.dropped == 1)
    # an agent that names a proc linked to another agent (pm0.2 is linked to none)
    rogue = Channel("host9#9", signer, Inbox())
    rogue.connect(f"ipc://{tmp_path}/ctl")
    rogue.start()
    try:
        rogue.send(CONTROLLER, {"kind": "replies", "cid": "c1", "gathered": [["pm0.2#102", 1, 2, True, 1], ["pm0.0#100", 1, 0, True, 1]]}, b"xy")
        wait_for(lambda: inbox.of_kind("replies"))
    finally:
        rogue.close()
    assert inbox.of_kind("replies")[0]["gathered"] == [["pm0.2#102", None, 2, True, 1], ["pm0.0#100", None, 0, True, 1]], \
        "neither pm0.2 (linked to no agent) nor pm0.0 (host0's) is host9's: both marked dropped"
    assert controller.dropped["gathered"] == 2


def test_a_message_held_for_gathered_replies_that_never_come_is_delivered_after_a_while(cluster, monkeypatch):
    controller, gather, procs, inbox = cluster
    monkeypatch.setattr(channel_module, "GATHER_WAIT_MAX_S", 0.2)
    procs["pm0.0"].send(CONTROLLER, reply("c1", 0), b"ok", gather=2)  # held at the agent (30 s linger, pm0.1 never answers)
    procs["pm0.0"].send(CONTROLLER, {"kind": "actor_failed", "actor": "a", "rank": 0})
    wait_for(lambda: inbox.of_kind("actor_failed"), timeout_s=5)
    assert controller.dropped["gathered late"] == 1 and not inbox.of_kind("replies")


def test_a_proc_that_exits_has_its_held_replies_sent_by_flush_all():
    """The gatherer alone: the agent calls flush_all before it reports a proc's exit."""
    signer, sent, timers = Signer(KEY), [], []
    gather = ReplyGather(signer, lambda header, body: sent.append((header, body)), lambda delay, fn: timers.append(fn))
    frames = encode(signer, {**reply("c1", 0), "src": "pm0.0#100", "dst": CONTROLLER, "seq": 1, "gk": 1}, b"ok")
    gather.on_link_message(b"pm0.0", [b"%3", *frames])
    assert not sent and len(timers) == 1, "held, its linger set"
    gather.flush_all()
    assert [(h["cid"], h["gathered"], body) for h, body in sent] == [("c1", [["pm0.0#100", 1, 0, True, 2]], b"ok")]
    timers[0]()  # the linger after the flush: nothing more to send
    assert len(sent) == 1
    gather.on_link_message(b"pm0.0", [b"%3", *frames])  # the same reply again
    assert gather.dropped == 1 and len(sent) == 1, "a replay is dropped"
    assert reply_gather.GATHER_LINGER_S <= 0.05, "a proc's later messages wait at most this long behind its held reply"


def test_a_gathered_reply_the_controller_drops_keeps_its_bytes_so_the_next_ones_read_their_own(cluster, tmp_path):
    """A host's replies in one message, the first from an incarnation the controller no longer
    has (a proc restarted meanwhile), the second current: the first is marked dropped (``gk``
    None), not removed, so each later item's body is still found at its offset."""
    controller, gather, procs, inbox = cluster
    signer = Signer(KEY)
    agent = Channel("host0#2", signer, Inbox())  # a message of host0's agent (another incarnation: its own seq)
    agent.connect(f"ipc://{tmp_path}/ctl")
    agent.start()
    try:
        agent.send(CONTROLLER, {"kind": "replies", "cid": "c1", "gathered": [["pm0.0#99", 1, 0, True, 5],
                                                                             ["pm0.1#101", 1, 1, True, 3]]}, b"stalecur")
        wait_for(lambda: inbox.of_kind("replies"))
    finally:
        agent.close()
    [got] = inbox.of_kind("replies")
    assert got["gathered"] == [["pm0.0#99", None, 0, True, 5], ["pm0.1#101", 1, 1, True, 3]] and got["body"] == b"stalecur"
    offset = sum(item[4] for item in got["gathered"][:1])
    assert got["body"][offset:offset + 3] == b"cur", "pm0.1's reply is its own bytes"
    assert controller.dropped["gathered"] == 1


def test_gathered_replies_are_cut_at_an_item_whose_size_cannot_be_known(cluster, tmp_path):
    """A buggy agent's item that is not a list (a tuple, a string): its bytes cannot be placed,
    so it and the items after it are dropped, the ones before it kept."""
    controller, gather, procs, inbox = cluster
    agent = Channel("host0#3", Signer(KEY), Inbox())
    agent.connect(f"ipc://{tmp_path}/ctl")
    agent.start()
    try:
        agent.send(CONTROLLER, {"kind": "replies", "cid": "c2", "gathered": [["pm0.1#101", 1, 1, True, 3], ("pm0.0#100", 1, 0, True, 2),
                                                                             ["pm0.0#100", 1, 0, True, 2]]}, b"curxxyy")
        wait_for(lambda: inbox.of_kind("replies"))
    finally:
        agent.close()
    [got] = inbox.of_kind("replies")
    assert got["gathered"] == [["pm0.1#101", 1, 1, True, 3]] and controller.dropped["gathered"] == 2


def test_a_serving_relays_replies_for_its_members_procs_are_taken_and_a_plain_agents_are_not(cluster, tmp_path):
    """Up the relay tree: a relay's merged replies hold other agents' procs' replies; the
    controller takes them from an agent it knows serves as a relay (``relay_serves``), drops
    them from any other, and drops a number it had (a member's resend after its relay's)."""
    controller, gather, procs, inbox = cluster
    relay = Channel("host9#9", Signer(KEY), Inbox())
    relay.connect(f"ipc://{tmp_path}/ctl")
    relay.start()
    try:
        item = ["pm0.0#100", 1, 0, True, 1]
        relay.send(CONTROLLER, {"kind": "replies", "cid": "c1", "gathered": [list(item)]}, b"x")
        wait_for(lambda: len(inbox.of_kind("replies")) == 1)
        controller.relay_serves("host9#9", True)
        relay.send(CONTROLLER, {"kind": "replies", "cid": "c1", "gathered": [list(item)]}, b"x")
        relay.send(CONTROLLER, {"kind": "replies", "cid": "c1", "gathered": [list(item)]}, b"x")  # the same again
        wait_for(lambda: len(inbox.of_kind("replies")) == 3)
        controller.relay_serves("host9#9", False)
        relay.send(CONTROLLER, {"kind": "replies", "cid": "c1", "gathered": [["pm0.1#101", 1, 1, True, 1]]}, b"y")
        wait_for(lambda: len(inbox.of_kind("replies")) == 4)
    finally:
        relay.close()
    assert [got["gathered"][0][1] for got in inbox.of_kind("replies")] == [None, 1, None, None], \
        "not a relay: dropped; a relay: taken; the same number again: dropped; no longer a relay: dropped"
    assert controller.replies_via_relays == 1


def test_a_relay_merges_its_hosts_replies_to_a_call_it_split_into_one_message():
    """The relay's merge alone, driven by hand: it knows how many of its hosts' procs gather."""
    sent, timers = [], []
    merge = reply_gather.ReplyMerge(lambda header, body: sent.append((header, body)), lambda delay, fn: timers.append(fn))
    merge.expect("c1", 4)
    merge.add({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.0#1", 1, 0, True, 1], ["pm0.1#2", 1, 1, True, 2]], "n": 2}, b"abb")
    assert not sent and len(timers) == 1, "held for the other host's, its linger set"
    merge.add({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.2#3", 1, 2, True, 1]], "n": 2}, b"c")  # one went straight
    assert [(h["cid"], [i[0] for i in h["gathered"]], body) for h, body in sent] == [("c1", ["pm0.0#1", "pm0.1#2", "pm0.2#3"], b"abbc")]
    merge.add({"kind": Kind.REPLIES, "cid": "c9", "gathered": [["pm0.3#4", 1, 0, True, 1]], "n": 1}, b"d")
    assert sent[-1][0]["cid"] == "c9" and len(sent) == 2, "a call not split here (its cast came straight): sent on at once"
    merge.expect("c2", 4)
    merge.add({"kind": Kind.REPLIES, "cid": "c2", "gathered": [["pm0.0#1", 2, 0, True, 1]], "n": 1}, b"e")
    timers[-1]()  # the linger: what is held goes, the rest as it comes
    merge.add({"kind": Kind.REPLIES, "cid": "c2", "gathered": [["pm0.1#2", 2, 1, True, 1]], "n": 3}, b"f")
    assert [body for _, body in sent[2:]] == [b"e", b"f"]
    assert reply_gather.RELAY_LINGER_S <= 0.1, "a proc's later messages wait at most this long behind a relay's held reply"


def test_a_member_keeps_what_it_sent_up_for_a_few_seconds_and_at_most_so_many_bytes(monkeypatch):
    kept = reply_gather.KeptReplies(keep_s=1.0, max_bytes=10)
    clock = [100.0]
    monkeypatch.setattr(reply_gather.time, "monotonic", lambda: clock[0])
    kept.add({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.0#1", 1, 0, True, 4]], "n": 1}, b"aaaa")
    clock[0] += 0.6
    kept.add({"kind": Kind.REPLIES, "cid": "c2", "gathered": [["pm0.0#1", 2, 0, True, 4]], "n": 1}, b"bbbb")
    clock[0] += 0.6  # c1 is 1.2 s old
    assert [(h["cid"], body) for h, body in kept.take()] == [("c2", b"bbbb")]
    assert kept.take() == [], "taken once"
    for cid in ("c3", "c4", "c5"):
        kept.add({"kind": Kind.REPLIES, "cid": cid, "gathered": [], "n": 1}, b"cccc")
    assert [h["cid"] for h, _ in kept.take()] == ["c4", "c5"], "over 10 bytes: the oldest went"


def test_a_hosts_replies_that_all_went_straight_still_count_at_its_relay_and_an_exit_flushes_the_merge():
    """A host whose procs' replies all went straight (tensors) says how many, so the relay's
    merge does not wait for them; a proc's exit sends what the merge holds at once."""
    signer, up, timers = Signer(KEY), [], []
    gather = ReplyGather(signer, lambda header, body: up.append((header, body)), lambda delay, fn: timers.append(fn))
    gather.on_link_message(b"pm0.2", [b"%2", b"~c1"])
    gather.on_link_message(b"pm0.3", [b"%2", b"~c1"])
    assert [(h["gathered"], h["n"], body) for h, body in up] == [([], 2, b"")], "a count alone"
    sent: list = []
    merge = reply_gather.ReplyMerge(lambda header, body: sent.append((header, body)), lambda delay, fn: timers.append(fn))
    merge.expect("c1", 4)
    merge.add({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.0#1", 1, 0, True, 1]], "n": 1}, b"a")
    merge.add(*up[0])
    assert not sent, "one of the relay's own procs has not answered"
    merge.flush_all()  # that proc exited: what is held goes before its exit report
    assert [h["gathered"] for h, _ in sent] == [[["pm0.0#1", 1, 0, True, 1]]]
    merge.add({"kind": Kind.REPLIES, "cid": "c9", "gathered": [], "n": 2}, b"")
    assert len(sent) == 1, "a count for a call not split here is not sent on"
    kept = reply_gather.KeptReplies(keep_s=5.0)
    kept.add({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.0#1", 1, 0, True, 1]], "n": 1}, b"a")
    kept.add({"kind": Kind.REPLIES, "cid": "c2", "gathered": [["pm0.1#2", 1, 0, True, 1]], "n": 1}, b"b")
    assert [h["cid"] for h, _ in kept.naming("pm0.1")] == ["c2"] and len(kept.take()) == 2, "naming keeps them"
