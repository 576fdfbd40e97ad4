"""Supervision decisions: backoff, max_restarts, owners that handle, decline or raise; chaos plans."""

from __future__ import annotations

import pytest

from monarch_nb.faults.chaos import ChaosSchedule
from monarch_nb.supervision.policy import Failure, SupervisionPolicy, decide


def _failure(rank: int = 1) -> Failure:
    return Failure("pm0", rank, {"gpus": rank}, 4242, "SIGKILL", "SIGKILL", "killed by SIGKILL", 0.0, 0)


def test_restart_backs_off_exponentially_up_to_the_cap_then_escalates():
    policy = SupervisionPolicy("restart", max_restarts=4, backoff_s=0.5, backoff_max_s=1.5)
    waits = [decide(policy, _failure()).wait_s for _ in range(4)]
    assert waits == [0.5, 1.0, 1.5, 1.5]
    last = decide(policy, _failure())
    assert last.action == "escalate" and "max_restarts=4 reached" in last.detail
    assert decide(policy, _failure(rank=2)).action == "restart"  # counted per rank


def test_owner_is_asked_first():
    seen = []
    handled = decide(SupervisionPolicy("escalate", owner=lambda f: seen.append(f.rank) or True), _failure())
    assert handled.action == "handled" and seen == [1]

    class Declines:
        def __supervise__(self, failure):
            return False

    assert decide(SupervisionPolicy("isolate", owner=Declines()), _failure()).action == "isolate"

    def raises(failure):
        raise RuntimeError("owner bug")

    escalated = decide(SupervisionPolicy("escalate", owner=raises), _failure())
    assert escalated.action == "escalate" and "__supervise__ raised RuntimeError: owner bug" in escalated.detail


@pytest.mark.parametrize("kwargs, error", [
    ({"policy": "retry"}, ValueError), ({"max_restarts": -1}, ValueError), ({"backoff_s": -0.1}, ValueError),
    ({"owner": object()}, TypeError),
])
def test_bad_policies_are_refused(kwargs, error):
    with pytest.raises(error):
        SupervisionPolicy(**kwargs)


def test_chaos_plan_is_a_pure_function_of_the_seed():
    a = ChaosSchedule(mtbf_s=20, kinds=("kill", "hang", "nan"), seed=7).plan(20, world=4)
    b = ChaosSchedule(mtbf_s=20, kinds=("kill", "hang", "nan"), seed=7).plan(20, world=4)
    assert [f.key() for f in a] == [f.key() for f in b]
    assert [f.key() for f in a] != [f.key() for f in ChaosSchedule(20, ("kill", "hang", "nan"), seed=8).plan(20, world=4)]
    assert all(0 <= f.rank < 4 for f in a) and {f.kind for f in a} <= {"kill", "hang", "nan"}
    gaps = [b.at_s - a.at_s for a, b in zip(a, a[1:])]
    assert 5 < sum(gaps) / len(gaps) < 60  # mean time between faults around mtbf_s


@pytest.mark.parametrize("kwargs", [{"mtbf_s": 0}, {"mtbf_s": 5, "kinds": ("boom",)}, {"mtbf_s": 5, "ranks": []}])
def test_bad_chaos_schedules_are_refused(kwargs):
    with pytest.raises(ValueError):
        ChaosSchedule(**kwargs)
