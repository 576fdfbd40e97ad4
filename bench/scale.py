"""The control plane's cost as procs grow: real procs on this machine, the controller measured.

    python bench/scale.py [--procs 4,16,64,128] [--calls 50] [--idle-s 10] [--quick] [--heartbeats both]
        [--simulated 1,8,64,1024] [--per-host 8] [--paths direct,agents,tree]
    python bench/scale.py --baseline CHECKOUT [--procs 4,128] [--calls 60] [--repeat 2]

Both liveness paths in one run, each in its own controller process: ``agents`` (today's
default: procs heartbeat to their host agent, which sums them up in one message per interval,
monarch_nb.runtime.heartbeat_relay) and ``direct`` (``MONARCH_NB_HEARTBEATS_VIA_AGENTS=0``:
every proc heartbeats to the controller, as before issue 25). For each size N: N real procs on
this host (one mesh, ``preload=()``: each a fresh interpreter, as the issue's table was measured;
no fork server) with a trivial actor, then:

- spawn -> first reply: from ``spawn_procs`` to the first call-to-all's answer (actor spawned);
- controller CPU, idle: the controller process's user+system CPU time (``getrusage``: every thread
  of this process: the IO thread that takes heartbeats, the supervisor, and this idle main
  thread) over ``--idle-s`` seconds while the procs sit idle, as % of one core; with the
  heartbeats sent in that time (4 per proc per second), the CPU per heartbeat; the messages the
  controller received per second, the host agent's CPU (``/proc/PID/stat``: where the
  relay's work goes) and the procs' own, all of them together (what an idle mesh costs the machine);
- call to all: ``actors.ping.call().get()`` round trips, p50/p95 over ``--calls``, and the CPU
  they took: the controller's (``getrusage``) and the procs' (every thread, ``schedstat``) per call;
  beside it the floor: the same call to all over plain pyzmq between as many bare Python
  processes (``raw_call_all_floor``: no signing, pickling or actor), and the wire floor: the
  same processes verifying, unpickling, answering and signing with monarch_nb's own message code
  (``wire.decode``/``encode``), on one thread, without its runtime (``WIRE_WORKER``), and that
  wire floor again over Unix ``SOCK_SEQPACKET`` socketpairs instead of ZeroMQ
  (``packet_call_all_floor``: no libzmq IO thread between a process's socket and its Python);
- SIGKILL seen: a rank's process killed (by pid) to its ``proc_exited`` event, one sample;
- SIGSTOP seen: another rank stopped (by pid) to its ``proc_hung`` event, one sample (the hang
  timeout, 2 s by default, plus the detection delay).

Then, in this process, the real controller against **simulated hosts** (``--simulated``, hosts of
8 procs: 1 / 8 / 64 / 1,024 hosts = 8 / 64 / 512 / 8,192 procs): bench/_sim_hosts.py, one
process speaking the host-agent protocol for every host (hello, heartbeats carrying their procs
as heard, a proc's exit), signed as real agents' messages are; the hosts are registered with the
controller as attached hosts are (judged for silence, sent the controller's heartbeats), the procs
as the controller's records of a mesh with the ``isolate`` policy, and each proc is a connection
of its own to the controller that answers a trivial actor's constructor and calls
(``_sim_hosts.SimProcs``: one socket in the simulator, one peer per proc for the controller). Real:
the controller, its sockets, every message it receives and sends, its liveness, supervision and
messaging code. Simulated: the procs themselves (no process; the one simulator process answers
for all of them, on the same 2 cores) and their actors. For each size: controller CPU idle (% of
a core, ``getrusage`` over ``--idle-s``), messages received per second (the agents' heartbeats,
each every second interval as an idle agent's), CPU per agent heartbeat received (the
controller's own heartbeats to the hosts included), procs wrongly declared hung meanwhile (must
be 0); spawn of the trivial actor to its first call-to-all's answer, call to all p50/p95 and the
controller's CPU per call to all, cast (``broadcast``: from the call to the moment the simulator
holds it for every proc) p50/p95 and the controller's CPU per cast (both less its idle share), the
CPU of the thread that sends a cast (``thread_time`` around ``broadcast``: the controller's own
work per cast, unmixed with its IO thread's) and, on the tree path, its messages down the tree
and the parts sent again straight (a member that left its relay);
one host silenced -> its ``host_lost`` event, one proc's exit -> its ``proc_exited`` event; and
how many hosts that were not silenced were lost anyway over the whole run ("others lost": a
simulated host whose heartbeats came later than the hang timeout allows, the simulator being one
process for every host on the controller's 2 cores; a lost simulated host is not attached again).

Each size runs on up to four paths (``--paths``): ``direct`` (every simulated proc heartbeats
and answers straight), ``agents`` (one heartbeat per host, casts through the hosts), ``tree``
(from ``relay_min_hosts`` hosts: the agents' heartbeats also through the relay tree, casts
down it and a call to all's gathered replies up it, merged by each relay,
monarch_nb.runtime.relay; the simulator's relays and members are the real AgentRelay,
RelayMember and ReplyMerge, its relays pass casts on and replies up over their real sockets),
``tree-down`` (the tree with each host's gathered replies straight to the controller, as before
replies went up the tree: the same-run baseline for that step). On the tree
path it also records when the tree formed (every relay ready, every placed member heard through
its relay), then silences one relay: how soon its members heartbeat straight, when the relay is
lost, and that none of its members is lost wrongly.

``--baseline CHECKOUT`` runs only a same-run comparison with another monarch_nb checkout (the
code before a change, or the commit an issue started from): for each ``--procs`` size, a script
that uses only the public API (:data:`SAME_API_SCRIPT`: spawn N procs, a call to all of a
trivial actor, ``--calls`` timed after 20 warm ones) runs on this checkout and on CHECKOUT in
turns, ``--repeat`` times each, and reports the call's p50 and every proc thread's CPU per call
(``schedstat``): the actors' threads, the proc's IO thread (its main thread), libzmq's IO thread,
with their run periods (wake-ups) per call. Figures of two days' machines differ by more than
most changes do (this machine's call to all of 128 procs: 35-38 ms one day, 41-53 another), so
a before/after is only read from one run.

What this does not do: a peer in the same run (torchmonarch's figures on real hosts are Monarch
PR #4875's; ipyparallel's broadcast is in bench/actor_latency.py). Prints tables and writes bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import resource
import signal
import statistics
import struct
import subprocess
import threading
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _peers  # noqa: E402
import monarch_nb  # noqa: E402
from monarch_nb import Actor, endpoint  # noqa: E402
from monarch_nb.config import config  # noqa: E402
from monarch_nb.runtime.controller import Controller  # noqa: E402
from monarch_nb.runtime.protocol import CallHeader  # noqa: E402
from monarch_nb.runtime.hosts import LOCAL  # noqa: E402

RESULTS = ROOT / "bench" / "results"


class Ping(Actor):
    @endpoint
    def ping(self) -> int:
        return 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_cpu_s(pid: int) -> float:
    """User+system CPU seconds of process ``pid`` (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_ns(pid: int) -> int:
    """CPU nanoseconds of process ``pid``, every thread (``/proc/PID/task/*/schedstat``: exact,
    where /proc/PID/stat counts 10 ms ticks, too coarse for a proc's share of a few calls)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process ended meanwhile
        return 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total


RAW_WORKER = """
import sys, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.IDENTITY, sys.argv[2].encode())
sock.connect(sys.argv[1])
sock.send(b"ready")
while (message := sock.recv()) != b"quit":
    sock.send(message)
"""

#: The wire floor's worker: monarch_nb's own message code, nothing of its runtime. It verifies and
#: reads each call (``wire.decode``: HMAC-SHA256, marshal header), unpickles its arguments, calls a
#: function, pickles the result and sends a signed reply (``wire.encode``), on one thread: no
#: receive lease, mailbox, actor host or second thread.
WIRE_WORKER = """
import os, pickle, sys, zmq
from monarch_nb.transport.wire import Signer, decode, encode
signer = Signer(bytes.fromhex(sys.argv[3]))
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.IDENTITY, sys.argv[2].encode())
sock.connect(sys.argv[1])
sock.send(b"ready")
endpoints, seq = {"ping": os.getpid}, 0
while (frames := sock.recv_multipart())[0] != b"quit":
    header, body, buffers = decode(signer, frames)
    args, kwargs = pickle.loads(body)
    result = endpoints[header["ep"]](*args, **kwargs)
    seq += 1
    reply = {"kind": "reply", "cid": header["cid"], "idx": header["idx"], "ok": True, "src": sys.argv[2], "dst": header["src"], "seq": seq}
    sock.send_multipart(encode(signer, reply, pickle.dumps(result, 5)))
"""


#: The wire floor's worker over a Unix ``SOCK_SEQPACKET`` socket (an inherited socketpair end)
#: instead of ZeroMQ: the same message code, each message one packet (``frame_packet``), a
#: blocking ``recv`` on the one thread: no libzmq IO thread between the socket and Python.
PACKET_WORKER = """
import os, pickle, socket, struct, sys
from monarch_nb.transport.wire import Signer, decode, encode
signer = Signer(bytes.fromhex(sys.argv[3]))
sock = socket.socket(fileno=int(sys.argv[1]))
def frames_of(packet):
    count = packet[0]
    view, at, frames = memoryview(packet), 1 + 4 * count, []
    for size in struct.unpack_from(f"<{count}I", packet, 1):
        frames.append(view[at:at + size])
        at += size
    return frames
sock.send(b"ready")
endpoints, seq = {"ping": os.getpid}, 0
while (packet := sock.recv(1 << 16)) != b"quit":
    header, body, buffers = decode(signer, frames_of(packet))
    args, kwargs = pickle.loads(body)
    result = endpoints[header["ep"]](*args, **kwargs)
    seq += 1
    reply = {"kind": "reply", "cid": header["cid"], "idx": header["idx"], "ok": True, "src": sys.argv[2], "dst": header["src"], "seq": seq}
    frames = [bytes(f) for f in encode(signer, reply, pickle.dumps(result, 5))]
    sock.send(bytes([len(frames)]) + struct.pack(f"<{len(frames)}I", *map(len, frames)) + b"".join(frames))
"""


def _floor_env() -> dict[str, str]:
    """The floors' workers' environment: this checkout's ``monarch_nb`` first on their path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _floor_call_header(call: int, index: int, dst: str, seq: int) -> CallHeader:
    """The header of the wire floors' ``call``-th call to worker ``index`` (as a proc's call header)."""
    return {"kind": "call", "ep": "ping", "cid": f"c{call}", "idx": index, "src": "controller", "dst": dst, "seq": seq,
            "reply_to": "controller"}


def _end_floor_workers(workers: list[subprocess.Popen]) -> None:
    """Wait for the floors' workers (told to quit) to exit; kill one that does not within 10 s."""
    for worker in workers:
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def frame_packet(frames: list) -> bytes:
    """Frames as one packet: their count (1 byte), their sizes (``<u32`` each), their bytes."""
    frames = [bytes(f) for f in frames]
    return bytes([len(frames)]) + struct.pack(f"<{len(frames)}I", *map(len, frames)) + b"".join(frames)


def packet_frames(packet: bytes) -> list[bytes]:
    """:func:`frame_packet` undone."""
    count, at, frames = packet[0], 1 + 4 * packet[0], []
    for size in struct.unpack_from(f"<{count}I", packet, 1):
        frames.append(packet[at:at + size])
        at += size
    return frames


def packet_call_all_floor(n: int, calls: int) -> float:
    """p50 seconds of the wire floor's call to all (:func:`raw_call_all_floor` with ``wire``) over
    Unix ``SOCK_SEQPACKET`` socketpairs instead of ZeroMQ (:data:`PACKET_WORKER`): what the same
    message code costs when no libzmq IO thread stands between each process's socket and its
    Python thread (two thread hand-offs a message in each process; docs/scale.md)."""
    import selectors
    import socket

    from monarch_nb.transport.wire import Signer, decode, encode
    key = os.urandom(32)
    signer = Signer(key)
    env = _floor_env()
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(n)]
    workers = []
    try:
        for i, (_, theirs) in enumerate(pairs):
            workers.append(subprocess.Popen([sys.executable, "-c", PACKET_WORKER, str(theirs.fileno()), f"w{i}", key.hex()],
                                            env=env, pass_fds=[theirs.fileno()]))
            theirs.close()
        ours = [mine for mine, _ in pairs]
        selector = selectors.DefaultSelector()
        for sock in ours:
            sock.settimeout(120)
            if sock.recv(16) != b"ready":
                raise RuntimeError("a packet floor worker did not start")
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        body, samples, seq = pickle.dumps(((), {}), 5), [], 0
        for call in range(calls + 5):
            t0 = time.perf_counter()
            for index, sock in enumerate(ours):
                seq += 1
                sock.send(frame_packet(encode(signer, _floor_call_header(call, index, f"w{index}", seq), body)))
            answered = 0
            while answered < n:
                for key_, _ in selector.select(120):
                    decode(signer, packet_frames(key_.fileobj.recv(1 << 16)))  # type: ignore[union-attr]
                    answered += 1
            samples.append(time.perf_counter() - t0)
        for sock in ours:
            sock.setblocking(True)
            sock.send(b"quit")
    finally:
        _end_floor_workers(workers)
        for mine, _ in pairs:
            mine.close()
    return statistics.median(samples[5:])


def raw_call_all_floor(n: int, calls: int, *, wire: bool = False) -> float:
    """p50 seconds of a call to all over plain pyzmq, the floor under ``measure``'s: ``n`` Python
    processes, each a DEALER that sends back what it receives, and a ROUTER here sending each a
    200-byte message and taking the ``n`` answers (ipc, as a proc's link to a controller on its
    host). No signing, no pickling, no actor: what the processes and ZeroMQ alone cost on this machine.

    ``wire``: the wire floor instead (:data:`WIRE_WORKER`): each call a signed monarch_nb message
    (``wire.encode`` here, a pickled ``((), {})`` body), verified, unpickled, answered with a signed
    reply, which this side verifies: what a proc's message costs without monarch_nb's runtime
    around it (the headroom a leaner proc could win; docs/scale.md).
    """
    import zmq

    from monarch_nb.transport.wire import Signer, decode, encode
    address = f"ipc://{tempfile.gettempdir()}/monarch_nb-bench-floor-{os.getpid()}"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(address)
    key = os.urandom(32)
    signer = Signer(key)
    worker = WIRE_WORKER if wire else RAW_WORKER
    env = _floor_env()
    workers = [subprocess.Popen([sys.executable, "-c", worker, address, f"w{i}", key.hex()], env=env) for i in range(n)]
    try:
        if not router.poll(120_000):
            raise RuntimeError("the floor's pyzmq workers did not start within 120 s")
        peers = [router.recv_multipart()[0]]
        while len(peers) < n and router.poll(120_000):
            peers.append(router.recv_multipart()[0])
        if len(peers) < n:
            raise RuntimeError(f"{len(peers)} of {n} of the floor's pyzmq workers started within 120 s")
        message, samples, body, seq = b"x" * 200, [], pickle.dumps(((), {}), 5), 0
        for call in range(calls + 5):
            t0 = time.perf_counter()
            for index, peer in enumerate(peers):
                if wire:
                    seq += 1
                    router.send_multipart([peer, *encode(signer, _floor_call_header(call, index, peer.decode(), seq), body)])
                else:
                    router.send_multipart([peer, message])
            for _ in peers:
                frames = router.recv_multipart()
                if wire:
                    decode(signer, frames[1:])
            samples.append(time.perf_counter() - t0)
        for peer in peers:
            router.send_multipart([peer, b"quit"])
    finally:
        _end_floor_workers(workers)
        router.close(linger=0)
        with contextlib.suppress(OSError):
            os.unlink(address.removeprefix("ipc://"))
    return statistics.median(samples[5:])


#: A call to all of N real procs through the public API only (it runs on older checkouts too):
#: ``python -c SAME_API_SCRIPT N CALLS`` prints one JSON line.
SAME_API_SCRIPT = """
import json, os, statistics, sys, time
from monarch_nb import Actor, endpoint, this_host

class Ping(Actor):
    @endpoint
    def ping(self):
        return os.getpid()

def threads(pids):
    cpu, periods = {"actor": 0, "io": 0, "libzmq": 0}, {"actor": 0, "io": 0, "libzmq": 0}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ran_ns, _, slices = map(int, f.read().split())
            except (OSError, ValueError):
                continue
            kind = "libzmq" if name.startswith("ZMQbg") else "io" if int(tid) == pid else "actor"
            cpu[kind] += ran_ns
            periods[kind] += slices
    return cpu, periods

n, calls = int(sys.argv[1]), int(sys.argv[2])
procs = this_host().spawn_procs(per_host={"gpus": n})
try:
    actors = procs.spawn("ping", Ping)
    pids = sorted({pid for _, pid in actors.ping.call().get().items()})
    for _ in range(20):
        actors.ping.call().get()
    time.sleep(1.0)
    cpu0, periods0, own0 = *threads(pids), time.process_time()
    rtts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        actors.ping.call().get()
        rtts.append(time.perf_counter() - t0)
    own = time.process_time() - own0
    cpu, periods = threads(pids)
finally:
    procs.stop()
rtts.sort()
print(json.dumps({"procs": n, "call_all_p50_ms": 1e3 * statistics.median(rtts), "call_all_p95_ms": 1e3 * rtts[int(0.95 * (len(rtts) - 1))],
                  "controller_cpu_per_call_all_ms": 1e3 * own / calls,
                  "proc_thread_cpu_us_per_call": {k: (cpu[k] - cpu0[k]) / 1e3 / calls / n for k in cpu},
                  "proc_thread_periods_per_call": {k: (periods[k] - periods0[k]) / calls / n for k in periods}}))
"""


def same_api_call_all(checkout: Path, n: int, calls: int) -> dict:
    """:data:`SAME_API_SCRIPT` on ``checkout``'s monarch_nb at ``n`` procs; its JSON.

    Raises:
        RuntimeError: the script failed (its stderr's end is printed above).
    """
    result = _peers.run_json_script(sys.executable, SAME_API_SCRIPT, (str(n), str(calls)), env_extra={"PYTHONPATH": str(checkout.resolve())},
                                    label=f"the call to all of {n} procs on {checkout}", timeout_s=1800)
    if result is None:
        raise RuntimeError(f"the call to all of {n} procs on {checkout} failed (see above)")
    return result


def compare_with_baseline(baseline: Path, sizes: list[int], calls: int, repeat: int) -> list[dict]:
    """Each size on this checkout and on ``baseline`` in turns, ``repeat`` times; per size and
    checkout the median of each figure over the repeats, the runs kept under ``runs``."""
    rows = []
    for n in sizes:
        runs: dict[str, list[dict]] = {"this": [], "baseline": []}
        for _ in range(repeat):
            runs["this"].append(same_api_call_all(ROOT, n, calls))
            runs["baseline"].append(same_api_call_all(baseline, n, calls))
        for which, done in runs.items():
            row: dict = {"procs": n, "code": which, "checkout": str(ROOT if which == "this" else baseline.resolve())}
            for key in ("call_all_p50_ms", "call_all_p95_ms", "controller_cpu_per_call_all_ms"):
                row[key] = statistics.median(r[key] for r in done)
            for key in ("proc_thread_cpu_us_per_call", "proc_thread_periods_per_call"):
                row[key] = {kind: statistics.median(r[key][kind] for r in done) for kind in ("actor", "io", "libzmq")}
            rows.append({**row, "runs": done})
    return rows


def _print_comparison(rows: list[dict]) -> None:
    print(f"{'procs':>6} {'code':>9} {'call-all p50 ms':>16} {'p95 ms':>8} {'ctrl CPU/call ms':>17} "
          f"{'actor us (runs)':>16} {'proc IO us (runs)':>18} {'libzmq us (runs)':>17}   (per proc and call; medians)")
    for r in rows:
        cpu, periods = r["proc_thread_cpu_us_per_call"], r["proc_thread_periods_per_call"]
        print(f"{r['procs']:>6} {r['code']:>9} {r['call_all_p50_ms']:>16.2f} {r['call_all_p95_ms']:>8.2f} "
              f"{r['controller_cpu_per_call_all_ms']:>17.2f} "
              + " ".join(f"{f'{cpu[k]:.0f} ({periods[k]:.1f})':>{w}}" for k, w in (("actor", 16), ("io", 18), ("libzmq", 17))))


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
        agent = ctrl.hosts[LOCAL].pid
        pids = [ctrl.proc_record(procs.name, rank).pid for rank in range(n)]
        received0 = sum(ctrl.channel.received.values())
        cpu0, agent0, procs0, w0 = _cpu_s(), _proc_cpu_s(agent), sum(map(_proc_cpu_s, pids)), time.perf_counter()
        time.sleep(idle_s)
        cpu, agent_cpu, wall = _cpu_s() - cpu0, _proc_cpu_s(agent) - agent0, time.perf_counter() - w0
        procs_cpu = sum(map(_proc_cpu_s, pids)) - procs0
        messages = sum(ctrl.channel.received.values()) - received0
        rtts = []
        cpu0, procs0 = _cpu_s(), sum(map(_proc_cpu_ns, pids))
        for _ in range(calls):
            c0 = time.perf_counter()
            actors.ping.call().get(timeout=60)
            rtts.append(time.perf_counter() - c0)
        call_cpu, procs_call_cpu = _cpu_s() - cpu0, (sum(map(_proc_cpu_ns, pids)) - procs0) / 1e9
        victim = ctrl.proc_record(procs.name, n - 1)
        since = ctrl.events.next_seq
        k0 = time.perf_counter()
        os.kill(victim.pid, signal.SIGKILL)
        seen = ctrl.events.wait_for(lambda e: e.kind == "proc_exited" and e.rank == n - 1, 30, since)
        kill_s = time.perf_counter() - k0 if seen is not None else float("nan")
        stopped = ctrl.proc_record(procs.name, 0)
        since = ctrl.events.next_seq
        s0 = time.perf_counter()
        os.kill(stopped.pid, signal.SIGSTOP)
        seen = ctrl.events.wait_for(lambda e: e.kind == "proc_hung" and e.rank == 0, 30, since)
        hang_s = time.perf_counter() - s0 if seen is not None else float("nan")
    finally:
        procs.stop()
    return {"procs": n, "heartbeats": "agents" if config.heartbeats_via_agents else "direct",
            "spawn_to_first_reply_s": spawn_s, "controller_cpu_idle_pct": 100 * cpu / wall,
            "cpu_per_heartbeat_us": 1e6 * cpu / heartbeats if heartbeats else float("nan"),
            "controller_messages_per_s_idle": messages / wall, "agent_cpu_idle_pct": 100 * agent_cpu / wall,
            "procs_cpu_idle_pct": 100 * procs_cpu / wall, "sigstop_seen_s": hang_s,
            "call_all_p50_ms": 1e3 * statistics.median(rtts), "call_all_p95_ms": 1e3 * _pct(rtts, 0.95),
            "controller_cpu_per_call_all_ms": 1e3 * call_cpu / calls, "procs_cpu_per_call_all_ms": 1e3 * procs_call_cpu / calls,
            "sigkill_seen_ms": 1e3 * kill_s}


def _run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    """Measure ``mode`` ("agents" or "direct") in a fresh controller process; its rows."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        flag = "1" if mode == "agents" else "0"  # heartbeats and the controller's messages both
        env = dict(os.environ, MONARCH_NB_HEARTBEATS_VIA_AGENTS=flag, MONARCH_NB_MESSAGES_VIA_AGENTS=flag)
        subprocess.run([sys.executable, __file__, "--procs", args.procs, "--calls", str(args.calls), "--idle-s", str(args.idle_s),
                        "--heartbeats", mode, "--rows-to", out.name], env=env, check=True)
        return json.loads(Path(out.name).read_text())


def _answer(future, sim: subprocess.Popen, timeout_s: float):
    """``future``'s value, within ``timeout_s``; RuntimeError at once if the simulator exited
    meanwhile (out of memory, a crash: it said why on stderr), not after the whole timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            if sim.poll() is not None:
                raise RuntimeError(f"the simulated hosts exited (code {sim.returncode}) before answering") from None
            if time.monotonic() >= deadline:
                raise


def _simulated_calls(procs, sim: subprocess.Popen, calls: int, idle_cpu: float) -> dict:
    """Spawn a trivial actor on the simulated procs, then ``calls`` calls to all and as many
    broadcasts (casts), end to end, with the controller's CPU for each (its CPU over the
    operation, less its idle share ``idle_cpu``, a fraction of a core, over that time)."""
    t0 = time.perf_counter()
    actors = procs.spawn("ping", Ping)
    _answer(actors.ping.call(), sim, 600)
    first_s = time.perf_counter() - t0
    rtts, cpu0, w0 = [], _cpu_s(), time.perf_counter()
    for _ in range(calls):
        c0 = time.perf_counter()
        _answer(actors.ping.call(), sim, 120)
        rtts.append(time.perf_counter() - c0)
    call_cpu = (_cpu_s() - cpu0 - idle_cpu * (time.perf_counter() - w0)) / calls
    casts, sending = [], []
    assert sim.stdout is not None
    channel = Controller.get().channel
    relayed0, resent0 = channel.sent_via_relays, channel.resent_relayed
    cpu0, w0 = _cpu_s(), time.perf_counter()
    for n in range(1, calls + 1):
        c0, t0 = time.monotonic(), time.thread_time()
        actors.ping.broadcast()
        sending.append(time.thread_time() - t0)  # the calling thread signs and sends the cast's messages
        line = sim.stdout.readline().split()  # "cast N T": every simulated proc got broadcast N at T
        if line[:2] != ["cast", str(n)]:
            raise RuntimeError(f"simulated hosts said {line!r}, not cast {n}")
        casts.append(float(line[2]) - c0)
    cast_cpu = (_cpu_s() - cpu0 - idle_cpu * (time.perf_counter() - w0)) / calls
    return {"spawn_to_first_reply_s": first_s, "call_all_p50_ms": 1e3 * statistics.median(rtts),
            "call_all_p95_ms": 1e3 * _pct(rtts, 0.95), "controller_cpu_per_call_all_ms": 1e3 * call_cpu,
            "cast_p50_ms": 1e3 * statistics.median(casts), "cast_p95_ms": 1e3 * _pct(casts, 0.95),
            "controller_cpu_per_cast_ms": 1e3 * cast_cpu, "sending_cpu_per_cast_ms": 1e3 * statistics.median(sending),
            "tree_messages_per_cast": (channel.sent_via_relays - relayed0) / calls,
            "tree_parts_resent": channel.resent_relayed - resent0}


def _ms_pair(row: dict) -> str:
    wall, cpu = row.get("host_lost_handling_ms"), row.get("host_lost_handling_cpu_ms")
    return "-" if wall is None or cpu is None else f"{wall:.1f} ({cpu:.1f})"


class _HostLostTimer:
    """Times the controller's handling of the next lost host (``Liveness.host_lost``: its procs
    failed, their peers told, the supervisor called), on the thread that handles it."""

    def __init__(self, liveness) -> None:
        self._liveness, self._original, self._done = liveness, liveness.host_lost, threading.Event()
        self.figures: tuple[float, float] | None = None
        liveness.host_lost = self._timed

    def _timed(self, host: str, why: str) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._original(host, why)
        finally:
            self.figures = (1e3 * (time.perf_counter() - t0), 1e3 * (time.thread_time() - c0))
            self._liveness.host_lost = self._original
            self._done.set()

    def wait(self, timeout_s: float) -> tuple[float, float] | None:
        """``(wall ms, CPU ms)`` of the handling, or None if no host was lost in time."""
        return self.figures if self._done.wait(timeout_s) else None


def _relay_lost(ctrl, names: list[str], sim: subprocess.Popen) -> dict:
    """Silence one relay of the tree: when it is lost, when all its members heartbeat straight
    again (on their own, :data:`~monarch_nb.runtime.relay.RELAY_SILENT_INTERVALS` intervals after
    its last beat), and how many of them were lost meanwhile (must be 0)."""
    tree = ctrl.host_agents.tree
    relay = next(name for name in names if name in tree.relays)
    members = sorted(m for m, r in tree.relay_of.items() if r == relay)
    since = ctrl.events.next_seq
    t0 = time.perf_counter()
    assert sim.stdin is not None
    sim.stdin.write(f"silence {relay}\n")
    sim.stdin.flush()
    straight_s, deadline = float("nan"), time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(not ctrl.hosts[m].via_relay for m in members):
            straight_s = time.perf_counter() - t0
            break
        time.sleep(0.005)
    # who was not (member -> the relay it was last heard through): the JSON is all there is to read afterwards
    not_straight = {m: ctrl.hosts[m].via_relay for m in members if ctrl.hosts[m].via_relay}
    lost = ctrl.events.wait_for(lambda e: e.kind == "host_lost" and e.host == relay, 30, since)
    lost_s = time.perf_counter() - t0 if lost is not None else float("nan")
    time.sleep(config.hang_timeout_s)  # a member wrongly lost would be lost by now
    wrongly = [e.host for e in ctrl.events.events("host_lost", since_seq=since) if e.host in members]
    return {"relay": relay, "relay_members": len(members), "relay_lost_s": lost_s, "relay_members_straight_s": straight_s,
            "relay_members_wrongly_lost": len(wrongly), "relay_members_not_straight": not_straight}


def _path_name(row: dict) -> str:
    """A simulated row's path: direct, agents, agents+tree-down, agents+tree."""
    if not row["relay_tree"]:
        return row["messages"]
    return row["messages"] + ("+tree" if row.get("replies_up_tree", False) else "+tree-down")


def measure_simulated(hosts: int, per_host: int, idle_s: float, calls: int = 20, via_agents: bool = True,
                      relays: bool = False, replies_up: bool = True) -> dict:
    """The controller against ``hosts`` simulated hosts of ``per_host`` procs (bench/_sim_hosts.py);
    ``via_agents``: the procs are linked to their agents (the controller's messages go through
    them, one per host for a cast or a call to all), as real procs are since issue 25's step 2;
    ``relays``: the hosts' heartbeats through a relay tree (``config.relay_fan_in`` hosts a relay,
    monarch_nb.runtime.relay), else each host's straight to the controller; ``replies_up``: on
    the tree, a call to all's gathered replies go up it (merged by the relays), else each host's
    straight (as before 2026-12-06's step)."""
    from _sim_hosts import host_name, raise_fd_limit

    from monarch_nb.actor.mesh import ProcMesh
    from monarch_nb.actor.shape import Extent
    from monarch_nb.supervision.policy import SupervisionPolicy
    from monarch_nb.supervision.records import HostRecord, ProcMeshRecord, ProcRecord, ProcState

    raise_fd_limit()
    ctrl = Controller.get()
    fan_in = config.relay_fan_in
    monarch_nb.configure(relay_fan_in=fan_in if relays else 0)
    # a mesh of its own: no failure of an earlier run in its way
    mesh = f"sim{hosts}x{per_host}{'a' if via_agents else 'd'}{'r' if relays else ''}{'' if replies_up else 's'}"
    names = [host_name(mesh, h) for h in range(hosts)]
    for name in names:  # as an attached host: judged for silence, sent the controller's heartbeats
        ctrl.hosts[name] = HostRecord(name, address="tcp://127.0.0.1:9")
        ctrl.host_agents._links[name] = {"address": "tcp://127.0.0.1:9", "trust": None}
    ctrl.host_agents._reattaching.update(names)  # one lost is lost for good: no worker to attach again
    first_seq = ctrl.events.next_seq
    sim = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_sim_hosts.py"), ctrl.address, mesh, str(hosts),
                            str(per_host), repr(config.heartbeat_interval_s), "--answer", *(["--linked"] if via_agents else []),
                            *([] if replies_up else ["--replies-straight"])],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    identities: list[str] = []
    try:
        assert sim.stdin is not None and sim.stdout is not None
        sim.stdin.write(ctrl.signer.key.hex() + "\n")
        sim.stdin.flush()
        assert sim.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not all(ctrl.hosts[n].state == ProcState.HEALTHY for n in names):
            if time.monotonic() > deadline:
                raise RuntimeError("simulated hosts did not all say hello within 60 s")
            time.sleep(0.05)
        now = time.monotonic()
        for rank in range(hosts * per_host):
            h, g = divmod(rank, per_host)
            identity = f"{mesh}.{rank}"
            rec = ProcRecord(identity, mesh, rank, {"hosts": h, "gpus": g}, names[h], {}, state=ProcState.HEALTHY,
                             pid=1_000_000 + rank, last_heartbeat=now, started_at=now)
            rec.ready.set()
            ctrl.procs[identity] = rec
            identities.append(identity)
            if via_agents:  # what a linked proc's hello does
                ctrl.channel.route_via(identity, names[h], sim.pid)  # the incarnation its messages name (the simulator's pid)
        ctrl.meshes[mesh] = ProcMeshRecord(mesh, Extent({"hosts": hosts, "gpus": per_host}), identities,
                                           supervision=SupervisionPolicy("isolate"))
        tree_s = float("nan")
        straight = 0
        if relays:  # every host placed in a group of fan_in, one of each its relay: the others heard through it
            expected, tree = hosts - -(-hosts // fan_in), ctrl.host_agents.tree
            t0 = time.perf_counter()
            while True:
                with ctrl.host_agents._tree_lock:
                    placed = dict(tree.relay_of)
                    ready = all(r.endpoint for r in tree.relays.values())
                through = sum(1 for n in names if ctrl.hosts[n].via_relay)
                if ready and through == len(placed) and through >= expected - len(tree._left):
                    break  # a member that left its relay (it fell silent to it) stays straight
                if time.perf_counter() - t0 > 60:
                    raise RuntimeError(f"only {through} of {expected} simulated hosts heard through a relay within 60 s")
                time.sleep(0.01)
            tree_s = time.perf_counter() - t0
            straight = hosts - len(tree.relays) - through
        time.sleep(2.0)
        since = ctrl.events.next_seq
        received0 = sum(ctrl.channel.received.values())
        cpu0, w0 = _cpu_s(), time.perf_counter()
        time.sleep(idle_s)
        cpu, wall = _cpu_s() - cpu0, time.perf_counter() - w0
        messages = sum(ctrl.channel.received.values()) - received0
        hung = [e for e in ctrl.events.events(since_seq=since) if e.kind == "proc_hung" and e.mesh == mesh]
        messaging = _simulated_calls(ProcMesh(mesh, Extent({"hosts": hosts, "gpus": per_host})), sim, calls, cpu / wall)
        since = ctrl.events.next_seq
        t0 = time.perf_counter()
        sim.stdin.write(f"exit {identities[0]}\n")
        sim.stdin.flush()
        seen = ctrl.events.wait_for(lambda e: e.kind == "proc_exited" and e.mesh == mesh and e.rank == 0, 30, since)
        kill_s = time.perf_counter() - t0 if seen is not None else float("nan")
        victim = names[-1]
        handling = _HostLostTimer(ctrl.liveness)
        since = ctrl.events.next_seq
        t0 = time.perf_counter()
        sim.stdin.write(f"silence {victim}\n")
        sim.stdin.flush()
        lost = ctrl.events.wait_for(lambda e: e.kind == "host_lost" and e.host == victim, 30, since)
        lost_s = time.perf_counter() - t0 if lost is not None else float("nan")
        handled = handling.wait(30)
        relay_lost = _relay_lost(ctrl, names, sim) if relays else {}
        # hosts lost that were not silenced: late heartbeats (the simulator, one process for every
        # host and proc, shares the 2 cores with the controller: answering 8,192 calls it is late too)
        others = {e.host for e in ctrl.events.events("host_lost", since_seq=first_seq)} - {victim, relay_lost.get("relay")}
    finally:
        try:
            if sim.stdin is not None:
                sim.stdin.write("quit\n")
                sim.stdin.close()
        except BrokenPipeError:  # it died (it said why on stderr)
            pass
        sim.wait(30)
        monarch_nb.configure(relay_fan_in=fan_in)
        with ctrl.host_agents._tree_lock:
            for name in names:
                ctrl.host_agents.tree.lose(name)  # the tree forgets the simulated hosts (no agent to tell)
        ctrl.meshes.pop(mesh, None)
        for identity in identities:
            ctrl.procs.pop(identity, None)
            ctrl.channel.route_direct(identity)
        for name in names:
            ctrl.channel.cast_through(name, None)
            ctrl.hosts.pop(name, None)
            ctrl.host_agents._links.pop(name, None)
            ctrl.host_agents._reattaching.discard(name)
    agent_beats = max(messages, 1)  # an idle agent's heartbeats (IdleCadence), all the controller received
    return {"hosts": hosts, "procs": hosts * per_host, "messages": "agents" if via_agents else "direct",
            "relay_tree": relays, "replies_up_tree": relays and replies_up, "relays": -(-hosts // fan_in) if relays else 0, "tree_formed_s": tree_s,
            "hosts_straight": straight,
            "controller_cpu_idle_pct": 100 * cpu / wall,
            "controller_messages_per_s_idle": messages / wall, "cpu_per_agent_heartbeat_us": 1e6 * cpu / agent_beats,
            "procs_wrongly_hung": len(hung), "other_hosts_lost": len(others), "host_lost_s": lost_s, "proc_exit_seen_ms": 1e3 * kill_s,
            "host_lost_handling_ms": handled[0] if handled else None, "host_lost_handling_cpu_ms": handled[1] if handled else None,
            **messaging, **relay_lost}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", default="4,16,64,128", help="comma-separated sizes of real meshes (default 4,16,64,128; '' for none)")
    p.add_argument("--calls", type=int, default=50, help="call-to-all samples per size (default 50)")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measurement (default 10)")
    p.add_argument("--quick", action="store_true", help="sizes 4,16,64; 20 calls; 5 s idle")
    p.add_argument("--heartbeats", choices=("both", "agents", "direct"), default="both",
                   help="liveness path(s) to measure, each in its own controller (default both)")
    p.add_argument("--simulated", default="1,8,64,1024",
                   help="simulated host counts, 8 procs each (default 1,8,64,1024; '' for none)")
    p.add_argument("--per-host", default="8",
                   help="procs per simulated host, comma-separated (default 8); with two or more, the controller's CPU "
                        "per call to all and per cast is fitted to hosts and procs (sizes over 8,192 procs are skipped)")
    p.add_argument("--paths", default="direct,agents,tree",
                   help="simulated paths, comma-separated: direct (every proc to the controller), agents (one "
                        "message per host), tree (agents' heartbeats and casts through relays, replies merged up "
                        "them; from relay_min_hosts hosts), tree-down (the same with each host's replies straight)")
    p.add_argument("--baseline", type=Path,
                   help="another monarch_nb checkout: run only the same-API call to all at each --procs size on this "
                        "checkout and on that one, in turns (see above)")
    p.add_argument("--repeat", type=int, default=2, help="with --baseline: runs of each checkout per size (default 2)")
    p.add_argument("--rows-to", help=argparse.SUPPRESS)  # a mode's child process writes its rows here
    args = p.parse_args(argv)
    if args.quick:
        args.procs, args.calls, args.idle_s = "4,16,64", 20, 5.0
    if args.baseline is not None:
        if not (args.baseline / "monarch_nb" / "__init__.py").is_file():
            p.error(f"--baseline {args.baseline}: no monarch_nb package there (make one with `git worktree add DIR COMMIT`)")
        if args.repeat < 1:
            p.error("--repeat must be at least 1")
        compared = compare_with_baseline(args.baseline, [int(n) for n in args.procs.split(",") if n], args.calls, args.repeat)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "scale_baseline.json").write_text(json.dumps({"host": os.uname().nodename, "cores": os.cpu_count(),
                                                                  "rows": compared}, indent=1))
        _print_comparison(compared)
        print(f"JSON: {RESULTS / 'scale_baseline.json'}")
        return 0
    if args.rows_to:
        rows = [measure(int(n), args.calls, args.idle_s) for n in args.procs.split(",")]
        Controller.get().shutdown()
        Path(args.rows_to).write_text(json.dumps(rows))
        return 0
    modes = ("agents", "direct") if args.heartbeats == "both" else (args.heartbeats,)
    rows = [row for mode in modes for row in _run_mode(mode, args)] if args.procs else []
    sizes = sorted({row["procs"] for row in rows})
    floors = {n: raw_call_all_floor(n, args.calls) for n in sizes}
    wire_floors = {n: raw_call_all_floor(n, args.calls, wire=True) for n in sizes}
    packet_floors = {n: packet_call_all_floor(n, args.calls) for n in sizes}
    for row in rows:
        row["raw_zmq_call_all_p50_ms"] = 1e3 * floors[row["procs"]]
        row["wire_floor_call_all_p50_ms"] = 1e3 * wire_floors[row["procs"]]
        row["packet_wire_floor_call_all_p50_ms"] = 1e3 * packet_floors[row["procs"]]
    # each size straight (every proc's messages, every host's heartbeats to the controller), through
    # the agents, and from relay_min_hosts hosts on with the agents' heartbeats through relays too
    paths = {"direct": (False, False, False), "agents": (True, False, False), "tree-down": (True, True, False),
             "tree": (True, True, True)}
    unknown = set(args.paths.split(",")) - set(paths)
    if unknown:
        p.error(f"unknown --paths {', '.join(sorted(unknown))}: choose from {', '.join(paths)}")
    simulated = [measure_simulated(int(h), int(g), args.idle_s, via_agents=via, relays=tree, replies_up=up)
                 for g in args.per_host.split(",") for h in args.simulated.split(",") if h and int(h) * int(g) <= MAX_SIMULATED_PROCS
                 for path, (via, tree, up) in paths.items() if path in args.paths.split(",")
                 and (not tree or int(h) >= config.relay_min_hosts)]
    if simulated:
        Controller.get().shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fits = fit_by_hosts_and_procs(simulated)
    out = {"host": os.uname().nodename, "cores": os.cpu_count(), "rows": rows, "simulated": simulated, "fits": fits}
    (RESULTS / "scale.json").write_text(json.dumps(out, indent=1))
    print(f"{'heartbeats':>10} {'procs':>6} {'spawn->reply s':>15} {'ctrl CPU idle %':>16} {'ctrl msgs/s':>12} "
          f"{'agent CPU %':>12} {'procs CPU %':>12} {'call-all p50 ms':>16} {'p95 ms':>8} {'raw pyzmq ms':>13} {'wire floor ms':>14} "
          f"{'packets ms':>11} {'CPU/call: ctrl ms':>18} {'procs ms':>9} {'SIGKILL seen ms':>16} {'SIGSTOP seen s':>15}")
    for r in rows:
        print(f"{r['heartbeats']:>10} {r['procs']:>6} {r['spawn_to_first_reply_s']:>15.2f} {r['controller_cpu_idle_pct']:>16.1f} "
              f"{r['controller_messages_per_s_idle']:>12.0f} {r['agent_cpu_idle_pct']:>12.1f} {r['procs_cpu_idle_pct']:>12.1f} "
              f"{r['call_all_p50_ms']:>16.2f} "
              f"{r['call_all_p95_ms']:>8.2f} {r['raw_zmq_call_all_p50_ms']:>13.2f} {r['wire_floor_call_all_p50_ms']:>14.2f} "
              f"{r['packet_wire_floor_call_all_p50_ms']:>11.2f} {r['controller_cpu_per_call_all_ms']:>18.2f} "
              f"{r['procs_cpu_per_call_all_ms']:>9.2f} {r['sigkill_seen_ms']:>16.1f} {r['sigstop_seen_s']:>15.2f}")
    if simulated:
        print(f"\nsimulated hosts (heartbeats through the agents)\n{'hosts':>6} {'procs':>6} {'relays':>6} "
              f"{'ctrl CPU idle %':>16} "
              f"{'ctrl msgs/s':>12} {'us/agent hb':>12} {'wrongly hung':>13} {'others lost':>12} {'host lost s':>12} "
              f"{'exit seen ms':>13} {'lost host handled ms (CPU)':>27}")
        for r in simulated:
            print(f"{r['hosts']:>6} {r['procs']:>6} {r['relays']:>6} {r['controller_cpu_idle_pct']:>16.1f} "
                  f"{r['controller_messages_per_s_idle']:>12.0f} "
                  f"{r['cpu_per_agent_heartbeat_us']:>12.0f} {r['procs_wrongly_hung']:>13} {r['other_hosts_lost']:>12} "
                  f"{r['host_lost_s']:>12.2f} "
                  f"{r['proc_exit_seen_ms']:>13.1f} {_ms_pair(r):>27}")
        print(f"\nsimulated procs answering a trivial actor's calls (controller CPU less its idle share)\n{'messages':>12} {'procs':>6} "
              f"{'spawn->reply s':>15} {'call-all p50 ms':>16} {'p95 ms':>8} {'ctrl CPU/call-all ms':>21} {'cast p50 ms':>12} "
              f"{'p95 ms':>8} {'ctrl CPU/cast ms':>17} {'sending ms':>11} {'msgs down tree':>15} {'resent':>7}")
        for r in simulated:
            path = _path_name(r)
            print(f"{path:>12} {r['procs']:>6} {r['spawn_to_first_reply_s']:>15.2f} {r['call_all_p50_ms']:>16.2f} "
                  f"{r['call_all_p95_ms']:>8.2f} "
                  f"{r['controller_cpu_per_call_all_ms']:>21.2f} {r['cast_p50_ms']:>12.2f} {r['cast_p95_ms']:>8.2f} "
                  f"{r['controller_cpu_per_cast_ms']:>17.2f} {r['sending_cpu_per_cast_ms']:>11.2f} "
                  f"{r['tree_messages_per_cast']:>15.1f} {r['tree_parts_resent']:>7}")
        tree_rows = [r for r in simulated if r["relay_tree"]]
        if tree_rows:
            print(f"\nrelay tree: one relay silenced\n{'hosts':>6} {'relays':>6} {'straight':>8} {'tree formed s':>14} {'members':>8} "
                  f"{'members straight s':>19} {'relay lost s':>13} {'members wrongly lost':>21}")
            for r in tree_rows:
                print(f"{r['hosts']:>6} {r['relays']:>6} {r['hosts_straight']:>8} {r['tree_formed_s']:>14.2f} {r['relay_members']:>8} "
                      f"{r['relay_members_straight_s']:>19.2f} {r['relay_lost_s']:>13.2f} {r['relay_members_wrongly_lost']:>21}")
    if fits:
        print("\ncontroller CPU fitted to a + b x hosts + c x procs (least squares over the simulated sizes above)")
        print(f"{'messages':>12} {'of':>9} {'a ms':>8} {'b us/host':>10} {'c us/proc':>10} {'at 1,024 x 8: hosts':>20} {'procs':>7} "
              f"{'max resid %':>12}")
        for f in fits:
            print(f"{f['messages']:>12} {f['of']:>9} {f['fixed_ms']:>8.2f} {f['per_host_us']:>10.1f} {f['per_proc_us']:>10.2f} "
                  f"{f['hosts_share_at_1024x8_ms']:>17.1f} ms {f['procs_share_at_1024x8_ms']:>4.1f} ms {f['max_residual_pct']:>12.1f}")
    print(f"JSON: {RESULTS / 'scale.json'}")
    return 0


#: The most simulated procs a size may have (the simulator keeps a connection per proc).
MAX_SIMULATED_PROCS = 8192


def fit_by_hosts_and_procs(simulated: list[dict]) -> list[dict]:
    """The controller's CPU per call to all and per cast, fitted (least squares) to ``a + b *
    hosts + c * procs`` over the simulated sizes of each path: whether the work grows with hosts
    (``b``) or with procs (``c``). Needs three sizes of at least two procs-per-host values, else
    nothing. Returns one row per path and operation: the coefficients (ms, µs a host, µs a proc),
    each term's share at 1,024 hosts x 8, and the largest residual (% of the measured value)."""
    import numpy as np

    fits = []
    for messages in sorted({_path_name(r) for r in simulated}):
        rows = [r for r in simulated if _path_name(r) == messages]
        if len(rows) < 3 or len({r["procs"] // r["hosts"] for r in rows}) < 2:
            continue
        design = np.array([[1.0, r["hosts"], r["procs"]] for r in rows])
        for of, key in (("call all", "controller_cpu_per_call_all_ms"), ("cast", "controller_cpu_per_cast_ms")):
            measured = np.array([r[key] for r in rows])
            (fixed, per_host, per_proc), *_ = np.linalg.lstsq(design, measured, rcond=None)
            residual = np.abs(design @ np.array([fixed, per_host, per_proc]) - measured) / np.maximum(measured, 1e-9)
            fits.append({"messages": messages, "of": of, "sizes": [[r["hosts"], r["procs"]] for r in rows],
                         "fixed_ms": float(fixed), "per_host_us": 1e3 * float(per_host), "per_proc_us": 1e3 * float(per_proc),
                         "hosts_share_at_1024x8_ms": 1024 * float(per_host), "procs_share_at_1024x8_ms": 8192 * float(per_proc),
                         "max_residual_pct": 100 * float(residual.max())})
    return fits


if __name__ == "__main__":
    raise SystemExit(main())
