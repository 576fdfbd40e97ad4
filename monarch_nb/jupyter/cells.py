"""Controller side of ``%%mesh``: run a cell on ranks, route each rank's output into that cell.

A :class:`CellRun` sends the cell to the selected ranks' :class:`~.worker.CellExecutor` and
collects, per rank, the output lines, rich displays, the last expression's value and the error.
The :class:`OutputRouter` (one per controller, installed in ``Controller.output_sinks`` in place
of the default printer) reads the executor's marker lines and hands every line written between
a cell's ``begin`` and ``end`` markers to that cell's run; other lines go to the default printer.

Completeness: a rank is done when its reply has arrived **and** the ``end`` markers of both its
streams have (output travels proc → host agent → controller, the reply proc → controller, so the
reply may overtake the output). A rank whose proc died is done at its failure, which the
controller reports only after the dead proc's last output. Nothing is shown twice: a line is
delivered to exactly one place.

Where the output appears: the cell that started the run. A blocking cell writes from the kernel's
main thread; a non-blocking one from a pump thread that sets the cell's parent header on the
kernel's streams and display publisher (``set_thread_parent``, ipykernel >= 7; see DESIGN §7).
"""

from __future__ import annotations

import base64
import itertools
import json
import linecache
import logging
import queue
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import SupervisionError, format_remote_traceback
from .worker import MARKER

__all__ = ["CellRun", "OutputRouter", "MeshCellError", "parse_ranks", "RankSpecError", "router_for"]

log = logging.getLogger(__name__)

_MARKER_RE = re.compile(re.escape(MARKER) + r"([0-9a-f-]+):(\w+)(?::([^\x1e]*))?\x1e")
_cell_numbers = itertools.count(1)
#: how long a rank whose reply came may take to deliver its end markers before we give up on it
_MARKER_GRACE_S = 10.0
#: how many ranks' tracebacks an error shows before the summary line
_TRACEBACKS_SHOWN = 3


# -- rank selection ------------------------------------------------------------------------------
class RankSpecError(ValueError):
    """A malformed or out-of-range ``--ranks`` value."""


RANK_FORMS = "all | N | A-B (inclusive) | A:B[:STEP] (a Python slice) | a comma-separated mix, e.g. 0,2-3"


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """The sorted ranks that ``spec`` selects out of ``0..world_size-1``.

    >>> parse_ranks("0,2-3", 4)
    [0, 2, 3]
    >>> parse_ranks("::2", 4)
    [0, 2]

    Raises:
        RankSpecError: a malformed spec or a rank out of range (the message names the valid forms).
    """
    if spec is None or spec.strip() in ("", "all", "*"):
        return list(range(world_size))
    chosen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if ":" in part:
                pieces = [int(p) if p.strip() else None for p in part.split(":")]
                if len(pieces) > 3:
                    raise ValueError(part)
                if any(p is not None and p < 0 for p in pieces):
                    raise RankSpecError(f"--ranks {spec!r}: negative numbers are not ranks; valid ranks are 0..{world_size - 1}")
                if len(pieces) == 3 and pieces[2] == 0:
                    raise ValueError(part)
                stop = pieces[1]
                if stop is not None and stop > world_size:
                    raise RankSpecError(f"--ranks {spec!r}: {stop} is past the last rank; valid ranks are 0..{world_size - 1}")
                picked = list(range(world_size))[slice(*pieces)]
            elif re.fullmatch(r"\d+\s*-\s*\d+", part):
                lo, hi = (int(p) for p in part.split("-"))
                if lo > hi:
                    raise RankSpecError(f"--ranks {spec!r}: range {part} runs backwards (write {hi}-{lo})")
                picked = list(range(lo, hi + 1))
            else:
                picked = [int(part)]
        except RankSpecError:
            raise
        except ValueError:
            raise RankSpecError(f"--ranks {spec!r} is malformed; valid forms: {RANK_FORMS}") from None
        bad = [r for r in picked if not 0 <= r < world_size]
        if bad:
            raise RankSpecError(f"--ranks {spec!r}: rank {bad[0]} is out of range; valid ranks are 0..{world_size - 1}")
        chosen.update(picked)
    if not chosen:
        raise RankSpecError(f"--ranks {spec!r} selects no rank; valid ranks are 0..{world_size - 1}")
    return sorted(chosen)


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts = []
    for _, group in itertools.groupby(enumerate(sorted(ranks)), lambda p: p[1] - p[0]):
        run = [r for _, r in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


# -- errors --------------------------------------------------------------------------------------
class MeshCellError(Exception):
    """A ``%%mesh`` cell failed on some ranks. Renders as per-rank remote tracebacks + a summary.

    Attributes:
        errors: rank -> the remote traceback dict (or a SupervisionError for a dead proc).
        interrupted: ranks stopped by an interrupt.
    """

    def __init__(self, errors: dict[int, Any], selected: list[int], interrupted: list[int] | None = None):
        self.errors = dict(sorted(errors.items()))
        self.selected = list(selected)
        self.interrupted = sorted(interrupted or [])
        super().__init__(self.summary())

    def summary(self) -> str:
        ranks = sorted(self.errors)
        kinds = sorted({_error_type(e) for e in self.errors.values()})
        if self.interrupted and set(self.interrupted) >= set(ranks):
            return f"interrupted on rank(s) {format_ranks(self.interrupted)} of {format_ranks(self.selected)}"
        return f"{len(ranks)} of {len(self.selected)} rank(s) failed: {format_ranks(ranks)} ({', '.join(kinds)})"

    def _render_traceback_(self) -> list[str]:
        out: list[str] = []
        shown = [r for r in self.errors if r not in self.interrupted] or list(self.errors)[:1]
        for rank in shown[:_TRACEBACKS_SHOWN]:
            out.append(f"[{rank}:traceback]")
            out += render_error(self.errors[rank]).rstrip("\n").split("\n")
        if len(shown) > _TRACEBACKS_SHOWN:
            out.append(f"... {len(shown) - _TRACEBACKS_SHOWN} more rank(s) failed the same way or otherwise: "
                       f"{format_ranks(shown[_TRACEBACKS_SHOWN:])}")
        out.append(f"MeshCellError: {self.summary()}")
        return out

    def __str__(self) -> str:
        return self.summary()


def _error_type(error: Any) -> str:
    if isinstance(error, BaseException):
        return type(error).__name__
    return error.get("type", "Exception")


def render_error(error: Any) -> str:
    if isinstance(error, SupervisionError):
        return f"SupervisionError: {error}\n"
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}\n"
    if not error.get("frames") and error.get("type") == "SyntaxError":
        return f"SyntaxError: {error.get('message', '')}\n"
    return format_remote_traceback(error)


# -- where output goes ---------------------------------------------------------------------------
class CellOutput:
    """Writes into the output area of the cell that was executing when this was made."""

    def __init__(self) -> None:
        self.parent: dict | None = None
        self.shell = None
        self.main_thread = threading.get_ident()
        try:
            from IPython import get_ipython

            self.shell = get_ipython()
        except ImportError:
            pass
        kernel = getattr(self.shell, "kernel", None)
        if kernel is not None:
            self.parent = kernel.get_parent()

    def bind_thread(self) -> None:
        """Make writes from the calling (non-main) thread land in the cell (ipykernel >= 7)."""
        if self.parent is None or threading.get_ident() == self.main_thread:
            return
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "set_thread_parent"):
                stream.set_thread_parent(self.parent)
        pub = getattr(self.shell, "display_pub", None)
        if hasattr(pub, "set_thread_parent"):
            pub.set_thread_parent(self.parent)

    def stream(self, name: str, text: str) -> None:
        target = sys.stderr if name == "stderr" else sys.stdout
        target.write(text)

    def display(self, data: dict, metadata: dict | None = None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self.shell is None:
            sys.stdout.write(str(data.get("text/plain", "")) + "\n")
            return
        from IPython.display import publish_display_data

        publish_display_data(data, metadata or {})

    def flush(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()


# -- one run -------------------------------------------------------------------------------------
@dataclass
class RankResult:
    """What one rank did in a cell."""

    rank: int
    outputs: list = field(default_factory=list)  # ("stdout"|"stderr", text) or ("display", bundle)
    ended: set = field(default_factory=set)  # streams whose end marker arrived
    reply: dict | None = None
    failure: BaseException | None = None
    reply_time: float = 0.0
    done: bool = False
    incomplete: bool = False

    @property
    def ok(self) -> bool:
        return self.failure is None and self.reply is not None and self.reply.get("ok", False)

    @property
    def error(self) -> Any:
        if self.failure is not None:
            return self.failure
        if self.reply is not None and not self.reply.get("ok", True):
            return self.reply.get("error")
        return None

    def stdout(self) -> str:
        return "".join(text + "\n" for kind, text in self.outputs if kind == "stdout")

    def stderr(self) -> str:
        return "".join(text + "\n" for kind, text in self.outputs if kind == "stderr")


class CellRun:
    """One ``%%mesh`` cell running on some ranks. Returned by ``%%mesh --out NAME``.

    Use ``wait(timeout)``, ``done()``, ``interrupt()``; after it finished, ``results`` (rank ->
    :class:`RankResult`), ``values`` (rank -> last expression value), ``errors``, ``stdout(rank)``.
    """

    def __init__(
        self,
        session: Any,
        source: str,
        ranks: list[int],
        *,
        stream: bool = True,
        group_outputs: str = "rank",
        frame: bool = False,
        output: CellOutput | None = None,
    ) -> None:
        self.session = session
        self.cell_id = secrets.token_hex(6)
        self.number = next(_cell_numbers)
        self.filename = f"<mesh-cell-{self.number}>"
        self.source = source
        self.ranks = list(ranks)
        self.stream_output = stream
        self.group_outputs = group_outputs
        self.frame = frame
        self.output = output or CellOutput()
        self.results = {r: RankResult(r) for r in ranks}
        self.interrupted: set[int] = set()
        self.started = time.monotonic()
        self.finished_at: float | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._shown = False
        self._pump_thread: threading.Thread | None = None
        linecache.cache[self.filename] = (len(source), None, source.splitlines(True), self.filename)

    # -- starting ---------------------------------------------------------------------------------
    def start(self) -> "CellRun":
        router = router_for(self.session.controller)
        router.register(self)
        options = {"frame": self.frame}
        for rank in self.ranks:
            try:
                future = self.session.executor_of(rank).run_cell.call_one(self.cell_id, self.source, self.filename, options)
            except Exception as exc:  # the rank is known to be dead: fail fast
                self._on_reply(rank, None, exc)
                continue
            future.add_done_callback(lambda f, r=rank: self._on_future(r, f))
        return self

    def _on_future(self, rank: int, future: Any) -> None:
        exc = future.exception()
        self._on_reply(rank, None if exc is not None else future.get(), exc)

    # -- events from the IO thread (router) and reply callbacks -------------------------------------
    def on_line(self, rank: int, stream: str, text: str) -> None:
        res = self.results.get(rank)
        if res is None:
            return
        with self._lock:
            res.outputs.append((stream, text))
        if self.stream_output:
            self._queue.put(("line", rank, stream, text))

    def on_display(self, rank: int, payload: str) -> None:
        res = self.results.get(rank)
        if res is None:
            return
        try:
            bundle = json.loads(base64.b64decode(payload))
        except Exception:
            bundle = {"text/plain": "<undecodable display>"}
        with self._lock:
            res.outputs.append(("display", bundle))
        if self.stream_output:
            self._queue.put(("display", rank, bundle))

    def on_end(self, rank: int, stream: str) -> None:
        res = self.results.get(rank)
        if res is None:
            return
        with self._lock:
            res.ended.add(stream)
        self._check_rank(rank)

    def on_proc_failed(self, rank: int) -> None:
        """The rank's proc died: its output up to the death has been delivered already."""
        self._check_rank(rank, proc_gone=True)

    def _on_reply(self, rank: int, reply: dict | None, exc: BaseException | None) -> None:
        res = self.results[rank]
        with self._lock:
            res.reply = reply
            res.failure = exc
            res.reply_time = time.monotonic()
        self._check_rank(rank)

    def _check_rank(self, rank: int, proc_gone: bool = False) -> None:
        res = self.results[rank]
        with self._lock:
            if res.done:
                return
            replied = res.reply is not None or res.failure is not None
            if not replied:
                return
            markers = {"stdout", "stderr"} <= res.ended
            dead = proc_gone or isinstance(res.failure, SupervisionError)
            late = time.monotonic() - res.reply_time > _MARKER_GRACE_S
            if not (markers or dead or late):
                return
            res.done = True
            res.incomplete = not markers and not dead
            all_done = all(r.done for r in self.results.values())
        if all_done:
            self._finish()

    def check_stragglers(self) -> None:
        """Give up on end markers that never came (a rank that died without the proc dying)."""
        for rank in self.ranks:
            self._check_rank(rank)

    def _finish(self) -> None:
        router = router_for(self.session.controller)
        router.unregister(self)
        self.finished_at = time.monotonic()
        self._queue.put(("done",))
        self._done.set()

    # -- waiting, pumping, showing ------------------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every rank is done (True) or ``timeout`` passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.1):
            self.check_stragglers()
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def interrupt(self) -> list[int]:
        """Interrupt the cell on every selected rank still running it; return those ranks."""
        running = [r for r, res in self.results.items() if not res.done]
        for rank in running:
            self.interrupted.add(rank)
            self.session.interrupt_rank(rank)
        return running

    def pump(self, deadline: float | None = None) -> None:
        """Show output as it arrives until the run is done (calling thread), or until ``deadline``
        (a ``time.monotonic()`` value) passes."""
        self.output.bind_thread()
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._done.is_set() or (deadline is not None and time.monotonic() > deadline):
                    break
                self.check_stragglers()
                continue
            batch = [item]
            while True:  # coalesce what is already there into few writes
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            finished = self._show_items(batch)
            if finished:
                break
        self.output.flush()

    def _show_items(self, items: list) -> bool:
        buffered: list[str] = []
        buffered_stream = None

        def flush_text() -> None:
            nonlocal buffered, buffered_stream
            if buffered:
                self.output.stream(buffered_stream, "".join(buffered))
            buffered, buffered_stream = [], None

        finished = False
        for item in items:
            if item[0] == "line":
                _, rank, stream, text = item
                if buffered_stream not in (None, stream):
                    flush_text()
                buffered_stream = stream
                buffered.append(f"[{stream}:{rank}] {text}\n")
            elif item[0] == "display":
                flush_text()
                _, rank, bundle = item
                self.output.stream("stdout", f"[output:{rank}]\n")
                self.output.flush()
                self.output.display(bundle)
            elif item[0] == "done":
                finished = True
        flush_text()
        return finished

    def show_results(self) -> None:
        """Show buffered output (--no-stream), the ``Out[rank]`` values and warnings."""
        if self._shown:
            return
        self._shown = True
        self.output.bind_thread()
        if not self.stream_output:
            self._show_grouped()
        for rank in self.ranks:
            res = self.results[rank]
            data = (res.reply or {}).get("data") if res.ok else None
            if data:
                self.output.flush()
                bundle = dict(data)
                bundle["text/plain"] = f"Out[{rank}]: {data.get('text/plain', '')}"
                if "text/html" in bundle:
                    bundle["text/html"] = f"<b>Out[{rank}]:</b> {bundle['text/html']}"
                self.output.display(bundle)
        lost = [r for r, res in self.results.items() if res.incomplete]
        if lost:
            self.output.stream("stderr", f"warning: rank(s) {format_ranks(lost)} did not report the end of their output; it may be incomplete\n")
        self.output.flush()

    def _show_grouped(self) -> None:
        if self.group_outputs == "type":
            for kind in ("stdout", "stderr", "display"):
                for rank in self.ranks:
                    self._show_rank_kind(rank, kind)
        else:
            for rank in self.ranks:
                for kind in ("stdout", "stderr", "display"):
                    self._show_rank_kind(rank, kind)

    def _show_rank_kind(self, rank: int, kind: str) -> None:
        items = [o for o in self.results[rank].outputs if o[0] == kind]
        if not items:
            return
        if kind == "display":
            for _, bundle in items:
                self.output.stream("stdout", f"[output:{rank}]\n")
                self.output.flush()
                self.output.display(bundle)
            return
        text = "".join(t + "\n" for _, t in items)
        self.output.stream(kind, f"[{kind}:{rank}]\n{text}")
        self.output.flush()

    def error(self) -> MeshCellError | None:
        errors = {r: res.error for r, res in self.results.items() if res.error is not None}
        if not errors:
            return None
        interrupted = [r for r, res in self.results.items() if (res.reply or {}).get("interrupted") or (r in self.interrupted and res.error is not None)]
        return MeshCellError(errors, self.ranks, interrupted)

    # -- results ----------------------------------------------------------------------------------
    @property
    def values(self) -> dict[int, Any]:
        """rank -> the value of the cell's last expression (None if none or unpicklable)."""
        return {r: (res.reply or {}).get("value") for r, res in self.results.items() if res.ok}

    @property
    def errors(self) -> dict[int, Any]:
        return {r: res.error for r, res in self.results.items() if res.error is not None}

    def stdout(self, rank: int) -> str:
        return self.results[rank].stdout()

    def stderr(self, rank: int) -> str:
        return self.results[rank].stderr()

    @property
    def elapsed_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<CellRun {self.filename} ranks {format_ranks(self.ranks)} {state}, {self.elapsed_s:.2f} s>"


# -- the router ----------------------------------------------------------------------------------
class OutputRouter:
    """The controller's output sink for ``%%mesh``: per (mesh, rank, stream), which cell is on."""

    def __init__(self, fallback: Callable[[Any], None] | None):
        self.fallback = fallback
        self._runs: dict[str, tuple[str, CellRun]] = {}  # cell id -> (mesh, run)
        self._active: dict[tuple[str, int, str], CellRun] = {}
        self._lock = threading.Lock()

    def register(self, run: CellRun) -> None:
        with self._lock:
            self._runs[run.cell_id] = (run.session.mesh_name, run)

    def unregister(self, run: CellRun) -> None:
        with self._lock:
            self._runs.pop(run.cell_id, None)
            for key in [k for k, v in self._active.items() if v is run]:
                del self._active[key]

    def on_proc_exit(self, mesh: str, rank: int) -> None:
        with self._lock:
            runs = [run for (m, run) in self._runs.values() if m == mesh and rank in run.results]
            for stream in ("stdout", "stderr"):
                self._active.pop((mesh, rank, stream), None)
        for run in runs:
            run.on_proc_failed(rank)

    def __call__(self, line: Any) -> None:
        text = line.text
        if MARKER not in text:
            self._deliver(line, text)
            return
        while True:
            match = _MARKER_RE.search(text)
            if match is None:
                if text:
                    self._deliver(line, text)
                return
            if match.start():
                self._deliver(line, text[: match.start()])
            self._marker(line, *match.groups())
            text = text[match.end():]
            if not text:
                return

    def _deliver(self, line: Any, text: str) -> None:
        run = self._active.get((line.mesh, line.rank, line.stream))
        if run is not None:
            run.on_line(line.rank, line.stream, text)
        elif self.fallback is not None:
            if text is line.text:
                self.fallback(line)
            else:
                self.fallback(type(line)(line.mesh, line.rank, line.stream, text))

    def _marker(self, line: Any, cell_id: str, kind: str, payload: str | None) -> None:
        entry = self._runs.get(cell_id)
        run = entry[1] if entry is not None else None
        key = (line.mesh, line.rank, line.stream)
        if kind == "begin":
            if run is not None:
                self._active[key] = run
        elif kind == "end":
            if self._active.get(key) is run:
                self._active.pop(key, None)
            if run is not None:
                run.on_end(line.rank, line.stream)
        elif kind == "display":
            target = run or self._active.get(key)
            if target is not None:
                target.on_display(line.rank, payload or "")


_routers: dict[int, OutputRouter] = {}
_routers_lock = threading.Lock()


def router_for(controller: Any) -> OutputRouter:
    """The controller's router, installed on first use in place of its default printer."""
    with _routers_lock:
        router = _routers.get(id(controller))
        if router is not None and router in controller.output_sinks:
            return router
        from ..runtime.controller import print_output

        sinks = controller.output_sinks
        fallback = print_output if print_output in sinks else None
        router = OutputRouter(fallback)
        if fallback is not None:
            sinks[sinks.index(print_output)] = router
        else:
            sinks.insert(0, router)
        _routers[id(controller)] = router

        def on_event(event: Any) -> None:
            if event.kind in ("proc_exited", "proc_hung", "proc_restarting"):
                router.on_proc_exit(event.mesh, event.rank)

        controller.events.subscribe(on_event)
        return router
