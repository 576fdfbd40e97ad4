"""Meshes across hosts: worker loops in network namespaces, attached over CurveZMQ; host loss,
link cuts, and the rules of who may attach."""

from __future__ import annotations

import os
import threading
import time

import pytest

import monarch_nb
from monarch_nb import Actor, SupervisionError, current_rank, endpoint
from monarch_nb.config import config
from monarch_nb.runtime.controller import Controller
from monarch_nb.runtime.hosts import AttachError
from monarch_nb.supervision.records import ProcState
from monarch_nb.supervision.tree import find
from monarch_nb.transport.keys import create_keys

from .conftest import hang_deadline_s, pid_alive, wait_until
from .netns_cluster import NetnsCluster, require_namespaces

pytestmark = pytest.mark.timeout(300)


class Where(Actor):
    def __init__(self, tag: str = ""):
        self.tag = tag
        self.value = 0

    @endpoint
    def where(self) -> dict:
        return {"rank": current_rank().rank, "pid": os.getpid(), "netns": os.readlink("/proc/self/ns/net"),
                "group_rank": int(os.environ["GROUP_RANK"]), "gloo_if": os.environ.get("GLOO_SOCKET_IFNAME")}

    @endpoint
    def add(self, by: int) -> int:
        self.value += by
        return self.value

    @endpoint
    def peers_failed(self) -> list[tuple[int, str]]:
        """``(rank, cause)`` of each failure of this proc's mesh that the controller told it of."""
        from monarch_nb.runtime.proc import current

        proc = current()
        assert proc is not None
        return sorted((f.rank, f.cause) for f in proc.peer_failures)

    @endpoint
    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")  # env://: the controller's store, across hosts
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, no_leaked_processes):
    require_namespaces()
    keys = create_keys(str(tmp_path_factory.mktemp("keys") / "cluster"))
    hosts = NetnsCluster(2, keys).start()
    yield hosts
    controller = Controller.existing()
    if controller is not None:
        no_leaked_processes.update(controller.pids())
        controller.shutdown()  # a fresh controller for the modules after this one
    hosts.close()


@pytest.fixture(scope="module")
def mesh(cluster):
    hosts = monarch_nb.attach_to_workers(cluster.addresses, ca=cluster.ca)
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    yield hosts, procs
    procs.stop()


def test_a_2x2_mesh_across_namespaces_runs_every_adverb(cluster, mesh):
    hosts, procs = mesh
    assert dict(hosts.extent) == {"hosts": 2} and dict(procs.extent) == {"hosts": 2, "gpus": 2}
    actors = procs.spawn("where", Where)
    info = actors.where.call().get(timeout=30)
    mine = os.readlink("/proc/self/ns/net")
    by_rank = {v["rank"]: v for v in info.values()}
    assert [by_rank[r]["group_rank"] for r in range(4)] == [0, 0, 1, 1]
    assert all(v["netns"] != mine for v in by_rank.values())  # they really run on the other "hosts"
    assert by_rank[0]["netns"] == by_rank[1]["netns"] != by_rank[2]["netns"] == by_rank[3]["netns"]
    assert {v["pid"] for v in by_rank.values()} <= set(cluster.pids_in(0)) | set(cluster.pids_in(1))
    assert all(v["gloo_if"].startswith(cluster.tag) for v in by_rank.values())
    assert actors.slice(hosts=1, gpus=0).add.call_one(5).get(timeout=10) == 5
    assert actors.add.choose(1).get(timeout=10) >= 1
    actors.add.broadcast(10)
    assert sorted(f.get(timeout=10) for f in actors.add.stream(0)) == sorted(actors.add.call(0).get(timeout=10).values())
    assert actors.all_reduce.call().get(timeout=120).values() == [10.0] * 4  # gloo over the bridge
    tree = procs.tree()
    placed = {h["name"]: sorted(p["rank"] for p in h["children"] if p["kind"] == "proc") for h in find(tree, "host")}
    assert {name: ranks for name, ranks in placed.items() if ranks} == dict(zip(hosts.host_names, [[0, 1], [2, 3]]))
    controller = Controller.get()
    assert all(controller.hosts[h].detail["ip"].startswith(cluster.subnet) for h in hosts.host_names)


def _wait_host(name: str, state: ProcState, timeout_s: float) -> None:
    wait_until(lambda: Controller.get().hosts[name].state == state, timeout_s, message=f"host {name} {state}")


def test_a_killed_host_agent_fails_its_procs_only_and_the_host_comes_back(cluster, mesh):
    hosts, procs = mesh
    actors = procs.spawn("survivors", Where)
    ctrl = Controller.get()
    lost_host = hosts.host_names[1]
    agent = ctrl.hosts[lost_host].pid
    old = [ctrl.proc_record(procs.name, r).pid for r in (2, 3)]
    since = ctrl.events.next_seq
    os.kill(agent, 9)
    event = ctrl.events.wait_for(lambda e: e.kind == "host_lost" and e.host == lost_host, hang_deadline_s() + 1, since)
    assert event is not None
    with pytest.raises(SupervisionError, match=r"rank 2 failed \(host_lost\)"):
        actors.slice(hosts=1, gpus=0).add.call_one(1).get(timeout=10)
    assert actors.slice(hosts=0).add.call(1).get(timeout=10).values() == [1, 1]  # the other host goes on
    # each survivor was told of both of the lost host's procs (in one message, Liveness.fail_procs)
    survivors = actors.slice(hosts=0).peers_failed.call().get(timeout=10).values()
    assert [[f for f in seen if f[0] in (2, 3)] for seen in survivors] == [[(2, "host_lost"), (3, "host_lost")]] * 2
    wait_until(lambda: not any(pid_alive(p) for p in old), 10, message="the lost host's procs gone")
    _wait_host(lost_host, ProcState.HEALTHY, 30)  # attached again: the worker loop outlived its agent
    for rank in (2, 3):
        procs.restart(rank, timeout_s=60)
    assert actors.add.call(0).get(timeout=30).values() == [1, 1, 0, 0]


def test_a_killed_worker_loop_takes_its_agent_and_procs_along_and_comes_back(cluster, mesh):
    """The worker loop of a host is SIGKILLed (as a node's service manager would stop it): its host
    agent and procs end with it (nothing serves on behind its back), the host is lost; the loop
    started again at the same address is attached again, and the host's ranks restart on it."""
    hosts, procs = mesh
    actors = procs.spawn("loop_killed", Where)
    ctrl = Controller.get()
    host = hosts.host_names[1]
    orphans = [ctrl.hosts[host].pid] + [ctrl.proc_record(procs.name, r).pid for r in (2, 3)]
    since = ctrl.events.next_seq
    cluster.kill_worker(1)
    _host_lost(ctrl, host, since)
    wait_until(lambda: not any(pid_alive(p) for p in orphans), 10, message="the killed loop's agent and procs gone")
    cluster.start_worker_again(1)
    _wait_host(host, ProcState.HEALTHY, 60)
    for rank in (2, 3):
        procs.restart(rank, timeout_s=60)
    assert actors.add.call(1).get(timeout=30).values() == [1, 1, 1, 1]


def test_a_new_mesh_right_after_a_worker_loop_restart_serves_on_every_host(cluster, mesh):
    """Host 1's worker loop is SIGKILLed and started again; a new proc mesh on the same host mesh,
    spawned at moments before, during and after the controller learns of the loss (the first ones
    reach the dying agent), serves on every rank once the host is back: procs of a host lost while
    they start are started again there. The old mesh's ranks fail as ``host_lost``, the cause
    README names, not as the SIGKILL their dying agent dealt them."""
    hosts, procs = mesh
    actors = procs.spawn("before_restart", Where)
    ctrl = Controller.get()
    host = hosts.host_names[1]
    for delay_s in (0.0, 0.05, 0.3):
        since = ctrl.events.next_seq
        spawned: list = []
        cluster.kill_worker(1)
        time.sleep(delay_s)
        spawner = threading.Thread(target=lambda spawned=spawned: spawned.append(hosts.spawn_procs(per_host={"gpus": 1})))
        spawner.start()
        cluster.start_worker_again(1)
        spawner.join(60)
        assert spawned, "spawn_procs did not return within 60 s"
        fresh = spawned[0]
        try:
            info = fresh.spawn("fresh", Where).where.call().get(timeout=30)
            assert sorted(v["group_rank"] for v in info.values()) == [0, 1]
            assert {v["pid"] for v in info.values() if v["group_rank"] == 1} <= set(cluster.pids_in(1))
        finally:
            fresh.stop()
        _host_lost(ctrl, host, since)
        lost = [e for e in ctrl.events.events() if e.seq >= since and e.kind == "proc_exited" and e.mesh == procs.name]
        assert lost and all(e.cause == "host_lost" for e in lost), [(e.rank, e.cause) for e in lost]
        with pytest.raises(SupervisionError, match=r"rank 2 failed \(host_lost\)"):
            actors.slice(hosts=1, gpus=0).add.call_one(1).get(timeout=10)
        _wait_host(host, ProcState.HEALTHY, 60)
        for rank in (2, 3):
            procs.restart(rank, timeout_s=60)


def test_a_cut_link_is_a_lost_host_and_its_return_is_no_split_brain(cluster, mesh):
    hosts, procs = mesh
    actors = procs.spawn("cut", Where)
    ctrl = Controller.get()
    cut_host = hosts.host_names[0]
    before = {r: ctrl.proc_record(procs.name, r).pid for r in (0, 1)}
    since = ctrl.events.next_seq
    t0 = time.monotonic()
    cluster.cut(0)
    try:
        event = ctrl.events.wait_for(lambda e: e.kind == "host_lost" and e.host == cut_host, hang_deadline_s() + 1, since)
        assert event is not None and event.monotonic - t0 <= config.hang_timeout_s + 2 * config.heartbeat_interval_s + 1.5
        with pytest.raises(SupervisionError, match="host_lost"):
            actors.slice(hosts=0, gpus=1).add.call_one(1).get(timeout=10)
        assert actors.slice(hosts=1).add.call(1).get(timeout=10).values() == [1, 1]
    finally:
        cluster.restore(0)
    _wait_host(cut_host, ProcState.HEALTHY, 60)
    # the cut-off ranks of before never serve again: killed by their agent (controller silent) or fenced
    wait_until(lambda: not any(pid_alive(p) for p in before.values()), 30, message="cut-off procs gone")
    for rank in (0, 1):
        procs.restart(rank, timeout_s=60)
    assert actors.add.call(0).get(timeout=30).values() == [0, 0, 1, 1]
    assert all(ctrl.proc_record(procs.name, r).pid not in before.values() for r in (0, 1))


def _host_lost(ctrl, host: str, since: int) -> None:
    event = ctrl.events.wait_for(lambda e: e.kind == "host_lost" and e.host == host, hang_deadline_s() + 1, since)
    assert event is not None, f"host {host} not found lost within {hang_deadline_s() + 1:.1f} s"


def _trains_on(run, steps: int, message: str) -> None:
    target = run.step + steps
    wait_until(lambda: run.step >= target or run.done(), 120, message=message)
    assert not run.done(), run.report(timeout=1)


def test_training_across_hosts_survives_a_killed_host_agent_and_a_cut_link(cluster, mesh, no_leaked_processes):
    """digits on 2 hosts x 2 procs: the ranks of a host whose agent is SIGKILLed, then of a host
    cut off and let back, fail with host_lost while the other host trains on, and rejoin once
    their host is attached again; the sample ledger shows nothing lost or repeated and the
    replicas end identical."""
    from monarch_nb.train import start

    hosts, _ = mesh
    ctrl = Controller.get()
    run = start("digits", procs=2, steps=1_000_000, seed=0, eval_every=0, hosts=hosts)
    try:
        wait_until(lambda: run.step >= 20 or run.done(), 180, message="training under way on 2 hosts")
        by_host = {r: ctrl.proc_record(run.mesh_name, r).host for r in range(4)}
        assert by_host == {0: hosts.host_names[0], 1: hosts.host_names[0], 2: hosts.host_names[1], 3: hosts.host_names[1]}
        assert run.live_ranks == [0, 1, 2, 3]

        # (a) the host agent of the second host is SIGKILLed
        since = ctrl.events.next_seq
        os.kill(ctrl.hosts[hosts.host_names[1]].pid, 9)
        _host_lost(ctrl, hosts.host_names[1], since)
        _trains_on(run, 10, "the first host trains on without the lost one")
        wait_until(lambda: run.live_ranks == [0, 1, 2, 3], 120, message="ranks 2 and 3 rejoined once their host was back")
        _trains_on(run, 10, "four ranks train together again")

        # (b) the first host's link is cut mid-training, then restored
        since = ctrl.events.next_seq
        cluster.cut(0)
        try:
            _host_lost(ctrl, hosts.host_names[0], since)
            _trains_on(run, 10, "the second host trains on while the first is cut off")
        finally:
            cluster.restore(0)
        wait_until(lambda: run.live_ranks == [0, 1, 2, 3], 120, message="ranks 0 and 1 rejoined after the link returned")
        _trains_on(run, 10, "four ranks train together after the cut")
    finally:
        assert run.stop(timeout=20.0)
        no_leaked_processes.update(e.pid for e in ctrl.events.events() if e.mesh == run.mesh_name and e.pid)
    report = run.report(timeout=1)
    assert (report.hosts, report.procs) == (2, 4)
    assert (report.steps_lost, report.samples_lost, report.samples_repeated) == (0, 0, 0)
    assert report.replicas_identical
    lost = {f["rank"] for f in report.failures if f["cause"] == "host_lost"}
    assert lost == {0, 1, 2, 3}, report.failures
    assert all(f["rejoin_latency_s"] is not None for f in report.failures if f["restarted"]), report.failures


def test_who_may_attach(cluster, tmp_path):
    with pytest.raises(ValueError, match="refusing to listen on tcp://10.0.0.9:1 without a cluster key"):
        monarch_nb.run_worker_loop_forever("tcp://10.0.0.9:1")
    with pytest.raises(ValueError, match="pass ca="):
        monarch_nb.attach_to_workers([cluster.addresses[0]])
    other = create_keys(str(tmp_path / "other"))
    monarch_nb.configure(start_timeout_s=3.0)
    with pytest.raises(AttachError, match="did not answer"):  # CurveZMQ refuses a client of another cluster
        monarch_nb.attach_to_workers([cluster.addresses[0]], ca=other)
