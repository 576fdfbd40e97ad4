"""The control plane's cost as procs grow: real procs on this machine, the controller measured.

    python bench/scale.py [--procs 4,16,64,128] [--calls 50] [--idle-s 10] [--quick]

For each size N, in one run: N real procs on this host (one mesh, ``preload=()``: each a fresh
interpreter, as the issue's table was measured; no fork server) with a trivial actor, then:

- spawn -> first reply: from ``spawn_procs`` to the first call-to-all's answer (actor spawned);
- controller CPU, idle: the controller process's user+system CPU time (``getrusage``: every thread
  of this process: the IO thread that takes heartbeats, the supervisor, and this idle main
  thread) over ``--idle-s`` seconds while the procs sit idle, as % of one core; with the
  heartbeats received in that time (4 per proc per second), the CPU per heartbeat;
- call to all: ``actors.ping.call().get()`` round trips, p50/p95 over ``--calls``;
- SIGKILL seen: a rank's process killed (by pid) to its ``proc_exited`` event, one sample.

What this does not yet do (issue 25): simulated hosts (many host agents with many simulated
procs each, to reach 1,024 hosts x 8 procs on two cores), and a peer in the same run
(torchmonarch's figures on real hosts are Monarch PR #4875's; ipyparallel's broadcast is in
bench/actor_latency.py). Prints a table and writes bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import monarch_nb  # noqa: E402
from monarch_nb import Actor, endpoint  # noqa: E402
from monarch_nb.config import config  # noqa: E402
from monarch_nb.runtime.controller import Controller  # noqa: E402

RESULTS = ROOT / "bench" / "results"


class Ping(Actor):
    @endpoint
    def ping(self) -> int:
        return 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(n: int, calls: int, idle_s: float) -> dict:
    ctrl = Controller.get()
    t0 = time.perf_counter()
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": n})
    try:
        actors = procs.spawn("ping", Ping)
        actors.ping.call().get(timeout=600)
        spawn_s = time.perf_counter() - t0
        time.sleep(2.0)  # the spawn's after-effects (imports finishing, first heartbeats) settle
        heartbeats = n * idle_s / config.heartbeat_interval_s
        cpu0, w0 = _cpu_s(), time.perf_counter()
        time.sleep(idle_s)
        cpu, wall = _cpu_s() - cpu0, time.perf_counter() - w0
        rtts = []
        for _ in range(calls):
            c0 = time.perf_counter()
            actors.ping.call().get(timeout=60)
            rtts.append(time.perf_counter() - c0)
        victim = ctrl.proc_record(procs.name, n - 1)
        since = ctrl.events.next_seq
        k0 = time.perf_counter()
        os.kill(victim.pid, signal.SIGKILL)
        seen = ctrl.events.wait_for(lambda e: e.kind == "proc_exited" and e.rank == n - 1, 30, since)
        kill_s = time.perf_counter() - k0 if seen is not None else float("nan")
    finally:
        procs.stop()
    return {"procs": n, "spawn_to_first_reply_s": spawn_s, "controller_cpu_idle_pct": 100 * cpu / wall,
            "cpu_per_heartbeat_us": 1e6 * cpu / heartbeats if heartbeats else float("nan"),
            "call_all_p50_ms": 1e3 * statistics.median(rtts), "call_all_p95_ms": 1e3 * _pct(rtts, 0.95),
            "sigkill_seen_ms": 1e3 * kill_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", default="4,16,64,128", help="comma-separated sizes (default 4,16,64,128)")
    p.add_argument("--calls", type=int, default=50, help="call-to-all samples per size (default 50)")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measurement (default 10)")
    p.add_argument("--quick", action="store_true", help="sizes 4,16,64; 20 calls; 5 s idle")
    args = p.parse_args(argv)
    if args.quick:
        args.procs, args.calls, args.idle_s = "4,16,64", 20, 5.0
    rows = [measure(int(n), args.calls, args.idle_s) for n in args.procs.split(",")]
    Controller.get().shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"host": os.uname().nodename, "cores": os.cpu_count(), "rows": rows}
    (RESULTS / "scale.json").write_text(json.dumps(out, indent=1))
    print(f"{'procs':>6} {'spawn->reply s':>15} {'ctrl CPU idle %':>16} {'us/heartbeat':>13} {'call-all p50 ms':>16} "
          f"{'p95 ms':>8} {'SIGKILL seen ms':>16}")
    for r in rows:
        print(f"{r['procs']:>6} {r['spawn_to_first_reply_s']:>15.2f} {r['controller_cpu_idle_pct']:>16.1f} "
              f"{r['cpu_per_heartbeat_us']:>13.0f} {r['call_all_p50_ms']:>16.2f} {r['call_all_p95_ms']:>8.2f} "
              f"{r['sigkill_seen_ms']:>16.1f}")
    print(f"JSON: {RESULTS / 'scale.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
