"""Jobs start worker loops and hand back host meshes: LocalJob, SSHJob through a real sshd in a
network namespace, SlurmJob through a real slurmctld + slurmd (scripts/slurm-local.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from monarch_nb.config import config
from monarch_nb.job import LocalJob, SlurmJob, SSHJob, job_load
from monarch_nb.runtime.hosts import AttachError
from monarch_nb.transport.keys import create_keys

from .actors import Counter
from .conftest import pid_alive, wait_until
from .netns_cluster import NetnsCluster, require_namespaces

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(300)


def _use(host_mesh, per_host: int = 1) -> list[int]:
    procs = host_mesh.spawn_procs(per_host={"gpus": per_host})
    try:
        return procs.spawn("c", Counter, 1).incr.call().get(timeout=60).values()
    finally:
        procs.stop()


def test_local_job_lifecycle_and_reattach_from_the_state_file(tmp_path, no_leaked_processes):
    state_file = str(tmp_path / "job_state.json")
    job = LocalJob({"trainers": 2, "loaders": 1})
    try:
        state = job.state(cached_path=state_file)
        assert dict(state.trainers.extent) == {"hosts": 2} and dict(state.loaders.extent) == {"hosts": 1}
        with pytest.raises(AttributeError, match="its meshes: loaders, trainers"):
            state.evaluators  # noqa: B018 - the error names the meshes there are
        assert _use(state.trainers) == [2, 2]
        pids = list(job.running["pids"])
        # a restarted kernel: a new job object with the same spec finds the allocation and re-attaches
        again = LocalJob({"trainers": 2, "loaders": 1})
        again.state(cached_path=state_file)
        assert again.running["pids"] == pids and job_load(state_file).running["pids"] == pids
    finally:
        job.kill(cached_path=state_file)
    assert not os.path.exists(state_file)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, message="local workers gone after kill")


@pytest.fixture
def ssh_host(tmp_path, no_leaked_processes):
    """One namespace host running a real sshd (throwaway host and user keys) and no worker."""
    require_namespaces()
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        pytest.fail("sshd is missing: run scripts/install-test-daemons.sh (make test does)")
    keys = create_keys(str(tmp_path / "cluster"))
    cluster = NetnsCluster(1, keys, workers=False).start()
    try:
        host_key, user_key = tmp_path / "host_key", tmp_path / "user_key"
        for key in (host_key, user_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        (tmp_path / "authorized_keys").write_text((tmp_path / "user_key.pub").read_text())
        os.chmod(tmp_path / "authorized_keys", 0o600)
        config = tmp_path / "sshd_config"
        config.write_text(
            f"Port 2222\nListenAddress {cluster.host_ip(0)}\nHostKey {host_key}\nPidFile {tmp_path}/sshd.pid\n"
            f"AuthorizedKeysFile {tmp_path}/authorized_keys\nPermitRootLogin prohibit-password\nStrictModes no\n"
            "UsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        )
        os.makedirs("/run/sshd", exist_ok=True)
        cluster.run_in(0, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.DEVNULL)
        ssh_args = ["-i", str(user_key), "-p", "2222", "-o", "StrictHostKeyChecking=no", "-o",
                    "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes"]
        probe = ["ssh", *ssh_args, cluster.host_ip(0), "true"]
        wait_until(lambda: subprocess.run(probe, capture_output=True, timeout=20).returncode == 0, 30,
                   interval_s=0.2, message="sshd answering")
        yield cluster, keys, ssh_args
    finally:
        cluster.close()


def test_ssh_job_starts_workers_through_sshd(ssh_host, tmp_path):
    cluster, keys, ssh_args = ssh_host
    job = SSHJob([cluster.host_ip(0)], mesh="trainers", ca=keys, python=sys.executable, ssh_args=ssh_args)
    try:
        state = job.state(cached_path=str(tmp_path / "state.json"))
        assert _use(state.trainers, per_host=2) == [2, 2]
        remote = job.running["remote_pids"][0]
        assert remote in cluster.pids_in(0)  # the worker runs on the ssh host (its namespace)
    finally:
        job.kill(cached_path=str(tmp_path / "state.json"))
    wait_until(lambda: remote not in cluster.pids_in(0), 15, message="the remote worker gone after kill")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster on this machine, stopped after the module."""
    if os.geteuid() != 0:
        pytest.skip("slurmd needs root")
    state = str(tmp_path_factory.mktemp("slurm"))
    script = os.path.join(REPO, "scripts", "slurm-local.sh")
    started = subprocess.run(["bash", script, "start", state], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, f"slurm-local.sh start failed: {started.stderr}"
    os.environ["SLURM_CONF"] = started.stdout.strip().splitlines()[-1]
    yield state
    subprocess.run(["bash", script, "stop", state], capture_output=True, timeout=120)
    del os.environ["SLURM_CONF"]


def test_slurm_job_submits_attaches_trains_and_cancels(slurm, tmp_path):
    state_file = str(tmp_path / "state.json")
    job = SlurmJob({"trainers": 2}, ntasks_per_node=2, worker_host="127.0.0.1", log_dir=str(tmp_path / "slurm"),
                   time_limit="00:10:00", start_timeout_s=120)
    try:
        job.apply().dump(state_file)  # submitted; `monarch-nb train --job` attaches its workers
        job_id = job.running["job_id"]
        report_json = str(tmp_path / "report.json")
        trained = subprocess.run(
            [sys.executable, "-m", "monarch_nb.cli", "train", "--job", state_file, "--procs", "1", "--steps", "30",
             "--eval-every", "0", "--no-progress", "--report-json", report_json],
            capture_output=True, text=True, timeout=240, cwd=REPO)
        assert trained.returncode == 0, trained.stderr[-3000:]
        assert "training on host mesh 'trainers' of the SlurmJob" in trained.stderr
        report = json.load(open(report_json))
        assert (report["procs"], report["hosts"], report["steps"]) == (2, 2, 30)
        assert (report["samples_lost"], report["samples_repeated"], report["replicas_identical"]) == (0, 0, True)
        # the CLI's controller let the workers go: this one attaches them again
        state = job.state(cached_path=state_file)
        assert job.slurm_state() == "RUNNING"
        assert dict(state.trainers.extent) == {"hosts": 2}
        assert _use(state.trainers) == [2, 2]
    finally:
        job.kill(cached_path=state_file)
    wait_until(lambda: job.slurm_state({"job_id": job_id}) == "GONE" or "CANCELLED" in job.slurm_state({"job_id": job_id}),
               30, message="the Slurm job cancelled")


def test_bad_job_specs_are_clear_errors():
    with pytest.raises(ValueError, match="positive number of hosts"):
        LocalJob({"trainers": 0})
    with pytest.raises(ValueError, match="identifiers"):
        LocalJob({"my trainers": 1})
    with pytest.raises(ValueError, match="non-empty list"):
        SSHJob("gpu1")


def _controller_process(state_file: str) -> tuple[subprocess.Popen, dict]:
    """A controller of its own (a kernel) that applied a LocalJob of 2 hosts and uses them."""
    env = dict(os.environ, MONARCH_NB_HANG_TIMEOUT_S="1.0", MONARCH_NB_HEARTBEAT_INTERVAL_S="0.1")
    popen = subprocess.Popen([sys.executable, "-m", "tests.job_controller", state_file], cwd=REPO, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = popen.stdout.readline()
    assert line, f"the controller process failed (exit {popen.wait()})"
    return popen, json.loads(line)


@pytest.mark.parametrize("delay_s", [0.0, 0.6, 1.5])
def test_a_restarted_kernel_reattaches_its_job_at_any_moment_after_the_old_one_died(tmp_path, no_leaked_processes,
                                                                                       delay_s):
    """The kernel that applied the job is SIGKILLed; a new one calls job.state() ``delay_s`` later,
    before, around and after the hang timeout in which the old agents could still count on their
    controller: it attaches the same workers, and the dead controller's agents and procs are
    fenced (gone), never left serving beside the new ones."""
    state_file = str(tmp_path / "job_state.json")
    old, used = _controller_process(state_file)
    assert used["values"] == [2, 2]
    job = job_load(state_file)
    try:
        os.kill(old.pid, 9)
        old.wait()
        time.sleep(delay_s)
        again = LocalJob({"trainers": 2})
        state = again.state(cached_path=state_file)
        assert again.running["pids"] == job.running["pids"]  # the same workers, not a new allocation
        assert _use(state.trainers) == [2, 2]
        assert not any(pid_alive(p) for p in used["agents"] + used["procs"])
    finally:
        job.kill(cached_path=state_file)


def test_a_job_ended_through_another_object_leaves_no_host_behind(tmp_path, no_leaked_processes):
    """A kernel attaches a job with ``LocalJob(...).state()``, then ends it with
    ``job_load(path).kill()``: this controller forgets the job's hosts. (It kept them: their
    workers gone, it tried to attach them again every second, and took the next worker that
    listened at one of their ports, a later job's, which another controller was attaching.)"""
    from monarch_nb.runtime.controller import Controller
    from monarch_nb.supervision.records import ProcState

    state_file = str(tmp_path / "job_state.json")
    names = LocalJob({"trainers": 2}).state(cached_path=state_file).trainers.host_names
    ctrl = Controller.get()
    assert [ctrl.hosts[n].state for n in names] == [ProcState.HEALTHY] * 2
    job = job_load(state_file)
    pids = list(job.running["pids"])
    job.kill(cached_path=state_file)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 15, message="the job's workers gone")
    assert [n for n in names if n in ctrl.hosts or ctrl.host_agents.reattaching(n)] == []


def test_a_live_controller_keeps_its_hosts(tmp_path, no_leaked_processes):
    """Another controller asking for the hosts of a live one is refused, saying whose they are, and
    the live controller's procs serve on untouched."""
    state_file = str(tmp_path / "job_state.json")
    owner, used = _controller_process(state_file)
    job = job_load(state_file)
    try:
        with pytest.raises(AttachError, match=r"attached to another controller \(run \w+ \(pid \d+ on .*heard from"):
            LocalJob({"trainers": 2}).state(cached_path=state_file)
        assert all(pid_alive(p) for p in used["agents"] + used["procs"])
        owner.stdin.close()  # the owner exits normally: its hosts wait for the next controller
        owner.wait(30)
        assert _use(LocalJob({"trainers": 2}).state(cached_path=state_file).trainers) == [2, 2]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        job.kill(cached_path=state_file)


def test_one_worker_under_two_spellings_is_one_host(tmp_path, no_leaked_processes):
    """``tcp://localhost:P`` after ``tcp://127.0.0.1:P`` is the same host: attaching it again
    returns it, the first attach's procs keep serving (no stealing back and forth), and naming it
    twice in one mesh is refused."""
    from monarch_nb import attach_to_workers
    from monarch_nb.runtime.controller import Controller

    job = LocalJob({"trainers": 1})
    try:
        first = job.state(cached_path=None).trainers
        address = job.running["workers"]["trainers"][0]
        assert address.startswith("tcp://127.0.0.1:")
        procs = first.spawn_procs(per_host={"gpus": 1})
        counter = procs.spawn("c", Counter, 0)
        ctrl = Controller.get()
        agent, proc = ctrl.hosts[first.host_names[0]].pid, ctrl.proc_record(procs.name, 0).pid
        second = attach_to_workers([address.replace("127.0.0.1", "localhost")])
        assert second.host_names == first.host_names
        with pytest.raises(ValueError, match="the same worker"):
            attach_to_workers([address, address.replace("127.0.0.1", "localhost")])
        deadline = time.monotonic() + 3 * config.hang_timeout_s  # stealing showed within a couple of seconds
        while time.monotonic() < deadline:
            assert counter.incr.call_one().get(timeout=10) >= 1
            time.sleep(0.1)
        assert ctrl.hosts[first.host_names[0]].pid == agent and ctrl.proc_record(procs.name, 0).pid == proc
        procs.stop()
    finally:
        job.kill(cached_path=None)


def test_a_worker_logs_who_attaches_and_when_they_leave(no_leaked_processes):
    """An operator reading a worker's log sees each controller that attached (run, pid, machine,
    host name) and when and why it left."""
    from monarch_nb import attach_to_workers
    from monarch_nb.runtime.controller import Controller

    worker = subprocess.Popen([sys.executable, "-m", "monarch_nb.cli", "worker", "--address", "tcp://127.0.0.1:0"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
    try:
        address = json.loads(worker.stdout.readline())["address"]
        hosts = attach_to_workers([address])
        ctrl = Controller.get()
        Controller.get().detach_hosts(hosts.host_names)
        agent = ctrl.hosts.get(hosts.host_names[0])
        assert agent is None  # forgotten here; the worker says the controller left
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(worker.stderr.readline, "")), daemon=True)
        reader.start()
        wait_until(lambda: any("the controller stopped using this host" in line for line in lines), 15,
                   message="the departure logged")
        attached = next(line for line in lines if "attached to the controller of run" in line)
        assert f"run {ctrl.run_id} (pid {os.getpid()} on " in attached and f"as host {hosts.host_names[0]}" in attached
        left = next(line for line in lines if "left after" in line)
        assert f"run {ctrl.run_id}" in left and "waiting for a controller" in left
        assert all(line[:4].isdigit() and line[4] == "-" for line in (attached, left))  # timestamped
    finally:
        worker.terminate()
        worker.wait(10)
