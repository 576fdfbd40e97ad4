"""monarch_nb's compiled kernels, behind torch.library op names with a pure-torch fallback.

``torch.ops.monarch_nb.grad_stats(x)`` -> float64 tensor ``[sum of squares of finite elements,
number of non-finite elements]`` of a floating-point tensor ``x`` (any shape, on the CPU or a GPU).
The training loop runs it on each gradient before the all-reduce, so a NaN-poisoned rank is found
on that rank instead of poisoning every replica, and the gradient norm comes with it.

Three implementations stand behind the one op name:

- the pure-torch reference (``CompositeExplicitAutograd``), always registered: the op works
  everywhere, with no compiler;
- a C++ CPU kernel (``csrc/grad_stats.cpp``), and a CUDA kernel (``csrc/grad_stats_cuda.cu``) that
  torch hipifies into HIP on a ROCm build. :func:`load` JIT-builds them with
  ``torch.utils.cpp_extension.load`` (cached under TORCH_EXTENSIONS_DIR) and registers them for
  the CPU and CUDA dispatch keys, where they take precedence over the reference.

``load()`` never raises for a missing compiler or ninja: it logs why and keeps the reference.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import torch

__all__ = ["grad_stats", "grad_stats_reference", "load", "compiled"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_lib = torch.library.Library("monarch_nb", "DEF")
_lib.define("grad_stats(Tensor x) -> Tensor")
_compiled: list[str] = []


def grad_stats_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``grad_stats``: float64 ``[sum of squares of finite elements, non-finite count]``.

    Raises:
        RuntimeError: ``x`` is not floating point.
    """
    if not x.is_floating_point():
        raise RuntimeError(f"grad_stats expects a floating-point tensor, got {x.dtype}")
    values = x.detach().to(torch.float64).reshape(-1)
    finite = torch.isfinite(values)
    sum_sq = torch.where(finite, values, torch.zeros((), dtype=torch.float64, device=x.device)).square().sum()
    return torch.stack([sum_sq, (~finite).sum().to(torch.float64)])


_lib.impl("grad_stats", grad_stats_reference, "CompositeExplicitAutograd")


def grad_stats(x: torch.Tensor) -> torch.Tensor:
    """``torch.ops.monarch_nb.grad_stats(x)``; see the module docstring."""
    return torch.ops.monarch_nb.grad_stats(x)


def compiled() -> list[str]:
    """The dispatch keys served by compiled kernels ("CPU", "CUDA"); empty: the reference only."""
    return list(_compiled)


def load(verbose: bool = False) -> list[str]:
    """Build (or reuse the cached build of) the C++/CUDA/HIP kernels and register them.

    Returns the dispatch keys now served by compiled kernels. Idempotent.
    """
    if _compiled:
        return compiled()
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.info("hip_ext: no C++ compiler; using the pure-torch grad_stats")
        return []
    from torch.utils import cpp_extension

    sources = [str(_CSRC / "grad_stats.cpp")]
    keys = ["CPU"]
    if torch.cuda.is_available() and (cpp_extension.CUDA_HOME or cpp_extension.ROCM_HOME):
        sources.append(str(_CSRC / "grad_stats_cuda.cu"))
        keys.append("CUDA")
    venv_bin = os.path.dirname(sys.executable)  # ninja from the venv, when it is not activated
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(
            name="monarch_nb_hip_ext" + ("_gpu" if len(keys) > 1 else ""),
            sources=sources,
            extra_cflags=["-O3"],
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no ninja, a compile error, ...
        log.warning("hip_ext: build failed, using the pure-torch grad_stats: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return []
    _compiled.extend(keys)
    return compiled()
