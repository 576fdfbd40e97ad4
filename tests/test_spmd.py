"""torchrun scripts on a mesh: every rank runs a DDP script as ``__main__`` (env:// rendezvous);
a second run reuses the procs; a failure stops the others at once; ``max_restarts`` runs the
group again; the mesh outlives a failed run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import monarch_nb
from monarch_nb.errors import ActorError, SupervisionError
from monarch_nb.runtime.controller import Controller
from monarch_nb.spmd import ScriptFailed, run_script
from monarch_nb.spmd.cli import SCRIPT_PRELOAD

from .conftest import pid_alive, wait_until

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ddp_script.py")

pytestmark = pytest.mark.usefixtures("patient_hang_timeout")  # DDP's first steps on a busy 2-core machine


@pytest.fixture
def script_procs(no_leaked_processes):
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2}, preload=SCRIPT_PRELOAD)
    yield procs
    no_leaked_processes.update(r.pid for r in Controller.get().mesh_records(procs.name))
    procs.stop()


def _pids(procs) -> list[int]:
    return [r.pid for r in Controller.get().mesh_records(procs.name)]


def _lines(procs, rank: int, prefix: str) -> list[str]:
    return [line for line in Controller.get().proc_record(procs.name, rank).output_tail if line.startswith(prefix)]


def test_a_ddp_script_runs_on_every_rank_and_again_on_the_same_procs(script_procs):
    pids = _pids(script_procs)
    first = run_script(script_procs, SCRIPT, ["4"])
    assert (first.world_size, first.attempts, first.failures) == (2, 1, ())
    done = [wait_until(lambda r=r: _lines(script_procs, r, "done"), 10, message=f"rank {r}'s last line") for r in (0, 1)]
    assert done[0] == done[1], "DDP kept the replicas identical"
    second = run_script(script_procs, SCRIPT, ["4"])
    assert second.attempts == 1 and _pids(script_procs) == pids, "the second run used the same procs"
    assert second.failures == () and second.world_size == 2


def test_a_rank_that_raises_stops_its_peer_at_once_and_the_group_runs_again(script_procs, tmp_path):
    pids = _pids(script_procs)
    run = run_script(script_procs, SCRIPT, ["6", "--fail-at", "1:2:raise", "--marker", str(tmp_path / "m"), "--step-s", "0.05"],
                     max_restarts=1)
    assert run.attempts == 2 and [f.rank for f in run.failures] == [1]
    failure = run.failures[0]
    assert isinstance(failure.error, ActorError) and failure.error.exception_type == "ValueError"
    assert all(p not in _pids(script_procs) for p in pids), "the whole group ran again on restarted procs"
    assert run.seconds < 60, "rank 0, blocked in the all-reduce, was stopped, not left to a collective timeout"


def test_a_killed_rank_fails_the_run_and_the_mesh_stays_usable(script_procs, tmp_path):
    with pytest.raises(ScriptFailed, match="ddp_script.py failed on rank 0") as info:
        run_script(script_procs, SCRIPT, ["6", "--fail-at", "0:1:kill", "--marker", str(tmp_path / "m")])
    assert isinstance(info.value.failures[0].error, SupervisionError)
    again = run_script(script_procs, SCRIPT, ["3"])
    assert again.attempts == 1


def test_bad_arguments_say_what_to_fix(script_procs, tmp_path):
    with pytest.raises(FileNotFoundError, match="no script 'nope.py'"):
        run_script(script_procs, "nope.py")
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
        run_script(script_procs, SCRIPT, max_restarts=-1)


def test_the_command_runs_a_script_restarts_it_and_reports_a_failure(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ok = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "run", "--procs", "2", "--max-restarts", "1", SCRIPT, "4",
                         "--fail-at", "0:1:kill", "--marker", str(tmp_path / "m")],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "[0] done" in ok.stdout and "[1] done" in ok.stdout and "after 1 restart(s)" in ok.stderr
    bad = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "run", "--procs", "2", SCRIPT, "4",
                          "--fail-at", "1:1:raise", "--marker", str(tmp_path / "m2")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1
    assert "ddp_script.py failed on rank 1" in bad.stderr and "ValueError: rank 1 fails at step 1 on purpose" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "run", "nope.py"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "no script 'nope.py'" in usage.stderr


def test_the_command_exits_with_the_status_the_script_passed_to_sys_exit(tmp_path):
    """As `python script.py` would: sys.exit(3) on a rank is the command's status 3, and a message
    (sys.exit("...")) is status 1 with the message; one line each, no traceback of the runtime."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for code, status, said in (("3", 3, "exited with status 3 on rank"), ("'bad config'", 1, ": bad config")):
        script = tmp_path / f"exit_{status}.py"
        script.write_text(f"import sys\nsys.exit({code})\n")
        ended = subprocess.run([sys.executable, "-m", "monarch_nb.cli", "run", "--procs", "2", str(script)],
                               capture_output=True, text=True, timeout=120, env=env)
        assert ended.returncode == status, ended.stderr
        assert said in ended.stderr and "Traceback" not in ended.stderr, ended.stderr


@pytest.mark.kernel
def test_mesh_run_in_a_notebook_shows_each_ranks_output_and_debugs_the_failed_rank(tmp_path):
    from .jupyter_kernel import Kernel
    from .test_debug import ok

    kernel = Kernel()
    pids: list[int] = []
    try:
        kernel.ok("%mesh start 2", 120)
        pids = kernel.worker_pids()
        ran = kernel.ok(f"%mesh run {SCRIPT} 3", 120).stream_text()
        assert "ended on all 2 ranks" in ran
        assert "[0] done" in ran and "[1] done" in ran, ran
        failed = kernel.ok(f"%mesh run {SCRIPT} 4 --fail-at 1:1:raise --marker {tmp_path / 'm'}", 120)
        text = failed.stream_text("stderr")
        assert "ddp_script.py failed on rank 1" in text and "`%mesh debug 1` opens rank 1's post-mortem" in text, text
        post_mortem = ok(kernel, "%mesh debug 1", ["p step", "p how", "q"], 60).text
        assert "1\n" in post_mortem and "'raise'" in post_mortem, post_mortem
        assert "ended on all 2 ranks" in kernel.ok(f"%mesh run {SCRIPT} 2", 120).stream_text(), "the mesh outlived the failure"
        usage = kernel.execute("%mesh run nope.py")
        assert usage.status == "error" and "no script 'nope.py'" in usage.stream_text("stderr") + str(usage.error)
        kernel.ok("%mesh stop")
    finally:
        pids += kernel.worker_pids()
        kernel.shutdown()
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 10.0, message=f"kernel's workers {pids} gone")
