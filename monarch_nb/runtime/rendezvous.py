"""The controller-side torch.distributed rendezvous store, listening on 127.0.0.1 only.

TCPStore binds every interface by itself; handed a socket already bound to loopback
(``master_listen_fd``) it serves only this host. It lives in the controller, never in a worker,
so no rank's death takes it down.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

__all__ = ["loopback_store"]


def loopback_store(world_size: int | None = None, timeout_s: float = 300.0) -> Any:
    """A master ``torch.distributed.TCPStore`` on 127.0.0.1 and a free port (``store.port``)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    store = dist.TCPStore(
        "127.0.0.1", sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store owns (and closes) the listening socket now
    return store
