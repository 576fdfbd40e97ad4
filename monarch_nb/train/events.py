"""What the training thread of a run is told, by the threads that tell it. Runs in the controller.

The coordinator's training thread owns the run's state; every other thread only puts one of these
frozen values on its queue (``Coordinator.events``) and the training thread handles them in order:

- the actor runtime's callback threads: :class:`WindowAnswered`, :class:`EvalAnswered`,
  :class:`CheckpointAnswered` (a future of a call to a trainer is done);
- the supervisor thread (``Membership.supervise``): :class:`RankFailed`;
- the restart threads (``Membership._restart``, ``_restart_group``): :class:`RankReady`,
  :class:`RestartFailed`;
- any thread (``Coordinator.wake``: a stop, a fault planned from a notebook): :class:`Wake`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

__all__ = ["Wake", "WindowAnswered", "EvalAnswered", "CheckpointAnswered", "RankFailed", "RankReady",
           "RestartFailed", "RunEvent"]


@dataclass(frozen=True)
class Wake:
    """Look at the run's flags again (nothing else happened)."""


@dataclass(frozen=True)
class WindowAnswered:
    """``rank``'s ``run_window`` call of ``window`` (the coordinator's ``_Window``) is done: its
    reply or its error is in ``future``."""

    window: Any
    rank: int
    future: Any


@dataclass(frozen=True)
class EvalAnswered:
    """The evaluation after step ``step``, asked of ``rank``, is done (``future``)."""

    step: int
    rank: int
    future: Any


@dataclass(frozen=True)
class CheckpointAnswered:
    """The disk checkpoint before step ``next_step``, written by ``rank``, is done (``future``)."""

    next_step: int
    rank: int
    future: Any


@dataclass(frozen=True)
class RankFailed:
    """The supervisor saw ``rank``'s proc (pid ``pid``) fail: ``error`` (a SupervisionError)."""

    rank: int
    error: BaseException
    pid: int | None = None


@dataclass(frozen=True)
class RankReady:
    """``rank`` was restarted and set up: it waits to be healed and to join a quorum."""

    rank: int


@dataclass(frozen=True)
class RestartFailed:
    """Every restart attempt of ``rank`` failed (the last with ``error``): the run goes on without it."""

    rank: int
    error: BaseException | None = None


RunEvent = Union[Wake, WindowAnswered, EvalAnswered, CheckpointAnswered, RankFailed, RankReady, RestartFailed]
