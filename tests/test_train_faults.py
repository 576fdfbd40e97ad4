"""Training under faults in every phase of a run, and under every fault kind at once.

The matrix injects a fault of each detection path (kill: the host agent sees the exit; hang: the
heartbeats stop and the proc is fenced; raise: an endpoint raises) in each phase of a run
(spawning procs, constructing trainers, forming a quorum, healing, evaluating, checkpointing,
stopping). Each run must complete with nothing lost or stop cleanly; never hang; never restart a
rank twice for one failure (two incarnations of one rank).
"""

from __future__ import annotations

import threading
import time

import pytest

from monarch_nb.runtime.controller import Controller
from monarch_nb.train import start

from .conftest import pid_alive, wait_until

PROCS = 2
STEPS = 30
PHASES = ("spawning", "constructing", "forming quorum", "healing", "evaluating", "checkpointing", "stopping")
KINDS = ("kill", "hang", "raise")


pytestmark = pytest.mark.usefixtures("patient_hang_timeout")


def _restarts(mesh: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for event in Controller.get().events.events("proc_restarting"):
        if event.mesh == mesh:
            counts[event.rank] = counts.get(event.rank, 0) + 1
    return counts


def _pids(mesh: str) -> set[int]:
    ctrl = Controller.get()
    return {e.pid for e in ctrl.events.events() if e.mesh == mesh and e.pid}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("phase", PHASES)
def test_a_fault_in_every_phase_is_survived_or_stops_cleanly(phase, kind, tmp_path, no_leaked_processes):
    options: dict = dict(eval_every=0, window_steps=4, keep_parameters=False)
    faults = []
    steps = STEPS
    target = 1
    if phase == "healing":
        faults = ["kill@5:rank=1"]  # rank 1 restarts; the fault hits its new incarnation as it is healed
    elif phase == "evaluating":
        options["eval_every"] = 10
        target = 0  # the evaluating rank
    elif phase == "checkpointing":
        options.update(checkpoint_dir=str(tmp_path), checkpoint_every=10)
        target = 0  # the rank that writes it
    elif phase == "stopping":
        steps = 1_000_000
    ctrl = Controller.get()
    run = start("digits", procs=PROCS, steps=steps, seed=0, faults=faults, **options)
    fired = threading.Event()
    errors: list = []

    def inject() -> None:
        if fired.is_set():
            return
        fired.set()
        try:
            ctrl.inject(run.mesh_name, target, kind, {})
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    unsubscribe = None
    if phase == "spawning":  # the rank said hello; the others may not have yet
        def on_event(event) -> None:
            if event.kind == "proc_started" and event.mesh == run.mesh_name and event.rank == target:
                threading.Thread(target=inject, daemon=True).start()

        unsubscribe = ctrl.events.subscribe(on_event)
    else:  # on the training thread, just before the phase's work starts
        run.subscribe(lambda item: inject() if item.get("type") == "phase" and item["phase"] == phase else None)
    try:
        if phase == "stopping":
            wait_until(lambda: run.step >= 10 or run.done(), 150, message="training under way")
            t0 = time.monotonic()
            assert run.stop(timeout=20.0), "stop() did not end the run"
            assert time.monotonic() - t0 < 20.0
            report = run.report(timeout=1)
            assert report.stopped_early and report.steps >= 10
        else:
            report = run.report(timeout=240)  # never a hang
            assert report.steps == steps and not report.stopped_early
            assert report.steps_lost == 0 and report.replicas_identical
        assert fired.is_set() and not errors, errors
        assert (report.samples_lost, report.samples_repeated) == (0, 0)
    finally:
        if unsubscribe is not None:
            unsubscribe()
        run.stop()
    mesh = run.mesh_name
    # one restart per failure: the target at most once per fault it got, the others never
    planned = {1: 1} if phase == "healing" else {}
    for rank, count in _restarts(mesh).items():
        assert count <= planned.get(rank, 0) + (1 if rank == target else 0), (rank, count, _restarts(mesh))
    assert not [e for e in ctrl.events.events("restart_skipped") if e.mesh == mesh]
    pids = _pids(mesh)
    no_leaked_processes.update(pids)
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 10, message=f"the run's procs {sorted(pids)} gone")


def test_every_fault_kind_while_others_are_still_rejoining(no_leaked_processes):
    """Nine kinds, one every 0.3 s (less than a rejoin takes) into a live rank, leaving one live
    rank at least: ranks fail while others rejoin. Nothing is lost; the replicas end identical."""
    run = start("digits", procs=4, steps=1_000_000, seed=0, eval_every=0)
    params = {"stall": {"seconds": 4.0}, "partition": {"seconds": 4.0}, "slow": {"ms": 20.0}}
    kinds = ("kill", "segfault", "exit", "hang", "stall", "raise", "nan", "slow", "partition")
    try:
        wait_until(lambda: run.step >= 20 or run.done(), 150, message="training under way")
        ctrl = Controller.get()

        def serving_live_ranks() -> list[int] | None:
            # the run's live ranks that the runtime has not found failed yet (a rank hung 0.3 s ago
            # is still in the run's quorum until the run hears of it)
            live = [r for r in run.live_ranks if ctrl.proc_record(run.mesh_name, r).serving]
            return live if len(run.live_ranks) >= 2 and live else None

        rotation = 0
        for kind in kinds:
            deadline = time.monotonic() + 120
            while True:
                live = wait_until(serving_live_ranks, 120, message="two live ranks, one of them serving")
                rank = live[rotation % len(live)]
                try:
                    run.procs.inject(rank, kind, **params.get(kind, {}))
                    break
                except RuntimeError as exc:  # it failed between the read and the injection: another
                    assert "faults go to live procs" in str(exc) and time.monotonic() < deadline, exc
            rotation += 1
            time.sleep(0.3)
        # every failed rank comes back (nan and slow fail none). The faults are still being found
        # (a hang takes hang_timeout_s): wait on the run's recovery log, not on its live ranks

        def failed_ranks_rejoined() -> bool:
            def key(item: dict) -> tuple:
                return item["kind"], item["rank"], item["fault_step"]
            log = list(run.recoveries)
            failed = {key(i) for i in log if i.get("event") == "failed" and i["kind"] not in ("nan", "slow")}
            rejoined = {key(i) for i in log if i.get("event") == "rejoined"}
            return {k for k, _, _ in failed} >= set(kinds) - {"nan", "slow"} and failed <= rejoined

        wait_until(lambda: (failed_ranks_rejoined() and len(run.live_ranks) == 4) or run.done(), 180,
                   message="every failed rank rejoined")
        target = run.step + 20  # and they train together
        wait_until(lambda: run.step >= target, 60, message="20 more steps with every rank")
    finally:
        assert run.stop(timeout=20.0)
    report = run.report(timeout=1)
    assert report.stopped_early
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    assert report.replicas_identical
    assert {f["kind"] for f in report.failures} >= set(kinds)
    restarted = [f for f in report.failures if f["restarted"]]
    assert restarted
    assert [f for f in restarted if f["rejoin_latency_s"] is None] == [], "\n".join(map(str, report.failures))
    no_leaked_processes.update(_pids(run.mesh_name))


QUIET_END = """
import sys, time
import monarch_nb
monarch_nb.configure(heartbeat_interval_s=0.1, hang_timeout_s=3.0)
from monarch_nb.train import start

run = start("digits", procs=2, steps=1_000_000, seed=0, eval_every=0, snapshot_every=0, spares=0)
def kill_all(item):
    if item.get("type") == "step" and item["step"] == 30:
        for rank in range(2):
            run.procs.inject(rank, "kill")
run.subscribe(kill_all)
try:
    run.report(timeout=150)
except Exception as exc:
    print(f"the run failed: {exc}", file=sys.stderr, flush=True)
time.sleep(3.0)  # anything a background thread would print comes now
"""


def test_a_run_that_cannot_go_on_ends_with_its_message_last(no_leaked_processes):
    """Every replica killed and no snapshot to restore (snapshots off): the run ends with a clear
    message, and nothing is printed after it (restart threads stop quietly, no traceback)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", QUIET_END], cwd=repo, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=repo))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("the run failed: every rank failed at once"), proc.stderr[-3000:]
    assert "no snapshot" in lines[-1] and "Traceback" not in proc.stderr
