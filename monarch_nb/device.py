"""Accelerator detection and per-rank device visibility: CPU, NVIDIA CUDA, AMD ROCm (HIP).

Detection reads the OS (``/proc/driver/nvidia/gpus``, ``/sys/class/kfd``) and the visibility
variables, so the controller and host agents never import torch to count GPUs. Inside a worker,
:func:`backend` and :func:`device` ask torch, which knows whether it is a CUDA or a ROCm build
(``torch.version.hip``): the collective backend is gloo on CPU and nccl on GPUs, which on ROCm
torch is RCCL.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["GpuInventory", "detect_gpus", "visibility_env", "backend", "device", "describe", "loaded_torch"]


def loaded_torch() -> ModuleType | None:
    """torch if this process has finished importing it, else None; never imports it.

    A torch that another thread is still importing (``sys.modules`` holds it from the import's
    first line, its ``__spec__._initializing`` set) counts as not loaded: reading ``torch.Tensor``
    or ``torch.cuda`` from it would raise AttributeError ("partially initialized module").
    """
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


class GpuInventory:
    """What the OS says about GPUs on this host: ``vendor`` ("nvidia", "amd" or None) and ``count``."""

    def __init__(self, vendor: str | None, count: int):
        self.vendor = vendor
        self.count = count

    def __repr__(self) -> str:
        return f"GpuInventory(vendor={self.vendor!r}, count={self.count})"


def _visible(var: str) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return [d for d in raw.split(",") if d.strip() and d.strip() != "-1"]


def detect_gpus() -> GpuInventory:
    """Count the GPUs this process may use, honouring *_VISIBLE_DEVICES."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    if nvidia.is_dir():
        count = len(list(nvidia.iterdir()))
        visible = _visible("CUDA_VISIBLE_DEVICES")
        return GpuInventory("nvidia", len(visible) if visible is not None else count)
    kfd = Path("/sys/class/kfd/kfd/topology/nodes")
    if kfd.is_dir():
        count = 0
        for node in kfd.iterdir():
            try:
                props = (node / "properties").read_text()
            except OSError:
                continue
            if any(line.startswith("simd_count") and line.split()[-1] != "0" for line in props.splitlines()):
                count += 1
        for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            visible = _visible(var)
            if visible is not None:
                count = min(count, len(visible))
        return GpuInventory("amd" if count else None, count)
    return GpuInventory(None, 0)


def visibility_env(local_rank: int, inventory: GpuInventory | None = None) -> dict[str, str]:
    """Environment that makes exactly one GPU visible to the proc at ``local_rank`` (none on CPU).

    Procs beyond the GPU count share GPUs round-robin. The index is into the parent's visible list.
    """
    inventory = inventory or detect_gpus()
    if not inventory.count:
        return {}
    slot = local_rank % inventory.count
    if inventory.vendor == "nvidia":
        visible = _visible("CUDA_VISIBLE_DEVICES")
        return {"CUDA_VISIBLE_DEVICES": visible[slot] if visible else str(slot)}
    visible = _visible("HIP_VISIBLE_DEVICES") or _visible("ROCR_VISIBLE_DEVICES")
    return {"HIP_VISIBLE_DEVICES": visible[slot] if visible else str(slot)}


def backend() -> str:
    """torch.distributed backend for this process: "nccl" on CUDA and on ROCm (RCCL), else "gloo"."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def device():
    """The torch device this proc computes on: its (only visible) GPU, or the CPU."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def describe() -> dict:
    """Plain-data description of this process's device: kind, name, memory in use (bytes)."""
    import torch

    if not torch.cuda.is_available():
        return {"kind": "cpu", "name": "cpu", "torch": torch.__version__}
    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return {
        "kind": kind,
        "name": torch.cuda.get_device_name(0),
        "memory_allocated_bytes": torch.cuda.memory_allocated(0),
        "memory_reserved_bytes": torch.cuda.memory_reserved(0),
        "torch": torch.__version__,
    }
