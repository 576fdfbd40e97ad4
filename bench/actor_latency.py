"""Actor-call latency, throughput, start-up and memory: monarch_nb against raw pyzmq and its peers.

    python bench/actor_latency.py [--calls 2000] [--with-peers] [--quick]

Measured in one run, on one machine, so the ratios hold on a noisy host:

- raw pyzmq DEALER/ROUTER ping-pong between two Python processes (the floor);
- monarch_nb: ``call_one`` round trip (no arguments), ``call`` to 4 actors, a 1 MiB and a 64 MiB
  tensor argument echoed back (GB/s = tensor bytes / round-trip time), ``broadcast`` throughput,
  and the time from ``spawn_procs`` of 4 (in a fresh controller process) to the first reply;
- the same workload on torchmonarch and ipyparallel, in their own venv (``--with-peers`` makes
  it; see bench/_peers.py). A peer that is missing prints "not measured".
- memory: an idle worker's RSS above a bare ``python -c "import torch"``, the controller's RSS
  growth over many calls, and the peak extra RSS of a 64 MiB round trip in copies of the tensor.

Prints a table and writes bench/results/actor_latency.json. Medians and p95 in microseconds.

Over 500 lines on purpose: one Monarch-API script run on monarch_nb, on a baseline checkout and
on torchmonarch in the same run, plus the raw pyzmq floor; each figure is a function of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _peers  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def summarize(samples_s: list[float]) -> dict:
    ordered = sorted(samples_s)
    return {
        "n": len(ordered),
        "median_us": statistics.median(ordered) * 1e6,
        "p95_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1e6,
    }


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- raw pyzmq ------------------------------------------------------------------------------------
RAW_SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(b"ready")
while True:
    msg = sock.recv_multipart()
    if msg[0] == b"quit":
        break
    sock.send_multipart(msg)
"""


def bench_raw_zmq(calls: int) -> dict:
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    address = f"ipc:///tmp/monarch_nb-bench-raw-{os.getpid()}"
    sock.bind(address)
    server = subprocess.Popen([sys.executable, "-c", RAW_SERVER, address])
    try:
        ident, _ = sock.recv_multipart()
        samples = []
        for _ in range(calls + 200):
            t0 = time.perf_counter()
            sock.send_multipart([ident, b"ping"])
            sock.recv_multipart()
            samples.append(time.perf_counter() - t0)
        sock.send_multipart([ident, b"quit"])
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        sock.close(linger=0)
        try:
            os.unlink(address.removeprefix("ipc://"))
        except OSError:
            pass
    return summarize(samples[200:])


# -- monarch_nb -----------------------------------------------------------------------------------
STARTUP_SCRIPT = """
import json, time
t0 = time.perf_counter()
from {module} import Actor, endpoint, this_host

class Ping(Actor):
    @endpoint
    def ping(self):
        return 1

procs = this_host().spawn_procs(per_host={{"gpus": 4}})
actors = procs.spawn("ping", Ping)
actors.ping.call().get()
elapsed = time.perf_counter() - t0
procs.stop()
print(json.dumps({{"startup_s": elapsed}}))
"""


def _startup(python: str, module: str, runs: int, env_extra: dict | None = None) -> dict | None:
    samples = []
    env = dict(os.environ, **(env_extra or {}))
    for _ in range(runs):
        result = subprocess.run([python, "-c", STARTUP_SCRIPT.format(module=module)], capture_output=True, text=True, env=env, timeout=300)
        lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
        if result.returncode != 0 or not lines:
            print(f"startup run failed: {result.stderr[-500:]}", file=sys.stderr)
            return None
        samples.append(json.loads(lines[-1])["startup_s"])
    return {"runs": runs, "median_s": statistics.median(samples), "min_s": min(samples)}


#: One Monarch-API script, run as written on monarch_nb (``monarch_nb.actor``) and on torchmonarch
#: (``monarch.actor``), each in its own fresh process: the same workload, the same code.
ACTOR_SCRIPT = """
import importlib, json, resource, statistics, sys, time
import torch
api = importlib.import_module("MODULE")
Actor, endpoint, this_host = api.Actor, api.endpoint, api.this_host
Channel = getattr(api, "Channel", None)  # an older monarch_nb had no ports

CALLS = int(sys.argv[1])
QUICK = sys.argv[2] == "1"

def summarize(s):
    s = sorted(s)
    return {"n": len(s), "median_us": statistics.median(s) * 1e6, "p95_us": s[min(len(s) - 1, int(len(s) * 0.95))] * 1e6}

class Echo(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def ping(self):
        return None

    @endpoint
    def echo(self, value):
        return value

    @endpoint
    def count(self):
        self.n += 1

    @endpoint
    def counted(self):
        return self.n

    @endpoint
    def stream_to(self, port, n):
        for i in range(n):
            port.send(i)

    @endpoint
    def relay(self, other, n):
        for _ in range(100):
            other.ping.call_one().get()
        s = []
        for _ in range(n):
            t0 = time.perf_counter()
            other.ping.call_one().get()
            s.append(time.perf_counter() - t0)
        return s

procs = this_host().spawn_procs(per_host={"gpus": 4})
actors = procs.spawn("echo", Echo)
one = actors.slice(gpus=0)
for _ in range(200):
    one.ping.call_one().get()
out = {}
s = []
for _ in range(CALLS):
    t0 = time.perf_counter(); one.ping.call_one().get(); s.append(time.perf_counter() - t0)
out["call_one"] = summarize(s)
s = []
for _ in range(max(200, CALLS // 2)):
    t0 = time.perf_counter(); actors.ping.call().get(); s.append(time.perf_counter() - t0)
out["call_4"] = summarize(s)
# an endpoint calling another actor's endpoint (on another proc of the host), timed inside the
# endpoint; with the controller's CPU (this process, user + system) per call meanwhile
def cpu_s():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
cpu0 = cpu_s()
out["actor_to_actor"] = summarize(one.relay.call_one(actors.slice(gpus=1), CALLS).get())
out["actor_to_actor"]["controller_cpu_us_per_call"] = (cpu_s() - cpu0) / (CALLS + 100) * 1e6
# broadcasts to 4 actors, end to end: until the last one is processed on every actor
rates = []
total = 0
for _ in range(3):
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        actors.count.broadcast()
    counts = actors.counted.call().get()
    rates.append(n / (time.perf_counter() - t0))
    total += n
    assert all(v == total for _, v in counts.items()), counts
out["broadcast_e2e"] = {"broadcasts": 2000, "actors": 4, "broadcasts_per_s": statistics.median(rates)}
# 10,000 values through one port, from an endpoint to this client
rates = []
for _ in range(0 if Channel is None else 1 if QUICK else 3):
    port, receiver = Channel.open()
    n = 10000
    t0 = time.perf_counter()
    one.stream_to.broadcast(port, n)
    for i in range(n):
        assert receiver.recv().get() == i
    rates.append(n / (time.perf_counter() - t0))
if rates:
    out["port_stream"] = {"values": 10000, "values_per_s": statistics.median(rates)}
for label, nbytes, reps in (("tensor_1MiB", 1 << 20, 50 if QUICK else 200), ("tensor_64MiB", 64 << 20, 5 if QUICK else 20)):
    t = torch.ones(nbytes // 4)
    one.echo.call_one(t).get()
    s = []
    for _ in range(reps):
        t0 = time.perf_counter(); back = one.echo.call_one(t).get(); s.append(time.perf_counter() - t0)
    assert back.numel() == t.numel()
    st = summarize(s); st["gb_per_s"] = nbytes / (st["median_us"] / 1e6) / 1e9
    out[label] = st
stopping = procs.stop()
if stopping is not None:
    stopping.get()
out["module_file"] = api.__file__
print(json.dumps(out))
"""


def run_actor_script(python: str, module: str, calls: int, quick: bool, env_extra: dict | None = None) -> dict | None:
    """Run :data:`ACTOR_SCRIPT` with ``python`` on ``module``; its JSON, or None if it failed."""
    return _peers.run_json_script(python, ACTOR_SCRIPT.replace("MODULE", module), (str(calls), "1" if quick else "0"),
                                  env_extra=env_extra, label=f"{module} run")


def _baseline_env(checkout: Path) -> dict:
    """PYTHONPATH that makes ``import monarch_nb`` load ``checkout``'s package (the scripts run in
    a folder of their own, so the current folder's package does not come first)."""
    return {"PYTHONPATH": str(checkout.resolve())}


def bench_monarch_nb(calls: int, quick: bool) -> dict:
    return run_actor_script(sys.executable, "monarch_nb.actor", calls, quick, {"PYTHONPATH": str(ROOT)}) or {}


# -- memory ---------------------------------------------------------------------------------------
def bench_memory(quick: bool) -> dict:
    import torch

    from monarch_nb import Actor, endpoint, this_host

    class Probe(Actor):
        @endpoint
        def rss_after_torch(self) -> int:
            import torch  # noqa: F401 - the reference imports torch too

            return rss_bytes()

        @endpoint
        def maxrss(self) -> int:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        @endpoint
        def echo(self, value):
            return value

        @endpoint
        def ping(self):
            return None

    bare = subprocess.run(
        [sys.executable, "-c", "import torch\nfor l in open('/proc/self/status'):\n    l.startswith('VmRSS') and print(int(l.split()[1])*1024)"],
        capture_output=True, text=True, check=True,
    )
    bare_rss = int(bare.stdout.strip())
    out: dict = {}
    with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
        probe = procs.spawn("probe", Probe)
        worker_rss = probe.rss_after_torch.call_one().get()
        out["idle_worker_rss_mb"] = worker_rss / 2**20
        out["bare_python_torch_rss_mb"] = bare_rss / 2**20
        out["idle_worker_over_bare_mb"] = (worker_rss - bare_rss) / 2**20

        nbytes = 64 << 20
        tensor = torch.ones(nbytes // 4)
        before_worker = probe.maxrss.call_one().get()
        before_ctrl = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        back = probe.echo.call_one(tensor).get()
        after_worker = probe.maxrss.call_one().get()
        after_ctrl = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        del back
        out["tensor_64MiB_worker_peak_copies"] = (after_worker - before_worker) / nbytes
        out["tensor_64MiB_controller_peak_copies"] = (after_ctrl - before_ctrl) / nbytes

        calls = 20_000 if quick else 100_000
        for _ in range(2000):
            probe.ping.call_one().get()
        start = rss_bytes()
        for _ in range(calls):
            probe.ping.call_one().get()
        out["controller_rss_growth_mb"] = (rss_bytes() - start) / 2**20
        out["controller_rss_growth_calls"] = calls
    return out


# -- peers ----------------------------------------------------------------------------------------
IPYPARALLEL = """
import json, statistics, time
import ipyparallel as ipp

def summarize(s):
    s = sorted(s)
    return {"n": len(s), "median_us": statistics.median(s) * 1e6, "p95_us": s[int(len(s) * 0.95)] * 1e6}

def ping():
    return None

t0 = time.perf_counter()
cluster = ipp.Cluster(n=4, log_level=40)
rc = cluster.start_and_connect_sync()
rc.wait_for_engines(4, timeout=120)
rc[:].apply_sync(ping)
startup = time.perf_counter() - t0
out = {"startup": {"runs": 1, "median_s": startup, "min_s": startup}}
one = rc[0]
for _ in range(50):
    one.apply_sync(ping)
s = []
for _ in range(CALLS):
    t0 = time.perf_counter(); one.apply_sync(ping); s.append(time.perf_counter() - t0)
out["call_one"] = summarize(s)
s = []
view = rc[:]
for _ in range(max(100, CALLS // 4)):
    t0 = time.perf_counter(); view.apply_sync(ping); s.append(time.perf_counter() - t0)
out["call_4"] = summarize(s)
cluster.stop_cluster_sync()
print(json.dumps(out))
"""


def median_of_runs(runs: list[dict]) -> dict:
    """Per figure, the median over runs (each run is run_actor_script's JSON)."""
    runs = [r for r in runs if r]
    if not runs:
        return {}
    out: dict = {}
    for key in runs[0]:
        fields = {f for r in runs if isinstance(r.get(key), dict) for f in r[key]}
        out[key] = {f: statistics.median([r[key][f] for r in runs if f in (r.get(key) or {})]) for f in fields}
    return out


def bench_peers(calls: int, quick: bool, skip_ipyparallel: bool = False, torchmonarch: dict | None = None) -> dict:
    out: dict = {"torchmonarch": None, "ipyparallel": None}
    python = _peers.peer_python()
    if python is None:
        return out
    tm = torchmonarch or run_actor_script(str(python), "monarch.actor", calls, quick)
    if tm is not None and not skip_ipyparallel:
        startup = _startup(str(python), "monarch.actor", 1 if quick else 3)
        tm["startup"] = startup
    out["torchmonarch"] = tm
    if not skip_ipyparallel:
        out["ipyparallel"] = _peers.run_peer(IPYPARALLEL.replace("CALLS", str(min(calls, 1000))))
    return out


# -- report ---------------------------------------------------------------------------------------
def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "not measured"
    if isinstance(value, float):
        return f"{value:,.1f}{unit}" if value >= 10 else f"{value:.3f}{unit}"
    return f"{value}{unit}"


_ROW_KEYS = {
    "call_one median (us)": ("call_one", "median_us"), "call_one p95 (us)": ("call_one", "p95_us"),
    "call to 4 median (us)": ("call_4", "median_us"), "call to 4 p95 (us)": ("call_4", "p95_us"),
    "1 MiB tensor round trip (GB/s)": ("tensor_1MiB", "gb_per_s"), "64 MiB tensor round trip (GB/s)": ("tensor_64MiB", "gb_per_s"),
    "2,000 broadcasts to 4, end to end (/s)": ("broadcast_e2e", "broadcasts_per_s"),
    "actor -> actor call_one median (us)": ("actor_to_actor", "median_us"),
    "actor -> actor: controller CPU a call (us)": ("actor_to_actor", "controller_cpu_us_per_call"),
    "10,000 values through a port (/s)": ("port_stream", "values_per_s"),
}


def _base_value(base: dict, label: str):
    key = _ROW_KEYS.get(label)
    return (base.get(key[0]) or {}).get(key[1]) if key else None


def print_table(results: dict) -> None:
    ours = results["monarch_nb"]
    peers = results["peers"]
    tm = peers.get("torchmonarch") or {}
    ipp = peers.get("ipyparallel") or {}

    def get(d, *path):
        for key in path:
            if not isinstance(d, dict) or key not in d:
                return None
            d = d[key]
        return d

    rows = [
        ("call_one median (us)", get(results, "raw_zmq", "median_us"), get(ours, "call_one", "median_us"),
         get(tm, "call_one", "median_us"), get(ipp, "call_one", "median_us")),
        ("call_one p95 (us)", get(results, "raw_zmq", "p95_us"), get(ours, "call_one", "p95_us"),
         get(tm, "call_one", "p95_us"), get(ipp, "call_one", "p95_us")),
        ("call to 4 median (us)", None, get(ours, "call_4", "median_us"), get(tm, "call_4", "median_us"), get(ipp, "call_4", "median_us")),
        ("call to 4 p95 (us)", None, get(ours, "call_4", "p95_us"), get(tm, "call_4", "p95_us"), get(ipp, "call_4", "p95_us")),
        ("1 MiB tensor round trip (GB/s)", None, get(ours, "tensor_1MiB", "gb_per_s"), get(tm, "tensor_1MiB", "gb_per_s"), None),
        ("64 MiB tensor round trip (GB/s)", None, get(ours, "tensor_64MiB", "gb_per_s"), get(tm, "tensor_64MiB", "gb_per_s"), None),
        ("2,000 broadcasts to 4, end to end (/s)", None, get(ours, "broadcast_e2e", "broadcasts_per_s"),
         get(tm, "broadcast_e2e", "broadcasts_per_s"), None),
        ("actor -> actor call_one median (us)", None, get(ours, "actor_to_actor", "median_us"), get(tm, "actor_to_actor", "median_us"), None),
        ("actor -> actor: controller CPU a call (us)", None, get(ours, "actor_to_actor", "controller_cpu_us_per_call"),
         get(tm, "actor_to_actor", "controller_cpu_us_per_call"), None),
        ("10,000 values through a port (/s)", None, get(ours, "port_stream", "values_per_s"), get(tm, "port_stream", "values_per_s"), None),
        ("spawn 4 procs -> first reply (s)", None, get(results, "startup", "median_s"), get(tm, "startup", "median_s"),
         get(ipp, "startup", "median_s")),
    ]
    base = results.get("baseline")
    if base is not None:
        rows = [(r[0], r[1], _base_value(base, r[0]), *r[2:]) for r in rows]
    header = ("metric", "raw pyzmq") + (("baseline",) if base is not None else ()) + ("monarch_nb", "torchmonarch", "ipyparallel")
    widths = [40, 14] + ([14] if base is not None else []) + [14, 14, 14]
    load = results.get("loadavg_before") or (0, 0, 0)
    print(f"\nactor latency — {os.cpu_count()} cores, {results['calls']} calls per latency row, "
          f"load average {load[0]:.2f} before, {(results.get('loadavg_after') or (0,))[0]:.2f} after")
    print("".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print(row[0].ljust(widths[0]) + "".join(_fmt(v).ljust(w) for v, w in zip(row[1:], widths[1:])))
    mem = results.get("memory") or {}
    if mem:
        print("\nmemory")
        print(f"  idle worker RSS over bare `import torch`: {_fmt(mem.get('idle_worker_over_bare_mb'), ' MB')} (target <= 60 MB)")
        print(f"  controller RSS growth over {mem.get('controller_rss_growth_calls')} calls: "
              f"{_fmt(mem.get('controller_rss_growth_mb'), ' MB')} (target < 20 MB)")
        print(f"  64 MiB round trip peak extra, in tensor copies: worker {_fmt(mem.get('tensor_64MiB_worker_peak_copies'))}, "
              f"controller {_fmt(mem.get('tensor_64MiB_controller_peak_copies'))} (target <= 2)")
    ratios = results["ratios"]
    print("\nratios")
    for key, value in ratios.items():
        print(f"  {key}: {_fmt(value)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls per latency measurement (default 2000)")
    parser.add_argument("--with-peers", action="store_true", help="create bench/.peers-venv if needed and measure torchmonarch and ipyparallel")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not for quoting)")
    parser.add_argument("--baseline", type=Path, help="another monarch_nb checkout (e.g. the commit before a change), measured in the same run")
    parser.add_argument("--repeat", type=int, default=1, help="run the actor script this many times per runtime, alternating "
                        "runtimes, and report per-figure medians (a shared machine's load comes and goes)")
    parser.add_argument("--actors-only", action="store_true", help="only the actor rows (no memory, start-up or ipyparallel)")
    parser.add_argument("--json", type=Path, default=RESULTS / "actor_latency.json", help="where to write the results")
    args = parser.parse_args(argv)
    if args.with_peers:
        _peers.ensure_peers_venv()
    results: dict = {"cores": os.cpu_count(), "calls": args.calls, "time": time.time(), "loadavg_before": os.getloadavg()}
    results["raw_zmq"] = bench_raw_zmq(args.calls)
    if not args.actors_only:
        results["startup"] = _startup(sys.executable, "monarch_nb", 1 if args.quick else 3, {"PYTHONPATH": str(ROOT)})
    runs: dict[str, list] = {"monarch_nb": [], "baseline": [], "torchmonarch": []}
    for _ in range(max(1, args.repeat)):  # alternate the runtimes, so each sees the same load
        runs["monarch_nb"].append(bench_monarch_nb(args.calls, args.quick))
        if args.baseline is not None:
            runs["baseline"].append(run_actor_script(sys.executable, "monarch_nb", args.calls, args.quick,
                                                     _baseline_env(args.baseline)) or {})
        if _peers.peer_python() is not None:
            runs["torchmonarch"].append(run_actor_script(str(_peers.peer_python()), "monarch.actor", args.calls, args.quick) or {})
    results["monarch_nb"] = median_of_runs(runs["monarch_nb"])
    if args.baseline is not None:
        results["baseline"] = median_of_runs(runs["baseline"])
    results["runs"] = runs
    if not args.actors_only:
        results["memory"] = bench_memory(args.quick)
    results["peers"] = (bench_peers(args.calls, args.quick, skip_ipyparallel=args.actors_only,
                                    torchmonarch=median_of_runs(runs["torchmonarch"])) if _peers.peer_python()
                        else {"torchmonarch": None, "ipyparallel": None})
    results["loadavg_after"] = os.getloadavg()
    ours = results["monarch_nb"]
    tm = results["peers"].get("torchmonarch") or {}
    def ratio(a, b):
        return a / b if a is not None and b else None

    def med(d, key, field="median_us"):
        return (d.get(key) or {}).get(field)

    results["ratios"] = {
        "call_one / raw pyzmq (target <= 2)": ratio(med(ours, "call_one"), results["raw_zmq"]["median_us"]),
        "call_one / torchmonarch (target <= 0.35)": ratio(med(ours, "call_one"), med(tm, "call_one")),
        "call to 4 / torchmonarch (target <= 0.5)": ratio(med(ours, "call_4"), med(tm, "call_4")),
        "broadcast end to end / torchmonarch (target >= 2)": ratio(med(ours, "broadcast_e2e", "broadcasts_per_s"),
                                                                   med(tm, "broadcast_e2e", "broadcasts_per_s")),
        "actor->actor / controller->actor call_one (target <= 1.5)": ratio(med(ours, "actor_to_actor"), med(ours, "call_one")),
        "torchmonarch: actor->actor / controller->actor": ratio(med(tm, "actor_to_actor"), med(tm, "call_one")),
        "port stream / torchmonarch (target >= 2)": ratio(med(ours, "port_stream", "values_per_s"), med(tm, "port_stream", "values_per_s")),
        "startup / torchmonarch (target <= 1)": ratio((results.get("startup") or {}).get("median_s"), (tm.get("startup") or {}).get("median_s")),
    }
    print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
