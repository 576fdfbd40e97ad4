"""SlurmJob: worker loops started by ``srun`` in an ``sbatch`` allocation; addresses announced in files."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import uuid

from .base import Job, read_announcement

__all__ = ["SlurmJob"]

_LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


class SlurmJob(Job):
    """Submit worker loops to Slurm with ``sbatch``; attach them once they run; ``scancel`` to kill.

    One Slurm task runs one worker loop, which is one host of a mesh; tasks are placed
    ``ntasks_per_node`` per node. Each worker announces its address in a file under ``log_dir``
    (a folder every node and this machine share).

    Args:
        meshes: mesh name -> number of hosts (tasks), e.g. ``{"trainers": 4}``.
        gpus_per_node: ``--gpus-per-node`` (None: not requested).
        partition, time_limit (``HH:MM:SS``), job_name: as sbatch takes them.
        ntasks_per_node: worker loops per node (1 for one host agent per machine).
        ca: the cluster's key folder or file (at the same path on every node).
        python: the interpreter on the nodes.
        port: the port each worker listens on (0: any free port, announced).
        worker_host: the address a worker listens on (default: the node's hostname).
        log_dir: shared folder for the batch script, Slurm's output and the announcements.
        sbatch_args: further sbatch options.

    Example::

        job = SlurmJob({"trainers": 2}, gpus_per_node=8, partition="mi300", time_limit="02:00:00",
                       ca="/shared/monarch-keys")
        procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})
    """

    def __init__(self, meshes: dict[str, int], gpus_per_node: int | None = None, partition: str | None = None,
                 time_limit: str | None = None, job_name: str = "monarch_nb", ntasks_per_node: int = 1,
                 ca: str | None = None, python: str = sys.executable, port: int = 0, worker_host: str | None = None,
                 log_dir: str = ".monarch/slurm", sbatch_args: list[str] | tuple = (), start_timeout_s: float = 600.0):
        super().__init__(meshes, ca, start_timeout_s)
        self.gpus_per_node, self.partition, self.time_limit, self.job_name = gpus_per_node, partition, time_limit, job_name
        self.ntasks_per_node, self.python, self.port, self.worker_host = ntasks_per_node, python, port, worker_host
        self.log_dir, self.sbatch_args = os.path.abspath(log_dir), list(sbatch_args)

    def spec(self) -> dict:
        return {"meshes": self.meshes, "gpus_per_node": self.gpus_per_node, "partition": self.partition,
                "time_limit": self.time_limit, "job_name": self.job_name, "ntasks_per_node": self.ntasks_per_node,
                "ca": self.ca, "python": self.python, "port": self.port, "worker_host": self.worker_host,
                "log_dir": self.log_dir, "sbatch_args": self.sbatch_args, "start_timeout_s": self.start_timeout_s}

    def script(self, announce_dir: str) -> str:
        """The batch script (one ``srun`` of all the worker loops)."""
        tasks = sum(self.meshes.values())
        nodes = -(-tasks // self.ntasks_per_node)
        lines = ["#!/bin/bash", f"#SBATCH --job-name={self.job_name}", f"#SBATCH --nodes={nodes}",
                 f"#SBATCH --ntasks={tasks}", f"#SBATCH --ntasks-per-node={self.ntasks_per_node}",
                 f"#SBATCH --output={self.log_dir}/%j.out"]
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        if self.time_limit:
            lines.append(f"#SBATCH --time={self.time_limit}")
        if self.gpus_per_node:
            lines.append(f"#SBATCH --gpus-per-node={self.gpus_per_node}")
        host = shlex.quote(self.worker_host) if self.worker_host else "$(hostname)"
        trust = ""
        if self.ca:
            trust = f" {'--curve-keys' if os.path.isdir(self.ca) else '--key-file'} {shlex.quote(self.ca)}"
        worker = (f"exec {shlex.quote(self.python)} -m monarch_nb.cli worker --address tcp://{host}:{self.port}{trust}"
                  f" --name $(hostname)-$SLURM_PROCID --announce {shlex.quote(announce_dir)}/worker-$SLURM_PROCID.json")
        lines.append(f"srun --kill-on-bad-exit=0 bash -c {shlex.quote(worker)}")
        return "\n".join(lines) + "\n"

    def _start(self) -> dict:
        announce_dir = os.path.join(self.log_dir, f"announce-{uuid.uuid4().hex[:12]}")
        os.makedirs(announce_dir, exist_ok=True)
        path = os.path.join(self.log_dir, f"{os.path.basename(announce_dir)}.sh")
        with open(path, "w") as f:
            f.write(self.script(announce_dir))
        try:
            out = subprocess.run(["sbatch", "--parsable", *self.sbatch_args, path], capture_output=True, text=True,
                                 check=True, timeout=60)
        except FileNotFoundError:
            raise RuntimeError("sbatch is not on PATH: run this where Slurm's client tools are installed") from None
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"sbatch refused the job: {exc.stderr.strip()}") from None
        return {"job_id": out.stdout.strip().split(";")[0], "announce_dir": announce_dir}

    def slurm_state(self, running: dict | None = None) -> str:
        """The allocation's Slurm state (``PENDING``, ``RUNNING``, ...; ``GONE`` once squeue forgot it)."""
        running = running or self.running
        if running is None:
            return "GONE"
        out = subprocess.run(["squeue", "-h", "-j", running["job_id"], "-o", "%T"], capture_output=True, text=True,
                             timeout=60)
        return out.stdout.strip() or "GONE"

    def _alive(self, running: dict) -> bool:
        return self.slurm_state(running) in _LIVE_STATES

    def _workers(self, running: dict, deadline: float) -> dict[str, list[str]]:
        total = sum(self.meshes.values())
        files = [os.path.join(running["announce_dir"], f"worker-{i}.json") for i in range(total)]
        while not all(os.path.exists(f) for f in files):
            state = self.slurm_state(running)
            if state not in _LIVE_STATES:
                raise RuntimeError(f"Slurm job {running['job_id']} is {state} before its workers started; see "
                                   f"{self.log_dir}/{running['job_id']}.out")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {running['job_id']} ({state}): {sum(map(os.path.exists, files))} of "
                                   f"{total} workers announced within {self.start_timeout_s} s")
            time.sleep(0.2)
        addresses = iter([read_announcement(open(f).read())["address"] for f in files])
        return {mesh: [next(addresses) for _ in range(count)] for mesh, count in self.meshes.items()}

    def _kill(self, running: dict) -> None:
        subprocess.run(["scancel", running["job_id"]], capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while self._alive(running) and time.monotonic() < deadline:
            time.sleep(0.2)
