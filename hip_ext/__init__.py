"""monarch_nb's compiled kernels, behind ``torch.library`` op names with pure-torch references.

Two ops, under the ``monarch_nb`` namespace:

- ``torch.ops.monarch_nb.grad_health(tensors)`` -> float64 ``[sum of squares of the finite
  elements, number of non-finite elements]`` over a whole list of gradients in one pass
  (:func:`grad_health`). Each rank runs it before the all-reduce: a NaN is found on the rank
  that produced it, and the gradient norm comes with it.
- ``torch.ops.monarch_nb.checksum(x)`` -> a 64-bit hash of ``x``'s bytes that is the same on
  the CPU, CUDA and HIP for the same bytes (:func:`checksum`): replicas and healed ranks are
  proven bit-identical with it.

Three implementations stand behind each name: the pure-torch reference (``_reference.py``,
registered as ``CompositeExplicitAutograd``, so the ops work everywhere with no compiler); a C++
CPU kernel (``csrc/ops_cpu.cpp``); and GPU kernels (``csrc/*.cu``) written once in the CUDA
subset that hipify maps to HIP, behind the portable warp layer ``csrc/portable.h``, so they build
as CUDA on NVIDIA torch and as HIP on ROCm torch. :func:`load` builds the compiled ones at first
use and registers them for the ``CPU`` and ``CUDA`` dispatch keys; it never raises.

``scripts/hip-offline-check.sh`` compiles the kernel files for AMD targets (gfx90a, gfx940) with
Debian's hipcc and for sm_80/sm_90 with nvcc, on machines with no GPU.
"""

from __future__ import annotations

from ._build import compiled, load
from ._ops import checksum, grad_health
from ._reference import HEALTH_DTYPES, checksum_reference, grad_health_reference

__all__ = [
    "grad_health",
    "checksum",
    "grad_health_reference",
    "checksum_reference",
    "HEALTH_DTYPES",
    "load",
    "compiled",
]
