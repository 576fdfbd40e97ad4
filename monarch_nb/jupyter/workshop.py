"""Checkers for the exercises of notebook 04 (:class:`Workshop`) and 05 (:class:`OwnLoopWorkshop`):
run the learner's code against a fresh fault, name what went wrong.

    check = Workshop(procs, workers)     # the mesh and the Worker actors of the notebook
    check.reset()                        # every rank healthy again, between exercises
    check.exercise_1(call_live)          # prints "exercise 1 done: ..." or raises a Hint

A checker builds its own situation (a rank killed or frozen just for it, so an answer that
hard-codes the demo's ranks or reads an older fault is caught), calls the learner's function,
compares with the truth it measured itself, and on a mismatch raises :class:`Hint`: one line
that says what is wrong and where to look, shown by IPython without a traceback. The mesh is
reset afterwards either way.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import SupervisionError
from ..supervision.records import ProcState

__all__ = ["Workshop", "OwnLoopWorkshop", "Hint"]


class Hint(AssertionError):
    """An exercise is not solved yet; the message says what went wrong."""

    def __init__(self, exercise: int, message: str) -> None:
        self.exercise = exercise
        super().__init__(f"exercise {exercise}: {message}")

    def _render_traceback_(self) -> list[str]:
        return [f"Hint: {self}"]


class Workshop:
    """The checks of the workshop notebook, on ``procs`` (a ProcMesh) and ``workers`` (its
    ``Worker`` actor mesh, whose ``work(x)`` returns ``x * (rank + 1)``).

    Args:
        hang_timeout_s: how long a hang check may wait for fencing (default: the settings'
            ``hang_timeout_s`` plus slack).
    """

    def __init__(self, procs: Any, workers: Any, *, hang_timeout_s: float | None = None) -> None:
        from ..config import config
        from ..runtime.controller import Controller

        self.procs = procs
        self.workers = workers
        self.size = len(procs)
        self.controller = Controller.get()
        self.fence_wait_s = hang_timeout_s or (config.hang_timeout_s + 2 * config.heartbeat_interval_s + 10.0)

    # -- the mesh ---------------------------------------------------------------------------------
    def _state(self, rank: int) -> str:
        return self.controller.proc_record(self.procs.name, rank).state

    def _restarts(self) -> list[int]:
        return [self.controller.proc_record(self.procs.name, r).restarts for r in range(self.size)]

    def reset(self, quiet: bool = False) -> None:
        """Restart every rank that is not healthy, and check that every worker answers."""
        restarted = []
        for rank in range(self.size):
            if self._state(rank) not in (ProcState.HEALTHY, ProcState.BUSY):
                self.procs.restart(rank)
                restarted.append(rank)
        answers = self.workers.work.call(1).get(timeout=30).values()
        if answers != [r + 1 for r in range(self.size)]:
            raise RuntimeError(f"the workers answer {answers} after a reset; restart the kernel and run the notebook again")
        if not quiet:
            print(f"mesh reset: {self.size} ranks healthy" + (f" (restarted {restarted})" if restarted else ""))

    def _kill(self, rank: int) -> None:
        mark = self.controller.events.next_seq
        self.procs.inject(rank, "kill")
        self.controller.events.wait_for(lambda e: e.kind == "proc_exited" and e.rank == rank and e.mesh == self.procs.name,
                                        timeout=30, since_seq=mark)

    @staticmethod
    def _call(exercise: int, fn: Callable, *args: Any) -> Any:
        name = getattr(fn, "__name__", "your function")
        try:
            return fn(*args)
        except NotImplementedError:
            raise Hint(exercise, f"{name} still raises NotImplementedError: replace the stub's `raise` with your code") from None
        except SupervisionError as exc:
            raise Hint(exercise, f"{name} let a SupervisionError escape ({exc}): calls to a dead rank raise it; "
                       "catch it for that rank and go on with the others") from None
        except Hint:
            raise
        except Exception as exc:
            raise Hint(exercise, f"{name} raised {type(exc).__name__}: {exc}") from None

    # -- exercise 1 -------------------------------------------------------------------------------
    def exercise_1(self, call_live: Callable) -> None:
        """``call_live(mesh, size, x)`` must return ``{rank: value}`` of the live ranks only."""
        self.reset(quiet=True)
        victim, x = 1, 5  # not the rank the demo killed: an answer copied from the demo shows
        self._kill(victim)
        try:
            got = self._call(1, call_live, self.workers, self.size, x)
            expected = {r: x * (r + 1) for r in range(self.size) if r != victim}
            if not isinstance(got, dict):
                raise Hint(1, f"call_live should return a dict {{rank: value}}, it returned a {type(got).__name__}")
            if victim in got:
                raise Hint(1, f"rank {victim} is dead, yet your answer has a value for it ({got[victim]!r}): "
                           "leave out the ranks whose call raised SupervisionError")
            missing = sorted(set(expected) - set(got))
            if missing:
                raise Hint(1, f"rank(s) {missing} are alive but missing from your answer: call every rank in "
                           "range(size) on its own (mesh.slice(gpus=r).work.call_one(x)), and stop only that rank's "
                           "call when it fails")
            wrong = {r: got[r] for r in expected if got[r] != expected[r]}
            if wrong:
                r = sorted(wrong)[0]
                raise Hint(1, f"rank {r} answers {expected[r]} for x={x}, your dict says {wrong[r]!r}: pass x to "
                           "work and keep what .get() returns")
            print(f"exercise 1 done: with rank {victim} freshly killed, call_live returned {got}")
        finally:
            self.reset(quiet=True)

    # -- exercise 2 -------------------------------------------------------------------------------
    def exercise_2(self, detection_latency_s: Callable) -> None:
        """``detection_latency_s(events, rank)``: seconds from the ``fault_injected`` event of
        ``rank`` to its ``proc_hung`` event."""
        self.reset(quiet=True)
        victim = 1
        log = self.controller.events
        mark = log.next_seq
        self.procs.inject(victim, "hang")
        log.wait_for(lambda e: e.kind == "proc_fenced" and e.rank == victim, timeout=self.fence_wait_s, since_seq=mark)
        fresh = [e for e in log.events(since_seq=mark) if e.rank == victim and e.mesh == self.procs.name]
        injected = next(e for e in fresh if e.kind == "fault_injected")
        hung = next(e for e in fresh if e.kind == "proc_hung")
        fenced = next(e for e in fresh if e.kind == "proc_fenced")
        truth = hung.monotonic - injected.monotonic
        try:
            got = self._call(2, detection_latency_s, log.events(), victim)
            if not isinstance(got, (int, float)):
                raise Hint(2, f"return a number of seconds, not a {type(got).__name__}")
            tolerance = 0.02
            if abs(got - truth) <= tolerance:
                print(f"exercise 2 done: a fresh hang of rank {victim} was detected after {got:.2f} s")
                return
            if abs(got + truth) <= tolerance:
                raise Hint(2, "your latency is negative: subtract the fault_injected time from the proc_hung time")
            if abs(got - (fenced.monotonic - injected.monotonic)) <= tolerance:
                raise Hint(2, "you measured up to proc_fenced (the SIGKILL after the hang was found); "
                           "detection ends at proc_hung")
            older = [e for e in log.events("fault_injected")
                     if e.seq < injected.seq and e.rank == victim and e.mesh == self.procs.name]
            if any(abs(got - (hung.monotonic - e.monotonic)) <= tolerance for e in older):
                raise Hint(2, "you measured from an older fault of that rank: use the last fault_injected event "
                           "before the proc_hung one")
            if abs(got) > 1e5:
                raise Hint(2, f"{got:.0f} s is not a latency: use the events' `monotonic` times for both ends "
                           "(or `time` for both), not one of each")
            raise Hint(2, f"the hang was detected {truth:.2f} s after the fault, your function says {got:.2f} s: "
                       f"pick the events of rank {victim} (kind fault_injected, then proc_hung)")
        finally:
            self.reset(quiet=True)

    # -- exercise 3 -------------------------------------------------------------------------------
    def exercise_3(self, heal: Callable) -> None:
        """``heal(procs)`` restarts exactly the failed ranks and returns them."""
        self.reset(quiet=True)
        victims = [1, 2]
        for rank in victims:
            self._kill(rank)
        before = self._restarts()
        try:
            got = self._call(3, heal, self.procs)
            after = self._restarts()
            still = [r for r in victims if self._state(r) not in (ProcState.HEALTHY, ProcState.BUSY)]
            if still:
                raise Hint(3, f"rank(s) {still} are still {self._state(still[0])}: restart each rank whose "
                           "record's state is 'failed' with procs.restart(rank)")
            extra = [r for r in range(self.size) if r not in victims and after[r] > before[r]]
            if extra:
                raise Hint(3, f"you restarted healthy rank(s) {extra} too: restart only the ranks whose state is 'failed'")
            if got is None:
                raise Hint(3, "heal restarted the right ranks but returned None: return the list of ranks it restarted")
            if sorted(got) != victims:
                raise Hint(3, f"ranks {victims} were restarted, but heal returned {got!r}")
            answers = self.workers.work.call(10).get(timeout=30).values()
            if answers != [10 * (r + 1) for r in range(self.size)]:
                raise Hint(3, f"after heal the workers answer {answers}")
            print(f"exercise 3 done: heal restarted {sorted(got)} and every worker answers")
        finally:
            self.reset(quiet=True)

    # -- exercise 4 -------------------------------------------------------------------------------
    @staticmethod
    def exercise_4(faults: list, report: Any) -> None:
        """A training run with a kill of rank 1 at step 40 lost nothing."""
        from ..faults.spec import parse_fault

        if not faults:
            raise Hint(4, "faults is empty: schedule the kill, e.g. faults = ['kill@40:rank=1']")
        try:
            specs = [parse_fault(f) for f in faults]
        except ValueError as exc:
            raise Hint(4, f"a fault spec does not parse: {exc} (the form is KIND@STEP:rank=R)") from None
        if [(s.kind, s.step, s.rank) for s in specs] != [("kill", 40, 1)]:
            got = ", ".join(f"{s.kind} at step {s.step} on rank {s.rank}" for s in specs)
            raise Hint(4, f"the exercise asks for one kill of rank 1 at step 40; your faults say: {got}")
        if report is None:
            raise Hint(4, "report is None: run mt.fit('digits', procs=2, steps=80, faults=faults) and keep what it returns")
        d = report.to_dict()
        if d["steps"] != 80:
            raise Hint(4, f"the run has {d['steps']} steps; the exercise trains for 80")
        if [f["kind"] for f in d["failures"]] != ["kill"]:
            raise Hint(4, f"the report lists failures {[f['kind'] for f in d['failures']]}; expected the one kill")
        lost = {k: d[k] for k in ("steps_lost", "samples_lost", "samples_repeated") if d[k]}
        if lost:
            raise Hint(4, f"the run lost work: {lost}")
        print("exercise 4 done: one kill, 0 steps lost, 0 samples lost or repeated")



class OwnLoopWorkshop:
    """The checks of notebook 05 ("make your own loop fault tolerant").

    Args:
        train_set: the notebook's training data ``(inputs, targets)``; the checker's runs use it.
        procs: ranks of the checker's own training run (default 3).
    """

    def __init__(self, train_set: Any, procs: int = 3) -> None:
        self.train_set = train_set
        self.procs = procs

    def exercise_1(self, train_fn: Callable) -> None:
        """Train ``train_fn`` on ``procs`` ranks through a kill of rank 1 at step 100; the replicas
        must end identical (the LR scheduler healed with the rest: ``ft.register``).

        Raises:
            Hint: the replicas differ, or the run failed.
        """
        from ..train import TrainingError, fit

        try:
            report = fit(train_fn, procs=self.procs, faults=["kill@100:rank=1"], progress=False)
        except TrainingError as exc:
            raise Hint(1, f"the run failed: {str(exc).splitlines()[0]}") from None
        if not report.replicas_identical:
            raise Hint(1, "after rank 1 was killed and healed, its replica ended different from the others': its "
                          "LR scheduler started again from epoch 0, so it decays at other steps. Give the scheduler "
                          "to ft.register(\"sched\", ...) so it is healed with the model and the optimizer")
        (failure,) = report.failures
        print(f"exercise 1 done: rank 1 rejoined {failure['rejoin_latency_s']:.2f} s after its kill, and all "
              f"{self.procs} replicas end identical (scheduler included)")

    @staticmethod
    def exercise_2(samples_per_rank: Callable) -> None:
        """Compare ``samples_per_rank(global_batch, live_ranks)`` with the split the run uses
        (:func:`monarch_nb.train.data.shard_bounds`), on cases of the checker's own.

        Raises:
            Hint: a case where the answer differs.
        """
        import random

        from ..train.data import shard_bounds

        rng = random.Random()
        cases = [(64, [0, 1, 2, 3]), (64, [0, 1, 3]), (10, [2, 5, 7])]
        cases += [(rng.randint(8, 200), sorted(rng.sample(range(16), rng.randint(1, 6)))) for _ in range(3)]
        for global_batch, live in cases:
            truth = {r: (lambda b: b[1] - b[0])(shard_bounds(global_batch, len(live), i)) for i, r in enumerate(live)}
            got = Workshop._call(2, samples_per_rank, global_batch, list(live))
            if got != truth:
                raise Hint(2, f"for a global batch of {global_batch} over ranks {live} you gave {got}; the run splits "
                              f"it {truth}: contiguous parts in rank order, the first ones one larger")
            if sum(got.values()) != global_batch:
                raise Hint(2, "the parts must add up to the global batch: no sample lost or repeated")
        print(f"exercise 2 done: {len(cases)} splits match the run's, every sample in exactly one rank's part")
