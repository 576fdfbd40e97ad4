"""``monarch-nb train``: fault-tolerant data-parallel training from the command line.

    monarch-nb train --procs 4 --steps 300 --fault kill@120:rank=2 --fault hang@200:rank=1

Trains on a local mesh with a progress bar, injects the faults, and prints the report; exits 0
on success, 2 on bad input (before any worker starts), 1 if the run failed.
"""

from __future__ import annotations

import argparse
import sys

from ..argtypes import positive_float, positive_int

__all__ = ["add_train_parser", "run_train"]


def add_train_parser(sub) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to an argparse subparsers object."""
    p = sub.add_parser(
        "train",
        help="fault-tolerant data-parallel training on a local mesh, with injected faults and a report",
        description="Train on real data over a local mesh of worker processes; survive injected faults.",
    )
    p.add_argument("--procs", type=positive_int, default=4, help="worker processes / data-parallel ranks (default 4)")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--workload", choices=("digits", "charlm"), default="digits",
                   help="digits: MLP on sklearn's handwritten digits (default); charlm: byte-level transformer LM on --text")
    p.add_argument("--text", metavar="PATH", help="text file for charlm (default: the source of Python's inspect module)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="KIND@STEP:rank=R[,param=value], e.g. kill@120:rank=2, hang@200:rank=1, exit@50:rank=0,code=3, "
                        "slow@10:rank=1,ms=50; repeatable")
    p.add_argument("--chaos-mtbf", type=positive_float, metavar="SECONDS",
                   help="also inject random faults (kill, hang, exit, segfault, raise, nan) with this mean time between them")
    p.add_argument("--seed", type=int, default=0, help="seed of model init, data order and chaos (default 0)")
    p.add_argument("--batch-size", type=positive_int, help="global batch: samples per step over all ranks")
    p.add_argument("--lr", type=positive_float, help="learning rate (default: the workload's)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="collective backend (default: gloo on CPU, nccl/RCCL on GPUs)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between test evaluations (0: only at the end)")
    p.add_argument("--report-json", metavar="PATH", help="write the report (with the sample ledger) as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)
    return p


def run_train(args: argparse.Namespace) -> int:
    from .loop import TrainingError, fit

    try:
        report = fit(
            args.workload, procs=args.procs, steps=args.steps, faults=args.fault, seed=args.seed,
            progress=not args.no_progress, lr=args.lr, batch_size=args.batch_size, text=args.text,
            backend=args.backend, chaos_mtbf_s=args.chaos_mtbf, eval_every=args.eval_every,
            report_json=args.report_json,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"monarch-nb train: error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"monarch-nb train: the run failed: {exc}", file=sys.stderr)
        return 1
    print(report)
    if args.report_json:
        print(f"report written to {args.report_json}")
    return 0
