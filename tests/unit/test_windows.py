"""How long the controller's windows of steps are (``Coordinator._window_size``): about
``window_s`` (here 0.5 s unless said) in the steady state, at most ``JOIN_WINDOW_S`` while a restarted rank is on its way
back (it joins at a boundary, after the windows in flight). No processes: the coordinator's
fields the sizing reads are set by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from monarch_nb.train.coordinator import JOIN_WINDOW_S, Coordinator
from monarch_nb.train.options import make_options


def sizing(step_s: float | None, *, restarting=(), ready=(), window_s: float = 0.5) -> int:
    o = SimpleNamespace(window_steps=None, window_s=window_s)
    fields = SimpleNamespace(o=o, step_s=step_s, m=SimpleNamespace(restarting=list(restarting), ready=list(ready)))
    return Coordinator._window_size(fields)  # type: ignore[arg-type]


def test_a_window_is_window_s_of_steps():
    assert make_options("digits", procs=2, steps=10).window_s == 0.1
    assert sizing(0.01) == 50
    assert sizing(0.06) == 8  # a sharded charlm step here: 8 steps a window with window_s=0.5
    assert sizing(0.06, window_s=0.1) == 1
    assert sizing(None) == 1  # no step timed yet: one step


@pytest.mark.parametrize("waiting", [{"restarting": [2]}, {"ready": [1]}])
def test_windows_shrink_while_a_rank_is_on_its_way_back(waiting):
    assert sizing(0.01, **waiting) == round(JOIN_WINDOW_S / 0.01)
    assert sizing(0.5, **waiting) == 1


def test_a_shorter_window_s_or_fixed_window_steps_win():
    assert sizing(0.01, restarting=[0], window_s=0.05) == 5  # the user's shorter window stays
    o = SimpleNamespace(window_steps=7, window_s=0.5)
    fields = SimpleNamespace(o=o, step_s=0.01, m=SimpleNamespace(restarting=[1], ready=[]))
    assert Coordinator._window_size(fields) == 7  # type: ignore[arg-type]
