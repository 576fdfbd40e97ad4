"""The membership's state machine against a fake backend: failures, restarts, replica groups,
quorums. No processes: the trainers' endpoints return futures that the fake resolves (as torchft
tests its Manager), the procs are a fake :class:`~monarch_nb.train.rank_procs.RankProcs`, the
rendezvous store a dict."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from monarch_nb.actor.future import Future
from monarch_nb.errors import ActorError, SupervisionError
from monarch_nb.supervision.records import ProcState
from monarch_nb.train.events import RankReady, RestartFailed, RunEvent
from monarch_nb.train.recovery import Membership, RankState, TrainingError, own_failure


class FakeRun:
    """What the membership uses of a TrainingRun: options, the lock, the stop, the records."""

    def __init__(self, group_size: int = 1):
        self.options = SimpleNamespace(restart_timeout_s=2.0, collective_timeout_s=1.0, group_size=group_size)
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.step = 7
        self.recorded: list[tuple[str, int, str]] = []  # (event, rank, kind)

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def recovery(self, event: str, rec: Any, at: float) -> None:
        self.recorded.append((event, rec.rank, rec.kind))

    def phase(self, name: str, **detail: Any) -> None:
        pass


class FakeProcs:
    """A RankProcs whose restarts succeed unless told to fail."""

    name = "pm0"

    def __init__(self) -> None:
        self.restarted: list[int] = []
        self.failing: set[int] = set()  # ranks whose restarts raise
        self.deaths: dict[tuple[int, int], SupervisionError] = {}  # (rank, pid) -> its own death, heard during a restart

    def restart(self, rank: int, timeout_s: float) -> None:
        self.restarted.append(rank)
        if rank in self.failing:
            raise RuntimeError(f"proc pm0.{rank} exited (exit 1); its output: ImportError")

    def pid(self, rank: int) -> int | None:
        return 1000 + rank

    def state(self, rank: int) -> ProcState:
        return ProcState.HEALTHY

    def host_serving(self, rank: int) -> bool:
        return True

    def own_exit(self, rank: int, pid: int) -> SupervisionError | None:
        return self.deaths.get((rank, pid))


def actor_error(rank: int, exception_type: str) -> ActorError:
    return ActorError(rank, {"rank": rank}, "trainer", "init_quorum", {"type": exception_type, "message": "", "frames": []})


class FakeTrainer:
    """A rank's trainer: each endpoint answers through ``rules[name](*args)`` (a value, or an
    exception to fail with, or a Future left for the test to resolve)."""

    def __init__(self, rank: int, rules: dict[str, Callable[..., Any]]):
        self.rank = rank
        self.calls: list[tuple[str, tuple]] = []
        for name, rule in rules.items():
            setattr(self, name, SimpleNamespace(call_one=self._endpoint(name, rule)))

    def _endpoint(self, name: str, rule: Callable[..., Any]) -> Callable[..., Future]:
        def call_one(*args: Any) -> Future:
            self.calls.append((name, args))
            outcome = rule(self.rank, *args)
            if isinstance(outcome, Future):
                return outcome
            if isinstance(outcome, BaseException):
                return Future.completed(error=outcome)
            return Future.completed(outcome)
        return call_one


class Barrier:
    """The rendezvous store of a quorum: ``init_quorum`` blocks until every member arrived, or
    fails with QuorumAborted when the controller sets the abort key (as the real trainers do)."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.waiting: dict[int, list[tuple[int, concurrent.futures.Future]]] = {}
        self.dead: set[int] = set()  # ranks whose init_quorum fails as a crash

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value
        quorum = int(key.removeprefix("quorum").split("/")[0])
        for rank, inner in self.waiting.pop(quorum, []):
            inner.set_exception(actor_error(rank, "QuorumAborted"))

    def init_quorum(self, rank: int, quorum: int, ranks: list[int], source: int | None) -> Any:
        if rank in self.dead:
            return SupervisionError(rank, "killed", signal="SIGKILL")
        inner: concurrent.futures.Future = concurrent.futures.Future()
        arrived = self.waiting.setdefault(quorum, [])
        arrived.append((rank, inner))
        alive = [r for r in ranks if r not in self.dead]
        if len(arrived) == len(alive) == len(ranks):
            for _, f in self.waiting.pop(quorum):
                f.set_result({"quorum": quorum})
        return Future(inner)


def membership(ranks: int = 4, group_size: int = 1, *, barrier: Barrier | None = None,
               setup: Callable[..., Any] = lambda rank, *args: {"rank": rank}) -> tuple[Membership, FakeRun, FakeProcs]:
    run = FakeRun(group_size)
    events: "queue.SimpleQueue[RunEvent]" = queue.SimpleQueue()
    m = Membership(run, events)  # type: ignore[arg-type]  # a fake run
    procs = FakeProcs()
    m.procs = procs
    barrier = barrier or Barrier()
    m.store = barrier
    m.trainers = {r: FakeTrainer(r, {"init_quorum": barrier.init_quorum, "setup": setup}) for r in range(ranks)}
    for r in range(ranks):
        m.move(r, RankState.LIVE)
    return m, run, procs


def next_event(m: Membership, timeout_s: float = 5.0) -> RunEvent:
    return m.events.get(timeout=timeout_s)


def test_a_killed_rank_restarts_once_and_comes_back_ready():
    m, run, procs = membership()
    killed = SupervisionError(2, "killed", signal="SIGKILL")
    assert m.fail_rank(2, killed) is True
    assert m.fail_rank(2, killed) is False, "the same failure seen twice (exit and a call in flight): one restart"
    assert m.state[2] is RankState.RESTARTING and m.live == [0, 1, 3]
    event = next_event(m)
    assert event == RankReady(2) and procs.restarted == [2]
    m.on_ready(2)
    assert m.ready == [2]
    assert m.trainers[2].calls == [("setup", ())], "the restart builds the trainer again"
    assert [(e, r, k) for e, r, k in run.recorded] == [("failed", 2, "crash"), ("detected", 2, "crash")]
    assert m.failures[0].pid == 1002 and m.failures[0].restarted and m.failures[0].disrupted
    m.join_threads(5)


def test_a_rank_whose_restarts_keep_failing_is_left_out_after_three_tries():
    m, run, procs = membership()
    procs.failing.add(1)
    m.fail_rank(1, SupervisionError(1, "exited"))
    event = next_event(m)
    assert isinstance(event, RestartFailed) and event.rank == 1 and "ImportError" in str(event.error)
    assert procs.restarted == [1, 1, 1]
    m.on_restart_failed(1)
    assert m.state[1] is RankState.OUT
    assert m.fail_rank(1, SupervisionError(1, "exited")) is False, "an out rank is not restarted again"
    m.join_threads(5)


def test_a_failed_shard_holder_takes_its_whole_replica_group_out_and_the_group_restarts_as_one():
    m, run, procs = membership(ranks=4, group_size=2)
    m.fail_rank(3, SupervisionError(3, "killed", signal="SIGKILL"))
    assert m.restarting == [2, 3] and m.live == [0, 1], "rank 2's partner failed: its group's collectives cannot go on"
    assert sorted((f.rank, f.kind) for f in m.failures) == [(2, "group"), (3, "crash")]
    assert {next_event(m), next_event(m)} == {RankReady(2), RankReady(3)}
    assert sorted(procs.restarted) == [2, 3]
    assert m.trainers[2].calls == m.trainers[3].calls == [("setup", (1,))], "set up under the group's new incarnation"
    assert m.generation == {1: 1}
    m.join_threads(5)


def test_a_killed_rank_whose_death_is_heard_after_its_partners_error_is_recorded_as_a_crash():
    """Rank 1 is SIGKILLed in a reduce-scatter; its partner's GroupCollectiveError reaches the
    controller first, which takes rank 1 out as the partner (``group``). Rank 1's own death, heard
    next, names the cause; a report about another incarnation (or an error that is not a death)
    does not."""
    m, run, procs = membership(ranks=4, group_size=2)
    m.fail_rank(0, actor_error(0, "GroupCollectiveError"))
    assert sorted((f.rank, f.kind) for f in m.failures) == [(0, "group"), (1, "group")]
    assert not m.own_death_heard(1, SupervisionError(1, "killed", signal="SIGKILL"), pid=999), "another incarnation"
    assert not m.own_death_heard(1, actor_error(1, "GroupCollectiveError"), pid=1001), "not a death"
    assert m.own_death_heard(1, SupervisionError(1, "SIGKILL", signal="SIGKILL"), pid=1001)
    assert sorted((f.rank, f.kind, f.cause) for f in m.failures) == [
        (0, "group", "raised GroupCollectiveError"), (1, "crash", "SIGKILL")]
    assert m.restarting == [0, 1] and len(m.failures) == 2, "still one restart of the group, one record each"
    assert {next_event(m), next_event(m)} == {RankReady(0), RankReady(1)}
    m.join_threads(5)


def test_a_partner_that_died_on_its_own_before_the_group_restart_killed_it_is_recorded_as_a_crash():
    """The same race, later still: the restart began (and sent its kill) before rank 1's own
    exit was heard, so that exit was never reported; the restart finds it (RankProcs.own_exit)."""
    m, run, procs = membership(ranks=4, group_size=2)
    procs.deaths[(1, 1001)] = SupervisionError(1, "SIGKILL", "killed by SIGKILL", signal="SIGKILL")
    m.fail_rank(0, actor_error(0, "GroupCollectiveError"))
    assert {next_event(m), next_event(m)} == {RankReady(0), RankReady(1)}
    m.join_threads(5)
    assert sorted((f.rank, f.kind, f.cause) for f in m.failures) == [
        (0, "group", "raised GroupCollectiveError"), (1, "crash", "SIGKILL")]


def test_a_rank_that_dies_inside_the_quorum_barrier_aborts_it_and_the_quorum_forms_without_it():
    barrier = Barrier()
    m, run, procs = membership(barrier=barrier)
    barrier.dead.add(1)
    m.form_quorum(initial=True)
    assert barrier.keys == {"quorum1/abort": "1"}, "the first quorum was aborted for the others' sake"
    assert m.quorum == 2 and m.members == [0, 2, 3] and not m.broken
    assert m.state[1] is RankState.RESTARTING
    first = [args for name, args in m.trainers[0].calls if name == "init_quorum"]
    assert first == [(1, [0, 1, 2, 3], 0), (2, [0, 2, 3], 0)], "the initial quorum's members take rank 0's state"
    assert next_event(m) == RankReady(1)
    m.join_threads(5)


def test_the_survivors_blocked_in_an_aborted_quorum_are_not_failed():
    assert own_failure(SupervisionError(1, "killed"))
    assert not own_failure(actor_error(0, "QuorumAborted")), "a peer's failure seen from a survivor"
    assert not own_failure(actor_error(0, "CollectiveError"))
    assert own_failure(actor_error(0, "ValueError"))


def test_no_quorum_when_every_rank_keeps_failing_ends_the_run():
    barrier = Barrier()
    m, run, procs = membership(ranks=2, barrier=barrier)
    attempts = iter(range(100))

    def flaky(rank: int, quorum: int, ranks: list[int], source: int | None) -> Any:
        next(attempts)
        return actor_error(rank, "QuorumAborted")  # never the rank's own failure: nobody to take out

    for trainer in m.trainers.values():
        trainer.init_quorum = SimpleNamespace(call_one=lambda *args, t=trainer: Future.completed(error=flaky(t.rank, *args)))
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match="could not form a quorum after 20 tries"):
        m.form_quorum()
    assert m.quorum == 20 and m.live == [0, 1] and time.monotonic() - t0 < 2.0


def test_a_failure_while_the_run_stops_opens_no_restart():
    m, run, procs = membership()
    run.stop_event.set()
    assert m.fail_rank(0, SupervisionError(0, "killed")) is True
    assert m.state[0] is RankState.RESTARTING and procs.restarted == [] and m.events.empty()
