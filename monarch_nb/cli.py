"""The ``monarch-nb`` command.

    monarch-nb demo [--procs N]        start a local CPU mesh, call actors, inject a fault, recover
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="monarch-nb",
        description="Interactive, fault-tolerant distributed training with Monarch's actor API.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser("demo", help="run a short tour of the actor mesh on local worker processes")
    demo.add_argument("--procs", type=_positive_int, default=4, help="number of worker processes (default 4)")
    demo.set_defaults(func=_demo)
    return parser


def _demo(args: argparse.Namespace) -> int:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
