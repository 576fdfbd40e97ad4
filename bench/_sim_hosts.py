"""bench/scale.py's simulated hosts: the host-agent protocol of many hosts, from one process.

    python bench/_sim_hosts.py ADDRESS MESH HOSTS PER_HOST INTERVAL_S   (the cluster key, hex, on stdin's first line)

Each simulated host is a ZeroMQ DEALER named like a host agent (``MESH-host<h>``, incarnation this
pid), connected to the controller at ADDRESS, its messages signed with the cluster key as a real
agent's are: it says hello (``agent_hello``), then heartbeats as an idle agent does, every
IDLE_HEARTBEAT_EVERY x INTERVAL_S seconds (heartbeat_relay.IdleCadence), the hosts spread over
that time (``agent_heartbeat``: a load, no stopped procs, and its PER_HOST procs
``MESH.<rank>`` as heard with their fields unchanged: what a real agent sends for idle procs,
monarch_nb.runtime.heartbeat_relay). It reads and drops what the controller sends (its heartbeats
to attached hosts). Commands on stdin, one a line: ``exit IDENTITY`` (report that proc exited by
SIGKILL, as an agent does on SIGCHLD), ``silence HOST`` (that host stops heartbeating, as a
frozen or cut-off host), ``quit``. It prints ``ready`` once every hello is sent.

Simulated, not real: the procs (no process, no socket: they exist as the controller's records
and in their agent's heartbeat), their calls and replies, spawning, CurveZMQ.
"""

from __future__ import annotations

import os
import resource
import select
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from monarch_nb.runtime.heartbeat_relay import IDLE_HEARTBEAT_EVERY  # noqa: E402
from monarch_nb.runtime.protocol import CONTROLLER, Kind  # noqa: E402
from monarch_nb.transport.wire import Signer, encode  # noqa: E402


def raise_fd_limit() -> None:
    """Soft limit of open files up to the hard one: a socket per simulated host (and the
    controller one connection per host)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def host_name(mesh: str, h: int) -> str:
    """The name of simulated host ``h`` of ``mesh``."""
    return f"{mesh}-host{h}"


def main() -> int:
    address, mesh, hosts, per_host, interval_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    signer = Signer(bytes.fromhex(sys.stdin.readline().strip()))
    raise_fd_limit()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, hosts + 64)  # ZeroMQ's default is 1,023 sockets a context
    pid = os.getpid()
    names = [host_name(mesh, h) for h in range(hosts)]
    socks, seqs = {}, {}
    for name in names:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks[name], seqs[name] = sock, 0
    heard = {name: [f"{mesh}.{h * per_host + g}" for g in range(per_host)] for h, name in enumerate(names)}

    def send(name: str, header: dict) -> None:
        seqs[name] += 1
        header.update(src=f"{name}#{pid}", dst=CONTROLLER, seq=seqs[name])
        socks[name].send_multipart(encode(signer, header))

    for name in names:
        send(name, {"kind": Kind.AGENT_HELLO, "pid": pid, "host": name})
    print("ready", flush=True)
    silent: set[str] = set()
    start = time.monotonic()
    every_s = interval_s * IDLE_HEARTBEAT_EVERY  # an idle agent's cadence (nothing new to say)
    due = {name: start + every_s * h / hosts for h, name in enumerate(names)}  # spread over it
    next_drain = start
    while True:
        now = time.monotonic()
        for name in names:
            if due[name] <= now:
                due[name] += every_s
                if name not in silent:
                    send(name, {"kind": Kind.AGENT_HEARTBEAT, "load": 0.1, "stopped": [], "heard": heard[name], "changed": {}})
        if now >= next_drain:  # what the controller sends to attached hosts: read and dropped
            next_drain = now + interval_s
            for sock in socks.values():
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    sock.recv_multipart()
        wait = max(0.0, min(due.values()) - time.monotonic())
        readable, _, _ = select.select([sys.stdin], [], [], min(wait, 0.05))
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line or line.strip() == "quit":
            break
        command, _, arg = line.strip().partition(" ")
        if command == "silence":
            silent.add(arg)
        elif command == "exit":
            exited = {"kind": Kind.PROC_EXITED, "proc": arg, "pid": 0, "returncode": -9, "signal": "SIGKILL", "time": time.time()}
            send(names[int(arg.rsplit(".", 1)[1]) // per_host], exited)
    for sock in socks.values():
        sock.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
