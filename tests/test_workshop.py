"""Notebook 04's checkers: the stubs and typical wrong answers get a hint naming the mistake; the
solutions pass. The checkers run each answer against a fresh fault of their own."""

from __future__ import annotations

import pytest

from monarch_nb import SupervisionError
from monarch_nb.jupyter.workshop import Hint, Workshop
from monarch_nb.runtime.controller import Controller

from .actors import WorkshopWorker

pytestmark = pytest.mark.timeout(150)


def stub(*args):
    raise NotImplementedError


@pytest.fixture
def check(procs4):
    return Workshop(procs4, procs4.spawn("workers", WorkshopWorker))


def _hint(fn, *args) -> str:
    with pytest.raises(Hint) as info:
        fn(*args)
    return str(info.value)


def test_exercise_1_hints(check, capsys):
    def no_catch(mesh, size, x):
        return {r: mesh.slice(gpus=r).work.call_one(x).get(timeout=10) for r in range(size)}

    def copied_from_the_demo(mesh, size, x):
        return {0: 1, 1: 2, 3: 4}

    def good(mesh, size, x):
        answers = {}
        for r in range(size):
            try:
                answers[r] = mesh.slice(gpus=r).work.call_one(x).get(timeout=10)
            except SupervisionError:
                pass
        return answers

    assert "still raises NotImplementedError" in _hint(check.exercise_1, stub)
    assert "let a SupervisionError escape" in _hint(check.exercise_1, no_catch)
    assert "rank 1 is dead, yet your answer has a value for it" in _hint(check.exercise_1, copied_from_the_demo)
    check.exercise_1(good)
    assert "exercise 1 done" in capsys.readouterr().out


def test_exercise_2_hints(check, capsys):
    def reversed_order(events, rank):
        injected = [e for e in events if e.kind == "fault_injected" and e.rank == rank][-1]
        hung = next(e for e in events if e.kind == "proc_hung" and e.rank == rank and e.seq > injected.seq)
        return injected.monotonic - hung.monotonic

    def good(events, rank):
        injected = [e for e in events if e.kind == "fault_injected" and e.rank == rank][-1]
        hung = next(e for e in events if e.kind == "proc_hung" and e.rank == rank and e.seq > injected.seq)
        return hung.monotonic - injected.monotonic

    assert "still raises NotImplementedError" in _hint(check.exercise_2, stub)
    assert "negative" in _hint(check.exercise_2, reversed_order)
    check.exercise_2(good)
    assert "exercise 2 done" in capsys.readouterr().out


def test_exercise_3_hints(check, capsys):
    def restart_everything(procs):
        for rank in range(len(procs)):
            procs.restart(rank)
        return list(range(len(procs)))

    def forgets_to_return(procs):
        controller = Controller.get()
        for rank in range(len(procs)):
            if controller.proc_record(procs.name, rank).state == "failed":
                procs.restart(rank)

    assert "still raises NotImplementedError" in _hint(check.exercise_3, stub)
    assert "you restarted healthy rank(s) [0, 3] too" in _hint(check.exercise_3, restart_everything)
    assert "returned None" in _hint(check.exercise_3, forgets_to_return)
    check.exercise_3(lambda procs: forgets_to_return(procs) or [1, 2])
    assert "exercise 3 done" in capsys.readouterr().out


def test_exercise_4_hints():
    assert "faults is empty" in _hint(Workshop.exercise_4, [], None)
    assert "one kill of rank 1 at step 40" in _hint(Workshop.exercise_4, ["kill@40:rank=2"], None)
    assert "report is None" in _hint(Workshop.exercise_4, ["kill@40:rank=1"], None)


def test_a_hint_renders_as_one_line():
    assert Hint(2, "what went wrong")._render_traceback_() == ["Hint: exercise 2: what went wrong"]
