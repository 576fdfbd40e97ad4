"""Chaos schedules: faults injected at random times, reproducibly from a seed.

A :class:`ChaosSchedule` draws exponential inter-arrival times with mean ``mtbf_s`` (a Poisson
process: failures with a mean time between them of ``mtbf_s`` seconds), and for each arrival a
rank and a fault kind, all from ``random.Random(seed)``; the same seed gives the same sequence.
:meth:`ChaosSchedule.start` injects them into a proc mesh from a background thread until
:meth:`~ChaosSchedule.stop`, ``max_faults`` or ``duration_s``. A planned fault whose rank is not
alive at its time (already dead, restarting) is recorded as skipped, so the plan stays the same
whatever the mesh's state::

    chaos = ChaosSchedule(mtbf_s=30, kinds=("kill", "hang"), seed=7).start(procs)
    ...                                   # train; the supervision tree shows the faults
    chaos.stop()
    chaos.injected                        # [ChaosFault(at_s=21.4, rank=2, kind='kill', ...), ...]
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..runtime.protocol import FAULT_KINDS, validate_fault

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh

__all__ = ["ChaosSchedule", "ChaosFault"]

log = logging.getLogger(__name__)


@dataclass
class ChaosFault:
    """One planned fault.

    Attributes:
        at_s: seconds after the schedule started when it is due.
        rank: the target's flat rank.
        kind: the fault kind.
        params: its parameters.
        status: "planned", "injected" or "skipped".
        error: why it was skipped ("" otherwise).
        injected_at_s: seconds after start when it was injected (None unless injected).
    """

    at_s: float
    rank: int
    kind: str
    params: dict = field(default_factory=dict)
    status: str = "planned"
    error: str = ""
    injected_at_s: float | None = None

    def key(self) -> tuple:
        """(at_s, rank, kind): what the seed decides."""
        return (round(self.at_s, 9), self.rank, self.kind)


class ChaosSchedule:
    """Random faults with mean time between failures ``mtbf_s``, reproducible from ``seed``.

    Args:
        mtbf_s: mean seconds between faults (> 0).
        kinds: fault kinds to draw from, uniformly (see :data:`~monarch_nb.runtime.protocol.FAULT_KINDS`).
        seed: the random seed; the same seed gives the same times, ranks and kinds.
        ranks: flat ranks to draw from; None for every rank of the mesh (or slice) given to
            :meth:`start` (:meth:`plan` then needs ``world``).
        params: per-kind parameters, e.g. ``{"slow": {"ms": 50}, "stall": {"seconds": 3}}``.
        max_faults: stop after this many planned faults (None: no limit).
        duration_s: stop this many seconds after start (None: no limit).

    Raises:
        ValueError: ``mtbf_s`` not positive, an unknown kind, bad params, empty ``ranks``.
    """

    def __init__(
        self,
        mtbf_s: float,
        kinds: Sequence[str] = ("kill",),
        seed: int = 0,
        ranks: Sequence[int] | None = None,
        *,
        params: dict[str, dict[str, Any]] | None = None,
        max_faults: int | None = None,
        duration_s: float | None = None,
    ):
        if isinstance(mtbf_s, bool) or not isinstance(mtbf_s, (int, float)) or not mtbf_s > 0:
            raise ValueError(f"mtbf_s must be a positive number of seconds, got {mtbf_s!r}")
        kinds = tuple(kinds)
        if not kinds:
            raise ValueError("kinds must name at least one fault kind")
        params = dict(params or {})
        for kind in kinds:
            validate_fault(kind, params.get(kind, {}))  # raises ValueError for unknown kinds / bad params
        extra = set(params) - set(kinds)
        if extra:
            raise ValueError(f"params given for kinds not in kinds: {sorted(extra)}")
        if ranks is not None:
            ranks = tuple(ranks)
            if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
                raise ValueError(f"ranks must be a non-empty list of ints >= 0, got {ranks!r}")
        for name, value in (("max_faults", max_faults), ("duration_s", duration_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be a non-negative number or None, got {value!r}")
        self.mtbf_s = float(mtbf_s)
        self.kinds = kinds
        self.seed = seed
        self.ranks = ranks
        self.params = params
        self.max_faults = max_faults
        self.duration_s = duration_s
        self.faults: list[ChaosFault] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- the plan (pure) ------------------------------------------------------------------------
    def plan(self, n: int, world: int | None = None) -> list[ChaosFault]:
        """The first ``n`` faults this schedule draws (nothing is injected); ``world``: ranks
        0..world-1 when the schedule has no ``ranks``.

        Raises:
            ValueError: ``ranks`` is None and ``world`` is not given.
        """
        return [fault for _, fault in zip(range(n), self._draws(tuple(range(world)) if world else None))]

    def _draws(self, default_ranks: tuple | None):
        ranks = self.ranks if self.ranks is not None else default_ranks
        if not ranks:
            raise ValueError("the schedule has no ranks: give ranks=... or world=...")
        rng = random.Random(self.seed)
        at = 0.0
        while True:
            at += rng.expovariate(1.0 / self.mtbf_s)
            rank = rng.choice(ranks)
            kind = rng.choice(self.kinds)
            yield ChaosFault(at, rank, kind, {**FAULT_KINDS[kind].params, **self.params.get(kind, {})})

    # -- running ------------------------------------------------------------------------------
    def start(self, procs: "ProcMesh") -> "ChaosSchedule":
        """Inject the planned faults into ``procs`` from a background thread; returns self.

        Raises:
            RuntimeError: already started.
            ValueError: a rank in ``ranks`` is not in ``procs``.
        """
        if self._thread is not None:
            raise RuntimeError("this chaos schedule was already started; make a new one to run again")
        members = tuple(procs._shape.ranks)
        bad = [r for r in (self.ranks or ()) if r not in members]
        if bad:
            raise ValueError(f"ranks {bad} are not in the proc mesh (its ranks: {list(members)})")
        draws = self._draws(members)
        self._thread = threading.Thread(target=self._run, args=(procs, draws), name="monarch_nb-chaos", daemon=True)
        self._thread.start()
        return self

    def _run(self, procs: "ProcMesh", draws) -> None:
        start = time.monotonic()
        for count, fault in enumerate(draws):
            if self.max_faults is not None and count >= self.max_faults:
                break
            if self.duration_s is not None and fault.at_s > self.duration_s:
                break
            if self._stop.wait(max(0.0, start + fault.at_s - time.monotonic())):
                break
            try:
                procs.inject(fault.rank, fault.kind, **self.params.get(fault.kind, {}))
                fault.status, fault.injected_at_s = "injected", round(time.monotonic() - start, 6)
            except (RuntimeError, ValueError) as exc:  # not alive now, mesh stopped: skip, keep the plan
                fault.status, fault.error = "skipped", str(exc)
            except Exception as exc:  # never let chaos kill the kernel's thread silently
                log.exception("chaos: injecting %s into rank %d failed", fault.kind, fault.rank)
                fault.status, fault.error = "skipped", f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.faults.append(fault)
        self._stop.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop injecting (idempotent); waits up to ``timeout_s`` for the thread to end."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the schedule ends by itself (``max_faults`` / ``duration_s``) or is stopped;
        True if it ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def injected(self) -> list[ChaosFault]:
        """The faults injected so far, in order."""
        with self._lock:
            return [f for f in self.faults if f.status == "injected"]

    def history(self) -> list[ChaosFault]:
        """Every fault whose time has come (injected or skipped), in order."""
        with self._lock:
            return list(self.faults)

    def __enter__(self) -> "ChaosSchedule":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<ChaosSchedule mtbf_s={self.mtbf_s} kinds={list(self.kinds)} seed={self.seed} injected={len(self.injected)}>"
