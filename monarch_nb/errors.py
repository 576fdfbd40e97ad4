"""Every error type monarch_nb raises at the caller, in one place.

Remote errors render well in IPython: they implement ``_render_traceback_`` so a failure on a
rank prints as that rank's own traceback (with the source lines of notebook-cell code, which the
controller's linecache holds) instead of a wall of wrapper frames.
"""

from __future__ import annotations

import linecache
import traceback
from typing import Iterable, Mapping

__all__ = [
    "MonarchError",
    "ActorError",
    "SupervisionError",
    "MeshStoppedError",
    "UnknownEndpointError",
    "format_remote_traceback",
    "capture_traceback",
    "rank_ranges",
    "group_identical",
]


class MonarchError(Exception):
    """Base of monarch_nb's errors."""


def capture_traceback(exc: BaseException) -> dict:
    """Plain-data form of ``exc`` and its traceback, to send to the caller.

    Returns a dict with ``type``, ``message`` and ``frames`` (a list of
    ``[filename, lineno, function, source line or None]``), outermost frame first, chained causes
    under ``cause``.
    """
    frames = [
        [f.filename, f.lineno, f.name, f.line or None] for f in traceback.extract_tb(exc.__traceback__)
    ]
    info = {"type": type(exc).__qualname__, "module": type(exc).__module__, "message": str(exc), "frames": frames}
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and cause is not exc:
        info["cause"] = capture_traceback(cause)
    return info


def format_remote_traceback(info: dict) -> str:
    """Render :func:`capture_traceback`'s dict like Python's own traceback.

    Source lines missing on the remote side (code defined in a notebook cell) are looked up in
    this process's linecache, where IPython keeps every cell.
    """
    parts = []
    if "cause" in info:
        parts.append(format_remote_traceback(info["cause"]))
        parts.append("\nThe above exception was the direct cause of the following exception:\n\n")
    lines = ["Traceback (most recent call last):\n"]
    for filename, lineno, name, line in info.get("frames", []):
        lines.append(f'  File "{filename}", line {lineno}, in {name}\n')
        line = line or linecache.getline(filename, lineno).strip()
        if line:
            lines.append(f"    {line}\n")
    exc_name = info.get("type", "Exception")
    message = info.get("message", "")
    lines.append(f"{exc_name}: {message}\n" if message else f"{exc_name}\n")
    parts.append("".join(lines))
    return "".join(parts)


def rank_ranges(ranks: "Iterable[int]") -> str:
    """Ranks as compact ranges: ``[0, 1, 2, 5]`` -> ``"0-2,5"`` (sorted, duplicates dropped)."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for rank in ordered + [None]:  # a sentinel closes the last run
        if rank is not None and prev is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = rank
    return ",".join(parts)


def group_identical(texts: "Mapping[int, str]") -> list[tuple[list[int], str]]:
    """Ranks whose texts (rendered tracebacks) are identical, grouped: ``[(ranks, text), ...]``.

    Groups come in the order of their first rank; ranks within a group are sorted. Four ranks
    that raised the same error in the same place give one group, shown once as ``ranks 0-3:``.
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


class ActorError(MonarchError):
    """An endpoint raised on a rank.

    Attributes:
        rank: flat rank of the actor that raised (int).
        coords: its coordinates (dict of dim -> index).
        actor: the actor mesh's name.
        endpoint: the endpoint name.
        remote: the plain-data traceback (see :func:`capture_traceback`).
        exception_type: the remote exception's class name, e.g. ``"ValueError"``.
        others: further ``ActorError``s of the same call (other ranks), possibly empty.
    """

    def __init__(self, rank: int, coords: dict, actor: str, endpoint: str, remote: dict):
        self.rank = rank
        self.coords = dict(coords)
        self.actor = actor
        self.endpoint = endpoint
        self.remote = remote
        self.exception_type = remote.get("type", "Exception")
        self.others: list[ActorError] = []
        super().__init__(self._headline())

    def _headline(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.coords.items())
        return (
            f"{self.actor}.{self.endpoint} failed on rank {self.rank}"
            f"{f' ({where})' if where else ''}: {self.exception_type}: {self.remote.get('message', '')}"
        )

    def __str__(self) -> str:
        more = f"\n(+{len(self.others)} more rank(s) failed: {sorted(e.rank for e in self.others)})" if self.others else ""
        return f"{self._headline()}\n\nRemote traceback (rank {self.rank}):\n{format_remote_traceback(self.remote)}{more}"

    def _render_traceback_(self) -> list[str]:
        out = [f"ActorError: {self._headline()}", f"--- rank {self.rank} ---"]
        out += format_remote_traceback(self.remote).rstrip("\n").split("\n")
        for other in self.others[:3]:
            out.append(f"--- rank {other.rank} ---")
            out += format_remote_traceback(other.remote).rstrip("\n").split("\n")
        if len(self.others) > 3:
            out.append(f"... and {len(self.others) - 3} more rank(s)")
        return out

    def __reduce__(self):
        return _rebuild_actor_error, (self.rank, self.coords, self.actor, self.endpoint, self.remote, self.others)


def _rebuild_actor_error(rank, coords, actor, endpoint, remote, others) -> ActorError:
    err = ActorError(rank, coords, actor, endpoint, remote)
    err.others = list(others)
    return err


class SupervisionError(MonarchError):
    """A call could not complete because the proc holding the actor failed.

    Attributes:
        rank: the failed proc's flat rank.
        cause: what happened: ``"killed"``, ``"exited"``, ``"hung"``, ``"stopped"``, ...
        signal: the signal name that ended the proc (``"SIGKILL"``) or None.
        detail: a human-readable description.
    """

    def __init__(self, rank: int, cause: str, detail: str = "", signal: str | None = None):
        self.rank = rank
        self.cause = cause
        self.signal = signal
        self.detail = detail
        sig = f", signal {signal}" if signal and signal != cause else ""
        super().__init__(f"rank {rank} failed ({cause}{sig}){': ' + detail if detail else ''}")

    def __reduce__(self):
        return SupervisionError, (self.rank, self.cause, self.detail, self.signal)


class MeshStoppedError(MonarchError):
    """The mesh was stopped; spawn a new one with ``this_host().spawn_procs(...)``."""


class UnknownEndpointError(MonarchError, AttributeError):
    """The actor class has no endpoint of that name."""


def error_from_reply(info: dict, rank: int, coords: dict, actor: str, endpoint: str) -> BaseException:
    """The exception a caller sees for an error reply ``info`` (built by the proc)."""
    if info.get("supervision"):
        return SupervisionError(rank, info.get("cause", "failed"), info.get("detail", ""), info.get("signal"))
    return ActorError(rank, coords, actor, endpoint, info)
