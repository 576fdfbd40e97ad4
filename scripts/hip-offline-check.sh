#!/usr/bin/env bash
# Offline compile check of hip_ext's GPU kernels, on a machine with no GPU (run by `make test`
# through tests/test_hip_ext.py, and by hand).
#
# 1. HIP (mandatory): Debian's hipcc (HIP_PLATFORM=amd: with an nvcc on PATH hipcc would pick the
#    NVIDIA platform) compiles each kernel file as HIP device code for gfx90a (MI200) and gfx940
#    (CDNA3: the newest one Debian 12's clang 15 knows; MI300X/MI325X are gfx942, which needs a
#    newer LLVM), with -Wall -Wextra -Werror.
# 2. CUDA: nvcc compiles the same files for sm_80 and sm_90, warnings as errors. Skipped, and said
#    so, only where no nvcc is on PATH and none could be installed from PyPI.
# 3. Binding: the host compiler compiles ops_cuda.cpp (the torch binding of the GPU kernels) to an
#    object against torch's CUDA headers and the CUDA runtime headers, -O1 with warnings as errors
#    (nothing to link with here). An object, not -fsyntax-only: the middle end's warnings (an
#    infinite recursion, once) only come from a real compile.
#
# The kernel files include only hip_ext/csrc's own headers, never torch's, which is what makes 1
# and 2 possible without a GPU build of torch. Compilers missing here are installed first
# (scripts/install-gpu-compilers.sh).
#
# Usage: scripts/hip-offline-check.sh [OUTDIR]   (default build/hip-offline)
# Writes OUTDIR/<kernel>.hip.o and OUTDIR/<kernel>.cuda.o (or OUTDIR/SKIPPED-cuda with the reason),
# each compiler's output in OUTDIR/*.log, and prints one table.
# Exit status: 0 passed; 1 a compile failed or warned; 3 hipcc is missing and could not be installed.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/build/hip-offline}"
CSRC="$ROOT/hip_ext/csrc"
KERNELS="grad_health checksum"
HIP_ARCHS="gfx90a gfx940"
CUDA_ARCHS="80 90"
NVCC_PREFIX="${MNB_NVCC_PREFIX:-$ROOT/build/nvcc}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"

rm -rf "$OUT"
mkdir -p "$OUT"
bash "$ROOT/scripts/install-gpu-compilers.sh"
rows=()
failed=0
elapsed() { local ms=$((($(date +%s%N) - $1) / 1000000)); printf '%d.%d s' $((ms / 1000)) $((ms % 1000 / 100)); }

if ! command -v hipcc >/dev/null 2>&1; then
  echo "hip-offline-check: FAILED: no hipcc, and it could not be installed (apt-get install --no-install-recommends hipcc)"
  exit 3
fi
# the compilers' scratch space (clang's offload bundler leaves empty <kernel>-XXXXXX folders behind)
export TMPDIR="$OUT/tmp"
mkdir -p "$TMPDIR"
trap 'rm -rf "$OUT/tmp"' EXIT
hip_flags=(-x hip -O3 -Wall -Wextra -Werror -I"$CSRC")
for arch in $HIP_ARCHS; do hip_flags+=("--offload-arch=$arch"); done
hip_version="$(HIP_PLATFORM=amd hipcc --version 2>/dev/null | sed -n 's/^HIP version: //p' | head -1)"
for k in $KERNELS; do
  start=$(date +%s%N)
  if HIP_PLATFORM=amd hipcc "${hip_flags[@]}" -c "$CSRC/$k.cu" -o "$OUT/$k.hip.o" >"$OUT/$k.hip.log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed=1
    cat "$OUT/$k.hip.log"
  fi
  rows+=("$(printf '%-14s %-28s %-16s %-7s %s' "$k.cu" "hipcc (HIP ${hip_version:-?})" "${HIP_ARCHS// /,}" "$status" "$(elapsed "$start")")")
done

NVCC="$(command -v nvcc || true)"
if [ -z "$NVCC" ] && [ -x "$NVCC_PREFIX/nvidia/cu13/bin/nvcc" ]; then
  NVCC="$NVCC_PREFIX/nvidia/cu13/bin/nvcc"
fi
cuda_include=""
if [ -z "$NVCC" ]; then
  echo "no nvcc on PATH and none could be installed from PyPI (scripts/install-gpu-compilers.sh)" >"$OUT/SKIPPED-cuda"
  rows+=("$(printf '%-14s %-28s %-16s %s' "*.cu" "nvcc" "sm_${CUDA_ARCHS// /,sm_}" "SKIPPED: $(cat "$OUT/SKIPPED-cuda")")")
else
  nvcc_version="$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  top="$(cd "$OUT" && echo | "$NVCC" --dryrun -x cu -c - -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
  for dir in "$top/targets/x86_64-linux/include" "$top/include"; do
    if [ -z "$cuda_include" ] && [ -f "$dir/cuda_runtime.h" ]; then cuda_include="$dir"; fi
  done
  nvcc_flags=(-x cu -O3 -Werror all-warnings -Xcompiler=-Wall,-Wextra,-Werror -I"$CSRC")
  for arch in $CUDA_ARCHS; do nvcc_flags+=(-gencode "arch=compute_$arch,code=sm_$arch"); done
  for k in $KERNELS; do
    start=$(date +%s%N)
    if "$NVCC" "${nvcc_flags[@]}" -c "$CSRC/$k.cu" -o "$OUT/$k.cuda.o" >"$OUT/$k.cuda.log" 2>&1; then
      status=ok
    else
      status=FAILED
      failed=1
      cat "$OUT/$k.cuda.log"
    fi
    rows+=("$(printf '%-14s %-28s %-16s %-7s %s' "$k.cu" "nvcc $nvcc_version" "sm_${CUDA_ARCHS// /,sm_}" "$status" "$(elapsed "$start")")")
  done
fi

# The binding, against torch's CUDA headers. CPU wheels of torch ship those headers but not the
# generated c10/cuda/impl/cuda_cmake_macros.h: a one-line stand-in is made for the check.
torch_include="$("$PY" -c 'from torch.utils.cpp_extension import include_paths; print(":".join(include_paths()))' 2>/dev/null || true)"
if [ -n "$torch_include" ] && [ -n "$cuda_include" ]; then
  stub="$OUT/stub-include"
  mkdir -p "$stub/c10/cuda/impl"
  if [ ! -f "${torch_include%%:*}/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
  fi
  inc=()
  IFS=: read -r -a tdirs <<<"$torch_include"
  for d in "${tdirs[@]}" "$stub" "$cuda_include"; do inc+=(-isystem "$d"); done
  start=$(date +%s%N)
  if "${CXX:-c++}" -std=c++17 -c -O1 -Wall -Wextra -Werror "${inc[@]}" -I"$CSRC" "$CSRC/ops_cuda.cpp" \
      -o "$OUT/ops_cuda.host.o" >"$OUT/ops_cuda.log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed=1
    cat "$OUT/ops_cuda.log"
  fi
  rows+=("$(printf '%-14s %-28s %-16s %-7s %s' "ops_cuda.cpp" "${CXX:-c++} -c -O1" "torch CUDA API" "$status" "$(elapsed "$start")")")
else
  rows+=("$(printf '%-14s %-28s %-16s %s' "ops_cuda.cpp" "${CXX:-c++} -c -O1" "torch CUDA API" "SKIPPED: no torch or no CUDA headers")")
fi

echo "hip-offline-check: kernel files compiled offline (objects in $OUT)"
printf '%-14s %-28s %-16s %-7s %s\n' "source" "compiler" "targets" "result" "time"
printf '%s\n' "${rows[@]}"
exit $failed
