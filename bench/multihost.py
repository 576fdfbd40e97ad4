"""Multi-host figures across network namespaces: messaging against the raw pyzmq floor on the same
link, bulk transfer with and without CurveZMQ, mesh start-up, host-loss and partition detection.

    python bench/multihost.py [--calls 1000] [--trials 5] [--quick]     # needs root (namespaces)

Hosts are Linux network namespaces on this machine joined by a bridge (tests/netns_cluster.py),
each running a real worker loop; the controller is this process, in the root namespace.
Measured in one run:

- floor: raw pyzmq DEALER -> ROUTER echo between this process and a process in a host namespace
  (round trip of an empty message, and of a 64 MiB message);
- ``call_one`` to a proc on a remote host (target <= 2.5x the floor), with CurveZMQ and with plain
  HMAC-signed TCP;
- a 64 MiB tensor echoed by a remote actor (GB/s = tensor bytes / round trip; target >= 50% of the
  raw pyzmq bulk rate on the link), with and without CurveZMQ;
- a 2x2 mesh up and answering: attach 2 hosts, spawn 2 procs each, first call returns;
- detection of a lost host: its agent SIGKILLed, and its link cut (``ip link set ... down``),
  each from the act to the ``host_lost`` event (target <= hang_timeout_s + 1 s);
- training steady state (digits, no spares), each beside the same ranks on this host alone, run
  right before it: 2 hosts x 1 proc of a LocalJob (loopback) and of the namespace hosts
  (CurveZMQ), 2 namespace hosts x 2 procs.

Prints a table and writes bench/results/multihost.json. Times in microseconds unless named.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import monarch_nb  # noqa: E402
from monarch_nb import Actor, endpoint  # noqa: E402
from monarch_nb.runtime.controller import Controller  # noqa: E402
from monarch_nb.transport.keys import create_keys  # noqa: E402
from tests.netns_cluster import NetnsCluster, namespaces_unavailable  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MIB64 = 64 << 20


def summarize(samples_s: list[float]) -> dict:
    ordered = sorted(samples_s)
    return {"n": len(ordered), "median_us": statistics.median(ordered) * 1e6,
            "p95_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1e6}


ECHO_SERVER = """
import sys, zmq, zmq.auth
sock = zmq.Context().socket(zmq.ROUTER)
if len(sys.argv) > 2:  # CurveZMQ server with the cluster's certificate
    sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(sys.argv[2])
    sock.curve_server = True
sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    msg = sock.recv_multipart(copy=False)
    if msg[1].bytes == b"quit":
        break
    sock.send_multipart(msg, copy=False)
"""


def bench_floor(cluster: NetnsCluster, calls: int, bulk_rounds: int, curve_dir: str | None = None, port: int = 26700) -> dict:
    """Raw pyzmq echo to a process in host 0's namespace: plain, or CurveZMQ with ``curve_dir``'s keys."""
    import zmq

    from monarch_nb.transport.keys import load_trust

    address = f"tcp://{cluster.host_ip(0)}:{port}"
    argv = [sys.executable, "-c", ECHO_SERVER, address] + ([f"{curve_dir}/curve.key_secret"] if curve_dir else [])
    server = cluster.run_in(0, argv, stdout=subprocess.PIPE, text=True)
    server.stdout.readline()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_dir:
        trust = load_trust(curve_dir)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = trust.curve_public, trust.curve_public, trust.curve_secret
    sock.connect(address)
    try:
        for _ in range(50):
            sock.send(b"x")
            sock.recv()
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            sock.send(b"x")
            sock.recv()
            samples.append(time.perf_counter() - t0)
        payload = bytearray(os.urandom(1 << 20)) * 64
        bulk = []
        for _ in range(bulk_rounds):
            t0 = time.perf_counter()
            sock.send(payload, copy=False)
            sock.recv(copy=False)
            bulk.append(time.perf_counter() - t0)
        sock.send(b"quit")
    finally:
        sock.close(0)
    return {"rtt": summarize(samples), "bulk_64mib_gbps": MIB64 / statistics.median(bulk) / 1e9}


class Echo(Actor):
    @endpoint
    def ping(self) -> None:
        return None

    @endpoint
    def echo(self, value):
        return value

    @endpoint
    def ping_peer(self, peer, calls: int) -> list:
        """Time ``calls`` calls from this actor to ``peer`` (an actor mesh of one), seconds each."""
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            peer.ping.call_one().get(timeout=10)
            samples.append(time.perf_counter() - t0)
        return samples


def bench_mesh(workers: list[str], ca: str, calls: int, bulk_rounds: int) -> dict:
    import torch

    t0 = time.perf_counter()
    hosts = monarch_nb.attach_to_workers(workers, ca=ca)
    t_attach = time.perf_counter() - t0
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    echo = procs.spawn("echo", Echo)
    echo.ping.call().get(timeout=60)
    t_up = time.perf_counter() - t0
    remote = echo.slice(hosts=0, gpus=0)
    try:
        for _ in range(50):
            remote.ping.call_one().get(timeout=10)
        samples = []
        for _ in range(calls):
            t1 = time.perf_counter()
            remote.ping.call_one().get(timeout=10)
            samples.append(time.perf_counter() - t1)
        tensor = torch.randn(MIB64 // 4)
        remote.echo.call_one(tensor).get(timeout=60)
        bulk = []
        for _ in range(bulk_rounds):
            t1 = time.perf_counter()
            back = remote.echo.call_one(tensor).get(timeout=60)
            bulk.append(time.perf_counter() - t1)
        assert torch.equal(back, tensor)
        # actor -> actor across hosts: through the controller's hub (two hops)
        peer_samples = echo.slice(hosts=1, gpus=0).ping_peer.call_one(remote, calls).get(timeout=600)
    finally:
        procs.stop()
    return {"attach_s": t_attach, "mesh_2x2_up_s": t_up, "call_one": summarize(samples),
            "actor_to_actor_across_hosts": summarize(peer_samples),
            "tensor_64mib_gbps": MIB64 / statistics.median(bulk) / 1e9}


def bench_training(workers: list[str], ca: str, steps: int) -> dict:
    """digits, fault-free, no spares, each multi-host run right after its one-host peer: 2 ranks on
    2 hosts x 1 proc (a LocalJob's loopback workers; the namespace hosts, CurveZMQ) vs this host x
    2, and 4 ranks on the namespace hosts x 2 vs this host x 4."""
    from monarch_nb.job import LocalJob
    from monarch_nb.train import fit

    def figures(report) -> dict:
        return {"throughput_samples_per_s": report.throughput_samples_per_s, "step_ms_median": report.step_time_ms_median,
                "setup_s": report.setup_time_s, "replicas_identical": report.replicas_identical}

    def one_host(procs: int) -> dict:
        return figures(fit("digits", procs=procs, steps=steps, eval_every=0, progress=False, spares=0))

    out: dict = {"steps": steps}
    job = LocalJob({"hosts": 2})
    try:
        local = job.state(cached_path=None).hosts
        out["local_job_2x1"] = {"one_host": one_host(2), "hosts": figures(
            fit("digits", procs=1, steps=steps, eval_every=0, progress=False, spares=0, hosts=local))}
    finally:
        job.kill(cached_path=None)
    hosts = monarch_nb.attach_to_workers(workers, ca=ca)
    for name, per_host in (("netns_2x1", 1), ("netns_2x2", 2)):
        peer = one_host(2 * per_host)
        out[name] = {"one_host": peer, "hosts": figures(
            fit("digits", procs=per_host, steps=steps, eval_every=0, progress=False, spares=0, hosts=hosts))}
    for row in ("local_job_2x1", "netns_2x1", "netns_2x2"):
        r = out[row]
        r["ratio"] = r["hosts"]["throughput_samples_per_s"] / r["one_host"]["throughput_samples_per_s"]
    return out


def bench_detection(cluster: NetnsCluster, ca: str, trials: int) -> dict:
    from monarch_nb.supervision.records import ProcState

    hosts = monarch_nb.attach_to_workers(cluster.addresses, ca=ca)
    procs = hosts.spawn_procs(per_host={"gpus": 1})
    ctrl = Controller.get()
    out: dict = {"agent_kill_s": [], "partition_s": []}
    try:
        for _trial in range(trials):
            for how in ("agent_kill_s", "partition_s"):
                name = hosts.host_names[1]
                deadline = time.monotonic() + 60
                while ctrl.hosts[name].state != ProcState.HEALTHY and time.monotonic() < deadline:
                    time.sleep(0.05)
                since = ctrl.events.next_seq
                t0 = time.monotonic()
                if how == "agent_kill_s":
                    os.kill(ctrl.hosts[name].pid, 9)
                else:
                    cluster.cut(1)
                event = ctrl.events.wait_for(lambda e, name=name: e.kind == "host_lost" and e.host == name, 30, since)
                if how == "partition_s":
                    cluster.restore(1)
                out[how].append((event.monotonic - t0) if event is not None else float("inf"))
    finally:
        procs.stop()
    return {k: {"n": len(v), "median_s": statistics.median(v), "p95_s": sorted(v)[min(len(v) - 1, int(len(v) * 0.95))],
                "samples_s": v} for k, v in out.items()}


def run_all(args: argparse.Namespace, folder: str) -> dict:
    """Every figure, with the cluster's keys made in ``folder``."""
    curve, plain = create_keys(f"{folder}/curve"), create_keys(f"{folder}/plain.key", curve=False)
    results: dict = {"cores": os.cpu_count(), "hang_timeout_s": 1.0, "heartbeat_interval_s": 0.1}
    with_curve = NetnsCluster(2, curve).start()
    try:
        results["floor"] = bench_floor(with_curve, args.calls, args.bulk)
        results["floor_curve"] = bench_floor(with_curve, args.calls, args.bulk, curve_dir=curve, port=26701)
        results["curve"] = bench_mesh(with_curve.addresses, curve, args.calls, args.bulk)
        results["training"] = bench_training(with_curve.addresses, curve, args.steps)
        Controller.get().shutdown()
        results["detection"] = bench_detection(with_curve, curve, args.trials)
        Controller.get().shutdown()
    finally:
        with_curve.close()
    without = NetnsCluster(2, plain).start()
    try:
        results["plain"] = bench_mesh(without.addresses, plain, args.calls, args.bulk)
        Controller.get().shutdown()
    finally:
        without.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="round trips per latency figure (default 1000)")
    parser.add_argument("--bulk", type=int, default=5, help="64 MiB round trips per throughput figure (default 5)")
    parser.add_argument("--trials", type=int, default=5, help="host losses per detection figure (default 5)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per steady-state figure (default 400)")
    parser.add_argument("--quick", action="store_true", help="200 calls, 3 bulk rounds, 2 trials, 150 steps")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.bulk, args.trials, args.steps = 200, 3, 2, 150
    why = namespaces_unavailable()
    if why is not None:
        print(f"bench/multihost.py: {why}", file=sys.stderr)
        return 2
    monarch_nb.configure(heartbeat_interval_s=0.1, hang_timeout_s=1.0)
    folder = tempfile.mkdtemp(prefix="mnb-bench-keys-")
    try:
        results = run_all(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    floor_us = results["floor"]["rtt"]["median_us"]
    floor_bulk = results["floor"]["bulk_64mib_gbps"]
    rows = [
        ("raw pyzmq round trip (floor), us", f"{floor_us:.0f}", f"p95 {results['floor']['rtt']['p95_us']:.0f}", ""),
        ("raw pyzmq 64 MiB round trip, GB/s", f"{floor_bulk:.2f}", "", ""),
        ("raw pyzmq CurveZMQ 64 MiB round trip, GB/s", f"{results['floor_curve']['bulk_64mib_gbps']:.2f}", "",
         "(the cost of encryption itself)"),
    ]
    for mode in ("curve", "plain"):
        r = results[mode]
        ratio = r["call_one"]["median_us"] / floor_us
        rows.append((f"call_one to a remote proc ({mode}), us", f"{r['call_one']['median_us']:.0f}",
                     f"p95 {r['call_one']['p95_us']:.0f}", f"{ratio:.2f}x floor (target <= 2.5x)"))
        a2a = r["actor_to_actor_across_hosts"]
        rows.append((f"actor -> actor across hosts ({mode}), us", f"{a2a['median_us']:.0f}", f"p95 {a2a['p95_us']:.0f}",
                     f"{a2a['median_us'] / r['call_one']['median_us']:.2f}x controller -> actor (via the hub)"))
        rows.append((f"64 MiB tensor round trip ({mode}), GB/s", f"{r['tensor_64mib_gbps']:.2f}", "",
                     f"{r['tensor_64mib_gbps'] / floor_bulk:.0%} of raw (target >= 50%)"))
        rows.append((f"2x2 mesh up and answering ({mode}), s", f"{r['mesh_2x2_up_s']:.2f}", f"attach {r['attach_s']:.2f}", ""))
    for how in ("agent_kill_s", "partition_s"):
        d = results["detection"][how]
        rows.append((f"host lost: {how[:-2].replace('_', ' ')}, s", f"{d['median_s']:.2f}", f"p95 {d['p95_s']:.2f}",
                     "target <= hang_timeout_s + 1 = 2.0"))
    t = results["training"]
    for row, what in (("local_job_2x1", "LocalJob 2 hosts x 1 proc (loopback)"), ("netns_2x1", "2 namespace hosts x 1 proc"),
                      ("netns_2x2", "2 namespace hosts x 2 procs")):
        r = t[row]
        ranks = 4 if row == "netns_2x2" else 2
        rows.append((f"training digits, {what}, samples/s", f"{r['hosts']['throughput_samples_per_s']:.0f}",
                     f"step {r['hosts']['step_ms_median']:.1f} ms",
                     f"{r['ratio']:.2f}x 1 host x {ranks} procs ({r['one_host']['throughput_samples_per_s']:.0f}; "
                     "target >= 0.9x)"))
    width = max(len(r[0]) for r in rows)
    print(f"multihost, 2 namespace hosts on {os.cpu_count()} cores, hang_timeout_s 1.0")
    for name, value, extra, target in rows:
        print(f"  {name:<{width}}  {value:>8}  {extra:<14} {target}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "multihost.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS / 'multihost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
