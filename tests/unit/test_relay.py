"""The relay tree of heartbeats (monarch_nb.runtime.relay): a relay's ROUTER and its members'
DEALERs as real ZeroMQ sockets in one process, and the controller's plan of the tree; no worker
processes."""

from __future__ import annotations

import time
from typing import Callable


import pytest

from monarch_nb.runtime.protocol import AgentHeartbeatHeader, Kind, QuietMember
from monarch_nb.runtime.relay import (RELAY_READY_TIMEOUT_S, RELAY_SILENT_INTERVALS, AgentRelay, RelayJoin, RelayMember, RelayTree,
                                      cast_parts)
from monarch_nb.transport.wire import BadMessage, Signer, decode, encode

KEY = b"0123456789abcdef0123456789abcdef"
INTERVAL_S = 0.05


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("not true within the deadline")
        time.sleep(0.005)


def beat(heard: list[str] = (), changed: dict | None = None, load: float = 0.5, stopped: list[str] = (),
         all_heard: int | None = None) -> AgentHeartbeatHeader:
    header: AgentHeartbeatHeader = {"kind": Kind.AGENT_HEARTBEAT, "src": "", "dst": "", "seq": 0, "load": load,
                                    "stopped": list(stopped), "heard": list(heard), "changed": dict(changed or {})}
    if all_heard is not None:
        header["all_heard"] = all_heard
    return header


class Pair:
    """A relay (``host1``) and members on loopback, plain TCP."""

    def __init__(self) -> None:
        self.signer = Signer(KEY)
        self.relay = AgentRelay("host1#100", self.signer, None, "127.0.0.1")
        self.members: list[RelayMember] = []

    def member(self, identity: str, signer: Signer | None = None) -> RelayMember:
        member = RelayMember(identity, signer or self.signer, None, "host1", self.relay.endpoint, INTERVAL_S)
        self.members.append(member)
        return member

    def taken(self, count: int) -> list[dict]:
        """The relay's take() once it holds ``count`` members' heartbeats."""
        got: list[dict] = []

        def enough() -> bool:
            self.relay.on_readable()
            return len(self.relay._pending) >= count

        wait_for(enough)
        got.extend(self.relay.take().members)
        return sorted(got, key=lambda e: e["src"])

    def close(self) -> None:
        for member in self.members:
            member.close()
        self.relay.close()


def test_members_heartbeats_reach_the_relay_merged_per_member_and_are_taken_once():
    pair = Pair()
    try:
        a, b = pair.member("host2#200"), pair.member("host3#300")
        a.send(beat(heard=["pm0.0#1"], changed={"pm0.1#2": {"step": 3}}))
        a.send(beat(heard=["pm0.1#2"], changed={"pm0.0#1": {"step": 7}}, load=1.5, stopped=["pm0.2#3"]))
        b.send(beat(heard=["pm0.4#5"]))
        wait_for(lambda: (pair.relay.on_readable(), "host2" in pair.relay._pending and "host3" in pair.relay._pending
                          and pair.relay._guard._last.get("host2#200") == 2)[1])
        first, second = pair.relay.take().members
        assert first["src"] == "host2#200" and first["load"] == 1.5 and first["stopped"] == ["pm0.2#3"]
        # the two beats of one interval: every proc heard once, the newest fields of each kept
        assert first["changed"] == {"pm0.1#2": {"step": 3}, "pm0.0#1": {"step": 7}} and first["heard"] == []
        assert second == {"src": "host3#300", "load": 0.5, "stopped": [], "heard": ["pm0.4#5"], "changed": {}}
        assert not pair.relay.take() and pair.relay.passed == 2
        assert pair.relay.members == ["host2", "host3"]
    finally:
        pair.close()


def test_a_member_with_nothing_new_is_passed_on_as_its_name_load_and_count_only():
    pair = Pair()
    try:
        idle, busy, merged = pair.member("host2#200"), pair.member("host3#300"), pair.member("host4#400")
        idle.send(beat(heard=["pm0.0#1", "pm0.1#2"], load=0.25, all_heard=2))
        busy.send(beat(heard=["pm0.2#3"], changed={"pm0.3#4": {"busy": {"a": ["step", 1.0]}}}))
        # an interval's first beat changed a field, its second said nothing new: the change is passed on whole
        merged.send(beat(changed={"pm0.4#5": {"loading": ["torch"]}}))
        merged.send(beat(heard=["pm0.4#5"], all_heard=1))
        wait_for(lambda: (pair.relay.on_readable(), len(pair.relay._pending) == 3
                          and pair.relay._guard._last.get("host4#400") == 2)[1])
        taken = pair.relay.take()
        assert taken.quiet == [QuietMember("host2#200", 0.25, 2)]
        by_src = {e["src"]: e for e in taken.members}  # (two members' sockets: no order between them)
        assert sorted(by_src) == ["host3#300", "host4#400"] and len(taken.members) == 2
        assert by_src["host4#400"]["changed"] == {"pm0.4#5": {"loading": ["torch"]}}
        header = beat()
        taken.into(header)
        assert header["quiet"] == [["host2#200", 0.25, 2]] and QuietMember.from_wire(header["quiet"][0]) == taken.quiet[0]
        # a proc stopped (SIGSTOP) is news whatever all_heard says; an all_heard that is not a count is none
        idle.send(beat(heard=["pm0.0#1", "pm0.1#2"], stopped=["pm0.1#2"], all_heard=2))
        busy.send(beat(heard=["pm0.2#3", "pm0.3#4"], all_heard=True))
        wait_for(lambda: (pair.relay.on_readable(), len(pair.relay._pending) == 2)[1])
        again = pair.relay.take()
        assert again.quiet == [] and sorted(e["src"] for e in again.members) == ["host2#200", "host3#300"]
        assert pair.relay.passed == 5
    finally:
        pair.close()


def test_a_quiet_entry_that_is_not_src_load_count_is_refused():
    for row in (["host2#1", 0.5], ["host2#1", "x", 2], [3, 0.5, 2], ["host2#1", 0.5, True], ["host2#1", 0.5, "2"], None):
        with pytest.raises((TypeError, ValueError)):
            QuietMember.from_wire(row)


def test_a_relay_drops_forged_replayed_and_impersonating_heartbeats():
    pair = Pair()
    try:
        forger = pair.member("host4#400", Signer(b"another cluster's key, 32 bytes!"))
        forger.send(beat(heard=["pm9.0#1"]))
        # a member that signs its beat as another host's agent
        liar = pair.member("host5#500")
        liar.sock.send_multipart(encode(pair.signer, {**beat(), "src": "host2#200", "dst": "host1", "seq": 1}))
        honest = pair.member("host6#600")
        honest.send(beat(heard=["pm6.0#1"]))
        replayed = {**beat(heard=["pm6.0#1"]), "src": "host6#600", "dst": "host1", "seq": 1}
        honest.sock.send_multipart(encode(pair.signer, replayed))  # the same seq again
        honest.sock.send_multipart(encode(pair.signer, {"kind": Kind.OUTPUT, "src": "host6#600", "dst": "host1", "seq": 9}))
        wait_for(lambda: (pair.relay.on_readable(), sum(pair.relay.dropped.values()) >= 4)[1])
        assert dict(pair.relay.dropped) == {"bad": 1, "another's name": 1, "replayed": 1, "not a heartbeat": 1}
        assert [e["src"] for e in pair.relay.take().members] == ["host6#600"]
    finally:
        pair.close()


def test_the_relays_beat_says_when_it_heard_the_controller_and_its_silence_is_seen():
    pair = Pair()
    try:
        member = pair.member("host2#200")
        member.send(beat())
        wait_for(lambda: (pair.relay.on_readable(), pair.relay.members == ["host2"])[1])
        assert member.controller_heard is None and not member.silent()
        before = time.monotonic()
        pair.relay.beat_members(controller_age_s=0.2)
        wait_for(lambda: (member.on_readable(), member.controller_heard is not None)[1])
        assert before - 0.2 - 0.01 <= member.controller_heard <= time.monotonic() - 0.2
        # beats signed with another key, or by another host, are not the relay's: dropped, so the
        # relay's next beat (behind them on the same connection) is the next one taken
        forged = {"kind": Kind.RELAY_BEAT, "src": "host1#100", "dst": "members", "seq": 50, "controller_age_s": 0.0}
        pair.relay.sock.send_multipart([b"host2", *encode(Signer(b"another cluster's key, 32 bytes!"), forged)])
        other = {**forged, "src": "host7#700", "seq": 60}
        pair.relay.sock.send_multipart([b"host2", *encode(pair.signer, other)])
        pair.relay.beat_members(controller_age_s=3.0)
        wait_for(lambda: (member.on_readable(), member.controller_heard < time.monotonic() - 2.5)[1])
        assert member._guard._last == {"host1#100": 2}  # the forged seq 50 was never taken
        # no beat for RELAY_SILENT_INTERVALS intervals: silent
        wait_for(lambda: member.silent(), 10 * RELAY_SILENT_INTERVALS * INTERVAL_S)
        assert time.monotonic() - member.relay_heard >= RELAY_SILENT_INTERVALS * INTERVAL_S
    finally:
        pair.close()


def test_a_member_gone_is_no_longer_beaten():
    pair = Pair()
    try:
        member = pair.member("host2#200")
        member.send(beat())
        wait_for(lambda: (pair.relay.on_readable(), pair.relay.members == ["host2"])[1])
        member.close()
        pair.members.remove(member)
        # ROUTER_MANDATORY: the beat to a disconnected member fails, and the relay forgets it
        wait_for(lambda: (pair.relay.beat_members(0.0), pair.relay.members == [])[1])
    finally:
        pair.close()


# -- the controller's plan ---------------------------------------------------------------------------
def hosts(n: int) -> list[str]:
    return [f"host{i}" for i in range(1, n + 1)]


def test_no_tree_below_min_hosts_and_groups_of_fan_in_above():
    tree = RelayTree(fan_in=32, min_hosts=64)
    assert tree.plan(hosts(63), 0.0) == ([], [])
    serve, joins = tree.plan(hosts(70), 0.0)
    assert serve == ["host1", "host33", "host65"] and joins == []  # 32 + 32 + 6, each relay one of its group
    assert sorted(tree.relays["host1"].members) == sorted(hosts(32)[1:])
    assert sorted(tree.relays["host65"].members) == ["host66", "host67", "host68", "host69", "host70"]
    # a relay ready: its members are told where it is; the others wait for theirs
    joins = tree.ready("host33", "tcp://10.0.0.33:4000")
    assert joins == [RelayJoin(f"host{i}", "host33", "tcp://10.0.0.33:4000") for i in sorted(range(34, 65), key=str)]
    assert tree.ready("host33", "tcp://10.0.0.33:4000") == []  # once
    assert RelayTree(fan_in=0, min_hosts=1).plan(hosts(100), 0.0) == ([], [])


def test_new_hosts_fill_relays_with_room_and_a_lone_host_is_straight():
    tree = RelayTree(fan_in=4, min_hosts=2)
    assert tree.plan(hosts(5), 0.0) == (["host1"], [])  # host5 alone: no relay of one
    tree.ready("host1", "tcp://a:1")
    assert "host5" not in tree.relay_of
    serve, joins = tree.plan(hosts(7), 1.0)  # host5..7: a group of its own
    assert serve == ["host5"] and joins == []
    tree.lose("host3")  # a member lost: room for the next host, joined at once (its relay is ready)
    serve, joins = tree.plan([h for h in hosts(8) if h != "host3"], 2.0)
    assert joins == [RelayJoin("host8", "host1", "tcp://a:1")] and serve == []


def test_a_refused_or_silent_relay_is_not_asked_again_and_its_group_is_placed_anew():
    tree = RelayTree(fan_in=3, min_hosts=2)
    assert tree.plan(hosts(6), 0.0) == (["host1", "host4"], [])
    assert tree.ready("host1", "") == []  # it could not bind
    tree.expire(RELAY_READY_TIMEOUT_S + 1)  # host4 never answered
    assert tree.relays == {} and tree.relay_of == {}
    serve, _ = tree.plan(hosts(6), RELAY_READY_TIMEOUT_S + 2)
    assert serve == ["host2", "host5"] and sorted(tree.relays["host2"].members) == ["host1", "host3"]


def test_a_lost_relays_members_go_straight_and_a_member_that_left_is_not_put_back_under_it():
    tree = RelayTree(fan_in=3, min_hosts=2)
    tree.plan(hosts(3), 0.0)
    tree.ready("host1", "tcp://a:1")
    tree.left("host2", "host1")  # host2 stopped hearing host1 and went straight
    assert tree.relay_of == {"host3": "host1"}
    serve, joins = tree.plan(hosts(3), 1.0)
    assert serve == [] and joins == []  # host2 stays straight: no other relay, and not back under host1
    assert tree.lose("host1") == [RelayJoin("host3")]  # host1 lost: its members straight now
    assert tree.relays == {} and tree.relay_of == {}
    # host1 back (a fresh agent): it may relay host2 again
    serve, _ = tree.plan(hosts(3), 2.0)
    assert serve == ["host1"] and sorted(tree.relays["host1"].members) == ["host2", "host3"]


def test_a_relay_passes_a_member_its_part_of_a_cast_unread_and_says_when_it_cannot():
    pair = Pair()
    try:
        member = pair.member("host2#200")
        got: list[tuple[list[bytes], list[bytes]]] = []
        member.on_routed = lambda routes, frames: got.append((routes, [bytes(f) for f in frames]))
        member.send(beat(heard=["pm1.0#1"]))  # connected once the relay heard it
        wait_for(lambda: (pair.relay.on_readable(), pair.relay.members == ["host2"])[1])
        signed = encode(pair.signer, {"kind": "call", "src": "controller", "dst": "host1", "seq": 9})
        assert pair.relay.pass_on(b"host2", b"@pm1.0,pm1.1", signed)
        assert not pair.relay.pass_on(b"host9", b"@pm2.0", signed), "a host not connected: the controller is told"
        wait_for(lambda: (member.on_readable(), got)[1] != [])
        assert got == [([b"pm1.0", b"pm1.1"], [bytes(f) for f in signed])]
        assert (pair.relay.casts_passed, pair.relay.unreached) == (1, 1)
    finally:
        pair.close()


def test_a_cast_down_the_tree_is_split_per_host_each_part_signed_with_its_entries_alone():
    signer = Signer(KEY)
    cast = {"kind": "call", "src": "controller", "dst": "host1", "seq": 41, "ep": "ping",
            "fan": {"to": ["pm0.0", "pm0.1", "pm0.2"], "rank": [0, 1, 2], "pseq": [[7, 3], [8, 5], [9, 2]]}}
    sections = [(b"host1", [b"pm0.0"]), (b"host2", [b"pm0.1", b"pm0.2"])]
    cid, parts = cast_parts(signer, sections, encode(signer, cast, b"args"))
    assert cid is None, "a call whose replies do not gather"
    assert cast_parts(signer, sections, encode(signer, {**cast, "cid": "c7", "gth": 1}, b"args"))[0] == "c7"
    assert [(host, routing) for host, routing, _ in parts] == [(b"host1", b"@pm0.0"), (b"host2", b"@pm0.1,pm0.2")]
    header, body, _ = decode(signer, parts[1][2])  # verifies as the controller's own message would
    assert (header["src"], header["dst"], header["seq"], header["ep"], bytes(body)) == ("controller", "host2", 41, "ping", b"args")
    assert header["fan"] == {"to": ["pm0.1", "pm0.2"], "rank": [1, 2], "pseq": [[8, 5], [9, 2]]}
    with pytest.raises(BadMessage):  # not the cluster's key: nothing is signed again
        cast_parts(signer, sections, encode(Signer(b"another key, 32 bytes long......"), cast, b"args"))
    with pytest.raises(BadMessage):  # the routing frame names procs the fan does not
        cast_parts(signer, [(b"host1", [b"pm0.0"]), (b"host2", [b"pm0.2", b"pm0.1"])], encode(signer, cast, b"args"))
    with pytest.raises(BadMessage):  # ... or fewer than it lists
        cast_parts(signer, [(b"host1", [b"pm0.0"])], encode(signer, cast, b"args"))


def test_a_members_replies_reach_the_relays_merge_and_one_naming_another_member_does_not():
    pair = Pair()
    merged: list[tuple[dict, bytes]] = []
    try:
        a = pair.member("host2#200")
        a.send_replies({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.2#3", 1, 2, True, 2]], "n": 2}, b"ok")
        wait_for(lambda: (pair.relay.on_readable(), pair.relay.dropped["not a heartbeat"] == 1)[1])
        assert not merged, "a relay without a merge takes no replies"
        pair.relay.merge = type("Merge", (), {"add": lambda self, header, body: merged.append((header, body))})()  # type: ignore[assignment]
        a.send_replies({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.2#3", 1, 2, True, 2]], "n": 2}, b"ok")
        wait_for(lambda: (pair.relay.on_readable(), len(merged) == 1)[1])
        header, body = merged[0]
        assert (header["src"], header["cid"], header["gathered"], header["n"], body) == ("host2#200", "c1", [["pm0.2#3", 1, 2, True, 2]], 2, b"ok")
        a.send_replies({"kind": Kind.REPLIES, "cid": "c1", "gathered": [["pm0.2#3", 1, 2, True, 5]], "n": 1}, b"ok")
        wait_for(lambda: (pair.relay.on_readable(), pair.relay.dropped["bad replies"] == 1)[1])  # 5 bytes named, 2 sent
        assert len(merged) == 1, "merged, its sizes would misplace the other hosts' bytes"
        forged = pair.member("host3#300")
        forged.identity = "host2#200"  # signs as host2's agent on host3's connection
        forged.send_replies({"kind": Kind.REPLIES, "cid": "c1", "gathered": [], "n": 1}, b"")
        wait_for(lambda: (pair.relay.on_readable(), pair.relay.dropped["another's name"] == 1)[1])
        assert len(merged) == 1
    finally:
        pair.close()
