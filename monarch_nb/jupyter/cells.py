"""Controller side of ``%%mesh``: one cell running on some ranks, and what each rank did.

A :class:`CellRun` sends the cell to the selected ranks' :class:`~.worker.CellExecutor` and
collects, per rank, the output lines, rich displays, the last expression's value and the error;
:mod:`.routing` brings it the lines between the cell's markers.

Completeness: a rank is done when its reply has arrived **and** the ``end`` markers of both its
streams have (output travels proc → host agent → controller, the reply proc → controller, so the
reply may overtake the output). A rank whose proc died is done at its failure, which the
controller reports only after the dead proc's last output. Nothing is shown twice: a line is
delivered to exactly one place.

Where the output appears: the cell that started the run (see :class:`~.routing.CellOutput`).
A rank's unfinished line (a tqdm bar) is shown in place and replaced until it ends.
"""

from __future__ import annotations

import base64
import itertools
import json
import linecache
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import SupervisionError
from .cell_errors import MeshCellError, error_line
from .ranks import format_ranks
from .routing import CellOutput, router_for

__all__ = ["CellRun", "RankResult"]

log = logging.getLogger(__name__)

_cell_numbers = itertools.count(1)
#: how long a rank whose reply came may take to deliver its end markers before we give up on it
_MARKER_GRACE_S = 10.0


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
    def on_line(self, rank: int, stream: str, text: str, partial: bool = False) -> None:
        """A line of ``rank``'s cell output; ``partial``: the current content of an unfinished
        line (shown in place when streaming, never kept: the whole line comes later)."""
        res = self.results.get(rank)
        if res is None:
            return
        if partial:
            if self.stream_output:
                self._queue.put(("partial", rank, stream, text))
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
            failed_first = not all_done and res.error is not None and rank not in self.interrupted
            running = [r for r, other in self.results.items() if not other.done] if failed_first else []
        if all_done:
            self._finish()
        elif running:  # said now: the others may be waiting for it (a collective), and never end
            self._queue.put(("failed", rank, running))

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

    def wait_interactive(self, timeout: float | None = None, interval_s: float = 0.1, file: Any = None) -> bool:
        """Wait with a live progress bar of the ranks done: tqdm.auto, so a bar widget in a
        notebook and a text bar on stderr (or ``file``) in a terminal.

        Returns True when every rank is done, False when ``timeout`` seconds passed first.
        """
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        total = len(self.ranks)
        with tqdm(total=total, desc=f"{self.filename} rank(s) {format_ranks(self.ranks)}", unit="rank",
                  file=file, leave=True) as bar:
            while True:
                self.check_stragglers()
                finished = self._done.is_set()
                done = total if finished else sum(1 for res in self.results.values() if res.done)
                if done != bar.n:
                    bar.update(done - bar.n)
                if finished:
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                left = interval_s if deadline is None else max(0.0, min(interval_s, deadline - time.monotonic()))
                self._done.wait(left)

    def running_ranks(self) -> list[int]:
        """The ranks that have not finished the cell yet."""
        return [r for r, res in self.results.items() if not res.done]

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
                if self._done.is_set():
                    # the last lines and "done" may have been queued since the get timed out
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                elif deadline is not None and time.monotonic() > deadline:
                    break
                else:
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
        buffered_stream: str | None = None
        live = self.output.live

        def flush_text() -> None:
            nonlocal buffered, buffered_stream
            if buffered and buffered_stream is not None:  # (a buffered line has its stream)
                self.output.stream(buffered_stream, "".join(buffered))
            buffered, buffered_stream = [], None

        last = {(item[1], item[2]): i for i, item in enumerate(items) if item[0] in ("line", "partial")}
        finished = False
        for i, item in enumerate(items):
            if item[0] in ("line", "partial"):
                _, rank, stream, text = item
                key = (self.cell_id, rank, stream)
                shown = f"[{stream}:{rank}] {text}"
                if item[0] == "partial":
                    if last[(rank, stream)] == i:  # else a newer state of this line follows
                        flush_text()
                        live.show(key, shown, stream)
                    continue
                if live.active(key):  # the line shown in place ends: it stays where it is
                    flush_text()
                    live.show(key, shown, stream, final=True)
                    continue
                if buffered_stream not in (None, stream):
                    flush_text()
                buffered_stream = stream
                buffered.append(shown + "\n")
            elif item[0] == "display":
                flush_text()
                _, rank, bundle = item
                self.output.stream("stdout", f"[output:{rank}]\n")
                self.output.flush()
                self.output.display(bundle)
            elif item[0] == "failed":
                flush_text()
                _, rank, running = item
                self.output.stream("stderr", f"rank {rank} failed ({error_line(self.results[rank].error)}) while rank(s) "
                                   f"{format_ranks(running)} still run the cell; its traceback follows when they end "
                                   "(if they wait for it, as in a collective, interrupt the kernel)\n")
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
        interrupted = [r for r, res in self.results.items()
                       if (res.reply or {}).get("interrupted") or (r in self.interrupted and res.error is not None)]
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
