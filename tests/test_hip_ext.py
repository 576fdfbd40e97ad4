"""hip_ext: grad_health and checksum, their pure-torch references, the compiled CPU kernels behind
the same op names, and the offline HIP/CUDA compile of the GPU kernels."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hip_ext
from hip_ext import _reference

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "hip_ext" / "csrc"
KERNEL_FILES = ("grad_health.cu", "checksum.cu")

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def compiled_cpu():
    assert "CPU" in hip_ext.load(), "the C++ CPU kernels did not build (see the hip_ext log line)"
    for op in ("grad_health", "checksum"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"monarch_nb::{op}", "CPU")


# -- checksum: an independent implementation of the documented formula, on Python ints ---------------
_M = (1 << 64) - 1


def _spec_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def _spec_checksum(data: bytes) -> int:
    padded = data + b"\0" * (-len(data) % 8)
    total = _spec_splitmix64(len(data) ^ 0xD6E8FEB86659FD93)
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        total += _spec_splitmix64(word ^ ((i * 0x9E3779B97F4A7C15) & _M))
    total &= _M
    return total - (1 << 64) if total >= 1 << 63 else total


def _bytes_of(x: torch.Tensor) -> bytes:
    return x.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _checksum_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    cases = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in range(0, 18)]
    base = torch.randn(37, 11, generator=g)
    cases += [
        base,
        base.t(),  # non-contiguous: the bytes of its contiguous copy
        base[::3, 1:],
        base.to(torch.float16),
        base.to(torch.bfloat16)[:, :5],
        base.double(),
        torch.tensor(3.5),  # 0-dim
        torch.zeros(0, 4),
        torch.tensor([True, False, True]),
        torch.randn(5, dtype=torch.complex64, generator=g).conj(),  # conjugate bit resolved
        torch.arange(-6, 7, dtype=torch.int64),
        torch.randn(10, generator=g)[1:],  # contiguous, at a 4-byte offset
        torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g)[3:],  # at an odd byte offset
    ]
    return cases


def test_checksum_reference_follows_the_documented_formula():
    for x in _checksum_cases():
        assert int(hip_ext.checksum_reference(x)) == _spec_checksum(_bytes_of(x)), (x.dtype, tuple(x.shape))


def test_checksum_tells_apart_lengths_orders_and_single_bit_flips():
    a = torch.zeros(4, dtype=torch.uint8)
    assert len({hip_ext.checksum(torch.zeros(n, dtype=torch.uint8)) for n in range(0, 17)}) == 17
    x = torch.arange(64, dtype=torch.float32)
    flipped = x.clone()
    flipped.view(torch.int32)[40] ^= 1
    swapped = x.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    values = {hip_ext.checksum(x), hip_ext.checksum(flipped), hip_ext.checksum(swapped), hip_ext.checksum(a)}
    assert len(values) == 4
    assert hip_ext.checksum(x) == hip_ext.checksum(x.view(torch.int32)) == hip_ext.checksum(x.view(torch.uint8))
    with pytest.raises(RuntimeError, match="dense"):
        hip_ext.checksum(torch.eye(3).to_sparse())


def test_checksum_reference_is_the_same_for_any_chunking(monkeypatch):
    x = torch.randn(10_001)  # 40_004 bytes: 5_000 words and a 4-byte tail
    whole = int(hip_ext.checksum_reference(x))
    for words_per_piece in (1, 7, 4096):
        monkeypatch.setattr(_reference, "_HALF_WORDS", words_per_piece)
        assert int(hip_ext.checksum_reference(x)) == whole


@needs_compiler
def test_cpu_checksum_kernel_matches_the_reference_for_any_bytes(compiled_cpu):
    for x in _checksum_cases():
        got = torch.ops.monarch_nb.checksum(x)
        assert got.dtype == torch.int64 and got.shape == ()
        assert int(got) == int(hip_ext.checksum_reference(x)), (x.dtype, tuple(x.shape))


@needs_compiler
def test_cpu_checksum_is_the_same_for_any_split_over_threads(compiled_cpu):
    # pieces of 65536 words per task: 3 pieces and a tail over 1 or 2 threads, and the reference's
    # own chunking, must all give one value
    x = torch.randint(0, 256, (3 * 65536 * 8 + 5 * 8 + 3,), dtype=torch.uint8)
    threads = torch.get_num_threads()
    try:
        values = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            values.add(hip_ext.checksum(x))
    finally:
        torch.set_num_threads(threads)
    values.add(int(hip_ext.checksum_reference(x)))
    assert len(values) == 1


# -- grad_health -----------------------------------------------------------------------------------
def test_grad_health_reference_values():
    got = hip_ext.grad_health_reference(
        [torch.tensor([3.0, float("nan")]), torch.tensor([[4.0, float("inf")]]), torch.tensor([float("-inf")]).half()])
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got.tolist() == [25.0, 3.0]
    assert hip_ext.grad_health_reference([]).tolist() == [0.0, 0.0]
    assert hip_ext.grad_health_reference([torch.empty(0), torch.empty(3, 0)]).tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16 or float64 tensors; tensor 1 is torch.int64"):
        hip_ext.grad_health_reference([torch.ones(2), torch.ones(2, dtype=torch.int64)])


def _gradients(seed: int) -> list[torch.Tensor]:
    """Random sizes around the kernels' chunk boundaries, four dtypes, strided views, NaN/Inf at
    the first and last elements, float16 subnormals and extremes, float32 values whose squares
    overflow float32."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 7, 1023, 1024, 1025, 65535, 65536, 65537, 200_003]
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    out = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, generator=g).to(dtypes[i % 4])
        if i % 3 == 0:
            x[0] = float("nan")
        if i % 3 == 1:
            x[-1] = float("inf")
        if i % 4 == 2:
            x[0], x[-1] = float("-inf"), float("nan")
        out.append(x)
    m = torch.randn(300, 257, generator=g)
    m[0, 0], m[-1, -1] = float("nan"), float("-inf")
    out += [
        m.t(),  # transposed: first and last element poisoned
        m[::7, 3:],
        torch.randn(513, 129, generator=g).half().t()[5:],
        torch.tensor([6.0e-8, -6.1e-5, 65504.0, -65504.0, 0.0, -0.0], dtype=torch.float16),  # subnormal .. max
        torch.tensor([3.0e38, 1.0e20, -1.0e-40], dtype=torch.float32),  # squares beyond float32's range
        torch.tensor([1.0e38, -3.0e38], dtype=torch.bfloat16),
        torch.empty(0),
        torch.empty(4, 0, dtype=torch.bfloat16),
    ]
    return out


@needs_compiler
def test_cpu_grad_health_kernel_matches_the_reference(compiled_cpu):
    for seed in range(3):
        grads = _gradients(seed)
        got = torch.ops.monarch_nb.grad_health(grads)
        want = hip_ext.grad_health_reference(grads)
        assert got.dtype == torch.float64 and got.shape == (2,)
        assert got[1].item() == want[1].item() > 0
        assert got[0].item() == pytest.approx(want[0].item(), rel=1e-12)
        for t in grads:  # each tensor on its own, too
            one, ref = hip_ext.grad_health([t]), hip_ext.grad_health_reference([t])
            assert one[1].item() == ref[1].item()
            assert one[0].item() == pytest.approx(ref[0].item(), rel=1e-12, abs=1e-300)


@needs_compiler
def test_cpu_grad_health_counts_every_kind_of_non_finite_value(compiled_cpu):
    for dtype in hip_ext.HEALTH_DTYPES:
        x = torch.ones(70_000, dtype=dtype)
        x[0], x[1], x[-2], x[-1] = float("nan"), float("inf"), float("-inf"), -float("nan")
        assert hip_ext.grad_health([x]).tolist() == [70_000 - 4, 4.0], dtype


@needs_compiler
def test_cpu_grad_health_reads_every_16_bit_pattern_exactly(compiled_cpu):
    # all 65536 bit patterns of float16 and bfloat16, one exponent at a time (both signs), so a
    # wrong subnormal or a wrong large value is not hidden under bigger squares
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for dtype, exponent_shift, exponents in ((torch.float16, 10, 32), (torch.bfloat16, 7, 256)):
        values = bits.view(dtype)
        exponent = (bits.to(torch.int32) >> exponent_shift) & (exponents - 1)
        for e in range(exponents):
            group = values[exponent == e]
            got, want = hip_ext.grad_health([group]), hip_ext.grad_health_reference([group])
            assert got[1].item() == want[1].item() == (group.numel() if e == exponents - 1 else 0)
            assert got[0].item() == pytest.approx(want[0].item(), rel=1e-13), (dtype, e)


@needs_compiler
def test_cpu_grad_health_empty_inputs_and_errors(compiled_cpu):
    assert hip_ext.grad_health([]).tolist() == [0.0, 0.0]
    assert hip_ext.grad_health([torch.empty(0), torch.empty(2, 0).half()]).tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16 or float64 tensors; tensor 1 is Long"):
        hip_ext.grad_health([torch.ones(2), torch.ones(2, dtype=torch.int64)])


@needs_compiler
def test_grad_health_over_a_real_model(compiled_cpu):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model(torch.randn(32, 64)).square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    sum_sq, nonfinite = hip_ext.grad_health(grads).tolist()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])).item()
    assert nonfinite == 0 and sum_sq ** 0.5 == pytest.approx(norm, rel=1e-12)


def test_without_a_compiler_load_logs_one_line_and_the_references_serve():
    code = """
import logging, torch, hip_ext
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
print(hip_ext.load(), hip_ext.load())
print(hip_ext.grad_health([torch.tensor([3.0, float("nan")]), torch.tensor([4.0])]).tolist())
print(hip_ext.checksum(torch.arange(3)) == int(hip_ext.checksum_reference(torch.arange(3))))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), CXX="no-such-compiler"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[] []", "[25.0, 1.0]", "True"]
    logged = [line for line in proc.stderr.splitlines() if line.startswith("hip_ext")]
    assert logged == ["hip_ext._build WARNING hip_ext: no C++ compiler ('no-such-compiler' is not on PATH); "
                      "grad_health and checksum use the pure-torch reference"]


@needs_compiler
def test_a_lock_left_by_a_killed_build_does_not_block_the_next_one(tmp_path):
    # cpp_extension's own lock is a plain file: a build killed mid-way leaves it, and every later
    # load would wait on it forever. load() holds an OS lock around it, so it knows the file is stale.
    code = "import hip_ext; print(hip_ext.load())"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_EXTENSIONS_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170, env=env)
    assert first.stdout.strip() == "['CPU']", first.stderr
    (build_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("monarch_nb_hip_ext")]
    (build_dir / "lock").touch()  # what a SIGKILLed builder leaves
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert again.stdout.strip() == "['CPU']", again.stderr
    assert "removing a build lock left by a killed build" in again.stderr
    assert not (build_dir / "lock").exists()


def test_readme_example_and_docstring_examples_run():
    import doctest

    from hip_ext import _ops

    section = (ROOT / "README.md").read_text().split("## hip_ext:", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[25.0, 1.0]", "True"]
    result = doctest.testmod(_ops)
    assert result.attempted >= 4 and result.failed == 0


# -- the GPU kernel sources ------------------------------------------------------------------------
def _code(path: Path) -> str:
    """Source without comments."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def test_kernel_files_include_only_the_portable_headers_and_name_no_warp_size():
    own = {p.name for p in CSRC.glob("*.h")}
    for name in KERNEL_FILES + tuple(sorted(own)):
        code = _code(CSRC / name)
        for quoted in re.findall(r'#include\s+"([^"]+)"', code):
            assert quoted in own, f"{name} includes {quoted}, not one of hip_ext/csrc's headers"
        system = re.findall(r"#include\s+<([^>]+)>", code)
        assert not [s for s in system if s.split("/")[0] in ("torch", "ATen", "c10", "cuda_fp16.h")], (name, system)
    for name in KERNEL_FILES + ("portable.h", "launch.h"):
        code = _code(CSRC / name)
        assert not re.search(r"\b(32|64)\b|0xffffffff", code, flags=re.I), f"{name} names a warp size or a 32-bit mask"
        assert "__shfl" not in code or name == "portable.h", f"{name} shuffles outside the portable header"


def _elf_section(path: Path, name: str) -> bytes:
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF", path
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name_offset, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names_at + name_offset)
        if data[names_at + name_offset : end].decode() == name:
            return data[offset : offset + size]
    raise AssertionError(f"{path} has no {name} section")


def _amd_code_objects(obj: Path) -> dict[str, bytes]:
    """The clang offload bundle of a HIP object: {bundle id: code object}."""
    bundle = _elf_section(obj, ".hip_fatbin")
    assert bundle.startswith(b"__CLANG_OFFLOAD_BUNDLE__")
    (count,) = struct.unpack_from("<Q", bundle, 24)
    pos, out = 32, {}
    for _ in range(count):
        offset, size, id_len = struct.unpack_from("<QQQ", bundle, pos)
        ident = bundle[pos + 24 : pos + 24 + id_len].decode()
        pos += 24 + id_len
        out[ident] = bundle[offset : offset + size]
    return out


def _cuda_cubin_archs(obj: Path) -> list[int]:
    """SM versions of the cubins (ELF entries) in a CUDA object's fatbinary."""
    fatbin = _elf_section(obj, ".nv_fatbin")
    magic, _version, header_size, total = struct.unpack_from("<IHHQ", fatbin, 0)
    assert magic == 0xBA55ED50
    pos, archs = header_size, []
    while pos < header_size + total:
        kind, _, entry_header, size = struct.unpack_from("<HHIQ", fatbin, pos)
        (arch,) = struct.unpack_from("<I", fatbin, pos + 28)
        if kind == 2:  # ELF (cubin); 1 would be PTX
            archs.append(arch)
        pos += entry_header + size
    return sorted(archs)


@pytest.mark.timeout(900)
def test_offline_check_compiles_the_kernels_for_amd_and_nvidia_targets(tmp_path):
    import tempfile

    temp = Path(tempfile.gettempdir())
    before = set(os.listdir(temp))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "hip-offline-check.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=850)
    output = proc.stdout + proc.stderr
    left = sorted(n for n in set(os.listdir(temp)) - before if n.startswith(("grad_health-", "checksum-")))
    assert not left, f"the compilers left scratch folders in {temp}: {left}"
    if proc.returncode == 3:
        if os.environ.get("CI"):
            pytest.fail("hipcc is missing in CI and could not be installed (apt-get install hipcc):\n" + output)
        pytest.skip("hipcc is missing and this user cannot install it (needs root): apt-get install hipcc")
    assert proc.returncode == 0, output
    for name in KERNEL_FILES:
        stem = name.removesuffix(".cu")
        objects = _amd_code_objects(tmp_path / f"{stem}.hip.o")
        for arch in ("gfx90a", "gfx940"):
            code = objects[f"hipv4-amdgcn-amd-amdhsa--{arch}"]
            assert code[:4] == b"\x7fELF" and f"mnb_{stem}_kernel".encode() in code, (name, arch)
            assert b".wavefront_size\x40" in code, f"{name} for {arch} is not built for 64-lane wavefronts"
        if (tmp_path / "SKIPPED-cuda").exists():
            continue
        assert _cuda_cubin_archs(tmp_path / f"{stem}.cuda.o") == [80, 90], name
    if (tmp_path / "SKIPPED-cuda").exists():
        warnings.warn("the offline check skipped its CUDA half: " + (tmp_path / "SKIPPED-cuda").read_text().strip(), stacklevel=1)
    assert "ops_cuda.cpp" in output
