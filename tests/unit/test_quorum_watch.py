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
    assert not watch.lose(1) and watch.lost is None, "rank 1 is not a member"
    assert watch.lose(3) and watch.lose(2) and watch.lost == 3, "the first one said dead"
    watch.begin([0, 1, 2, 3])  # a new quorum (rank 3's new incarnation in it)
    assert watch.lost is None


class _Work:
    """A collective that completes after ``after_s`` seconds, with ``error`` or without."""

    def __init__(self, after_s: float, error: str | None = None) -> None:
        self.done_at, self.error = time.monotonic() + after_s, error

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: datetime.timedelta) -> bool:
        left = self.done_at - time.monotonic()
        if left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
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
    assert watch.abandoned == 0
