"""How a failed ``%%mesh`` cell reads: per-rank remote tracebacks, identical ones grouped, and a summary."""

from __future__ import annotations

from typing import Any

from ..errors import SupervisionError, format_remote_traceback, group_identical
from .ranks import format_ranks

__all__ = ["MeshCellError", "render_error", "error_line"]

#: how many distinct tracebacks an error shows before the summary line
TRACEBACKS_SHOWN = 3


class MeshCellError(Exception):
    """A ``%%mesh`` cell failed on some ranks. Renders as remote tracebacks + a summary.

    Ranks whose tracebacks are identical (a constructor or a line that fails the same way on
    every rank) are shown once, under ``[ranks 0-3:traceback]``.

    Attributes:
        errors: rank -> the remote traceback dict (or a SupervisionError for a dead proc).
        selected: the ranks the cell ran on.
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
        groups = group_identical({rank: render_error(self.errors[rank]) for rank in shown})
        for ranks, text in groups[:TRACEBACKS_SHOWN]:
            label = str(ranks[0]) if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            out.append(f"[{label}:traceback]")
            out += text.rstrip("\n").split("\n")
        if len(groups) > TRACEBACKS_SHOWN:
            rest = sorted(r for ranks, _ in groups[TRACEBACKS_SHOWN:] for r in ranks)
            out.append(f"... {len(rest)} more rank(s) failed otherwise: {format_ranks(rest)}")
        out.append(f"MeshCellError: {self.summary()}")
        return out

    def __str__(self) -> str:
        return self.summary()


def _error_type(error: Any) -> str:
    if isinstance(error, BaseException):
        return type(error).__name__
    return error.get("type", "Exception")


def error_line(error: Any) -> str:
    """One rank's error in one line, ``Type: message``: the last line of :func:`render_error`."""
    return render_error(error).rstrip("\n").rsplit("\n", 1)[-1]


def render_error(error: Any) -> str:
    """One rank's error as text: a remote traceback, or the line of a local error (a dead proc)."""
    if isinstance(error, SupervisionError):
        return f"SupervisionError: {error}\n"
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}\n"
    if not error.get("frames") and error.get("type") == "SyntaxError":
        return f"SyntaxError: {error.get('message', '')}\n"
    return format_remote_traceback(error)
