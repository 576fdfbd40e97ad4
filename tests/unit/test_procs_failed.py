"""PROC_FAILED's body: the procs that failed together, as one typed value each (no processes)."""

from __future__ import annotations

import pytest

from monarch_nb.runtime.protocol import FailedProc


def test_a_lost_hosts_procs_round_trip_in_one_body():
    failed = [FailedProc(f"pm0.{r}", r, "host_lost", "host host3 lost: no heartbeat for 2.10 s", None) for r in (24, 25)]
    killed = FailedProc("pm0.3", 3, "SIGKILL", "killed by SIGKILL", "SIGKILL")
    assert FailedProc.decode(FailedProc.encode(failed)) == failed
    assert FailedProc.decode(memoryview(FailedProc.encode([killed]))) == [killed]  # as the IO loop hands it


@pytest.mark.parametrize("body", [b"", b"{}", b'{"rank": 3}', b"[[1, 2]]", b'[["pm0.1", "one", "x", "", null]]', b"\xff"])
def test_a_body_that_is_not_a_list_of_failed_procs_is_refused_by_name(body):
    with pytest.raises(ValueError, match="not a list of failed procs"):
        FailedProc.decode(body)
