#!/usr/bin/env bash
# Compilers for the offline GPU compile check (scripts/hip-offline-check.sh), installed when missing:
# - Debian's hipcc (apt package `hipcc`, clang 15 + ROCm 5.2 headers, ~140 MB), which needs root or
#   sudo without a password; without either it says how and leaves it: the check's test then skips
#   outside CI and fails in CI;
# - NVIDIA's nvcc from PyPI wheels (nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt,
#   nvidia-cuda-runtime: ~100 MB download, no root) into build/nvcc, when no nvcc is on PATH.
# Never fails itself: hip-offline-check.sh reports what is still missing.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NVCC_PREFIX="${MNB_NVCC_PREFIX:-$ROOT/build/nvcc}"
CUDA_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96"

if ! command -v hipcc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    SUDO=""
  elif sudo -n true >/dev/null 2>&1; then
    SUDO="sudo -n"
  else
    SUDO="none"
    echo "install-gpu-compilers: hipcc is missing; run 'sudo apt-get install --no-install-recommends hipcc' for the offline HIP check"
  fi
  if [ "$SUDO" != none ]; then
    echo "install-gpu-compilers: installing Debian's hipcc (apt)"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends hipcc >/dev/null \
      || echo "install-gpu-compilers: could not install hipcc; the offline HIP check will fail in CI"
  fi
fi

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x "$NVCC_PREFIX/nvidia/cu13/bin/nvcc" ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
  [ -x "$PY" ] || PY=python3
  echo "install-gpu-compilers: installing nvcc 13.0 from PyPI wheels into $NVCC_PREFIX"
  # shellcheck disable=SC2086 # the wheel list is split on purpose
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$NVCC_PREFIX" $CUDA_WHEELS \
    || echo "install-gpu-compilers: could not install nvcc; the offline check will skip its CUDA half"
fi
exit 0
