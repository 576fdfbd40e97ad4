"""Procs' stdout/stderr on the controller: bytes from host agents become lines, handed to sinks.

Host agents forward what procs write as byte chunks (``output`` messages, in order per proc and
stream). :class:`LineAssembler` turns them into lines, decoding UTF-8 across chunk edges, and
each line goes to every sink in ``Controller.output_sinks`` as an :class:`OutputLine`. The
default sink, :func:`print_output`, prints ``[rank] text``; ``%%mesh`` replaces it with a router
that sends each line to the cell it belongs to.
"""

from __future__ import annotations

import codecs
import sys
from dataclasses import dataclass

__all__ = ["OutputLine", "LineAssembler", "print_output"]


@dataclass
class OutputLine:
    """One line a proc wrote. ``stream`` is "stdout" or "stderr"; ``text`` has no newline."""

    mesh: str
    rank: int
    stream: str
    text: str


class LineAssembler:
    """Turns (proc, stream) byte chunks into whole lines, decoding UTF-8 across chunk edges."""

    def __init__(self) -> None:
        self._decoders: dict = {}
        self._partial: dict = {}

    def feed(self, key: tuple, data: bytes) -> list[str]:
        """The lines that ``data`` completes for ``key``; a trailing partial line is kept."""
        decoder = self._decoders.setdefault(key, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        text = self._partial.pop(key, "") + decoder.decode(data)
        lines = text.split("\n")
        if lines[-1]:
            self._partial[key] = lines[-1]
        return lines[:-1]

    def flush(self, key: tuple) -> list[str]:
        """The partial line kept for ``key`` (the proc exited), as a list of zero or one line."""
        decoder = self._decoders.pop(key, None)
        rest = self._partial.pop(key, "") + (decoder.decode(b"", final=True) if decoder else "")
        return [rest] if rest else []


def print_output(line: OutputLine) -> None:
    """Default output sink: ``[rank] text`` on the controller's stdout or stderr."""
    stream = sys.stderr if line.stream == "stderr" else sys.stdout
    print(f"[{line.rank}] {line.text}", file=stream, flush=True)
