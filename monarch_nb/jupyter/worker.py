"""Worker side of ``%%mesh``: an actor that runs notebook cells in a persistent per-rank namespace.

One :class:`CellExecutor` lives on every proc of a mesh started with ``%mesh start``. Its
``run_cell`` endpoint compiles a cell, runs it in the rank's namespace (``rank``,
``world_size``, ``coords`` and whatever earlier cells defined), and returns the value of the
cell's last expression as display data.

Output: the cell writes to the proc's real stdout / stderr (file descriptors 1 and 2, which the
host agent reads), so output of C code and subprocesses is kept too. Before and after the cell,
the executor writes a *marker line* on both descriptors (``\\x1emnb:<cell id>:begin\\x1e``,
``...:end\\x1e``). The controller (:mod:`monarch_nb.jupyter.cells`) attributes the lines between
the markers to the cell, and a blocking cell returns only once it has seen both end markers of
every rank: per-rank output is complete and in order (per stream) by construction, including
what was printed just before an exception. ``display(obj)`` writes a ``display`` marker carrying
the object's mime bundle on fd 1, so rich output keeps its place among the printed lines.

Interrupts: the proc's IO thread calls :meth:`CellExecutor.__interrupt__`, which raises
``KeyboardInterrupt`` in the thread that runs the cell (``PyThreadState_SetAsyncExc``) while
user code runs, and never outside it. Such an exception is seen between bytecodes, so
``time.sleep`` is made interruptible for cell threads (it sleeps in slices of at most 50 ms); a
C call that blocks (a collective waiting for a dead peer) ends first.
"""

from __future__ import annotations

import ast
import base64
import ctypes
import json
import linecache
import os
import sys
import threading
import time
import traceback
from typing import Any

from ..actor.endpoint import Actor, endpoint

__all__ = ["CellExecutor", "MARKER", "marker_line", "mime_bundle"]

#: Marker lines start and end with ASCII record separators, which printed text hardly contains.
MARKER = "\x1emnb:"
_SLEEP_SLICE_S = 0.05

_interruptible: set[int] = set()
_original_sleep = time.sleep


def _interruptible_sleep(seconds: float) -> None:
    """``time.sleep`` that a cell interrupt can stop: slices of 50 ms on cell threads."""
    if threading.get_ident() not in _interruptible or seconds <= _SLEEP_SLICE_S:
        return _original_sleep(seconds)
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        _original_sleep(min(left, _SLEEP_SLICE_S))


def marker_line(cell_id: str, kind: str, payload: str = "") -> bytes:
    """The bytes of one marker line (with its newline)."""
    tail = f":{payload}" if payload else ""
    return f"{MARKER}{cell_id}:{kind}{tail}\x1e\n".encode()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _flush_all() -> None:
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
    if "image/png" not in data and type(value).__name__ == "Figure" and hasattr(value, "savefig"):
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


class CellExecutor(Actor):
    """Runs ``%%mesh`` cells on one rank, in a namespace that persists between cells."""

    def __init__(self) -> None:
        from ..actor.context import current_rank

        point = current_rank()
        self.rank = point.rank
        self.world_size = point.extent.nelements if len(point.extent) else 1
        self.namespace: dict[str, Any] = {
            "__name__": "__main__",
            "__builtins__": __builtins__,
            "rank": self.rank,
            "world_size": self.world_size,
            "coords": dict(point),
            "local_rank": int(os.environ.get("LOCAL_RANK", self.rank)),
            "display": self._display,
        }
        self._lock = threading.Lock()
        self._user_thread: int | None = None
        self._interrupted = False
        self._cell_id = ""
        time.sleep = _interruptible_sleep  # only cell threads slice their sleeps; see the module doc

    # -- interrupts (called on the proc's IO thread) ---------------------------------------------
    def __interrupt__(self, thread_ident: int | None = None) -> bool:
        """Raise KeyboardInterrupt in the running cell, if user code runs now. True if it did."""
        with self._lock:
            if self._user_thread is None:
                return False
            self._interrupted = True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._user_thread), ctypes.py_object(KeyboardInterrupt)
            )
            return True

    # -- endpoints --------------------------------------------------------------------------------
    @endpoint
    def run_cell(self, cell_id: str, source: str, filename: str, options: dict | None = None) -> dict:
        """Run ``source`` in this rank's namespace; return ``{"ok", "value", "data", "error"}``.

        ``data`` is the mime bundle of the last expression's value (None when the cell ends in a
        statement or the value is None); ``value`` the value itself when it can be pickled;
        ``error`` the remote traceback (see :func:`monarch_nb.errors.capture_traceback`),
        ``"interrupted": True`` when the cell was interrupted.
        """
        options = options or {}
        self._cell_id = cell_id
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        _flush_all()
        for fd in (1, 2):
            _write_all(fd, marker_line(cell_id, "begin"))
        try:
            try:
                result = self._run_user(source, filename, options)
            except KeyboardInterrupt as exc:  # an interrupt that landed just after the user code
                result = self._error(exc, filename, interrupted=True)
        finally:
            _flush_all()
            for fd in (1, 2):
                _write_all(fd, marker_line(cell_id, "end"))
            self._cell_id = ""
        return result

    @endpoint
    def init_distributed(self, host: str, port: int, backend: str | None = None, timeout_s: float = 60.0) -> str:
        """Initialise ``torch.distributed`` on this rank from a TCPStore served by the controller.

        Puts ``dist`` (``torch.distributed``) in the namespace; returns the backend used.
        """
        import datetime

        import torch.distributed as dist

        from .. import device

        if not dist.is_initialized():
            backend = backend or device.backend()
            store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
        self.namespace["dist"] = dist
        return dist.get_backend()

    @endpoint
    def names(self) -> list[str]:
        """The names defined in this rank's namespace (without the dunder ones)."""
        return sorted(k for k in self.namespace if not k.startswith("__"))

    # -- internals --------------------------------------------------------------------------------
    def _namespace(self, options: dict) -> dict:
        if options.get("frame"):
            try:
                from ..debug.worker import frame_namespace
            except ImportError as exc:
                raise RuntimeError("--frame needs the debugger (monarch_nb.debug.magic), which is not available") from exc
            return frame_namespace()
        return self.namespace

    def _run_user(self, source: str, filename: str, options: dict) -> dict:
        me = threading.get_ident()
        try:
            namespace = self._namespace(options)
            tree = ast.parse(source, filename=filename, mode="exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            body = compile(tree, filename, "exec")
            last_code = compile(last, filename, "eval") if last is not None else None
        except BaseException as exc:
            return self._error(exc, filename)
        with self._lock:
            self._user_thread = me
            self._interrupted = False
        _interruptible.add(me)
        value = None
        try:
            exec(body, namespace)
            if last_code is not None:
                value = eval(last_code, namespace)
            error = None
        except BaseException as exc:  # KeyboardInterrupt and SystemExit in a cell are the cell's
            interrupted = isinstance(exc, KeyboardInterrupt) and self._interrupted
            if not interrupted:  # keep its frames for %mesh debug RANK and %%mesh --frame
                from ..debug.worker import record_failure

                record_failure(exc, "_mesh_cells", "run_cell")
            error = self._error(exc, filename, interrupted=interrupted)
        finally:
            _interruptible.discard(me)
            with self._lock:
                self._user_thread = None
                if self._interrupted:  # drop an interrupt that was raised too late to land
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(me), None)
        if error is not None:
            return error
        if value is None:
            return {"ok": True, "value": None, "data": None}
        namespace["_"] = value
        return {"ok": True, "value": _picklable_or_none(value), "data": mime_bundle(value)}

    def _error(self, exc: BaseException, filename: str, interrupted: bool = False) -> dict:
        from ..errors import capture_traceback

        info = capture_traceback(exc)
        frames = info.get("frames", [])
        for i, frame in enumerate(frames):  # drop the executor's own frames: start at the cell
            if frame[0] == filename:
                info["frames"] = frames[i:]
                break
        else:
            if isinstance(exc, SyntaxError):
                info["frames"] = []
                info["message"] = "".join(traceback.format_exception_only(type(exc), exc)).strip().split(": ", 1)[-1]
        return {"ok": False, "value": None, "data": None, "error": info, "interrupted": interrupted}

    def _display(self, *objs: Any, **_: Any) -> None:
        """``display(obj, ...)`` inside a cell: rich output, in order with the printed lines."""
        _flush_all()
        for obj in objs:
            payload = base64.b64encode(json.dumps(mime_bundle(obj)).encode()).decode()
            _write_all(1, marker_line(self._cell_id or "-", "display", payload))


def _picklable_or_none(value: Any) -> Any:
    from ..transport.serialization import dumps

    try:
        dumps(value)
    except Exception:
        return None
    return value
