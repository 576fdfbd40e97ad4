"""A training rank's state moves only as the membership's diagram allows (no processes)."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from monarch_nb.train.recovery import Membership, RankState


def _membership() -> Membership:
    return Membership(SimpleNamespace(options=None), queue.SimpleQueue())


def test_a_rank_goes_round_the_diagram():
    m = _membership()
    path = [RankState.LIVE, RankState.RESTARTING, RankState.READY, RankState.LIVE,  # failed, restarted, healed
            RankState.RESTARTING, RankState.READY, RankState.RESTARTING, RankState.OUT]  # failed while ready; out
    for state in path:
        m.move(3, state)
        assert m.state[3] is state
    assert m.live == [] and m.ready == [] and m.restarting == []


@pytest.mark.parametrize("start, illegal", [
    ([RankState.LIVE], RankState.READY),  # a live rank is not "ready" without a restart
    ([RankState.LIVE], RankState.LIVE),
    ([RankState.LIVE, RankState.RESTARTING], RankState.LIVE),  # not live again before it was healed
    ([RankState.LIVE, RankState.RESTARTING, RankState.OUT], RankState.RESTARTING),  # out is the end
    ([], RankState.READY),
])
def test_a_move_off_the_diagram_is_refused_and_changes_nothing(start, illegal):
    m = _membership()
    for state in start:
        m.move(0, state)
    before = m.state.get(0)
    with pytest.raises(RuntimeError, match=f"rank 0: .* -> {illegal.value} is not a legal move"):
        m.move(0, illegal)
    assert m.state.get(0) is before
