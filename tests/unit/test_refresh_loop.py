"""The widgets' refresh loop: a slow refresh (a tree of 8,192 ranks) leaves the kernel most of its time."""

from __future__ import annotations

import threading
import time

from monarch_nb.jupyter.refresh import MAX_BUSY_FRACTION, refresh_loop

from ..conftest import wait_until


class _SlowWidget:
    _min_interval_s = 0.0  # as often as it likes: only the busy fraction holds it back

    def __init__(self, dirty: threading.Event) -> None:
        self.dirty = dirty
        self.spans: list[tuple[float, float]] = []

    def refresh(self) -> None:
        start = time.monotonic()
        time.sleep(0.04)
        self.spans.append((start, time.monotonic()))
        self.dirty.set()  # always more to show: a busy cluster


def test_a_slow_refresh_is_followed_by_a_pause_in_proportion():
    dirty, stop = threading.Event(), threading.Event()
    widget = _SlowWidget(dirty)
    dirty.set()
    thread = threading.Thread(target=refresh_loop, args=(lambda: widget, dirty, stop, "refresh"), daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(widget.spans) >= 4, 10, message="four refreshes")
    finally:
        stop.set()
        dirty.set()
        thread.join(5)
    assert not thread.is_alive()
    for (start, end), (next_start, _) in zip(widget.spans, widget.spans[1:]):
        took = end - start
        assert next_start - end >= 0.99 * took / MAX_BUSY_FRACTION, "the refresh thread held at most its fraction of the time"
