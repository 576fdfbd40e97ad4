"""hip_ext's CPU kernels on real gradients: grad_health and checksum against the pure-torch
references, torch's own idiom, SHA-256 and memcpy of the same bytes, measured in one run.

    python bench/kernels.py [--repeats 15] [--quick]

Models (gradients from one real forward/backward pass, float32):

- charlm: the transformer that ``monarch-nb train --workload charlm`` trains (default size);
- charlm-wide: the same code at d_model 512, 8 layers (a mid-size transformer);
- mlp-100M: an MLP 5120 -> 6144 -> 6144 -> 5120, 100.7 M parameters (403 MB of gradients),
  also as bfloat16.

For each, over the model's list of gradients (parameters for checksum):

- grad_health: the compiled kernel (``hip_ext.grad_health``, one pass over all tensors);
  the reference (``hip_ext.grad_health_reference``: isfinite, masked copy, float64 copy, sum per
  tensor); and torch's idiom ``torch._foreach_norm`` + ``isfinite`` (does not leave NaN out of
  the norm, so it is faster than the reference but not the same answer);
- checksum: the compiled kernel per tensor; the pure-torch reference; ``hashlib.sha256`` over the
  bytes (what replica comparison used before);
- memcpy: ``Tensor.copy_`` of one buffer of the same number of bytes (torch's threads, like the
  kernels), libc ``memmove`` on one thread, and ``copy_`` of each tensor into its twin (the same
  one call per tensor as checksum: on small models per-call overhead, not bandwidth, decides).

Bandwidth is bytes read (memcpy: bytes copied) / median time. Targets: grad_health >= 2x the
reference and >= 50% of memcpy's bandwidth; checksum >= 50% of memcpy's. "memcpy" in the
ratios is the faster of the two one-buffer copies (the bandwidth ceiling); checksum is also
compared with the per-tensor copy. The kernels and the copies are timed in interleaved
rounds (one call of each per round), so a neighbour's load on a shared machine hits them alike;
the slow peers get fewer calls, after them. Prints a table and writes bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import hip_ext  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def timed(fns: dict, rounds: int, warmup: int = 1) -> dict:
    """Median and p95 seconds of each ``fns[key]()``, called once per round for ``rounds`` rounds
    (after ``warmup`` calls each), in interleaved order."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - t0)
    out = {}
    for key, values in samples.items():
        values.sort()
        out[key] = {"n": rounds, "median_s": statistics.median(values),
                    "p95_s": values[min(rounds - 1, int(rounds * 0.95))]}
    return out


def charlm(d_model: int = 64, layers: int = 2, context: int = 64):
    from monarch_nb.train.workloads import CharLMWorkload, default_text_path

    wl = CharLMWorkload(default_text_path(), context=context, d_model=d_model, layers=layers)
    wl.setup()
    torch.manual_seed(0)
    model = wl.build_model()
    inputs, targets = wl.train_batch(list(range(0, 32 * 97, 97)))
    wl.loss_sum(model, inputs, targets)[0].backward()
    return model


def mlp_100m():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5120, 6144), torch.nn.GELU(), torch.nn.Linear(6144, 6144), torch.nn.GELU(),
        torch.nn.Linear(6144, 5120))
    model(torch.randn(8, 5120)).square().mean().backward()
    return model


def foreach_idiom(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What one writes with torch alone: per-tensor norms in one foreach call, and isfinite."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    bad = torch.stack([(~torch.isfinite(g)).sum() for g in grads]).sum()
    return norm, bad


def bench_model(name: str, model: torch.nn.Module, repeats: int, dtype: torch.dtype | None = None) -> dict:
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    params = [p.detach() for p in model.parameters()]
    if dtype is not None:
        grads = [g.to(dtype) for g in grads]
        params = [p.to(dtype) for p in params]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    pbytes = sum(p.numel() * p.element_size() for p in params)
    n_params = sum(p.numel() for p in params)
    # the kernel and the reference agree, and both run compiled where they should
    got, want = hip_ext.grad_health(grads), hip_ext.grad_health_reference(grads)
    assert got[1] == want[1] and abs(got[0] - want[0]) <= 1e-9 * want[0], (got, want)
    assert [hip_ext.checksum(p) for p in params[:3]] == [int(hip_ext.checksum_reference(p)) for p in params[:3]]

    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    psrc = torch.empty(pbytes, dtype=torch.uint8).random_()
    pdst = torch.empty_like(psrc)
    memmove = ctypes.CDLL(None).memmove
    memmove.restype = ctypes.c_void_p
    memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    views = [p.contiguous().view(-1).view(torch.uint8).numpy() for p in params]
    twins = [torch.empty_like(p) for p in params]

    def copy_each() -> None:
        for twin, p in zip(twins, params):
            twin.copy_(p)

    def sha256() -> str:
        h = hashlib.sha256()
        for v in views:
            h.update(v)
        return h.hexdigest()

    fast = timed({
        "grad_health": lambda: hip_ext.grad_health(grads),
        "memcpy_grads_copy_": lambda: dst.copy_(src),
        "memcpy_grads_libc_1thread": lambda: memmove(dst.data_ptr(), src.data_ptr(), nbytes),
        "checksum": lambda: [torch.ops.monarch_nb.checksum(p) for p in params],
        "memcpy_params_copy_": lambda: pdst.copy_(psrc),
        "memcpy_params_libc_1thread": lambda: memmove(pdst.data_ptr(), psrc.data_ptr(), pbytes),
        "memcpy_params_per_tensor": copy_each,
    }, repeats)
    slow = timed({
        "grad_health_reference": lambda: hip_ext.grad_health_reference(grads),
        "foreach_norm_isfinite": lambda: foreach_idiom(grads),
        "checksum_reference": lambda: [hip_ext.checksum_reference(p) for p in params],
        "sha256": sha256,
    }, max(3, repeats // 5))  # a few seconds a call on the 400 MB model
    order = ["grad_health", "grad_health_reference", "foreach_norm_isfinite", "memcpy_grads_copy_",
             "memcpy_grads_libc_1thread", "checksum", "checksum_reference", "sha256", "memcpy_params_copy_",
             "memcpy_params_libc_1thread", "memcpy_params_per_tensor"]
    rows = {key: {**fast, **slow}[key] for key in order}
    for key, row in rows.items():
        size = pbytes if key.startswith(("checksum", "sha256", "memcpy_params")) else nbytes
        row["bytes"] = size
        row["gb_per_s"] = size / row["median_s"] / 1e9
    memcpy_grads = max(rows["memcpy_grads_copy_"]["gb_per_s"], rows["memcpy_grads_libc_1thread"]["gb_per_s"])
    memcpy_params = max(rows["memcpy_params_copy_"]["gb_per_s"], rows["memcpy_params_libc_1thread"]["gb_per_s"])
    ratios = {
        "grad_health_vs_reference": rows["grad_health_reference"]["median_s"] / rows["grad_health"]["median_s"],
        "grad_health_vs_foreach": rows["foreach_norm_isfinite"]["median_s"] / rows["grad_health"]["median_s"],
        "grad_health_of_memcpy": rows["grad_health"]["gb_per_s"] / memcpy_grads,
        "checksum_of_memcpy": rows["checksum"]["gb_per_s"] / memcpy_params,
        "checksum_of_per_tensor_memcpy": rows["checksum"]["gb_per_s"] / rows["memcpy_params_per_tensor"]["gb_per_s"],
        "checksum_vs_reference": rows["checksum_reference"]["median_s"] / rows["checksum"]["median_s"],
        "checksum_vs_sha256": rows["sha256"]["median_s"] / rows["checksum"]["median_s"],
    }
    return {"model": name, "dtype": str(grads[0].dtype).replace("torch.", ""), "tensors": len(grads),
            "parameters": n_params, "grad_bytes": nbytes, "rows": rows, "ratios": ratios,
            "targets_met": {"grad_health_2x_reference": ratios["grad_health_vs_reference"] >= 2.0,
                            "grad_health_half_memcpy": ratios["grad_health_of_memcpy"] >= 0.5,
                            "checksum_half_memcpy": ratios["checksum_of_memcpy"] >= 0.5}}


def print_table(results: dict) -> None:
    print(f"\nhip_ext CPU kernels — {results['cores']} cores, {results['threads']} torch threads, "
          f"compiled: {results['compiled']}")
    head = f"{'model':<12} {'dtype':<9} {'what':<28} {'MB':>8} {'median ms':>10} {'p95 ms':>9} {'GB/s':>7}"
    print("(GB/s: bytes read / median; memcpy rows: bytes copied / median)")
    print(head)
    print("-" * len(head))
    for m in results["models"]:
        for key, row in m["rows"].items():
            print(f"{m['model']:<12} {m['dtype']:<9} {key:<28} {row['bytes'] / 1e6:>8.1f} {row['median_s'] * 1e3:>10.3f} "
                  f"{row['p95_s'] * 1e3:>9.3f} {row['gb_per_s']:>7.2f}")
        r = m["ratios"]
        print(f"{'':<12} {'':<9} grad_health: {r['grad_health_vs_reference']:.1f}x the reference, "
              f"{r['grad_health_vs_foreach']:.1f}x foreach_norm+isfinite, {100 * r['grad_health_of_memcpy']:.0f}% of memcpy; "
              f"checksum: {100 * r['checksum_of_memcpy']:.0f}% of memcpy ({100 * r['checksum_of_per_tensor_memcpy']:.0f}% of "
              f"per-tensor memcpy), {r['checksum_vs_reference']:.1f}x the reference, "
              f"{r['checksum_vs_sha256']:.1f}x sha256")
        print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds of the kernels and copies (slow peers: a fifth, >= 3)")
    parser.add_argument("--quick", action="store_true", help="charlm only, 5 repeats")
    parser.add_argument("--json", type=Path, default=RESULTS / "kernels.json", help="where to write the results")
    args = parser.parse_args(argv)
    compiled = hip_ext.load()
    if "CPU" not in compiled:
        print("bench/kernels.py: the CPU kernels did not build; this would measure the reference against itself")
        return 1
    repeats = 5 if args.quick else args.repeats
    results: dict = {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "compiled": compiled,
                     "torch": torch.__version__, "time": time.time(), "models": []}
    results["models"].append(bench_model("charlm", charlm(), repeats * 10))
    if not args.quick:
        results["models"].append(bench_model("charlm-wide", charlm(d_model=512, layers=8), repeats * 2))
        model = mlp_100m()
        results["models"].append(bench_model("mlp-100M", model, repeats))
        results["models"].append(bench_model("mlp-100M", model, repeats, dtype=torch.bfloat16))
    print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
