"""The controller-side torch.distributed rendezvous stores, listening on one address: 127.0.0.1,
or on a cluster the controller's address that every attached host reaches.

TCPStore binds every interface by itself; handed a socket already bound to one address
(``master_listen_fd``) it serves only there. Stores live in the controller, never in a
worker, so no rank's death takes one down.

- :func:`controller_store`: a store now (imports torch).
- :class:`LazyStore`: a listening socket now, the store on first use. Every proc mesh gets one,
  named in its procs' ``MASTER_ADDR`` / ``MASTER_PORT``, so torchrun-style code
  (``dist.init_process_group("gloo")`` with the ``env://`` rendezvous) runs unchanged without the
  controller importing torch for meshes that never use it: a connection waits in the socket's
  backlog until the controller's IO loop sees it and starts the TCPStore server on that socket.
"""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta
from typing import Any

__all__ = ["controller_store", "LazyStore"]

log = logging.getLogger(__name__)


def _listen(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def _store_on(sock: socket.socket, world_size: int | None, timeout_s: float) -> Any:
    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    store = dist.TCPStore(
        host, port, world_size, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store owns (and closes) the listening socket now
    return store


def controller_store(host: str = "127.0.0.1", world_size: int | None = None, timeout_s: float = 300.0) -> Any:
    """A master ``torch.distributed.TCPStore`` on ``host`` (an address of this machine: 127.0.0.1,
    or the one a proc mesh's hosts reach, :meth:`Controller.rendezvous_host`) and a free port
    (``store.port``)."""
    return _store_on(_listen(host), world_size, timeout_s)


class LazyStore:
    """A port on ``host`` (127.0.0.1, or the controller's address on a cluster's network) whose
    TCPStore server starts when the first client connects.

    Call :meth:`start` from the listening socket's first readable event (the controller's IO
    loop watches :attr:`fd`); the server is built on a thread of its own (importing torch can
    take seconds), and the waiting client is served once it is up.
    """

    def __init__(self, timeout_s: float = 1800.0, host: str = "127.0.0.1"):
        self._sock: socket.socket | None = _listen(host)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.fd: int = self._sock.fileno()
        self._timeout_s = timeout_s
        self._store: Any = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        """A client connected: the store may hold keys (a clean one is one nobody used)."""
        return self._sock is None

    def start(self) -> None:
        """Start the TCPStore server on the socket (once; returns at once)."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is None:
            return

        def serve() -> None:
            try:
                self._store = _store_on(sock, None, self._timeout_s)
            except Exception:
                log.exception("the rendezvous store on 127.0.0.1:%d could not start", self.port)
                sock.close()

        threading.Thread(target=serve, name=f"monarch_nb-store-{self.port}", daemon=True).start()

    def close(self) -> None:
        """Stop listening (the store, if started, is freed with this object)."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._store = None
