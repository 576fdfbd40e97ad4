"""A ZeroMQ socket owned by one IO thread, with a thread-safe send queue and timers.

ZeroMQ sockets must not be used by two threads at once, so every use of the socket happens under
one lock. Any thread may call :meth:`Channel.send`: the message is numbered, signed and sent
under that lock, so sequence numbers follow send order (the receiver's replay guard relies on it)
and no thread hand-off is paid on the send path (on a small VM each wake-up of another thread
costs about as much as a whole ZeroMQ hop). The IO thread waits on the socket's ZMQ_FD *without*
the lock and takes it only to receive. ZMQ_FD is edge-triggered and a send may consume its edge,
so after every send the sender checks ZMQ_EVENTS and wakes the IO thread if input is pending.
Received messages are verified (:func:`monarch_nb.transport.wire.decode`) and the replay guard
is applied before ``on_message`` runs on the IO thread; bad ones are dropped and counted.

The controller's channel is a ROUTER bound to an address; procs and host agents connect a
DEALER whose routing identity is their name. Identities may carry an incarnation after ``#``
(``"pm0.3#4211"``); routing uses the part before it, so a restarted proc takes over its name
(ROUTER_HANDOVER) while the replay guard keeps each incarnation's sequence apart.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import select
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import zmq

from . import shm
from .keys import Trust
from .wire import BadMessage, ReplayGuard, Signer, decode, encode, route_id

__all__ = ["Channel", "route_id"]

log = logging.getLogger(__name__)

_authenticators: dict[int, tuple[Any, set]] = {}  # id(context) -> (ZAP handler, its domains)
_auth_lock = threading.Lock()


def _zap_domain(ctx: zmq.Context, trust: Trust) -> str:
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
def curve_server(sock: zmq.Socket, trust: Trust | None) -> Iterator[None]:
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

MessageHandler = Callable[[dict, Any, list, list], None]


class Channel:
    """One socket, one IO thread. ``router=True`` binds a ROUTER; otherwise a DEALER connects.

    Args:
        identity: this endpoint's name, used as ``src`` in headers (and, for DEALERs, as the
            routing identity up to ``#``).
        signer: the cluster's :class:`~monarch_nb.transport.wire.Signer`.
        on_message: ``f(header, body, buffers, frames)`` run on the IO thread for each verified
            message. It must not block.
        router: bind a ROUTER (the controller) instead of connecting a DEALER.
    """

    def __init__(
        self, identity: str, signer: Signer, on_message: MessageHandler, *, router: bool = False, shm_run_id: str | None = None
    ):
        self.identity = identity
        # same-host peers: large buffers go through /dev/shm (see monarch_nb.transport.shm)
        self.shm_run_id = shm_run_id if shm_run_id and shm.available() else None
        self.router = router
        self._signer = signer
        self._on_message = on_message
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER if router else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
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
        self._readers_lock = threading.Lock()
        self._timers: list[list] = []  # [next_due, interval_s, fn]
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.dropped = collections.Counter()  # reason -> count
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
            bound = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
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
        """Call ``callback(fd)`` on the IO thread when ``fd`` is readable. Any thread."""
        with self._readers_lock:
            self._readers[fd] = callback
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._wake()

    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd``. Any thread; on the IO thread it takes effect at once."""
        with self._readers_lock:
            self._readers.pop(fd, None)

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the IO thread every ``interval_s`` seconds. Call before :meth:`start`."""
        self._timers.append([time.monotonic() + interval_s, interval_s, fn])

    def start(self, name: str = "monarch_nb-io") -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def run_forever(self) -> None:
        """Run the IO loop on the calling thread until :meth:`close` (host agents, procs)."""
        self._run()

    # -- sending --------------------------------------------------------------------------------
    def send(self, dst: str, header: dict, body: bytes = b"", buffers: Sequence[Any] = ()) -> None:
        """Number, sign and send one message to ``dst``. Thread-safe; never blocks on the network."""
        header["src"] = self.identity
        header["dst"] = dst
        if self.shm_run_id and buffers:
            buffers = self._export_large(header, buffers)
        with self._lock:
            self._seq += 1
            header["seq"] = self._seq
            frames = encode(self._signer, header, body, buffers)
            if self.router:
                frames.insert(0, route_id(dst).encode())
            self._send_locked(frames)

    def _export_large(self, header: dict, buffers: Sequence[Any]) -> list:
        out = list(buffers)
        exported = []
        for index, buf in enumerate(buffers):
            nbytes = memoryview(buf).nbytes
            if nbytes >= shm.SHM_MIN_BYTES:
                exported.append([index, shm.export_buffer(buf, self.shm_run_id), nbytes])
                out[index] = b""
        if exported:
            header["shm"] = exported
        return out

    def _import_large(self, header: dict, buffers: list) -> list:
        for index, name, nbytes in header["shm"]:
            buffers[index] = shm.import_buffer(name, nbytes)
        return buffers

    def forward(self, dst: str, frames: list) -> None:
        """Send already-signed ``frames`` (a message from another peer) to ``dst`` (ROUTER only)."""
        with self._lock:
            self._send_locked([route_id(dst).encode(), *frames])

    def _send_locked(self, frames: list) -> None:
        if self.muted_until and time.monotonic() < self.muted_until:
            self.dropped["partitioned"] += 1
            return
        if self._closed.is_set():
            return
        try:
            self._sock.send_multipart(frames, copy=False)
            pending_input = self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
        except zmq.ZMQError as exc:
            log.warning("send failed: %s", exc)
            return
        if pending_input and threading.current_thread() is not self._thread:
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed, or the pipe is full (the IO thread is awake anyway)
            pass

    # -- IO loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        self._thread = threading.current_thread()
        poller = select.poll()
        sock_fd = self._sock.getsockopt(zmq.FD)
        poller.register(sock_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        registered: set[int] = set()
        while not self._closed.is_set():
            with self._readers_lock:
                wanted = set(self._readers)
            if wanted != registered:
                for fd in wanted - registered:
                    poller.register(fd, select.POLLIN)
                    registered.add(fd)
                for fd in registered - wanted:
                    poller.unregister(fd)
                    registered.discard(fd)
            timeout_ms = 0 if self._input_pending() else self._next_timer_ms()
            try:
                events = poller.poll(timeout_ms)
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                elif fd != sock_fd:
                    with self._readers_lock:
                        callback = self._readers.get(fd)
                    if callback is not None:
                        self._guarded(callback, fd)
            self._receive_all()
            self._run_timers()

    def _input_pending(self) -> bool:
        with self._lock:
            if self._closed.is_set():
                return False
            return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _guarded(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("handler %r failed; the IO loop goes on", fn)

    def _receive_all(self) -> None:
        for _ in range(64):  # bounded so timers and readers are not starved
            with self._lock:
                if self._closed.is_set():
                    return
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:
                    log.warning("recv failed: %s", exc)
                    return
            if self.router:
                frames = frames[1:]
            if self.muted_until and time.monotonic() < self.muted_until:
                self.dropped["partitioned"] += 1
                continue
            try:
                header, body, buffers = decode(self._signer, frames)
            except BadMessage as exc:
                self.dropped["bad"] += 1
                log.warning("dropped a bad message: %s", exc)
                continue
            if not self._guard.accept(header):
                self.dropped["replayed"] += 1
                log.warning("dropped a replayed or out-of-order message from %r", header.get("src"))
                continue
            if "shm" in header and (not self.router or header["dst"] == self.identity):  # not when forwarding
                try:
                    buffers = self._import_large(header, buffers)
                except (OSError, ValueError, TypeError) as exc:
                    self.dropped["bad"] += 1
                    log.warning("dropped a message whose shared-memory buffer is unusable: %s", exc)
                    continue
            self._guarded(self._on_message, header, body, buffers, frames)

    def _next_timer_ms(self) -> int:
        if not self._timers:
            return 200
        due = min(t[0] for t in self._timers)
        return max(0, int((due - time.monotonic()) * 1000) + 1)

    def _run_timers(self) -> None:
        now = time.monotonic()
        for timer in self._timers:
            if now >= timer[0]:
                timer[0] = now + timer[1]
                self._guarded(timer[2])

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, join_timeout_s: float = 2.0) -> None:
        """Stop the IO loop (after flushing queued sends) and close the socket."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
        with self._lock:
            self._sock.close(linger=500)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
