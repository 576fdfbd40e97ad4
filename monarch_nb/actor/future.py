"""Future: the result of an adverb (``call``, ``call_one``, ``choose``, ...), usable sync or async.

``fut.get(timeout)`` blocks; ``await fut`` suspends an async endpoint or a notebook cell
(IPython runs top-level ``await``); ``result``/``exception``/``done`` read its state. A ``get``
that times out leaves the call pending, as ``concurrent.futures.Future.result(timeout)`` does: a
later ``get``, ``await`` or ``done()`` sees the reply when it comes. Dropping a call is a separate,
explicit act: :meth:`Future.cancel`.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any, Callable, Generator, Generic, TypeVar

if TYPE_CHECKING:
    import asyncio

__all__ = ["Future"]

R = TypeVar("R")

#: Why an actor's wait for its own endpoint's reply is refused (it would never end).
_WAITS_ON_ITSELF = ("this actor is waiting for a reply from itself, which never comes: it handles one message at a "
                    "time, and the one waiting is still running. Run the code directly (a plain method both "
                    "endpoints call), send without waiting (broadcast), or await it from a @concurrent_endpoint")

#: What a call still pending means for the next ones (a wait for it timed out or was interrupted).
_BEHIND = ("; an endpoint still running keeps its actor's later calls waiting behind it "
           "(cancel() drops the reply; it does not stop the endpoint)")


class Future(Generic[R]):
    """The eventual value of a remote call (or of a stop, a port receive, an accumulation).

    Args:
        inner: the ``concurrent.futures.Future`` the runtime completes.
        on_cancel: called with no arguments by :meth:`cancel`, so the runtime forgets the call
            (a late reply is then dropped).
        lead: ``lead(done, timeout)``: the runtime's way to receive on the waiting thread itself
            (so the reply wakes the thread that waits for it); True once ``done()`` holds.
    """

    __slots__ = ("_inner", "_on_cancel", "_lead", "_waits_on_itself")

    def __init__(self, inner: concurrent.futures.Future[R] | None = None, on_cancel: Callable[[], None] | None = None,
                 lead: Callable[..., bool] | None = None) -> None:
        self._inner: concurrent.futures.Future[R] = inner if inner is not None else concurrent.futures.Future()
        self._on_cancel = on_cancel
        self._lead = lead
        #: set on a call an actor made to itself: ``waits_on_itself(awaiting)`` (see ``Instance``)
        self._waits_on_itself: Callable[[bool], bool] | None = None

    @classmethod
    def completed(cls, value: Any = None, error: BaseException | None = None) -> "Future[Any]":
        fut: Future[Any] = cls()
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
            TimeoutError: no reply within ``timeout``; the call stays pending (get it again later,
                or :meth:`cancel` it); its actor may still run it, and run its later calls after it.
            KeyboardInterrupt: the wait was interrupted; the call stays pending (a note says so).
            RuntimeError: an actor waits for a call to itself (it would wait forever).
            ActorError: the endpoint raised on a rank.
            SupervisionError: the actor, or a proc holding it, failed.
            concurrent.futures.CancelledError: the call was cancelled.
        """
        inner = self._inner
        wait = timeout
        self._refuse_a_wait_on_itself(awaiting=False)
        try:
            if self._lead is not None and not inner.done():
                self._lead(inner.done, timeout)
                if not inner.done() and timeout is not None:
                    wait = 0  # the wait already took its time
            return inner.result(wait)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no reply within {timeout} s; the call is still pending (get it again, or cancel() it){_BEHIND}") from None
        except KeyboardInterrupt as exc:
            if not inner.done() and hasattr(exc, "add_note"):  # (Python 3.11+) the user's next call would wait unexplained
                exc.add_note(f"monarch_nb: the interrupted call is still pending{_BEHIND}")
            raise

    def result(self, timeout: float | None = None) -> R:
        """Same as :meth:`get`."""
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the call ended with, or None; waits like :meth:`get`.

        Raises:
            TimeoutError: not finished within ``timeout`` (the call stays pending).
        """
        try:
            return self._inner.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no reply within {timeout} s; the call is still pending") from None

    def done(self) -> bool:
        """True once the value or the error is there (or the call was cancelled)."""
        return self._inner.done()

    def cancel(self) -> bool:
        """Drop the call: stop waiting for it, drop its reply if one comes, make ``get`` raise
        ``concurrent.futures.CancelledError``. Returns False if it had already finished.

        The remote endpoint is not interrupted (it may already be running)."""
        if self._inner.done():
            return False
        if self._on_cancel is not None:
            self._on_cancel()
        return self._inner.cancel()

    def cancelled(self) -> bool:
        return self._inner.cancelled()

    def add_done_callback(self, fn: Callable[["Future[R]"], None]) -> None:
        """Call ``fn(self)`` when done (at once if done; else on the thread that completes it)."""
        self._inner.add_done_callback(lambda _inner: fn(self))

    def as_asyncio(self) -> "asyncio.Future[R]":
        """An asyncio Future on the running loop that completes with this one."""
        import asyncio  # only where awaited: `import monarch_nb` stays light

        return asyncio.wrap_future(self._inner)

    def __await__(self) -> Generator[Any, None, R]:
        self._refuse_a_wait_on_itself(awaiting=True)
        return self.as_asyncio().__await__()

    def _refuse_a_wait_on_itself(self, awaiting: bool) -> None:
        """Raise RuntimeError if this is an actor's call to itself that the wait about to begin
        (``awaiting``: an ``await``) would keep from ever running."""
        if self._waits_on_itself is not None and not self._inner.done() and self._waits_on_itself(awaiting):
            raise RuntimeError(_WAITS_ON_ITSELF)

    def __repr__(self) -> str:
        state = "cancelled" if self._inner.cancelled() else "done" if self.done() else "pending"
        return f"<Future {state}>"
