"""A controller in a process of its own, as a kernel would be: ``python -m tests.job_controller
STATE_FILE [HOSTS]`` applies (or re-attaches) a LocalJob of HOSTS hosts, spawns one proc per host,
prints one JSON line ``{"agents", "procs", "values"}`` (pids, and a call's results), then serves
until stdin closes. Tests SIGKILL it to play a kernel that died."""

from __future__ import annotations

import json
import sys

from monarch_nb.job import LocalJob
from monarch_nb.runtime.controller import Controller

from .actors import Counter


def main() -> None:
    state_file, hosts = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    job = LocalJob({"trainers": hosts})
    state = job.state(cached_path=state_file)
    procs = state.trainers.spawn_procs(per_host={"gpus": 1})
    values = procs.spawn("c", Counter, 1).incr.call().get(timeout=60).values()
    ctrl = Controller.get()
    agents = [ctrl.hosts[h].pid for h in state.trainers.host_names]
    pids = [ctrl.proc_record(procs.name, r).pid for r in range(hosts)]
    print(json.dumps({"agents": agents, "procs": pids, "values": values}), flush=True)
    sys.stdin.read()  # until the test closes it (or kills this process)


if __name__ == "__main__":
    main()
