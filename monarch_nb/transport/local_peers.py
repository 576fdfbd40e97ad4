"""Messages between procs of one host, sent straight from one to the other (issue 25, step 4).

Without this, a proc's message to another proc goes through the controller's hub, which passes it
on unread (numbered for the receiver, see :mod:`monarch_nb.transport.channel`): every
actor-to-actor message costs the controller a receive and a send, and crosses the network twice
when the controller runs on another machine. Two procs linked to the same host agent skip it:
each proc binds a ROUTER, its *inbox*, on a Unix socket in the agent's run folder named after its
route (``in-<route>.sock``), and a peer connects a DEALER to it the first time it sends there.

**Who is on the host.** The host agent tells its procs over their link
(:mod:`monarch_nb.runtime.proc_link`): a proc that links gets ``+ROUTE`` for each proc already
linked, the others get ``+ROUTE`` for it, and all get ``-ROUTE`` when the agent reaps that proc
(it is the procs' parent: it knows of an exit first). An announcement names the routes of the
agent's own procs only, and is read from the agent's private socket.

**Order.** Messages from one sender to one receiver keep their order, as Monarch promises: a
proc sends all of its messages for one route the same way, chosen at the first one (the way is
*pinned*) and kept until that route's proc exits (``-ROUTE``). A route not yet known to be on
the host at its first message keeps going through the hub until then, so an announcement that
comes late never lets a straight message overtake one still on its way through the controller
(the receiver's replay guard would drop the older one); such a route stays on the hub for its
proc's life (:attr:`LocalPeers.through_hub` counts what that costs). A proc remembers the ways
of at most 65,536 routes; past that it forgets those through the hub of routes not on its host
(chosen the same way again, unless such a route joins the host while a message to it is still
in the controller: not expected at that count). There is no order between different
senders (as in Monarch): the controller's own messages and a peer's may pass each other. The one
case code relies on (the controller spawns an actor and passes its mesh on at once; a peer's
call may reach the new actor's proc before the spawn) is kept by the receiver: a call that came
straight from a peer for an actor it has not spawned waits for the spawn
(:class:`~monarch_nb.runtime.actor_host.ActorHost`, up to ``HOLD_FOR_SPAWN_S``).

**Failures.** A message for a proc that died is lost, as through the hub; the caller's future
fails from the supervision event. The socket to a route is closed, with what it still held, when
the agent says the route's proc exited.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import zmq

__all__ = ["LocalPeers", "inbox_address", "JOINED", "LEFT", "ANNOUNCEMENTS"]

log = logging.getLogger(__name__)

JOINED, LEFT = b"+", b"-"  # an announcement's first byte, then the route
ANNOUNCEMENTS = (JOINED, LEFT)
_MAX_UNIX_PATH = 100  # sun_path is 108 bytes on Linux
_MAX_PINNED = 65_536  # routes a proc remembers the way of (those through the hub forgotten first)
_CLOSE_LINGER_MS = 500  # what a closing proc sent its peers last (a reply) still goes out


def inbox_address(folder: str, route: str) -> str:
    """``ipc://<folder>/in-<route>.sock``, or "" when the path is too long for a Unix socket
    (that proc's peers then reach it through the controller)."""
    path = os.path.join(folder, f"in-{route}.sock")
    return f"ipc://{path}" if len(path) <= _MAX_UNIX_PATH else ""


class LocalPeers:
    """A proc's side: its inbox, the routes on its host, and the way pinned for each route.

    Every method but :meth:`open` runs under the proc's channel lock (the sockets are ZeroMQ's:
    one thread at a time).

    Args:
        folder: the host agent's run folder (the inboxes' directory).
        route: this proc's route (``"pm0.3"``).

    Attributes:
        inbox: the bound ROUTER, or None before :meth:`open` (or when its path is too long).
        sent: messages sent straight to a peer.
        through_hub: messages for a route on this host that went through the hub (its way pinned
            before the route was announced).
    """

    def __init__(self, folder: str, route: str) -> None:
        self._folder = folder
        self.inbox: zmq.Socket[Any] | None = None
        self._here: set[bytes] = set()  # routes announced on this host, not left since
        self._ways: dict[bytes, zmq.Socket[Any] | None] = {}  # pinned: a DEALER to its inbox, or None (the hub)
        self._address = inbox_address(folder, route)
        self.sent = 0
        self.through_hub = 0

    def open(self) -> bool:
        """Bind the inbox (before the proc links to its agent, so a peer told of it can send
        at once); False when its path is too long or the bind fails (logged)."""
        if not self._address:
            log.warning("peers on this host reach this proc through the controller: %s is too long for a Unix socket",
                        self._folder)
            return False
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        try:
            sock.bind(self._address)
        except zmq.ZMQError as exc:
            log.warning("peers on this host reach this proc through the controller: binding %s failed: %s",
                        self._address, exc)
            sock.close(linger=0)
            return False
        self.inbox = sock
        return True

    def learn(self, frame: bytes) -> bool:
        """Take an announcement from the agent (``+ROUTE`` or ``-ROUTE``); False if ``frame``
        is not one."""
        mark, route = frame[:1], frame[1:]
        if mark == JOINED and route:
            self._here.add(route)
        elif mark == LEFT and route:
            self._here.discard(route)
            sock = self._ways.pop(route, None)
            if sock is not None:
                sock.close(linger=0)
        else:
            return False
        return True

    def way(self, route: bytes) -> "zmq.Socket[Any] | None":
        """The socket to send ``route``'s messages on (a DEALER to its inbox), or None: through
        the hub. Pinned at the first call until the route leaves."""
        if route in self._ways:
            sock = self._ways[route]
            if sock is None and route in self._here:
                self.through_hub += 1
            return sock
        if len(self._ways) >= _MAX_PINNED:
            self._forget_hub_ways()
        sock = None
        if route in self._here:
            address = inbox_address(self._folder, route.decode())
            if address:
                sock = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(address)
        self._ways[route] = sock
        return sock

    def _forget_hub_ways(self) -> None:
        """Forget the ways through the hub of routes not on this host (they would be chosen the
        same way again); those of routes on it stay pinned (forgetting them could reorder)."""
        for route in [r for r, s in self._ways.items() if s is None and r not in self._here]:
            del self._ways[route]

    def close(self) -> None:
        for sock in self._ways.values():
            if sock is not None:
                sock.close()
        self._ways.clear()
        if self.inbox is not None:
            self.inbox.close(linger=0)
            self.inbox = None
