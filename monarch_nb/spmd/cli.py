"""``monarch-nb run``: a torchrun script on a mesh of this machine (or of ``--hosts`` / ``--job``).

    monarch-nb run --procs 4 train.py --lr 0.1
    monarch-nb run --procs 4 --max-restarts 1 train.py         # torchrun --nproc-per-node=4 --max-restarts=1
    monarch-nb run --procs 2 --hosts 10.0.0.2:26600,10.0.0.3:26600 --ca DIR train.py

Every rank runs the script as ``__main__`` with torchrun's environment; its output comes live,
each line prefixed with its rank. On a failure the other ranks are stopped at once; with
``--max-restarts K`` the whole group runs again on restarted procs. Exit status: 0 when every
rank's script returned; the status the failing rank's script passed to ``sys.exit`` (1 for a
message), as ``python script.py`` would; 1 when the run failed otherwise (the tracebacks grouped
by rank); 2 for a usage error; 130 on Ctrl-C (every rank stopped first).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..argtypes import positive_int

__all__ = ["add_run_parser", "run_cli"]

#: what a script's procs import once, in their host's fork server, so each rank starts in milliseconds
#: (torch._dynamo: an optimizer's constructor imports it, ~1.5 s of CPU per process)
SCRIPT_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.optim")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def add_run_parser(sub) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand."""
    p = sub.add_parser(
        "run", help="run a torchrun script on every rank of a mesh (SPMD), restarting the group on a failure",
        description="Run SCRIPT as __main__ on every rank, with torchrun's environment (RANK, LOCAL_RANK, "
                    "WORLD_SIZE, MASTER_ADDR, MASTER_PORT: init_process_group with env:// works unchanged). "
                    "A rank's failure stops the others at once; --max-restarts K runs the whole group again "
                    "(torchrun's semantics, on warm procs).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  monarch-nb run --procs 4 train.py --lr 0.1\n"
               "  monarch-nb run --procs 4 --max-restarts 1 train.py\n"
               "  monarch-nb run --procs 2 --hosts 10.0.0.2:26600,10.0.0.3:26600 --ca DIR train.py")
    p.add_argument("--procs", type=positive_int, default=4, help="ranks (default 4); per host with --hosts or --job")
    p.add_argument("--max-restarts", type=_non_negative_int, default=0,
                   help="whole-group restarts after a failure (default 0), as torchrun's --max-restarts")
    p.add_argument("--spares", type=_non_negative_int, default=0,
                   help="warm spare procs per host, taken by restarted ranks (default 0: they are forked fresh)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="fail an attempt that runs longer than this (default: no limit)")
    where = p.add_argument_group("across hosts")
    where.add_argument("--hosts", metavar="H:P[,H:P...]", help="run on these workers (`monarch-nb worker --address tcp://H:P`)")
    where.add_argument("--ca", metavar="DIR", help="with --hosts: the cluster's keys (`monarch-nb keys DIR`)")
    where.add_argument("--job", metavar="FILE", help="run on the hosts of a saved job (.monarch/job_state.json)")
    where.add_argument("--mesh", metavar="NAME", help="with --job: which of its host meshes (default: its first)")
    p.add_argument("script", nargs="?", help="the script (a path; it must exist on every host)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    from ..job.placement import run_placed

    if args.script is None:  # (argparse would call the optional ARGS required too)
        print("monarch-nb run: error: which script? e.g. monarch-nb run --procs 4 train.py (see monarch-nb run --help)",
              file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"monarch-nb run: error: no script {args.script!r} (see monarch-nb run --help)", file=sys.stderr)
        return 2
    return run_placed("run", args, lambda placement: _run(args, placement))


def _run(args: argparse.Namespace, placement) -> int:
    from ..actor.context import this_host
    from .runner import ScriptFailed, run_script

    host = placement.host_mesh if placement.host_mesh is not None else this_host()
    procs = host.spawn_procs(per_host={"gpus": args.procs}, spares=args.spares, preload=SCRIPT_PRELOAD)
    try:
        run = run_script(procs, args.script, args.args, max_restarts=args.max_restarts, timeout_s=args.timeout)
    except ScriptFailed as exc:
        if exc.exited is None:
            print(f"monarch-nb run: {exc}", file=sys.stderr)
            return 1
        # as `python script.py` would: the script's own status, no traceback of the runtime's
        status, message = exc.exited
        last = exc.failures[-1]
        print(f"monarch-nb run: {os.path.basename(exc.script)} exited{'' if message else f' with status {status}'} "
              f"on rank {last.rank}{' (the first to end)' if len(exc.failures) == 1 else f' in attempt {last.attempt + 1}'}"
              f"{f': {message}' if message else ''}", file=sys.stderr)
        return status if 0 < status < 256 else 1
    except KeyboardInterrupt:
        print("monarch-nb run: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    finally:
        procs.stop()
    restarts = f" after {run.attempts - 1} restart(s)" if run.attempts > 1 else ""
    print(f"monarch-nb run: {os.path.basename(run.script)} ended on all {run.world_size} ranks in {run.seconds:.2f} s{restarts}",
          file=sys.stderr)
    return 0
