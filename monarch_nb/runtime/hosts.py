"""The controller's hosts: the local host agent it starts, remote hosts it attaches, and their liveness.

- This machine: a host agent process the controller starts (``host0``; it dies with the
  controller: parent-pid check).
- Other machines: each runs a worker loop (:mod:`monarch_nb.runtime.worker_loop`). :meth:`Hosts.attach`
  binds the controller's socket on the interface that reaches the worker (CurveZMQ when the
  cluster has a key folder), sends a signed ``attach`` carrying the controller's session key
  sealed with the cluster key, and waits for the worker's host agent to say hello.

Liveness: every host agent heartbeats (every second interval while it has nothing new to say:
:class:`~.heartbeat_relay.IdleCadence`); the controller heartbeats to remote agents, each every
:data:`CONTROLLER_HEARTBEAT_EVERY` intervals, the hosts taking turns. A host silent
for ``hang_timeout_s`` is *lost*: its procs fail with cause ``host_lost`` (calls to them raise
``SupervisionError``). Its agent, silent controller or not, kills its procs after
``controller_timeout_s`` (twice the hang timeout), so a cut-off rank stops; the controller tries
to attach the host again every second (the worker loop then replaces the old agent, and its procs
die with it), and a lost host whose old agent is heard again has its procs killed at once; the
host serves again only with a fresh agent. No proc of a lost host ever serves the controller
again: restarts start fresh ones (no split brain).

Of its controller :class:`Hosts` sees only :class:`HostsController`: what an agent is told (the
controller's address, run id and session key), the socket, the records, the event log, and the
act of failing a lost host's procs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol, cast

import zmq

from ..config import config
from ..errors import MonarchError
from ..supervision.records import HostRecord, ProcRecord, ProcState
from ..transport.channel import RELAYED_KEEP_S
from ..transport.keys import Trust, load_trust, seal
from ..transport.wire import BadMessage, Signer, decode, encode, route_id
from .launch import LocalAgent
from .protocol import (CONTROLLER, AgentEnv, AgentExitingHeader, AgentHelloHeader, AttachedHeader, AttachHeader, Kind,
                       RelayJoinHeader, RelayReadyHeader, RelayUnreachedHeader, SignalHeader)
from .relay import RELAY_SILENT_INTERVALS, RelayJoin, RelayTree
from .worker_loop import LOOPBACK_KEY, interface_for, is_loopback, machine_id

if TYPE_CHECKING:
    from ..supervision.events import Event
    from ..transport.channel import Channel

__all__ = ["Hosts", "HostsController", "AttachError", "LOCAL"]

log = logging.getLogger(__name__)
_HEALTHY = ProcState.HEALTHY  # an Enum member read off its class costs 0.2 us (Python 3.11): per host per tick

#: The local host agent's name.
LOCAL = "host0"
#: How long a worker loop may take to answer an attach (it answers at once when it hears it), seconds.
ATTACH_REPLY_S = 15.0
_LOCAL_NAMES = ("localhost", "127.0.0.1", LOCAL)


class AttachError(MonarchError, ConnectionError):
    """A worker could not be attached (unreachable, refused, wrong key)."""


class _AlreadyAttached(AttachError):
    """The worker already serves this controller as host ``host`` (another spelling of its address)."""

    def __init__(self, address: str, host: str):
        super().__init__(f"worker {address} is already attached as host {host}")
        self.host = host


def _address_key(address: str) -> tuple[frozenset, str]:
    """``(IP addresses, port)`` of ``tcp://HOST:PORT``: two spellings of one worker compare equal
    (``localhost`` and ``127.0.0.1``, a hostname and its address)."""
    hostport = address[len("tcp://"):] if address.startswith("tcp://") else address
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    try:
        ips = frozenset(info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except OSError:
        ips = frozenset()
    return ips or frozenset({host}), port


#: The controller places hosts in the relay tree every this many liveness ticks (1 s by default).
RELAY_PLAN_EVERY = 4

#: The controller heartbeats to each remote agent every this many intervals (0.5 s by default),
#: the hosts spread over the ticks: any message from the controller counts, and the agent (and
#: its worker loop, :meth:`~.worker_loop.WorkerLoop._controller_heard`) takes a controller silent
#: for ``hang_timeout_s`` (2 s) as gone; one message per host per tick was half of an idle
#: controller's CPU at 1,024 hosts (docs/scale.md).
CONTROLLER_HEARTBEAT_EVERY = 2


def controller_timeout_s() -> float:
    """How long a remote agent waits for a silent controller before killing its procs (seconds)."""
    return max(2 * config.hang_timeout_s, 3.0)


class HostsController(Protocol):
    """What :class:`Hosts` uses of its controller (:class:`~.controller.Controller` is one)."""

    @property
    def address(self) -> str:
        """Where the local host agent and its procs connect (the controller's ROUTER)."""

    @property
    def run_id(self) -> str:
        """This controller's run id (sent with each attach)."""

    @property
    def signer(self) -> Signer:
        """Signs the controller's messages; its key goes to each host agent (sealed for a remote one)."""

    @property
    def channel(self) -> Channel:
        """The controller's socket: binds an endpoint per cluster, sends to agents."""

    @property
    def closed(self) -> bool:
        """True once the controller shut down (a host gone then is not lost)."""

    @property
    def hosts(self) -> dict[str, HostRecord]:
        """Host agent name -> its record (this room's records)."""

    @property
    def procs(self) -> dict[str, ProcRecord]:
        """Proc identity -> its record (the procs of a host to fence)."""

    def record_host_event(self, kind: str, host: HostRecord, **fields: Any) -> Event:
        """Append an event about host agent ``host`` (``host_lost``, ``host_returned``)."""

    def fail_host_procs(self, host: str, why: str) -> None:
        """Host ``host`` is lost: every proc of it fails with cause ``host_lost``."""


class Hosts:
    """The hosts of ``controller``: records in ``controller.hosts``, agents, endpoints, liveness."""

    def __init__(self, controller: HostsController):
        self.ctrl = controller
        self.records = controller.hosts
        self._local: LocalAgent | None = None
        self._endpoints: dict[tuple[str, bytes | None], str] = {}  # (controller IP, cluster key) -> tcp endpoint
        self._links: dict[str, dict] = {}  # remote host name -> {"address", "trust", "info", "endpoint"}
        self._reattaching: set[str] = set()
        self._ticks = 0  # liveness ticks so far (the turn of each host's heartbeat)
        self._fenced: set[str] = set()  # procs of lost hosts already told to die
        self.tree = RelayTree(config.relay_fan_in, config.relay_min_hosts)  # whose heartbeats pass through whom
        self._lock = threading.RLock()
        self._tree_lock = threading.Lock()  # the tree's alone: the IO thread never waits on a caller holding _lock
        self._next = 1

    # -- this machine ----------------------------------------------------------------------------
    def resolve(self, host: str) -> HostRecord:
        """The record of ``host`` (a name given by :meth:`attach`, or "localhost"), started or
        attached and serving.

        Raises:
            ValueError: an unknown host.
            AttachError: the host is lost (its procs cannot be started until it is back).
        """
        if host in _LOCAL_NAMES:
            return self._local_agent()
        record = self.records.get(host)
        if record is None:
            known = sorted(self.records) or ["none"]
            raise ValueError(f"unknown host {host!r}; hosts: {', '.join(known)} (attach more with attach_to_workers)")
        if record.state != ProcState.HEALTHY:
            raise AttachError(f"host {host} is lost (no heartbeat from its agent); it is attached again as soon as its "
                              "worker answers: retry then (the host_returned event)")
        return record

    def _local_agent(self) -> HostRecord:
        ctrl = self.ctrl
        with self._lock:
            record = self.records.get(LOCAL)
            if record is None or self._local is None or not self._local.alive():
                env = AgentEnv(ctrl.address, ctrl.signer.key.hex(), os.getpid(), ctrl.channel.shm_run_id or "",
                               config.orphan_check_s, config.heartbeat_interval_s,
                               relay_heartbeats=config.heartbeats_via_agents, link_procs=config.messages_via_agents)
                # the record first: the agent's hello may come before this thread runs again (a
                # thread importing torch holds the GIL for a second), and a hello without a record is dropped
                record = self.records[LOCAL] = HostRecord(LOCAL, detail={
                    "machine": machine_id(), "cores": len(os.sched_getaffinity(0))})
                self._local = LocalAgent(LOCAL, env)
                if not record.pid:
                    record.pid = self._local.pid
        if not record.ready.wait(config.start_timeout_s):
            raise RuntimeError(f"host agent {LOCAL} did not connect within {config.start_timeout_s} s")
        return record

    def is_local(self, host: str) -> bool:
        return host in _LOCAL_NAMES

    def placement(self, host: str) -> dict:
        """Where procs of ``host`` connect and what they inherit: ``{"controller", "base_env",
        "run_id", "master_ip"}`` (the controller's address and IP as that host sees them)."""
        if self.is_local(host):
            return {"controller": self.ctrl.address, "base_env": True, "run_id": self.ctrl.channel.shm_run_id or "",
                    "master_ip": "127.0.0.1"}
        link = self._links[host]
        return {"controller": link["endpoint"], "base_env": False, "run_id": "", "master_ip": link["controller_ip"]}

    # -- other machines ----------------------------------------------------------------------------
    def attach(self, workers: list[str], ca: str | None) -> list[str]:
        """Attach the worker loops at ``workers`` (``tcp://HOST:PORT`` each); return their host names.

        Raises:
            AttachError: a worker is unreachable within ``start_timeout_s``, refused, or its key differs.
            ValueError: a malformed address, or a non-loopback worker without ``ca``.
        """
        trust = load_trust(ca) if ca is not None else None
        names: list[str] = []
        for address in workers:
            before = len(names)
            self._attach_address(address, trust, names)
            if names[before:] and names[-1] in names[:before]:
                earlier = workers[names.index(names[-1])]
                raise ValueError(f"{earlier} and {address} are the same worker (host {names[-1]}); name each host once")
        return names

    def _attach_address(self, address: str, trust: Trust | None, names: list[str]) -> None:
        """Attach one worker and append its host name to ``names`` (see :meth:`attach`)."""
        if trust is None and not is_loopback(address):
            raise ValueError(f"worker {address} is not on this machine: pass ca= (the cluster's key file or folder)")
        wanted = trust or Trust(LOOPBACK_KEY, source="loopback")
        key = _address_key(address)
        with self._lock:  # the same worker with the same keys is the same host, however it is spelled
            known = next((n for n, link in self._links.items()
                          if _same_worker(link["key"], key) and link["trust"].hmac_key == wanted.hmac_key), None)
            record = self.records.get(known) if known is not None else None
            if known is not None and record is not None and record.state == ProcState.HEALTHY:
                names.append(known)  # already attached and serving: attaching again changes nothing
                return
            name = known or f"host{self._next}"
            if known is None:
                self._next += 1
        deadline = time.monotonic() + config.start_timeout_s
        try:
            while True:
                try:
                    self._attach_one(name, address, wanted)
                    break
                except _AlreadyAttached as exc:  # the worker says so: it is that host, under another spelling
                    with self._lock:
                        if name not in self._links and self.records.get(name) is not None:
                            del self.records[name]
                        other = self.records.get(exc.host)
                    if other is None and time.monotonic() < deadline:
                        # a host this controller let go of (detached: its mesh stopped) whose agent is
                        # still shutting down: the worker lets go of it within a few seconds
                        time.sleep(0.2)
                        continue
                    if other is None or not other.ready.wait(config.start_timeout_s):
                        raise AttachError(f"worker {address} serves this controller as host {exc.host}, which is not "
                                          "serving now") from None
                    names.append(exc.host)
                    return
        except BaseException:
            with self._lock:  # a host that never served leaves no record behind
                if name not in self._links and self.records.get(name) is not None:
                    del self.records[name]
            raise
        names.append(name)

    def _endpoint_for(self, ip: str, trust: Trust) -> str:
        key = (ip, trust.curve_public)  # one endpoint per cluster: its CurveZMQ keys (or plain)
        with self._lock:
            endpoint = self._endpoints.get(key)
            if endpoint is None:
                endpoint = self._endpoints[key] = self.ctrl.channel.bind(f"tcp://{ip}:0", trust if trust.encrypted else None)
            return endpoint

    def _attach_one(self, name: str, address: str, trust: Trust, timeout_s: float | None = None) -> HostRecord:
        ctrl = self.ctrl
        timeout_s = config.start_timeout_s if timeout_s is None else timeout_s
        worker_ip = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        controller_ip = "127.0.0.1" if is_loopback(address) else interface_for(worker_ip)[0]
        endpoint = self._endpoint_for(controller_ip, trust)
        nonce, sealed = seal(trust.hmac_key, ctrl.signer.key)
        header: AttachHeader = {
            "kind": Kind.ATTACH, "src": CONTROLLER, "dst": name, "seq": 1, "controller": endpoint,
            "run_id": ctrl.run_id, "name": name, "time": time.time(), "nonce": nonce, "sealed_key": sealed,
            "heartbeat_interval_s": config.heartbeat_interval_s, "hang_timeout_s": config.hang_timeout_s,
            "controller_timeout_s": controller_timeout_s(), "controller_host": socket.gethostname(),
            "controller_pid": os.getpid(), "relay_heartbeats": config.heartbeats_via_agents,
            "link_procs": config.messages_via_agents}
        with self._lock:
            record = self.records.get(name)
            if record is None:
                record = self.records[name] = HostRecord(name, address=address)
            record.ready.clear()  # a lost host keeps its state (failed) until its new agent says hello
        # the worker answers at once if it hears us: a long silence means other keys or no worker
        # the worker answers at once if it hears us, or within its current controller's hang
        # timeout if another controller holds it (it waits to tell a dead one from a live one)
        reply = _request(address, trust, encode(Signer(trust.hmac_key), header), min(timeout_s, ATTACH_REPLY_S))
        if not reply.get("ok"):
            if reply.get("attached_as"):
                raise _AlreadyAttached(address, str(reply["attached_as"]))
            raise AttachError(f"worker {address} refused to attach: {reply.get('error')}")
        with self._lock:
            self._links[name] = {"address": address, "key": _address_key(address), "trust": trust, "info": reply,
                                 "endpoint": endpoint, "controller_ip": controller_ip}
            record.pid = int(reply.get("pid", 0))
            record.detail = {k: reply.get(k) for k in ("hostname", "ip", "iface", "cores", "gpus", "machine")}
        if not record.ready.wait(timeout_s):
            raise AttachError(f"the host agent of {address} did not connect back to {endpoint} within {timeout_s} s "
                              "(can the host reach this address? a firewall?)")
        return record

    def reattaching(self, host: str) -> bool:
        """``host`` is lost and the controller is attaching it again (its worker may answer soon)."""
        return host in self._reattaching

    def named(self, hosts: list[str]) -> list[str]:
        """The host names of ``hosts``: each a host name, or a worker's address (``tcp://HOST:PORT``,
        any spelling) standing for the attached host it serves, if any."""
        names = []
        for host in hosts:
            if host.startswith("tcp://"):
                key = _address_key(host)
                with self._lock:
                    names += [name for name, link in self._links.items() if link.get("key") == key]
            else:
                names.append(host)
        return list(dict.fromkeys(names))

    def detach(self, names: list[str]) -> None:
        """Forget the attached hosts ``names`` (their job ended): tell their agents to stop, try no
        re-attach, drop their records. Their procs' meshes should be stopped first."""
        with self._lock:
            for name in names:
                if self.is_local(name):
                    continue
                self._reattaching.discard(name)
                self._links.pop(name, None)
                with self._tree_lock:
                    joins = self.tree.lose(name)
                self._send_joins(joins)
                self.ctrl.channel.cast_through(name, None)
                self.ctrl.channel.relay_serves(name, False)
                if self.records.pop(name, None) is not None:
                    self.ctrl.channel.send(name, {"kind": Kind.SHUTDOWN})

    # -- messages (IO thread) --------------------------------------------------------------------------
    def on_hello(self, header: AgentHelloHeader) -> None:
        record = self.records.get(route_id(header["src"]))
        if record is not None:
            procs = self.ctrl.procs  # a fresh agent: its host's procs may be fenced again if it is lost again
            self._fenced = {p for p in self._fenced if p not in procs or procs[p].host != record.name}
            record.pid = header["pid"]
            with self._tree_lock:  # a fresh agent is in no relay tree: if its host relayed, its members go straight
                joins = self.tree.lose(record.name)
            self._send_joins(joins)
            self._set_relay(record, "")
            self.ctrl.channel.relay_serves(record.name, False)
            record.state = ProcState.HEALTHY
            record.last_heartbeat = time.monotonic()
            record.ready.set()

    def on_agent_exiting(self, header: AgentExitingHeader) -> None:
        """An agent exits on its own (its worker loop died, its controller went silent): the host is
        lost now, for that reason, instead of after the hang timeout."""
        record = self.records.get(route_id(header["src"]))
        if record is not None and record.state == ProcState.HEALTHY and not self.ctrl.closed:
            self._lose(record, str(header.get("why") or "its host agent exited"))

    def on_heartbeat(self, name: str, load: float, via: str = "", left: str = "", now: float | None = None) -> HostRecord | None:
        """Host ``name``'s agent heartbeated: straight (``via`` "": it may say which relay it
        ``left``), or in relay ``via``'s heartbeat (received at ``now``, ``time.monotonic()``;
        None: now). Its record, None for an unknown host."""
        record = self.records.get(name)
        if record is None:
            return None
        record.last_heartbeat = time.monotonic() if now is None else now
        record.load = float(load)
        if record.via_relay != via:
            self._set_relay(record, via)
        if left:
            with self._tree_lock:
                self.tree.left(name, left)
        if record.state == ProcState.FAILED and record.name in self._links:
            self._fence_returned(record)
        return record

    def _set_relay(self, record: HostRecord, via: str) -> None:
        """Host ``record`` is heard through relay ``via`` now ("": straight): the one place that
        changes. Casts to its procs follow (down the tree through ``via``: ``Channel.cast_through``);
        a host that left a relay gets the casts sent through it lately straight, as the relay may not
        have passed them on (``Channel.resend_relayed``; its procs drop those they had)."""
        before, record.via_relay = record.via_relay, via
        channel = self.ctrl.channel
        channel.cast_through(record.name, via or None)
        if before:
            resent = channel.resend_relayed(before, [record.name])
            if resent:
                log.info("host %s left relay %s: %d casts sent through it lately sent to it straight", record.name, before, resent)

    def on_relay_unreached(self, header: RelayUnreachedHeader) -> None:
        """A relay could not pass a cast on to some of its members: they get their part straight."""
        try:
            hosts, cast = [str(host) for host in header["hosts"]], int(header["cast"])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("dropped a malformed relay_unreached from %s: %r", header.get("src"), exc)
            return
        self.ctrl.channel.resend_relayed(route_id(header["src"]), hosts, cast)

    def on_relay_ready(self, header: RelayReadyHeader) -> None:
        """A host asked to relay bound its socket (or could not): its members join it."""
        name = route_id(header["src"])
        if header.get("error"):
            log.warning("host %s cannot relay heartbeats (%s): its group heartbeats straight", name, header["error"])
        else:
            self.ctrl.channel.relay_serves(name, True)  # its members' replies come merged in its own
        with self._tree_lock:
            joins = self.tree.ready(name, str(header.get("endpoint") or ""))
        self._send_joins(joins)

    def _send_joins(self, joins: list[RelayJoin]) -> None:
        for join in joins:
            record = self.records.get(join.member)
            if record is None:
                continue
            if not join.relay:
                self._set_relay(record, "")  # the controller heartbeats to it again, from this tick on
            message: RelayJoinHeader = {"kind": Kind.RELAY_JOIN, "relay": join.relay, "endpoint": join.endpoint}
            self.ctrl.channel.send(join.member, message)

    def _plan_relays(self, now: float) -> None:
        """Place the healthy attached hosts in the relay tree (:class:`~.relay.RelayTree`)."""
        healthy = [name for name in self._links if (r := self.records.get(name)) is not None
                   and r.state == ProcState.HEALTHY and r.ready.is_set()]
        # a cast down the tree is kept until a member that lost its relay has surely said so
        self.ctrl.channel.relayed_keep_s = max(RELAYED_KEEP_S, 2 * (config.hang_timeout_s + RELAY_SILENT_INTERVALS * config.heartbeat_interval_s))
        with self._tree_lock:
            self.tree.fan_in, self.tree.min_hosts = config.relay_fan_in, config.relay_min_hosts
            self.tree.expire(now)
            serve, joins = self.tree.plan(healthy, now)
        self._send_joins(joins)
        for name in serve:
            self.ctrl.channel.send(name, {"kind": Kind.RELAY_SERVE})

    # -- liveness (IO thread) --------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        self._ticks += 1
        if self._ticks % RELAY_PLAN_EVERY == 0:
            self._plan_relays(now)
        cutoff, records = now - config.hang_timeout_s, self.records
        for turn, name in enumerate(list(self._links)):  # 1,024 hosts 4 times a second: names looked up once, above
            record = records.get(name)
            if record is None:
                continue
            if record.state is _HEALTHY:
                if not record.via_relay and (turn + self._ticks) % CONTROLLER_HEARTBEAT_EVERY == 0:  # the hosts take turns
                    self.ctrl.channel.send(name, {"kind": Kind.CONTROLLER_HEARTBEAT})
                if record.last_heartbeat < cutoff:
                    self._lose(record, f"no heartbeat for {now - record.last_heartbeat:.2f} s")
        record = self.records.get(LOCAL)
        if record is not None and record.state == ProcState.HEALTHY and self._local is not None and not self._local.alive():
            if self.ctrl.closed:
                record.state = ProcState.STOPPED
            else:
                self._lose(record, f"the host agent exited ({self._local.popen.returncode})")

    def _lose(self, record: HostRecord, why: str) -> None:
        # marked as being attached again before it is marked lost: a spawn that sees it lost
        # waits for its return (:meth:`reattaching`) instead of failing in between
        reattach = record.name in self._links and record.name not in self._reattaching
        if reattach:
            self._reattaching.add(record.name)
        with self._tree_lock:  # a lost relay's members go straight at once (they would on their own within a second)
            joins = self.tree.lose(record.name)
        self._send_joins(joins)
        record.state = ProcState.FAILED
        self.ctrl.record_host_event("host_lost", record, detail=why, cause="host_lost")
        self.ctrl.fail_host_procs(record.name, why)
        if reattach:
            threading.Thread(target=self._reattach, args=(record.name,), name=f"monarch_nb-reattach-{record.name}",
                             daemon=True).start()

    def _fence_returned(self, record: HostRecord) -> None:
        """A lost host's old agent is heard again: kill what it still runs (fenced: never a split
        brain). It serves again only once attached again, with a fresh agent."""
        for rec in list(self.ctrl.procs.values()):
            if rec.host == record.name and rec.identity not in self._fenced:
                self._fenced.add(rec.identity)
                kill: SignalHeader = {"kind": Kind.SIGNAL, "proc": rec.identity, "signal": "SIGKILL"}
                self.ctrl.channel.send(record.name, kill)

    def _reattach(self, name: str) -> None:
        try:
            while not self.ctrl.closed and name in self._reattaching:
                record = self.records.get(name)
                if record is None or record.state == ProcState.HEALTHY:
                    return
                link = self._links[name]
                try:
                    self._attach_one(name, link["address"], link["trust"], timeout_s=max(2.0, config.hang_timeout_s))
                except _AlreadyAttached as exc:  # attached meanwhile under another spelling: that host it is
                    log.warning("not attaching %s again: its worker serves this controller as host %s", name, exc.host)
                    return
                except (AttachError, OSError, RuntimeError) as exc:
                    log.debug("attaching %s again failed: %s", name, exc)
                    time.sleep(1.0)
                    continue
                self.ctrl.record_host_event("host_returned", record, detail="attached again; its procs start fresh",
                                            cause="attach")
                return
        finally:
            self._reattaching.discard(name)

    # -- shutdown --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell every agent to stop; wait for the local one."""
        self._reattaching.clear()
        for name in list(self.records):
            self.ctrl.channel.send(name, {"kind": Kind.SHUTDOWN})
        if self._local is not None:
            self._local.wait(3.0)
        for record in self.records.values():
            record.state = ProcState.STOPPED


def _same_worker(a: tuple[frozenset, str], b: tuple[frozenset, str]) -> bool:
    return a[1] == b[1] and bool(a[0] & b[0])


def _request(address: str, trust: Trust, frames: list[Any], timeout_s: float) -> AttachedHeader:
    """Send one signed request (an attach) to a worker loop and return the reply's header (attached)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if trust.encrypted:
            sock.curve_serverkey = trust.curve_public
            sock.curve_publickey = trust.curve_public
            sock.curve_secretkey = trust.curve_secret
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            raise AttachError(f"worker {address} did not answer within {timeout_s} s (is `monarch-nb worker` running "
                              "there, with the same keys?)")
        try:
            header, _body, _buffers = decode(Signer(trust.hmac_key), sock.recv_multipart())
        except BadMessage as exc:
            raise AttachError(f"worker {address} answered with a bad message ({exc}): another cluster key?") from None
        return cast(AttachedHeader, header)  # a worker loop answers an attach with nothing else
    finally:
        sock.close(0)

