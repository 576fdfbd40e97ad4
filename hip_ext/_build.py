"""Building and loading the compiled kernels with torch's ``cpp_extension``, at first use.

:func:`load` builds (or reuses the cached build of) ``csrc/`` and registers its kernels for the
``CPU`` key, plus the ``CUDA`` key on CUDA and ROCm builds of torch with a visible GPU (the
``.cu`` files are hipified into HIP by ``cpp_extension`` on ROCm). It never raises: a missing
compiler, a missing ninja or a failed build logs one line and leaves the pure-torch references.

The build lives under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), one
directory per torch and Python version. Procs that start together wait for one build under an
OS file lock, which, unlike ``cpp_extension``'s own lock file, dies with its holder: a proc killed
mid-build (a fault, a notebook restart) cannot leave the others waiting forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

__all__ = ["load", "compiled"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
#: what csrc/ holds: kernels (.cu) and the headers they share (.h, no torch header), bindings
#: (.cpp) and the headers only bindings include (.hpp, which may include torch's)
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cu")
CPU_SOURCES = ("ops_cpu.cpp",)
GPU_SOURCES = ("ops_cuda.cpp", "grad_health.cu", "checksum.cu")

_lock = threading.Lock()
_attempted = False
_compiled: list[str] = []


def compiled() -> list[str]:
    """The dispatch keys served by compiled kernels (``"CPU"``, ``"CUDA"``); empty: the references only."""
    return list(_compiled)


def load(verbose: bool = False) -> list[str]:
    """Build (or reuse the cached build of) the kernels and register them. Idempotent, thread-safe.

    Args:
        verbose: show the compiler's command lines and output.

    Returns:
        The dispatch keys now served by compiled kernels: ``["CPU"]``, ``["CPU", "CUDA"]``, or
        ``[]`` where nothing could be built (then the references serve every device).
    """
    global _attempted
    with _lock:
        if not _attempted:
            _attempted = True
            _compiled.extend(_build(verbose))
        return compiled()


def _missing_toolchain() -> str | None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    venv_bin = os.path.dirname(sys.executable)  # the venv's ninja, when the venv is not activated
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    if not cpp_extension.is_ninja_available():
        return "no ninja (pip install ninja)"
    return None


def _gpu_toolchain() -> str | None:
    """Why the GPU kernels cannot be built here, or None when they can."""
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        return "no GPU visible"
    if torch.version.hip is not None:
        return None if cpp_extension.ROCM_HOME else "ROCm torch without ROCM_HOME (hipcc)"
    return None if cpp_extension.CUDA_HOME else "CUDA torch without CUDA_HOME (nvcc)"


def _build(verbose: bool) -> list[str]:
    missing = _missing_toolchain()
    if missing is not None:
        log.warning("hip_ext: %s; grad_health and checksum use the pure-torch reference", missing)
        return []
    attempts: list[tuple[tuple[str, ...], list[str]]] = [(CPU_SOURCES, ["CPU"])]
    gpu_missing = _gpu_toolchain()
    if gpu_missing is None:
        attempts.insert(0, (CPU_SOURCES + GPU_SOURCES, ["CPU", "CUDA"]))
    elif torch.version.cuda is not None or torch.version.hip is not None:
        log.info("hip_ext: GPU kernels not built: %s", gpu_missing)
    error: BaseException | None = None
    for sources, keys in attempts:
        try:
            _compile(sources, gpu=len(keys) > 1, verbose=verbose)
            return keys
        except Exception as exc:  # noqa: BLE001 - a compiler error, a linker error, a bad cache: fall back
            error = exc
            if len(keys) > 1:
                log.warning("hip_ext: building the GPU kernels failed (%s); trying the CPU kernels", _first_line(exc))
    log.warning("hip_ext: building the kernels failed (%s); grad_health and checksum use the pure-torch reference",
                _first_line(error))
    return []


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


def _compile(sources: tuple[str, ...], gpu: bool, verbose: bool) -> None:
    from torch.utils import cpp_extension

    name = "monarch_nb_hip_ext" + ("_gpu" if gpu else "")
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    flavour = torch.version.hip and "hip" or torch.version.cuda and "cuda" or "cpu"
    # one folder per version of the sources: two checkouts (or a rebuilt venv) never fight over one
    version = _sources_digest(CSRC)[:12]
    build_dir = root / f"{name}-{version}-torch{torch.__version__.split('+')[0]}-{flavour}-py{sys.version_info[0]}{sys.version_info[1]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the OS if this proc dies
        baton = build_dir / "lock"  # cpp_extension's lock file: only a dead builder can have left it here
        if baton.exists():
            log.warning("hip_ext: removing a build lock left by a killed build: %s", baton)
            baton.unlink(missing_ok=True)
        src = _stage_sources(build_dir / "csrc")
        digest = version  # in the flags too: cpp_extension hashes the sources, not the headers they include
        # at::parallel_reduce is a header template whose threads are an `omp parallel` region: it
        # runs on one thread unless the extension is built with -fopenmp (linked to the libgomp
        # torch already loaded, by soname). -fopenmp-simd alone keeps the `omp simd` loops.
        openmp = ["-fopenmp"] if torch._C.has_openmp and sys.platform.startswith("linux") else []
        cpp_extension.load(
            name=name,
            sources=[str(src / s) for s in sources],
            extra_cflags=["-O3", "-fopenmp-simd", *openmp, f"-DMNB_HEADERS={digest}"],
            extra_cuda_cflags=["-O3", f"-DMNB_HEADERS={digest}"],
            extra_ldflags=openmp,
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )


def _stage_sources(dest: Path) -> Path:
    """Copy csrc/ into the build directory (hipify writes next to the sources; the package may be
    read-only). Files whose content is unchanged are left alone, so ninja sees no change."""
    dest.mkdir(exist_ok=True)
    for path in CSRC.iterdir():
        if path.suffix in SOURCE_SUFFIXES:
            target = dest / path.name
            if not target.exists() or target.read_bytes() != path.read_bytes():
                tmp = target.with_suffix(target.suffix + f".tmp{os.getpid()}")
                shutil.copyfile(path, tmp)
                os.replace(tmp, target)
    return dest


def _sources_digest(src: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(src.iterdir()):
        if path.suffix in SOURCE_SUFFIXES:
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()
