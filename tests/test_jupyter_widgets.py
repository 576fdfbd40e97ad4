"""Widget state without a browser: the tree follows faults and recovery; the dashboard its feed."""

from __future__ import annotations

import time

import pytest

from monarch_nb.jupyter.dashboard import TrainingDashboard
from monarch_nb.jupyter.tree_widget import BUTTON_FAULTS, SupervisionTree

from .conftest import wait_until

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
    wait_until(lambda: tree.proc_states().get(2) == "failed", 5, message="the widget showing rank 2 failed")
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
    wait_until(lambda: tree.proc_states().get(1) == "failed", 5, message="rank 1 fenced")
    kinds = [e["kind"] for e in tree.events if e["rank"] == 1]
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


def test_dashboard_from_synthetic_metrics():
    dash = TrainingDashboard(total_steps=100)
    try:
        for step in range(60):
            dash.add_metric({"step": step, "loss": 2.0 / (step + 1), "accuracy": step / 100, "time_s": step * 0.01,
                             "epoch": 0, "live_ranks": [0, 1, 2, 3] if step < 30 else [0, 1, 3],
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
        wait_until(lambda: dash.progress.get("step") == 5000, 5, message="last step shown")
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
