"""The host agent's heartbeat relay: real beat files, summaries as the controller gets them."""

from __future__ import annotations

import os

from monarch_nb.runtime.heartbeat_relay import HeartbeatRelay, HeartbeatSender, beat_path


def _relay(tmp_path, children: dict[int, str]) -> HeartbeatRelay:
    return HeartbeatRelay(str(tmp_path), lambda: list(children.items()))


def test_a_proc_is_sent_with_its_fields_once_then_only_as_heard(tmp_path):
    relay = _relay(tmp_path, {os.getpid(): "pm0.0"})
    sender = HeartbeatSender(relay.folder)
    assert relay.summary() == relay.summary() and relay.summary().heard == (), "nothing written yet: not heard"
    assert sender.send({"busy": {}})
    first = relay.summary()
    assert first.heard == () and first.changed == {"pm0.0": {"busy": {}}}
    assert relay.summary().heard == () and relay.summary().changed == {}, "silent since: not in the next summary"
    sender.send({"busy": {}})
    sender.send({"busy": {}})
    assert relay.summary().heard == ("pm0.0",), "heard, fields unchanged: the identity alone"
    sender.send({"busy": {"a0": ["step", 1.5]}})
    assert relay.summary().changed == {"pm0.0": {"busy": {"a0": ["step", 1.5]}}}
    relay.close()
    assert not os.path.exists(os.path.join(tmp_path, "heartbeats"))


def test_only_the_agents_children_are_read_and_garbage_is_counted(tmp_path):
    children = {os.getpid(): "pm0.1"}
    relay = _relay(tmp_path, children)
    with open(beat_path(relay.folder, 4242), "w") as f:  # not a child: never read
        f.write('{"seq": 1, "busy": {}}')
    with open(beat_path(relay.folder, os.getpid()), "w") as f:
        f.write("not json")
    assert relay.summary().changed == {} and relay.dropped == 1
    with open(beat_path(relay.folder, os.getpid()), "w") as f:
        f.write('{"busy": {}}')  # no sequence number
    assert relay.summary().changed == {} and relay.dropped == 2


def test_a_new_incarnation_starts_as_never_heard(tmp_path):
    children = {os.getpid(): "pm0.2"}
    relay = _relay(tmp_path, children)
    HeartbeatSender(relay.folder).send({"busy": {}})
    relay.summary()
    relay.forget(os.getpid())  # it exited (its file goes); a restart with the same pid, as a test stands in
    assert not os.path.exists(beat_path(relay.folder, os.getpid()))
    HeartbeatSender(relay.folder).send({"busy": {}})
    assert relay.summary().changed == {"pm0.2": {"busy": {}}}


def test_disabled_or_gone_the_relay_says_nothing_and_the_sender_drops_without_raising(tmp_path):
    off = HeartbeatRelay(str(tmp_path), lambda: [], enabled=False)
    assert off.folder == "" and off.summary().heard == ()
    relay = _relay(tmp_path, {})
    sender = HeartbeatSender(relay.folder)
    relay.close()
    assert sender.send({"busy": {}}) is False and sender.failures == 1
