"""The controller's side of a script run: one rendezvous round per attempt, the first failure
stops the rest at once, ``max_restarts`` whole-group restarts (torchrun's semantics).

Per attempt: a fresh rendezvous store for the mesh (``MASTER_PORT``), then every rank's
:class:`~.rank.ScriptRank` runs the script. The first rank that fails (raised, exited non-zero,
its proc died) decides the attempt (a survivor whose collective lost its peer is not the cause:
the peer's own failure, reported a moment later, is): every other rank still running has its proc restarted at
once (killed, and a warm spare or a fork of the host's fork server takes its place), so nobody
waits out a collective timeout. With restarts left the failed rank's proc is restarted too and
the group runs again; on the last attempt the failed rank's proc is kept, so its post-mortem is
there for ``%mesh debug RANK``. While a run is active, its procs' failures are the run's to
handle (a supervision owner), not reported as unhandled.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ActorError, MonarchError, SupervisionError, says_peer_gone
from .rank import ScriptExited, ScriptRank

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh

__all__ = ["ScriptFailed", "ScriptRun", "RankFailure", "run_script"]

_ACTOR = "spmd_script"
#: seconds a stopped rank's proc gets to come back (a restart on a warm spare or a fork takes well under one)
_RESTART_TIMEOUT_S = 60.0
#: how long a survivor's "peer gone" error waits for the peer's own failure, seconds (it comes in milliseconds)
_ROOT_CAUSE_WAIT_S = 1.0
#: how long a finished run waits for its ranks' last output lines, seconds (they take milliseconds)
_OUTPUT_WAIT_S = 2.0


@dataclass(frozen=True)
class RankFailure:
    """What failed an attempt: the first rank to fail and why.

    Attributes:
        attempt: 0 for the first run, 1 for the first restart, ...
        rank: the rank.
        error: its ActorError (it raised or exited non-zero) or SupervisionError (its proc died).
        at_s: seconds after the attempt started.
    """

    attempt: int
    rank: int
    error: BaseException
    at_s: float


@dataclass(frozen=True)
class ScriptRun:
    """A script run that ended with every rank done.

    Attributes:
        script: the script's absolute path. args: its arguments.
        world_size: ranks. attempts: runs of the whole group (1 + restarts used).
        seconds: from the call to the last rank's return. failures: one per failed attempt.
    """

    script: str
    args: tuple[str, ...]
    world_size: int
    attempts: int
    seconds: float
    failures: tuple[RankFailure, ...] = field(default=())


class ScriptFailed(MonarchError, RuntimeError):
    """Every attempt of a script run failed; ``failures`` says how (the last one's error is the
    cause, its tracebacks grouped by rank in ``str(err)``)."""

    def __init__(self, script: str, failures: Sequence[RankFailure]):
        self.script = script
        self.failures = tuple(failures)
        last = self.failures[-1]
        tries = f" (attempt {last.attempt + 1} of {len(self.failures)})" if len(self.failures) > 1 else ""
        super().__init__(f"{os.path.basename(script)} failed on rank {last.rank}{tries}:\n{last.error}")

    @property
    def exited(self) -> tuple[int, str] | None:
        """How the last attempt's failing rank ended when it was by ``sys.exit``: the status (its
        int, or 1 for a message, as ``python script.py`` would exit) and the message ("" for an
        int); None: it raised, or its proc died."""
        error = self.failures[-1].error
        return ScriptExited.read(error.remote) if isinstance(error, ActorError) else None


class _Owner:
    """The mesh's supervision owner while a script runs: failures of its procs are the run's."""

    def __init__(self) -> None:
        self.active = False

    def __supervise__(self, failure: Any) -> bool:
        return self.active


_owners: dict[tuple[str, str], _Owner] = {}
_actors: dict[tuple[str, str], Any] = {}  # (controller run id, mesh) -> its ScriptRank actor mesh
_lock = threading.Lock()


def run_script(procs: "ProcMesh", script: str, args: Sequence[str] = (), *, max_restarts: int = 0,
               timeout_s: float | None = None) -> ScriptRun:
    """Run ``script`` on every rank of ``procs`` as ``python script ARGS`` would (see the module docstring).

    Args:
        procs: the mesh (its procs stay up afterwards, for the next run).
        script: the script's path (made absolute here); on a host where it does not exist, the
            same file of the synced workspace (``procs.sync_workspace()``, ``%mesh sync``) runs.
        args: its command-line arguments.
        max_restarts: whole-group restarts after a failure (torchrun's ``--max-restarts``).
        timeout_s: give up on an attempt after this many seconds (None: no limit); a timeout is a failure.

    Returns:
        The :class:`ScriptRun` once every rank's script returned.

    Raises:
        FileNotFoundError: ``script`` does not exist here.
        ValueError: a negative ``max_restarts``.
        ScriptFailed: every attempt failed.
        KeyboardInterrupt: interrupted; every rank still running was stopped first.
    """
    from ..runtime.controller import Controller

    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no script {script!r} (looked for {path})")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    owner = _owner(procs)
    actors = _script_ranks(procs)
    ranks = actors.flatten("rank")
    world = len(Controller.get().mesh_records(procs.name))
    t0 = time.monotonic()
    failures: list[RankFailure] = []
    owner.active = True
    try:
        for attempt in range(max_restarts + 1):
            Controller.get().new_rendezvous_round(procs.name)
            failure = _attempt(procs, ranks, world, path, list(args), attempt, timeout_s, last=attempt == max_restarts)
            if failure is None:
                return ScriptRun(path, tuple(args), world, attempt + 1, time.monotonic() - t0, tuple(failures))
            failures.append(failure)
        raise ScriptFailed(path, failures)
    finally:
        owner.active = False


def _owner(procs: "ProcMesh") -> _Owner:
    with _lock:
        owner = _owners.get(_key(procs))
        if owner is None:
            owner = _owners[_key(procs)] = _Owner()
            procs.supervise("escalate", owner=owner)
    return owner


def _script_ranks(procs: "ProcMesh") -> Any:
    """The mesh's ScriptRank actors, spawned on its first run (a restarted proc gets its own again)."""
    with _lock:
        actors = _actors.get(_key(procs))
        if actors is None:
            actors = _actors[_key(procs)] = procs.spawn(_ACTOR, ScriptRank)
    actors.initialized.get()
    return actors


def _key(procs: "ProcMesh") -> tuple[str, str]:
    """A mesh across controllers (a new session's ``pm0`` is another mesh)."""
    from ..runtime.controller import Controller

    return Controller.get().run_id, procs.name


def _attempt(procs: "ProcMesh", ranks: Any, world: int, path: str, args: list[str], attempt: int,
             timeout_s: float | None, *, last: bool) -> RankFailure | None:
    """One run of the whole group; None when every rank returned, else the first failure."""
    t0 = time.monotonic()
    from ..runtime.controller import Controller

    cwd = os.getcwd()
    synced = Controller.get().workspaces.root  # a script inside it runs from each host's copy where the path is not there
    done: "queue.SimpleQueue[tuple[int, Any]]" = queue.SimpleQueue()
    seen = _LinesSeen(procs.name)
    for r in range(world):
        future = ranks.slice(rank=r).run.call_one(path, args, cwd, synced)
        future.add_done_callback(lambda f, r=r: done.put((r, f.exception(0) or f.get(0))))
    running = set(range(world))
    printed: dict[int, int] = {}
    try:
        while running:
            left = None if timeout_s is None else timeout_s - (time.monotonic() - t0)
            try:
                rank, answer = done.get(timeout=None if left is None else max(0.0, left))
            except queue.Empty:
                rank, answer = min(running), TimeoutError(f"the script did not end within {timeout_s} s")
            running.discard(rank)
            if not isinstance(answer, BaseException):
                printed[rank] = int(answer)
                continue
            failure = _root_cause(RankFailure(attempt, rank, answer, time.monotonic() - t0), done, running, t0)
            running.discard(failure.rank)
            keep = {failure.rank} if last and isinstance(failure.error, ActorError) else set()  # its post-mortem, for %mesh debug
            _restart(procs, (running | {rank, failure.rank}) - keep)
            return failure
        seen.wait_for(printed, _OUTPUT_WAIT_S)
        return None
    except KeyboardInterrupt:
        _restart(procs, running)
        raise
    finally:
        seen.close()


def _root_cause(first: RankFailure, done: "queue.SimpleQueue[tuple[int, Any]]", running: set[int], t0: float) -> RankFailure:
    """The failure that caused ``first``: a survivor's collective that lost its peer (gloo's
    "Connection closed by peer") often answers before the peer's death is reported; then the
    death (or another rank's own error) that comes within ``_ROOT_CAUSE_WAIT_S`` is the cause."""
    if not _lost_a_peer(first.error):
        return first
    deadline = time.monotonic() + _ROOT_CAUSE_WAIT_S
    while running:
        try:
            rank, answer = done.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        running.discard(rank)
        if isinstance(answer, BaseException) and not _lost_a_peer(answer):
            return RankFailure(first.attempt, rank, answer, time.monotonic() - t0)
    return first


def _lost_a_peer(error: BaseException) -> bool:
    return isinstance(error, ActorError) and says_peer_gone(error.remote.get("message", ""))


class _LinesSeen:
    """Counts the whole output lines the controller received from each rank of ``mesh`` (an
    output sink, while an attempt runs): the script's last lines are shown before its end."""

    def __init__(self, mesh: str):
        from ..runtime.controller import Controller

        self.mesh = mesh
        self.counts: dict[int, int] = {}
        self.cond = threading.Condition()
        self._sinks = Controller.get().output_sinks
        self._sinks.append(self)

    def __call__(self, line: Any) -> None:
        if line.mesh == self.mesh:
            with self.cond:
                self.counts[line.rank] = self.counts.get(line.rank, 0) + 1
                self.cond.notify_all()

    def close(self) -> None:
        if self in self._sinks:
            self._sinks.remove(self)

    def wait_for(self, printed: dict[int, int], timeout_s: float) -> None:
        """Until each rank's ``printed`` lines arrived (they travel through its host agent, the
        reply straight from the proc), at most ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(self.counts.get(r, 0) < n for r, n in printed.items()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)


def _restart(procs: "ProcMesh", ranks: set[int]) -> None:
    """Restart the procs of ``ranks`` at once, in parallel (each kill releases its peers' collectives)."""
    if not ranks:
        return
    with ThreadPoolExecutor(len(ranks), thread_name_prefix="monarch_nb-spmd-restart") as pool:
        for done in [pool.submit(procs.restart, r, _RESTART_TIMEOUT_S) for r in sorted(ranks)]:
            try:
                done.result()
            except SupervisionError:  # died again while coming back: the next attempt's call says so
                pass
