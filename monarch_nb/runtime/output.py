"""Procs' stdout/stderr on the controller: bytes from host agents become lines, handed to sinks.

Host agents forward what procs write as byte chunks (``output`` messages, in order per proc and
stream), as soon as they read them. :class:`LineAssembler` turns them into lines, decoding UTF-8
across chunk edges, and each line goes to every sink in ``Controller.output_sinks`` as an
:class:`OutputLine`. The default sink, :func:`print_output`, prints ``[rank] text``; ``%%mesh``
replaces it with a router that sends each line to the cell it belongs to.

Unfinished lines (progress bars). A proc that writes a line in pieces, or redraws one with
``\\r`` as tqdm does, has an unfinished line that it may not end for minutes. Its current content
is handed out as a *partial* :class:`OutputLine` (``partial=True``) at once when the proc wrote
a ``\\r`` into it, and otherwise once nothing was added for ``quiet_s`` (0.1 s): short enough to
see, long enough that ``print(a, b)`` (written in pieces by an unbuffered proc) arrives as one
whole line. A partial line is the content of that (mesh, rank, stream)'s current line, replaced
by the next line of the same key, partial or whole. Only sinks with ``accepts_partial = True``
get partial lines; the others see whole lines only, as before. A whole line's text is what a
terminal would show: the part after its last ``\\r``.
"""

from __future__ import annotations

import codecs
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["OutputLine", "LineAssembler", "LiveLines", "TERMINAL", "print_output", "deliver", "QUIET_S"]

#: how long an unfinished line must stay unchanged before it is handed out as a partial line (s)
QUIET_S = 0.1


@dataclass
class OutputLine:
    """One line a proc wrote. ``stream`` is "stdout" or "stderr"; ``text`` has no newline.

    ``partial`` is True for the current content of a line the proc has not ended yet (see the
    module doc); the next line of the same (mesh, rank, stream) replaces it.
    """

    mesh: str
    rank: int
    stream: str
    text: str
    partial: bool = False


def _visible(raw: str) -> str:
    """What a terminal shows of ``raw``: the last non-empty part between carriage returns."""
    parts = [p for p in raw.split("\r") if p]
    return parts[-1] if parts else ""


class LineAssembler:
    """Turns (proc, stream) byte chunks into whole lines and partial ones.

    ``feed`` returns the whole lines a chunk completes; ``redrawn`` the unfinished line's content
    when the chunk redrew it with ``\\r``; ``quiet`` the unfinished lines that stopped changing.
    Not thread-safe: the controller calls it from its IO thread only.
    """

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self._decoders: dict = {}
        self._partial: dict = {}  # key -> raw text of the unfinished line
        self._changed: dict = {}  # key -> monotonic time of a change not handed out yet
        self._redrawn: dict = {}  # key -> content to hand out now (a \r arrived)

    def feed(self, key: tuple, data: bytes, now: float | None = None) -> list[str]:
        """The lines that ``data`` completes for ``key``; a trailing unfinished line is kept."""
        decoder = self._decoders.setdefault(key, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        new = decoder.decode(data)
        text = self._partial.pop(key, "") + new
        lines = text.split("\n")
        rest = lines[-1]
        self._redrawn.pop(key, None)
        self._changed.pop(key, None)
        if rest:
            self._partial[key] = rest
            tail = new.rsplit("\n", 1)[-1]
            if "\r" in tail and _showable(rest):
                self._redrawn[key] = _visible(rest)
            else:
                self._changed[key] = time.monotonic() if now is None else now
        return [_visible(line) if "\r" in line else line for line in lines[:-1]]

    def redrawn(self, key: tuple) -> str | None:
        """The unfinished line of ``key`` to show now, if the last chunk redrew it with ``\\r``."""
        return self._redrawn.pop(key, None)

    def quiet(self, now: float | None = None) -> list[tuple[tuple, str]]:
        """``(key, content)`` of unfinished lines unchanged for ``quiet_s`` and not handed out yet."""
        now = time.monotonic() if now is None else now
        due = [key for key, since in self._changed.items() if now - since >= self.quiet_s]
        out = []
        for key in due:
            del self._changed[key]
            raw = self._partial.get(key, "")
            if _showable(raw):
                out.append((key, _visible(raw)))
        return out

    def flush(self, key: tuple) -> list[str]:
        """The unfinished line kept for ``key`` (the proc exited), as a list of zero or one line."""
        decoder = self._decoders.pop(key, None)
        self._changed.pop(key, None)
        self._redrawn.pop(key, None)
        rest = self._partial.pop(key, "") + (decoder.decode(b"", final=True) if decoder else "")
        return [_visible(rest)] if rest else []


def _showable(raw: str) -> bool:
    """An unfinished line worth showing: visible text, and not a control record being written
    (``\\x1e``-delimited records, such as ``%%mesh``'s markers, are only read whole)."""
    return "\x1e" not in raw and bool(_visible(raw).strip())


def deliver(sinks: Iterable[Callable[[OutputLine], None]], line: OutputLine, on_error: Callable[[Any], None]) -> None:
    """Give ``line`` to each sink (partial lines only to sinks with ``accepts_partial``)."""
    for sink in list(sinks):
        if line.partial and not getattr(sink, "accepts_partial", False):
            continue
        try:
            sink(line)
        except Exception:
            on_error(sink)


class LiveLines:
    """Partial lines redrawn in place at the bottom of a terminal: one line per (mesh, rank,
    stream), like tqdm's ``position``; whole lines print above them.

    Drawn on ``sys.stderr`` when it is a terminal; elsewhere (a pipe, a file, a notebook's
    stream) partial lines are dropped and only whole lines print, so a log holds each bar once,
    finished.
    """

    def __init__(self) -> None:
        self._live: dict[tuple, str] = {}
        self._drawn = 0
        self._lock = threading.Lock()

    def show(self, line: OutputLine, text: str) -> None:
        """Show ``text`` (the formatted ``line``): in the live block if partial, else printed."""
        target = sys.stderr if line.stream == "stderr" else sys.stdout
        term = sys.stderr if _isatty(sys.stderr) else None
        key = (line.mesh, line.rank, line.stream)
        with self._lock:
            if term is None:
                if not line.partial:
                    print(text, file=target, flush=True)
                return
            self._erase(term)
            if line.partial:
                self._live[key] = text
            else:
                self._live.pop(key, None)
                print(text, file=target, flush=True)
            self._draw(term)

    def _erase(self, term: Any) -> None:
        if self._drawn:
            term.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw(self, term: Any) -> None:
        if not self._live:
            term.flush()
            return
        width = max(20, shutil.get_terminal_size().columns - 1)
        rows = [text[:width] for _, text in sorted(self._live.items())]
        term.write("".join(row + "\n" for row in rows))
        term.flush()
        self._drawn = len(rows)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:
        return False


#: the live block of this process's terminal (shared by every printer of partial lines)
TERMINAL = LiveLines()


def print_output(line: OutputLine) -> None:
    """Default output sink: ``[rank] text`` on the controller's stdout or stderr; in a terminal,
    each rank's unfinished line (a progress bar) is redrawn in place."""
    TERMINAL.show(line, f"[{line.rank}] {line.text}")


print_output.accepts_partial = True  # type: ignore[attr-defined]
