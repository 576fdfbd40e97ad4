"""The link between a host agent and its procs: the controller's casts to them, passed on unread.

A message of the controller's for several procs of one host (a ``broadcast``, a call to all, a
spawn) is sent once, to the host agent (:meth:`~monarch_nb.transport.channel.Channel.send_many`),
which passes it on to each: one message over the network and one send of the controller's per
host, not per proc. A message for one proc (``call_one``) still goes straight to it, as do the
procs' own messages (replies to a ``call_one``, calls to actors on other hosts; those for procs
of their own host go straight to them, below); the controller numbers
what it sends a linked proc, so the two paths keep their order (see
:mod:`monarch_nb.transport.channel`). The way back: a proc's reply to a cast goes to the agent,
which sends the controller its host's replies as one message (:mod:`.reply_gather`).

The agent binds a ROUTER on a Unix socket in its run folder (:class:`AgentLink`); a proc connects
a DEALER under its routing identity (:func:`link_to_agent`), says ``link`` (with its pid) and waits
for the agent's ``linked`` before its hello to the controller, so the agent can route to it from
the controller's first cast. The agent reads only the routing frame (``@ROUTE,ROUTE...``) the
controller put before the signed message; each proc verifies the signature as for a message on
its own socket (:meth:`~monarch_nb.transport.channel.Channel.add_link`). A message for a proc that
is gone (exited, not linked yet) is dropped and counted, as the controller's ROUTER drops one for
a peer it does not know.

The link also tells the procs who is on the host, for their messages to each other, which go
straight (:mod:`monarch_nb.transport.local_peers`): a proc that links gets ``+ROUTE`` for each
proc linked before it, those get ``+ROUTE`` for it, and all get ``-ROUTE`` when the agent reaps a
proc (:meth:`AgentLink.leave`; not when a new incarnation has taken its route since).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import zmq

from ..transport.local_peers import JOINED, LEFT

__all__ = ["AgentLink", "link_to_agent", "LINK_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: Seconds a proc waits for its agent's ``linked`` before it goes without the link.
LINK_TIMEOUT_S = 5.0
_LINK, _LINKED, _INBOX = b"link", b"linked", b"inbox"
_SOCKET_NAME = "procs.sock"
_MAX_UNIX_PATH = 100  # sun_path is 108 bytes on Linux
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class AgentLink:
    """The agent's end: a ROUTER its procs connect to (IO thread only).

    Args:
        folder: the agent's run folder (private to the user); the socket file goes in it.
        enabled: False (``config.messages_via_agents`` off): no socket; the procs get the
            controller's messages straight from it.

    Attributes:
        address: ``ipc://<folder>/procs.sock``, or "" when the path is too long for a Unix
            socket (the procs then get the controller's messages straight from it).
        forwarded: messages passed on to a proc.
        unreachable: messages for a proc not connected (gone, or not linked yet): dropped.
        announced: ``+ROUTE`` and ``-ROUTE`` sent to procs.
    """

    def __init__(self, folder: str, *, enabled: bool = True) -> None:
        self.forwarded = 0
        self.unreachable = 0
        self.announced = 0
        self._linked: dict[bytes, tuple[bytes, bool]] = {}  # route -> (the pid its link named, has an inbox), in link order
        #: ``on_gathered(route, frames)`` for a proc's reply sent for gathering (first frame ``%N``;
        #: :class:`~monarch_nb.runtime.reply_gather.ReplyGather`); None: such messages are dropped
        self.on_gathered: Callable[[bytes, list[Any]], None] | None = None
        path = os.path.join(folder, _SOCKET_NAME)
        self.address = f"ipc://{path}" if enabled and len(path) <= _MAX_UNIX_PATH else ""
        self.sock: zmq.Socket[Any] | None = None
        if not self.address:
            if enabled:
                log.warning("the procs' link to this agent is off: %s is too long for a Unix socket", path)
            return
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock = sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a proc not connected raises: counted, not queued
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted proc takes over its name
        sock.bind(self.address)

    @property
    def fd(self) -> int:
        """The socket's ZMQ_FD, for the agent's loop (``Channel.add_reader``); -1 when off."""
        return int(self.sock.getsockopt(zmq.FD)) if self.sock is not None else -1

    def on_readable(self, fd: int = -1) -> None:
        """Answer every ``link`` waiting (a proc that just connected); hand on the procs' replies
        sent for gathering."""
        sock = self.sock
        while sock is not None and int(sock.getsockopt(_EVENTS)) & _POLLIN:
            try:
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            if 2 <= len(frames) <= 4 and frames[1] == _LINK:
                try:
                    sock.send_multipart([frames[0], _LINKED])
                except zmq.ZMQError:  # gone again already
                    self.unreachable += 1
                    continue
                self._join(frames[0], frames[2] if len(frames) > 2 else b"", frames[3:] == [_INBOX])
            elif len(frames) >= 3 and frames[1][:1] == b"%" and self.on_gathered is not None:
                try:
                    self.on_gathered(frames[0], frames[1:])
                except Exception:
                    log.exception("a reply for gathering from %r failed; the agent goes on", frames[0])

    def _join(self, route: bytes, pid: bytes, inbox: bool) -> None:
        """``route`` linked: tell it which procs of the host have an inbox, and them of it if it
        has one (a proc without one still sends to theirs)."""
        for other, (_, has_inbox) in list(self._linked.items()):
            if other == route:
                continue
            if has_inbox:
                self._announce(route, JOINED + other)
            if inbox:
                self._announce(other, JOINED + route)
        self._linked.pop(route, None)  # a new incarnation of it: last in link order
        self._linked[route] = (pid, inbox)

    def leave(self, route: str, pid: int) -> None:
        """Proc ``route`` of ``pid`` (the agent's child) exited, reaped: its peers send through
        the controller from now on. Not if a newer incarnation of it has linked since: the pid
        its link named is another one, alive (a proc started through a wrapper that did not exec
        names its own pid, dead with it)."""
        key = route.encode()
        linked = self._linked.get(key)
        if linked is None:
            return
        named = linked[0]
        if named != str(pid).encode() and named.isdigit() and _alive(int(named)):
            return
        del self._linked[key]
        if linked[1]:
            for other in list(self._linked):
                self._announce(other, LEFT + key)

    def _announce(self, to: bytes, news: bytes) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            sock.send_multipart([to, news])
            self.announced += 1
        except zmq.ZMQError:  # gone (reaped soon: its own leave follows)
            self.unreachable += 1

    def forward(self, routes: list[bytes], frames: list[Any]) -> None:
        """Pass ``frames`` (a signed message, unread) to each proc of ``routes``."""
        sock = self.sock
        if sock is None:
            self.unreachable += len(routes)
            return
        for route in routes:
            try:
                sock.send_multipart([route, *frames])  # small frames copied (cheaper); received buffers go by reference
                self.forwarded += 1
            except zmq.ZMQError:  # EHOSTUNREACH: not connected (exited; a new incarnation links before its hello)
                self.unreachable += 1
        if int(sock.getsockopt(_EVENTS)) & _POLLIN:  # a send may take the socket's edge: read what came meanwhile
            self.on_readable()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None


def link_to_agent(address: str, route: str, timeout_s: float = LINK_TIMEOUT_S, pid: int | None = None,
                  inbox: bool = False) -> "zmq.Socket[Any] | None":
    """Connect proc ``route`` (process ``pid``, this one's by default) to its agent's link at
    ``address``; the connected DEALER once the agent answered, or None (logged) if it did not
    within ``timeout_s`` seconds: the proc then says so in its hello and the controller's
    messages come straight to it. Announcements of the host's procs follow on it (see above);
    ``inbox``: this proc's inbox is bound (its peers are told of it)."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # replies for gathering go this way too: never block, never drop
    sock.setsockopt(zmq.IDENTITY, route.encode())
    sock.connect(address)
    sock.send_multipart([_LINK, str(os.getpid() if pid is None else pid).encode(), *([_INBOX] if inbox else [])])
    if sock.poll(int(timeout_s * 1000)) and sock.recv() == _LINKED:
        return sock
    log.warning("proc %s: no answer from its host agent's link %s in %.0f s; the controller's messages "
                "come straight to it", route, address, timeout_s)
    sock.close(linger=0)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True
