"""A proc's state moves only as the transition table allows (ProcRecord.move; no processes)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import monarch_nb
from monarch_nb.supervision.records import MOVES, RACY_MOVES, ProcRecord, ProcState

S = ProcState


def _record(state: ProcState = S.STARTING) -> ProcRecord:
    return ProcRecord("pm0.3", "pm0", 3, {"gpus": 3}, "host0", {}, state=state)


def _walk(rec: ProcRecord, *moves: ProcState) -> None:
    for new in moves:
        old = rec.state
        assert rec.move(new, "test") is old
        assert rec.state is new


def test_the_lives_the_runtime_gives_a_proc():
    # started, busy and idle, hung, fenced (its exit), restarted, stopped
    _walk(_record(), S.HEALTHY, S.BUSY, S.HEALTHY, S.HUNG, S.FAILED, S.RESTARTING, S.HEALTHY, S.STOPPING, S.STOPPED)
    # slow, not hung (fencing off); killed; restarted in place of a hung one; its new incarnation dies
    _walk(_record(), S.HEALTHY, S.HUNG, S.BUSY, S.FAILED, S.RESTARTING, S.RESTARTING, S.FAILED)
    # its host is lost while it starts, and comes back; a spawn that fails stops the rest
    _walk(_record(), S.FAILED, S.RESTARTING, S.HEALTHY)
    _walk(_record(), S.STOPPING, S.HEALTHY, S.FAILED)  # a proc stopped while it started says hello, then exits


@pytest.mark.parametrize("old, new", [(old, new) for old in ProcState for new in sorted(MOVES[old])])
def test_every_move_in_the_table_is_made(old, new):
    rec = _record(old)
    assert rec.move(new, "test") is old
    assert rec.state is new


@pytest.mark.parametrize("old, new", [
    (S.STARTING, S.BUSY),  # busy only once it served
    (S.STARTING, S.STOPPED),  # stopped only after stopping
    (S.HEALTHY, S.STOPPED),
    (S.HUNG, S.HUNG),
    (S.STOPPED, S.STOPPED),
    (S.STOPPED, S.BUSY),
    *[(old, S.STARTING) for old in ProcState],  # only a new record starts
    *[(old, S.PAUSED) for old in ProcState],  # the tree's state, never a record's
])
def test_a_move_off_the_table_raises_and_changes_nothing(old, new):
    rec = _record(old)
    with pytest.raises(RuntimeError, match=rf"proc pm0\.3: {old.value} -> {new.value} is not a legal move \(test\); from "):
        rec.move(new, "test")
    assert rec.state is old


def test_the_table_covers_every_state_and_its_racy_moves():
    assert set(MOVES) == set(ProcState)
    assert all(S.STARTING not in targets and S.PAUSED not in targets for targets in MOVES.values())
    assert MOVES[S.PAUSED] == frozenset()
    assert all(targets <= MOVES[old] for old, targets in RACY_MOVES.items())
    assert all(S.FAILED in MOVES[old] and S.HEALTHY in MOVES[old] for old in ProcState if old is not S.PAUSED)


_ASSIGNS_STATE = re.compile(r"\.state\s*(,[^=\n]*)?=(?!=)")  # ``x.state = ...``, ``x.state, y = ...``


def _assigns_proc_state(node: ast.AST) -> bool:
    """``x.state = <something of ProcState>`` (also inside a tuple of targets)."""
    return isinstance(node, ast.Assign) and any(
        isinstance(x, ast.Attribute) and x.attr == "state" for t in node.targets for x in ast.walk(t)) and any(
        isinstance(n, ast.Name) and n.id == "ProcState" for n in ast.walk(node.value))


def test_only_move_changes_a_procs_state():
    for sample in ("rec.state = ProcState.BUSY if rec.busy else ProcState.HEALTHY", "rec.state, n = ProcState.FAILED, 1"):
        assert _ASSIGNS_STATE.search(sample) and _assigns_proc_state(ast.parse(sample).body[0])  # what the scan finds
    root = pathlib.Path(monarch_nb.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ("supervision/records.py", "runtime/hosts.py"):  # move itself; host agents' records
            continue
        text = path.read_text()
        if "ProcState" not in text or not _ASSIGNS_STATE.search(text):  # parse only candidates: fast
            continue
        found += [f"{rel}:{n.lineno}" for n in ast.walk(ast.parse(text, filename=str(path))) if _assigns_proc_state(n)]
    assert found == [], f"assign a proc's state with ProcRecord.move: {found}"
