"""Every error type monarch_nb raises at the caller, in one place.

Remote errors render well in IPython: they implement ``_render_traceback_`` so a failure on a
rank prints as that rank's own traceback (with the source lines of notebook-cell code, which the
controller's linecache holds) instead of a wall of wrapper frames; ranks that failed with the
same traceback are printed once, under "ranks 0-3:".

Capturing an error on a rank never fails: an exception whose ``__str__`` or ``__repr__`` raises,
that cannot be pickled, or whose cause or context does either, is still described (type name and
``<str() failed>``, as Python's traceback module does), so the caller always gets its reply.
"""

from __future__ import annotations

import linecache
import os
import traceback
from typing import Any, Iterable, Mapping

__all__ = [
    "MonarchError",
    "ActorError",
    "SupervisionError",
    "MeshStoppedError",
    "UnknownEndpointError",
    "format_remote_traceback",
    "capture_traceback",
    "format_ranks",
    "says_peer_gone",
    "group_identical",
]

#: Frames from these folders above the user's code are the runtime's own: not shown remotely.
_RUNTIME_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), d) + os.sep for d in ("runtime", "actor")
)


class MonarchError(Exception):
    """Base of monarch_nb's errors."""


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except BaseException:  # noqa: BLE001 - any failure of a user's __str__
        return "<str() failed>"


def _safe_frames(tb) -> list:
    try:
        frames: list[list[Any]] = [[f.filename, f.lineno, f.name, f.line or None] for f in traceback.extract_tb(tb)]
    except BaseException:  # noqa: BLE001 - a broken loader or linecache entry
        return []
    while len(frames) > 1 and frames[0][0].startswith(_RUNTIME_DIRS):  # runtime frames above the user's code
        frames.pop(0)
    return frames


def capture_traceback(exc: BaseException, _depth: int = 0) -> dict:
    """Plain-data form of ``exc`` and its traceback, to send to the caller. Never raises.

    Returns a dict with ``type``, ``module``, ``message`` and ``frames`` (a list of
    ``[filename, lineno, function, source line or None]``, outermost frame first, the runtime's
    own frames above the user's code left out); the exception it was raised from under ``cause``
    with ``chain`` ``"cause"`` (``raise ... from``) or ``"context"`` (raised while handling it).
    """
    kind = type(exc)
    info = {
        "type": getattr(kind, "__qualname__", "Exception"),
        "module": getattr(kind, "__module__", ""),
        "message": _safe_str(exc),
        "frames": _safe_frames(exc.__traceback__),
    }
    try:
        if exc.__cause__ is not None:
            linked, chain = exc.__cause__, "cause"
        elif exc.__context__ is not None and not exc.__suppress_context__:
            linked, chain = exc.__context__, "context"
        else:
            linked, chain = None, ""
    except BaseException:  # noqa: BLE001
        linked, chain = None, ""
    if linked is not None and linked is not exc and _depth < 20:
        info["cause"] = capture_traceback(linked, _depth + 1)
        info["chain"] = chain
    return info


_CHAIN_LINES = {
    "cause": "\nThe above exception was the direct cause of the following exception:\n\n",
    "context": "\nDuring handling of the above exception, another exception occurred:\n\n",
}
_REMOTE_HEADER = "Traceback of where the remote call failed (most recent call last):\n"


def format_remote_traceback(info: dict) -> str:
    """Render :func:`capture_traceback`'s dict like Python's own traceback (both chain kinds).

    Source lines missing on the remote side (code defined in a notebook cell) are looked up in
    this process's linecache, where IPython keeps every cell.
    """
    parts = []
    if "cause" in info:
        parts.append(format_remote_traceback(info["cause"]))
        parts.append(_CHAIN_LINES.get(info.get("chain", "cause"), _CHAIN_LINES["cause"]))
    lines = [_REMOTE_HEADER] if info.get("frames") else []
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


#: how torch's gloo and NCCL backends say that a peer of a collective is gone (their errors are
#: plain RuntimeErrors, or torch.distributed.DistError subclasses in newer builds)
PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
                     "Timed out waiting", "ProcessGroupNCCL")


def says_peer_gone(message: str) -> bool:
    """True if an error's ``message`` is a collective's backend saying a peer is gone (see
    :data:`PEER_GONE_MARKERS`): the rank that raised it is a survivor, not the cause."""
    return any(marker in message for marker in PEER_GONE_MARKERS)


def format_ranks(ranks: "Iterable[int]") -> str:
    """Ranks as compact ranges: ``[0, 1, 2, 3, 5]`` -> ``"0-3,5"`` (sorted, duplicates dropped)."""
    ranks = sorted(set(ranks))
    spans: list[str] = []
    start: int | None = None
    prev: int | None = None
    for r in [*ranks, None]:
        if start is not None and prev is not None and (r is None or r != prev + 1):  # (prev is set with start)
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ",".join(spans)


def group_identical(texts: "Mapping[int, str]") -> list[tuple[list[int], str]]:
    """Ranks whose texts (rendered tracebacks, stacks) are identical, grouped: ``[(ranks, text), ...]``.

    Groups come in the order of their first rank; ranks within a group are sorted. Four ranks
    that raised the same error in the same place give one group, shown once as ``ranks 0-3:``.
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


class ActorError(MonarchError):
    """An endpoint raised on a rank.

    ``str(err)`` starts with ``"Actor call <mesh>.<endpoint> failed"`` (as in Monarch) and holds
    the remote traceback, with both kinds of chained exception; ranks whose tracebacks are
    identical are shown once, under ``ranks 0-3:``.

    Attributes:
        rank: flat rank of the actor that raised (int).
        coords: its coordinates (dict of dim -> index).
        actor: the actor mesh's name.
        endpoint: the endpoint name.
        remote: the plain-data traceback (see :func:`capture_traceback`).
        exception_type: the remote exception's class name, e.g. ``"ValueError"``.
        message: the first line, ``"Actor call <mesh>.<endpoint> failed ..."``.
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

    @property
    def message(self) -> str:
        return self._headline()

    @property
    def exception(self) -> BaseException:
        """A local stand-in of the remote exception: its type name and message (the original
        object stays on the rank; tracebacks of both are in ``str(err)``)."""
        return RemoteException(f"{self.exception_type}: {self.remote.get('message', '')}")

    def _headline(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.coords.items())
        return (
            f"Actor call {self.actor}.{self.endpoint} failed on rank {self.rank}"
            f"{f' ({where})' if where else ''}: {self.exception_type}: {self.remote.get('message', '')}"
        )

    def _groups(self) -> list[tuple[list[int], str]]:
        """(ranks, traceback text) with identical tracebacks merged, first rank first."""
        groups: dict[str, list[int]] = {}
        for err in [self, *self.others]:
            groups.setdefault(format_remote_traceback(err.remote), []).append(err.rank)
        return [(ranks, text) for text, ranks in groups.items()]

    def __str__(self) -> str:
        out = [self._headline()]
        for ranks, text in self._groups():
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            out.append(f"\n{label}:\n{text}")
        return "\n".join(out)

    def _render_traceback_(self) -> list[str]:
        out = [f"ActorError: {self._headline()}"]
        groups = self._groups()
        for ranks, text in groups[:4]:
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            out.append(f"--- {label}: ---")
            out += text.rstrip("\n").split("\n")
        if len(groups) > 4:
            out.append(f"... and {len(groups) - 4} more distinct traceback(s)")
        return out

    def __reduce__(self):
        return _rebuild_actor_error, (self.rank, self.coords, self.actor, self.endpoint, self.remote, self.others)


class RemoteException(Exception):
    """Stands for an exception raised on a rank (see :attr:`ActorError.exception`)."""


def _rebuild_actor_error(rank, coords, actor, endpoint, remote, others) -> ActorError:
    err = ActorError(rank, coords, actor, endpoint, remote)
    err.others = list(others)
    return err


class SupervisionError(MonarchError, RuntimeError):
    """A call could not complete because the actor, or the proc holding it, failed or was stopped.

    The message reads ``"Endpoint call <mesh>.<endpoint>() failed, <what happened>"`` when it is
    about a call (as Monarch's); for an actor failure, what happened is the failure's report
    (``"The actor <...> and all its descendants have failed: ..."``), for a proc failure
    ``"rank R failed (<cause>)"``.

    Attributes:
        rank: the failed proc's (or actor's) flat rank.
        cause: what happened: ``"killed"``, ``"exited"``, ``"hung"``, ``"stopped"``, ``"actor failed"``, ...
        signal: the signal name that ended the proc (``"SIGKILL"``) or None.
        detail: a human-readable description.
        call: ``"<mesh>.<endpoint>"`` of the call that failed, or None.
        report: the actor failure's report, or None.
    """

    def __init__(self, rank: int, cause: str, detail: str = "", signal: str | None = None,
                 call: str | None = None, report: str | None = None, actor: str | None = None):
        self.rank = rank
        self.cause = cause
        self.signal = signal
        self.detail = detail
        self.call = call
        self.report = report
        sig = f", signal {signal}" if signal and signal != cause else ""
        what = report or f"rank {rank} failed ({cause}{sig}){': ' + detail if detail else ''}"
        if actor and not report:  # a call to an actor whose proc failed: say so as Monarch does
            what = (f"The actor {actor} and all its descendants have failed:\n  the process this actor was running on "
                    f"failed: {what}")
        self.actor = actor
        super().__init__(f"Endpoint call {call}() failed, {what}" if call else what)

    def __reduce__(self):
        return SupervisionError, (self.rank, self.cause, self.detail, self.signal, self.call, self.report, self.actor)


class MeshStoppedError(SupervisionError):
    """The mesh was stopped (```ProcMesh` has already been stopped``); spawn a new one with
    ``this_host().spawn_procs(...)``. A SupervisionError (and a RuntimeError), as in Monarch."""

    def __init__(self, message: str):
        MonarchError.__init__(self, message)
        self.rank, self.cause, self.signal, self.detail, self.call, self.report = -1, "stopped", None, message, None, None

    def __reduce__(self):
        return MeshStoppedError, (str(self),)


class UnknownEndpointError(MonarchError, AttributeError):
    """The actor class has no endpoint of that name."""


def error_from_reply(info: dict, rank: int, coords: dict, actor: str, endpoint: str) -> BaseException:
    """The exception a caller sees for an error reply ``info`` (built by the proc)."""
    if info.get("supervision"):
        return SupervisionError(rank, info.get("cause", "failed"), info.get("detail", ""), info.get("signal"),
                                f"{actor}.{endpoint}", info.get("report"))
    return ActorError(rank, coords, actor, endpoint, info)
