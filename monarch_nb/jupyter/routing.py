"""Where ``%%mesh`` output goes: each line to the cell it belongs to, in that cell's output area.

The :class:`OutputRouter` (one per controller, installed in ``Controller.output_sinks`` in place
of the default printer) reads the cell executor's marker lines and hands every line written
between a cell's ``begin`` and ``end`` markers to that cell's run; other lines go to the
default printer. Nothing is shown twice: a line is delivered to exactly one place.

A :class:`CellOutput` writes into the output area of the cell that was executing when it was
made: from the kernel's main thread (a blocking cell) or from a pump thread that sets the cell's
parent header on the kernel's streams and display publisher (``set_thread_parent``, ipykernel
>= 7; see DESIGN §7).

Unfinished lines (progress bars, see :mod:`monarch_nb.runtime.output`) are shown in place: in a
notebook as one display per (rank, stream) that is updated (``update_display_data``) until the
line ends, in a terminal in the live block at the bottom of the screen.
"""

from __future__ import annotations

import re
import secrets
import sys
import threading
from typing import Any, Callable

from ..runtime.output import TERMINAL, OutputLine
from .worker import MARKER

__all__ = ["CellOutput", "LiveDisplays", "OutputRouter", "router_for"]

_MARKER_RE = re.compile(re.escape(MARKER) + r"([0-9a-f-]+):(\w+)(?::([^\x1e]*))?\x1e")


def _kernel_shell() -> Any:
    """The IPython shell if this process is a Jupyter kernel, else None."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None


class LiveDisplays:
    """Lines shown in place until they end: one updatable display per key (notebook), or the
    terminal's live block (anywhere else)."""

    def __init__(self, publish: Callable[[dict, dict, dict, bool], None] | None) -> None:
        self._publish = publish  # (data, metadata, transient, update) or None: use the terminal
        self._ids: dict[tuple, str] = {}

    def active(self, key: tuple) -> bool:
        return key in self._ids

    def show(self, key: tuple, text: str, stream: str, final: bool = False) -> None:
        """Show ``text`` as the current line of ``key`` (``(source, rank, stream)``); ``final``:
        the line ended, so it stays as it is and the key's next line starts a new one."""
        if self._publish is None:
            line = OutputLine(str(key[0]), key[1], stream, text, not final)
            if final:
                self._ids.pop(key, None)
            else:
                self._ids[key] = "terminal"
            TERMINAL.show(line, text)
            return
        display_id = self._ids.get(key)
        update = display_id is not None
        if display_id is None:
            display_id = self._ids[key] = f"mnb-line-{secrets.token_hex(6)}"
        if final:
            self._ids.pop(key, None)
        self._publish({"text/plain": text}, {}, {"display_id": display_id}, update)


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
        self.live = LiveDisplays(self._publish if kernel is not None else None)

    def bind_thread(self) -> None:
        """Make writes from the calling (non-main) thread land in the cell (ipykernel >= 7)."""
        if self.parent is None or threading.get_ident() == self.main_thread:
            return
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "set_thread_parent"):
                stream.set_thread_parent(self.parent)
        pub: Any = getattr(self.shell, "display_pub", None)
        if hasattr(pub, "set_thread_parent"):
            pub.set_thread_parent(self.parent)

    def stream(self, name: str, text: str) -> None:
        target = sys.stderr if name == "stderr" else sys.stdout
        target.write(text)

    def display(self, data: dict, metadata: dict | None = None) -> None:
        self.flush()
        if self.shell is None:
            sys.stdout.write(str(data.get("text/plain", "")) + "\n")
            return
        from IPython.display import publish_display_data

        publish_display_data(data, metadata or {})

    def _publish(self, data: dict, metadata: dict, transient: dict, update: bool) -> None:
        self.flush()
        from IPython.display import publish_display_data

        publish_display_data(data, metadata, transient=transient, update=update)

    def flush(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()


class OutputRouter:
    """The controller's output sink for ``%%mesh``: per (mesh, rank, stream), which cell is on."""

    accepts_partial = True

    def __init__(self, fallback: Callable[[Any], None] | None):
        self.fallback = fallback
        self._runs: dict[str, tuple[str, Any]] = {}  # cell id -> (mesh, run)
        self._active: dict[tuple[str, int, str], Any] = {}
        self._lock = threading.Lock()
        self._kernel_live: LiveDisplays | None = None

    def register(self, run: Any) -> None:
        with self._lock:
            self._runs[run.cell_id] = (run.session.mesh_name, run)

    def unregister(self, run: Any) -> None:
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
        partial = getattr(line, "partial", False)
        run = self._active.get((line.mesh, line.rank, line.stream))
        if run is not None:
            run.on_line(line.rank, line.stream, text, partial)
        elif self._in_kernel_live(line, text, partial):
            return
        elif self.fallback is not None:
            if text is line.text:
                self.fallback(line)
            else:
                self.fallback(OutputLine(line.mesh, line.rank, line.stream, text, partial))

    def _in_kernel_live(self, line: Any, text: str, partial: bool) -> bool:
        """In a kernel, a rank's unfinished line outside any cell (an endpoint's progress bar)
        is shown in place, in the cell that runs now; True if it was shown so."""
        key = (line.mesh, line.rank, line.stream)
        live = self._kernel_live
        if not partial and (live is None or not live.active(key)):
            return False
        if live is None:
            if _kernel_shell() is None:
                return False
            live = self._kernel_live = CellOutput().live
        live.show(key, f"[{line.rank}] {text}", line.stream, final=not partial)
        return True

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
