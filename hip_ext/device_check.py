"""hip_ext on a real GPU: build, correctness against the references, bandwidth, and training.

    python -m hip_ext.device_check [--device cuda] [--gib 1.0] [--steps 200] [--out DIR]

Run by ``hip_ext/device_check.sh`` on a lent GPU machine (NVIDIA, or AMD with ROCm torch: both
are torch's "cuda" device). ``--device cpu`` runs the same checks on the CPU kernels (a dry run
of this harness where no GPU is lent). Prints one table and writes ``DIR/device_check.json``:

- build: ``hip_ext.load()`` builds the CUDA/HIP path with ``cpp_extension``;
- grad_health: the GPU kernel against the reference on the GPU (sizes around the chunk size,
  fp32/fp16/bf16/fp64, strided views, NaN/Inf at the first and last elements, every 16-bit
  pattern, empty inputs); checksum: GPU kernel == CPU kernel == reference, for odd sizes, odd
  byte offsets and several dtypes;
- bandwidth: ``--gib`` GiB of float32 gradients in 200 tensors: grad_health, the torch idiom
  ``torch._foreach_norm`` + ``isfinite``, checksum, and a device-to-device copy of the same bytes;
- training: ``monarch-nb train`` of the default workload for ``--steps`` steps, ``--procs 1``
  with nccl (gloo on the CPU), and ``--procs 2`` with gloo, in steps/s.

Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import _reference, compiled, load

ROOT = Path(__file__).resolve().parent.parent


def _time(fn, device: torch.device, repeats: int = 10) -> float:
    """Median seconds of fn() after two warm-up calls, synchronizing the device around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _gradients(device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    out = []
    for i, n in enumerate([1, 255, 256, 65535, 65536, 65537, (1 << 20) + 3, 3_000_001]):
        x = torch.randn(n, generator=g).to(dtypes[i % 4])
        if i % 2 == 0:
            x[0] = float("nan")
        if i % 3 == 0:
            x[-1] = float("-inf")
        out.append(x)
    m = torch.randn(1000, 513, generator=g)
    m[0, 0], m[-1, -1] = float("inf"), float("nan")
    out += [m.t(), m[::3, 7:], torch.empty(0), torch.empty(3, 0, dtype=torch.bfloat16)]
    return [t.to(device) for t in out]


def check_grad_health(device: torch.device) -> tuple[bool, str]:
    op = torch.ops.monarch_nb.grad_health
    worst = 0.0
    for seed in range(3):
        grads = _gradients(device, seed)
        got, want = op(grads).cpu(), _reference.grad_health_reference(grads).cpu()
        if got[1] != want[1]:
            return False, f"seed {seed}: non-finite count {got[1].item()} != {want[1].item()}"
        worst = max(worst, abs(got[0].item() - want[0].item()) / want[0].item())
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for dtype, shift, exponents in ((torch.float16, 10, 32), (torch.bfloat16, 7, 256)):
        exponent = (bits.to(torch.int32) >> shift) & (exponents - 1)
        for e in range(exponents - 1):  # every finite exponent: no big square hides a wrong small one
            group = bits.view(dtype)[exponent == e].to(device)
            got, want = op([group]).cpu(), _reference.grad_health_reference([group]).cpu()
            if got[1] != 0 or (want[0] > 0 and abs(got[0] - want[0]) / want[0] > 1e-12):
                return False, f"{dtype} exponent {e}: {got.tolist()} != {want.tolist()}"
    if op([]).tolist() != [0.0, 0.0] or op([torch.empty(0, device=device)]).tolist() != [0.0, 0.0]:
        return False, "empty inputs"
    if worst > 1e-9:
        return False, f"relative error of the sum of squares {worst:.1e}"
    return True, f"counts exact, sum of squares within {worst:.1e}, 65536 patterns x 2 dtypes exact"


def check_checksum(device: torch.device) -> tuple[bool, str]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (5_000_011,), dtype=torch.uint8, generator=g)
    cases = [base[:n] for n in range(0, 18)] + [
        base, base[3:], base[5:4_000_007],  # odd byte offsets and lengths
        torch.randn(1 << 22, generator=g), torch.randn(999, 1001, generator=g).t(),
        torch.randn(12_345, generator=g).half(), torch.randn(7, dtype=torch.complex64, generator=g).conj(),
        torch.tensor(2.5), torch.tensor([True, False, True]),
    ]
    for i, x in enumerate(cases):
        on_device = int(torch.ops.monarch_nb.checksum(x.to(device)))
        on_cpu = int(torch.ops.monarch_nb.checksum(x))
        reference = int(_reference.checksum_reference(x.to(device)))
        if not on_device == on_cpu == reference:
            return False, f"case {i} ({x.dtype}, {tuple(x.shape)}): device {on_device}, cpu {on_cpu}, reference {reference}"
    return True, f"{len(cases)} tensors: device == CPU kernel == reference"


def bandwidth(device: torch.device, gib: float) -> dict:
    total = int(gib * (1 << 30)) // 4
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(200, generator=g) + 0.05
    sizes = (weights / weights.sum() * total).long().tolist()
    sizes[-1] += total - sum(sizes)
    grads = [torch.randn(n, device=device) for n in sizes]
    nbytes = 4 * total
    flat = torch.empty(total, device=device)
    flat2 = torch.empty_like(flat)

    def torch_idiom():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        finite = torch.stack([torch.isfinite(t).all() for t in grads]).all()
        return norm, finite

    times = {
        "grad_health": _time(lambda: torch.ops.monarch_nb.grad_health(grads), device),
        "foreach_norm_isfinite": _time(torch_idiom, device),
        "checksum": _time(lambda: [torch.ops.monarch_nb.checksum(t) for t in grads], device),
        "copy": _time(lambda: flat2.copy_(flat), device),
    }
    return {key: {"median_s": t, "gb_per_s": nbytes / t / 1e9} for key, t in times.items()} | {"bytes": nbytes}


def train(procs: int, backend: str, steps: int, out: Path) -> dict:
    report = out / f"train-procs{procs}-{backend}.json"
    cmd = [sys.executable, "-m", "monarch_nb.cli", "train", "--procs", str(procs), "--steps", str(steps),
           "--backend", backend, "--eval-every", "0", "--no-progress", "--report-json", str(report)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    if proc.returncode != 0:
        return {"ok": False, "detail": (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]}
    data = json.loads(report.read_text())
    return {"ok": data["steps"] == steps, "steps": data["steps"], "wall_time_s": data["wall_time_s"],
            "steps_per_s": data["steps"] / data["wall_time_s"], "final_loss": data["final_loss"],
            "backend": data["backend"], "total_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (NVIDIA or ROCm torch) or cpu (a dry run)")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of float32 gradients for the bandwidth rows")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "device-check", help="JSON and training reports")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    key = "CUDA" if device.type == "cuda" else "CPU"
    rows: list[tuple[str, str, str]] = []
    results: dict = {"device": args.device, "torch": torch.__version__, "hip": torch.version.hip,
                     "cuda": torch.version.cuda}
    failed = False
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("device_check: torch sees no GPU (torch", torch.__version__, ")")
            return 1
        props = torch.cuda.get_device_properties(0)
        results["gpu"] = f"{props.name}, warp {getattr(props, 'warp_size', '?')}"
    t0 = time.monotonic()
    keys = load(verbose=False)
    results["build_s"] = time.monotonic() - t0
    ok = key in keys
    failed |= not ok
    rows.append(("build (cpp_extension)", "ok" if ok else "FAILED", f"{compiled()} in {results['build_s']:.0f} s"))
    for name, check in (("grad_health vs reference", check_grad_health), ("checksum vs CPU and reference", check_checksum)):
        ok, detail = check(device) if key in keys else (False, "no compiled kernel")
        failed |= not ok
        rows.append((name, "ok" if ok else "FAILED", detail))
    bw = bandwidth(device, args.gib)
    results["bandwidth"] = bw
    gh, idiom = bw["grad_health"], bw["foreach_norm_isfinite"]
    rows.append((f"grad_health, {args.gib:g} GiB / 200 tensors", f"{gh['gb_per_s']:.0f} GB/s",
                 f"{idiom['median_s'] / gh['median_s']:.1f}x foreach_norm+isfinite ({idiom['gb_per_s']:.0f} GB/s); "
                 f"{100 * gh['gb_per_s'] / bw['copy']['gb_per_s']:.0f}% of a copy ({bw['copy']['gb_per_s']:.0f} GB/s)"))
    rows.append((f"checksum, {args.gib:g} GiB / 200 tensors", f"{bw['checksum']['gb_per_s']:.0f} GB/s",
                 f"{100 * bw['checksum']['gb_per_s'] / bw['copy']['gb_per_s']:.0f}% of a copy"))
    for procs, backend in ((1, "nccl" if device.type == "cuda" else "gloo"), (2, "gloo")):
        run = train(procs, backend, args.steps, args.out)
        results[f"train_procs{procs}_{backend}"] = run
        failed |= not run["ok"]
        if run["ok"]:
            rows.append((f"train digits --procs {procs} ({backend})", f"{run['steps_per_s']:.1f} steps/s",
                         f"{run['steps']} steps in {run['wall_time_s']:.1f} s, final loss {run['final_loss']:.3f}"))
        else:
            rows.append((f"train digits --procs {procs} ({backend})", "FAILED", " ".join(run["detail"])))
    print(f"\nhip_ext device check — {results.get('gpu', args.device)}, torch {torch.__version__} "
          f"({'HIP ' + str(torch.version.hip) if torch.version.hip else 'CUDA ' + str(torch.version.cuda)})")
    width = max(len(r[0]) for r in rows)
    for check, result, detail in rows:
        print(f"{check:<{width}}  {result:<14}  {detail}")
    (args.out / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
