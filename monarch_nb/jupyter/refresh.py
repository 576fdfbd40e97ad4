"""The widgets' update loop: a background thread that redraws at most ``max_hz`` times a second.

Widgets mark themselves dirty (an event arrived, a metric, a click) from any thread; this loop
calls their refresh method, which pushes the new state with :func:`push_changes` (the traits
that changed, in one message). It holds only a
weak reference, so a widget that is closed or garbage-collected ends its thread.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

__all__ = ["refresh_loop", "push_changes", "MAX_BUSY_FRACTION"]

log = logging.getLogger(__name__)

#: A refresh that takes ``t`` seconds is followed by at least ``t / MAX_BUSY_FRACTION`` seconds
#: without one: a widget over 8,192 ranks (a refresh of ~0.2 s) holds the kernel's GIL at most a
#: fifth of the time, so cells and comm messages keep their turn.
MAX_BUSY_FRACTION = 0.2


def refresh_loop(
    ref: "weakref.ref[Any]",
    dirty: threading.Event,
    stop: threading.Event,
    refresh: str,
    *,
    periodic: bool = False,
    final: bool = False,
) -> None:
    """Call ``getattr(ref(), refresh)()`` whenever ``dirty`` is set (and each second if ``periodic``),
    never more often than the widget's ``_min_interval_s`` nor than :data:`MAX_BUSY_FRACTION`
    allows; once more after ``stop`` if ``final``."""
    last = 0.0
    spacing = 0.0  # seconds from one refresh's end to the next one's start, at least
    while not stop.is_set():
        dirty.wait(1.0)
        if stop.is_set():
            break
        if not (dirty.is_set() or periodic):
            continue
        widget = ref()
        if widget is None:
            return
        wait = max(widget._min_interval_s, spacing) - (time.monotonic() - last)
        if wait > 0 and stop.wait(wait):
            break  # closed while it waited: no refresh after close (a final one follows if asked)
        dirty.clear()
        started = time.monotonic()
        try:
            getattr(widget, refresh)()
        except Exception:
            log.exception("%s.%s failed", type(widget).__name__, refresh)
        last = time.monotonic()
        spacing = (last - started) / MAX_BUSY_FRACTION
        del widget
    if final:
        widget = ref()
        if widget is not None:
            try:
                getattr(widget, refresh)()
            except Exception:
                log.exception("%s.%s failed", type(widget).__name__, refresh)


def push_changes(widget: Any, **values: Any) -> None:
    """Set the traits of ``widget`` whose value differs, inside one ``hold_sync()`` (one message
    to the browser, none when nothing changed)."""
    with widget.hold_sync():
        for name, value in values.items():
            if value != getattr(widget, name):
                setattr(widget, name, value)
