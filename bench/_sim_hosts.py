"""bench/scale.py's simulated hosts: the host-agent protocol of many hosts, from one process.

    python bench/_sim_hosts.py ADDRESS MESH HOSTS PER_HOST INTERVAL_S [--answer] [--linked]   (the cluster key, hex, on stdin's first line)

Each simulated host is a ZeroMQ DEALER named like a host agent (``MESH-host<h>``, incarnation this
pid), connected to the controller at ADDRESS, its messages signed with the cluster key as a real
agent's are: it says hello (``agent_hello``), then heartbeats as an idle agent does, every
IDLE_HEARTBEAT_EVERY x INTERVAL_S seconds (heartbeat_relay.IdleCadence), each host in its slot of
the interval as a real agent (heartbeat_relay.tick_phase_s) (``agent_heartbeat``: a load, no stopped procs, and its PER_HOST procs
``MESH.<rank>`` as heard with their fields unchanged, all of them (``all_heard``): what a real agent sends for idle procs,
monarch_nb.runtime.heartbeat_relay). It reads and drops what the controller sends (its heartbeats
to attached hosts). Commands on stdin, one a line: ``exit IDENTITY`` (report that proc exited by
SIGKILL, as an agent does on SIGCHLD), ``silence HOST`` (that host stops heartbeating, as a
frozen or cut-off host), ``quit``. It prints ``ready`` once every hello is sent.

The relay tree (monarch_nb.runtime.relay) with the real relay code: a host the controller asks to
serve (``relay_serve``) binds an :class:`~monarch_nb.runtime.relay.AgentRelay` on 127.0.0.1 and
answers ``relay_ready``; from then on it heartbeats every interval, as a real relay does, with its
members' heartbeats since its last one, and beats its members. A host told to join
(``relay_join``) sends its heartbeats to that relay through a
:class:`~monarch_nb.runtime.relay.RelayMember` (signed, as a real member's), and heartbeats straight
again, saying which relay it left, once that relay is silent (a silenced relay).

With ``--answer`` the procs answer calls too (:class:`SimProcs`: a connection per proc, from one
socket). With ``--linked`` as well, the procs are linked to their agents (as real procs are,
monarch_nb.runtime.proc_link): the controller sends their messages to the host's DEALER, one
message per host for a cast or a call to all, and the simulated agent reads it once and answers
for each of its procs named in it: a call to all's replies signed by each proc and gathered by
the host's :class:`~monarch_nb.runtime.reply_gather.ReplyGather` (the real agent's), one
message per host, as real linked procs' are; other replies from each proc's own connection. On
the relay tree a member's gathered replies go up to its relay (the real
:meth:`~monarch_nb.runtime.relay.RelayMember.send_replies`), which merges its hosts' replies to a
call it split (the real :class:`~monarch_nb.runtime.reply_gather.ReplyMerge`) before they go to
the controller; ``--replies-straight``: each host's to the controller, as before that step.
Simulated, not real: the procs (no process; they exist as the controller's records, in their
agent's heartbeat and, with ``--answer``, as connections that answer), their actors (a
constructor returns None, every call 0), spawning, CurveZMQ.
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

from monarch_nb.runtime.heartbeat_relay import IDLE_HEARTBEAT_EVERY, tick_phase_s  # noqa: E402
from monarch_nb.runtime.protocol import CONTROLLER, Kind  # noqa: E402
from monarch_nb.runtime.relay import AgentRelay, RelayMember, pass_cast_down  # noqa: E402
from monarch_nb.runtime.reply_gather import ReplyGather, ReplyMerge  # noqa: E402
from monarch_nb.transport.serialization import dumps  # noqa: E402
from monarch_nb.transport.wire import BadMessage, Signer, decode, encode, fields_at  # noqa: E402

_NONE, _ZERO = dumps(None)[0], dumps(0)[0]  # what a constructor and the ping endpoint return


def raise_fd_limit() -> None:
    """Soft limit of open files up to the hard one: a socket per simulated host (and the
    controller one connection per host)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def host_name(mesh: str, h: int) -> str:
    """The name of simulated host ``h`` of ``mesh``."""
    return f"{mesh}-host{h}"


class SimProcs:
    """The simulated procs' end: one ROUTER connected to the controller once per proc, each
    connection under the proc's routing identity (``MESH.<rank>``, ZMQ_ROUTING_ID) and known here
    by the same name (ZMQ_CONNECT_ROUTING_ID), so the controller sees one peer per proc, as with
    real procs, and this process reads them all from one socket.

    A proc answers what a proc with a trivial actor would: a constructor (``spawn``) with None,
    any call with 0 (``ping``), to the caller the call names; a broadcast (a call with no call id)
    is counted, and once every proc got broadcast number N it prints ``cast N T`` (T: the
    ``time.monotonic()`` of the last one, the same clock as the controller's on Linux).
    """

    def __init__(self, ctx: zmq.Context, address: str, signer: Signer, identities: list[str]) -> None:
        self.signer, self.pid, self.seqs = signer, os.getpid(), dict.fromkeys(identities, 0)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        for identity in identities:
            self.sock.setsockopt(zmq.ROUTING_ID, identity.encode())
            self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, identity.encode())
            self.sock.connect(address)
        # the controller routes to a proc only once its connection is up: wait for every handshake
        connected, deadline = 0, time.monotonic() + 120
        while connected < len(identities):
            if not monitor.poll(max(1, int(1000 * (deadline - time.monotonic())))):
                raise SystemExit(f"only {connected} of {len(identities)} simulated procs connected in 120 s")
            monitor.recv_multipart()
            connected += 1
        self.sock.disable_monitor()
        monitor.close()
        self.casts: dict[int, int] = {}  # broadcast number -> procs that got it
        self.cast_no = dict.fromkeys(identities, 0)  # proc -> broadcasts it got
        self.total = len(identities)
        self.gathered = dict.fromkeys(identities, 0)  # proc -> replies it sent its agent for gathering (gk)
        self.delivered: dict[str, int] = {}  # proc -> the highest number (pseq) of the controller's it got

    def serve(self) -> None:
        """Answer every message waiting on the procs' own connections (never blocks)."""
        sock = self.sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(copy=False)
            try:
                header, _, _ = decode(self.signer, frames[1:])
            except BadMessage:
                continue
            self.answer(bytes(frames[0]).decode(), header)

    def serve_routed(self, frames: list, gather: ReplyGather) -> None:
        """A message the controller sent through a simulated agent (``@ROUTE[,ROUTE...]``, then
        the signed frames): read once, answered for each proc named (its own fields from ``fan``'s columns),
        a call to all's replies through the agent's ``gather`` as linked procs' are."""
        try:
            header, _, _ = decode(self.signer, frames[1:])
        except BadMessage:
            return
        fan = header.pop("fan", None)
        routes = bytes(frames[0])[1:].decode().split(",")
        for index, route in enumerate(routes):  # the routing frame and the fan's "to" list them in the same order
            own = header
            if fan is not None:
                own = fields_at(fan, index, header)
                del own["to"]
            pseq = own.get("pseq")
            if pseq is not None:  # a part sent again (its relay fell silent): a real proc drops what it had
                if pseq[1] <= self.delivered.get(route, 0):
                    continue
                self.delivered[route] = pseq[1]
            self.answer(route, own, gather if len(routes) > 1 else None, len(routes))

    def answer(self, identity: str, header: dict, gather: ReplyGather | None = None, expected: int = 1) -> None:
        """What proc ``identity`` with a trivial actor does with ``header``'s message (its reply
        signed, then through ``gather`` when the call allows it, else from its own connection)."""
        if header.get("kind") not in (Kind.CALL, Kind.SPAWN):
            return  # proc_failed, rendezvous, stop, ...: nothing a trivial actor answers
        if "cid" not in header:  # a broadcast: no reply wanted
            self.cast_no[identity] += 1
            n = self.cast_no[identity]
            self.casts[n] = self.casts.get(n, 0) + 1
            if self.casts[n] == self.total:
                print(f"cast {n} {time.monotonic()!r}", flush=True)
            return
        self.seqs[identity] += 1
        reply = {"kind": Kind.REPLY, "cid": header["cid"], "idx": header["idx"], "ok": True,
                 "src": f"{identity}#{self.pid}", "dst": header["reply_to"], "seq": self.seqs[identity]}
        body = _NONE if header["kind"] == Kind.SPAWN else _ZERO
        if gather is not None and "gth" in header:
            self.gathered[identity] += 1
            reply["gk"] = self.gathered[identity]
            gather.on_link_message(identity.encode(), [b"%%%d" % expected, *encode(self.signer, reply, body)])
            return
        self.sock.send_multipart([identity.encode(), *encode(self.signer, reply, body)])


def main() -> int:
    address, mesh, hosts, per_host, interval_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    answer = "--answer" in sys.argv[6:]  # simulated procs that answer calls (SimProcs)
    linked = "--linked" in sys.argv[6:]  # ... linked to their agents: the controller's messages come through them
    replies_up = "--replies-straight" not in sys.argv[6:]  # a member's gathered replies up its relay (merged there)
    signer = Signer(bytes.fromhex(sys.stdin.readline().strip()))
    raise_fd_limit()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * hosts + 64)  # ZeroMQ's default is 1,023 sockets a context (the procs share one;
    # a host's socket to its relay, a relay's for its members, are sockets of the global context)
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 2 * hosts + 64)
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
    procs = SimProcs(ctx, address, signer, [identity for name in names for identity in heard[name]]) if answer else None

    def send(name: str, header: dict, body: bytes = b"") -> None:
        seqs[name] += 1
        header.update(src=f"{name}#{pid}", dst=CONTROLLER, seq=seqs[name])
        socks[name].send_multipart(encode(signer, header, body))

    timers: list[tuple[float, object]] = []  # (due, fn): the gatherers' call_later

    def call_later(delay_s: float, fn) -> None:
        timers.append((time.monotonic() + delay_s, fn))

    relays: dict[str, AgentRelay] = {}  # hosts serving as relays
    members: dict[str, RelayMember] = {}  # hosts heartbeating through a relay

    def send_replies(name: str, header: dict, body: bytes) -> None:
        """A host's gathered replies: up to its relay, into its own merge when it relays, else
        straight (the real agent's HostAgent._send_replies, less the kept copies for a resend)."""
        member, relay = members.get(name), relays.get(name)
        if replies_up and member is not None and member.send_replies(header, body):  # type: ignore[arg-type]
            return
        if replies_up and relay is not None and relay.merge is not None:
            relay.merge.add(header, body)  # type: ignore[arg-type]
            return
        if header["gathered"]:  # a count alone is for a relay's merge
            send(name, header, body)

    # each host's gathering of its procs' replies (the real agent's code)
    gathers = {name: ReplyGather(signer, lambda header, body, name=name: send_replies(name, header, body), call_later)
               for name in names}
    ticks = dict.fromkeys(names, 0)  # a member's ticks (it checks its relay's silence every tick)

    def from_controller(name: str, frames: list) -> None:
        """What a host agent does with the controller's message: the relay tree's, or nothing."""
        first = bytes(frames[0])
        if procs is not None and first[:2] == b"@@":  # a cast down the tree: ours, and each member's passed on (a real relay's code)
            unreached = pass_cast_down(signer, relays.get(name), name.encode(), first, frames[1:], to_procs(name))
            if unreached is not None:
                send(name, unreached)
            return
        if procs is not None and first[:1] == b"@":  # for its procs (--linked)
            procs.serve_routed(frames, gathers[name])
            return
        try:
            header, _, _ = decode(signer, frames)
        except BadMessage:
            return
        if header["kind"] == Kind.RELAY_SERVE:
            if name not in relays:
                relays[name] = AgentRelay(f"{name}#{pid}", signer, None, "127.0.0.1")
                if replies_up:
                    relays[name].merge = ReplyMerge(lambda header, body, name=name: send(name, header, body), call_later)
                if procs is not None:  # its members' replies wake the loop
                    poller.register(relays[name].sock, zmq.POLLIN)
            send(name, {"kind": Kind.RELAY_READY, "endpoint": relays[name].endpoint, "error": ""})
            due[name] = min(due[name], time.monotonic() + interval_s)  # a relay beats every interval
        elif header["kind"] == Kind.RELAY_JOIN:
            leave(name)
            if header.get("endpoint"):
                member = members[name] = RelayMember(f"{name}#{pid}", signer, None, header["relay"], header["endpoint"], interval_s)
                if procs is not None:  # its part of the casts down the tree
                    member.on_routed = to_procs(name)
                    poller.register(member.sock, zmq.POLLIN)

    def to_procs(name: str):
        """``(routes, frames)``: host ``name``'s part of a cast, for its procs (an agent's link forward)."""
        assert procs is not None
        return lambda routes, frames: procs.serve_routed([b"@" + b",".join(routes), *frames], gathers[name])

    def leave(name: str) -> None:
        """Host ``name`` stops heartbeating through its relay (if it had one)."""
        member = members.pop(name, None)
        if member is not None:
            if procs is not None:
                poller.unregister(member.sock)
            member.close()

    def heartbeat(name: str) -> None:
        """One host's heartbeat: an idle agent's, through its relay if it has one; a relay's with its members'."""
        header = {"kind": Kind.AGENT_HEARTBEAT, "load": 0.1, "stopped": [], "heard": heard[name], "changed": {},
                  "all_heard": len(heard[name])}
        relay = relays.get(name)
        if relay is not None:
            relay.take().into(header)
            relay.beat_members(0.0)
        member = members.get(name)
        if member is not None and member.silent():  # its relay fell silent: straight again (checked every tick)
            header["relay_left"] = member.relay
            leave(name)
            member = None
        elif member is not None:  # an idle member ticks every interval and beats every IDLE_HEARTBEAT_EVERY-th
            ticks[name] += 1
            if ticks[name] % IDLE_HEARTBEAT_EVERY:
                return
        if member is not None:
            member.send(header)
        else:
            send(name, header)

    for name in names:
        send(name, {"kind": Kind.AGENT_HELLO, "pid": pid, "host": name})
    poller = zmq.Poller()
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    if procs is not None:
        poller.register(procs.sock, zmq.POLLIN)
        if linked:
            for sock in socks.values():
                poller.register(sock, zmq.POLLIN)
    print("ready", flush=True)
    silent: set[str] = set()
    start = time.monotonic()
    every_s = interval_s * IDLE_HEARTBEAT_EVERY  # an idle agent's cadence (nothing new to say)
    wall = time.time()  # each host in its slot of the interval, as real agents tick (heartbeat_relay.tick_phase_s)
    due = {name: start + (tick_phase_s(name, interval_s) - wall) % every_s for name in names}
    next_drain = start
    while True:
        now = time.monotonic()
        for name in names:
            if due[name] <= now:
                due[name] += interval_s if name in relays or name in members else every_s
                if name not in silent:
                    heartbeat(name)
        if now >= next_drain or linked:  # what the controller sends to attached hosts
            next_drain = now + interval_s
            for name, sock in socks.items():
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    from_controller(name, sock.recv_multipart(copy=False))
            if linked:
                for member in list(members.values()):  # casts passed down by their relays
                    member.on_readable()
                for relay in list(relays.values()):  # replies sent up by their members
                    relay.on_readable()
        if timers:
            now = time.monotonic()
            for timer in [t for t in timers if t[0] <= now]:
                timers.remove(timer)
                timer[1]()
        wait = max(0.0, min(min(due.values()), *(t[0] for t in timers)) - time.monotonic()) if timers else \
            max(0.0, min(due.values()) - time.monotonic())
        if procs is not None:
            procs.serve()
            readable = [fd for fd, _ in poller.poll(1000 * min(wait, 0.05)) if fd == sys.stdin.fileno()]
        else:
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
    for end in [*relays.values(), *members.values()]:
        end.close()
    for sock in socks.values():
        sock.close()
    if procs is not None:
        procs.sock.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
