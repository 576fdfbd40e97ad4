"""Waiting for one reply from each rank, with a deadline and the run's stop. Runs in the controller.

The coordinator and the membership ask every rank of a quorum the same thing (set up, join a
quorum, heal, checksum) and must act on the first failure at once, not when the last reply
comes: :func:`wait_all` calls ``on_error`` as each failure arrives.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

__all__ = ["Stopped", "wait_all"]


class Stopped(Exception):
    """The run was asked to stop while it waited (internal)."""


def wait_all(futures: dict, timeout_s: float, stop: threading.Event,
             on_error: Callable[[int, BaseException], None] | None = None) -> tuple[dict, dict]:
    """Wait for every future of ``{rank: future}``; ``on_error(rank, exc)`` runs as soon as one
    fails. Returns ``(values, errors)`` by rank; a future still pending at the deadline is a
    TimeoutError.

    Raises:
        Stopped: ``stop`` was set meanwhile.
    """
    done: "queue.SimpleQueue[int]" = queue.SimpleQueue()
    for rank, fut in futures.items():
        fut.add_done_callback(lambda _f, r=rank: done.put(r))
    values: dict = {}
    errors: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(values) + len(errors) < len(futures):
        if stop.is_set():
            raise Stopped()
        left = deadline - time.monotonic()
        if left <= 0:
            for rank in futures:
                if rank not in values and rank not in errors:
                    errors[rank] = TimeoutError(f"rank {rank}: no reply within {timeout_s:.1f} s")
                    if on_error:
                        on_error(rank, errors[rank])
            break
        try:
            rank = done.get(timeout=min(left, 0.1))
        except queue.Empty:
            continue
        exc = futures[rank].exception(0)
        if exc is None:
            values[rank] = futures[rank].get(0)
        else:
            errors[rank] = exc
            if on_error:
                on_error(rank, exc)
    return values, errors
