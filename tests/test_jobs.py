"""Jobs start worker loops and hand back host meshes: LocalJob, SSHJob through a real sshd in a
network namespace, SlurmJob through a real slurmctld + slurmd (scripts/slurm-local.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from monarch_nb.job import LocalJob, SlurmJob, SSHJob, job_load
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
