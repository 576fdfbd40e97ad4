"""Fault-tolerant training vs plain torch DDP and vs torchrun restarts: a table and bench/results/training.json.

    .venv/bin/python bench/training.py --quick        # short runs (about 10 minutes on 2 cores)
    .venv/bin/python bench/training.py                # the issue's sizes
    .venv/bin/python bench/training.py --chaos        # also 3 minutes of chaos (--chaos-seconds)
    .venv/bin/python bench/training.py --only steady,windows   # some sections

Same workload, model, data, sample order, global batch and procs on both sides. Sections:

1. ``steady``: ``monarch_nb.train.fit`` (no faults) vs plain DDP launched by ``python -m
   torch.distributed.run`` (gloo, DistributedDataParallel, no fault tolerance), interleaved, on
   the digits MLP (about 1 ms of compute a step: per-step messaging would show) and on the charlm
   transformer (tens of ms a step), with the controller talking to the ranks over ipc:// and over
   tcp://. Throughput = committed samples / training wall time (first step to last step).
2. ``windows``: the effect of the window size (steps a rank runs between two words from the
   controller) on digits: the per-step loop (one round trip a step), windows of 1, 8 and 64
   steps two in flight, and the default (windows of about ``window_s``).
3. ``rejoin``: fault -> rejoined latency over >= 10 SIGKILLs, with a warm spare and without
   (a fresh interpreter), and over a few hangs (found after the hang timeout, then fenced).
4. ``snapshot``: the shared-memory snapshots' cost (% of step time) from the steady runs, and
   the restore when every replica is killed at once (time from the last kill to training again).
5. ``kill``: one SIGKILL of rank 2 at step K: monarch_nb vs ``torchrun --max-restarts=1``
   restarting the whole job from its last checkpoint (every 50 steps).
6. ``memory``: peak RSS per worker (trainer vs DDP worker), and the extra peak RSS of a donor
   while it streams a 6.3 M-parameter MLP with Adam (about 75 MB of state) to a joiner.
7. ``sharded``: FSDP2 inside replica groups of 2 (HSDP) vs torch's native HSDP and plain FSDP2
   under torchrun, same model and batches: bench/sharded.py in a subprocess (its steady state,
   memory and kills of a shard holder), its bench/results/sharded.json merged in.
8. ``chaos`` (``--chaos``): faults of mixed kinds, a mean time between them of 20 s, for >= 180 s
   at 4 procs, with a seed whose plan has at least one kill and one hang; throughput vs a
   fault-free run, steps and samples lost, each failure's detect / resume / rejoin.

torchrun's own rendezvous store listens on every interface; the DDP jobs therefore run in a
private network namespace (``unshare -n``) with only loopback, when that is available.

Over 500 lines on purpose: every training figure with its peer (plain DDP, torchrun restarts) in
the same run; each section is a function of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RESULTS = os.path.join(REPO, "bench", "results", "training.json")
DDP_SCRIPT = os.path.join(REPO, "bench", "_ddp_train.py")
SECTIONS = ("steady", "windows", "rejoin", "snapshot", "kill", "memory", "sharded", "chaos")
CHAOS_KINDS = ("kill", "hang", "exit", "segfault", "raise", "nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _netns_prefix() -> list[str]:
    if shutil.which("unshare") and shutil.which("ip"):
        probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
        if probe.returncode == 0:
            return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "netns"]
    return []


def _pct(values: list, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_ddp(args, workload: str, steps: int, *, kill_at: int = -1, checkpoint_every: int = 0,
            max_restarts: int = 0) -> dict:
    """Run the plain-DDP job under torchrun; returns its summary plus the driver's wall time. A job
    that fails by itself (gloo or its store aborting on a loaded host; seen once in ~40 runs) is run
    again once, and the summary says so (``peer_retries``)."""
    for attempt in range(2):
        try:
            summary = _run_ddp_once(args, workload, steps, kill_at=kill_at, checkpoint_every=checkpoint_every,
                                    max_restarts=max_restarts)
            summary["peer_retries"] = attempt
            return summary
        except RuntimeError as exc:
            if attempt:
                raise
            print(f"the DDP peer failed by itself; running it again: {str(exc).splitlines()[-1][:200]}", flush=True)
    raise AssertionError("unreachable")


def _run_ddp_once(args, workload: str, steps: int, *, kill_at: int, checkpoint_every: int, max_restarts: int) -> dict:
    work = tempfile.mkdtemp(prefix="ddp-bench-")
    out = os.path.join(work, "summary.json")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.procs),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.1", DDP_SCRIPT, "--workload", workload, "--steps", str(steps),
        "--seed", str(args.seed), "--out", out, "--checkpoint-dir", work, "--checkpoint-every", str(checkpoint_every),
        "--kill-at", str(kill_at), "--kill-rank", "2",
    ]
    # torchrun's own scratch folders (torchelastic_*) go into the job's folder, removed below
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", LOGLEVEL="ERROR", TMPDIR=work)
    try:
        t0 = time.time()
        proc = subprocess.run(_netns_prefix() + cmd, capture_output=True, text=True, env=env, timeout=1800)
        wall = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        final = out if os.path.exists(out) else max(
            (os.path.join(work, n) for n in os.listdir(work) if n.startswith("summary.json.attempt")), key=os.path.getmtime)
        summary = json.load(open(final))
        start = json.load(open(out + ".start"))
        summary["train_wall_s"] = summary["t_end"] - start["t_first_step"]
        summary["job_wall_s"] = wall
        summary["throughput_samples_per_s"] = steps * summary["global_batch"] / summary["train_wall_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def use_transport(transport: str) -> None:
    """Make the next run's controller talk to its procs over ``transport`` (a new controller)."""
    import monarch_nb
    from monarch_nb.config import config
    from monarch_nb.runtime.controller import Controller

    if config.transport != transport:
        existing = Controller.existing()
        if existing is not None:
            existing.shutdown()
        monarch_nb.configure(transport=transport)


def run_monarch(args, workload: str, steps: int, faults=(), **extra) -> dict:
    from monarch_nb.train import fit

    t0 = time.time()
    options = dict(progress=False, eval_every=0, seed=args.seed)
    options.update(extra)
    report = fit(workload, procs=args.procs, steps=steps, faults=list(faults), **options)
    d = report.to_dict()
    d["job_wall_s"] = time.time() - t0
    return d


# -- 1. steady state ------------------------------------------------------------------------------
def steady(args, workload: str, steps: int, transport: str) -> tuple[dict, list, list]:
    use_transport(transport)
    mon, ddp = [], []
    for _ in range(args.repeats):  # interleaved: both see the same machine load
        mon.append(run_monarch(args, workload, steps))
        ddp.append(run_ddp(args, workload, steps))
    m_tp = statistics.median(r["throughput_samples_per_s"] for r in mon)
    d_tp = statistics.median(r["throughput_samples_per_s"] for r in ddp)
    # the machine's load drifts between runs: each monarch_nb run is compared with the DDP run right after it
    pairs = [m["throughput_samples_per_s"] / d["throughput_samples_per_s"] for m, d in zip(mon, ddp)]
    return {
        "workload": workload, "transport": transport, "steps": steps, "global_batch": mon[0]["global_batch"],
        "monarch_samples_per_s": m_tp, "ddp_samples_per_s": d_tp, "ratio": statistics.median(pairs),
        "pair_ratios": pairs, "ratio_of_medians": m_tp / d_tp,
        "monarch_step_ms_median": statistics.median(r["step_time_ms_median"] for r in mon),
        "ddp_step_ms_median": statistics.median(r["step_ms"][len(r["step_ms"]) // 2] for r in ddp),
        "monarch_window_steps_median": statistics.median(r["window_steps_median"] for r in mon),
        "monarch_goodput": statistics.median(r["goodput"] for r in mon),
        "monarch_runs": [r["throughput_samples_per_s"] for r in mon],
        "ddp_runs": [r["throughput_samples_per_s"] for r in ddp], "target_ratio": 0.97,
        "snapshots": [r["snapshots"] for r in mon],
    }, mon, ddp


# -- 2. window size ---------------------------------------------------------------------------------
WINDOWS = (
    ("per-step loop (1 step, nothing ahead)", {"window_steps": 1, "pipeline": 1}),
    ("windows of 1 step, 2 in flight", {"window_steps": 1}),
    ("windows of 8 steps, 2 in flight", {"window_steps": 8}),
    ("windows of 64 steps, 2 in flight", {"window_steps": 64}),
    ("windows of ~0.1 s, 2 in flight (default)", {}),
)


def windows(args, steps: int) -> list[dict]:
    """Each window configuration against a DDP run just before it (pairs share the machine's load)."""
    use_transport("ipc")
    rows = []
    for label, extra in WINDOWS:
        pairs = []
        for _ in range(args.repeats):
            ddp = run_ddp(args, "digits", steps)
            mon = run_monarch(args, "digits", steps, **extra)
            pairs.append((mon, ddp))
        ratios = [m["throughput_samples_per_s"] / d["throughput_samples_per_s"] for m, d in pairs]
        rows.append({"label": label, "options": extra,
                     "samples_per_s": statistics.median(m["throughput_samples_per_s"] for m, _ in pairs),
                     "ddp_samples_per_s": statistics.median(d["throughput_samples_per_s"] for _, d in pairs),
                     "step_ms_median": statistics.median(m["step_time_ms_median"] for m, _ in pairs),
                     "window_steps_median": statistics.median(m["window_steps_median"] for m, _ in pairs),
                     "ratio_to_ddp": statistics.median(ratios), "ratios": ratios})
    return rows


# -- 3. rejoin ---------------------------------------------------------------------------------------
def rejoin(args, spares: int, kinds: tuple, faults: int, gap_s: float) -> dict:
    """Inject ``faults`` faults of ``kinds`` (in turn), each once every rank is back (and, with
    spares, a spare is ready), ``gap_s`` after the last was found, into live ranks of one long
    run; fault -> rejoined latency of each."""
    from monarch_nb.train import start

    use_transport("ipc")
    run = start("digits", procs=args.procs, steps=10_000_000, seed=args.seed, eval_every=0, spares=spares)
    injected = 0
    try:
        deadline = time.monotonic() + 300
        while run.step < 20 and time.monotonic() < deadline and not run.done():
            time.sleep(0.05)
        rank_turn = 0
        while injected < faults and time.monotonic() < deadline + faults * gap_s * 3 and not run.done():
            live = run.live_ranks
            if len(live) == args.procs and (not spares or _ready_spares(run.mesh_name)):  # all back: the next fault
                rank = live[1 + rank_turn % (len(live) - 1)]  # not rank 0: it writes the snapshots
                rank_turn += 1
                try:
                    run.procs.inject(rank, kinds[injected % len(kinds)])
                except RuntimeError:  # it failed by itself meanwhile (a busy machine): the next one
                    continue
                injected += 1
                out = time.monotonic() + 30
                while rank in run.live_ranks and time.monotonic() < out:  # a hang is found after the timeout
                    time.sleep(0.02)
                time.sleep(gap_s)
            else:
                time.sleep(0.05)
        t_end = time.monotonic() + 120
        while len(run.live_ranks) < args.procs and time.monotonic() < t_end and not run.done():
            time.sleep(0.05)
    finally:
        run.stop()
    report = run.report(timeout=30)
    ours = [f for f in report.failures if f["kind"] in kinds]
    lat = [f["rejoin_latency_s"] for f in ours if f["rejoin_latency_s"] is not None]
    det = [f["detection_latency_s"] for f in ours if f["detection_latency_s"] is not None]
    return {"kind": "/".join(kinds), "spares": spares, "faults": injected, "rejoined": len(lat),
            "by_kind": {k: [f["rejoin_latency_s"] for f in ours if f["kind"] == k] for k in kinds},
            "rejoin_p50_s": _pct(lat, 0.5), "rejoin_p95_s": _pct(lat, 0.95), "rejoin_max_s": max(lat) if lat else None,
            "detect_p50_s": _pct(det, 0.5), "rejoin_s": lat,
            "heal_ms_median": statistics.median(f["heal_ms"] for f in report.failures if f["heal_ms"] is not None)
            if any(f["heal_ms"] is not None for f in report.failures) else None,
            "samples_lost": report.samples_lost, "replicas_identical": report.replicas_identical}


def _ready_spares(mesh: str) -> list:
    from monarch_nb.runtime.controller import Controller
    from monarch_nb.supervision.records import ProcState
    from monarch_nb.supervision.tree import find

    return [s for s in find(Controller.get().tree(mesh), "spare") if s["state"] == ProcState.HEALTHY]


# -- 4. snapshots: restore when every replica dies ---------------------------------------------------
def restore(args) -> dict:
    from monarch_nb.train import start

    use_transport("ipc")
    steps = 400 if args.quick else 1200
    run = start("digits", procs=args.procs, steps=steps, seed=args.seed, eval_every=0, keep_parameters=False)
    marks: dict = {}

    def kill_all(item: dict) -> None:
        if item.get("type") == "step" and item["step"] == steps // 2 and "killed" not in marks:
            for rank in range(args.procs):
                run.procs.inject(rank, "kill")
            marks["killed"] = time.monotonic()
        elif item.get("type") == "recovery" and item["event"] == "restored":
            marks["restored"] = time.monotonic()
        elif item.get("type") == "step" and "restored" in marks and "training" not in marks:
            marks["training"] = time.monotonic()

    run.subscribe(kill_all)
    report = run.report(timeout=600)
    (r,) = report.restores
    return {"steps": steps, "killed_at_step": steps // 2, "restored_step": r["step"], "steps_redone": r["steps_redone"],
            "restore_s": r["restore_s"], "kill_to_restored_s": marks["restored"] - marks["killed"],
            "kill_to_training_s": marks.get("training", marks["restored"]) - marks["killed"],
            "samples_lost": report.samples_lost, "samples_repeated": report.samples_repeated,
            "replicas_identical": report.replicas_identical, "snapshots": report.snapshots}


# -- 5. one kill vs torchrun -------------------------------------------------------------------------
def kill_vs_torchrun(args) -> dict:
    use_transport("ipc")
    kill_steps, kill_at = (160, 120) if args.quick else (300, 120)
    clean_m = run_monarch(args, "digits", kill_steps)
    kill_m = run_monarch(args, "digits", kill_steps, faults=[f"kill@{kill_at}:rank=2"])
    clean_d = run_ddp(args, "digits", kill_steps, checkpoint_every=50, max_restarts=1)
    kill_d = run_ddp(args, "digits", kill_steps, kill_at=kill_at, checkpoint_every=50, max_restarts=1)
    (failure,) = [f for f in kill_m["failures"] if f["kind"] == "kill"]
    # Two runs' wall-time difference is noisy on a busy machine, so the time lost is at least the
    # survivors' stall: kill -> next commit, plus the pause of the heal at the rejoin boundary.
    stall_m = failure["resume_latency_s"] + (failure["heal_ms"] or 0) / 1e3
    lost_m = max(kill_m["wall_time_s"] - clean_m["wall_time_s"], stall_m)
    lost_d = kill_d["train_wall_s"] - clean_d["train_wall_s"]
    return {
        "steps": kill_steps, "kill_at": kill_at, "checkpoint_every": 50,
        "monarch_time_lost_s": lost_m, "monarch_wall_difference_s": kill_m["wall_time_s"] - clean_m["wall_time_s"],
        "monarch_stall_s": stall_m, "torchrun_time_lost_s": lost_d, "ratio": lost_m / lost_d if lost_d > 0 else None,
        "monarch_detection_s": failure["detection_latency_s"], "monarch_resume_s": failure["resume_latency_s"],
        "monarch_rejoin_s": failure["rejoin_latency_s"], "monarch_heal_ms": failure["heal_ms"],
        "monarch_steps_lost": kill_m["steps_lost"], "monarch_samples_lost": kill_m["samples_lost"],
        "monarch_samples_repeated": kill_m["samples_repeated"],
        "torchrun_steps_redone": kill_at - (kill_at // 50) * 50,
        "targets": {"resume_s": 1.0, "rejoin_s": 1.0, "ratio": 0.1},
    }


# -- 6. memory ---------------------------------------------------------------------------------------
def heal_memory(args) -> dict:
    """Peak extra RSS of a donor streaming ~75 MB of state to a joiner (one heal, in isolation)."""
    from monarch_nb import this_host
    from monarch_nb.runtime.controller import Controller
    from monarch_nb.runtime.rendezvous import controller_store
    from monarch_nb.train import Trainer, Workload

    def model_fn():
        import torch

        return torch.nn.Sequential(torch.nn.Linear(1024, 3072), torch.nn.ReLU(), torch.nn.Linear(3072, 1024))

    import torch

    use_transport("ipc")
    x = torch.randn(64, 1024)
    workload = Workload.custom(model_fn, (x, x.clone()), torch.nn.functional.mse_loss, batch_size=8)
    store = controller_store(timeout_s=60)
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        trainers = procs.spawn("t", Trainer, workload, 0, 1e-3, 8, "127.0.0.1", store.port, "gloo", 30.0, 4 << 20)
        trainers.setup.call().get(120)
        donor, joiner = trainers.slice(gpus=0), trainers.slice(gpus=1)
        donor.init_quorum.call_one(1, [0]).get(60)
        donor.run_window.call_one(1, 0, 1).get(60)  # one step: Adam's state exists now
        state_bytes = donor.memory.call_one().get()["state_bytes"]
        pid = Controller.get().proc_record(procs.name, 0).pid
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        rss_before = _status_kb(pid, "VmRSS") * 1024
        t0 = time.monotonic()
        manifest = donor.state_manifest.call_one().get(60)
        joiner.load_begin.call_one(manifest).get(60)
        for i in range(manifest["chunks"]):
            joiner.load_chunk.call_one(i, donor.state_chunk.call_one(i).get(60)).get(60)
        donor.state_done.call_one().get(60)
        joiner.load_end.call_one().get(60)
        heal_s = time.monotonic() - t0
        peak = _status_kb(pid, "VmHWM") * 1024
        same = donor.checksum.call_one().get(60).digest == joiner.checksum.call_one().get(60).digest
    del store
    extra = max(0, peak - rss_before)
    return {"state_bytes": state_bytes, "chunks": manifest["chunks"], "donor_rss_before_bytes": rss_before,
            "donor_peak_rss_bytes": peak, "donor_extra_peak_bytes": extra,
            "extra_over_state": extra / state_bytes, "heal_s": heal_s, "replicas_identical": same,
            "target_extra_over_state": 1.2}


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# -- 7. chaos ----------------------------------------------------------------------------------------
def chaos_seed(mtbf_s: float, seconds: float, procs: int, start: int = 0) -> int:
    """The first seed >= ``start`` whose chaos plan, within ``seconds``, has a kill and a hang."""
    from monarch_nb.faults.chaos import ChaosSchedule

    for seed in range(start, start + 10_000):
        plan = [f for f in ChaosSchedule(mtbf_s, kinds=CHAOS_KINDS, seed=seed).plan(200, world=procs) if f.at_s < seconds * 0.8]
        kinds = {f.kind for f in plan}
        if {"kill", "hang"} <= kinds and len(plan) >= seconds / mtbf_s * 0.6:
            return seed
    raise RuntimeError("no seed gives a plan with a kill and a hang")


def chaos(args, steps_per_s: float) -> dict:
    """Faults of mixed kinds (mean time between them ``--chaos-mtbf``) for ``--chaos-seconds``."""
    use_transport("ipc")
    seed = chaos_seed(args.chaos_mtbf, args.chaos_seconds, args.procs, args.seed)
    steps = int(steps_per_s * args.chaos_seconds)
    wargs = argparse.Namespace(**{**vars(args), "seed": seed})
    run = run_monarch(wargs, "digits", steps, chaos_mtbf_s=args.chaos_mtbf, chaos_kinds=CHAOS_KINDS)
    clean = run_monarch(wargs, "digits", max(200, steps // 3))
    return {
        "seconds_planned": args.chaos_seconds, "mtbf_s": args.chaos_mtbf, "seed": seed, "steps": steps,
        "faults": len(run["failures"]), "kinds": sorted({f["kind"] for f in run["failures"]}),
        "throughput_samples_per_s": run["throughput_samples_per_s"],
        "fault_free_samples_per_s": clean["throughput_samples_per_s"],
        "ratio": run["throughput_samples_per_s"] / clean["throughput_samples_per_s"],
        "steps_lost": run["steps_lost"], "samples_lost": run["samples_lost"],
        "samples_repeated": run["samples_repeated"], "goodput": run["goodput"], "restores": run["restores"],
        "replicas_identical": run["replicas_identical"], "failures": run["failures"], "target_ratio": 0.95,
        "wall_time_s": run["wall_time_s"],
    }


# -- main ---------------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--chaos", action="store_true", help="also run the chaos comparison")
    p.add_argument("--only", help=f"comma-separated sections among {','.join(SECTIONS)}")
    p.add_argument("--chaos-seconds", type=float, default=180.0)
    p.add_argument("--chaos-mtbf", type=float, default=20.0)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=None, help="steady-state repeats (median)")
    args = p.parse_args()
    import monarch_nb

    monarch_nb.configure(heartbeat_interval_s=0.1, hang_timeout_s=2.0)
    args.repeats = args.repeats or (1 if args.quick else 3)
    only = set(args.only.split(",")) if args.only else set(SECTIONS) - ({"chaos"} if not args.chaos else set())
    digits_steps = 800 if args.quick else 2500
    charlm_steps = 60 if args.quick else 250
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                     "config": {"procs": args.procs, "quick": args.quick, "seed": args.seed, "repeats": args.repeats}}
    mon_digits: list = []
    ddp_digits: list = []
    if "steady" in only or "memory" in only or "chaos" in only:
        results["steady"] = []
        for transport in ("ipc", "tcp") if "steady" in only else ("ipc",):
            for workload, steps in (("digits", digits_steps), ("charlm", charlm_steps)):
                row, mon, ddp = steady(args, workload, steps, transport)
                results["steady"].append(row)
                if workload == "digits" and transport == "ipc":
                    mon_digits, ddp_digits = mon, ddp
                print(f"steady {workload} {transport}: {row['ratio']:.3f}x DDP", flush=True)
    if "windows" in only:
        results["windows"] = windows(args, digits_steps)
    if "rejoin" in only:
        kills = 10
        crashes = ("kill", "segfault", "exit")
        results["rejoin"] = [
            rejoin(args, 1, crashes, kills, 2.0),
            rejoin(args, 0, crashes, kills, 2.0),
            rejoin(args, 1, ("hang",), 3 if args.quick else 5, 2.0),
        ]
        from monarch_nb.config import config

        for r in results["rejoin"]:  # the issue's targets: 1 s after a crash with a spare; hang timeout + 1 s
            r["target_p95_s"] = (1.0 if r["spares"] else None) if r["kind"] != "hang" else config.hang_timeout_s + 1.0
    if "snapshot" in only:
        results["snapshot"] = restore(args)
    if "kill" in only:
        results["kill"] = kill_vs_torchrun(args)
    if "memory" in only and mon_digits:
        m_rss = max(max(r["worker_peak_rss_bytes"]) for r in mon_digits)
        d_rss = max(max(r["peak_rss_bytes"]) for r in ddp_digits)
        results["memory"] = {"monarch_worker_peak_rss_bytes": m_rss, "ddp_worker_peak_rss_bytes": d_rss,
                             "ratio": m_rss / d_rss, "target_ratio": 1.1, "heal": heal_memory(args)}
    if "sharded" in only:
        results["sharded"] = sharded(args)
    if "chaos" in only:
        base = next(r for r in results["steady"] if r["workload"] == "digits" and r["transport"] == "ipc")
        results["chaos"] = chaos(args, base["monarch_samples_per_s"] / base["global_batch"])
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    path = RESULTS if not args.only else RESULTS.replace(".json", f"_{'_'.join(sorted(only))}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(_table(results))
    print(f"\nwritten to {os.path.relpath(path, REPO)}")
    return 0


def sharded(args) -> dict:
    """The sharded rows: bench/sharded.py (ft HSDP vs native HSDP and plain FSDP2 under torchrun,
    same model and batches, in its own run; see its docstring), its JSON merged here."""
    cmd = [sys.executable, os.path.join(REPO, "bench", "sharded.py"), "--seed", str(args.seed)]
    if args.quick:
        cmd.append("--quick")
    subprocess.run(cmd, cwd=REPO, check=True)
    with open(os.path.join(REPO, "bench", "results", "sharded.json")) as f:
        return json.load(f)


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _table(r: dict) -> str:
    mb = 1 << 20
    rows = [f"training benchmark: {r['config']['procs']} procs, {r['machine']['cpus']} CPUs"
            f"{' (quick)' if r['config']['quick'] else ''}, repeats {r['config']['repeats']}", "",
            f"{'measure':<50}{'monarch_nb':>13}{'peer':>13}{'ratio':>8}{'target':>10}"]
    for s in r.get("steady", []):
        rows.append(f"{'steady ' + s['workload'] + ' over ' + s['transport'] + ' (samples/s), DDP peer':<50}"
                    f"{s['monarch_samples_per_s']:>13.0f}{s['ddp_samples_per_s']:>13.0f}{s['ratio']:>8.3f}{'>= 0.97':>10}")
        rows.append(f"{'  median step (ms); steps per window':<50}{s['monarch_step_ms_median']:>13.2f}"
                    f"{s['ddp_step_ms_median']:>13.2f}{s['monarch_window_steps_median']:>8.0f}")
    for w in r.get("windows", []):
        rows.append(f"{'window: ' + w['label']:<50}{w['samples_per_s']:>13.0f}{w['ddp_samples_per_s']:>13.0f}"
                    f"{w['ratio_to_ddp']:>8.3f}")
    for j in r.get("rejoin", []):
        label = f"{j['kind']} -> rejoined p50/p95 (s), {'a warm spare' if j['spares'] else 'no spare'}, n={j['rejoined']}"
        rows.append(f"{label:<50}{_fmt(j['rejoin_p50_s']) + '/' + _fmt(j['rejoin_p95_s']):>13}{'':>13}{'':>8}"
                    f"{('<= ' + _fmt(j['target_p95_s'], '.0f')) if j.get('target_p95_s') else '':>10}")
    snaps = [x for s in r.get("steady", []) if s["transport"] == "ipc" for x in s["snapshots"] if x.get("count")]
    for snap in snaps[:2]:
        rows.append(f"{'snapshot: cost (% of step time), every N steps':<50}{_fmt(snap['cost_pct_of_step_time'], '.3f'):>13}"
                    f"{_fmt(snap['interval_steps'], '.0f'):>13}{'':>8}{'< 1':>10}")
    if "snapshot" in r:
        s = r["snapshot"]
        rows.append(f"{'every replica killed: restore (s), steps redone':<50}{s['restore_s']:>13.3f}{s['steps_redone']:>13}")
        rows.append(f"{'  last kill -> training again (s); lost/repeated':<50}{s['kill_to_training_s']:>13.3f}"
                    f"{str(s['samples_lost']) + '/' + str(s['samples_repeated']):>13}")
    if "kill" in r:
        k = r["kill"]
        rows.append(f"{'SIGKILL @ step ' + str(k['kill_at']) + ': time lost (s), torchrun peer':<50}{k['monarch_time_lost_s']:>13.2f}"
                    f"{k['torchrun_time_lost_s']:>13.2f}{_fmt(k['ratio'], '.3f'):>8}{'<= 0.1':>10}")
        latencies = f"{_fmt(k['monarch_detection_s'], '.3f')}/{_fmt(k['monarch_resume_s'], '.3f')}/{_fmt(k['monarch_rejoin_s'], '.2f')}"
        rows.append(f"{'  detect / resume / rejoin (s)':<50}{latencies:>13}")
    if "memory" in r:
        m = r["memory"]
        h = m["heal"]
        rows.append(f"{'peak RSS per worker (MiB), DDP worker':<50}{m['monarch_worker_peak_rss_bytes'] / mb:>13.1f}"
                    f"{m['ddp_worker_peak_rss_bytes'] / mb:>13.1f}{m['ratio']:>8.2f}{'<= 1.1':>10}")
        rows.append(f"{'heal: donor extra peak RSS / state size (MiB)':<50}{h['donor_extra_peak_bytes'] / mb:>13.1f}"
                    f"{h['state_bytes'] / mb:>13.1f}{h['extra_over_state']:>8.2f}{'< 1.2':>10}")
    if "sharded" in r:
        h = r["sharded"]
        sps, rss = h["steady_samples_per_s"], h["peak_rss_bytes_max_rank"]
        rows.append(f"{'sharded ' + h['workload'] + ' G=' + str(h['group_size']) + ' (samples/s), native HSDP':<50}"
                    f"{sps['ft_hsdp']:>13.0f}{sps['native_hsdp']:>13.0f}{h['ratio_vs_native_hsdp']:>8.3f}{'>= 0.95':>10}")
        rows.append(f"{'  plain FSDP2 (samples/s)':<50}{'':>13}{sps['native_fsdp2']:>13.0f}")
        rows.append(f"{'  peak RSS, largest rank (MiB), native HSDP':<50}{rss['ft_hsdp'] / mb:>13.1f}"
                    f"{rss['native_hsdp'] / mb:>13.1f}{h['memory_ratio_vs_native_hsdp']:>8.3f}{'<= 1.1':>10}")
        k = h.get("kills")
        if k:
            rows.append(f"{'  kill -> next commit / group rejoined p95 (s)':<50}"
                        f"{_fmt(k.get('resume_p95_s'), '.3f') + '/' + _fmt(k.get('rejoin_p95_s'), '.3f'):>13}"
                        f"{'':>13}{'':>8}{'0.5/2':>10}")
    if "chaos" in r:
        c = r["chaos"]
        rows.append(f"{'chaos ' + str(int(c['wall_time_s'])) + ' s, mtbf ' + str(int(c['mtbf_s'])) + ' s: samples/s, fault-free':<50}"
                    f"{c['throughput_samples_per_s']:>13.0f}{c['fault_free_samples_per_s']:>13.0f}{c['ratio']:>8.3f}{'>= 0.95':>10}")
        rows.append(f"{'  faults / steps lost / samples lost / repeated':<50}"
                    f"{str(c['faults']) + '/' + str(c['steps_lost']) + '/' + str(c['samples_lost']) + '/' + str(c['samples_repeated']):>13}"
                    f"{', '.join(c['kinds']):>30}")
        rows.append("    kind       rank  step   detect_s  resume_s  rejoin_s")
        for f in c["failures"]:
            rows.append(f"    {f['kind']:<10} {f['rank']:>4} {f['step']:>5}   {_fmt(f['detection_latency_s'], '8.3f'):>8}  "
                        f"{_fmt(f['resume_latency_s'], '8.3f'):>8}  {_fmt(f['rejoin_latency_s'], '8.3f'):>8}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
