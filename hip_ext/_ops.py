"""The ``torch.library`` definitions of ``monarch_nb::grad_health`` and ``monarch_nb::checksum``,
with the pure-torch references registered for every device, and their typed Python faces.

Compiled kernels (see :mod:`hip_ext._build`) register later for the ``CPU`` and ``CUDA`` keys,
where the dispatcher prefers them to the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._reference import checksum_reference, grad_health_reference

__all__ = ["grad_health", "checksum"]

_lib = torch.library.Library("monarch_nb", "DEF")
_lib.define("grad_health(Tensor[] tensors) -> Tensor")
_lib.define("checksum(Tensor x) -> Tensor")
_lib.impl("grad_health", grad_health_reference, "CompositeExplicitAutograd")
_lib.impl("checksum", checksum_reference, "CompositeExplicitAutograd")


def grad_health(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.ops.monarch_nb.grad_health``: the health of all gradients of a model in one pass.

    Args:
        tensors: float32, float16, bfloat16 or float64 tensors (any mix of dtypes, sizes and
            strides; empty tensors and an empty list allowed), all on one device. Strided
            tensors are made contiguous first (a copy).

    Returns:
        float64 tensor of shape ``(2,)`` on the tensors' device (the CPU for an empty list):
        ``[sum of squares of the finite elements, number of NaN and +-Inf elements]``;
        ``result[0].sqrt()`` is the L2 norm of the finite elements.

    Raises:
        RuntimeError: a tensor of another dtype, or tensors on different devices.

    Example:
        >>> import torch, hip_ext
        >>> hip_ext.grad_health([torch.tensor([3.0, float("nan")]), torch.tensor([4.0])]).tolist()
        [25.0, 1.0]
    """
    return torch.ops.monarch_nb.grad_health(list(tensors))


def checksum(x: torch.Tensor) -> int:
    """``torch.ops.monarch_nb.checksum``: a 64-bit hash of ``x``'s bytes, as a Python int.

    The same bytes give the same value on the CPU, CUDA and HIP, whichever kernel serves the op:
    the byte layout and formula are in :func:`hip_ext.checksum_reference`. Use it to prove
    replicas bit-identical. It waits for a GPU tensor's kernel (a device sync); the op itself
    returns a 0-dim int64 tensor on ``x``'s device without waiting.

    Args:
        x: a dense tensor of any dtype, shape, strides and device.

    Returns:
        The checksum's 64 bits as a signed int64 value (``-2**63 <= value < 2**63``).

    Raises:
        RuntimeError: ``x`` is not strided (sparse, ...).

    Example:
        >>> import torch, hip_ext
        >>> a = torch.arange(10, dtype=torch.float32)
        >>> hip_ext.checksum(a) == hip_ext.checksum(a.clone()) != hip_ext.checksum(a + 1)
        True
    """
    return int(torch.ops.monarch_nb.checksum(x))
