"""A relay's word that a host's procs were all heard (monarch_nb.runtime.protocol.QuietMember) on the
controller: the proc table's records per host, Liveness taking them as heard in one write, and the
hang check skipping a host whose agent vouched since the cutoff. Liveness against a stand-in controller (no
sockets, no processes): what it moves is the records."""

from __future__ import annotations

import time
from typing import Any

import pytest

from monarch_nb.config import config
from monarch_nb.runtime.liveness import Liveness
from monarch_nb.supervision.records import HostRecord, ProcRecord, ProcState, ProcTable


def record(identity: str, host: str, state: ProcState = ProcState.HEALTHY) -> ProcRecord:
    rec = ProcRecord(identity, identity.split(".")[0], int(identity.split(".")[1]), {}, host, {})
    rec.state = state
    return rec


class StandIn:
    """What Liveness uses of its controller, recording what it was asked to do."""

    def __init__(self) -> None:
        self.procs = ProcTable()
        self.hosts: dict[str, HostRecord] = {}
        self.events: list[tuple[str, str]] = []
        self.failed: list[tuple[str, str]] = []
        self.signalled: list[tuple[str, str, bool]] = []
        self.channel = self.messenger = self

    # channel / messenger
    def send(self, dst: str, header: Any, *body: Any) -> None:
        pass

    def send_many(self, dsts: Any, header: Any, *body: Any, **each: Any) -> None:
        pass

    def proc_failed(self, identity: str, error: Exception) -> None:
        pass

    def proc_recovered(self, identity: str) -> None:
        pass

    def record_event(self, kind: str, rec: ProcRecord, **fields: Any) -> None:
        self.events.append((kind, rec.identity))

    def emit_lines(self, *args: Any, **kwargs: Any) -> None:
        pass

    def new_rendezvous_round(self, mesh: str) -> None:
        pass

    def report_failure(self, rec: ProcRecord, cause: str, detail: str, signame: str | None, *, handle: bool = True) -> None:
        self.failed.append((rec.identity, cause))

    def signal_proc(self, identity: str, signame: str, *, stacks_first: bool = False) -> None:
        self.signalled.append((identity, signame, stacks_first))


def test_the_proc_table_keeps_each_hosts_records_through_writes_and_removals():
    table = ProcTable()
    a, b, c = record("pm0.0", "h1"), record("pm0.1", "h1"), record("pm0.2", "h2")
    for rec in (a, b, c):
        table[rec.identity] = rec
    assert table.on_host("h1") == (a, b) and table.on_host("h2") == (c,) and table.on_host("h9") == ()
    again = record("pm0.0", "h2")  # the mesh spawned again under its name, rank 0 on another host
    table["pm0.0"] = again
    assert table.on_host("h1") == (b,) and table.on_host("h2") == (c, again) and table["pm0.0"] is again
    assert table.pop("pm0.1") is b and table.pop("pm0.1", None) is None
    del table["pm0.2"]
    assert table.on_host("h1") == () and [recs for _, recs in table.by_host()] == [(again,)] and list(table) == ["pm0.0"]
    assert again.host_heard is table.host_heard("h2") and a.host_heard is table.host_heard("h1")
    for bulk in (lambda: table.update({}), lambda: table.clear(), lambda: table.setdefault("x", a), table.popitem):
        with pytest.raises(TypeError, match="one at a time"):
            bulk()


def test_all_heard_takes_each_alive_proc_of_the_host_as_heard_and_the_hang_check_skips_it(monkeypatch):
    monkeypatch.setattr(config, "hang_timeout_s", 0.2)
    ctrl = StandIn()
    ctrl.hosts = {"h1": HostRecord("h1", state=ProcState.HEALTHY), "h2": HostRecord("h2", state=ProcState.HEALTHY)}
    serving = [record("pm0.0", "h1"), record("pm0.1", "h1", ProcState.BUSY)]
    starting, elsewhere = record("pm0.2", "h1", ProcState.STARTING), record("pm0.4", "h2")
    for rec in (*serving, starting, elsewhere):
        ctrl.procs[rec.identity] = rec
    liveness = Liveness(ctrl)  # type: ignore[arg-type]  # the stand-in has what Liveness uses
    before = time.monotonic()
    assert liveness.on_host_heard_all("h1", 3)
    assert all(rec.last_heard >= before for rec in (*serving, starting)), "one write: every alive proc of h1 heard"
    assert elsewhere.last_heard == 0.0 and serving[0].last_heartbeat == 0.0, "its own heartbeat is its own"
    # past the hang timeout, both hosts heard lately: h1's agent vouched again, so only h2's proc is judged
    time.sleep(0.25)
    for host in ctrl.hosts.values():
        host.last_heartbeat = time.monotonic()
    assert liveness.on_host_heard_all("h1", 3)
    liveness.check_heartbeats()
    assert [e for e in ctrl.events if e[0] == "proc_hung"] == [("proc_hung", "pm0.4")]
    assert ctrl.signalled == [("pm0.4", "SIGKILL", True)], "fenced, its stacks taken first"
    assert all(rec.state != ProcState.HUNG for rec in serving)
    # h1's agent stops vouching (a proc stopped: it lists those it heard): the silent one is judged
    # from the agent's last word, not from its own last heartbeat long before
    time.sleep(0.1)
    liveness.on_host_heartbeats("h1", ["pm0.1"], {})
    for host in ctrl.hosts.values():
        host.last_heartbeat = time.monotonic()
    liveness.check_heartbeats()
    assert serving[0].state == ProcState.HEALTHY, "heard 0.1 s ago on its agent's word: not yet hung"
    time.sleep(0.15)
    liveness.on_host_heartbeats("h1", ["pm0.1"], {})
    for host in ctrl.hosts.values():
        host.last_heartbeat = time.monotonic()
    liveness.check_heartbeats()
    assert serving[0].state == ProcState.HUNG and serving[1].state == ProcState.BUSY


def test_all_heard_of_fewer_procs_than_the_controller_has_serving_there_takes_none():
    ctrl = StandIn()
    recs = [record(f"pm0.{r}", "h1") for r in range(3)]
    dead = record("pm0.3", "h1", ProcState.FAILED)
    for rec in (*recs, dead):
        ctrl.procs[rec.identity] = rec
    liveness = Liveness(ctrl)  # type: ignore[arg-type]
    assert not liveness.on_host_heard_all("h1", 2)  # the agent runs two: which one is missing is not known
    assert [rec.last_heard for rec in recs] == [0.0] * 3
    assert liveness.on_host_heard_all("h1", 3), "a dead proc's record is not one the agent must have heard"
    assert all(rec.last_heard > 0 for rec in recs) and dead.last_heard == 0.0


def test_all_heard_resumes_a_proc_the_hang_check_found_hung_unless_it_was_fenced(monkeypatch):
    monkeypatch.setattr(config, "hang_timeout_s", 0.2)
    monkeypatch.setattr(config, "fence_hung", False)
    ctrl = StandIn()
    host = ctrl.hosts["h1"] = HostRecord("h1", state=ProcState.HEALTHY)
    slow, fenced = record("pm0.0", "h1"), record("pm0.1", "h1", ProcState.HUNG)
    fenced.fenced = True
    for rec in (slow, fenced):
        ctrl.procs[rec.identity] = rec
    liveness = Liveness(ctrl)  # type: ignore[arg-type]
    slow.last_heartbeat = time.monotonic() - 1.0
    host.last_heartbeat = time.monotonic()
    liveness.check_heartbeats()
    assert slow.state == ProcState.HUNG
    assert liveness.on_host_heard_all("h1", 2)
    assert slow.state == ProcState.HEALTHY and ("proc_resumed", "pm0.0") in ctrl.events
    assert fenced.state == ProcState.HUNG, "a fenced proc was killed: it does not come back"
