"""A host agent gathers its procs' replies to a cast: one message to the controller per host, not per proc.

A call to all reaches a host's procs in one message through their agent (:mod:`.proc_link`);
without this, each of them answers the controller on its own, so a call to all of 8,192 actors
brings the controller 8,192 messages to receive, verify and dispatch, a cost that grows with
procs. A linked proc sends its reply to such a call (one marked ``gth`` that came in a ``fan``
of N procs of its host) to its agent instead, signed as ever (:meth:`Channel.send
<monarch_nb.transport.channel.Channel.send>` with ``gather=N``). The agent (:class:`ReplyGather`)
verifies each (HMAC, replay guard, a proc speaks only for itself), keeps the call's replies until
all N came or :data:`GATHER_LINGER_S` passed since the first one, and sends them to the
controller as one ``replies`` message (:class:`~.protocol.RepliesHeader`, signed by the agent),
whose channel checks that each is from a proc linked to that agent (or to any, from a relay:
below) before the messenger takes them (:meth:`Messenger.on_replies <monarch_nb.runtime.messenger.Messenger.on_replies>`).

A reply that cannot come this way (a tensor, a body of more than 64 KiB) goes straight, and the
proc tells its agent, which then waits for one fewer. A proc that exits has its held replies sent
before the agent reports the exit (:meth:`ReplyGather.flush_all`), so a call sees the answer a
proc gave before it died. The order against the proc's other messages is kept by the
controller's channel (``gk`` / ``after``: see :mod:`monarch_nb.transport.channel`).

Up the relay tree (:mod:`.relay`): a member agent sends its ``replies`` to its relay instead
(:meth:`RelayMember.send_replies <monarch_nb.runtime.relay.RelayMember.send_replies>`), each
saying how many of the call's procs it accounts for (``n``: those gathered and those that went
straight), and keeps what it sent (:class:`KeptReplies`) for the seconds in which its relay may
be lost holding them: leaving its relay, it sends them straight (the controller drops a reply it
had by its number, ``gk``). The relay merges its hosts' ``replies`` to a call it split
(:class:`ReplyMerge`: it knows how many of its hosts' procs gather) into one message, once all
came or :data:`RELAY_LINGER_S` after the first; the controller takes the items of any proc
linked to one of its agents from a serving relay (``Channel.relay_serves``).

Monarch's host-level actors gather replies for a cast the same way (accumulators that reduce a
mesh's replies on the way up); here the agent only bundles them, the values stay per rank.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

from ..transport.wire import BadMessage, Header, ReplayGuard, Signer, decode, route_id
from .protocol import CONTROLLER, Kind, RepliesHeader

__all__ = ["ReplyGather", "ReplyMerge", "KeptReplies", "GATHER_LINGER_S", "RELAY_LINGER_S"]

log = logging.getLogger(__name__)

#: Seconds an agent holds a call's replies for the rest of its host's (the first one's age), when
#: they do not all come (one rank slower than the others, one that hangs): then it sends what it
#: has and the rest as they come. A call's future completes only with its last reply, so holding
#: the others costs it nothing; what is held up is the proc's later messages to the controller
#: (its channel holds them behind the gathered replies), for at most this long.
GATHER_LINGER_S = 0.01
#: Seconds a relay holds a call's replies from its hosts for the rest (the first's age): longer
#: than at an agent, as a member's replies come after its own gather's linger and a hop more than
#: the relay's own procs' (they get their part of the cast first). What is held up is as above.
RELAY_LINGER_S = 0.05
#: Seconds after which a call's entry whose replies were all sent but not all seen is forgotten
#: (a rank that died before it answered, a reply lost with its proc).
_FORGET_S = 60.0


class _Gather:
    """One call's replies at this agent: how many of this host's procs it went to, how many
    answered (gathered or straight), and the replies held (items and bodies, in arrival order).
    At a relay (:class:`ReplyMerge`): how many procs of its hosts gather them, how many the
    ``replies`` merged so far account for (``seen``), those held."""

    __slots__ = ("expected", "seen", "flushed_seen", "items", "bodies", "touched_at")

    def __init__(self, expected: int, now: float) -> None:
        self.expected, self.seen, self.flushed_seen = expected, 0, 0
        self.items: list[list[Any]] = []
        self.bodies: list[bytes] = []
        self.touched_at = now


class ReplyGather:
    """The agent's gathering of its procs' replies (on the agent's loop thread only).

    Args:
        signer: the cluster's signer (verifies the procs' replies).
        send: ``send(header, body)``: sign and send one message to the controller (the agent's channel).
        call_later: ``call_later(delay_s, fn)`` on the agent's loop (``Channel.call_later``).
        linger_s: see :data:`GATHER_LINGER_S`.

    Attributes:
        sent: ``replies`` messages sent; ``gathered``: replies in them; ``dropped``: replies that
            failed verification (bad signature, replayed, a proc speaking for another).
    """

    def __init__(self, signer: Signer, send: Callable[[RepliesHeader, bytes], None], call_later: Callable[[float, Callable[[], None]], None],
                 linger_s: float = GATHER_LINGER_S) -> None:
        self._signer, self._send, self._call_later, self.linger_s = signer, send, call_later, linger_s
        self._guard = ReplayGuard()
        self._gathers: dict[str, _Gather] = {}
        self.sent = self.gathered = self.dropped = 0

    def on_link_message(self, route: bytes, frames: list[Any]) -> None:
        """A proc's message on the link whose first frame is ``%N``: its signed reply to a call
        that reached N procs of this host (frames after it), or ``~CID``: its reply to call CID
        went straight."""
        try:
            expected = int(bytes(frames[0])[1:])
        except ValueError:
            self.dropped += 1
            return
        now = time.monotonic()
        if len(frames) == 2 and bytes(frames[1])[:1] == b"~":
            cid = bytes(frames[1])[1:].decode(errors="replace")
            gather = self._entry(cid, expected, now)
        else:
            reply = self._verified(route, frames[1:])
            if reply is None:
                self.dropped += 1
                return
            header, body = reply
            cid = header["cid"]  # type: ignore[typeddict-item]  # a reply's (checked in _verified)
            gather = self._entry(cid, expected, now)
            if not gather.items:  # the first held: its linger starts
                self._call_later(self.linger_s, lambda: self._linger(cid, gather))
            gather.items.append([header["src"], header["gk"], header["idx"], header["ok"], len(body)])  # type: ignore[typeddict-item]
            gather.bodies.append(body)
        gather.seen += 1
        gather.touched_at = now
        if gather.seen >= gather.expected:
            self._flush(cid, gather)
            del self._gathers[cid]

    def flush_all(self, send: Callable[[RepliesHeader, bytes], None] | None = None) -> None:
        """Send every reply held now (a proc exited: what it answered goes out before its exit
        report), through ``send`` if given (the exit's own path), else as any other."""
        for cid, gather in list(self._gathers.items()):
            self._flush(cid, gather, send)
        self._gathers.clear()

    def _entry(self, cid: str, expected: int, now: float) -> _Gather:
        gather = self._gathers.get(cid)
        if gather is None:
            gather = self._gathers[cid] = _Gather(max(1, expected), now)
        return gather

    def _verified(self, route: bytes, frames: list[Any]) -> tuple[Header, bytes] | None:
        """The header and body of a proc's gathered reply, or None (logged) if it is not one: a
        bad signature, a replay, another proc's, not a reply to the controller, not numbered."""
        try:
            header, body, buffers = decode(self._signer, frames)
        except BadMessage as exc:
            log.warning("dropped a reply on the procs' link: %s", exc)
            return None
        src = header["src"]
        if (header["kind"] != Kind.REPLY or route_id(src) != route.decode(errors="replace") or header["dst"] != CONTROLLER
                or buffers or type(header.get("gk")) is not int or not isinstance(header.get("cid"), str)
                or not self._guard.accept(header)):
            log.warning("dropped a message from %s on the procs' link: not its own numbered reply to the controller", src)
            return None
        return header, bytes(body)

    def _linger(self, cid: str, gather: _Gather) -> None:
        """The call's first held reply is ``linger_s`` old: send what is held; forget stale entries."""
        if self._gathers.get(cid) is gather and gather.items:
            self._flush(cid, gather)
        cutoff = time.monotonic() - _FORGET_S
        for key in [key for key, g in self._gathers.items() if not g.items and g.touched_at < cutoff]:
            del self._gathers[key]

    def _flush(self, cid: str, gather: _Gather, send: Callable[[RepliesHeader, bytes], None] | None = None) -> None:
        if not gather.items and not (gather.seen >= gather.expected > gather.flushed_seen):
            return  # nothing held, or nothing a relay would wait for: a count alone goes only when all answered
        header: RepliesHeader = {"kind": Kind.REPLIES, "cid": cid, "gathered": gather.items, "n": gather.seen - gather.flushed_seen}
        (send or self._send)(header, b"".join(gather.bodies))
        self.sent += 1
        self.gathered += len(gather.items)
        gather.items, gather.bodies, gather.flushed_seen = [], [], gather.seen


class ReplyMerge:
    """A relay's merging of its hosts' gathered replies to a call it split (on the agent's loop
    thread only): one ``replies`` message to the controller for the relay's hosts, not one a host.

    Args:
        send: ``send(header, body)``: sign and send one ``replies`` message to the controller.
        call_later: ``call_later(delay_s, fn)`` on the agent's loop.
        linger_s: seconds after a call's first held ``replies`` at which what is held goes (the
            rest as it comes): :data:`RELAY_LINGER_S`.

    Attributes:
        sent: ``replies`` messages sent to the controller; ``merged``: ``replies`` taken in.
    """

    def __init__(self, send: Callable[[RepliesHeader, bytes], None], call_later: Callable[[float, Callable[[], None]], None],
                 linger_s: float = RELAY_LINGER_S) -> None:
        self._send, self._call_later, self.linger_s = send, call_later, linger_s
        self._merges: dict[str, _Gather] = {}
        self.sent = self.merged = 0

    def expect(self, cid: str, procs: int) -> None:
        """Call ``cid`` was split here to ``procs`` procs that gather their replies (on hosts with
        two or more of them: a single proc's reply goes straight)."""
        if procs > 0:
            now = time.monotonic()
            merges = self._merges
            merges[cid] = _Gather(procs, now)
            while True:  # forget the calls whose replies did not all come (oldest first: the dict's order)
                first = next(iter(merges))
                if merges[first].touched_at >= now - _FORGET_S:
                    break
                del merges[first]

    def flush_all(self) -> None:
        """Send every reply held now (a proc of this host exited: what it answered goes before
        its exit report); the calls' counts stay for what is still to come."""
        for cid, merge in list(self._merges.items()):
            self._flush(cid, merge)

    def add(self, header: RepliesHeader, body: bytes) -> None:
        """A host's ``replies`` (this relay's own or a member's, verified): held with the others
        of its call, or sent on at once for a call not split here (its cast came straight)."""
        cid, items = header["cid"], header["gathered"]
        self.merged += 1
        merge = self._merges.get(cid)
        if merge is None:
            if items:  # a count alone is for a merge
                self._send({"kind": Kind.REPLIES, "cid": cid, "gathered": items}, body)
                self.sent += 1
            return
        if not merge.items and items:
            self._call_later(self.linger_s, lambda: self._linger(cid, merge))
        merge.items.extend(items)
        merge.bodies.append(body)
        n = header.get("n")
        merge.seen += n if type(n) is int and n > 0 else len(items)
        merge.touched_at = time.monotonic()
        if merge.seen >= merge.expected:
            self._flush(cid, merge)
            del self._merges[cid]

    def _linger(self, cid: str, merge: _Gather) -> None:
        if self._merges.get(cid) is merge:
            self._flush(cid, merge)

    def _flush(self, cid: str, merge: _Gather) -> None:
        if merge.items:
            self._send({"kind": Kind.REPLIES, "cid": cid, "gathered": merge.items}, b"".join(merge.bodies))
            self.sent += 1
            merge.items, merge.bodies = [], []


class KeptReplies:
    """What a member agent sent up through its relay in the last ``keep_s`` seconds (the agent's
    loop thread only), to send straight if it leaves the relay: a relay lost (killed, stopped,
    cut off) may hold them, and a call's future waits for every reply.

    Args:
        keep_s: seconds a ``replies`` message is kept; longer than a member takes to find its
            relay silent (:data:`~monarch_nb.runtime.relay.RELAY_SILENT_INTERVALS` intervals).
        max_bytes: at most this many bytes of bodies are kept (the oldest go first, logged).
    """

    def __init__(self, keep_s: float, max_bytes: int = 64 << 20) -> None:
        self.keep_s, self.max_bytes = keep_s, max_bytes
        self._kept: collections.deque[tuple[float, RepliesHeader, bytes]] = collections.deque()
        self._bytes = 0

    def add(self, header: RepliesHeader, body: bytes) -> None:
        now = time.monotonic()
        self._kept.append((now, {"kind": Kind.REPLIES, "cid": header["cid"], "gathered": header["gathered"]}, body))
        self._bytes += len(body)
        over = 0
        while self._kept and (self._kept[0][0] < now - self.keep_s or self._bytes > self.max_bytes):
            sent_at, _, old = self._kept.popleft()
            self._bytes -= len(old)
            over += sent_at >= now - self.keep_s
        if over:
            log.warning("dropped %d replies kept for a resend: over %d bytes kept", over, self.max_bytes)

    def naming(self, route: str) -> list[tuple[RepliesHeader, bytes]]:
        """Those kept that hold a reply of proc ``route`` (kept still)."""
        return [(header, body) for _, header, body in self._kept
                if any(isinstance(item, list) and item and route_id(str(item[0])) == route for item in header["gathered"])]

    def take(self) -> list[tuple[RepliesHeader, bytes]]:
        """Those kept, oldest first (and forget them)."""
        cutoff = time.monotonic() - self.keep_s
        kept = [(header, body) for sent_at, header, body in self._kept if sent_at >= cutoff]
        self._kept.clear()
        self._bytes = 0
        return kept
