"""Sharded training: ``monarch_nb``'s FSDP-in-groups (HSDP) vs torch's native HSDP and plain FSDP2.

    .venv/bin/python bench/sharded.py [--quick] [--workload llama-small|charlm|digits|llama] [--repeats 3] [--kills 6]

One workload: by default ``llama-small``, transformers' LlamaForCausalLM at the benchmark's size
(3,033,344 parameters: 4 layers of 256, GQA 8/4 heads, byte vocabulary, context 64; ~0.4 s a
step here); ``llama``, the tests' tiny size (106,816 parameters); or the built-in ``charlm``, a
small transformer of tens of ms a step, where the fixed cost per step of fault tolerance shows
most. The same model, seed, sample order and global batch everywhere, 4 ranks on this machine, measured in
this one run:

1. steady state over the last half of each run's steps (samples/s), interleaved (the order
   reversed every other repeat), ``--repeats`` each; the ratio is the median of the repeats'
   ft / native HSDP ratios (each pair ran back to back, so a drift of the shared machine's speed
   cancels), the ratio of the medians beside it: ``mt.fit(workload, group_size=2,
   parallelism="fsdp")`` (2 replicas x 2 shards, fault tolerant; from the controller's commit times of the steps); torch's native HSDP
   (``fully_shard`` on a ``(replicate=2, shard=2)`` mesh under ``torchrun``, bench/_hsdp_train.py;
   from rank 0's times after each step); plain FSDP2 over the 4 ranks under ``torchrun``;
   and the CPU time per step over the same steps (user + system, of every process of the run:
   ft's controller, host agent, workers, spares and fork server from /proc at the commits; each
   native rank's ``time.process_time()``): the machine's other tenants move wall time much more
   than CPU time;
2. memory per rank: peak RSS of every worker (``ru_maxrss``), both sides, each job ending with
   the test set's loss (a run's final evaluation);
3. ``--kills`` SIGKILLs of a shard holder during one long sharded run, one at a time (each once
   every rank is back and the spare pool is full; 2 spares, so a whole group restarts warm): the
   survivors' next commit after the kill, the group's rejoin (both ranks healed shard by shard),
   p50 / p95, the heal bytes and milliseconds per rank; samples lost or repeated (the ledger).

torchft 0.2.0 is not measured: it ships no HSDP integration that runs on CPU (its
``fsdp_test.py`` drives ``fully_shard`` with an all-reduce hook on the Manager's group and is
skipped without 4 CUDA GPUs; its device-mesh wrapper ``ft_init_device_mesh`` is gone), and the
pattern it shows runs the cross-group all-reduce inside FSDP's post-backward hook, where a peer's
death is an exception inside autograd.

torchrun's store listens on every interface: those jobs run in a private network namespace
(``unshare -n``) with only loopback, when there is one. Prints a table and writes
bench/results/sharded.json (another workload: sharded-<workload>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
RESULTS = os.path.join(REPO, "bench", "results", "sharded.json")
HSDP_SCRIPT = os.path.join(REPO, "bench", "_hsdp_train.py")
PROCS, GROUP = 4, 2

from _hsdp_train import bench_workload  # noqa: E402
from own_loop import _steady, wait_whole  # noqa: E402
from training import _free_port, _netns_prefix, _pct  # noqa: E402


def run_ft(workload: str, steps: int, seed: int) -> dict:
    """A fault-free sharded run; steady samples/s from the controller's commit time of each step."""
    import monarch_nb.train as mt

    commits: dict[int, float] = {}
    cpu_at: dict[int, float] = {}  # step -> CPU seconds of this process and its descendants at its commit

    def on_metric(m: dict) -> None:
        if m.get("type") == "step":
            commits[m["step"]] = m["time_s"]
            cpu_at[m["step"]] = cpu_at.get(m["step"] - 1, 0.0) if m["time_s"] == commits.get(m["step"] - 1) else _tree_cpu_s()

    run = mt.start(bench_workload(workload, seed), procs=PROCS, steps=steps, group_size=GROUP, parallelism="fsdp",
                   eval_every=0, seed=seed)
    run.subscribe(on_metric)
    report = run.report(timeout=1800)
    order = sorted(commits)
    steady = _steady([commits[s] for s in order], [report.global_batch] * len(order))
    first, last = (order[i] for i in steady["span"])
    return {**steady, "cpu_ms_per_step": 1e3 * (cpu_at[last] - cpu_at[first]) / (last - first),
            "replicas_identical": report.replicas_identical, "peak_rss_bytes": report.worker_peak_rss_bytes,
            "step_ms_report_median": report.step_time_ms_median}


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process (the controller) and every live descendant
    (host agent, workers, spares, fork server), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # it exited meanwhile
                continue
            parent[int(entry)] = int(fields[1])
            used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    mine, grew = {os.getpid()}, True
    while grew:  # until no process has a parent among them
        grew = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    return sum(used.get(pid, 0.0) for pid in mine)


def run_native(workload: str, steps: int, seed: int, group_size: int) -> dict:
    """torch's HSDP (``group_size`` < world) or plain FSDP2 (``group_size`` == world) under torchrun."""
    work = tempfile.mkdtemp(prefix="sharded-native-")
    out = os.path.join(work, "summary.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(PROCS),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts", "0",
           HSDP_SCRIPT, "--workload", workload, "--steps", str(steps), "--seed", str(seed),
           "--group-size", str(group_size), "--out", out, "--evaluate"]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", LOGLEVEL="ERROR", TMPDIR=work, GLOO_SOCKET_IFNAME="lo")
    try:
        proc = subprocess.run(_netns_prefix() + cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.load(open(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    times = summary["times"]
    steady = _steady(times, [summary["global_batch"]] * len(times))
    first, last = steady["span"]
    cpu_s = sum(rank[last] - rank[first] for rank in summary["cpu_s"])
    return {**steady, "cpu_ms_per_step": 1e3 * cpu_s / (last - first), "peak_rss_bytes": summary["peak_rss_bytes"]}


def kills(workload: str, n: int, seed: int) -> dict:
    """``n`` SIGKILLs of a shard holder during one long sharded run, one at a time."""
    import monarch_nb.train as mt

    run = mt.start(bench_workload(workload, seed), procs=PROCS, steps=10_000_000, group_size=GROUP,
                   parallelism="fsdp", eval_every=0, seed=seed, spares=GROUP)
    commits: list[tuple[float, float]] = []  # (when the controller committed a step (monotonic), its step_ms)
    run.subscribe(lambda item: commits.append((time.monotonic(), item["step_ms"] or 0.0))
                  if item.get("type") == "step" else None)
    overhead = []
    try:
        deadline = time.monotonic() + 300
        while run.step < 20 and time.monotonic() < deadline and not run.done():
            time.sleep(0.05)
        for i in range(n):
            rank = [1, 2, 3, 0][i % PROCS]
            wait_whole(run, PROCS, GROUP, time.monotonic() + 600)  # a whole group can restart warm
            time.sleep(0.3)  # a few steps of the full quorum first
            seen = len(run._coordinator.m.failures)
            killed_at = time.monotonic()
            run.procs.inject(rank, "kill")
            while not run.done() and not any(f.rejoined_at for f in run._coordinator.m.failures[seen:]
                                              if f.kind == "kill"):
                time.sleep(0.05)
            after = [(t, ms) for t, ms in commits if t > killed_at]
            if after:  # the next commit less the time that step itself took on the survivors
                overhead.append(after[0][0] - killed_at - after[0][1] / 1e3)
    finally:
        run.stop(timeout=60)
    report = run.report(timeout=10)
    killed = [f for f in report.failures if f["kind"] == "kill"]
    group = [f for f in report.failures if f["kind"] == "group"]
    resume = [f["resume_latency_s"] for f in killed if f["resume_latency_s"] is not None]
    rejoin = [max(f["rejoin_latency_s"] or 0, g["rejoin_latency_s"] or 0) for f, g in zip(killed, group)]
    heals = [f for f in report.failures if f["heal_ms"] is not None]
    return {"kills": len(killed), "resume_s": resume, "rejoin_s": rejoin,
            "resume_p50_s": _pct(resume, 0.5), "resume_p95_s": _pct(resume, 0.95),
            "resume_less_survivors_step_s": overhead, "resume_less_step_p50_s": _pct(overhead, 0.5),
            "resume_less_step_p95_s": _pct(overhead, 0.95),
            "rejoin_p50_s": _pct(rejoin, 0.5), "rejoin_p95_s": _pct(rejoin, 0.95),
            "heal_bytes_per_rank": statistics.median(f["heal_bytes"] for f in heals) if heals else None,
            "heal_ms_p50": _pct([f["heal_ms"] for f in heals], 0.5), "heal_ms_p95": _pct([f["heal_ms"] for f in heals], 0.95),
            "samples_lost": report.samples_lost, "samples_repeated": report.samples_repeated,
            "replicas_identical": report.replicas_identical, "groups_taken_out": len(group)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, 1 repeat, 2 kills")
    p.add_argument("--workload", choices=("llama-small", "charlm", "digits", "llama"), default="llama-small",
                   help="llama: the tests' tiny Llama (106,816 parameters); llama-small: 3,033,344")
    p.add_argument("--steps", type=int,
                   help="steps of each steady run (default 100 llama-small, 300 charlm and llama, 1500 digits; quick: 40 / 120)")
    p.add_argument("--repeats", type=int, help="steady runs of each runtime (median; default 5, quick 1)")
    p.add_argument("--kills", type=int, help="SIGKILLs of a shard holder (default 6, quick 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    steps = args.steps or ({"llama-small": 40}.get(args.workload, 120) if args.quick else
                           {"charlm": 300, "llama": 300, "llama-small": 100, "digits": 1500}[args.workload])
    repeats = args.repeats or (1 if args.quick else 5)
    n_kills = args.kills if args.kills is not None else (2 if args.quick else 6)

    from tqdm import tqdm

    runners = {"ft_hsdp": lambda: run_ft(args.workload, steps, args.seed),
               "native_hsdp": lambda: run_native(args.workload, steps, args.seed, GROUP),
               "native_fsdp2": lambda: run_native(args.workload, steps, args.seed, PROCS)}
    rows: dict[str, list] = {k: [] for k in runners}
    with tqdm(total=repeats * 3, desc="steady runs", unit="run") as bar:
        for i in range(repeats):  # interleaved, the order reversed every other repeat: a drift of
            for name in (list(runners) if i % 2 == 0 else list(runners)[::-1]):  # the machine's speed
                rows[name].append(runners[name]())                                # favours neither side
                bar.update()
    med = {k: statistics.median(r["throughput_samples_per_s"] for r in v) for k, v in rows.items()}
    peak = {k: statistics.median(max(r["peak_rss_bytes"]) for r in v) for k, v in rows.items()}
    cpu = {k: statistics.median(r["cpu_ms_per_step"] for r in v) for k, v in rows.items()}
    pairs = [a["throughput_samples_per_s"] / b["throughput_samples_per_s"] for a, b in zip(rows["ft_hsdp"], rows["native_hsdp"])]
    result = {
        "workload": args.workload, "procs": PROCS, "group_size": GROUP, "steps": steps, "repeats": repeats,
        "steady_samples_per_s": med, "ratio_vs_native_hsdp": statistics.median(pairs),
        "ratio_of_medians_vs_native_hsdp": med["ft_hsdp"] / med["native_hsdp"], "per_run_ratios": pairs,
        "cpu_ms_per_step": cpu, "cpu_ratio_vs_native_hsdp": statistics.median(
            a["cpu_ms_per_step"] / b["cpu_ms_per_step"] for a, b in zip(rows["ft_hsdp"], rows["native_hsdp"])),
        "peak_rss_bytes_max_rank": peak, "memory_ratio_vs_native_hsdp": peak["ft_hsdp"] / peak["native_hsdp"],
        "runs": rows, "torchft": "not measured: no HSDP integration of torchft 0.2.0 runs on CPU (see the docstring)",
    }
    if n_kills:
        result["kills"] = kills(args.workload, n_kills, args.seed)
    path = RESULTS if args.workload == "llama-small" else RESULTS.replace(".json", f"-{args.workload}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    _print(result)
    print(f"written to {path}")
    return 0


def _print(r: dict) -> None:
    s, m = r["steady_samples_per_s"], r["peak_rss_bytes_max_rank"]
    print(f"\nsharded {r['workload']}: {r['procs']} ranks, groups of {r['group_size']}, median of {r['repeats']} run(s)\n")
    print(f"{'measure':44} {'ft HSDP':>10} {'native HSDP':>12} {'FSDP2':>10}   ratio / target")
    ratios = " ".join(f"{x:.2f}" for x in r["per_run_ratios"])
    print(f"{'steady (samples/s)':44} {s['ft_hsdp']:10.0f} {s['native_hsdp']:12.0f} {s['native_fsdp2']:10.0f}   "
          f"{r['ratio_vs_native_hsdp']:.3f}x / >= 0.95 (median of the per-repeat ratios {ratios}; "
          f"ratio of medians {r['ratio_of_medians_vs_native_hsdp']:.3f}x)")
    c = r["cpu_ms_per_step"]
    print(f"{'CPU per step, all processes (ms)':44} {c['ft_hsdp']:10.1f} {c['native_hsdp']:12.1f} {c['native_fsdp2']:10.1f}   "
          f"{r['cpu_ratio_vs_native_hsdp']:.3f}x (median of the per-repeat ratios)")
    print(f"{'peak RSS, largest rank (MiB)':44} {m['ft_hsdp'] / 2**20:10.0f} {m['native_hsdp'] / 2**20:12.0f} "
          f"{m['native_fsdp2'] / 2**20:10.0f}   {r['memory_ratio_vs_native_hsdp']:.3f}x / <= 1.10")
    k = r.get("kills")
    if k:
        print(f"{'kill of a shard holder: next commit p50/p95 (s)':44} {k['resume_p50_s']:.3f} / {k['resume_p95_s']:.3f}"
              f"   n={k['kills']}, target p95 <= 0.5")
        if k.get("resume_less_step_p50_s") is not None:
            print(f"{'  less the redone step itself p50/p95 (s)':44} {k['resume_less_step_p50_s']:.3f} / "
                  f"{k['resume_less_step_p95_s']:.3f}   (the step, redone on half the ranks, is in the above)")
        print(f"{'group rejoined (2 ranks healed) p50/p95 (s)':44} {k['rejoin_p50_s']:.3f} / {k['rejoin_p95_s']:.3f}"
              "   target p95 <= 2 (spares)")
        print(f"{'heal per rank: bytes, ms p50/p95':44} {k['heal_bytes_per_rank']:.0f} B, {k['heal_ms_p50']:.1f} / "
              f"{k['heal_ms_p95']:.1f} ms")
        print(f"{'samples lost / repeated, identical':44} {k['samples_lost']} / {k['samples_repeated']}, "
              f"{k['replicas_identical']}")
    print(f"torchft: {r['torchft']}")


if __name__ == "__main__":
    raise SystemExit(main())
