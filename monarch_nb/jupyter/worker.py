"""Worker side of ``%%mesh``: an actor that runs notebook cells in a persistent per-rank namespace.

One :class:`CellExecutor` lives on every proc of a mesh started with ``%mesh start``. Its
``run_cell`` endpoint compiles a cell, runs it in the rank's namespace (``rank``,
``world_size``, ``coords``, ``local_rank``, ``device`` and whatever earlier cells defined), and
returns the value of the cell's last expression as display data. ``device`` is the rank's
``torch.device`` (``cuda:0``, the one GPU a proc sees, on NVIDIA and ROCm; ``cpu`` otherwise);
torch is imported only for the first cell that names it. ``set_names`` / ``get_names`` move
values in and out of the namespace (``%mesh push`` / ``pull``), with tensors and arrays as
out-of-band buffers. A :class:`MeshProbe` beside it answers ``%mesh status`` while a cell runs.

Output: the cell writes to the proc's real stdout / stderr (file descriptors 1 and 2, which the
host agent reads), so output of C code and subprocesses is kept too. Before and after the cell,
the executor writes a *marker line* (:mod:`.display_worker`) on both descriptors (``\\x1emnb:<cell id>:begin\\x1e``,
``...:end\\x1e``). The controller (:mod:`monarch_nb.jupyter.cells`) attributes the lines between
the markers to the cell, and a blocking cell returns only once it has seen both end markers of
every rank: per-rank output is complete and in order (per stream) by construction, including
what was printed just before an exception. Rich output (``display``, IPython's display API,
matplotlib, pandas) becomes ``display`` markers on fd 1, so it keeps its place among the printed
lines (see :mod:`.display_worker`).

Interrupts: the proc's IO thread calls :meth:`CellExecutor.__interrupt__`, which raises
``KeyboardInterrupt`` in the thread that runs the cell (``PyThreadState_SetAsyncExc``) while
user code runs, and never outside it. Such an exception is seen between bytecodes, so
``time.sleep`` is made interruptible for cell threads (it sleeps in slices of at most 50 ms); a
C call that blocks (a collective waiting for a dead peer) ends first.
"""

from __future__ import annotations

import ast
import ctypes
import linecache
import os
import threading
import time
import traceback
from typing import Any

from ..actor.endpoint import Actor, endpoint
from ..device import loaded_torch
from . import display_worker
from .display_worker import MARKER, flush_all, marker_line, mime_bundle, write_all

__all__ = ["CellExecutor", "MeshProbe", "MARKER", "marker_line", "mime_bundle"]

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


def _names_used(tree: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


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
            "display": display_worker.display,
        }
        self._lock = threading.Lock()
        self._user_thread: int | None = None
        self._interrupted = False
        # only cell threads slice their sleeps; see the module doc (typeshed's sleep also takes SupportsIndex)
        time.sleep = _interruptible_sleep  # type: ignore[assignment]
        display_worker.install()

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
        display_worker.set_current_cell(cell_id)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        flush_all()
        for fd in (1, 2):
            write_all(fd, marker_line(cell_id, "begin"))
        try:
            try:
                result = self._run_user(source, filename, options)
            except KeyboardInterrupt as exc:  # an interrupt that landed just after the user code
                result = self._error(exc, filename, interrupted=True)
        finally:
            flush_all()
            for fd in (1, 2):
                write_all(fd, marker_line(cell_id, "end"))
            display_worker.set_current_cell("")
        return result

    @endpoint
    def init_distributed(self, host: str | None, port: int | None, backend: str | None = None, timeout_s: float = 60.0) -> str:
        """Initialise ``torch.distributed`` on this rank from a TCPStore served by the controller at
        ``host:port`` (None: the proc mesh's store, ``MASTER_ADDR:MASTER_PORT``).

        Puts ``dist`` (``torch.distributed``) in the namespace; returns the backend used.
        """
        import datetime

        import torch.distributed as dist

        from .. import device

        if host is None or port is None:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
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

    @endpoint
    def set_names(self, values: dict) -> list[str]:
        """Bind each ``name -> value`` of ``values`` in this rank's namespace (``%mesh push``)."""
        bad = [name for name in values if not isinstance(name, str) or not name.isidentifier()]
        if bad:
            raise ValueError(f"not Python names: {bad!r}")
        self.namespace.update(values)
        return sorted(values)

    @endpoint
    def get_names(self, names: list) -> dict:
        """``name -> value`` of ``names`` in this rank's namespace (``%mesh pull``).

        Raises:
            NameError: a name is not defined on this rank.
            TypeError: a value cannot be sent (pickled); the message names its type.
        """
        from ..transport.serialization import SerializationError, dumps

        missing = [n for n in names if n not in self.namespace]
        if missing:
            raise NameError(f"name {missing[0]!r} is not defined on rank {self.rank}")
        out = {n: self.namespace[n] for n in names}
        for name, value in out.items():
            try:
                dumps(value)
            except SerializationError as exc:
                raise TypeError(f"{name} ({type(value).__name__}) cannot be sent from rank {self.rank}: {exc}") from None
        return out

    @endpoint
    def idle(self) -> int:
        """Answers once every cell queued before it on this rank has finished (``%mesh barrier``)."""
        return self.rank

    # -- internals --------------------------------------------------------------------------------
    def _namespace(self, options: dict) -> dict:
        if options.get("frame"):
            try:
                from ..debug.worker import frame_namespace
            except ImportError as exc:
                raise RuntimeError("--frame needs the debugger (monarch_nb.debug.magic), which is not available") from exc
            return frame_namespace()
        return self.namespace

    def _predefine(self, namespace: dict, tree: ast.AST) -> None:
        """Names defined on first use: ``device`` imports torch only for a cell that names it."""
        if "device" not in namespace and "device" in _names_used(tree):
            from .. import device

            namespace["device"] = device.device()

    def _run_user(self, source: str, filename: str, options: dict) -> dict:
        me = threading.get_ident()
        try:
            namespace = self._namespace(options)
            tree = ast.parse(source, filename=filename, mode="exec")
            self._predefine(namespace, tree)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body[-1].value)
                tree.body.pop()
            body = compile(tree, filename, "exec")
            last_code = compile(last, filename, "eval") if last is not None else None
        except BaseException as exc:
            return self._error(exc, filename)
        with self._lock:
            self._user_thread = me
            self._interrupted = False
        _interruptible.add(me)
        value = None
        started = time.monotonic()
        try:
            exec(body, namespace)
            if last_code is not None:
                value = eval(last_code, namespace)
            display_worker.show_open_figures(value)
            error = None
        except BaseException as exc:  # KeyboardInterrupt and SystemExit in a cell are the cell's
            interrupted = isinstance(exc, KeyboardInterrupt) and self._interrupted
            if not interrupted:  # keep its frames for %mesh debug RANK and %%mesh --frame
                from ..debug.worker import record_failure

                record_failure(exc, "_mesh_cells", "run_cell")
            error = self._error(exc, filename, interrupted=interrupted, since=started)
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

    def _error(self, exc: BaseException, filename: str, interrupted: bool = False, since: float | None = None) -> dict:
        from ..errors import capture_traceback
        from ..train.group_worker import failure_note, looks_like_a_peer_error

        info = capture_traceback(exc)
        said = type(exc).__name__ == "PeerDeadError"  # its own message names the dead rank already
        note = ""
        if since is not None and not interrupted and not said:  # a peer's reset is seen before the controller's word
            note = failure_note(since, wait_s=2.0 if looks_like_a_peer_error(exc) else 0.0)
        if note:  # a peer died under this cell: say who and why, not only what gloo saw
            info["message"] = f"{info.get('message', '')}\n  ({note})"
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


def _picklable_or_none(value: Any) -> Any:
    from ..transport.serialization import dumps

    try:
        dumps(value)
    except Exception:
        return None
    return value


class MeshProbe(Actor):
    """Answers ``%mesh status`` on one rank, also while a cell runs there (its own thread).

    ``stats()`` reads the OS and, only where the rank already uses a GPU, torch: it never imports
    torch or creates a CUDA context on an idle rank.
    """

    def __init__(self) -> None:
        self._last = _cpu_seconds(), time.monotonic()

    @endpoint
    def stats(self) -> dict:
        """``{"device", "memory_used_bytes", "memory_total_bytes", "memory_note", "cpu_percent"
        (since the previous call), "rss_bytes"}``."""
        cpu, now = _cpu_seconds(), time.monotonic()
        last_cpu, last_t = self._last
        self._last = cpu, now
        out: dict[str, Any] = {"cpu_percent": 100.0 * (cpu - last_cpu) / max(now - last_t, 1e-6),
                               "rss_bytes": _rss_bytes(), "memory_used_bytes": None, "memory_total_bytes": None,
                               "memory_note": ""}
        torch = loaded_torch()
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info(0)
            out.update(device="cuda:0", memory_used_bytes=total - free, memory_total_bytes=total,
                       memory_note=f"{torch.cuda.memory_allocated(0)} B by torch here")
        else:
            from .. import device

            gpus = device.detect_gpus().count
            out["device"] = "cuda:0" if gpus else "cpu"
            out["memory_note"] = "no CUDA context yet" if gpus else ""
        return out


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
