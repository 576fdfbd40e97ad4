"""Widgets that leave their last state behind: a static HTML/text fallback in the output bundle.

A widget's view needs its model, which lives in the kernel: after ``%mesh stop``, a kernel
restart, or in a saved notebook opened later, JupyterLab shows "Error displaying widget: model
not found". :class:`StaticFallback` (mixed into the tree and the dashboard) prevents that:

- every display bundle of the widget also carries ``text/html`` and ``text/plain`` renderings
  of its state (read by frontends without widgets: nbconvert, GitHub, a notebook viewer);
- the widget displays itself with a display id, and :meth:`StaticFallback.freeze` replaces each
  of its displays (``update_display_data``) by the static rendering of its *last* state, so the
  saved notebook holds what happened. ``%mesh stop``, unloading the extension and the kernel's
  exit freeze every live widget (:func:`freeze_all`).
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

__all__ = ["StaticFallback", "freeze_all"]

log = logging.getLogger(__name__)

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()


class StaticFallback:
    """Mixin for an ``anywidget.AnyWidget``: define :meth:`static_html` and :meth:`static_text`."""

    def static_html(self) -> str:  # pragma: no cover - each widget defines it
        raise NotImplementedError

    def static_text(self) -> str:  # pragma: no cover - each widget defines it
        raise NotImplementedError

    def _static_bundle(self) -> dict:
        return {"text/html": self.static_html(), "text/plain": self.static_text()}

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        got = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        if isinstance(got, tuple):  # anywidget: (data, metadata)
            data, metadata = got
            return ({**data, **self._static_bundle()}, metadata) if data else got
        return {**got, **self._static_bundle()} if got else got

    def _ipython_display_(self) -> None:
        """Display with a display id, so :meth:`freeze` can replace this output later."""
        from IPython.display import display

        got = self._repr_mimebundle_()
        data, metadata = got if isinstance(got, tuple) else (got, {})
        if not data:
            return
        handle = display(data, raw=True, metadata=metadata, display_id=True)
        if handle is not None:
            self.__dict__.setdefault("_mnb_handles", []).append(handle)
            _live.add(self)

    def freeze(self) -> None:
        """Replace every display of this widget by the static rendering of its current state."""
        handles = self.__dict__.get("_mnb_handles", [])
        if not handles:
            return
        bundle = self._static_bundle()
        for handle in handles:
            try:
                handle.update(bundle, raw=True)
            except Exception:
                log.debug("could not update a display of %r", self, exc_info=True)
        handles.clear()
        _live.discard(self)


def freeze_all(close: bool = True) -> int:
    """Freeze every live widget of the extension (and close it with ``close``); return how many."""
    widgets = list(_live)
    for widget in widgets:
        try:
            widget.freeze()
            if close:
                widget.close()
        except Exception:
            log.debug("freezing %r failed", widget, exc_info=True)
    return len(widgets)


atexit.register(freeze_all, False)
