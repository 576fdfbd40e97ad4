"""A quorum's collectives give up as soon as the runtime says a member died. Runs in procs.

Gloo finds a dead peer through its connections: a survivor that talks to it gets a reset, fails
its collective, leaves the group, and its closed connections fail the others' in turn. Not
always: with two ranks killed a few hundred ms apart on a loaded machine (4 ranks on 2 cores),
about one run in twenty left a survivor in ``work.wait()`` for gloo's whole timeout
(``collective_timeout_s``, 10 s), every one of its connections already closed (``ss``): its
worker sat in ``UnboundBuffer::waitSend`` of the ring all-reduce (``eu-stack``), a send to a pair
closed under it that nothing signals (torch 2.13's gloo). The run then stood still for those
10 s, or failed the window's deadline (``collective_timeout_s`` + 5 s) with a ``TimeoutError``.

The runtime knows of the death at once (the dead proc's agent reaps it, the controller tells the
mesh's procs: ``proc_failed``). So :class:`QuorumWatch` keeps this rank's quorum members and the
first of them said dead (:meth:`QuorumWatch.lose`, on the proc's IO thread), and
:meth:`QuorumWatch.wait` waits for a collective in slices of :data:`CHECK_EVERY_S` (a timed
``Work.wait``: no thread hand-off, no cost when the collective completes in time), raising
:class:`~.trainer_quorum.CollectiveError` once a member is dead and the collective has not
completed. The abandoned work and its group are kept until gloo ends the work (its timeout) and
released then on a thread of their own: destroying a group whose worker is still in a collective
would block the training thread for that timeout.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Iterable

from .trainer_quorum import CollectiveError

__all__ = ["QuorumWatch", "CHECK_EVERY_S"]

log = logging.getLogger(__name__)

#: Seconds between looks at whether a member died, while a collective waits.
CHECK_EVERY_S = 0.05


class QuorumWatch:
    """This rank's quorum members and those the runtime said died since it formed (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: frozenset[int] = frozenset()
        self._lost: tuple[int, ...] = ()  # in the order heard
        self.abandoned = 0  #: collectives given up on because a member died

    def begin(self, members: Iterable[int]) -> None:
        """A new quorum of ``members`` (proc ranks): none of them is known dead (a failure heard
        before it is an earlier incarnation's: the controller formed this quorum after it)."""
        with self._lock:
            self._members, self._lost = frozenset(members), ()

    def lose(self, rank: int) -> bool:
        """The runtime says proc rank ``rank`` failed (any thread); True if it is a member."""
        with self._lock:
            if rank not in self._members:
                return False
            if rank not in self._lost:
                self._lost = (*self._lost, rank)
            return True

    def lost(self, among: Iterable[int] | None = None) -> int | None:
        """The first member said dead (of ``among`` only, when given), or None."""
        lost = self._lost
        if among is None:
            return lost[0] if lost else None
        wanted = set(among)
        return next((r for r in lost if r in wanted), None)

    def wait(self, work: Any, group: Any, members: Iterable[int] | None = None) -> None:
        """Wait for ``work`` (an async gloo collective of ``group``) to complete; ``members``:
        the proc ranks of ``group`` (default: the whole quorum).

        Raises:
            CollectiveError: a member of ``group`` died and ``work`` had not completed (it is
                abandoned: kept with ``group`` until it ends, then released off this thread).
            RuntimeError: the collective's own error.
        """
        slice_ = timedelta(seconds=CHECK_EVERY_S)
        among = None if members is None else tuple(members)
        while True:
            try:
                work.wait(slice_)
                return
            except RuntimeError:
                if work.is_completed():  # it ended meanwhile: its own outcome (raises its error, if any)
                    work.wait()
                    return
            lost = self.lost(among)
            if lost is not None:
                self.abandoned += 1
                _release_when_done(work, group)
                raise CollectiveError(f"rank {lost} of the quorum died (the runtime said so) before the collective completed")


def _release_when_done(work: Any, group: Any) -> None:
    """Keep ``work`` and ``group`` until the work ends (gloo's timeout), then drop them on this
    daemon thread: the group's destructor joins its workers, which must not happen on the
    training thread while one is still in the abandoned collective."""
    def release(held: list[Any]) -> None:
        try:
            held[0].wait()
        except Exception:  # noqa: BLE001 - it ends in an error (its peers are gone): expected
            pass
        held.clear()

    threading.Thread(target=release, args=([work, group],), name="monarch_nb-abandoned-collective", daemon=True).start()
