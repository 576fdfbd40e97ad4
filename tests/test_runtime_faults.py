"""Faults in every phase of a proc's life, seen by the runtime: warm spares, a hang during a heavy
import, restarts that race, overload, and the environment new procs start with."""

from __future__ import annotations

import os
import threading
import time

import pytest

import monarch_nb
from monarch_nb import Actor, endpoint
from monarch_nb.config import config
from monarch_nb.runtime.controller import Controller
from monarch_nb.supervision.records import ProcState
from monarch_nb.supervision.tree import find

from .actors import Counter, Worker
from .conftest import hang_deadline_s, live_processes, pid_alive, wait_until


def _spares(procs) -> list[dict]:
    return find(Controller.get().tree(procs.name), "spare")


def _ready_spare_pids(procs) -> set[int]:
    return {s["pid"] for s in _spares(procs) if s["state"] == ProcState.HEALTHY}


def _procs_named(identity: str) -> list[int]:
    """Pids of live processes started as proc ``identity`` (by command line or as a spare that took it)."""
    return [pid for pid, _, argv in live_processes() if b"monarch_nb.proc_main" in argv and identity.encode() in argv]


def test_a_warm_spare_takes_a_killed_ranks_place_and_the_pool_refills(no_leaked_processes):
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2}, spares=1, preload=("numpy",))
    ctrl = Controller.get()
    mine: set[int] = set()
    try:
        counters = procs.spawn("c", Counter, 5)
        spare = wait_until(lambda: _ready_spare_pids(procs), 30, message="a ready spare")
        old = ctrl.proc_record(procs.name, 1).pid
        mine |= spare | {old}
        procs.inject(1, "kill")
        wait_until(lambda: ctrl.proc_record(procs.name, 1).state == ProcState.FAILED, 10, message="rank 1 failed")
        procs.restart(1)
        rec = ctrl.proc_record(procs.name, 1)
        assert rec.on_spare and rec.pid in spare and rec.pid != old
        assert counters.incr.call(by=1).get(timeout=10).values() == [6, 6]  # actors respawned on the spare
        refilled = wait_until(lambda: _ready_spare_pids(procs) - spare, 30, message="a new spare")
        mine |= refilled | {r.pid for r in ctrl.mesh_records(procs.name)}
        restarted = [e for e in ctrl.events.events() if e.kind == "proc_restarted" and e.mesh == procs.name]
        assert "warm spare" in restarted[-1].detail
    finally:
        no_leaked_processes.update(mine)
        procs.stop()
    assert _spares(procs) == []
    wait_until(lambda: not any(pid_alive(p) for p in mine), 10, message=f"procs and spares {sorted(mine)} gone after stop")


HEAVY_SLOW_IMPORT = """
import time
for _ in range(1200):  # a heavy import that takes a minute (the GIL is released in the sleeps)
    time.sleep(0.05)
"""


class Importer(Actor):
    @endpoint
    def import_slowly(self, folder: str) -> None:
        import sys

        sys.path.insert(0, folder)
        import jaxlib  # noqa: F401 - a stand-in heavy module (see HEAVY_MODULES), slow on purpose


def test_a_proc_frozen_during_a_heavy_import_is_found_hung_in_the_hang_timeout(procs4, tmp_path):
    (tmp_path / "jaxlib").mkdir()
    (tmp_path / "jaxlib" / "__init__.py").write_text(HEAVY_SLOW_IMPORT)
    assert config.import_grace_s > 10 * config.hang_timeout_s
    ctrl = Controller.get()
    importers = procs4.spawn("imp", Importer)
    call = importers.slice(gpus=2).import_slowly.call_one(str(tmp_path))
    wait_until(lambda: ctrl.proc_record(procs4.name, 2).loading == ["jaxlib"], 10, message="rank 2 announcing its import")
    since = ctrl.events.next_seq
    procs4.inject(2, "hang")
    event = ctrl.events.wait_for(lambda e: e.kind == "proc_hung" and e.rank == 2 and e.mesh == procs4.name,
                                 hang_deadline_s(), since)
    assert event is not None, f"a SIGSTOPped proc was not found hung within {hang_deadline_s():.1f} s"
    assert "stopped (SIGSTOP)" in event.detail and "its host agent heard" in event.detail, \
        f"the hang says it was the proc, not its agent: {event.detail}"
    with pytest.raises(monarch_nb.SupervisionError, match="rank 2 failed"):
        call.get(timeout=10)


def test_restarts_that_race_make_one_restart_and_one_incarnation(procs4):
    ctrl = Controller.get()
    procs4.spawn("w", Worker)
    before = ctrl.proc_record(procs4.name, 3).restarts
    procs4.inject(3, "kill")
    wait_until(lambda: ctrl.proc_record(procs4.name, 3).state == ProcState.FAILED, 10, message="rank 3 failed")
    since = ctrl.events.next_seq
    errors: list = []

    def restart() -> None:
        try:
            procs4.restart(3, timeout_s=30)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=restart) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    rec = ctrl.proc_record(procs4.name, 3)
    assert rec.serving and rec.restarts == before + 1
    skipped = [e for e in ctrl.events.events(since_seq=since) if e.kind == "restart_skipped" and e.rank == 3]
    assert len(skipped) == 2
    assert _procs_named(f"{procs4.name}.3") == [rec.pid]


def test_a_new_mesh_sees_the_environment_of_the_moment(no_leaked_processes):
    first = monarch_nb.this_host().spawn_procs(per_host={"gpus": 1})
    first.stop()
    os.environ["MONARCH_NB_TEST_DATA_DIR"] = "/data/set-after-the-first-mesh"
    try:
        procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2})
        try:
            env = procs.spawn("w", EnvReader).env.call("MONARCH_NB_TEST_DATA_DIR").get(timeout=10)
            assert env.values() == ["/data/set-after-the-first-mesh"] * 2
        finally:
            procs.stop()
    finally:
        del os.environ["MONARCH_NB_TEST_DATA_DIR"]


class EnvReader(Actor):
    @endpoint
    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    @endpoint
    def torchrun_all_reduce(self) -> tuple:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// with what torchrun would have set
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        world = dist.get_world_size()
        dist.destroy_process_group()
        return (os.environ["MASTER_ADDR"], world, t.item())


def test_code_written_for_torchrun_runs_unchanged(procs4):
    result = procs4.spawn("t", EnvReader).torchrun_all_reduce.call().get(timeout=120)
    assert result.values() == [("127.0.0.1", 4, 10.0)] * 4


class DdpRounds(Actor):
    @endpoint
    def rounds(self, n: int) -> int:
        """``n`` times what a DDP script does at its end: its last backward, then
        ``destroy_process_group()`` and the model dropped at once (a ``main()`` returning)."""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        for _ in range(n):
            dist.init_process_group("gloo")
            model = DistributedDataParallel(torch.nn.Linear(8, 1))
            for _ in range(3):
                model(torch.randn(4, 8)).sum().backward()
            dist.destroy_process_group()
            del model
        return n


def test_a_ddp_model_dropped_right_after_its_group_was_destroyed_never_deadlocks_the_proc(no_leaked_processes):
    # torch frees the group in the DDP reducer's destructor holding the GIL, while a gloo worker
    # still dropping its last collective waits for the GIL: without the runtime holding destroyed
    # groups, a proc deadlocked within ~5 rounds and was fenced as hung
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2})
    try:
        assert procs.spawn("d", DdpRounds).rounds.call(20).get(timeout=120).values() == [20, 20]
    finally:
        procs.stop()


@pytest.mark.slow
def test_many_procs_on_two_cores_import_torch_in_turn_without_being_fenced(no_leaked_processes):
    count = 12  # 6 per core here: each import of torch takes seconds of CPU, far past the hang timeout
    ctrl = Controller.get()
    since = ctrl.events.next_seq
    t0 = time.monotonic()
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": count})
    try:
        workers = procs.spawn("w", Worker)
        assert workers.import_module.call("torch").get(timeout=170).values() == ["torch"] * count
        bad = [e for e in ctrl.events.events(since_seq=since)
               if e.mesh == procs.name and e.kind in ("proc_hung", "proc_exited", "proc_restarting")]
        assert bad == [], bad
        assert time.monotonic() - t0 < 180
        # the crowding that stretches a training run's setup deadline (12 ranks on this machine's cores)
        assert ctrl.procs_per_core(procs.name) == count / len(os.sched_getaffinity(0))
    finally:
        no_leaked_processes.update(ctrl.pids())
        procs.stop()
