"""Widget state without a browser: the tree follows faults and recovery; the dashboard its feed."""

from __future__ import annotations

import threading
import time

import pytest

from monarch_nb.jupyter.dashboard import TrainingDashboard
from monarch_nb.jupyter.tree_widget import BUTTON_FAULTS, GRID_AT, SupervisionTree

from .conftest import wait_until
from .synthetic_cluster import FAILED_RANK, LOST_HOST, SyntheticController

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def tree(procs4):
    widget = SupervisionTree(mesh=procs4.name)
    yield widget
    widget.close()


def test_tree_shows_every_level(tree, procs4):
    wait_until(lambda: tree.proc_states() == {r: "healthy" for r in range(4)}, 10, message="4 healthy procs in the widget")
    root = tree.tree
    assert root["kind"] == "controller"
    host = root["children"][0]
    assert host["kind"] == "host" and host["pid"] > 0
    procs = host["children"]
    assert [p["rank"] for p in procs] == [0, 1, 2, 3]
    assert all(p["pid"] > 0 and p["heartbeat_age_s"] is not None and p["restarts"] == 0 for p in procs)


def test_tree_follows_a_kill_click_and_a_restart_click(tree, procs4):
    wait_until(lambda: tree.proc_states().get(2) == "healthy", 10, message="rank 2 healthy")
    old_pid = tree.proc_node(2)["pid"]
    tree.click("fault", 2, "kill").join(10)
    # the state (self.tree) and the events (a trait set after it) both: a refresh sets them one by one
    wait_until(lambda: tree.proc_states().get(2) == "failed"
               and any(e["kind"] == "proc_exited" and e["rank"] == 2 for e in tree.events), 5,
               message="the widget showing rank 2 failed, and its exit")
    assert tree.proc_states()[0] == "healthy"  # isolated to rank 2
    assert any(e["kind"] == "proc_exited" and e["rank"] == 2 for e in tree.events)
    assert "injected kill into rank 2" in tree.status
    tree.click("restart", 2).join(30)
    wait_until(lambda: tree.proc_states().get(2) == "healthy", 10, message="the widget showing rank 2 healthy again")
    node = tree.proc_node(2)
    assert node["restarts"] == 1 and node["pid"] != old_pid
    assert node["failures"] == 1 and node["last_failure"]["cause"] == "SIGKILL"
    assert "restarted" in tree.status


def test_tree_follows_a_hang_to_its_fencing(tree, procs4):
    tree.click("fault", 1, "hang").join(10)
    wait_until(lambda: tree.proc_states().get(1) in ("hung", "failed"), 5, message="rank 1 hung")

    def kinds() -> list[str]:
        return [e["kind"] for e in tree.events if e["rank"] == 1]

    wait_until(lambda: tree.proc_states().get(1) == "failed" and {"proc_hung", "proc_fenced"} <= set(kinds()), 5,
               message="rank 1 fenced, and its events shown")
    kinds = kinds()
    assert "proc_hung" in kinds and "proc_fenced" in kinds


def test_tree_details_of_a_selected_proc(tree, procs4):
    from tests.actors import Counter

    procs4.spawn("counters", Counter, 0)
    wait_until(lambda: [a["name"] for a in tree.proc_node(3)["children"]] == ["counters"], 5, message="the actor in the tree")
    tree.selected = f"{procs4.name}.3"
    wait_until(lambda: tree.details.get("node", {}).get("rank") == 3, 5, message="details of rank 3")
    details = tree.details
    assert details["node"]["state"] == "healthy"
    assert any(e["kind"] == "proc_started" for e in details["events"])
    assert isinstance(details["output"], list)


def test_tree_updates_at_most_10_hz(tree, procs4):
    wait_until(lambda: tree.updates > 0, 5, message="a first update")
    before = tree.updates
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # a flood of events
        tree._controller.events.append(type(tree._controller.events.events()[0])("supervised", rank=0, mesh=procs4.name))
        time.sleep(0.002)
    assert tree.updates - before <= 12


def test_tree_buttons_and_bad_clicks(tree, procs4):
    assert BUTTON_FAULTS == ("kill", "hang", "nan", "slow", "partition", "raise")
    tree.click("fault", 0, "explode").join(5)
    assert "unknown fault" in tree.status
    assert tree.proc_states()[0] in ("healthy", "busy")


def _from_browser(widget, content: dict) -> None:
    """Deliver a message as the widget's view sends it (a comm "custom" message)."""
    widget._handle_custom_msg(content, [])


@pytest.fixture
def cluster_tree():
    """The widget over a synthetic 8 hosts x 8 GPUs cluster (real records and snapshot, no processes)."""
    controller = SyntheticController(hosts=8, per_host=8)
    widget = SupervisionTree(controller=controller)
    yield widget, controller
    widget.close()


def test_grid_at_cluster_size_shows_every_host_and_rank(cluster_tree):
    widget, _ = cluster_tree
    assert widget.layout == "grid"  # 64 procs > GRID_AT: one cell per rank
    rows = widget.grid["hosts"]
    assert [r["name"] for r in rows] == [f"host{h}" for h in range(1, 9)]
    assert sum(len(r["cells"]) for r in rows) == 64
    for h, row in enumerate(rows):  # each host's row holds its own 8 ranks, in order
        assert [c["rank"] for c in row["cells"]] == list(range(8 * h, 8 * h + 8))
        assert row["hostname"] == f"gpu-node-{h + 1:02d}" and row["load"] == pytest.approx(0.25 + 0.11 * h)
    by_rank = {c["rank"]: c for r in rows for c in r["cells"]}
    assert by_rank[FAILED_RANK]["state"] == "failed" and by_rank[FAILED_RANK]["cause"] == "SIGKILL"
    assert "rank 19" in by_rank[FAILED_RANK]["title"] and "failed (SIGKILL)" in by_rank[FAILED_RANK]["title"]
    assert {by_rank[r]["state"] for r in (3, 12, 33)} == {"busy"}
    assert by_rank[58]["state"] == "hung" and by_rank[62]["state"] == "restarting" and by_rank[52]["state"] == "paused"
    lost = next(r for r in rows if r["name"] == LOST_HOST)
    assert lost["lost"] and lost["last_event"]["kind"] == "host_lost"
    assert {c["state"] for c in lost["cells"]} == {"failed"} and {c["cause"] for c in lost["cells"]} == {"host_lost"}
    assert [r["name"] for r in rows if r["lost"]] == [LOST_HOST]
    assert widget.grid["counts"] == {"healthy": 49, "busy": 3, "paused": 1, "hung": 1, "failed": 9,
                                     "restarting": 1}
    assert any(e["kind"] == "host_lost" and e["host"] == LOST_HOST for e in widget.events)
    assert widget.nodes == {}  # the grid sends no per-node data (heartbeat ages change every second)


def test_a_click_on_a_cell_selects_that_rank_and_its_details_name_it(cluster_tree):
    widget, _ = cluster_tree
    _from_browser(widget, {"action": "select", "name": "pm0.19"})  # what a click on the cell of rank 19 sends
    wait_until(lambda: widget.details.get("node", {}).get("rank") == FAILED_RANK, 5, message="details of rank 19")
    details = widget.details
    assert details["title"].startswith("rank 19 of pm0") and "host3 (gpu-node-03)" in details["title"]
    facts = dict(details["facts"])
    assert facts["state"] == "failed" and "SIGKILL" in facts["last failure"] and facts["coords"] == "hosts=2, gpus=3"
    assert [a["name"] for a in details["actors"]] == ["trainers"]
    assert details["output"][-1] == "rank 19: step 4 loss 0.400"
    assert [e["kind"] for e in details["events"]] == ["proc_started", "proc_exited"]
    lost = widget.select(host=LOST_HOST)  # a click on the lost host's name
    assert lost["title"] == "host host6 (gpu-node-06) · LOST"
    assert dict(lost["facts"])["address"] == "tcp://10.0.0.7:26600" and dict(lost["facts"])["procs"] == "8"
    assert any(e["kind"] == "host_lost" for e in lost["events"])
    with pytest.raises(ValueError, match="no rank 64"):
        widget.select(64)


def test_fault_and_restart_from_a_selected_cell(cluster_tree):
    widget, controller = cluster_tree
    details = widget.select(27)
    assert details["node"]["state"] == "healthy"
    widget.click("fault", 27, "kill").join(5)
    # the grid and the details are traits set one after the other by a refresh: wait for both
    wait_until(lambda: next(c for r in widget.grid["hosts"] for c in r["cells"] if c["rank"] == 27)["state"] == "failed"
               and widget.details["node"]["state"] == "failed", 5, message="the cell of rank 27 failed, and its details")
    assert widget.details["node"]["state"] == "failed" and "injected kill into rank 27" in widget.status
    widget.click("restart", 27).join(5)
    wait_until(lambda: widget.proc_states()[27] == "healthy" and widget.proc_node(27)["restarts"] == 1, 5,
               message="rank 27 healthy again")
    widget.click("fault", FAILED_RANK, "kill").join(5)  # a dead rank takes no fault: said, nothing breaks
    assert "failed" in widget.status and "restart it first" in widget.status


def test_a_ranks_change_reaches_the_browser_as_its_host_row_and_a_frontend_behind_gets_the_whole_grid(cluster_tree):
    widget, controller = cluster_tree
    sent: list[dict] = []
    send = widget._send
    widget._send = lambda msg, buffers=None: (sent.append(msg), send(msg, buffers))
    widget.refresh()
    version = widget.grid["v"]
    controller.fail(27, "SIGKILL", "killed by signal SIGKILL")  # rank 27 lives on host4
    widget.refresh()
    deltas = [m["content"] for m in sent if m.get("method") == "custom" and m["content"].get("type") == "grid_delta"]
    assert len(deltas) == 1 and not any("grid" in m.get("state", {}) for m in sent), "no whole grid sent"
    delta = deltas[0]
    assert (delta["from"], delta["v"], delta["order"]) == (version, version + 1, None) and list(delta["rows"]) == ["host4"]
    assert next(c for c in delta["rows"]["host4"]["cells"] if c["rank"] == 27)["state"] == "failed"
    assert delta["summary"]["counts"] == {k: v for k, v in widget.grid["counts"].items()}
    sent.clear()
    _from_browser(widget, {"action": "grid_sync", "v": version + 1})  # up to date: nothing to send
    assert sent == []
    _from_browser(widget, {"action": "grid_sync", "v": version})  # a view that missed the delta
    [update] = [m for m in sent if m.get("method") == "update"]
    assert update["state"]["grid"]["v"] == version + 1 and len(update["state"]["grid"]["hosts"]) == 8


def test_a_lost_host_stays_lost_while_it_is_attached_again_until_it_is_back(cluster_tree):
    from monarch_nb.supervision.events import Event
    from monarch_nb.supervision.records import HostRecord, ProcState

    widget, controller = cluster_tree

    def row():
        widget.refresh()
        return next(r for r in widget.grid["hosts"] if r["name"] == LOST_HOST)

    # the controller attaches it again: a new record, "starting", until its agent says hello
    controller.hosts[LOST_HOST] = HostRecord(LOST_HOST, address=controller.hosts[LOST_HOST].address)
    assert row()["lost"] and row()["state"] == "starting"
    controller.hosts[LOST_HOST].state = ProcState.HEALTHY
    controller.events.append(Event("host_returned", host=LOST_HOST, detail="attached again; its procs start fresh"))
    back = row()
    assert not back["lost"] and back["last_event"]["kind"] == "host_returned"
    assert {c["state"] for c in back["cells"]} == {"failed"}  # its ranks start fresh only when restarted


def test_the_view_toggle_and_the_threshold(cluster_tree):
    widget, _ = cluster_tree
    _from_browser(widget, {"action": "view", "view": "list"})  # the toolbar's toggle
    wait_until(lambda: widget.layout == "list" and widget.nodes.get("kind") == "controller", 5, message="the list layout")
    assert len([p for h in widget.nodes["children"] for p in h["children"]]) == 64
    _from_browser(widget, {"action": "view", "view": "sideways"})  # a bad value is refused, the view kept
    widget.view = "sideways"
    assert widget.view == "list"
    _from_browser(widget, {"action": "view", "view": "auto"})
    wait_until(lambda: widget.layout == "grid" and widget.nodes == {}, 5, message="the grid again")
    for hosts, per_host, layout in ((2, GRID_AT // 2, "list"), (3, 6, "grid")):  # GRID_AT procs still list
        small = SupervisionTree(controller=SyntheticController(hosts=hosts, per_host=per_host, scenario=False))
        try:
            assert small.layout == layout, (hosts, per_host)
        finally:
            small.close()
    with pytest.raises(ValueError, match="auto, grid, list"):
        SupervisionTree(controller=SyntheticController(hosts=1, per_host=1), view="table")


def test_the_grids_static_fallback(cluster_tree):
    widget, _ = cluster_tree
    page = widget.static_html()
    assert page.count('class="mnb-cell"') == 64 and page.count('class="mnb-hostrow"') == 8
    assert page.count('data-lost="true"') == 1 and 'data-name="host6" data-lost="true"' in page
    assert 'data-rank="19" data-state="failed"' in page and "rank 19 · pm0.19 · failed (SIGKILL)" in page
    text = [line.strip() for line in widget.static_text().splitlines()]
    assert text[0] == "8 hosts, 64 procs: 49 healthy, 3 busy, 1 paused, 1 hung, 9 failed, 1 restarting"
    assert "host6 (gpu-node-06) · LOST · load 0.80 · ranks 40-47: failed ranks 40-47" in text
    assert "host3 (gpu-node-03) · healthy · load 0.47 · ranks 16-23: 7 healthy, failed rank 19" in text
    widget.view = "list"
    wait_until(lambda: widget.layout == "list", 5, message="the list layout")
    assert "rank 19 · pm0.19" in widget.static_text() and 'class="mnb-cell"' not in widget.static_html()


def test_the_grid_updates_at_most_10_hz(cluster_tree):
    widget, controller = cluster_tree
    wait_until(lambda: widget.updates > 0, 5, message="a first update")
    before = widget.updates
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # a flood of events
        controller._event("supervised", 0, "handled", "restart")
        time.sleep(0.002)
    assert widget.updates - before <= 12


def test_dashboard_from_synthetic_metrics():
    dash = TrainingDashboard(total_steps=100)
    try:
        for step in range(60):
            dash.add_metric({"step": step, "loss": 2.0 / (step + 1), "batch_accuracy": step / 100, "time_s": step * 0.01,
                             "quorum": 1, "live_ranks": [0, 1, 2, 3] if step < 30 else [0, 1, 3],
                             "grad_norm": 10.0 / (step + 1)})
        dash.add_record({"kind": "rank_failed", "step": 30, "rank": 2, "detection_ms": 35.0})
        dash.add_record({"kind": "resumed", "step": 30, "resume_ms": 120.0})
        dash.add_record({"kind": "rejoined", "step": 45, "rank": 2, "rejoin_s": 0.8})
        wait_until(lambda: dash.progress.get("step") == 60 and len(dash.figures) == 3, 5, message="the dashboard caught up")
        assert dash.progress["total"] == 100 and dash.progress["live_ranks"] == 3
        assert len(dash.metrics) == 60 and dash.metrics[-1]["loss"] == pytest.approx(2.0 / 60)
        assert dash.metrics[-1]["grad_norm"] == dash.progress["grad_norm"] == pytest.approx(10.0 / 60)
        assert dash.figures["detection"]["median_ms"] == 35.0
        assert dash.figures["resume"]["median_ms"] == 120.0
        assert dash.figures["rejoin"]["median_ms"] == 800.0
        assert {m["step"] for m in dash.markers} == {30, 45}
        assert any("rejoined rank 2" in row["label"] for row in dash.timeline)
    finally:
        dash.close()


def test_dashboard_reads_training_recovery_records():
    dash = TrainingDashboard(total_steps=200)
    try:
        for step in range(120):
            dash.add_metric({"type": "step", "step": step, "loss": 1.0, "accuracy": 0.5, "live_ranks": [0, 1, 2, 3]})
        base = {"type": "recovery", "kind": "kill", "rank": 2, "step": 100}
        dash.add_record({**base, "event": "failed", "latency_s": 0.0})
        dash.add_record({**base, "event": "detected", "latency_s": 0.074})
        dash.add_record({**base, "event": "resumed", "latency_s": 0.119})
        dash.add_record({**base, "event": "rejoined", "latency_s": 9.8})
        wait_until(lambda: len(dash.figures) == 3 and len(dash.timeline) == 4, 5, message="figures shown")
        assert dash.figures["detection"]["median_ms"] == pytest.approx(74.0)
        assert dash.figures["resume"]["median_ms"] == pytest.approx(119.0)
        assert dash.figures["rejoin"]["median_ms"] == pytest.approx(9800.0)
        assert [m["type"] for m in dash.markers] == ["fault", "recovered", "recovered"]
        assert dash.markers[0]["step"] == 100 and "kill on rank 2: failed" in dash.markers[0]["label"]
    finally:
        dash.close()


def test_dashboard_downsamples_and_rate_limits():
    dash = TrainingDashboard(total_steps=5000, max_hz=10)
    try:
        t0 = time.monotonic()
        for step in range(5000):
            dash.add_metric({"step": step, "loss": 1.0, "accuracy": 0.5})
        # progress is set before metrics in a push: wait for the last step in both
        wait_until(lambda: dash.progress.get("step") == 5000 and dash.metrics and dash.metrics[-1]["step"] == 4999, 5,
                   message="last step shown")
        assert len(dash.metrics) <= 600 and dash.metrics[-1]["step"] == 4999
        assert dash.updates <= 2 + 10 * (time.monotonic() - t0) + 1
    finally:
        dash.close()


def test_dashboard_marks_supervision_events(procs4):
    from monarch_nb.runtime.controller import Controller

    dash = TrainingDashboard(total_steps=10)
    try:
        class FakeRun:
            procs = procs4
            metrics = [{"step": 0, "loss": 1.0, "accuracy": 0.1}]

            def subscribe(self, fn):
                self.fn = fn
                return lambda: None

            def wait(self, timeout=None):
                time.sleep(min(timeout or 0, 0.05))
                return False

            def done(self):
                return False

        run = FakeRun()
        dash.attach(run, Controller.get(), mesh=procs4.name)
        run.fn({"step": 1, "loss": 0.5, "accuracy": 0.2})
        procs4.inject(1, "kill")
        wait_until(lambda: any(m["type"] == "fault" and "rank 1" in m["label"] for m in dash.markers), 5, message="a fault marker")
        procs4.restart(1)
        wait_until(lambda: any(m["type"] == "recovered" for m in dash.markers), 5, message="a recovery marker")
        assert dash.progress["status"] == "training"
    finally:
        dash.close()


def test_dashboard_stop_button_stops_the_run_it_follows():
    """"stop training" shows while the run trains; a click stops the run (on a thread, once),
    and the button is gone while it stops and after."""
    ended = threading.Event()
    stops: list[float] = []

    class FakeRun:
        metrics: list = []

        def subscribe(self, fn):
            return lambda: None

        def wait(self, timeout=None):
            return ended.wait(timeout)

        def done(self):
            return ended.is_set()

        def stop(self, timeout=10.0):
            stops.append(time.monotonic())
            ended.set()
            return True

        def report(self, timeout=None):
            return "training report (stopped early)"

    dash = TrainingDashboard(total_steps=10)
    try:
        assert dash.click_stop() is None  # no run yet: nothing to stop
        dash.attach(FakeRun())
        wait_until(lambda: dash.progress.get("stoppable") is True, 5, message="the stop button shown")
        worker = dash.click_stop()
        worker.join(5)
        assert len(stops) == 1
        wait_until(lambda: dash.report == "training report (stopped early)" and dash.progress.get("status") == "done", 5,
                   message="the report shown")
        assert dash.progress["stoppable"] is False
        assert dash.click_stop() is None and len(stops) == 1  # a second click after the end does nothing
    finally:
        dash.close()
