"""Rich output of ``%%mesh`` cells, inside each proc: the IPython display API and matplotlib.

A worker has no IPython shell, so IPython's own ``display()`` would print ``<IPython.core.display.HTML
object>``. Here every way a notebook user shows rich output becomes a ``display`` marker line on
fd 1, carrying the object's mime bundle (JSON, base64), so it keeps its place among the printed
lines of its rank (see :mod:`.worker`):

- the ``display`` builtin of the rank's namespace, ``IPython.display.display`` and
  ``IPython.display.publish_display_data`` (patched when IPython is imported, so a cell's
  ``from IPython.display import display`` gets the rank's version; IPython is never imported
  here just for that);
- matplotlib: the proc's backend is :mod:`.mpl_worker` (Agg drawing, PNG out), so
  ``plt.show()`` displays each open figure, and figures left open when a cell ends are shown
  then, as the inline backend does; a figure as the last expression is ``Out[rank]``;
- pandas objects, ``HTML``, ``Markdown``, images: their ``_repr_*_`` methods (:func:`mime_bundle`).

``tqdm.auto`` finds no notebook here and draws a text bar on stderr; the controller shows it in
place (see :mod:`monarch_nb.runtime.output`).
"""

from __future__ import annotations

import base64
import ctypes
import importlib.abc
import importlib.machinery
import json
import os
import sys
from typing import Any

__all__ = ["MARKER", "marker_line", "mime_bundle", "display", "install", "current_cell", "write_all", "flush_all"]

#: Marker lines start and end with ASCII record separators, which printed text hardly contains.
MARKER = "\x1emnb:"
#: the matplotlib backend of procs that run cells
MPL_BACKEND = "module://monarch_nb.jupyter.mpl_worker"

_state = {"cell": ""}


def current_cell() -> str:
    """The id of the cell running on this proc now ("" between cells)."""
    return _state["cell"]


def set_current_cell(cell_id: str) -> None:
    _state["cell"] = cell_id


def marker_line(cell_id: str, kind: str, payload: str = "") -> bytes:
    """The bytes of one marker line (with its newline)."""
    tail = f":{payload}" if payload else ""
    return f"{MARKER}{cell_id}:{kind}{tail}\x1e\n".encode()


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def flush_all() -> None:
    """Flush Python's and C stdio's buffers, so marker lines follow everything printed before."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass


def mime_bundle(value: Any) -> dict:
    """Display data of ``value``: ``text/plain`` always, rich forms where the object offers them."""
    data: dict[str, Any] = {}
    method = getattr(value, "_repr_mimebundle_", None)
    if callable(method) and not isinstance(value, type):
        try:
            got = method()
            if isinstance(got, tuple):
                got = got[0]
            if isinstance(got, dict):
                data.update(got)
        except Exception:
            pass
    for mime, name in (
        ("text/html", "_repr_html_"),
        ("text/markdown", "_repr_markdown_"),
        ("image/svg+xml", "_repr_svg_"),
        ("image/png", "_repr_png_"),
        ("image/jpeg", "_repr_jpeg_"),
        ("text/latex", "_repr_latex_"),
        ("application/json", "_repr_json_"),
    ):
        method = getattr(value, name, None)
        if mime in data or not callable(method) or isinstance(value, type):
            continue
        try:
            got = method()
        except Exception:
            continue
        if got is None:
            continue
        if isinstance(got, tuple):
            got = got[0]
        if isinstance(got, bytes):
            got = base64.b64encode(got).decode()
        data[mime] = got
    if "image/png" not in data and _is_figure(value):
        import io

        buf = io.BytesIO()
        value.savefig(buf, format="png", bbox_inches="tight")
        data["image/png"] = base64.b64encode(buf.getvalue()).decode()
    if "text/plain" not in data:
        try:
            import pprint

            data["text/plain"] = pprint.pformat(value)
        except Exception as exc:  # a broken __repr__ must not lose the cell's result
            data["text/plain"] = f"<{type(value).__name__} object; repr failed: {exc!r}>"
    return data


def _is_figure(value: Any) -> bool:
    return type(value).__name__ == "Figure" and hasattr(value, "savefig") and not isinstance(value, type)


def publish(data: dict, metadata: dict | None = None) -> None:
    """Send one mime bundle to the cell running now, in order with the printed lines."""
    flush_all()
    bundle = {k: v for k, v in data.items() if isinstance(k, str)}  # metadata is not carried
    payload = base64.b64encode(json.dumps(bundle, default=str).encode()).decode()
    write_all(1, marker_line(current_cell() or "-", "display", payload))


def display(*objs: Any, raw: bool = False, metadata: dict | None = None, include: Any = None,
            exclude: Any = None, **_ignored: Any) -> None:
    """``display(obj, ...)`` on a rank: rich output of each object, in the cell that runs now.

    Accepts IPython's arguments: ``raw=True`` takes mime bundles (dicts); ``include`` /
    ``exclude`` filter mime types; ``display_id``, ``transient`` and ``clear`` are ignored.
    """
    for obj in objs:
        data = dict(obj) if raw and isinstance(obj, dict) else mime_bundle(obj)
        if include:
            data = {k: v for k, v in data.items() if k in include or k == "text/plain"}
        if exclude:
            data = {k: v for k, v in data.items() if k not in exclude or k == "text/plain"}
        publish(data, metadata)


def publish_display_data(data: dict, metadata: dict | None = None, *args: Any, **kwargs: Any) -> None:
    """IPython's ``publish_display_data`` on a rank."""
    publish(dict(data), metadata)


# -- IPython's display API, patched when IPython is imported ----------------------------------------
_PATCHED = ("IPython.core.display_functions", "IPython.core.display", "IPython.display")


def _patch(module: Any) -> None:
    if hasattr(module, "display"):
        module.display = display
    if hasattr(module, "publish_display_data"):
        module.publish_display_data = publish_display_data


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _DisplayFinder(importlib.abc.MetaPathFinder):
    """Finds IPython's display modules like the normal path finder, then patches them."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Make IPython's display API and matplotlib show rich output in ``%%mesh`` cells (idempotent)."""
    if not any(isinstance(f, _DisplayFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DisplayFinder())
    for name in _PATCHED:
        if name in sys.modules:
            _patch(sys.modules[name])
    backend = os.environ.get("MPLBACKEND", "")
    if not backend or "inline" in backend or backend.lower() == "agg":
        os.environ["MPLBACKEND"] = MPL_BACKEND
    if "matplotlib.pyplot" in sys.modules and os.environ["MPLBACKEND"] == MPL_BACKEND:
        sys.modules["matplotlib.pyplot"].switch_backend(MPL_BACKEND)


def show_open_figures(shown_value: Any = None) -> None:
    """At the end of a cell: display the figures still open (closing them), as the inline backend
    does; ``shown_value`` (the cell's value, shown as ``Out[rank]``) is closed without a copy."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or "mpl_worker" not in str(pyplot.get_backend()):
        return
    if _is_figure(shown_value):
        pyplot.close(shown_value)
    from . import mpl_worker

    mpl_worker.show()
