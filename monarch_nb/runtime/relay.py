"""A tree of host agents for heartbeats: relays, so the controller hears tens of agents, not thousands.

Through the host agents (:mod:`.heartbeat_relay`) the controller hears one heartbeat per host per
interval; at 1,024 hosts that is still ~2,048 messages a second each way, and per message the
controller pays a wake-up, ZeroMQ, HMAC and decoding (15-18 % of a core idle, docs/scale.md).
Here some agents are *relays*: each binds a ROUTER (CurveZMQ when the cluster encrypts) on the
address that reaches the controller, its *member* agents (up to ``config.relay_fan_in - 1`` of
them) send it the heartbeats they would send the controller, and the relay puts those heard since
its last heartbeat into its own (:attr:`~.protocol.AgentHeartbeatHeader.members`). So the
controller receives and sends one message per relay per interval. A member whose heartbeat said
nothing new (all its procs heard, no fields changed, none stopped: an idle host) is passed on as
its name, load and count of procs alone (:class:`~.protocol.QuietMember`), and the controller
takes that host's procs as heard in one step: at 1,024 idle hosts the controller's work per
idle host is a record lookup and a few timestamps, not a lookup per proc (docs/scale.md).

Heartbeats take the tree, and casts down it: a cast to procs of several hosts of one relay is one
message to the relay, which verifies it and splits it per host (:func:`cast_parts`: each host's
entries alone, signed again), its own procs' part through its link and each member's over this
socket (:meth:`AgentRelay.pass_on`, :meth:`RelayMember.on_readable`; see
``monarch_nb.transport.channel``, "Down the relay tree"). A part the relay cannot pass on it names to the controller
(:data:`~.protocol.Kind.RELAY_UNREACHED`), and a member that leaves its relay gets the casts of the
last seconds straight again; the procs' numbering drops what came twice. A call to all's replies
go back up the same way: a member sends its host's gathered replies to its relay
(:meth:`RelayMember.send_replies`), which merges those of its hosts to a call it split into one
message (:class:`~.reply_gather.ReplyMerge`); a member that leaves its relay sends what it sent
through it lately straight (:class:`~.reply_gather.KeptReplies`), and the controller drops a
reply it had by its number. Everything else keeps its path: a proc's exit (the agent's SIGCHLD), an agent's hello or exit, output, spawns, signals and
messages to one proc go straight between the controller and each agent, so detection of a kill
does not change, and neither does any supervision guarantee. What changes:

- **Down the tree.** The controller heartbeats to relays (and to agents that heartbeat straight),
  not to members; a relay tells its members every interval how long ago it heard the controller
  (:data:`~.protocol.Kind.RELAY_BEAT`), and a member takes that as hearing the controller, so its
  own silence check (``controller_timeout_s``) is unchanged.
- **A dead or cut-off relay loses no member.** A member that has not heard its relay for
  :data:`RELAY_SILENT_INTERVALS` intervals heartbeats straight to the controller again (at once,
  saying which relay it left), well inside the hang timeout: the controller loses a host only
  when the host itself is silent. The controller tells a lost relay's members to go straight at
  once, and later assigns them to other relays (:class:`RelayTree`), never again to the relay a
  member left.
- **Timing.** A member's heartbeat reaches the controller up to one interval later than straight
  (the relay passes it on at its next tick), so it is taken as heard up to that much later, never
  earlier: a SIGSTOP on a member host is seen up to one interval later; a silent host is still
  lost at the hang timeout.

Trust: every agent of a cluster signs with the controller's session key, so a relay verifies its
members' heartbeats as the controller would (HMAC before anything is decoded, a replay guard per
sender) and the controller trusts the relay's summary as it trusts any signed message.

Classes:
    :class:`AgentRelay`: the relay's socket, its members' heartbeats since the last take.
    :class:`RelayMember`: a member's connection to its relay.
    :class:`RelayTree`: the controller's plan: which agents relay, and whose heartbeats.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import zmq

from ..transport.channel import curve_server, read_tree_routing
from ..transport.keys import Trust
from ..transport.wire import BadMessage, ReplayGuard, Signer, decode, encode, route_id
from .protocol import AgentHeartbeatHeader, Kind, QuietMember, RelayBeatHeader, RelayedHeartbeat, RelayUnreachedHeader, RepliesHeader
from .reply_gather import ReplyMerge

__all__ = ["AgentRelay", "RelayMember", "RelayTree", "Relayed", "cast_parts", "pass_cast_down", "RELAY_SILENT_INTERVALS", "RELAY_READY_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: A member that has not heard its relay for this many heartbeat intervals heartbeats straight to
#: the controller again. The relay beats its members every interval; a member's heartbeat is at
#: most two intervals old when the relay passes it on (an idle agent beats every second interval),
#: so with a 2 s hang timeout and 0.25 s intervals the member is heard straight ~1 s before the
#: controller would lose it.
RELAY_SILENT_INTERVALS = 3
#: Seconds a relay asked to serve has to answer (``relay_ready``) before the controller gives up on it.
RELAY_READY_TIMEOUT_S = 5.0
#: A relay stops beating a member it has not heard from for this long (seconds): gone, or moved.
MEMBER_FORGET_S = 10.0
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def _socket(kind: int) -> "zmq.Socket[Any]":
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def cast_parts(signer: Signer, sections: list[tuple[bytes, list[bytes]]],
               frames: list[Any]) -> tuple[str | None, list[tuple[bytes, bytes, list[Any]]]]:
    """A cast down the tree (``frames``: signed by the controller, ``fan`` listing every host's
    procs in the order of ``sections``, its routing frame's: :func:`~monarch_nb.transport.channel.read_tree_routing`)
    split per host: ``(host, its routing frame @ROUTE,..., its part)``, the part the controller's
    header with that host's ``fan`` entries alone (its ``seq`` and numbers kept), signed again
    with the cluster key, so each proc reads its host's entries, not the whole tree's. Returned
    with the call's id when its replies are gathered (``gth``; else None).

    Raises:
        BadMessage: not signed with the cluster key, with buffers, or its ``fan`` not the sections'.
    """
    header, body, buffers = decode(signer, frames)
    fan = header.pop("fan", None)
    if buffers or not isinstance(fan, dict) or not isinstance(fan.get("to"), list):
        raise BadMessage("a cast down the tree has a fan of routes and no buffers")
    parts, start, payload = [], 0, bytes(body)
    for host, routes in sections:
        end = start + len(routes)
        entries = {name: column[start:end] for name, column in fan.items()}
        if entries["to"] != [route.decode() for route in routes]:
            raise BadMessage("a cast's fan does not list the procs of its routing frame")
        part = {**header, "dst": host.decode(), "fan": entries}
        parts.append((host, b"@" + b",".join(routes), encode(signer, part, payload)))  # type: ignore[arg-type]  # a cast's header
        start = end
    if start != len(fan["to"]):
        raise BadMessage("a cast's fan lists procs its routing frame does not")
    cid = header.get("cid")
    return (cid if header.get("gth") and isinstance(cid, str) else None), parts


def pass_cast_down(signer: Signer, relay: "AgentRelay | None", own: bytes, routing: bytes, frames: list[Any],
                   to_own: Callable[[list[bytes], list[Any]], None]) -> RelayUnreachedHeader | None:
    """What a relay does with a cast down the tree (``routing``: ``@@CAST;HOST=ROUTE,...``, see
    :func:`~monarch_nb.transport.channel.read_tree_routing`; ``frames``: the signed message): split
    per host (:func:`cast_parts`), its own host's (``own``) part to ``to_own(routes, part)`` (the
    link's forward), each member's through ``relay`` (:meth:`AgentRelay.pass_on`). A call whose
    replies gather is told to the relay's :class:`~.reply_gather.ReplyMerge` first, with how
    many procs of its hosts gather them. Returns the ``relay_unreached`` to send the controller,
    naming the hosts not reached (every host of the cast, ours too, when it could not be split),
    or None when all were.

    Raises:
        ValueError: ``routing`` is not a relay's routing frame (nothing is passed on).
    """
    cast, sections = read_tree_routing(routing)
    try:
        cid, parts = cast_parts(signer, sections, frames)
    except (ValueError, TypeError, KeyError) as exc:  # BadMessage is a ValueError
        log.warning("could not split cast %d down the relay tree (%s): its hosts are to get it straight", cast, exc)
        return {"kind": Kind.RELAY_UNREACHED, "cast": cast, "hosts": [host.decode() for host, _ in sections]}
    if cid is not None and relay is not None and relay.merge is not None:  # a host's procs gather from two on
        relay.merge.expect(cid, sum(len(routes) for _, routes in sections if len(routes) > 1))
    unreached = []
    for host, host_routing, part in parts:
        if host == own:
            to_own(host_routing[1:].split(b","), part)
        elif relay is None or not relay.pass_on(host, host_routing, part):
            unreached.append(host.decode())
    if relay is not None:
        relay.on_readable()  # a send may take the socket's edge
    return {"kind": Kind.RELAY_UNREACHED, "cast": cast, "hosts": unreached} if unreached else None


def _sizes_match(items: Any, body_bytes: int) -> bool:
    """``items`` is a list of gathered replies (``[src, gk, idx, ok, nbytes]`` each) whose sizes
    add up to ``body_bytes``: a member's ``replies`` a relay can merge with others."""
    if not isinstance(items, list):
        return False
    total = 0
    for item in items:
        if not isinstance(item, list) or len(item) != 5 or type(item[4]) is not int or item[4] < 0:
            return False
        total += item[4]
    return total == body_bytes


@dataclass(frozen=True)
class Relayed:
    """A relay's members' heartbeats since its last heartbeat (:meth:`AgentRelay.take`).

    Attributes:
        members: those that said something (a proc silent or changed, a proc stopped), whole.
        quiet: those that said nothing new: name, load and count of procs only.
    """

    members: list[RelayedHeartbeat] = field(default_factory=list)
    quiet: list[QuietMember] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.members or self.quiet)

    def into(self, header: AgentHeartbeatHeader) -> None:
        """Put them into the relay's own heartbeat (``members``, ``quiet``; neither when empty)."""
        if self.members:
            header["members"] = self.members
        if self.quiet:
            header["quiet"] = [q.to_wire() for q in self.quiet]


class AgentRelay:
    """The relay's end: a ROUTER its members connect to (the agent's IO thread only).

    Args:
        identity: the relay agent's identity (``host#pid``), the ``src`` of its beats.
        signer: the controller's session signer (the members sign with it too).
        trust: the cluster's transport security; with CurveZMQ keys the socket admits only
            clients holding the cluster's key pair. None: plain TCP (loopback clusters).
        ip: the address to bind (the one this host reaches the controller from).

    Attributes:
        endpoint: ``tcp://IP:PORT`` the members connect to.
        dropped: reason -> messages dropped (bad signature, replayed, another's name, not a heartbeat).
        passed: member heartbeats passed on so far.
        casts_passed: parts of casts passed down to members (:meth:`pass_on`).
        unreached: parts of casts for members that could not be reached.

    Raises:
        zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, identity: str, signer: Signer, trust: Trust | None, ip: str) -> None:
        self.identity = identity
        self._signer = signer
        self.sock = _socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a beat for a member gone raises: it is forgotten
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a member's new incarnation takes over its name
        host = f"[{ip}]" if ":" in ip else ip
        with curve_server(self.sock, trust):
            self.sock.bind(f"tcp://{host}:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._guard = ReplayGuard()
        self._pending: dict[str, RelayedHeartbeat] = {}  # member host -> its heartbeats since the last take, merged
        self._all_heard: dict[str, int] = {}  # member host -> its latest heartbeat's all_heard (absent: it had none)
        self._members: dict[bytes, float] = {}  # member route -> when last heard (monotonic)
        self._seq = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.passed = 0
        self.casts_passed = 0
        self.unreached = 0
        #: the relay's merging of its hosts' gathered replies (the agent sets it); None: a
        #: member's ``replies`` are dropped
        self.merge: ReplyMerge | None = None

    @property
    def fd(self) -> int:
        """The socket's ZMQ_FD, for the agent's loop (``Channel.add_reader``)."""
        return int(self.sock.getsockopt(zmq.FD))

    def on_readable(self, fd: int = -1) -> None:
        """Take every member message waiting (verified, replay-guarded): heartbeats, merged per
        member; gathered replies, to :attr:`merge`."""
        sock = self.sock
        while int(sock.getsockopt(_EVENTS)) & _POLLIN:
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            route = frames[0].bytes
            try:
                header, body, buffers = decode(self._signer, frames[1:])
            except BadMessage as exc:
                self.dropped["bad"] += 1
                log.warning("relay %s dropped a bad message: %s", self.identity, exc)
                continue
            kind = header["kind"]
            if kind != Kind.AGENT_HEARTBEAT and (kind != Kind.REPLIES or self.merge is None or buffers):
                self.dropped["not a heartbeat"] += 1
                continue
            if route_id(header["src"]).encode() != route:
                self.dropped["another's name"] += 1  # a member speaks for itself only
                continue
            if not self._guard.accept(header):
                self.dropped["replayed"] += 1
                continue
            if kind == Kind.REPLIES:
                if not isinstance(header.get("cid"), str) or not _sizes_match(header.get("gathered"), len(body)):
                    self.dropped["bad replies"] += 1  # merged, its bytes would misplace the other hosts'
                    continue
                merge = self.merge
                if merge is not None:
                    merge.add(header, bytes(body))  # type: ignore[arg-type]  # checked: a call's replies
                continue
            self._merge(route.decode(), header)  # type: ignore[arg-type]  # checked kind: an agent heartbeat
            self._members[route] = time.monotonic()

    def _merge(self, host: str, header: AgentHeartbeatHeader) -> None:
        before = self._pending.get(host)
        heard, changed = list(header.get("heard", ())), dict(header.get("changed", {}))
        if before is not None and before["src"] == header["src"]:  # two beats in one of our intervals
            heard = list(dict.fromkeys([*before["heard"], *heard, *before["changed"]]))
            changed = {**before["changed"], **changed}
            heard = [identity for identity in heard if identity not in changed]
        self._pending[host] = RelayedHeartbeat(src=header["src"], load=float(header.get("load", 0.0)),
                                               stopped=list(header.get("stopped", ())), heard=heard, changed=changed)
        all_heard = header.get("all_heard")
        if isinstance(all_heard, int) and not isinstance(all_heard, bool) and all_heard >= 0:
            self._all_heard[host] = all_heard
        else:
            self._all_heard.pop(host, None)

    def take(self) -> Relayed:
        """The members' heartbeats heard since the last take (for this agent's heartbeat): a member
        whose latest heartbeat said nothing new (``all_heard``), with no changed fields from an
        earlier one of this interval and no stopped proc, as a :class:`~.protocol.QuietMember`."""
        self.on_readable()  # the socket's edge may have been taken by a send
        taken = Relayed()
        for host, entry in self._pending.items():
            procs = self._all_heard.get(host)
            if procs is not None and not entry["changed"] and not entry["stopped"]:
                taken.quiet.append(QuietMember(entry["src"], entry["load"], procs))
            else:
                taken.members.append(entry)
        self._pending.clear()
        self._all_heard.clear()
        self.passed += len(taken.members) + len(taken.quiet)
        return taken

    def pass_on(self, member: bytes, routing: bytes, frames: list[Any]) -> bool:
        """Send ``member`` (a member host's route) its part of a cast down the tree: ``routing``
        (``@ROUTE,...``, its procs) and the signed ``frames``, unread. False: it cannot be reached
        now (not connected, or its queue full); the controller is to send it straight."""
        try:
            self.sock.send_multipart([member, routing, *frames], _NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH: not connected (left, moved, not joined yet); EAGAIN: not reading
            self.unreached += 1
            return False
        self.casts_passed += 1
        return True

    def beat_members(self, controller_age_s: float) -> None:
        """Tell every member heard lately that this relay is alive and how long ago it heard
        the controller (seconds): one signed message, sent to each."""
        now = time.monotonic()
        for route in [r for r, heard in self._members.items() if now - heard > MEMBER_FORGET_S]:
            del self._members[route]
        if not self._members:
            return
        self._seq += 1
        beat: RelayBeatHeader = {"kind": Kind.RELAY_BEAT, "src": self.identity, "dst": "members", "seq": self._seq,
                                 "controller_age_s": round(controller_age_s, 3)}
        frames = encode(self._signer, beat)
        for route in list(self._members):
            try:
                self.sock.send_multipart([route, *frames], _NOBLOCK)
            except zmq.ZMQError:  # EHOSTUNREACH: disconnected (exited, moved); EAGAIN: not reading
                self._members.pop(route, None)
        if int(self.sock.getsockopt(_EVENTS)) & _POLLIN:  # a send may take the socket's edge
            self.on_readable()

    @property
    def members(self) -> list[str]:
        """The hosts heard lately (sorted)."""
        return sorted(route.decode() for route in self._members)

    def close(self) -> None:
        self.sock.close(linger=0)


class RelayMember:
    """A member's end: a DEALER to its relay (the agent's IO thread only).

    Args:
        identity: this agent's identity (``host#pid``); the routing identity is the host name.
        signer: the controller's session signer.
        trust: the cluster's transport security (a CurveZMQ client with its keys), or None.
        relay: the relay's host name.
        endpoint: the relay's ``tcp://IP:PORT``.
        interval_s: the heartbeat interval (seconds); the relay is silent after
            :data:`RELAY_SILENT_INTERVALS` of them without a beat.

    Attributes:
        controller_heard: ``time.monotonic()`` at which the relay last heard the controller, as its
            last beat said (None before its first beat).
    """

    def __init__(self, identity: str, signer: Signer, trust: Trust | None, relay: str, endpoint: str,
                 interval_s: float) -> None:
        self.identity, self.relay, self.endpoint = identity, relay, endpoint
        self._signer = signer
        self.silent_after_s = RELAY_SILENT_INTERVALS * interval_s
        self.sock = _socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, route_id(identity).encode())
        if trust is not None and trust.encrypted:
            self.sock.curve_serverkey = trust.curve_public
            self.sock.curve_publickey = trust.curve_public
            self.sock.curve_secretkey = trust.curve_secret
        self.sock.connect(endpoint)
        self._guard = ReplayGuard()
        self._seq = 0
        self.relay_heard = time.monotonic()  # joining counts as hearing it: it has the silence allowance to answer
        self.controller_heard: float | None = None
        #: ``on_routed(routes, frames)``: this host's part of a cast the relay passed on (its procs'
        #: routes, the signed frames: :meth:`~.proc_link.AgentLink.forward`); None: dropped
        self.on_routed: Callable[[list[bytes], list[Any]], None] | None = None

    @property
    def fd(self) -> int:
        return int(self.sock.getsockopt(zmq.FD))

    def on_readable(self, fd: int = -1) -> None:
        """Take the relay's beats waiting (verified, replay-guarded)."""
        sock = self.sock
        while int(sock.getsockopt(_EVENTS)) & _POLLIN:
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            first = frames[0].bytes
            if first[:1] == b"@" and len(frames) >= 2:  # our part of a cast down the tree: for our procs, unread
                if self.on_routed is not None:
                    self.on_routed(first[1:].split(b","), frames[1:])
                continue
            try:
                header, _, _ = decode(self._signer, frames)
            except BadMessage:
                continue
            if header["kind"] != Kind.RELAY_BEAT or route_id(header["src"]) != self.relay or not self._guard.accept(header):
                continue
            now = time.monotonic()
            self.relay_heard = now
            age = header.get("controller_age_s")
            if isinstance(age, (int, float)) and age >= 0:
                self.controller_heard = now - float(age)

    def send_replies(self, header: RepliesHeader, body: bytes) -> bool:
        """Sign and send this host's gathered replies to a call up to the relay (never blocks).
        False: not sent (the relay's queue is full); the caller sends them straight."""
        self._seq += 1
        header["src"], header["dst"], header["seq"] = self.identity, self.relay, self._seq
        try:
            self.sock.send_multipart(encode(self._signer, header, body), _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def silent(self) -> bool:
        """The relay has not beaten for :data:`RELAY_SILENT_INTERVALS` intervals."""
        self.on_readable()
        return time.monotonic() - self.relay_heard > self.silent_after_s

    def send(self, header: AgentHeartbeatHeader) -> None:
        """Sign and send one heartbeat to the relay (never blocks: dropped when the relay's
        queue is full, i.e. it has not read for a thousand intervals)."""
        self._seq += 1
        header["src"], header["dst"], header["seq"] = self.identity, self.relay, self._seq
        try:
            self.sock.send_multipart(encode(self._signer, header), _NOBLOCK)
        except zmq.Again:
            pass
        if int(self.sock.getsockopt(_EVENTS)) & _POLLIN:
            self.on_readable()

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass
class _Relay:
    host: str
    asked_at: float
    endpoint: str = ""  # "" until it said relay_ready
    members: set[str] = field(default_factory=set)  # joined (told the endpoint), or waiting for it to be ready


@dataclass(frozen=True)
class RelayJoin:
    """Tell ``member`` to heartbeat through ``relay`` at ``endpoint`` ("" and "": straight again)."""

    member: str
    relay: str = ""
    endpoint: str = ""


class RelayTree:
    """The controller's plan of the tree (its IO thread, under a lock of its own): which hosts relay,
    whose heartbeats, and what to tell each agent when that changes.

    The tree is one level: up to ``fan_in`` hosts per relay, the relay included (32 by default:
    1,024 hosts are 32 relays). Hosts are grouped in the order the controller lists them, and a
    plan keeps every existing member where it is, fills relays with room first, and makes a new
    relay of the first host of each further group; a host left alone heartbeats straight. There
    is no tree below ``min_hosts`` hosts (the controller's cost is small there: 2.3 % of a core at
    64 hosts, docs/scale.md). A host that could not serve is not asked again; a member that left
    a relay (it fell silent to it) is not put back under it.

    Args:
        fan_in: hosts per relay, itself included (0 or 1: no tree).
        min_hosts: healthy remote hosts it takes to build one.
    """

    def __init__(self, fan_in: int, min_hosts: int) -> None:
        self.fan_in, self.min_hosts = fan_in, min_hosts
        self.relays: dict[str, _Relay] = {}
        self.relay_of: dict[str, str] = {}  # member -> its relay
        self._refused: set[str] = set()  # hosts that could not serve as a relay
        self._left: dict[str, set[str]] = {}  # member -> relays it left

    def plan(self, healthy: Sequence[str], now: float) -> tuple[list[str], list[RelayJoin]]:
        """Place the healthy hosts not placed yet: (hosts to ask to serve as relays, joins to
        send now: members of relays already serving)."""
        if self.fan_in < 2 or len(healthy) < self.min_hosts:
            return [], []
        waiting = [h for h in healthy if h not in self.relays and h not in self.relay_of]
        joins: list[RelayJoin] = []
        for relay in sorted(self.relays.values(), key=lambda r: r.host):
            room = self.fan_in - 1 - len(relay.members)
            for host in [h for h in waiting if relay.host not in self._left.get(h, ())][:max(room, 0)]:
                waiting.remove(host)
                relay.members.add(host)
                self.relay_of[host] = relay.host
                if relay.endpoint:
                    joins.append(RelayJoin(host, relay.host, relay.endpoint))
        serve: list[str] = []
        while len(waiting) >= 2:
            chosen = next((h for h in waiting if h not in self._refused), None)
            if chosen is None:
                break
            waiting.remove(chosen)
            group = [h for h in waiting if chosen not in self._left.get(h, ())][:self.fan_in - 1]
            if not group:
                continue
            new = self.relays[chosen] = _Relay(chosen, now)
            for member in group:
                waiting.remove(member)
                new.members.add(member)
                self.relay_of[member] = chosen
            serve.append(chosen)
        return serve, joins

    def ready(self, host: str, endpoint: str) -> list[RelayJoin]:
        """Relay ``host`` is bound at ``endpoint`` ("": it could not be): the joins to send."""
        relay = self.relays.get(host)
        if relay is None or relay.endpoint:
            return []
        if not endpoint:
            self._refused.add(host)
            self._drop(host)
            return []
        relay.endpoint = endpoint
        return [RelayJoin(member, host, endpoint) for member in sorted(relay.members)]

    def expire(self, now: float) -> None:
        """Give up on relays that did not answer within :data:`RELAY_READY_TIMEOUT_S`."""
        for relay in [r for r in self.relays.values() if not r.endpoint and now - r.asked_at > RELAY_READY_TIMEOUT_S]:
            log.warning("host %s did not answer as a relay within %.0f s: its hosts heartbeat straight",
                        relay.host, RELAY_READY_TIMEOUT_S)
            self._refused.add(relay.host)
            self._drop(relay.host)

    def lose(self, host: str) -> list[RelayJoin]:
        """``host`` is lost or detached: if it relayed, its joined members go straight (the
        joins to send them); if it was a member, its relay has room again. A host that comes
        back has a fresh agent: members that left it as a relay may join it again."""
        self._left.pop(host, None)
        for relays in self._left.values():
            relays.discard(host)
        relay = self.relay_of.pop(host, None)
        if relay is not None and relay in self.relays:
            self.relays[relay].members.discard(host)
        if host not in self.relays:
            return []
        joined = sorted(self.relays[host].members) if self.relays[host].endpoint else []
        self._drop(host)
        return [RelayJoin(member) for member in joined]

    def left(self, member: str, relay: str) -> None:
        """``member`` heartbeats straight again: it had not heard ``relay`` for a while."""
        if self.relay_of.get(member) == relay:
            del self.relay_of[member]
            self.relays[relay].members.discard(member)
        self._left.setdefault(member, set()).add(relay)

    def _drop(self, host: str) -> None:
        relay = self.relays.pop(host)
        for member in relay.members:
            self.relay_of.pop(member, None)
