"""``%mesh`` and ``%%mesh``: drive a mesh of worker processes from notebook cells.

Load with ``%load_ext monarch_nb``. The closest peer is ipyparallel's ``%px`` family; what differs:

- output of every rank is complete and in order (per stream), also with ``--no-stream`` and
  also what a rank printed just before it raised (see :mod:`.cells`);
- an interrupt (Ctrl-C, the stop button) stops the cell on every selected rank, blocking or not;
- one rank restarts in place (``%mesh restart 2``), and faults are injected from a magic or from
  the supervision-tree widget (``%mesh tree``), which shows failures as they happen.

``%mesh --help`` lists the subcommands; ``%mesh SUBCOMMAND --help`` explains one.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..argtypes import nonneg_int, positive_int
from . import session as session_mod
from .cells import RANK_FORMS, CellOutput, RankSpecError, format_ranks

__all__ = ["MeshMagics", "load_ipython_extension", "unload_ipython_extension"]

SUBCOMMANDS = ("start", "status", "tree", "stop", "fault", "restart", "train", "logs", "debug", "stack", "help")
#: how long an interrupted cell may take to stop on every rank before we stop waiting
INTERRUPT_WAIT_S = 3.0


class _HelpShown(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as IPython UsageErrors instead of exiting the kernel."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}\n{self.format_usage().rstrip()}\n(see `{self.prog} --help`)")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            sys.stderr.write(message)
        raise _HelpShown()


def _fault_kinds() -> list[str]:
    from ..runtime.protocol import FAULT_KINDS

    return list(FAULT_KINDS)


def build_line_parser() -> _Parser:
    parser = _Parser(
        prog="%mesh",
        description="Drive a mesh of worker processes. Run cells on it with %%mesh (see `%%mesh --help`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `%mesh help cell` for the %%mesh cell magic's options.\n\nExamples:\n  %mesh start 4\n  %mesh fault kill 2\n  %mesh restart 2\n  %mesh tree\n"
        "  %mesh train --steps 200 --fault kill@60:1\n  %mesh stop",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=_Parser)

    p = sub.add_parser("start", help="start N worker procs (or one per GPU) with a cell executor on each",
                       description="Start a mesh: N local CPU procs, or one proc per GPU with --gpus N.")
    p.add_argument("n", nargs="?", type=positive_int, help="number of procs (default 4, or the --gpus count)")
    p.add_argument("--gpus", type=positive_int, metavar="N", help="one proc per GPU, N GPUs")
    p.add_argument("--hosts", metavar="H[,H...]", help="hosts to place procs on (default: this host)")
    p.add_argument("--dist", action="store_true", help="initialise torch.distributed on every rank (gloo on CPU, nccl/RCCL on GPUs)")
    p.add_argument("--name", help="the proc mesh's name (default: pm0, pm1, ...)")

    sub.add_parser("status", help="one line per rank: state, pid, heartbeat age, restarts, endpoint",
                   description="Show each rank's state, pid, heartbeat age, restarts and running endpoint, and the last events.")
    sub.add_parser("tree", help="show the live supervision-tree widget (with fault buttons)",
                   description="Show the supervision tree: controller -> hosts -> procs -> actors, live, with fault and restart buttons.")
    sub.add_parser("stop", help="stop the mesh (interrupting its cells) and its training run",
                   description="Stop the mesh: background cells are interrupted, the training run stopped, the procs ended.")

    kinds = ", ".join(_fault_kinds())
    p = sub.add_parser("fault", help="inject a fault into one rank: %%mesh fault KIND RANK [PARAM=VALUE ...]",
                       description=f"Inject a fault. KIND is one of: {kinds}.\n"
                       "Parameters: exit code=N, stall seconds=S, slow ms=M, partition seconds=S.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", metavar="KIND", help=f"one of: {kinds}")
    p.add_argument("rank", metavar="RANK", type=nonneg_int, help="the rank to hit")
    p.add_argument("params", nargs="*", metavar="PARAM=VALUE", help="e.g. ms=200 or seconds=3")
    p.add_argument("--mesh", help="the training mesh ('train') or a proc mesh name (default: the one %%%%mesh uses)")

    p = sub.add_parser("restart", help="restart one rank in place (same rank, new pid, actors respawned)",
                       description="Restart one rank in place: same rank and coordinates, new pid; its actors are respawned and its %%mesh namespace starts empty.")
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

    p = sub.add_parser("logs", help="the last output lines of one rank",
                       description="Print the last output lines a rank wrote (kept by the controller, also after it died).")
    p.add_argument("rank", metavar="RANK", type=nonneg_int)
    p.add_argument("-n", "--lines", type=positive_int, default=40, help="how many lines (default 40)")
    p.add_argument("--mesh", help="a proc mesh name (default: the one %%%%mesh uses)")

    for name, what in (("debug", "open a debugger on a rank"), ("stack", "show live stacks of ranks")):
        p = sub.add_parser(name, help=f"{what} (monarch_nb.debug)", add_help=False,
                           description=f"{what}; delegates to monarch_nb.debug.magic.")
        p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("help", help="help on a subcommand (%%mesh help fault) or on the cell magic (%%mesh help cell)")
    p.add_argument("topic", nargs="?", choices=[s for s in SUBCOMMANDS if s != "help"] + ["cell"], metavar="SUBCOMMAND")
    return parser


def build_cell_parser() -> _Parser:
    parser = _Parser(
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
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="with --block: stop waiting after S seconds (the cell is interrupted)")
    return parser


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot parse {line!r}: {exc}") from None


def _parse_params(items: list[str]) -> dict[str, Any]:
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


def _parse_fault_spec(spec: str, procs: int) -> str:
    """``kill@50:2`` or ``kill@50:rank=2[,param=v]`` -> the canonical spec; with no rank, the last one."""
    from ..faults.spec import parse_fault

    try:
        return str(parse_fault(spec, default_rank=procs - 1))
    except ValueError as exc:
        raise UsageError(f"--fault {spec!r}: {exc}") from None


@magics_class
class MeshMagics(Magics):
    """The ``%mesh`` line magic and the ``%%mesh`` cell magic."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.line_parser = build_line_parser()
        self.cell_parser = build_cell_parser()

    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        """``%mesh SUBCOMMAND ...`` drives the mesh; ``%%mesh [options]`` runs the cell on it.

        See ``%mesh --help`` and ``%%mesh --help``.
        """
        try:
            if cell is None:
                return self._line(line)
            return self._cell(line, cell)
        except _HelpShown:
            return None
        except session_mod.NoMeshError as exc:
            raise UsageError(str(exc)) from None

    # -- %mesh ------------------------------------------------------------------------------------
    def _line(self, line: str) -> Any:
        argv = _split(line)
        if not argv:
            self.line_parser.print_help()
            return None
        if argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
            raise UsageError(
                f"unknown subcommand {argv[0]!r}; valid subcommands: {', '.join(SUBCOMMANDS)} (see `%mesh --help`)"
            )
        if argv[0] in ("debug", "stack"):
            return self._debug(argv[0], " ".join(shlex.quote(a) for a in argv[1:]))
        args = self.line_parser.parse_args(argv)
        if args.command is None:
            self.line_parser.print_help()
            return None
        return getattr(self, f"_cmd_{args.command}")(args)

    def _cmd_help(self, args: argparse.Namespace) -> None:
        if args.topic is None:
            self.line_parser.print_help()
        elif args.topic == "cell":
            self.cell_parser.print_help()
        else:
            try:
                self.line_parser.parse_args([args.topic, "--help"])
            except _HelpShown:
                pass

    def _cmd_start(self, args: argparse.Namespace) -> Any:
        existing = session_mod.current(required=False)
        if existing is not None:
            print(f"a mesh is already running: {existing.procs!r} with {existing.world_size} procs; "
                  "`%mesh stop` it first, or use it (`%mesh status`)")
            return None
        from .. import device
        from ..actor.context import this_host

        if args.gpus is not None and args.n is not None and args.gpus != args.n:
            raise UsageError(f"`%mesh start {args.n} --gpus {args.gpus}`: give N or --gpus N, not two different counts")
        count = args.gpus or args.n or 4
        if args.gpus is not None:
            inventory = device.detect_gpus()
            if inventory.count < args.gpus:
                raise UsageError(f"--gpus {args.gpus}: this host has {inventory.count} visible GPU(s); "
                                 f"use `%mesh start {args.gpus}` for CPU procs")
        hosts = [h.strip() for h in args.hosts.split(",")] if args.hosts else ["localhost"]
        bad = [h for h in hosts if h not in ("localhost", "127.0.0.1")]
        if bad:
            raise UsageError(f"--hosts {args.hosts}: only this host (localhost) can be used from a notebook here; "
                             "start remote hosts with `monarch-nb host`")
        t0 = time.monotonic()
        dims = {"gpus": count}
        procs = this_host().spawn_procs(per_host=dims, name=args.name)
        try:
            sess = session_mod.MeshSession(procs)
            if args.dist:
                backend = sess.init_distributed()
        except BaseException:
            procs.stop()
            raise
        session_mod.set_current(sess)
        dist = f", torch.distributed up ({backend})" if args.dist else ""
        print(f"mesh {procs.name}: {count} procs up in {time.monotonic() - t0:.1f} s{dist}. "
              "Run cells on it with %%mesh; see it live with %mesh tree.")
        return procs

    def _cmd_status(self, args: argparse.Namespace) -> None:
        sess = session_mod.current(required=False)
        if sess is not None:
            print(status_text(sess.controller, sess.mesh_name, sess.world_size, sess.dist_backend,
                              [r for r in sess.background if not r.done()]))
        train = _training_run()
        if train is not None and not train.done():
            from ..runtime.controller import Controller

            procs = train.procs
            print(f"training run: step {train.step}, live ranks {train.live_ranks}")
            print(status_text(Controller.get(), procs.name, len(procs)))
        elif sess is None:
            raise session_mod.NoMeshError()

    def _cmd_tree(self, args: argparse.Namespace) -> None:
        from IPython.display import display

        from .tree_widget import SupervisionTree

        from ..runtime.controller import Controller

        sess = session_mod.current(required=False)
        controller = Controller.existing()
        running = controller is not None and any(not m.stopped for m in controller.meshes.values())
        if sess is None and _training_run() is None and not running:
            raise session_mod.NoMeshError()
        widget = SupervisionTree()
        if sess is not None:
            sess.tree_widget = widget
        display(widget)

    def _cmd_stop(self, args: argparse.Namespace) -> None:
        sess = session_mod.current(required=False)
        train = _training_run()
        if sess is None and train is not None and not train.done():
            train.stop()
            print("training run stopped")
            return
        if sess is None:
            print("no mesh is running (start one with `%mesh start 4`)")
            return
        sess.stop()
        session_mod.set_current(None)
        print(f"mesh {sess.mesh_name} stopped")

    def _mesh_for(self, name: str | None) -> Any:
        """(ProcMesh, world size) for --mesh NAME, the training mesh, or the %%mesh one."""
        from ..actor.mesh import ProcMesh
        from ..runtime.controller import Controller

        if name in (None, ""):
            sess = session_mod.current(required=False)
            if sess is not None:
                return sess.procs
            train = _training_run()
            if train is not None:
                return train.procs
            raise session_mod.NoMeshError()
        if name == "train":
            train = _training_run()
            if train is None:
                raise UsageError("no training run; start one with `%mesh train`")
            return train.procs
        controller = Controller.existing()
        mesh = controller.meshes.get(name) if controller is not None else None
        if mesh is None or mesh.stopped:
            live = sorted(n for n, m in (controller.meshes.items() if controller else []) if not m.stopped)
            raise UsageError(f"--mesh {name!r}: no such running proc mesh; running: {live or 'none'}")
        return ProcMesh(name, mesh.extent)

    def _check_rank(self, procs: Any, rank: int) -> None:
        if not 0 <= rank < len(procs):
            raise UsageError(f"rank {rank} is out of range; valid ranks are 0..{len(procs) - 1}")

    def _cmd_fault(self, args: argparse.Namespace) -> None:
        from ..runtime.protocol import validate_fault

        kinds = _fault_kinds()
        if args.kind not in kinds:
            raise UsageError(f"unknown fault kind {args.kind!r}; valid kinds: {', '.join(kinds)} "
                             "(usage: %mesh fault KIND RANK [PARAM=VALUE ...])")
        params = _parse_params(args.params)
        try:
            params = validate_fault(args.kind, params)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        procs = self._mesh_for(args.mesh)
        self._check_rank(procs, args.rank)
        try:
            procs.inject(args.rank, args.kind, **params)
        except (ValueError, RuntimeError) as exc:
            raise UsageError(str(exc)) from None
        shown = " ".join(f"{k}={v}" for k, v in params.items())
        print(f"injected {args.kind}{' ' + shown if shown else ''} into rank {args.rank} of {procs.name}")

    def _cmd_restart(self, args: argparse.Namespace) -> None:
        procs = self._mesh_for(args.mesh)
        self._check_rank(procs, args.rank)
        t0 = time.monotonic()
        procs.restart(args.rank)
        print(f"rank {args.rank} of {procs.name} restarted in {time.monotonic() - t0:.2f} s "
              f"(pid {_record(procs, args.rank).pid})")

    def _cmd_logs(self, args: argparse.Namespace) -> None:
        procs = self._mesh_for(args.mesh)
        self._check_rank(procs, args.rank)
        rec = _record(procs, args.rank)
        lines = [l for l in rec.output_tail if "\x1emnb:" not in l][-args.lines:]
        print(f"--- rank {args.rank} ({rec.state}, pid {rec.pid}), last {len(lines)} line(s) ---")
        for text in lines:
            print(text)

    def _cmd_train(self, args: argparse.Namespace) -> Any:
        try:
            from .. import train as train_mod

            start = train_mod.start  # type: ignore[attr-defined]
        except (ImportError, AttributeError):
            raise UsageError("training is not available in this install (monarch_nb.train.start is missing)") from None
        from IPython.display import display

        from .dashboard import TrainingDashboard

        previous = _training_run()
        if previous is not None and not previous.done():
            raise UsageError("a training run is already going; wait for it or stop it (`%mesh stop` stops it too)")
        procs = args.procs or 4
        faults = [_parse_fault_spec(f, procs) for f in args.fault]
        try:
            run = start(workload=args.workload, procs=procs, steps=args.steps, faults=faults, seed=args.seed)
        except (ValueError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
        dashboard = TrainingDashboard(total_steps=args.steps)
        dashboard.attach(run)
        _set_training_run(run, dashboard)
        display(dashboard)
        if args.wait:
            run.wait()
            print(run.report())
        return run

    def _debug(self, name: str, rest: str) -> Any:
        try:
            from ..debug import magic as debug_magic
        except ImportError:
            raise UsageError(f"`%mesh {name}` needs monarch_nb.debug.magic, which is not available in this install") from None
        fn = getattr(debug_magic, f"{name}_command", None)
        if fn is None:
            raise UsageError(f"`%mesh {name}` is not available (monarch_nb.debug.magic has no {name}_command)")
        return fn(rest, self.shell)

    # -- %%mesh -----------------------------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> Any:
        args = self.cell_parser.parse_args(_split(line))
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out {args.out!r} is not a Python name")
        sess = session_mod.current()
        try:
            ranks = sess.ranks(args.ranks)
        except RankSpecError as exc:
            raise UsageError(str(exc)) from None
        try:
            compile(cell, "<mesh-cell>", "exec")
        except SyntaxError as exc:  # fail here: nothing runs anywhere
            raise UsageError(f"the cell does not compile: {exc.msg} (line {exc.lineno})") from None
        queued = [r for r in sess.background if not r.done() and set(r.ranks) & set(ranks)]
        if queued:
            print(f"(queued behind the background cell(s) {', '.join(r.filename for r in queued)} on these ranks; "
                  "interrupt the kernel to stop them)")
        output = CellOutput()
        run = sess.run_cell(cell, ranks, stream=args.stream, group_outputs=args.group_outputs, frame=args.frame, output=output)
        if args.out:
            self.shell.user_ns[args.out] = run
        if not args.block:
            sess.add_background(run)
            _install_idle_interrupt(self.shell)
            threading.Thread(target=_pump_background, args=(run,), name=f"mesh-cell-{run.number}", daemon=True).start()
            print(f"running on rank(s) {format_ranks(ranks)} in the background"
                  f"{f'; its CellRun is {args.out}' if args.out else ''}; interrupt the kernel to stop it")
            return None
        return self._block(run, args.timeout)

    def _block(self, run: Any, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        interrupted = False
        watcher = None
        if deadline is not None:
            def watch() -> None:
                while not run.wait(0.1):
                    if time.monotonic() > deadline:
                        run.interrupt()
                        return
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        try:
            run.pump()
        except KeyboardInterrupt:
            interrupted = True
            run.interrupt()
            t0 = time.monotonic()
            try:
                run.pump(deadline=t0 + INTERRUPT_WAIT_S)  # what the ranks print while they stop
            except KeyboardInterrupt:
                pass
            if not run.done():
                run.wait(max(0.0, INTERRUPT_WAIT_S - (time.monotonic() - t0)))
        run.show_results()
        error = run.error()
        if interrupted and not run.done():
            still = [r for r, res in run.results.items() if not res.done]
            raise UsageError(f"interrupted; rank(s) {format_ranks(still)} did not stop within {INTERRUPT_WAIT_S} s "
                             f"(a C call that blocks?): `%mesh restart RANK` ends it")
        if error is not None:
            raise error
        if interrupted:
            raise KeyboardInterrupt
        return None


def _pump_background(run: Any) -> None:
    try:
        run.pump()
        run.show_results()
        error = run.error()
        if error is not None:
            run.output.stream("stderr", "\n".join(error._render_traceback_()) + "\n")
            run.output.flush()
    except Exception:
        import logging

        logging.getLogger(__name__).exception("showing the output of %r failed", run)


# -- interrupts while the kernel is idle ---------------------------------------------------------
def _idle_sigint(signum: int, frame: Any) -> None:
    """SIGINT while no cell executes (ipykernel ignores it then): stop the background cells."""
    sess = session_mod.current(required=False)
    if sess is not None:
        # a thread: a signal handler must not take locks the interrupted code may hold
        threading.Thread(target=sess.interrupt_background, name="mesh-interrupt", daemon=True).start()


def _install_idle_interrupt(shell: Any) -> None:
    """Make the kernel handle SIGINT when idle by stopping non-blocking cells.

    ipykernel installs ``default_int_handler`` while it runs a request and restores the handler
    it found afterwards (``kernel.saved_sigint_handler``, SIG_IGN at start). Setting that saved
    handler during a cell makes ours the idle-time handler from then on.
    """
    kernel = getattr(shell, "kernel", None)
    if kernel is not None and hasattr(kernel, "saved_sigint_handler"):
        kernel.saved_sigint_handler = _idle_sigint
    elif threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
            signal.signal(signal.SIGINT, _idle_sigint)


# -- status ----------------------------------------------------------------------------------------
def _record(procs: Any, rank: int) -> Any:
    from ..runtime.controller import Controller

    return Controller.get().proc_record(procs.name, rank)


def status_text(controller: Any, mesh: str, world_size: int, dist_backend: str | None = None, running: list | None = None) -> str:
    """One line per rank (state, pid, heartbeat age, restarts, running endpoint) and the last events."""
    now = time.monotonic()
    rows = [f"mesh {mesh}: {world_size} procs"
            f"{', torch.distributed ' + dist_backend if dist_backend else ''}",
            f"{'rank':>4}  {'state':<10} {'pid':>7}  {'heartbeat':>9}  {'restarts':>8}  endpoint"]
    for rank in range(world_size):
        rec = controller.proc_record(mesh, rank)
        age = f"{now - rec.last_heartbeat:.1f} s" if rec.last_heartbeat and rec.alive else "-"
        busy = ", ".join(f"{a}.{ep} ({s:.1f} s)" for a, (ep, s) in rec.busy.items()) or "-"
        rows.append(f"{rank:>4}  {rec.state:<10} {rec.pid:>7}  {age:>9}  {rec.restarts:>8}  {busy}")
    if running:
        rows.append(f"background cells running: {', '.join(r.filename for r in running)}")
    events = [e for e in controller.events.events() if e.mesh == mesh][-5:]
    if events:
        rows.append("last events:")
        for e in events:
            rows.append(f"  {time.strftime('%H:%M:%S', time.localtime(e.time))}  rank {e.rank}  {e.kind}  {e.detail}")
    return "\n".join(rows)


# -- training run (one per kernel) ---------------------------------------------------------------
_training: dict[str, Any] = {}


def _training_run() -> Any:
    return _training.get("run")


def _set_training_run(run: Any, dashboard: Any) -> None:
    _training["run"] = run
    _training["dashboard"] = dashboard
    sess = session_mod.current(required=False)
    if sess is not None:
        sess.training = run
        sess.dashboard = dashboard


# -- extension -------------------------------------------------------------------------------------
def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(MeshMagics)


def unload_ipython_extension(ipython: Any) -> None:
    sess = session_mod.current(required=False)
    if sess is not None:
        sess.stop()
        session_mod.set_current(None)
