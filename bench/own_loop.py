"""Your own training loop: ``monarch_nb.ft`` vs the same loop under plain DDP and under torchft.

    .venv/bin/python bench/own_loop.py [--quick] [--kills 10] [--repeats 3]

One user loop (bench/_user_loop.py: the same model, optimizer, loss and samples of each step),
three runtimes, measured in this one run, 4 ranks on this machine:

1. steady state, digits (an MLP: ~1 ms of compute a step, so per-step overheads show) and
   charlm (a small transformer, tens of ms a step), over the last half of each run's steps, from
   the loop's own times after each step on one rank: samples/s of ``mt.start(loop)`` with ``ft``;
   of the loop under ``torchrun`` + ``DistributedDataParallel`` (no fault tolerance); of the loop
   under torchft 0.2.0 (a lighthouse, 4 replica groups of one process, its DDP and Optimizer
   wrapper, ProcessGroupGloo; in the peers' venv). Runs interleaved, ``--repeats`` each (median).
2. kills during the ``ft`` run: ``--kills`` SIGKILLs, one at a time (each once every rank is
   back): the survivors' next commit after the kill, and the rank's rejoin (warm spares), p50 /
   p95, each kill once the spare pool has refilled (a rank that finds no spare starts a fresh
   interpreter: seconds on this machine); samples lost or repeated (the ledger). torchft: one SIGKILL of a replica group, with its
   default heartbeat timeout (5 s) and with 1 s: the survivors' next commit after it, and the
   samples never trained (a missing group's part of each step).

torchrun's store and torchft's servers listen on every interface: those jobs run in a private
network namespace (``unshare -n``) with only loopback, when there is one. Prints a table and
writes bench/results/own_loop.json. torchft is installed in bench/.peers-venv on first use
(PyPI); without it its rows say "not measured".
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
RESULTS = os.path.join(REPO, "bench", "results", "own_loop.json")
USER_LOOP = os.path.join(REPO, "bench", "_user_loop.py")

from training import _free_port, _netns_prefix, _pct  # noqa: E402


def _digits_npz(folder: str) -> str:
    """The digits workload's training split, as arrays the peers' venv can read (no scikit-learn)."""
    import numpy as np

    from monarch_nb.train.workloads import DigitsWorkload

    x, y, _tx, _ty = DigitsWorkload(0)._arrays
    path = os.path.join(folder, "digits.npz")
    np.savez(path, x=x, y=y)
    return path


def _paths(folder: str) -> dict[str, str]:
    from monarch_nb.train.workloads import default_text_path

    return {"digits": _digits_npz(folder), "charlm": default_text_path()}


BATCH = {"digits": 64, "charlm": 32}


def run_ft(kind: str, path: str, steps: int, procs: int) -> dict:
    import monarch_nb.train as mt
    from _user_loop import ft_loop

    work = tempfile.mkdtemp(prefix="own-loop-ft-")
    out = os.path.join(work, "times.json")
    try:
        report = mt.fit(ft_loop, procs=procs, args=(kind, path, steps, BATCH[kind], 0.0, out), eval_every=0,
                        progress=False)
        times = json.load(open(out))["times"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**_steady(times, [BATCH[kind]] * len(times)), "report_throughput_samples_per_s": report.throughput_samples_per_s,
            "replicas_identical": report.replicas_identical, "samples_lost": report.samples_lost}


def _steady(times: list[float], samples: list[int]) -> dict:
    """Samples/s and the step time over the last half of a run, from the wall times after each
    step of one rank and the samples each step trained: the same measure for ``ft``, DDP and
    torchft. The first half (warm-up; a warm spare or a lighthouse still starting on these 2
    cores) is not counted, nor the samples of the half's first step (its start is not timed).

    An ``ft`` run's times are its steps' commit times, which come a window at a time (every step
    of a window has its reply's time): the span then starts at the end of a window, so it holds
    whole windows only (from anywhere inside a window it would count steps done before its start:
    up to a window too many, ~5 % of 150 steps of 8-step windows). ``step_ms_median`` is the
    median of the times between steps where each step has its own (None for windowed times);
    ``step_ms_mean`` is the span over its steps; ``span`` its first and last step's indices.

    Raises:
        ValueError: the last half holds no whole window after its first.
    """
    start = len(times) // 2
    while start + 1 < len(times) and times[start + 1] == times[start]:
        start += 1  # inside a window: move to its last step
    if start + 1 >= len(times):
        raise ValueError(f"the last half of {len(times)} steps holds no whole window: run more steps")
    span = [start, len(times) - 1]  # the span's first and last step (indices into the run's steps)
    times, samples = times[start:], samples[start:]
    wall = times[-1] - times[0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"throughput_samples_per_s": sum(samples[1:]) / wall, "step_ms_mean": wall / (len(times) - 1) * 1e3,
            "step_ms_median": statistics.median(gaps) * 1e3 if all(gaps) else None, "span": span}


def run_ddp(kind: str, path: str, steps: int, procs: int) -> dict:
    work = tempfile.mkdtemp(prefix="own-loop-ddp-")
    out = os.path.join(work, "summary.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts", "0",
           USER_LOOP, "ddp", "--data", kind, "--path", path, "--steps", str(steps), "--batch-size", str(BATCH[kind]),
           "--out", out]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", LOGLEVEL="ERROR", TMPDIR=work)
    try:
        proc = subprocess.run(_netns_prefix() + cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        times = json.load(open(out))["times"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _steady(times, [BATCH[kind]] * len(times))


def _peers_python() -> str | None:
    """The peers' venv python, with torchft installed (PyPI, once); None if it cannot be had."""
    from _peers import ensure_peers_venv

    python = ensure_peers_venv()
    if python is None:
        return None
    probe = subprocess.run([str(python), "-c", "import torchft"], capture_output=True)
    if probe.returncode != 0:
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "torchft"]
        if subprocess.run(pip, capture_output=True).returncode != 0:
            print("torchft: could not install it in the peers' venv", file=sys.stderr)
            return None
    return str(python)


def run_torchft(python: str, kind: str, path: str, steps: int, groups: int, *, kill_at: int = -1,
                heartbeat_timeout_ms: int = 5000) -> dict | None:
    work = tempfile.mkdtemp(prefix="own-loop-torchft-")
    out = os.path.join(work, "summary.json")
    cmd = [python, USER_LOOP, "torchft-driver", "--data", kind, "--path", path, "--steps", str(steps),
           "--batch-size", str(BATCH[kind]), "--groups", str(groups), "--kill-at", str(kill_at), "--kill-group", "2",
           "--heartbeat-timeout-ms", str(heartbeat_timeout_ms), "--out", out]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", RUST_LOG="warn", TMPDIR=work)
    try:
        proc = subprocess.run(_netns_prefix() + cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"torchft run failed ({proc.returncode}): {proc.stderr[-1500:]}", file=sys.stderr)
            return None
        summary = json.load(open(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    records = summary["groups"].get("0") or next(iter(summary["groups"].values()))
    committed = [r for r in records if r[3]]
    per_group = BATCH[kind] // groups
    result = {**_steady([r[0] for r in committed], [r[2] * per_group for r in committed]),
              "samples_lost": sum((groups - r[2]) * per_group for r in committed)}
    if summary["kill_time"] is not None:
        after = [r for r in committed if r[0] > summary["kill_time"]]
        result["next_commit_after_kill_s"] = after[0][0] - summary["kill_time"] if after else None
    return result


def wait_whole(run, procs: int, spares: int, deadline: float) -> None:
    """Until every one of ``procs`` ranks of ``run`` is live and serving and at least ``spares``
    warm spares are ready (the pool refilled), the run ends, or ``time.monotonic()`` passes
    ``deadline``."""
    from monarch_nb.runtime.controller import Controller

    ctrl = Controller.get()
    while time.monotonic() < deadline and not run.done():
        pool = [sp for h in ctrl.hosts.values() for sp in h.spares.get(run.mesh_name, [])]
        if (len(run.live_ranks) == procs and all(ctrl.proc_record(run.mesh_name, r).serving for r in range(procs))
                and len(pool) >= spares and all(sp["ready"] for sp in pool)):
            return
        time.sleep(0.05)


def kills_during_ft(kind: str, path: str, procs: int, kills: int) -> dict:
    """``kills`` SIGKILLs during one long ``ft`` run, one at a time, each once every rank is back."""
    import monarch_nb.train as mt
    from _user_loop import ft_loop

    run = mt.start(ft_loop, procs=procs, args=(kind, path, 10_000_000, BATCH[kind]), eval_every=0)
    try:
        deadline = time.monotonic() + 300
        while run.step < 20 and time.monotonic() < deadline and not run.done():
            time.sleep(0.05)
        for i in range(kills):
            rank = 1 + i % (procs - 1)
            wait_whole(run, procs, 1, time.monotonic() + 600)
            time.sleep(0.3)  # a few steps of the full quorum first
            run.procs.inject(rank, "kill")
            while not run.done() and not any(f.kind == "kill" and f.rejoined_at for f in run._coordinator.m.failures[i:]):
                time.sleep(0.05)
    finally:
        run.stop(timeout=30)
    report = run.report(timeout=5)
    resume = [f["resume_latency_s"] for f in report.failures if f["resume_latency_s"] is not None]
    rejoin = [f["rejoin_latency_s"] for f in report.failures if f["rejoin_latency_s"] is not None]
    return {"kills": len(report.failures), "resume_s": resume, "rejoin_s": rejoin,
            "resume_p50_s": _pct(resume, 0.5), "resume_p95_s": _pct(resume, 0.95),
            "rejoin_p50_s": _pct(rejoin, 0.5), "rejoin_p95_s": _pct(rejoin, 0.95),
            "samples_lost": report.samples_lost, "samples_repeated": report.samples_repeated,
            "replicas_identical": report.replicas_identical}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, 1 repeat, 4 kills")
    p.add_argument("--repeats", type=int, help="steady-state runs of each runtime (median; default 3, quick 1)")
    p.add_argument("--kills", type=int, help="SIGKILLs during the ft run (default 10, quick 4)")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--steady-only", action="store_true", help="only the steady-state rows (no kills)")
    p.add_argument("--data", choices=("digits", "charlm"), action="append", help="steady state of this workload only (repeatable)")
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    kills = args.kills or (4 if args.quick else 10)
    steps = {"digits": 300 if args.quick else 1500, "charlm": 60 if args.quick else 150}
    torchft_kill_steps = 600 if args.quick else 1200  # the kill at a quarter: its effect, not a steady state
    folder = tempfile.mkdtemp(prefix="own-loop-bench-")
    results: dict = {"procs": args.procs, "cores": os.cpu_count(), "repeats": repeats, "steady": {}}
    try:
        paths = _paths(folder)
        peers = _peers_python()
        for kind in args.data or ("digits", "charlm"):
            rows: dict = {"ft": [], "ddp": [], "torchft": []}
            for _ in range(repeats):
                rows["ft"].append(run_ft(kind, paths[kind], steps[kind], args.procs))
                rows["ddp"].append(run_ddp(kind, paths[kind], steps[kind], args.procs))
                if peers is not None:
                    tf = run_torchft(peers, kind, paths[kind], steps[kind], args.procs)
                    if tf is not None:
                        rows["torchft"].append(tf)
                print(f"{kind}: ft {rows['ft'][-1]['throughput_samples_per_s']:.0f}, ddp "
                      f"{rows['ddp'][-1]['throughput_samples_per_s']:.0f}, torchft "
                      f"{rows['torchft'][-1]['throughput_samples_per_s'] if rows['torchft'] else float('nan'):.0f} "
                      "samples/s", flush=True)
            med = {k: statistics.median(r["throughput_samples_per_s"] for r in v) if v else None for k, v in rows.items()}
            pairs = [a["throughput_samples_per_s"] / b["throughput_samples_per_s"] for a, b in zip(rows["ft"], rows["ddp"])]
            results["steady"][kind] = {"runs": rows, "median": med,
                                       "ft_vs_ddp": med["ft"] / med["ddp"],
                                       "ft_vs_ddp_per_run": pairs,  # each ft run over the DDP run right after it
                                       "torchft_vs_ddp": med["torchft"] / med["ddp"] if med["torchft"] else None}
        results["kills"] = kills_during_ft("digits", paths["digits"], args.procs, kills) if not args.steady_only else None
        results["torchft_kill"] = {}
        if peers is not None and not args.steady_only:
            for hb in (5000, 1000):
                results["torchft_kill"][f"heartbeat_{hb}ms"] = run_torchft(
                    peers, "digits", paths["digits"], torchft_kill_steps, args.procs, kill_at=torchft_kill_steps // 4,
                    heartbeat_timeout_ms=hb)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _print(results)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)
    print(f"written to {RESULTS}")
    return 0


def _fmt(v, spec=".0f") -> str:
    return "not measured" if v is None else format(v, spec)


def _print(r: dict) -> None:
    print(f"\nown loop: {r['procs']} ranks on {r['cores']} cores, median of {r['repeats']} run(s)\n")
    print(f"{'measure':<58}{'ft':>10}{'DDP':>10}{'torchft':>14}   ratio / target")
    for kind, row in r["steady"].items():
        m = row["median"]
        tf = f" (torchft {row['torchft_vs_ddp']:.2f}x)" if row["torchft_vs_ddp"] else ""
        print(f"{'steady ' + kind + ' (samples/s)':<58}{_fmt(m['ft']):>10}{_fmt(m['ddp']):>10}{_fmt(m['torchft']):>14}"
              f"   {row['ft_vs_ddp']:.3f}x DDP{tf} / >= 0.97; per run "
              + " ".join(f"{x:.2f}" for x in row["ft_vs_ddp_per_run"]))
    k = r["kills"]
    if k is None:
        return
    print(f"{'kills during the ft run':<58}{k['kills']:>10}")
    print(f"{'  survivors next commit after a kill, p50 / p95 (s)':<58}{_fmt(k['resume_p50_s'], '.3f'):>10}"
          f"{'':>10}{'':>14}   p95 {_fmt(k['resume_p95_s'], '.3f')} / <= 0.2")
    print(f"{'  rejoined (warm spare), p50 / p95 (s)':<58}{_fmt(k['rejoin_p50_s'], '.3f'):>10}"
          f"{'':>10}{'':>14}   p95 {_fmt(k['rejoin_p95_s'], '.3f')} / <= 1")
    print(f"{'  samples lost / repeated; replicas identical':<58}{k['samples_lost']:>10}{'':>10}{'':>14}"
          f"   {k['samples_repeated']} / {k['replicas_identical']}")
    for name, tf in r["torchft_kill"].items():
        if tf:
            print(f"{'torchft, one kill, ' + name.replace('_', ' ') + ': next commit (s), samples lost':<58}{'':>10}{'':>10}"
                  f"{_fmt(tf.get('next_commit_after_kill_s'), '.3f'):>14}   {tf['samples_lost']} samples never trained")


if __name__ == "__main__":
    sys.exit(main())
