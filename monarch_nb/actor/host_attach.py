"""Hosts beyond this machine: ``attach_to_workers`` (Monarch's name) gives a HostMesh of them.

Each host runs a worker loop (``monarch-nb worker --address tcp://HOST:PORT --curve-keys DIR``,
or ``run_worker_loop_forever``); the controller attaches them, and the HostMesh has the dim
``hosts``::

    hosts = attach_to_workers(["tcp://10.0.0.2:26600", "tcp://10.0.0.3:26600"], ca="/etc/monarch/keys")
    procs = hosts.spawn_procs(per_host={"gpus": 8})          # dims {"hosts": 2, "gpus": 8}
    procs.slice(hosts=1).spawn("t", Trainer)                 # everything this_host() does works
"""

from __future__ import annotations

from typing import Sequence

from . import backend
from .mesh import HostMesh
from .shape import Extent, Shape

__all__ = ["attach_to_workers"]


def attach_to_workers(workers: Sequence[str], ca: str | None = None) -> HostMesh:
    """Attach the worker loops at ``workers``; a HostMesh with dim ``hosts``, one per worker.

    Args:
        workers: addresses, ``tcp://HOST:PORT`` each (as the workers were started with).
        ca: what the cluster trusts: the path of the key folder (HMAC + CurveZMQ, traffic
            encrypted) or key file (HMAC) made by ``monarch-nb keys``; may be None only for
            workers on this machine's loopback.

    Raises:
        ValueError: a malformed address, or a remote worker without ``ca``.
        AttachError (a ConnectionError): a worker did not answer, refused, or holds other keys.
        FileNotFoundError, PermissionError: ``ca`` is missing or readable by others.
    """
    if isinstance(workers, str):
        raise TypeError("workers is a list of addresses, e.g. ['tcp://10.0.0.2:26600']")
    names = backend.current().attach_hosts(list(workers), ca)
    return HostMesh(names, Shape(Extent({"hosts": len(names)})))  # dim "hosts" even for one
