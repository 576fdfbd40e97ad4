"""hip_ext: the grad_stats op, its pure-torch reference and the compiled CPU kernel behind one name."""

from __future__ import annotations

import shutil

import pytest
import torch

import hip_ext


def _poisoned(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(300, 257).to(dtype)
    x[3, 3] = float("nan")
    x[7, 1] = float("inf")
    x[9, 9] = float("-inf")
    return x


def test_reference_counts_nonfinite_and_sums_squares_of_the_rest():
    x = _poisoned(torch.float32)
    stats = hip_ext.grad_stats_reference(x)
    finite = x[torch.isfinite(x)].double()
    assert stats.dtype == torch.float64 and stats.shape == (2,)
    assert stats[1].item() == 3
    assert stats[0].item() == pytest.approx(finite.square().sum().item(), rel=1e-12)
    with pytest.raises(RuntimeError, match="floating-point"):
        hip_ext.grad_stats(torch.ones(3, dtype=torch.int64))


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_compiled_cpu_kernel_serves_the_op_and_matches_the_reference():
    assert "CPU" in hip_ext.load()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("monarch_nb::grad_stats", "CPU")
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = _poisoned(dtype)
        got = hip_ext.grad_stats(x)
        want = hip_ext.grad_stats_reference(x)
        assert got[1].item() == want[1].item() == 3
        assert got[0].item() == pytest.approx(want[0].item(), rel=1e-9)
    assert hip_ext.grad_stats(torch.empty(0)).tolist() == [0.0, 0.0]
    strided = _poisoned(torch.float32).t()
    assert torch.equal(hip_ext.grad_stats(strided)[1], torch.tensor(3.0, dtype=torch.float64))
