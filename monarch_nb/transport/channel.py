"""A ZeroMQ socket with one receiving thread at a time, a thread-safe send path, and timers.

ZeroMQ sockets must not be used by two threads at once, so every use of the socket happens under
one lock. Any thread may call :meth:`Channel.send`: the message is numbered, signed and sent
under that lock, so sequence numbers follow send order (the receiver's replay guard relies on it)
and no thread hand-off is paid on the send path.

Receiving moves to the thread that is waiting (leader/followers): one thread at a time holds the
*receive lease* and runs the loop: it waits on the socket's ZMQ_FD (without the socket lock),
receives, verifies and dispatches every message (``on_message``), and runs due timers. A thread
blocked on a reply (:meth:`lead`, used by ``Future.get``) and an actor thread waiting for work
lead themselves, so the reply or the call wakes the very thread that needs it: on a small
machine each wake-up of another thread costs about as much as a whole ZeroMQ hop. The IO thread
leads when no one else does: it yields to a waiting thread at once, and takes the lease back
when it has been free for :data:`TAKEOVER_S` (an endpoint is running), so control messages and
heartbeat timers are never held up much longer than that (it looks every
:data:`_IO_RECHECK_S`, backing off to :data:`_IO_RECHECK_MAX_S` while it keeps finding the
lease taken, and a leader that had kept the lease :data:`_IO_IDLE_WAIT_S`, an idle actor, wakes
it by letting go). Handlers therefore run on whichever thread leads, one at a time.

ZMQ_FD is edge-triggered and a send may consume its edge, so after every send the sender checks
ZMQ_EVENTS and wakes the leader if input is pending. Received messages are verified
(:func:`monarch_nb.transport.wire.decode`) and the replay guard is applied before ``on_message``
runs; bad ones are dropped and counted.

The controller's channel is a ROUTER bound to an address; procs and host agents connect a
DEALER whose routing identity is their name. Identities may carry an incarnation after ``#``
(``"pm0.3#4211"``); routing uses the part before it, so a restarted proc takes over its name
(ROUTER_HANDOVER) while the replay guard keeps each incarnation's sequence apart.

Casts through host agents (:meth:`Channel.send_many`): a message for several procs linked to
the same host agent (:meth:`Channel.route_via`) is sent once, to the agent (a first frame
``@ROUTE,ROUTE...`` that the agent reads; the signed message passed on unread, see
:mod:`monarch_nb.runtime.proc_link`); the header's ``fan`` lists the routes (``to``) and each
field that differs by proc as a column in the same order. A message for one proc still goes
straight to it (no extra hop on a ``call_one``), as does a message another peer sends it through
the controller. (A peer of the same host sends it straight to the proc's inbox instead, never
through the controller: :mod:`.local_peers`, which says how its order is kept.) Two paths must
not change the order in which the controller's socket sends a proc its messages (the
controller's own and those it passes on from peers: before the link they shared one pipe, and
code relies on that, e.g. a spawn the controller sent before a peer's call to the new actor),
so the controller numbers every message for a linked proc, per proc from 1, with the proc's incarnation (``pseq``): its own in
their signed headers (a cast in its ``fan`` fields), a peer's message it passes on in front of
the envelope, in the same frame (``^INC:N|``; the hub does not re-sign what it passes on, and a
frame of its own would cost a send and a receive more). The proc delivers them in that
order (:meth:`Channel._in_order`): one that overtook an earlier one waits for it; a number
already delivered, or another incarnation's, is dropped. A proc reads its agent's link as a
second socket of its loop (:meth:`Channel.add_link`).

Down the relay tree (:meth:`Channel.cast_through`): the hosts that heartbeat through a relay
(``monarch_nb.runtime.relay``) get a cast in one message to the relay, with each host's routes
(``@@CAST;HOST=ROUTE,...;HOST=...``, :func:`read_tree_routing`) and their ``fan`` entries in the
same order; the relay verifies it, and passes each host its part, the controller's header with
that host's entries alone, signed again with the cluster key (a proc then reads its host's entries,
not the tree's: 14 µs against 68 for 256 entries), its own procs through its link, each member
host over the relay's socket (``@ROUTE,...``, as from the controller). The numbering keeps the
order, as for any cast. A part can be lost on the way (a relay killed or stopped, a member
reconnecting), so the controller keeps what it sent down the tree for a few seconds
(:attr:`Channel.relayed_keep_s`) and sends a host its part straight again when it leaves its
relay, or when the relay says it could not reach it (:meth:`Channel.resend_relayed`); a proc drops
a part it already had. A cast whose plan changed before it was sent (a host left its relay) goes
one message a host, never to the relay: its resend may already have been made. A cast with
buffers or a body over ``INLINE_BODY_MAX`` is not kept (it would pin its buffers for seconds): it
goes one message a host, as without the tree.

Replies gathered per host (the way back): a linked proc's reply to a call that reached it in a
cast (``fan`` of two or more, the call marked ``gth``) goes, signed as ever, to its host agent
over the link (:meth:`Channel.send` with ``gather``), which verifies it and sends the host's
replies to that call as one message (``gathered``: ``[src, gk, ...]`` per reply; see
:mod:`monarch_nb.runtime.reply_gather`). A proc numbers its gathered replies (``gk``, from 1),
and every later message it sends the controller straight says how many it had gathered by then
(``after``): the controller holds such a message until those replies came (:meth:`Channel._held_back`),
so what the agent holds is never overtaken by what the proc sent after it (an ``actor_failed``
must not pass the reply before it). Gathered replies may pass each other (they answer different
calls). A message held longer than :data:`GATHER_WAIT_MAX_S` is delivered anyway (logged).
Up the relay tree a relay merges its hosts' gathered replies into one message: the controller
takes from an agent that serves as a relay (:meth:`Channel.relay_serves`) the items of any
linked proc, and drops a number it had (``gathered_again``: a member's resend after its relay
was lost holding them).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import math
import os
import select
import threading
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import zmq

from . import shm
from .keys import Trust
from .local_peers import ANNOUNCEMENTS, LocalPeers
from .wire import INLINE_BODY_MAX, MAGIC, BadMessage, Header, ReplayGuard, Signer, columns_at, decode, encode, fields_at, route_id

__all__ = ["Channel", "read_tree_routing", "route_id", "RELAYED_KEEP_S"]

log = logging.getLogger(__name__)

_authenticators: dict[int, tuple[Any, set[str]]] = {}  # id(context) -> (ZAP handler, its domains)
_auth_lock = threading.Lock()


def _zap_domain(ctx: zmq.Context[Any], trust: Trust) -> str:
    """The ZAP domain of ``trust``'s cluster on ``ctx``: its handler admits only CurveZMQ clients
    holding that cluster's key pair. One domain per cluster, so endpoints of different clusters
    (two jobs with their own keys) each admit their own clients only."""
    domain = "mnb-" + hashlib.sha256(trust.curve_public or b"").hexdigest()[:16]
    with _auth_lock:
        entry = _authenticators.get(id(ctx))
        if entry is None:
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx, log=logging.getLogger("monarch_nb.zap"))
            auth.start()
            entry = _authenticators[id(ctx)] = (auth, set())
        auth, domains = entry
        if domain not in domains:
            auth.configure_curve(domain=domain, location=trust.curve_dir)
            domains.add(domain)
    return domain


@contextlib.contextmanager
def curve_server(sock: zmq.Socket[Any], trust: Trust | None) -> Iterator[None]:
    """Within: endpoints bound on ``sock`` speak CurveZMQ as the server of ``trust``'s cluster
    (ZeroMQ takes security options when an endpoint is bound); without ``trust``, plain."""
    if trust is None or not trust.encrypted:
        yield
        return
    domain = _zap_domain(sock.context, trust)
    sock.curve_secretkey = trust.curve_secret
    sock.curve_publickey = trust.curve_public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    try:
        yield
    finally:  # later endpoints are plain again (the domain stays: libzmq takes no empty one, and
        sock.curve_server = False  # its handler admits NULL-mechanism peers)

#: ``on_message(header, body, buffers, frames)``: a verified message, and the frames it came in.
MessageHandler = Callable[[Header, memoryview, list[memoryview], list[Any]], None]

#: Seconds the receive lease may stay free (its last leader runs an endpoint) before the IO
#: thread takes it back to receive and run timers.
TAKEOVER_S = 0.002
#: Frames smaller than this are copied into ZeroMQ; larger ones are sent without a copy.
_ZERO_COPY_MIN_BYTES = 64 * 1024
# plain ints: pyzmq's enum members cost an enum construction on every `&`
_POLLIN, _NOBLOCK, _SNDMORE = int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.SNDMORE)
#: ``_zmq_poll([(sock, _POLLIN)], 0)``: whether input waits on ``sock`` (what ZMQ_EVENTS says, and
#: like it, it takes the socket's edge on ZMQ_FD), in C: pyzmq's ``getsockopt`` makes a
#: ``SocketOption`` enum in Python on every call (two Python frames, run cold at every message of
#: a proc among many; docs/scale.md). Only on an open socket, under the channel's lock after
#: ``_is_closed`` was looked at: on a closed one pyzmq polls fd 0 (its handle is NULL) instead of
#: raising ENOTSOCK as getsockopt does.
_zmq_poll = zmq.zmq_poll
#: ``_zmq_send(sock, frame, flags, copy=)``: pyzmq's C send (its ``Socket.send`` is a Python method
#: for the draft sockets' routing_id and group arguments, which a channel never passes)
_zmq_send = zmq.backend.Socket.send
#: How often the IO thread looks at the lease while a busy thread keeps taking it back (seconds),
#: at first: each look that finds it taken again doubles the wait, up to :data:`_IO_RECHECK_MAX_S`,
#: and a look that finds it free (an endpoint runs) starts again from this.
_IO_RECHECK_S = 0.02
#: The longest wait between two looks (seconds): a leader that starts a long endpoint leaves messages
#: and timers (the proc's heartbeat among them) waiting at most this much more (plus
#: :data:`TAKEOVER_S`), far inside a hang timeout (seconds). Every look is a wake-up of the
#: proc's IO thread, run cold when many procs share the cores: looking every 20 ms cost a call to all
#: of 128 procs on 2 cores ~80 µs of CPU a proc (2.4-3 wake-ups a call), backing off ~20 (0.6).
_IO_RECHECK_MAX_S = 0.16
#: A leader that has kept the lease this long (seconds; an idle actor receiving on its own thread)
#: is waited for: the IO thread sleeps until it lets go (which wakes it at once) or this much
#: longer, instead of looking every :data:`_IO_RECHECK_S`, which cost an idle proc 50 wake-ups a
#: second (62 context switches a second in all, 11 now). Its wake-up costs the first call after
#: such a wait ~0.1-0.3 ms (this machine). While the lease changes hands (a busy actor) the IO
#: thread keeps looking (every 20 ms, backing off): waking it at every release put a context switch on every
#: call's path (a call to all of 128 procs of this machine 39 ms against 34).
_IO_IDLE_WAIT_S = 1.0


#: The fewest procs a cast must be for to go through the host agents (one message per host of 2
#: or more of them). The agent's hop (a wake-up of another process: 0.1-0.2 ms on a 2-core VM)
#: costs more than a few of the controller's sends (~20 µs each): on 4 procs of one host a call to
#: all took 739 µs through the agent against 580 µs straight (bench/actor_latency.py); from about
#: 8 the controller's sends cost as much as the hop, and what the agents save grows with procs.
FAN_MIN_PROCS = 8
#: The fewest hosts a cast must span to go through their agents. What the agents win is doing in
#: parallel, one per host, the sends the controller would do one after another; on one host the
#: agent does them one after another instead, a hop later: a call to all of 64 procs of this
#: machine took ~42 ms p50 through the agent against ~33 ms straight, 16 procs ~8 against ~7.
FAN_MIN_HOSTS = 2
#: Numbered messages a proc keeps while it waits for an earlier one (one that came by the slower path).
_MAX_HELD = 100_000
#: Seconds the controller holds a proc's message behind gathered replies that have not come (a
#: host agent that lost them: a bug, or a host going away) before it delivers it anyway, logged.
GATHER_WAIT_MAX_S = 5.0
_GATHER_FRAME = b"%"  # a proc's first frame on its link: "%N" (a gathered reply, N of the call's on this host), then
_STRAIGHT_MARK = b"~"  # the signed reply, or "~CID": one of those N went straight (a tensor, a large body)


#: A message a linked proc sent, held behind its gathered replies: (held since, header, body,
#: buffers, frames, sender).
_Held = tuple[float, Header, memoryview, list[memoryview], list[Any], "bytes | None"]


#: Casts' plans a channel keeps (see :meth:`Channel._fan_plan`); all are dropped when there are more.
_MAX_FAN_PLANS = 64
#: Seconds (at least) the controller keeps a cast it sent down the relay tree, to send a member host its part
#: straight when the member leaves its relay or the relay says it could not reach it
#: (:meth:`Channel.resend_relayed`). A member leaves a silent relay after
#: ``relay.RELAY_SILENT_INTERVALS`` heartbeat intervals (0.75 s by default) and says so at once.
RELAYED_KEEP_S = 5.0
#: Casts kept at most for that (the oldest go first: a cast rate above 2,000 a second keeps less than
#: :data:`RELAYED_KEEP_S` of them).
RELAYED_KEEP_MAX = 10_000
#: ... and at most this many bytes of their bodies (a cast down the tree has no buffers and a body of
#: at most ``INLINE_BODY_MAX``).
RELAYED_KEEP_MAX_BYTES = 64 << 20


class _FanGroup(NamedTuple):
    """The destinations of a cast linked to one host agent: its routing frame, theirs, and their
    indices in the cast's destinations."""

    agent: bytes  # the agent's route, the ROUTER's first frame
    dst: str  # the same, the header's dst
    routing: bytes  # "@ROUTE,ROUTE...": read by the agent
    routes: list[str]
    members: list["_LinkedProc"]
    indices: list[int]


class _TreeGroup(NamedTuple):
    """The destinations of a cast on the hosts of one relay (the relay's own and its members'):
    one message to the relay, which passes each host's part on (``@@CAST;HOST=ROUTE,...;...``)."""

    relay: bytes  # the relay agent's route
    dst: str  # the same, the header's dst
    sections: bytes  # "HOST=ROUTE,ROUTE;HOST=...": after "@@CAST;" in the routing frame
    routes: list[str]  # every host's routes, in the sections' order
    members: list["_LinkedProc"]
    indices: list[int]
    groups: list[_FanGroup]  # per host: to send its part straight again (:meth:`Channel.resend_relayed`)


class _FanPlan(NamedTuple):
    """How a cast to a list of destinations goes: these indices one by one, these groups one
    message per host agent, these one message per relay; made when the links were at ``version``."""

    version: int
    straight: list[tuple[int, "_LinkedProc | None"]]  # an index and its linked proc (None: not linked), by index
    groups: list[_FanGroup]
    trees: list[_TreeGroup]


class _Relayed(NamedTuple):
    """A cast sent down the relay tree, kept for :attr:`Channel.relayed_keep_s` (see :meth:`Channel.resend_relayed`):
    enough to sign a host's part of it again, with the cast's own ``seq`` and numbers."""

    sent_at: float  # time.monotonic()
    relay: bytes
    tree: _TreeGroup
    header: Header  # as sent, less its fan
    entries: dict[str, list[Any]]  # its fan: every host's entries, in the tree's order
    body: bytes


class _LinkedProc:
    """A proc linked to its host agent, as the controller's channel knows it: its route, its
    agent's routing frame, its incarnation, the last number sent to it (under the channel's lock);
    on the receiving thread: its gathered replies received (all up to ``gathered_upto``, and
    those after a gap), and its messages held until those before them came (``waiting``)."""

    __slots__ = ("route", "agent", "incarnation", "sent", "gathered_upto", "gathered_early", "waiting")

    def __init__(self, route: str, agent: bytes, incarnation: int) -> None:
        self.route, self.agent, self.incarnation, self.sent = route, agent, incarnation, 0
        self.gathered_upto = 0
        self.gathered_early: set[int] = set()
        self.waiting: list[_Held] = []

    def took_gathered(self, number: int) -> bool:
        """Note gathered reply ``number`` as received; False if it was already (a duplicate)."""
        if number <= self.gathered_upto or number in self.gathered_early:
            return False
        if number != self.gathered_upto + 1:
            self.gathered_early.add(number)
            return True
        self.gathered_upto = number
        while self.gathered_upto + 1 in self.gathered_early:
            self.gathered_early.discard(self.gathered_upto + 1)
            self.gathered_upto += 1
        return True

    def number(self) -> int:
        """The next message's number (call under the channel's lock, as it is sent)."""
        self.sent += 1
        return self.sent

    def stamped(self, frames: list[Any]) -> list[Any]:
        """A peer's message passed on to the proc, its envelope after ``^INCARNATION:NUMBER|`` (in
        the envelope's frame: a frame of its own costs more than the copy of a small envelope)."""
        envelope = frames[0] if type(frames[0]) is bytes else frames[0].bytes
        return [b"^%d:%d|%s" % (self.incarnation, self.number(), envelope), *frames[1:]]


def _unstamp(frames: list[Any]) -> tuple[list[Any], tuple[int, int] | None]:
    """``(frames with the envelope alone, (incarnation, number))`` of a message a linked proc got
    straight from the controller's socket (``^INCARNATION:NUMBER|envelope``); None: no stamp."""
    first = frames[0]
    end = first.find(b"|", 0, 48)
    incarnation, _, number = first[1:end].partition(b":")
    try:
        order = (int(incarnation), int(number))
    except ValueError:
        return frames, None
    return [memoryview(first)[end + 1:], *frames[1:]], order


def read_tree_routing(frame: bytes) -> tuple[int, list[tuple[bytes, list[bytes]]]]:
    """A relay's routing frame, ``@@CAST;HOST=ROUTE,ROUTE;HOST=...``: the cast's number (the
    controller's, for :meth:`Channel.resend_relayed`) and each host's routes, in order. Raises
    ValueError for a frame not of that form."""
    if frame[:2] != b"@@":
        raise ValueError("not a relay's routing frame")
    number, *sections = frame[2:].split(b";")
    hosts = []
    for section in sections:
        host, equals, routes = section.partition(b"=")
        if not equals or not host or not routes:
            raise ValueError(f"bad section {section[:64]!r} in a relay's routing frame")
        hosts.append((host, routes.split(b",")))
    return int(number), hosts


def _is_route(frame: bytes) -> bool:
    """A destination frame (a routing identity), not a message envelope."""
    return type(frame) is bytes and len(frame) < 256 and not (frame.startswith(MAGIC) and len(frame) > 40)


class Channel:
    """One socket, one IO thread. ``router=True`` binds a ROUTER; otherwise a DEALER connects.

    Attributes:
        fan_min_procs: :meth:`send_many` sends a host's procs one message through their agent only
            when the message is for at least this many procs in all (default :data:`FAN_MIN_PROCS`).
        fan_min_hosts: ... and on at least this many hosts (default :data:`FAN_MIN_HOSTS`).

    Args:
        identity: this endpoint's name, used as ``src`` in headers (and, for DEALERs, as the
            routing identity up to ``#``).
        signer: the cluster's :class:`~monarch_nb.transport.wire.Signer`.
        on_message: ``f(header, body, buffers, frames)`` run on the IO thread for each verified
            message. It must not block.
        router: bind a ROUTER (the controller) instead of connecting a DEALER.
        hub: a DEALER's: the identity of the ROUTER it connects to. A message to it goes without
            a destination frame (one frame less to send and to read on every message to the
            controller); messages to other peers name theirs, for the hub to forward.
    """

    def __init__(
        self, identity: str, signer: Signer, on_message: MessageHandler, *, router: bool = False, shm_run_id: str | None = None,
        hub: str | None = None,
    ) -> None:
        self.identity = identity
        # same-host peers: large buffers go through /dev/shm (see monarch_nb.transport.shm)
        self.shm_run_id = shm_run_id if shm_run_id and shm.available() else None
        self.router = router
        self._signer = signer
        self._on_message = on_message
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER if router else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock_pollin = [(self._sock, _POLLIN)]  # for _zmq_poll
        if router:
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        else:
            self._sock.setsockopt(zmq.IDENTITY, route_id(identity).encode())
        self._guard = ReplayGuard()
        self._seq = 0
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._readers: dict[int, Callable[[int], None]] = {}
        self._readers_version = 0
        self._route_frames: dict[str, bytes] = {}
        self._hub_frame = route_id(hub).encode() if hub is not None and not router else None
        self._via: dict[str, _LinkedProc] = {}  # ROUTER: linked procs by route
        self._plans_version = 0  # ROUTER: changed whenever _via or a fan threshold is, so casts' plans are made again
        self._plans: dict[tuple[str, ...], _FanPlan] = {}  # ROUTER: casts' plans by their destinations
        self._relay_of: dict[bytes, bytes] = {}  # ROUTER: host agent -> the relay its casts go through
        self._relays: set[bytes] = set()  # ROUTER: the relays of _relay_of
        self._serving_relays: frozenset[bytes] = frozenset()  # ROUTER: agents serving as relays (gathered replies of others)
        self._relayed: collections.OrderedDict[int, _Relayed] = collections.OrderedDict()  # ROUTER: casts kept, by number
        self._relayed_no = 0
        self._relayed_bytes = 0
        #: ROUTER: seconds a cast sent down the relay tree is kept for a resend (:meth:`resend_relayed`;
        #: the controller sets it from its heartbeat interval and hang timeout, at least :data:`RELAYED_KEEP_S`)
        self.relayed_keep_s = RELAYED_KEEP_S
        self._links: list[zmq.Socket[Any]] = []  # DEALER: its host agent's link (received from like the socket)
        self._local_peers: LocalPeers | None = None  # DEALER of a linked proc: its inbox and its host's peers
        self._link_backlog: set[zmq.Socket[Any]] = set()  # links left with messages waiting (see _receive_link)
        # DEALER: the controller's numbered messages (pseq), delivered in order: this incarnation, the next
        # number, and those that came early (through the other path), by number
        _, _, incarnation = identity.partition("#")
        self._incarnation = int(incarnation) if incarnation.isdigit() else -1
        self._next_pseq = 1
        self._held: dict[int, tuple[Header, memoryview, list[memoryview], list[Any]]] = {}
        # DEALER of a linked proc: replies gathered through its agent so far (gk), and to whom
        self._gathered_sent = 0
        self._gather_dst: str | None = None
        self._waiting: set[_LinkedProc] = set()  # ROUTER: linked procs with messages held behind gathered replies
        #: DEALER: ``on_routed(routes, frames)`` for a message the hub routed through this endpoint
        #: (a host agent: forward ``frames`` unread to the procs ``routes``); None: such frames are dropped
        self.on_routed: Callable[[list[bytes], list[Any]], None] | None = None
        #: DEALER: ``on_relayed(routing, frames)`` for a cast the hub sent down the relay tree through
        #: this endpoint (a relay agent: ``routing`` is ``@@CAST;HOST=ROUTE,...``, see
        #: :func:`read_tree_routing`); None: such frames are dropped
        self.on_relayed: Callable[[bytes, list[Any]], None] | None = None
        self._peers: set[bytes] = set()  # ROUTER: identities that sent a verified message (forward targets)
        self._own_route = route_id(identity).encode()
        self._timers: list[list[Any]] = []  # [next_due, interval_s, fn, phase_s or None]
        self._next_due = math.inf  # the soonest timer's next_due (kept by the thread that leads)
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._is_closed = False  # _closed.is_set() without its Python call (read on every message)
        self._lease = threading.Lock()  # held by the thread that receives (see the module docstring)
        self._lease_freed = threading.Event()  # set when a leader lets the lease go while the IO thread waits on it
        self._io_waits = False  # the IO thread waits on _lease_freed (else a release need not set it: ~2 µs a message)
        self._leader: int | None = None  # that thread's ident
        self._leader_is_io = False
        self._released_at = 0.0
        self._wanting = 0  # threads waiting to lead (callers, idle actors): the IO thread yields
        self._callers = 0  # threads blocked on a reply waiting to lead: idle actors yield too
        self._count_lock = threading.Lock()
        self._local = threading.local()  # per leading thread: its poller
        self.dropped: collections.Counter[str] = collections.Counter()  # reason -> count
        self.received: collections.Counter[str] = collections.Counter()  # kind -> verified messages handed on
        self.forwarded = 0  # messages passed on to another peer unread (ROUTER)
        self.sent_via_agents = 0  # ROUTER: messages sent through a host agent (a cast to N procs of a host: one)
        self.sent_via_relays = 0  # ROUTER: messages sent down the relay tree (a cast to the hosts of a relay: one)
        self.resent_relayed = 0  # ROUTER: a host's part of such a cast sent to it straight again
        self.replies_via_relays = 0  # ROUTER: gathered replies taken from a relay for procs of its members
        self.gathered_again = 0  # ROUTER: gathered replies dropped as had (a member's resend after its relay passed them on)
        self._fan_min_procs = FAN_MIN_PROCS
        self._fan_min_hosts = FAN_MIN_HOSTS
        self.address: str | None = None
        self.muted_until = 0.0  # a partition fault: drop all traffic until this monotonic time

    # -- set-up ---------------------------------------------------------------------------------
    def bind(self, address: str, trust: Trust | None = None) -> str:
        """Bind (ROUTER) to ``address`` (``ipc://path`` or ``tcp://HOST:0``); return the real one.

        With an encrypting ``trust`` this endpoint speaks CurveZMQ as the server and admits only
        clients holding the cluster's key pair; other endpoints of the socket are unaffected
        (ZeroMQ takes security options when an endpoint is bound). Any thread.
        """
        with self._lock, curve_server(self._sock, trust):
            self._sock.bind(address)
            bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address = self.address or bound
        return bound

    def connect(self, address: str, trust: Trust | None = None) -> None:
        """Connect (DEALER) to ``address``; with an encrypting ``trust``, as a CurveZMQ client."""
        if trust is not None and trust.encrypted:
            self._sock.curve_serverkey = trust.curve_public
            self._sock.curve_publickey = trust.curve_public
            self._sock.curve_secretkey = trust.curve_secret
        self._sock.connect(address)
        self.address = address

    def add_reader(self, fd: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(fd)`` on the receiving thread when ``fd`` is readable (any thread)."""
        self._readers[fd] = callback
        self._readers_version += 1
        self._wake()

    def remove_reader(self, fd: int) -> None:
        self._readers.pop(fd, None)
        self._readers_version += 1

    def every(self, interval_s: float, fn: Callable[[], None], phase_s: float | None = None) -> None:
        """Run ``fn()`` on the IO thread every ``interval_s`` seconds. Call before :meth:`start`.

        ``phase_s``: run at the wall-clock times ``t`` where ``t % interval_s == phase_s`` (the
        first one as soon as it comes), so that processes on hosts whose clocks agree tick in
        chosen slots; None: ``interval_s`` after the previous run, the first ``interval_s`` from now.
        """
        now = time.monotonic()
        due = now + interval_s if phase_s is None else now + (phase_s - time.time()) % interval_s
        self._timers.append([due, interval_s, fn, phase_s])
        self._next_due = min(self._next_due, due)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once, on the thread that leads, ``delay_s`` seconds from now. Call it on
        the leading thread (from a handler, a reader or a timer) or before :meth:`start`."""
        due = time.monotonic() + delay_s
        self._timers.append([due, None, fn, None])
        self._next_due = min(self._next_due, due)

    def start(self, name: str = "monarch_nb-io") -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def run_forever(self) -> None:
        """Run the IO loop on the calling thread until :meth:`close` (host agents, procs)."""
        self._run()

    # -- sending --------------------------------------------------------------------------------
    def send(self, dst: str, header: Header, body: bytes = b"", buffers: Sequence[Any] = (), *, gather: int = 0) -> None:
        """Number, sign and send one message to ``dst``. Thread-safe; never blocks on the network.

        ``gather``: the message is one of ``gather`` replies of this host's procs to one call (a
        cast's, ``header["cid"]``) that their host agent may send ``dst`` as one message; it goes
        to the agent when this proc is linked and it has no buffers and a small body, else
        straight, the agent told so (see the module docstring). 0: straight.
        """
        if gather and self._links:
            if not buffers and len(body) <= INLINE_BODY_MAX:
                self._send_gathered(dst, header, body, gather)
                return
            self._to_link([b"%s%d" % (_GATHER_FRAME, gather), _STRAIGHT_MARK + header["cid"].encode()])  # type: ignore[typeddict-item]  # a reply's
        self._send_one(dst, header, body, buffers, self._linked(dst))

    def _linked(self, dst: str) -> _LinkedProc | None:
        """The linked proc ``dst`` names (by its route), or None (not linked; a DEALER links none)."""
        return self._via.get(route_id(dst)) if self._via else None

    def _send_one(self, dst: str, header: Header, body: bytes, buffers: Sequence[Any], linked: _LinkedProc | None) -> None:
        """Number, sign and send one message to ``dst`` on the socket; ``linked``: ``dst`` is that
        linked proc (its messages are numbered for it: ``pseq``), or None."""
        header["src"] = self.identity
        header["dst"] = dst
        if self.shm_run_id and buffers:
            buffers = self._export_large(header, buffers, self.shm_run_id)
        with self._lock:
            self._seq += 1
            header["seq"] = self._seq
            if linked is not None:
                header["pseq"] = [linked.incarnation, linked.number()]
            if self._gathered_sent and dst == self._gather_dst:  # held at the controller until those came
                header["after"] = self._gathered_sent
            frames = encode(self._signer, header, body, buffers)
            # a ROUTER's first frame routes; a DEALER's names the destination, so that the hub can
            # forward the message to another peer without reading it (the receiver verifies it);
            # a message to the hub itself names none
            route = self._route_frame(dst)
            if route != self._hub_frame:
                straight = self._local_peers.way(route) if self._local_peers is not None else None
                if straight is not None:  # a proc of this host: to its inbox (see local_peers)
                    self._local_peers.sent += 1  # type: ignore[union-attr]  # set when straight is
                    self._send_locked(frames, straight)
                    return
                frames.insert(0, route)
            self._send_locked(frames)

    def _send_gathered(self, dst: str, header: Header, body: bytes, gather: int) -> None:
        """Send a reply to the host agent for gathering (numbered ``gk``; DEALER of a linked proc)."""
        header["src"] = self.identity
        header["dst"] = dst
        with self._lock:
            self._seq += 1
            header["seq"] = self._seq
            self._gathered_sent += 1
            header["gk"] = self._gathered_sent
            self._gather_dst = dst
            frames = encode(self._signer, header, body)
            self._send_locked([b"%s%d" % (_GATHER_FRAME, gather), *frames], self._links[0])

    def _to_link(self, frames: list[Any]) -> None:
        with self._lock:
            self._send_locked(frames, self._links[0])

    def send_many(self, dsts: Sequence[str], header: Header, body: bytes = b"", buffers: Sequence[Any] = (),
                  each: Mapping[str, Sequence[Any]] | None = None) -> None:
        """Send ``header`` with ``body`` to each of ``dsts``, as :meth:`send` would one by one;
        ``each``: fields that differ by destination, as columns (``each[name][i]`` is
        ``dsts[i]``'s ``name``). The destinations reached through the same host agent get one
        message, signed once (``fan``: the routes and each column's entries for them), which the
        agent passes to each of them, when the message is for at least :attr:`fan_min_procs`
        procs in all, on at least :attr:`fan_min_hosts` hosts. Which destination goes which way
        is planned once per list of destinations (:meth:`_fan_plan`), so a cast's per-proc work is
        its number (``pseq``) and its columns' entries. Thread-safe; never blocks on the network."""
        plan = self._fan_plan(dsts)
        columns = each or {}
        for index, linked in plan.straight:
            dst = dsts[index]
            if plan.version != self._plans_version:  # a proc linked or unlinked meanwhile (a restart): ask again
                linked = self._linked(dst)
            self._send_one(dst, fields_at(columns, index, header), body, buffers, linked)  # type: ignore[arg-type]  # a kind's own fields
        for group in plan.groups:
            self._send_fan(group, header, columns, body, buffers)
        kept = not buffers and len(body) <= INLINE_BODY_MAX  # a large message is not kept: it goes one a host
        for tree in plan.trees:
            if kept and self._send_tree(tree, plan.version, header, columns, body):
                continue
            for group in tree.groups:  # one message a host
                self._send_fan(group, header, columns, body, buffers)

    def _send_tree(self, tree: _TreeGroup, version: int, header: Header, columns: Mapping[str, Sequence[Any]],
                   body: bytes) -> bool:
        """Send a cast's destinations on a relay's hosts as one message to the relay, kept for a
        resend; False (nothing sent) when the plan is stale: a host may have left that relay
        meanwhile, and what it was sent there after its resend would never come."""
        fan: Header = {**header, "src": self.identity, "dst": tree.dst}
        entries: dict[str, list[Any]] = {"to": tree.routes, **columns_at(columns, tree.indices)}
        with self._lock:  # cast_through changes the version before resend_relayed takes this lock
            if version != self._plans_version:
                return False
            self._seq += 1
            fan["seq"] = self._seq
            entries["pseq"] = [[linked.incarnation, linked.number()] for linked in tree.members]
            self._relayed_no += 1
            self._keep_relayed(self._relayed_no, _Relayed(time.monotonic(), tree.relay, tree, fan.copy(), entries, body))
            fan["fan"] = entries
            frames = encode(self._signer, fan, body)
            self.sent_via_relays += 1
            frames[:0] = [tree.relay, b"@@%d;%s" % (self._relayed_no, tree.sections)]
            self._send_locked(frames)
        return True

    def _send_fan(self, group: _FanGroup, header: Header, columns: Mapping[str, Sequence[Any]], body: bytes,
                  buffers: Sequence[Any]) -> None:
        """Send a cast's destinations on one host as one message to their agent."""
        fan: Header = {**header, "src": self.identity, "dst": group.dst}
        entries: dict[str, list[Any]] = {"to": group.routes, **columns_at(columns, group.indices)}
        with self._lock:
            self._seq += 1
            fan["seq"] = self._seq
            entries["pseq"] = [[linked.incarnation, linked.number()] for linked in group.members]
            fan["fan"] = entries
            frames = encode(self._signer, fan, body, buffers)
            self.sent_via_agents += 1
            frames[:0] = [group.agent, group.routing]
            self._send_locked(frames)

    def _keep_relayed(self, number: int, cast: _Relayed) -> None:
        """Keep a cast sent down the tree (channel lock held); drop those kept longer than
        :attr:`relayed_keep_s`, and the oldest beyond :data:`RELAYED_KEEP_MAX` casts or
        :data:`RELAYED_KEEP_MAX_BYTES` of bodies (counted: ``dropped["relayed kept"]``, logged once)."""
        kept = self._relayed
        kept[number] = cast
        self._relayed_bytes += len(cast.body)
        cutoff = cast.sent_at - self.relayed_keep_s
        while kept:
            oldest = next(iter(kept.values()))
            if oldest.sent_at >= cutoff and len(kept) <= RELAYED_KEEP_MAX and self._relayed_bytes <= RELAYED_KEEP_MAX_BYTES:
                break
            if oldest.sent_at >= cutoff:
                if not self.dropped["relayed kept"]:
                    log.warning("casts down the relay tree come faster than %d (or %d MiB) in %.1f s: the oldest are no "
                                "longer kept to send again should a relay fail", RELAYED_KEEP_MAX, RELAYED_KEEP_MAX_BYTES >> 20,
                                self.relayed_keep_s)
                self.dropped["relayed kept"] += 1
            kept.popitem(last=False)
            self._relayed_bytes -= len(oldest.body)

    def _fan_plan(self, dsts: Sequence[str]) -> _FanPlan:
        """Which of ``dsts`` go one by one and which in one message per host agent, kept for the
        next send to the same destinations until a proc is linked or unlinked or a threshold
        changes (a few plans)."""
        key = tuple(dsts)
        plan = self._plans.get(key)
        if plan is not None and plan.version == self._plans_version:
            return plan
        version = self._plans_version
        groups: dict[bytes, tuple[list[_LinkedProc], list[int]]] = {}
        straight: list[tuple[int, _LinkedProc | None]] = []
        via = self._via
        seen: set[str] = set()
        for index, dst in enumerate(dsts):
            linked = via.get(dst) if via else None
            if linked is None and via and "#" in dst:
                linked = via.get(route_id(dst))
            if linked is None or linked.route in seen:  # a proc named twice gets its second straight
                straight.append((index, linked))
            else:
                seen.add(linked.route)
                members, indices = groups.setdefault(linked.agent, ([], []))
                members.append(linked)
                indices.append(index)
        fan_out = len(dsts) >= self.fan_min_procs and len(groups) >= self.fan_min_hosts
        fans: list[_FanGroup] = []
        under: dict[bytes, list[_FanGroup]] = {}  # relay -> its hosts' groups
        for agent, (members, indices) in groups.items():
            relay = self._relay_of.get(agent, agent if agent in self._relays else None) if fan_out else None
            if (len(members) < 2 and relay is None) or not fan_out:  # the agent's hop would cost more than these sends
                straight.extend(zip(indices, members))
                continue
            routes = [linked.route for linked in members]
            group = _FanGroup(agent, agent.decode(), b"@" + ",".join(routes).encode(), routes, members, indices)
            if relay is None:
                fans.append(group)
            else:
                under.setdefault(relay, []).append(group)
        trees = []
        for relay, hosts in under.items():
            if len(hosts) >= 2:  # one message to the relay instead of one a host
                trees.append(self._tree_group(relay, hosts))
            elif len(hosts[0].members) >= 2:
                fans.append(hosts[0])
            else:
                straight.extend(zip(hosts[0].indices, hosts[0].members))
        plan = _FanPlan(version, sorted(straight, key=lambda item: item[0]), fans, trees)
        if len(self._plans) >= _MAX_FAN_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    @staticmethod
    def _tree_group(relay: bytes, hosts: list[_FanGroup]) -> _TreeGroup:
        routes = [route for group in hosts for route in group.routes]
        sections = b";".join(b"%s=%s" % (group.agent, group.routing[1:]) for group in hosts)
        return _TreeGroup(relay, relay.decode(), sections, routes, [linked for group in hosts for linked in group.members],
                          [index for group in hosts for index in group.indices], hosts)

    def cast_through(self, agent: str, relay: str | None) -> None:
        """Casts to host ``agent``'s linked procs go down the relay tree through ``relay`` (the
        agent heartbeats through it: connected to it), with the relay's other hosts' parts, one
        message to the relay; None: straight to the agent again (ROUTER). See :meth:`resend_relayed`
        for a cast the relay could not pass on."""
        host = route_id(agent).encode()
        with self._lock:  # callers on two threads (the IO thread's heartbeats, a detach)
            if relay is None:
                if self._relay_of.pop(host, None) is None:
                    return
            else:
                self._relay_of[host] = route_id(relay).encode()
            self._relays = set(self._relay_of.values())
            self._plans_version += 1

    def relay_serves(self, agent: str, serving: bool) -> None:
        """Host ``agent`` serves as a relay (or no longer does: a fresh agent, a detached host):
        the gathered replies it sends may hold its members' procs' (merged up the tree), which
        are taken as from their own agents (each still a linked proc's, its current incarnation,
        a number not seen). Not the casts' plan (:meth:`cast_through`): a member sends its
        replies up as soon as it joins, before the controller hears it through the relay."""
        host = route_id(agent).encode()
        with self._lock:
            self._serving_relays = self._serving_relays | {host} if serving else self._serving_relays - {host}

    def resend_relayed(self, relay: str, hosts: Sequence[str], cast: int | None = None) -> int:
        """Send ``hosts`` their parts of the casts sent down the tree through ``relay`` (of cast
        number ``cast`` only, the relay's own host among them if named: it said so; None: of every
        cast kept, :attr:`relayed_keep_s`, not to the relay's own host, gone with it) straight, as a
        cast through their agents: a member that left its relay (it fell silent), or that the relay
        said it could not reach. A proc drops a part it already had (its number, ``pseq``, was
        delivered). Returns how many parts were sent (ROUTER; thread-safe)."""
        through = route_id(relay).encode()
        wanted = {route_id(host).encode() for host in hosts}
        if cast is None:
            wanted.discard(through)
        parts: list[tuple[_FanGroup, Header, bytes]] = []
        with self._lock:  # what to send; signed and sent after, each under the lock on its own
            if cast is not None and cast not in self._relayed:
                log.warning("relay %s could not pass cast %d on to %s, and it is no longer kept: their procs wait for it",
                            relay, cast, ", ".join(sorted(hosts)))
            kept = self._relayed if cast is None else {cast: self._relayed[cast]} if cast in self._relayed else {}
            for entry in kept.values():
                if entry.relay != through:
                    continue
                start = 0
                for group in entry.tree.groups:
                    end = start + len(group.routes)
                    if group.agent in wanted:  # its part alone, as a cast through its agent, under the cast's own seq
                        parts.append((group, {**entry.header, "dst": group.dst,
                                              "fan": {name: column[start:end] for name, column in entry.entries.items()}},
                                      entry.body))
                    start = end
        for group, part, body in parts:
            frames = encode(self._signer, part, body)
            with self._lock:
                self._send_locked([group.agent, group.routing, *frames])
                self.resent_relayed += 1
        return len(parts)

    @property
    def fan_min_procs(self) -> int:
        """The fewest procs a cast must be for to go through host agents (:data:`FAN_MIN_PROCS`)."""
        return self._fan_min_procs

    @fan_min_procs.setter
    def fan_min_procs(self, procs: int) -> None:
        self._fan_min_procs = procs
        self._plans_version += 1

    @property
    def fan_min_hosts(self) -> int:
        """The fewest hosts a cast must span to go through their agents (:data:`FAN_MIN_HOSTS`)."""
        return self._fan_min_hosts

    @fan_min_hosts.setter
    def fan_min_hosts(self, hosts: int) -> None:
        self._fan_min_hosts = hosts
        self._plans_version += 1

    def route_via(self, dst: str, agent: str, incarnation: int) -> None:
        """``dst``'s incarnation ``incarnation`` (its pid) is linked to host ``agent``: casts to it
        and its host's other procs go through the agent, and every message for it is numbered
        (ROUTER). Call it before the first message to that incarnation (at its hello)."""
        route = route_id(dst)
        self._forget_waiting(self._via.get(route))
        self._via[route] = _LinkedProc(route, route_id(agent).encode(), incarnation)
        self._plans_version += 1

    def routed_via(self, dst: str) -> str | None:
        """The host agent that casts to ``dst`` go through, or None (not linked)."""
        linked = self._linked(dst)
        return linked.agent.decode() if linked is not None else None

    @property
    def held(self) -> int:
        """Numbered messages waiting here for an earlier one (DEALER of a linked proc)."""
        return len(self._held)

    def route_direct(self, dst: str) -> None:
        """``dst``'s new incarnation is not linked: every message straight to it, unnumbered."""
        self._forget_waiting(self._via.pop(route_id(dst), None))
        self._plans_version += 1

    def _forget_waiting(self, linked: _LinkedProc | None) -> None:
        """An incarnation is replaced (it is gone): drop what it sent that waited for replies its
        agent never passed on (counted)."""
        if linked is not None and linked.waiting:
            self.dropped["gathered never came"] += len(linked.waiting)
            linked.waiting.clear()
            self._waiting.discard(linked)

    def add_link(self, sock: "zmq.Socket[Any]") -> None:
        """Receive from ``sock`` (a connected DEALER: the host agent's link) as from the channel's
        own socket: verified, replay-guarded, dispatched on the leading thread. Before :meth:`start`."""
        self._links.append(sock)
        # Only this reader uses the socket, and it reads until ZMQ_EVENTS says none is left; a
        # message arriving after that makes ZMQ_FD readable (libzmq signals an arrival on a pipe
        # that was seen empty), so each arrival wakes the loop. Seen empty once now, or read now.
        self.add_reader(int(sock.getsockopt(zmq.FD)), lambda fd: self._receive_link(sock))
        self._receive_link(sock)

    def add_local_peers(self, peers: LocalPeers) -> None:
        """Send this proc's messages for the procs of its host straight to their inboxes, and
        receive theirs on ``peers.inbox`` when it is bound, as from the channel's own socket (a
        DEALER linked to its agent, whose announcements say who is on the host; see
        :mod:`.local_peers`). Before :meth:`start` or :meth:`run_forever`."""
        self._local_peers = peers
        inbox = peers.inbox
        if inbox is not None:
            self.add_reader(int(inbox.getsockopt(zmq.FD)), lambda fd: self._receive_link(inbox))
            self._receive_link(inbox)

    @property
    def local_peers(self) -> LocalPeers | None:
        """This proc's inbox and its host's peers (None: all its messages go through the hub)."""
        return self._local_peers

    def _route_frame(self, dst: str) -> bytes:
        frame = self._route_frames.get(dst)
        if frame is None:
            frame = self._route_frames[dst] = route_id(dst).encode()
        return frame

    def _export_large(self, header: Header, buffers: Sequence[Any], run_id: str) -> list[Any]:
        out = list(buffers)
        exported = []
        for index, buf in enumerate(buffers):
            nbytes = memoryview(buf).nbytes
            if nbytes >= shm.SHM_MIN_BYTES:
                exported.append([index, shm.export_buffer(buf, run_id), nbytes])
                out[index] = b""
        if exported:
            header["shm"] = exported
        return out

    def _import_large(self, header: Header, buffers: list[memoryview]) -> list[memoryview]:
        for index, name, nbytes in header["shm"]:
            buffers[index] = shm.import_buffer(name, nbytes)
        return buffers

    def forward(self, dst: str, frames: list[Any]) -> None:
        """Send already-signed ``frames`` (a message from another peer) to ``dst`` (ROUTER only)."""
        route = route_id(dst)
        linked = self._via.get(route) if self._via else None
        with self._lock:
            self._send_locked([route.encode(), *(linked.stamped(frames) if linked is not None else frames)])

    def _send_locked(self, frames: list[Any], link: "zmq.Socket[Any] | None" = None) -> None:
        """Send ``frames`` on the channel's socket, or on the host agent's ``link`` (a proc's
        replies for gathering); a partition fault cuts both."""
        if self.muted_until and time.monotonic() < self.muted_until:
            self.dropped["partitioned"] += 1
            return
        if self._is_closed:
            return
        try:
            sock = self._sock if link is None else link
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                # small frames are copied (cheaper than a zero-copy frame's bookkeeping), buffers are not
                size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
                _zmq_send(sock, frame, _SNDMORE if i < last else 0, copy=size < _ZERO_COPY_MIN_BYTES)
            pending_input = _zmq_poll(self._sock_pollin if link is None else [(link, _POLLIN)], 0)
        except zmq.ZMQError as exc:
            log.warning("send failed: %s", exc)
            return
        if pending_input:  # the send may have taken the socket's edge (ZMQ_FD): the loop reads it
            if link is not None:
                self._link_backlog.add(link)
            if threading.get_ident() != self._leader:
                self._wake()

    def wake(self) -> None:
        """Make the thread that receives look again (a message was queued for it meanwhile)."""
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed, or the pipe is full (the IO thread is awake anyway)
            pass

    # -- receiving: the lease --------------------------------------------------------------------
    def _run(self) -> None:
        """The IO thread: lead whenever no other thread does (yielding to any that wants to)."""
        self._thread = threading.current_thread()
        recheck_s = _IO_RECHECK_S
        while not self._is_closed:
            if self._lease.locked():  # another thread leads
                if time.monotonic() - self._released_at < _IO_IDLE_WAIT_S:
                    self._closed.wait(recheck_s)  # the lease changes hands (a busy actor): look again later,
                    recheck_s = min(2 * recheck_s, _IO_RECHECK_MAX_S)  # later each time it was taken
                else:  # kept for a while (an idle actor receiving on its own thread): wait until it lets go
                    self._lease_freed.clear()
                    self._io_waits = True  # before looking: a release after the look sees it and sets the event
                    if self._lease.locked():
                        self._lease_freed.wait(_IO_IDLE_WAIT_S)
                    self._io_waits = False
                    recheck_s = _IO_RECHECK_S  # an idle actor's next endpoint may be a long one
                continue
            recheck_s = _IO_RECHECK_S  # found free (an endpoint runs, or just ended): look often again
            free_for = time.monotonic() - self._released_at
            if self._wanting == 0 and free_for >= TAKEOVER_S and self._lease.acquire(blocking=False):
                self._lead_locked(lambda: self._wanting > 0, None, io=True)
                continue
            time.sleep(max(TAKEOVER_S - free_for, 0.0005))

    def lead(self, done: Callable[[], bool], timeout: float | None = None, caller: bool = True) -> bool:
        """Receive and dispatch messages on this thread until ``done()`` or ``timeout`` seconds.

        A ``caller`` (a thread blocked on a reply) waits for the lease; another thread (an idle
        actor) only takes it if it is free or held by the IO thread, and gives it up to a caller.
        Returns True when ``done()`` held, False on timeout or when the lease was not taken (the
        thread then waits in its own way: some leader dispatches to it).
        """
        if self._is_closed:
            return done()
        if self._leader == threading.get_ident():  # a handler waiting on a reply: already leading
            return done()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._count_lock:
            self._wanting += 1
            if caller:
                self._callers += 1
        try:
            while not done():
                if self._lease.acquire(blocking=False):
                    return self._lead_locked(done, deadline, io=False, yields=not caller)
                if self._leader_is_io:
                    self._wake()  # the IO thread yields to us
                if not caller and not self._leader_is_io:
                    return False  # another thread leads and will dispatch to us
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self._lease.acquire(timeout=min(0.001, left) if left is not None else 0.001):
                    return self._lead_locked(done, deadline, io=False, yields=not caller)
            return True
        finally:
            with self._count_lock:
                self._wanting -= 1
                if caller:
                    self._callers -= 1

    def _lead_locked(self, done: Callable[[], bool], deadline: float | None, io: bool, yields: bool = True) -> bool:
        """Run the loop holding the lease until ``done()`` (or, for the IO thread, until another
        thread wants to lead); release it."""
        self._leader = threading.get_ident()
        self._leader_is_io = io
        try:
            # the version read before the poller is made: a reader added or removed by another thread
            # in between makes the next turn make it again (read after, it would be missed)
            version = self._readers_version
            poller = self._poller()
            while not self._is_closed:
                if version != self._readers_version:  # a reader was added or removed meanwhile
                    version = self._readers_version
                    poller = self._poller()
                if done():
                    return True
                if not io and yields and self._callers > 0:
                    return False  # an idle actor gives way to a thread blocked on a reply
                with self._lock:  # input pending? (inline: a frame fewer on every message)
                    pending = not self._is_closed and _zmq_poll(self._sock_pollin, 0)
                timeout_ms = 0 if pending else self._next_timer_ms()
                if deadline is not None:
                    timeout_ms = min(timeout_ms, max(0, int((deadline - time.monotonic()) * 1000) + 1))
                try:
                    events = poller.poll(timeout_ms)
                except InterruptedError:
                    continue
                for fd, _ in events:
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 65536)
                        except (BlockingIOError, OSError):
                            pass
                    elif fd != self._wake_r:
                        callback = self._readers.get(fd)  # may be removed by another thread meanwhile
                        if callback is not None:
                            self._guarded(callback, fd)
                self._receive_all()
                if self._waiting:
                    self._release_overdue()
                if time.monotonic() >= self._next_due:
                    self._run_timers()
                if done():  # (before the loop's next turn: what it checks first, the message's own way out)
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
            return done()
        finally:
            self._leader = None
            self._leader_is_io = False
            self._released_at = time.monotonic()
            self._lease.release()
            if self._io_waits:
                self._lease_freed.set()

    def _poller(self) -> "select.poll":
        """This thread's poller over the socket, the wake pipe and the readers (kept current)."""
        local = self._local
        if getattr(local, "version", None) != self._readers_version or getattr(local, "poller", None) is None:
            version = self._readers_version
            poller = select.poll()
            poller.register(int(self._sock.getsockopt(zmq.FD)), select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            for fd in tuple(self._readers):
                poller.register(fd, select.POLLIN)
            local.poller, local.version = poller, version
        current: select.poll = local.poller
        return current

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("handler %r failed; the IO loop goes on", fn)

    def _receive_all(self) -> None:
        if self._link_backlog:
            for link in tuple(self._link_backlog):
                self._receive_link(link)
        for _ in range(64):  # bounded so timers and readers are not starved
            with self._lock:
                if self._is_closed:
                    return
                if not _zmq_poll(self._sock_pollin, 0):
                    return  # cheaper than raising zmq.Again
                try:
                    frames = self._recv_frames()
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:
                    log.warning("recv failed: %s", exc)
                    return
            if self.muted_until and time.monotonic() < self.muted_until:
                self.dropped["partitioned"] += 1
                continue
            sender = None
            if self.router:
                sender, frames = frames[0], frames[1:]
                if len(frames) >= 2 and _is_route(frames[0]):
                    dst, frames = frames[0], frames[1:]
                    if dst != self._own_route and dst in self._peers:
                        self.forwarded += 1  # another peer's: pass it on unread (the receiver verifies it)
                        linked = self._via.get(dst.decode()) if self._via else None
                        with self._lock:
                            self._send_locked([dst, *(linked.stamped(frames) if linked is not None else frames)])
                        continue
            elif frames[0][:1] == b"^":  # a linked proc: a peer's message, numbered by the controller's socket
                self._handle(*_unstamp(frames))
                continue
            elif len(frames) >= 2 and frames[0][:2] == b"@@":  # a relay agent: a cast for its hosts' procs
                if self.on_relayed is None:
                    self.dropped["relayed"] += 1
                else:
                    self._guarded(self.on_relayed, frames[0], frames[1:])
                continue
            elif len(frames) >= 2 and frames[0][:1] == b"@":  # a host agent: a cast for procs of ours
                if self.on_routed is None:
                    self.dropped["routed"] += 1
                else:
                    self._guarded(self.on_routed, frames[0][1:].split(b","), frames[1:])
                continue
            self._handle(frames, None, sender)

    def _receive_link(self, link: "zmq.Socket[Any]") -> None:
        """Receive what came through the host agent's link, or to this proc's inbox from a
        peer of its host (a reader: its fd became readable; or the loop: more was waiting than
        one turn reads)."""
        self._link_backlog.discard(link)
        peers = self._local_peers
        inbox = peers.inbox if peers is not None else None
        for _ in range(64):  # bounded so timers and the socket are not starved
            with self._lock:
                if self._is_closed or not _zmq_poll([(link, _POLLIN)], 0):
                    return  # seen empty: the next arrival makes its fd readable
                try:
                    frames: list[Any] = link.recv_multipart(_NOBLOCK, copy=False)
                except zmq.ZMQError:
                    return
                if link is inbox:
                    frames = frames[1:]  # the sender's routing frame (the header names it, signed)
                    if not frames:
                        continue
                frames[0] = frames[0].bytes  # the envelope (small); buffers stay zero-copy frames
                if link is not inbox and frames[0][:1] in ANNOUNCEMENTS:  # the agent's word on who is on the host
                    if peers is not None and (len(frames) != 1 or not peers.learn(frames[0])):
                        self.dropped["bad"] += 1  # (without peers, this proc sends through the hub only)
                    continue
            if self.muted_until and link is inbox and time.monotonic() < self.muted_until:
                self.dropped["partitioned"] += 1
                continue
            self._handle(frames, from_peer=link is inbox)
        self._link_backlog.add(link)  # more waiting, and its fd will not say so: the loop's next turn
        self._wake()

    def _handle(self, frames: list[Any], order: tuple[int, int] | None = None, sender: bytes | None = None,
                from_peer: bool = False) -> None:
        """Verify, replay-guard and dispatch one message (receiving thread); ``order``: the
        controller's ``(incarnation, number)`` for it (a linked proc's message straight from the
        controller's socket; a cast's is in its ``fan`` fields); ``from_peer``: it came to this
        proc's inbox, straight from a proc of its host (marked ``_local_peer`` for the handler)."""
        try:
            header, body, buffers = decode(self._signer, frames)
        except BadMessage as exc:
            self.dropped["bad"] += 1
            log.warning("dropped a bad message: %s", exc)
            return
        if from_peer:
            if route_id(str(header.get("dst", ""))).encode() != self._own_route or "pseq" in header or "fan" in header:
                self.dropped["not ours"] += 1  # a peer's is for this proc, one message, never numbered by the controller
                return
            header["_local_peer"] = 1  # type: ignore[typeddict-unknown-key]  # read by the actor host (a call before its spawn)
        fan = header.pop("fan", None)  # a message to several procs of a host: take ours
        if fan is not None:
            own = self._own_route.decode()
            try:
                routes = fan["to"]
                if type(routes) is not list:
                    raise TypeError("fan's routes are not a list")
                fields = fields_at(fan, routes.index(own))
                del fields["to"]
            except ValueError:
                self.dropped["not ours"] += 1
                return
            except (TypeError, KeyError, IndexError, AttributeError):
                self.dropped["bad"] += 1
                return
            header.update(fields)  # type: ignore[typeddict-item]  # a kind's own fields (rank, idx, mi, pseq)
            header["dst"] = own  # as a message of its own to us would say
            if len(routes) > 1 and self._links:
                header["_fanned"] = len(routes)  # type: ignore[typeddict-unknown-key]  # its reply may be gathered (see send)
        pseq = header.pop("pseq", None)
        if pseq is not None:
            if not (type(pseq) is list and len(pseq) == 2 and type(pseq[0]) is int and type(pseq[1]) is int):
                self.dropped["bad"] += 1
                return
            order = (pseq[0], pseq[1])
        if order is not None:
            self._in_order(order, header, body, buffers, frames)
            return
        self._accept(header, body, buffers, frames, sender)

    def _accept(self, header: Header, body: memoryview, buffers: list[memoryview], frames: list[Any],
                sender: bytes | None = None) -> None:
        # replies gathered by host agents, and a linked proc's messages that must wait for them
        if self._via and "after" in header and self._held_back(header, body, buffers, frames, sender):
            return
        if "gathered" in header:
            released = self._take_gathered(header)
            self._accept_now(header, body, buffers, frames, sender)
            for held in released:
                self._accept_now(*held)
            return
        self._accept_now(header, body, buffers, frames, sender)

    def _linked_now(self, src: str) -> _LinkedProc | None:
        """The linked proc ``src`` (``ROUTE#INCARNATION``) names, if that is its current incarnation."""
        route, _, incarnation = src.partition("#")
        linked = self._via.get(route)
        return linked if linked is not None and str(linked.incarnation) == incarnation else None

    def _due(self, linked: _LinkedProc, due: Callable[[_Held], bool]) -> list[_Held]:
        """Take ``linked``'s held messages from the first while ``due(held)`` says so, in order."""
        taken = []
        while linked.waiting and due(linked.waiting[0]):
            taken.append(linked.waiting.pop(0))
        if not linked.waiting:
            self._waiting.discard(linked)
        return taken

    def _held_back(self, header: Header, body: memoryview, buffers: list[memoryview], frames: list[Any],
                   sender: bytes | None) -> bool:
        """Hold a linked proc's message until the gathered replies it sent before it came (True: held)."""
        linked = self._linked_now(header["src"])
        after = header["after"]
        if linked is None or type(after) is not int or after <= linked.gathered_upto:
            return False
        linked.waiting.append((time.monotonic(), header, body, buffers, frames, sender))
        self._waiting.add(linked)
        return True

    def _take_gathered(self, header: Header) -> list[tuple[Header, memoryview, list[memoryview], list[Any], bytes | None]]:
        """Check a host agent's gathered replies (each item ``[src, gk, ...]``: a proc linked to
        that agent, or to any agent when it serves as a relay, its current incarnation, a number
        not seen); mark the others dropped (``gk``
        None: the item stays, as its reply's bytes stay in the body, so the items after it still
        find theirs); cut the list at an item that is not a list (its size unknown, the bytes after
        it cannot be placed); note the numbers; return the messages held for them, now due, in
        their order."""
        agent = route_id(header["src"]).encode()
        relaying = agent in self._serving_relays
        released: list[tuple[Header, memoryview, list[memoryview], list[Any], bytes | None]] = []
        items = header["gathered"]
        if not isinstance(items, list):
            self.dropped["gathered"] += 1
            items = header["gathered"] = []
        for position, item in enumerate(items):
            if not isinstance(item, list) or len(item) < 2:  # malformed (a buggy agent): it and those after it go
                self.dropped["gathered"] += len(items) - position
                del items[position:]
                break
            linked = self._linked_now(str(item[0]))
            if linked is None or (linked.agent != agent and not relaying) or type(item[1]) is not int:
                self.dropped["gathered"] += 1
                item[1] = None
                continue
            if not linked.took_gathered(item[1]):  # a number it had: a member's resend of what its relay passed on
                self.gathered_again += 1
                item[1] = None
                continue
            if linked.agent != agent:
                self.replies_via_relays += 1
            if linked.waiting:
                due = self._due(linked, lambda held, upto=linked.gathered_upto: held[1]["after"] <= upto)  # type: ignore[misc]
                released.extend(held[1:] for held in due)
        return released

    def _release_overdue(self) -> None:
        """Deliver messages held longer than :data:`GATHER_WAIT_MAX_S` for gathered replies that did not come."""
        if not self._waiting:
            return
        cutoff = time.monotonic() - GATHER_WAIT_MAX_S
        for linked in list(self._waiting):
            for _, header, body, buffers, frames, sender in self._due(linked, lambda held: held[0] < cutoff):
                log.warning("a message of %s waited %.0f s for replies gathered by its host agent that did not come; "
                            "delivered now", header["src"], GATHER_WAIT_MAX_S)
                self.dropped["gathered late"] += 1
                self._accept_now(header, body, buffers, frames, sender)

    def _accept_now(self, header: Header, body: memoryview, buffers: list[memoryview], frames: list[Any],
                    sender: bytes | None = None) -> None:
        if not self._guard.accept(header):
            self.dropped["replayed"] += 1
            log.warning("dropped a replayed or out-of-order message from %r", header.get("src"))
            return
        if sender is not None:
            self._peers.add(sender)
        self.received[header["kind"]] += 1
        if "shm" in header and (not self.router or header["dst"] == self.identity):  # not when forwarding
            try:
                buffers = self._import_large(header, buffers)
            except (OSError, ValueError, TypeError) as exc:
                self.dropped["bad"] += 1
                log.warning("dropped a message whose shared-memory buffer is unusable: %s", exc)
                return
        try:  # (as _guarded, inline: a frame fewer on every message)
            self._on_message(header, body, buffers, frames)
        except Exception:
            log.exception("handler %r failed; the IO loop goes on", self._on_message)

    def _in_order(self, order: tuple[int, int], header: Header, body: memoryview, buffers: list[memoryview],
                  frames: list[Any]) -> None:
        """Deliver the messages the controller's socket numbered for this proc in their order,
        whichever path each came by (straight, or a cast through the host agent); drop one
        already delivered, or another incarnation's (sent before this one's hello was heard)."""
        incarnation, number = order
        if incarnation != self._incarnation or number < self._next_pseq:
            self.dropped["replayed" if incarnation == self._incarnation else "other incarnation"] += 1
            return
        if number > self._next_pseq:  # an earlier one is on its way by the other path
            if len(self._held) >= _MAX_HELD:
                self.dropped["held"] += 1
                log.warning("dropped a message from %r: %d already wait for an earlier one", header.get("src"), _MAX_HELD)
                return
            self._held[number] = (header, body, buffers, frames)
            return
        self._next_pseq += 1
        self._accept(header, body, buffers, frames)
        while self._next_pseq in self._held:
            held = self._held.pop(self._next_pseq)
            self._next_pseq += 1
            self._accept(*held)

    def _recv_frames(self) -> list[Any]:
        """One message's frames (socket lock held): the envelope (and a ROUTER's identity) as
        bytes, the buffers after it as zero-copy frames. Raises zmq.Again if none is waiting."""
        sock = self._sock
        frame = sock.recv(_NOBLOCK, copy=False)  # (a frame says whether more follow: no getsockopt(RCVMORE))
        frames: list[Any] = [frame.bytes]
        # a ROUTER's sender frame, then a destination frame (none on a message to the hub itself); a
        # host agent's routing frame (@); the envelope after them: small, copied
        if self.router:
            if not frame.more:
                return frames
            frame = sock.recv(copy=False)
            frames.append(frame.bytes)
            more = 1 if _is_route(frames[1]) else 0
        else:
            more = 1 if frames[0][:1] == b"@" else 0
        for _ in range(more):
            if not frame.more:
                return frames
            frame = sock.recv(copy=False)
            frames.append(frame.bytes)
        while frame.more:
            frame = sock.recv(copy=False)
            frames.append(frame)
        return frames

    def _next_timer_ms(self) -> int:
        if self._next_due == math.inf:
            return 200
        return max(0, int((self._next_due - time.monotonic()) * 1000) + 1)

    def _run_timers(self) -> None:
        """Run the due timers (the loop calls it once the soonest, ``_next_due``, is due)."""
        now = time.monotonic()
        ran_once = False
        for timer in tuple(self._timers):  # a timer may add one (call_later)
            if now >= timer[0]:
                _, interval, fn, phase = timer
                if interval is None:  # call_later's: once
                    timer[0], ran_once = math.inf, True
                else:
                    wait = interval if phase is None else (phase - time.time()) % interval
                    if wait < interval / 2:  # a phased timer that ran late (or early): its next slot
                        wait += interval
                    timer[0] = now + wait
                self._guarded(fn)
        if ran_once:
            self._timers = [timer for timer in self._timers if timer[0] != math.inf]
        self._next_due = min((timer[0] for timer in self._timers), default=math.inf)

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, join_timeout_s: float = 2.0) -> None:
        """Stop the IO loop (after flushing queued sends) and close the socket."""
        if self._is_closed:
            return
        self._is_closed = True
        self._closed.set()
        self._wake()
        self._lease_freed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
        with self._lock:
            self._sock.close(linger=500)
            for link in self._links:
                link.close(linger=0)
            if self._local_peers is not None:
                self._local_peers.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
