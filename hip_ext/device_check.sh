#!/usr/bin/env bash
# hip_ext on a lent GPU machine (NVIDIA with CUDA torch, or AMD with ROCm torch), in under 4
# minutes, one table: builds the GPU path with cpp_extension, checks grad_health and checksum
# against the references on the GPU, measures grad_health's GB/s against torch._foreach_norm +
# isfinite on 1 GiB of gradients in 200 tensors, and trains the default workload for 200 steps
# with `monarch-nb train --procs 1` (nccl) and `--procs 2` (gloo). See hip_ext/device_check.py.
#
# Usage: hip_ext/device_check.sh [extra args for python -m hip_ext.device_check]
# Needs a Python with a GPU build of torch, ninja, pyzmq, cloudpickle and scikit-learn (the default
# workload); PYTHON picks it (default: the repo's .venv when its torch sees a GPU, else python3).
# The machine needs no network: the build is local, in build/device-check/torch_extensions.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PYTHON=.venv/bin/python
  fi
fi
missing="$("$PYTHON" - <<'EOF'
import importlib.util, shutil
need = ["torch", "zmq", "cloudpickle", "numpy", "sklearn"]
gone = [m for m in need if importlib.util.find_spec(m) is None]
if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
    gone.append("ninja")
print(" ".join(gone))
EOF
)"
if [ -n "$missing" ]; then
  echo "device_check: $PYTHON lacks: $missing"
  exit 1
fi
export PATH="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')"):$PATH"  # its ninja
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="$ROOT/build/device-check/torch_extensions"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then  # build for the GPU that is here only (a faster build)
  arch="$("$PYTHON" -c 'import torch; p = torch.cuda.get_device_capability(0); print(f"{p[0]}.{p[1]}") if torch.version.cuda else print("")' 2>/dev/null)"
  [ -n "$arch" ] && export TORCH_CUDA_ARCH_LIST="$arch"
fi
exec timeout 235 "$PYTHON" -m hip_ext.device_check --out "$ROOT/build/device-check" "$@"
