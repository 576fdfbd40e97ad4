"""The pure-torch references of ``grad_health`` and ``checksum``: the specification the compiled
kernels are tested against, and what serves the ops wherever no kernel is compiled.

They run on any device torch runs on (the same torch ops on the CPU, CUDA or ROCm).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["grad_health_reference", "checksum_reference", "HEALTH_DTYPES"]

#: the element types grad_health reads
HEALTH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

_MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: splitmix64's increment
LENGTH_SALT = 0xD6E8FEB86659FD93
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_HALF_WORDS = 1 << 30  # words summed at once: 2^30 halves of < 2^32 each cannot overflow int64


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _check_health_inputs(tensors: Sequence[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.dtype not in HEALTH_DTYPES:
            raise RuntimeError(
                f"grad_health expects float32, float16, bfloat16 or float64 tensors; tensor {i} is {t.dtype}")
        if t.device != device:
            raise RuntimeError(
                f"grad_health expects all tensors on one device; tensor {i} is on {t.device}, tensor 0 on {device}")
    return device


def grad_health_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Health of a list of gradients: ``[sum of squares of the finite elements, number of non-finite ones]``.

    Several passes per tensor (``isfinite``, a masked copy, a float64 copy, a sum); the compiled
    kernels give the same figures in one pass over all tensors.

    Args:
        tensors: float32, float16, bfloat16 or float64 tensors of any shapes and strides, all on one
            device; the list may be empty and tensors may have no elements.

    Returns:
        A float64 tensor of shape ``(2,)`` on the tensors' device (the CPU for an empty list):
        ``[sum of x*x over finite x, count of NaN and +-Inf elements]``. Squares are taken in
        float64 (exact for float32 and narrower), so ``sqrt(result[0])`` is the L2 norm of the
        finite elements.

    Raises:
        RuntimeError: a tensor of another dtype, or tensors on different devices.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(2, dtype=torch.float64)
    device = _check_health_inputs(tensors)
    sum_sq = torch.zeros((), dtype=torch.float64, device=device)
    nonfinite = torch.zeros((), dtype=torch.int64, device=device)
    for t in tensors:
        x = t.detach().reshape(-1)
        finite = torch.isfinite(x)
        nonfinite += (~finite).sum()
        sum_sq += torch.where(finite, x, 0).to(torch.float64).square().sum()
    return torch.stack([sum_sq, nonfinite.to(torch.float64)])


def _srl(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 tensors, element-wise, wrapping mod 2^64 like the C kernels' uint64_t."""
    z = z + _signed(GAMMA)
    z = (z ^ _srl(z, 30)) * _signed(_MUL1)
    z = (z ^ _srl(z, 27)) * _signed(_MUL2)
    return z ^ _srl(z, 31)


def checksum_reference(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of a tensor's bytes, the same for the same bytes on every device and kernel.

    The bytes are those of ``x.contiguous()`` (row-major, native little-endian element layout,
    conjugate and negative bits resolved), ``nbytes = x.numel() * x.element_size()`` of them.
    They are read as ``W = ceil(nbytes / 8)`` little-endian 64-bit words ``w_0 .. w_{W-1}``; the
    last word, when ``nbytes`` is not a multiple of 8, holds the remaining bytes in its low bytes
    and zeros above. With ``splitmix64(z) = f(z + GAMMA)``, where ``f`` is splitmix64's output
    function (xor-shift 30, multiply 0xBF58476D1CE4E5B9, xor-shift 27, multiply
    0x94D049BB133111EB, xor-shift 31), ``GAMMA = 0x9E3779B97F4A7C15`` and
    ``LENGTH_SALT = 0xD6E8FEB86659FD93``, all arithmetic mod 2^64::

        checksum = sum_i splitmix64(w_i XOR (i * GAMMA)) + splitmix64(nbytes XOR LENGTH_SALT)

    Each word's term depends only on its value and index, and addition mod 2^64 is commutative,
    so any split of the words over threads, blocks or chunks gives the same value: CPU, CUDA and
    HIP agree. It detects corrupted or differing bytes (any single changed word changes it); it is
    not a cryptographic hash.

    Args:
        x: a dense tensor of any dtype, shape, strides and device.

    Returns:
        A 0-dim int64 tensor on ``x``'s device: the 64 bits of the checksum as a signed integer.

    Raises:
        RuntimeError: ``x`` is not strided (sparse, ...).
    """
    if x.layout != torch.strided:
        raise RuntimeError(f"checksum expects a dense (strided) tensor, got layout {x.layout}")
    data = x.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    nbytes = data.numel()
    pad = -nbytes % 8
    if pad or data.storage_offset() % 8:  # a tail to pad, or a view that int64 cannot alias: copy
        padded = torch.zeros(nbytes + pad, dtype=torch.uint8, device=data.device)
        padded[:nbytes] = data
        data = padded
    words = data.view(torch.int64)
    low = torch.zeros((), dtype=torch.int64, device=x.device)
    high = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, words.numel(), _HALF_WORDS):
        piece = words[start : start + _HALF_WORDS]
        index = torch.arange(start, start + piece.numel(), dtype=torch.int64, device=x.device)
        terms = _splitmix64(piece ^ (index * _signed(GAMMA)))
        low = low + (terms & 0xFFFFFFFF).sum()  # exact: no overflow, unlike a sum of full terms
        high = high + _srl(terms, 32).sum()
    length_term = _splitmix64(torch.tensor(_signed(nbytes ^ LENGTH_SALT), dtype=torch.int64, device=x.device))
    return low + (high << 32) + length_term  # int64 arithmetic wraps mod 2^64
