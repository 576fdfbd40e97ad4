"""The host agent's heartbeat relay: real beat files, summaries as the controller gets them."""

from __future__ import annotations

import os

import pytest

from monarch_nb.runtime.heartbeat_relay import HeartbeatRelay, HeartbeatSender, IdleCadence, RelaySummary, beat_path


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
    sender.close()
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
    first = HeartbeatSender(relay.folder)
    first.send({"busy": {}})
    first.close()
    relay.summary()
    relay.forget(os.getpid())  # it exited (its file goes); a restart with the same pid, as a test stands in
    assert not os.path.exists(beat_path(relay.folder, os.getpid()))
    second = HeartbeatSender(relay.folder)
    second.send({"busy": {}})
    second.close()
    assert relay.summary().changed == {"pm0.2": {"busy": {}}}


def test_disabled_or_gone_the_relay_says_nothing_and_the_sender_drops_without_raising(tmp_path):
    off = HeartbeatRelay(str(tmp_path), lambda: [], enabled=False)
    assert off.folder == "" and off.summary().heard == ()
    relay = _relay(tmp_path, {})
    sender = HeartbeatSender(relay.folder)
    relay.close()
    assert sender.send({"busy": {}}) is False and sender.failures == 1
    sender.close()


def test_an_idle_host_beats_every_second_tick_and_sends_what_it_heard_meanwhile(tmp_path):
    children = {os.getpid(): "pm0.0"}
    relay, cadence = _relay(tmp_path, children), IdleCadence(every=2)
    sender = HeartbeatSender(relay.folder)
    sender.send({"busy": {}})
    first = cadence.take(relay.summary(), 0.0, [])
    assert first is not None and first.changed == {"pm0.0": {"busy": {}}}, "the first beat: sent"
    sent = []
    for _ in range(6):  # idle: heard every tick, nothing changed
        sender.send({"busy": {}})
        sent.append(cadence.take(relay.summary(), 0.0, []))
    assert [s is not None for s in sent] == [False, True] * 3, "every second tick"
    assert all(s.heard == ("pm0.0",) for s in sent if s is not None), "what a skipped tick heard goes out with the next"
    sender.close()


def test_anything_new_makes_the_very_next_tick_send(tmp_path):
    cadence = IdleCadence(every=4)
    quiet = RelaySummary(("pm0.0",), {}, True)
    assert cadence.take(quiet, 0.0, []) is not None  # the first: nothing was said yet
    assert cadence.take(quiet, 0.0, []) is None
    silent = cadence.take(RelaySummary((), {}, False), 0.0, [])
    assert silent is not None and silent.heard == ("pm0.0",), "a proc went silent: sent at once, with what was held"
    assert cadence.take(quiet, 0.0, []) is None
    assert cadence.take(quiet, 0.5, []) is not None, "the host's load changed"
    assert cadence.take(quiet, 0.5, []) is None
    assert cadence.take(quiet, 0.5, ["pm0.0"]) is not None, "a proc the OS reports stopped"
    assert cadence.take(quiet, 0.5, ["pm0.0"]) is None
    assert cadence.take(RelaySummary((), {"pm0.0": {"busy": {"a": ["f", 1.0]}}}, True), 0.5, ["pm0.0"]) is not None
    skipped = [cadence.take(quiet, 0.5, ["pm0.0"]) for _ in range(4)]
    assert [s is None for s in skipped] == [True, True, True, False], "every fourth tick when idle"
    with pytest.raises(ValueError, match="at least 1"):
        IdleCadence(every=0)


def test_agents_tick_in_eight_slots_by_host_name():
    from monarch_nb.runtime.heartbeat_relay import HEARTBEAT_SLOTS, tick_phase_s

    phases = [tick_phase_s(f"train0-host{h}", 0.25) for h in range(1024)]
    assert phases == [tick_phase_s(f"train0-host{h}", 0.25) for h in range(1024)], "the same on every machine"
    slots = {round(p / 0.25 * HEARTBEAT_SLOTS) for p in phases}
    assert slots == set(range(HEARTBEAT_SLOTS)) and all(0 <= p < 0.25 for p in phases)
    per_slot = [sum(1 for p in phases if round(p / 0.25 * HEARTBEAT_SLOTS) == s) for s in range(HEARTBEAT_SLOTS)]
    assert min(per_slot) > 1024 / HEARTBEAT_SLOTS / 2, per_slot  # spread: no slot gets the bulk


class _Clock:
    """A wall clock and a monotonic one that move together, by hand."""

    def __init__(self, wall: float):
        self.wall, self.mono = wall, 1000.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def test_a_phased_timer_runs_at_its_slot_of_the_wall_clock_and_keeps_it(monkeypatch):
    """``Channel.every(..., phase_s=)``: the first run at the next wall-clock time in the slot, then
    every interval in it, a late run not pushing the later ones (a plain timer's next run is an
    interval after the last)."""
    from monarch_nb.transport import channel as channel_module
    from monarch_nb.transport.channel import Channel
    from monarch_nb.transport.wire import Signer

    clock = _Clock(wall=5000.01)  # 10 ms past a multiple of 0.25 s
    monkeypatch.setattr(channel_module.time, "time", lambda: clock.wall)
    monkeypatch.setattr(channel_module.time, "monotonic", lambda: clock.mono)
    ch = Channel("test-timers", Signer(b"k" * 32), lambda *a: None)
    try:
        runs: list[float] = []
        ch.every(0.25, lambda: runs.append(clock.wall), phase_s=0.125)
        due = ch._timers[0][0]
        assert due - clock.mono == pytest.approx(0.115)  # 5000.125 comes in 115 ms
        for late in (0.0, 0.004, 0.030, 0.0):  # run each when due, some of them late
            clock.advance(ch._timers[0][0] - clock.mono + late)
            ch._run_timers()
        assert [round(t % 0.25, 3) for t in runs] == [0.125, 0.129, 0.155, 0.125]
        assert [round(b - a, 3) for a, b in zip(runs, runs[1:])] == [0.254, 0.276, 0.22]
    finally:
        ch.close()


def test_a_beat_overwrites_a_longer_one_in_place_and_a_half_written_file_is_skipped(tmp_path):
    children = {os.getpid(): "pm0.3"}
    relay = _relay(tmp_path, children)
    sender = HeartbeatSender(relay.folder)
    sender.send({"busy": {"a0": ["a_long_endpoint_name", 12.5]}})
    assert relay.summary().changed == {"pm0.3": {"busy": {"a0": ["a_long_endpoint_name", 12.5]}}}
    sender.send({"busy": {}})  # shorter: padded over the longer one
    assert relay.summary().changed == {"pm0.3": {"busy": {}}}
    path = beat_path(relay.folder, os.getpid())
    with open(path, "rb") as f:
        whole = f.read()
    with open(path, "r+b") as f:  # what a read meeting a write half done sees: another beat's bytes in the middle
        f.seek(len(whole) // 2)
        f.write(b'"seq": 9')
    assert relay.summary() == RelaySummary((), {}, complete=False) and relay.dropped == 1, "skipped: not heard"
    sender.send({"busy": {}})
    assert relay.summary().heard == ("pm0.3",), "the next whole beat is read"
    sender.close()


@pytest.fixture
def heard_once(tmp_path):
    """A relay whose one child is this process ("pm0.4"), and its sender, heard once."""
    relay = _relay(tmp_path, {os.getpid(): "pm0.4"})
    sender = HeartbeatSender(relay.folder)
    sender.send({"busy": {}})
    relay.summary()
    yield relay, sender
    sender.close()


def test_a_beat_file_removed_under_the_sender_is_written_again(heard_once):
    relay, sender = heard_once
    os.unlink(beat_path(relay.folder, os.getpid()))
    assert sender.send({"busy": {}}) and relay.summary().heard == ("pm0.4",)


def test_a_beat_never_goes_through_a_descriptor_closed_under_the_sender(tmp_path, heard_once):
    relay, sender = heard_once
    fd = sender._fd
    os.close(fd)  # other code closes it (a bug there) ...
    other = tmp_path / "other"
    other.write_bytes(b"IMPORTANT DATA")
    reused = os.open(other, os.O_RDWR)  # ... and its number goes to another file
    try:
        assert reused == fd
        assert sender.send({"busy": {}}) and relay.summary().heard == ("pm0.4",), "written to the beat file, opened again"
        assert other.read_bytes() == b"IMPORTANT DATA", "the other file is untouched"
    finally:
        os.close(reused)
