"""The ``%mesh`` and ``%%mesh`` command lines: argparse parsers whose errors are IPython UsageErrors.

``build_line_parser()`` knows every ``%mesh`` subcommand (its help text is the documentation
``%mesh SUBCOMMAND --help`` prints); ``build_cell_parser()`` the ``%%mesh`` options.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError

from ..actor.workspace import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES
from ..argtypes import nonneg_int, positive_int
from .ranks import RANK_FORMS

__all__ = ["SUBCOMMANDS", "HelpShown", "Parser", "build_line_parser", "build_cell_parser", "split_line",
           "parse_params", "parse_fault_spec", "fault_kinds"]

SUBCOMMANDS = ("start", "status", "tree", "stop", "auto", "push", "pull", "scatter", "gather", "barrier", "wait",
               "fault", "restart", "train", "run", "sync", "logs", "debug", "stack", "help")


class HelpShown(Exception):
    """``--help`` was printed: the magic has nothing more to do."""


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as IPython UsageErrors instead of exiting the kernel."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}\n{self.format_usage().rstrip()}\n(see `{self.prog} --help`)")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            sys.stderr.write(message)
        raise HelpShown()


def fault_kinds() -> list[str]:
    from ..runtime.protocol import FAULT_KINDS

    return list(FAULT_KINDS)


def build_line_parser() -> Parser:
    parser = Parser(
        prog="%mesh",
        description="Drive a mesh of worker processes. Run cells on it with %%mesh (see `%%mesh --help`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `%mesh help cell` for the %%mesh cell magic's options.\n\nExamples:\n  %mesh start 4\n  %mesh push lr data\n"
        "  %mesh auto on\n  %mesh fault kill 2\n  %mesh restart 2\n  %mesh tree\n"
        "  %mesh train --steps 200 --fault kill@60:1\n  %mesh wait run --step 50\n  %mesh stop",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=Parser)

    p = sub.add_parser("start", help="start N worker procs (or one per GPU) with a cell executor on each, here or on hosts",
                       description="Start a mesh: N local CPU procs, or one proc per GPU with --gpus N; or N procs on each "
                       "host of --hosts (workers started with `monarch-nb worker --address tcp://HOST:PORT --curve-keys DIR`) "
                       "or of a saved job (--job FILE): dims {hosts: H, gpus: N}, ranks numbered host by host.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="Examples:\n  %mesh start 4\n  %mesh start 2 --hosts 10.0.0.2:26600,10.0.0.3:26600 --ca /shared/mnb-keys\n"
                       "  %mesh start 2 --hosts 127.0.0.1:26600,127.0.0.1:26601      (workers on this machine: no keys)\n"
                       "  %mesh start --job .monarch/job_state.json --mesh trainers")
    p.add_argument("n", nargs="?", type=positive_int,
                   help="procs (per host with --hosts/--job; default 4 here, one per GPU the hosts report, or 1)")
    p.add_argument("--gpus", type=positive_int, metavar="N", help="one proc per GPU, N GPUs (per host with --hosts/--job)")
    p.add_argument("--hosts", metavar="H:P[,H:P...]",
                   help="worker addresses (tcp://HOST:PORT or HOST:PORT, as `monarch-nb worker --address` printed) to attach")
    p.add_argument("--ca", metavar="DIR", help="the cluster's keys the workers were started with (`monarch-nb keys DIR`); "
                   "needed unless every host is this machine's loopback")
    p.add_argument("--job", metavar="FILE", help="a saved job's state file (job.state() writes .monarch/job_state.json): "
                   "attach its running hosts")
    p.add_argument("--mesh", metavar="NAME", help="with --job: which of its host meshes (default: its first)")
    p.add_argument("--dist", action="store_true", help="initialise torch.distributed on every rank (gloo on CPU, nccl/RCCL on GPUs)")
    p.add_argument("--name", help="the proc mesh's name (default: pm0, pm1, ...)")

    sub.add_parser("status", help="one line per rank: state, pid, heartbeat, restarts, device, memory, CPU, RSS, what it runs",
                   description="Show each rank's state, pid, heartbeat age, restarts, device, device memory used/total, "
                   "CPU %, RSS and the cell or endpoint it runs, then the running cells and the last events.")
    sub.add_parser("tree", help="show the live supervision-tree widget (with fault buttons)",
                   description="Show the supervision tree: controller -> hosts -> procs -> actors, live, with fault and restart buttons.")
    sub.add_parser("stop", help="stop the mesh (interrupting its cells) and its training run",
                   description="Stop the mesh: background cells are interrupted, the training run stopped, the procs ended.")

    kinds = ", ".join(fault_kinds())
    p = sub.add_parser("fault", help="inject a fault into one rank: %%mesh fault KIND RANK [PARAM=VALUE ...]",
                       description=f"Inject a fault. KIND is one of: {kinds}.\n"
                       "Parameters: exit code=N, stall seconds=S, slow ms=M, partition seconds=S.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", metavar="KIND", help=f"one of: {kinds}")
    p.add_argument("rank", metavar="RANK", type=nonneg_int, help="the rank to hit")
    p.add_argument("params", nargs="*", metavar="PARAM=VALUE", help="e.g. ms=200 or seconds=3")
    p.add_argument("--mesh", help="the training mesh ('train') or a proc mesh name (default: the one %%%%mesh uses)")

    p = sub.add_parser("restart", help="restart one rank in place (same rank, new pid, actors respawned)",
                       description="Restart one rank in place: same rank and coordinates, new pid; its actors are respawned "
                                   "and its %%mesh namespace starts empty.")
    p.add_argument("rank", metavar="RANK", type=nonneg_int)
    p.add_argument("--mesh", help="a proc mesh name (default: the one %%%%mesh uses)")

    p = sub.add_parser("train", help="start fault-tolerant training in the background and show the dashboard",
                       description="Start fault-tolerant data-parallel training in the background (the kernel stays free) and show its dashboard.\n"
                       "Faults: --fault KIND@STEP[:RANK] (or KIND@STEP:rank=R,param=V), repeatable, e.g. --fault kill@50:2 --fault nan@80",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="digits", help="training workload (default: digits)")
    p.add_argument("--procs", type=positive_int, default=None, help="number of training procs (default 4)")
    p.add_argument("--steps", type=positive_int, default=300, help="training steps (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", action="append", default=[], metavar="KIND@STEP[:RANK]", help="a scheduled fault")
    p.add_argument("--wait", action="store_true", help="block until training ends, then print the report")

    p = sub.add_parser("run", help="run a torchrun script on every rank (SPMD): %%mesh run [--max-restarts K] SCRIPT ARGS...",
                       description="Run SCRIPT as __main__ on every rank of the mesh with torchrun's environment "
                       "(init_process_group with env:// works unchanged); output per rank, live. A rank's failure stops the "
                       "others at once; --max-restarts K runs the whole group again. The procs stay up: run it again "
                       "without paying for procs or `import torch`. After a failure, `%mesh debug RANK` opens its post-mortem.")
    p.add_argument("--max-restarts", type=nonneg_int, default=0, help="whole-group restarts after a failure (default 0)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="fail an attempt that runs longer")
    p.add_argument("--mesh", help="a proc mesh name (default: the one %%%%mesh uses)")
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")

    p = sub.add_parser("sync", help="copy a local folder's code and data to the mesh's hosts (only what changed): %%mesh sync [PATH] [--reload]",
                       description="Copy the files of PATH (default: the notebook's folder) to every host of the mesh, only those "
                       "whose content changed, over the mesh's own signed (and, across hosts, encrypted) channel, into a folder "
                       "first on the procs' sys.path: a %%mesh cell imports the notebook's modules on hosts that never had "
                       "them, and procs started or restarted later import the new code. .gitignore files count; caches, .git "
                       "and virtual environments are never copied. --reload: the running procs reload the modules that "
                       "changed (as IPython's autoreload: `mod.f` is new, a name from `from mod import f` is not).")
    p.add_argument("path", nargs="?", default=".", metavar="PATH", help="the folder (default: the working directory)")
    p.add_argument("--reload", action="store_true", help="the mesh's procs reload the modules that changed")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="a .gitignore-style pattern not to copy (repeatable), e.g. 'data/*.bin'")
    p.add_argument("--max-mib", type=positive_int, default=DEFAULT_MAX_BYTES // 2**20, metavar="MIB",
                   help="the most it may copy (default %(default)s MiB)")
    p.add_argument("--max-files", type=positive_int, default=DEFAULT_MAX_FILES, metavar="N",
                   help="the most files (default %(default)s)")
    p.add_argument("--mesh", help="a proc mesh name (default: the one %%%%mesh uses)")

    p = sub.add_parser("logs", help="the last output lines of one rank",
                       description="Print the last output lines a rank wrote (kept by the controller, also after it died).")
    p.add_argument("rank", metavar="RANK", type=nonneg_int)
    p.add_argument("-n", "--lines", type=positive_int, default=40, help="how many lines (default 40)")
    p.add_argument("--mesh", help="a proc mesh name (default: the one %%%%mesh uses)")

    for name, what in (("debug", "open a debugger on a rank"), ("stack", "show live stacks of ranks")):
        p = sub.add_parser(name, help=f"{what} (monarch_nb.debug)", add_help=False,
                           description=f"{what}; delegates to monarch_nb.debug.magic.")
        p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("auto", help="auto mode: run every following cell on the ranks, as if it began with %%mesh",
                       description="Auto mode (like ipyparallel's %autopx, nbdistributed's %dist_mode): every following cell runs on "
                       "the ranks as if it began with %%mesh, until `%mesh auto off`. A cell whose first line is a magic (%...) or "
                       "a shell command (!...) still runs in the kernel. `%automesh` toggles it.")
    p.add_argument("state", nargs="?", choices=("on", "off"), help="on or off (default: toggle)")
    p.add_argument("--ranks", "-r", metavar="SPEC", help=f"the ranks auto-mode cells run on (default: all); forms: {RANK_FORMS}")

    for name, what in (("push", "bind kernel variables in every selected rank's namespace: %%mesh push NAME [NAME ...]"),
                       ("pull", "a variable from every selected rank, as a ValueMesh: x = %%mesh pull NAME"),
                       ("scatter", "split a sequence, array or tensor along its first dimension over the ranks: %%mesh scatter NAME"),
                       ("gather", "a variable from every rank, joined in rank order: x = %%mesh gather NAME")):
        p = sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ". Tensors and arrays travel "
                           "without copies into the pickle stream; the ranks see the value after the cells queued before it.")
        p.add_argument("names", nargs="+" if name == "push" else 1, metavar="NAME")
        p.add_argument("--ranks", "-r", metavar="SPEC", help=f"the ranks (default: all); forms: {RANK_FORMS}")
        p.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after S seconds")

    p = sub.add_parser("barrier", help="wait until every rank is idle (its queued cells done), like nbdistributed's %%sync",
                       description="Wait until every selected rank has finished the cells queued on it (background ones too), "
                       "and their output is shown. The kernel keeps handling widget clicks while it waits.")
    p.add_argument("--ranks", "-r", metavar="SPEC", help="the ranks (default: all)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after S seconds")

    p = sub.add_parser("wait", help="wait for a run or a condition while widgets stay live: %%mesh wait [NAME] [--step N] [--until EXPR]",
                       description="Wait while the kernel keeps handling widget clicks (the tree's buttons work): for NAME (a "
                       "training run, a CellRun from --out, anything with .done() or .wait(timeout)) to finish, for NAME to have "
                       "committed N steps (--step N), or for a Python expression to hold (--until EXPR). With no NAME: the "
                       "background cells and the %%mesh train run. At the top level of a cell it is an `await` (ipykernel >= 7.4 "
                       "handles widget messages meanwhile); elsewhere it blocks.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", metavar="NAME", help="a variable of this kernel (default: the background work)")
    p.add_argument("--step", type=nonneg_int, metavar="N", help="until NAME's metrics hold N committed steps (or it ends)")
    p.add_argument("--until", metavar="EXPR", help="until this Python expression (evaluated in the kernel) is true")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after S seconds (a UsageError)")

    p = sub.add_parser("help", help="help on a subcommand (%%mesh help fault) or on the cell magic (%%mesh help cell)")
    p.add_argument("topic", nargs="?", choices=[s for s in SUBCOMMANDS if s != "help"] + ["cell"], metavar="SUBCOMMAND")
    return parser


def build_cell_parser() -> Parser:
    parser = Parser(
        prog="%%mesh",
        description="Run the cell on the mesh's ranks, each in its own persistent namespace "
        "(`rank`, `world_size`, `coords` predefined; `dist` after `%mesh start --dist`). "
        "The last expression's value shows as Out[rank].",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"--ranks forms: {RANK_FORMS}\nInterrupt the kernel to stop the cell on every rank.",
    )
    parser.add_argument("--ranks", "-r", metavar="SPEC", help="the ranks to run on (default: all)")
    parser.add_argument("--block", dest="block", action="store_true", default=True, help="wait for every rank (default)")
    parser.add_argument("--no-block", dest="block", action="store_false", help="return at once; output still lands in this cell")
    parser.add_argument("--stream", dest="stream", action="store_true", default=True, help="show output as it arrives (default)")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="show output when each rank is done, grouped")
    parser.add_argument("--group-outputs", choices=("rank", "type"), default="rank", help="with --no-stream: group by rank (default) or by type")
    parser.add_argument("--out", metavar="NAME", help="store the CellRun (values, errors, per-rank output) as NAME")
    parser.add_argument("--frame", action="store_true", help="run in the namespace of the debugger's frame on each rank (monarch_nb.debug)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="with --block: stop waiting after S seconds (the cell is interrupted)")
    parser.add_argument("--local", action="store_true",
                        help="run the cell in the kernel too (after starting it on the ranks), e.g. to keep a reference copy")
    return parser


def split_line(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot parse {line!r}: {exc}") from None


def parse_params(items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"fault parameter {item!r} is not PARAM=VALUE (e.g. ms=200)")
        key, value = item.split("=", 1)
        try:
            params[key] = int(value)
        except ValueError:
            try:
                params[key] = float(value)
            except ValueError:
                raise UsageError(f"fault parameter {key}: {value!r} is not a number") from None
    return params


def parse_fault_spec(spec: str, procs: int) -> str:
    """``kill@50:2`` or ``kill@50:rank=2[,param=v]`` -> the canonical spec; with no rank, the last one."""
    from ..faults.spec import parse_fault

    try:
        return str(parse_fault(spec, default_rank=procs - 1))
    except ValueError as exc:
        raise UsageError(f"--fault {spec!r}: {exc}") from None
