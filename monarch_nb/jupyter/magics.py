"""``%mesh`` and ``%%mesh``: drive a mesh of worker processes from notebook cells.

Load with ``%load_ext monarch_nb`` (harmless when already loaded; the Monarch kernel loads it).
The closest peers are ipyparallel's ``%px`` family and nbdistributed; what differs:

- output of every rank is complete and in order (per stream), also with ``--no-stream`` and
  also what a rank printed just before it raised (see :mod:`.cells`); progress bars and rich
  output (figures, tables) show per rank, in place and in order;
- an interrupt (Ctrl-C, the stop button) stops the cell on every selected rank, blocking or not,
  whatever the kernel is doing (see :mod:`.interrupts`);
- a torchrun script runs on every rank (``%mesh run train.py ARGS``, restarts with ``--max-restarts``);
- the notebook's folder reaches remote hosts (``%mesh sync``, only what changed; ``--reload``
  reloads the changed modules in the running procs);
- one rank restarts in place (``%mesh restart 2``), and faults are injected from a magic or from
  the supervision-tree widget (``%mesh tree``), which shows failures as they happen and keeps
  answering clicks while a ``%mesh wait`` waits.

The everyday moves of those peers are here too: auto mode (``%mesh auto on``, ``%automesh``),
``%mesh push/pull/scatter/gather`` (and the same methods on the mesh ``%mesh start`` returns),
``%%mesh --local``, ``device`` and ``local_rank`` on every rank, ``%mesh status`` with devices and
memory, ``%mesh barrier``, and ``CellRun.wait_interactive()``.

``%mesh --help`` lists the subcommands; ``%mesh SUBCOMMAND --help`` explains one. Argument
parsing is in :mod:`.parsers`, the cell magic in :mod:`.cell_magic`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from ..job import placement as placement_mod
from . import automode, interrupts, session as session_mod, values
from .cell_magic import run_cell_magic
from .fallback import freeze_all
from .parsers import (SUBCOMMANDS, HelpShown, build_cell_parser, build_line_parser, fault_kinds, parse_fault_spec,
                      parse_params, split_line)
from .ranks import RankSpecError, format_ranks

if TYPE_CHECKING:
    from ..faults.spec import FaultSpec

__all__ = ["MeshMagics", "load_ipython_extension", "unload_ipython_extension"]

#: fault kinds whose effect is the proc's exit: ``%mesh fault`` returns once the exit is seen
_ENDS_THE_PROC = ("kill", "segfault", "exit")


@magics_class
class MeshMagics(Magics):
    """The ``%mesh`` line magic, the ``%%mesh`` cell magic and ``%automesh``."""

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
            return run_cell_magic(self.shell, self.cell_parser.parse_args(split_line(line)), cell)
        except HelpShown:
            return None
        except session_mod.NoMeshError as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def automesh(self, line: str) -> None:
        """Toggle auto mode (every cell runs on the ranks), like ipyparallel's ``%autopx``."""
        self._line("auto" + (f" {line}" if line.strip() else ""))

    # -- %mesh ------------------------------------------------------------------------------------
    def _line(self, line: str) -> Any:
        argv = split_line(line)
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
            except HelpShown:
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
        try:
            placement = placement_mod.resolve(args.hosts, args.job, args.ca, args.mesh)
        except placement_mod.PlacementError as exc:
            raise UsageError(str(exc)) from None
        t0 = time.monotonic()
        if placement.host_mesh is None:
            count = args.gpus or args.n or 4
            if args.gpus is not None:
                inventory = device.detect_gpus()
                if inventory.count < args.gpus:
                    raise UsageError(f"--gpus {args.gpus}: this host has {inventory.count} visible GPU(s); "
                                     f"use `%mesh start {args.gpus}` for CPU procs")
            procs = this_host().spawn_procs(per_host={"gpus": count}, name=args.name)
        else:
            try:
                count = placement_mod.procs_per_host(placement, args.n, args.gpus, _controller().hosts)
            except placement_mod.PlacementError as exc:
                raise UsageError(str(exc)) from None
            try:
                procs = placement.host_mesh.spawn_procs(per_host={"gpus": count}, name=args.name)
            except BaseException:
                _controller().detach_hosts(placement.attached)
                raise
        try:
            sess = session_mod.MeshSession(procs, attached_hosts=placement.attached)
            if args.dist:
                backend = sess.init_distributed()
        except BaseException:
            procs.stop()
            _controller().detach_hosts(placement.attached)
            raise
        session_mod.set_current(sess)
        dist = f", torch.distributed up ({backend})" if args.dist else ""
        where = f" (dims {dict(procs.extent)}) on {placement.where}" if placement.host_mesh is not None else ""
        print(f"mesh {procs.name}: {len(procs)} procs{where} up in {time.monotonic() - t0:.1f} s{dist}. "
              "Run cells on it with %%mesh (or `%mesh auto on`); see it live with %mesh tree.")
        return sess.procs

    def _cmd_status(self, args: argparse.Namespace) -> None:
        from .status import records_text, status_text

        sess = session_mod.current(required=False)
        if sess is not None:
            print(status_text(sess, auto_mode=automode.MODE.on))
        train = session_mod.training_run()
        if train is not None and not train.wait(0):
            procs = train.procs
            print(f"training run: {len(train.metrics)} steps committed")
            print(records_text(sess.controller if sess else _controller(), procs.name, len(procs)))
        elif sess is None:
            raise session_mod.NoMeshError()

    def _cmd_auto(self, args: argparse.Namespace) -> None:
        on = (not automode.MODE.on) if args.state is None else args.state == "on"
        if on:
            sess = session_mod.current()
            if args.ranks is not None:
                try:
                    sess.ranks(args.ranks)
                except RankSpecError as exc:
                    raise UsageError(str(exc)) from None
        print(automode.set_mode(self.shell, on, args.ranks))

    # -- moving values ----------------------------------------------------------------------------
    def _ranks_of(self, sess: Any, spec: str | None) -> list[int] | None:
        if spec is None:
            return None
        try:
            return sess.ranks(spec)
        except RankSpecError as exc:
            raise UsageError(str(exc)) from None

    def _values_call(self, what: str, fn: Any, *fn_args: Any) -> Any:
        from ..errors import ActorError, SupervisionError

        try:
            return fn(*fn_args)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"%mesh {what}: {exc}") from None
        except ActorError as exc:
            raise UsageError(f"%mesh {what}: {exc.exception_type}: {exc.remote.get('message', '')}") from None
        except (SupervisionError, TimeoutError) as exc:
            raise UsageError(f"%mesh {what}: {exc}") from None

    def _user_value(self, name: str, what: str) -> Any:
        shell = self.shell
        assert shell is not None  # a magic runs in its shell
        if name not in shell.user_ns:
            raise UsageError(f"%mesh {what} {name}: no variable {name!r} in this kernel")
        return shell.user_ns[name]

    def _cmd_push(self, args: argparse.Namespace) -> None:
        sess = session_mod.current()
        ranks = self._ranks_of(sess, args.ranks)
        payload = {name: self._user_value(name, "push") for name in args.names}
        done = self._values_call("push", values.push, sess, payload, ranks, args.timeout)
        print(f"pushed {', '.join(args.names)} to rank(s) {format_ranks(done)}")

    def _cmd_pull(self, args: argparse.Namespace) -> Any:
        sess = session_mod.current()
        return self._values_call("pull", values.pull, sess, args.names[0], self._ranks_of(sess, args.ranks), args.timeout)

    def _cmd_scatter(self, args: argparse.Namespace) -> None:
        sess = session_mod.current()
        name = args.names[0]
        value = self._user_value(name, "scatter")
        sizes = self._values_call("scatter", values.scatter, sess, name, value, self._ranks_of(sess, args.ranks), args.timeout)
        print(f"scattered {name} ({type(value).__name__}, length {sum(sizes.values())}) over rank(s) "
              f"{format_ranks(list(sizes))}: " + ", ".join(f"{r}: {n}" for r, n in sizes.items()))

    def _cmd_gather(self, args: argparse.Namespace) -> Any:
        sess = session_mod.current()
        return self._values_call("gather", values.gather, sess, args.names[0], self._ranks_of(sess, args.ranks), args.timeout)

    # -- waiting ----------------------------------------------------------------------------------
    def _cmd_barrier(self, args: argparse.Namespace) -> None:
        self._wait(args)

    def _cmd_wait(self, args: argparse.Namespace) -> None:
        self._wait(args)

    def _wait(self, args: argparse.Namespace) -> None:
        """The blocking form (an indented ``%mesh wait``); at a cell's top level it is awaited."""
        from .waiting import line_check, timed_out, wait_until

        check, what = line_check(self.shell, args)
        if not wait_until(check, args.timeout):
            raise timed_out(what, args.timeout)

    # -- the mesh ---------------------------------------------------------------------------------
    def _cmd_tree(self, args: argparse.Namespace) -> None:
        from IPython.display import display

        from .tree_widget import SupervisionTree

        sess = session_mod.current(required=False)
        controller = _controller(required=False)
        running = controller is not None and any(not m.stopped for m in controller.meshes.values())
        if sess is None and session_mod.training_run() is None and not running:
            raise session_mod.NoMeshError()
        widget = SupervisionTree()
        if sess is not None:
            sess.tree_widget = widget
        display(widget)

    def _cmd_stop(self, args: argparse.Namespace) -> None:
        sess = session_mod.current(required=False)
        train = session_mod.training_run()
        freeze_all()  # the widgets keep their last state, as static HTML
        if automode.MODE.on:
            print(automode.set_mode(self.shell, False))
        if sess is None and train is not None and not train.wait(0):
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
        """The ProcMesh for --mesh NAME, the training mesh, or the %%mesh one."""
        from ..actor.mesh import ProcMesh

        train = session_mod.training_run()
        if name in (None, ""):
            sess = session_mod.current(required=False)
            if sess is not None:
                return sess.procs
            if train is not None:
                return train.procs
            raise session_mod.NoMeshError()
        if name == "train":
            if train is None:
                raise UsageError("no training run; start one with `%mesh train`")
            return train.procs
        controller = _controller(required=False)
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

        kinds = fault_kinds()
        if args.kind not in kinds:
            raise UsageError(f"unknown fault kind {args.kind!r}; valid kinds: {', '.join(kinds)} "
                             "(usage: %mesh fault KIND RANK [PARAM=VALUE ...])")
        params = parse_params(args.params)
        try:
            params = validate_fault(args.kind, params)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        procs = self._mesh_for(args.mesh)
        self._check_rank(procs, args.rank)
        events = _controller().events
        mark = events.next_seq
        try:
            procs.inject(args.rank, args.kind, **params)
        except (ValueError, RuntimeError) as exc:
            raise UsageError(str(exc)) from None
        shown = " ".join(f"{k}={v}" for k, v in params.items())
        seen = ""
        if args.kind in _ENDS_THE_PROC:  # the next cell must find the rank dead, not still running
            from ..config import config

            event = events.wait_for(lambda e: e.kind == "proc_exited" and e.rank == args.rank and e.mesh == procs.name,
                                    timeout=config.hang_timeout_s + 2 * config.heartbeat_interval_s, since_seq=mark)
            seen = f" ({event.detail})" if event is not None else " (its exit is not seen yet)"
        print(f"injected {args.kind}{' ' + shown if shown else ''} into rank {args.rank} of {procs.name}{seen}")

    def _cmd_restart(self, args: argparse.Namespace) -> None:
        procs = self._mesh_for(args.mesh)
        self._check_rank(procs, args.rank)
        t0 = time.monotonic()
        procs.restart(args.rank)
        print(f"rank {args.rank} of {procs.name} restarted in {time.monotonic() - t0:.2f} s "
              f"(pid {_controller().proc_record(procs.name, args.rank).pid})")

    def _cmd_run(self, args: argparse.Namespace) -> None:
        from ..spmd import ScriptFailed, run_script

        procs = self._mesh_for(args.mesh)
        try:
            run = run_script(procs, args.script, args.args, max_restarts=args.max_restarts, timeout_s=args.timeout)
        except (FileNotFoundError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        except ScriptFailed as exc:
            last = exc.failures[-1]
            print(f"{exc}\n`%mesh debug {last.rank}` opens rank {last.rank}'s post-mortem", file=sys.stderr)
            return
        restarts = f" after {run.attempts - 1} restart(s)" if run.attempts > 1 else ""
        print(f"{args.script} ended on all {run.world_size} ranks in {run.seconds:.2f} s{restarts}")

    def _cmd_sync(self, args: argparse.Namespace) -> Any:
        from ..actor.workspace import WorkspaceSyncError

        procs = self._mesh_for(args.mesh)
        try:
            done = procs.sync_workspace(args.path, auto_reload=args.reload, exclude=args.exclude,
                                        max_bytes=args.max_mib * 2**20, max_files=args.max_files)
        except (NotADirectoryError, ValueError) as exc:  # no folder, too large
            raise UsageError(str(exc)) from None
        except WorkspaceSyncError as exc:
            print(str(exc), file=sys.stderr)
            return None
        print(done.summary())
        return None

    def _cmd_logs(self, args: argparse.Namespace) -> None:
        procs = self._mesh_for(args.mesh)
        self._check_rank(procs, args.rank)
        rec = _controller().proc_record(procs.name, args.rank)
        lines = [line for line in rec.output_tail if "\x1emnb:" not in line][-args.lines:]
        print(f"--- rank {args.rank} ({rec.state}, pid {rec.pid}), last {len(lines)} line(s) ---")
        for text in lines:
            print(text)

    def _cmd_train(self, args: argparse.Namespace) -> Any:
        try:
            from .. import train as train_mod

            start = train_mod.start
        except (ImportError, AttributeError):
            raise UsageError("training is not available in this install (monarch_nb.train.start is missing)") from None
        from IPython.display import display

        from .dashboard import TrainingDashboard

        previous = session_mod.training_run()
        if previous is not None and not previous.wait(0):
            raise UsageError("a training run is already going; wait for it or stop it (`%mesh stop` stops it too)")
        procs = args.procs or 4
        faults: list[str | FaultSpec | dict[str, Any]] = [parse_fault_spec(f, procs) for f in args.fault]
        try:
            run = start(workload=args.workload, procs=procs, steps=args.steps, faults=faults, seed=args.seed)
        except (ValueError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
        dashboard = TrainingDashboard(total_steps=args.steps)
        dashboard.attach(run)
        session_mod.set_training_run(run, dashboard)
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


def _controller(required: bool = True) -> Any:
    from ..runtime.controller import Controller

    return Controller.get() if required else Controller.existing()


# -- extension -------------------------------------------------------------------------------------
def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(MeshMagics)
    automode.install(ipython)
    interrupts.install(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    freeze_all()
    automode.uninstall(ipython)
    interrupts.uninstall(ipython)
    sess = session_mod.current(required=False)
    if sess is not None:
        sess.stop()
        session_mod.set_current(None)
