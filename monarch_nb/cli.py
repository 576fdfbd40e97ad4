"""The ``monarch-nb`` command.

    monarch-nb demo                    the main job, as `make demo`: train on 4 local procs through a kill and a hang
    monarch-nb train [--procs N] [--steps S] [--fault kill@120:rank=2 ...]   fault-tolerant training + report
    monarch-nb tour [--procs N]        a short tour of the actor API: call actors, inject a fault, recover
    monarch-nb run [--procs N] [--max-restarts K] script.py ARGS   a torchrun script on every rank (SPMD)
    monarch-nb report FILE.json        print the report of a run saved with `train --report-json`
    monarch-nb install-kernel [--user|--sys-prefix|--prefix P]   the "Monarch (Python 3)" kernelspec
    monarch-nb keys DIR                make a cluster's keys (HMAC + CurveZMQ) for hosts to share
    monarch-nb worker --address tcp://HOST:PORT --curve-keys DIR   serve as a host of a cluster
"""

from __future__ import annotations

import argparse
import sys
import time

from .argtypes import positive_int

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument said in one line that names where help is (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="monarch-nb",
        description="Interactive, fault-tolerant distributed training with Monarch's actor API.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    tour = sub.add_parser("tour", help="a short tour of the actor API on local worker processes (no training)",
                          description="Spawn local worker procs, call an actor mesh, kill one rank (SIGKILL) and see "
                          "the others answer, then restart it in place: Monarch's actor API in a few seconds, no GPU.")
    tour.add_argument("--procs", type=positive_int, default=4, help="number of worker processes (default 4)")
    tour.set_defaults(func=_tour)
    kernel = sub.add_parser("install-kernel", help='install the Jupyter kernelspec "Monarch (Python 3)" (ipykernel with monarch_nb loaded)',
                            description='Install the Jupyter kernelspec "Monarch (Python 3)": an ipykernel that loads '
                            "monarch_nb's magics (%%mesh, %mesh) at start. Pick it in Jupyter's kernel menu.")
    where = kernel.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user (~/.local/share/jupyter)")
    where.add_argument("--sys-prefix", action="store_true", help="install into this environment (the default)")
    where.add_argument("--prefix", help="install into PREFIX/share/jupyter/kernels")
    kernel.set_defaults(func=_install_kernel)
    keys = sub.add_parser("keys", help="make a cluster's keys: copy the folder to every host and pass it as ca=",
                          description="Create a folder with the cluster's HMAC key and CurveZMQ certificates "
                          "(or, with --hmac-only, one key file). Hosts started with these keys accept only "
                          "controllers holding them; with a folder, traffic between hosts is encrypted.")
    keys.add_argument("path", help="the folder (or file, with --hmac-only) to create; never overwritten")
    keys.add_argument("--hmac-only", action="store_true", help="one key file: signed, not encrypted")
    keys.set_defaults(func=_keys)
    worker = sub.add_parser("worker", help="serve as a host of a cluster: wait for a controller, run its procs",
                            description="Listen for a controller (attach_to_workers, %mesh start --hosts, a job) "
                            "and run its procs on this host; when it is gone, wait for the next.")
    worker.add_argument("--address", required=True, metavar="tcp://HOST:PORT", help="where to listen (an address of this host)")
    trust = worker.add_mutually_exclusive_group()
    trust.add_argument("--curve-keys", metavar="DIR", help="the cluster's key folder (monarch-nb keys DIR): encrypted")
    trust.add_argument("--key-file", metavar="FILE", help="the cluster's key file (monarch-nb keys --hmac-only FILE)")
    worker.add_argument("--name", help="this host's name in the supervision tree (default: the hostname)")
    worker.add_argument("--announce", metavar="FILE", help="also write the announcement (address, pid; JSON) to FILE")
    worker.set_defaults(func=_worker)
    from .train.cli import DEMO_FAULTS, add_report_parser, add_train_parser

    add_train_parser(sub)
    add_train_parser(sub, name="demo", faults=DEMO_FAULTS)
    add_report_parser(sub)
    from .spmd.cli import add_run_parser

    add_run_parser(sub)
    return parser


def _tour(args: argparse.Namespace) -> int:
    from . import Actor, endpoint, this_host

    class Counter(Actor):
        def __init__(self, start: int):
            self.value = start

        @endpoint
        def incr(self, by: int = 1) -> int:
            self.value += by
            return self.value

    t0 = time.monotonic()
    with this_host().spawn_procs(per_host={"gpus": args.procs}) as procs:
        counters = procs.spawn("counters", Counter, 0)
        print(f"{args.procs} procs up and answering in {time.monotonic() - t0:.2f} s")
        counters.incr.broadcast()
        print("call(by=2) ->", counters.incr.call(by=2).get().values())
        last = args.procs - 1
        procs.inject(last, "kill")
        try:
            counters.incr.call().get(timeout=10)
        except Exception as exc:  # SupervisionError: the killed rank fails, the others answer
            print(f"after killing rank {last}: {type(exc).__name__}: {exc}")
        print("healthy slice still answers:", counters.slice(gpus=0).incr.call_one().get())
        procs.restart(last)
        print("after restart in place:", counters.incr.call().get().values())
    return 0


def _install_kernel(args: argparse.Namespace) -> int:
    from .jupyter.kernelspec import DISPLAY_NAME, KERNEL_NAME, install

    try:
        path = install(user=args.user, sys_prefix=args.sys_prefix, prefix=args.prefix)
    except OSError as exc:
        print(f"monarch-nb install-kernel: cannot write the kernelspec: {exc} (try --user, or another --prefix)",
              file=sys.stderr)
        return 2
    print(f'installed kernelspec "{DISPLAY_NAME}" ({KERNEL_NAME}) in {path}')
    return 0


def _keys(args: argparse.Namespace) -> int:
    from .transport.keys import create_keys

    try:
        path = create_keys(args.path, curve=not args.hmac_only)
    except FileExistsError as exc:
        print(f"monarch-nb keys: {exc}", file=sys.stderr)
        return 2
    what = "key file" if args.hmac_only else "key folder (HMAC + CurveZMQ)"
    print(f"wrote the cluster's {what} to {path}; copy it to every host (mode 600) and pass it as ca={path!r}")
    return 0


def _worker(args: argparse.Namespace) -> int:
    import logging

    from .runtime.worker_loop import run_worker_loop_forever

    # what an operator reads: each controller that attaches and leaves (who, when, why)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s monarch-nb worker: %(message)s", "%Y-%m-%d %H:%M:%S"))
    loop_log = logging.getLogger("monarch_nb.worker_loop")
    loop_log.addHandler(handler)
    loop_log.setLevel(logging.INFO)
    loop_log.propagate = False
    try:
        run_worker_loop_forever(args.address, args.curve_keys or args.key_file, name=args.name, announce=args.announce)
    except (ValueError, OSError) as exc:
        print(f"monarch-nb worker: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `monarch-nb report r.json | head`: the reader has gone, say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit must not fail
        return 1


if __name__ == "__main__":
    sys.exit(main())
