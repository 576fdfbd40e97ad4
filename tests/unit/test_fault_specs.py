"""Fault specs: one grammar for the CLI, the magics and training; the fault catalogue's checks."""

from __future__ import annotations

import pytest

from monarch_nb.faults.spec import check_faults, parse_fault
from monarch_nb.runtime.protocol import FAULT_KINDS, validate_fault


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kill@5", "needs rank"),
        ("boom@5:rank=1", "unknown fault kind 'boom'"),
        ("kill@x:rank=1", "is not an integer"),
        ("slow@3:rank=1,speed=2", "takes ms"),
        ("hang@3:rank=1,phase=collective", "only for kill"),
        ("kill", "expected KIND@STEP"),
    ],
)
def test_fault_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_fault(spec)


def test_fault_spec_forms():
    f = parse_fault("exit@50:rank=0,code=3")
    assert (f.kind, f.step, f.rank, f.params) == ("exit", 50, 0, {"code": 3})
    assert parse_fault("slow@10:rank=1,ms=50").params == {"ms": 50}
    assert parse_fault({"kind": "kill", "step": 4, "rank": 2}) == parse_fault("kill@4:rank=2")
    assert parse_fault("kill@40:rank=1,phase=collective").phase == "collective"



def test_short_form_and_default_rank():
    assert parse_fault("kill@50:2") == parse_fault("kill@50:rank=2")
    assert parse_fault("slow@5:1,ms=20").params == {"ms": 20}
    assert parse_fault("nan@80", default_rank=3).rank == 3
    assert str(parse_fault("slow@10:rank=1,ms=50")) == "slow@10:rank=1,ms=50"


def test_check_faults_names_the_valid_ranks_and_steps():
    with pytest.raises(ValueError, match=r"ranks are 0\.\.3"):
        check_faults([parse_fault("kill@1:rank=4")], procs=4, steps=10)
    with pytest.raises(ValueError, match=r"steps 0\.\.9"):
        check_faults([parse_fault("kill@10:rank=1")], procs=4, steps=10)
    with pytest.raises(ValueError, match="fail every rank"):
        check_faults([parse_fault("kill@3:rank=0"), parse_fault("hang@3:rank=1")], procs=2, steps=10)


def test_catalogue_defaults_and_bad_parameters():
    assert validate_fault("stall", {}) == {"seconds": 5.0}
    assert validate_fault("exit", {"code": 3}) == {"code": 3}
    assert FAULT_KINDS["kill"].signal == "SIGKILL" and FAULT_KINDS["raise"].signal is None
    for kind, params, message in [("boom", {}, "valid kinds: kill"), ("kill", {"x": 1}, "takes no parameters"),
                                  ("slow", {"ms": -1}, "non-negative"), ("exit", {"code": 1.5}, "must be an int")]:
        with pytest.raises(ValueError, match=message):
            validate_fault(kind, params)
