"""A quorum's collective gives up when the runtime says a member died (monarch_nb.train.quorum_watch);
with a real gloo group in tests/test_train_faults.py."""

from __future__ import annotations

import datetime
import time

import pytest

from monarch_nb.train.quorum_watch import CHECK_EVERY_S, QuorumWatch


def test_a_failure_outside_the_quorum_or_before_it_changes_nothing():
    watch = QuorumWatch()
    watch.begin([0, 2, 3])
    assert not watch.lose(1) and watch.lost() is None, "rank 1 is not a member"
    assert watch.lose(3) and watch.lose(2) and watch.lost() == 3, "the first one said dead"
    assert watch.lost(among=[0, 2]) == 2 and watch.lost(among=[0]) is None, "a group's own members"
    watch.begin([0, 1, 2, 3])  # a new quorum (rank 3's new incarnation in it)
    assert watch.lost() is None


class _Work:
    """A collective that completes after ``after_s`` seconds, with ``error`` or without;
    ``late_s``: a timed-out wait returns to its caller this much later (the GIL taken back on a
    loaded machine), by when the collective may have completed."""

    def __init__(self, after_s: float, error: str | None = None, late_s: float = 0.0) -> None:
        self.done_at, self.error, self.late_s = time.monotonic() + after_s, error, late_s

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        left = self.done_at - time.monotonic()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds() + self.late_s)
            raise RuntimeError("Operation timed out!")
        time.sleep(max(0.0, left))
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_a_collective_that_ends_is_waited_for_across_checks_and_its_own_error_raised():
    watch = QuorumWatch()
    watch.begin([0, 1])
    watch.wait(_Work(4 * CHECK_EVERY_S), group=None)  # several slices: no member lost, it completes
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        watch.wait(_Work(2 * CHECK_EVERY_S, "Connection closed by peer"), group=None)
    # it completes while a timed-out wait is on its way back: its outcome, not the timeout
    watch.wait(_Work(CHECK_EVERY_S * 1.5, late_s=CHECK_EVERY_S), group=None)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        watch.wait(_Work(CHECK_EVERY_S * 1.5, "Connection closed by peer", late_s=CHECK_EVERY_S), group=None)
    assert watch.abandoned == 0
