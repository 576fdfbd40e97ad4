"""Install the "Monarch (Python 3)" Jupyter kernelspec: ipykernel with ``monarch_nb`` preloaded.

The spec in the repository's ``kernels/monarch/kernel.json`` starts ``python``; the installed copy
starts this interpreter (``sys.executable``), so the kernel finds this environment's packages,
as ``python -m ipykernel install`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

__all__ = ["KERNEL_NAME", "kernel_spec", "install"]

KERNEL_NAME = "monarch"
DISPLAY_NAME = "Monarch (Python 3)"


def kernel_spec(python: str | None = None) -> dict:
    """The kernel.json content, with ``python`` (default: this interpreter) as argv[0]."""
    source = os.path.join(_repo_kernels_dir(), KERNEL_NAME, "kernel.json")
    if os.path.exists(source):
        with open(source) as f:
            spec = json.load(f)
    else:  # installed without the repository's kernels/ folder
        spec = {
            "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext=monarch_nb"],
            "display_name": DISPLAY_NAME,
            "language": "python",
            "interrupt_mode": "signal",
            "metadata": {"debugger": True},
        }
    spec["argv"][0] = python or sys.executable
    return spec


def install(user: bool = False, sys_prefix: bool = False, prefix: str | None = None, python: str | None = None) -> str:
    """Install the kernelspec; return the folder it went to.

    Args:
        user: into the user's Jupyter data dir (``~/.local/share/jupyter/kernels``).
        sys_prefix: into this environment (``sys.prefix/share/jupyter/kernels``), the default.
        prefix: into ``PREFIX/share/jupyter/kernels`` (tests use a temporary one).
        python: the interpreter the kernel runs (default: this one).
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if user and (sys_prefix or prefix):
        raise ValueError("choose one of user, sys_prefix and prefix")
    if not user and prefix is None:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, KERNEL_NAME)
        os.makedirs(folder)
        with open(os.path.join(folder, "kernel.json"), "w") as f:
            json.dump(kernel_spec(python), f, indent=2)
        for logo in ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg"):
            src = os.path.join(_repo_kernels_dir(), KERNEL_NAME, logo)
            if os.path.exists(src):
                shutil.copy(src, folder)
        return KernelSpecManager().install_kernel_spec(folder, KERNEL_NAME, user=user, prefix=None if user else prefix)


def _repo_kernels_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
