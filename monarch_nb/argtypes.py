"""argparse value types shared by the ``monarch-nb`` command and the ``%mesh`` magics."""

from __future__ import annotations

import argparse
from typing import Callable, TypeVar

__all__ = ["positive_int", "nonneg_int", "positive_float"]


N = TypeVar("N", int, float)


def _number(text: str, kind: Callable[[str], N], what: str, ok: Callable[[N], bool]) -> N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count: procs, steps, lines)."""
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def nonneg_int(text: str) -> int:
    """An integer >= 0 (a rank)."""
    return _number(text, int, "a rank (an integer >= 0)", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A number > 0 (seconds, a learning rate)."""
    return _number(text, float, "a positive number", lambda v: v > 0)
