#!/usr/bin/env bash
# Create the project's virtual environment (default .venv) and install monarch_nb into it.
# A torch that the system Python already has (a ROCm build on an AMD host, a CUDA build) is
# kept: the venv then sees system packages and pip never replaces it. Elsewhere the pinned CPU
# build torch==2.13.0 is installed (an open range would pull a multi-GB CUDA build).
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-dev,llm}"  # llm: transformers, for the "llama" workload and its tests
if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup-venv: using the preinstalled torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup-venv: installing torch==2.13.0 (CPU build)"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
# build hip_ext's kernels now (cached per version of their sources), not in the first training step
"$VENV/bin/python" -c "import hip_ext; keys = hip_ext.load(); print('setup-venv: hip_ext kernels:', ', '.join(keys) or 'none (pure-torch reference)')"
touch "$VENV/.installed"
echo "setup-venv: ready ($VENV)"
