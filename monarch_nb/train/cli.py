"""``monarch-nb train`` and ``monarch-nb report``: fault-tolerant training from the command line.

    monarch-nb train --procs 4 --steps 300 --fault kill@120:rank=2 --fault hang@200:rank=1
    monarch-nb train --procs 2 --hosts 10.0.0.2:26600,10.0.0.3:26600 --ca /shared/mnb-keys
    monarch-nb train --procs 2 --job .monarch/job_state.json [--mesh trainers]
    monarch-nb report report.json

``train`` trains on a local mesh (or ``--procs`` per host on attached workers or a saved job's
hosts) with a progress bar, injects the faults, and prints the report;
exits 0 on success, 2 on bad input (before any worker starts), 1 if the run failed, 130 when
interrupted (Ctrl-C), after printing the partial report. ``report`` prints the text report of a
run saved with ``--report-json``.
"""

from __future__ import annotations

import argparse
import signal
import sys

from ..argtypes import positive_float, positive_int

__all__ = ["add_train_parser", "add_report_parser", "run_train", "run_report", "DEMO_FAULTS"]

#: the faults of the main job (`make demo`, `monarch-nb demo`): a SIGKILL, then a SIGSTOP found hung
DEMO_FAULTS = ("kill@120:rank=2", "hang@200:rank=1")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_train_parser(sub, name: str = "train", faults: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand (or, with ``name="demo"`` and ``faults``, the main job: the same
    options, those faults unless ``--fault`` is given) to an argparse subparsers object."""
    demo = f"the main job (as `make demo`): train with the faults {' and '.join(faults)} unless --fault is given"
    p = sub.add_parser(
        name,
        help=demo if faults else "fault-tolerant data-parallel training on a local mesh, with injected faults and a report",
        description=(demo[0].upper() + demo[1:] + ". " if faults else "")
                    + "Train on real data over a local mesh of worker processes (or on the hosts of --hosts or "
                    "--job); survive injected faults.",
        epilog="Across hosts: start `monarch-nb worker --address tcp://HOST:PORT --curve-keys DIR` on each\n"
               "host (or a job: monarch_nb.job.SlurmJob / SSHJob, whose state() writes .monarch/job_state.json),\n"
               "then\n"
               "  monarch-nb train --procs 2 --hosts 10.0.0.2:26600,10.0.0.3:26600 --ca DIR\n"
               "  monarch-nb train --procs 2 --job .monarch/job_state.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--procs", type=positive_int, default=4,
                   help="worker processes / data-parallel ranks (default 4); per host with --hosts or --job")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--workload", choices=("digits", "charlm", "llama"), default="digits",
                   help="digits: MLP on sklearn's handwritten digits (default); charlm: byte-level transformer LM on "
                        "--text; llama: a tiny Llama (transformers' LlamaForCausalLM, random init, byte vocabulary) on "
                        "--text, needs pip install 'monarch_nb[llm]'")
    p.add_argument("--text", metavar="PATH",
                   help="text file for charlm and llama (default: the source of Python's inspect module)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="KIND@STEP:rank=R[,param=value], e.g. kill@120:rank=2, hang@200:rank=1, exit@50:rank=0,code=3, "
                        "slow@10:rank=1,ms=50; repeatable" + (f" (default: {' '.join(faults)})" if faults else ""))
    p.add_argument("--chaos-mtbf", type=positive_float, metavar="SECONDS",
                   help="also inject random faults (kill, hang, exit, segfault, raise, nan) with this mean time between them")
    p.add_argument("--seed", type=int, default=0, help="seed of model init, data order and chaos (default 0)")
    p.add_argument("--batch-size", type=positive_int,
                   help="global batch: samples per step over all ranks (default: the workload's, 64 for digits, "
                        "32 for charlm and llama)")
    p.add_argument("--lr", type=positive_float, help="learning rate (default: the workload's)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="collective backend (default: gloo on CPU, nccl/RCCL on GPUs)")
    p.add_argument("--eval-every", type=_non_negative_int, default=50,
                   help="steps between test evaluations (default 50; 0: only at the end)")
    p.add_argument("--spares", type=_non_negative_int, default=1,
                   help="warm spare procs per host (torch loaded) that take a failed rank's place (default 1; 0: none)")
    p.add_argument("--report-json", metavar="PATH", help="write the report (with the sample ledger) as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    shard = p.add_argument_group("sharded models (HSDP: shard inside a replica group, replicate across groups)")
    shard.add_argument("--parallelism", choices=("ddp", "fsdp"), default="ddp",
                       help="ddp: every rank a whole replica (default); fsdp: FSDP2 over each replica group")
    shard.add_argument("--group-size", type=positive_int, default=1, metavar="N",
                       help="ranks per replica group with --parallelism fsdp (must divide --procs; default 1); "
                            "a failed rank restarts its whole group, healed shard by shard from a live one")
    where = p.add_argument_group("across hosts")
    where.add_argument("--hosts", metavar="H:P[,H:P...]",
                       help="train on these workers (`monarch-nb worker --address tcp://H:P`): ranks host by host")
    where.add_argument("--ca", metavar="DIR", help="with --hosts: the cluster's keys (`monarch-nb keys DIR`) the workers use")
    where.add_argument("--job", metavar="FILE", help="train on the hosts of a saved job (job.state() writes .monarch/job_state.json)")
    where.add_argument("--mesh", metavar="NAME", help="with --job: which of its host meshes (default: its first)")
    p.set_defaults(func=run_train, default_faults=list(faults))
    return p


def add_report_parser(sub) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand (print a saved run's report)."""
    p = sub.add_parser("report", help="print the report of a training run saved with `train --report-json`",
                       description="Print the text report of a training run saved as JSON (monarch-nb train --report-json PATH).")
    p.add_argument("path", metavar="FILE.json", help="the saved report")
    p.set_defaults(func=run_report)
    return p


def run_train(args: argparse.Namespace) -> int:
    from ..job.placement import run_placed

    return run_placed("train", args, lambda placement: _train(args, placement))


def _train(args: argparse.Namespace, placement) -> int:
    from .progress import follow
    from .run import start

    try:
        run = start(
            args.workload, procs=args.procs, steps=args.steps, faults=args.fault or args.default_faults, seed=args.seed,
            lr=args.lr, batch_size=args.batch_size, text=args.text, backend=args.backend,
            chaos_mtbf_s=args.chaos_mtbf, eval_every=args.eval_every, spares=args.spares,
            report_json=args.report_json, hosts=placement.host_mesh, group_size=args.group_size,
            parallelism=args.parallelism,
        )
    except (ValueError, FileNotFoundError) as exc:
        why = str(exc)
        if not args.fault and args.default_faults and why.startswith("fault "):  # the demo's own faults, not the user's
            from ..faults.spec import parse_fault

            least = 1 + max(parse_fault(f).rank or 0 for f in args.default_faults)
            why = (f"its built-in faults ({', '.join(args.default_faults)}) need --procs {least} or more; "
                   f"pass --procs {least}, or faults of your own with --fault")
        print(f"monarch-nb {getattr(args, 'command', 'train')}: error: {why}", file=sys.stderr)
        return 2
    if placement.host_mesh is not None:
        print(f"training on {placement.where}", file=sys.stderr)
    interrupted = False
    try:
        follow(run, progress=not args.no_progress)
    except KeyboardInterrupt:
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the report short
        run.wait(10.0)
    try:
        report = run.report(timeout=0 if interrupted else None)
    except TimeoutError:
        print("monarch-nb train: interrupted; the run did not stop in time to report", file=sys.stderr)
        return 130
    except Exception as exc:  # TrainingError, or whatever ended the run: one line, no traceback
        if interrupted:
            print("monarch-nb train: interrupted before training began", file=sys.stderr)
            return 130
        print(f"monarch-nb train: the run failed: {exc}", file=sys.stderr)
        return 1
    print(report)
    if run.report_json_error is not None:
        print(f"monarch-nb train: the report above could not be written to {args.report_json}: {run.report_json_error}",
              file=sys.stderr)
        return 1
    if args.report_json:
        print(f"report written to {args.report_json}")
    if interrupted:
        print("monarch-nb train: interrupted (Ctrl-C); the report above covers the steps committed so far",
              file=sys.stderr)
        return 130
    return 0


def run_report(args: argparse.Namespace) -> int:
    from .report import TrainReport

    try:
        report = TrainReport.from_json(args.path)
    except (OSError, ValueError) as exc:
        print(f"monarch-nb report: error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0
