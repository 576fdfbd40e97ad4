"""Future: the result of an adverb (``call``, ``call_one``, ``choose``), usable sync or async.

``fut.get(timeout)`` blocks; ``await fut`` suspends an async endpoint or a notebook cell
(IPython runs top-level ``await``); ``result``/``exception``/``done`` read its state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Generic, TypeVar

__all__ = ["Future"]

R = TypeVar("R")


class Future(Generic[R]):
    """The eventual value of a remote call.

    Args:
        inner: the ``concurrent.futures.Future`` the runtime completes.
        on_timeout: called with no arguments when :meth:`get` times out, so the runtime can stop
            tracking the call (a late reply is then dropped).
    """

    __slots__ = ("_inner", "_on_timeout")

    def __init__(self, inner: concurrent.futures.Future | None = None, on_timeout: Callable[[], None] | None = None):
        self._inner = inner if inner is not None else concurrent.futures.Future()
        self._on_timeout = on_timeout

    @classmethod
    def completed(cls, value: Any = None, error: BaseException | None = None) -> "Future":
        fut = cls()
        if error is not None:
            fut._inner.set_exception(error)
        else:
            fut._inner.set_result(value)
        return fut

    def get(self, timeout: float | None = None) -> R:
        """Block until the value is there and return it.

        Args:
            timeout: seconds to wait; None waits forever.

        Raises:
            TimeoutError: no reply within ``timeout``; the mesh stays usable.
            ActorError: the endpoint raised on a rank.
            SupervisionError: a rank holding the actor failed.
        """
        try:
            return self._inner.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._on_timeout is not None:
                self._on_timeout()
            raise TimeoutError(f"no reply within {timeout} s; the mesh is still usable") from None

    def result(self, timeout: float | None = None) -> R:
        """Same as :meth:`get`."""
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the call ended with, or None; waits like :meth:`get`."""
        try:
            return self._inner.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no reply within {timeout} s") from None

    def done(self) -> bool:
        return self._inner.done()

    def add_done_callback(self, fn: Callable[["Future"], None]) -> None:
        self._inner.add_done_callback(lambda _inner: fn(self))

    def __await__(self):
        return asyncio.wrap_future(self._inner).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Future {state}>"
