"""``%%mesh``: run a cell on the ranks, blocking (interruptible) or in the background.

A blocking cell pumps its run's output on the kernel's main thread until every rank is done; an
interrupt stops it on every rank (and stops the background cells, see :mod:`.interrupts`),
shows what the ranks printed while stopping, and fails the cell. ``--no-block`` returns at
once; a pump thread shows the output in this cell as it comes, and the interrupt handler stops
it. ``--local`` runs the cell in the kernel too, after starting it on the ranks, so both run at
once and the local run shows first.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from IPython.core.error import UsageError

from . import interrupts, session as session_mod
from .ranks import RankSpecError, format_ranks
from .routing import CellOutput

__all__ = ["run_cell_magic", "INTERRUPT_WAIT_S"]

log = logging.getLogger(__name__)

#: how long an interrupted cell may take to stop on every rank before we stop waiting
INTERRUPT_WAIT_S = 3.0


def run_cell_magic(shell: Any, args: Any, cell: str) -> Any:
    """Run ``cell`` on the mesh as the parsed ``%%mesh`` options ``args`` say."""
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
    run = sess.run_cell(cell, ranks, stream=args.stream, group_outputs=args.group_outputs, frame=args.frame,
                        output=CellOutput())
    if args.out:
        shell.user_ns[args.out] = run
    if not args.block:
        sess.add_background(run)
        interrupts.install_idle_interrupt(shell)
        threading.Thread(target=_pump_background, args=(run,), name=f"mesh-cell-{run.number}", daemon=True).start()
        print(f"running on rank(s) {format_ranks(ranks)} in the background"
              f"{f'; its CellRun is {args.out}' if args.out else ''}; interrupt the kernel to stop it")
        if args.local:
            _run_local(shell, cell)
        return None
    sess.foreground = run
    try:
        if args.local:
            _run_local(shell, cell)
        return _block(sess, run, args.timeout)
    finally:
        sess.foreground = None


def _run_local(shell: Any, cell: str) -> None:
    """The cell in the kernel, as a cell of its own would run (its output, its Out)."""
    result = shell.run_cell(cell, store_history=False)
    if result.error_in_exec is not None and isinstance(result.error_in_exec, KeyboardInterrupt):
        raise KeyboardInterrupt


def _block(sess: Any, run: Any, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupted = False
    if deadline is not None:
        def watch() -> None:
            while not run.wait(0.1):
                if time.monotonic() > deadline:
                    run.interrupt()
                    return
        threading.Thread(target=watch, daemon=True).start()
    try:
        run.pump()
    except KeyboardInterrupt:
        interrupted = True
        run.interrupt()
        sess.interrupt_background()
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
        if error is not None:  # the ranks that had failed before the interrupt: their tracebacks, not lost
            _show_error(run, error)
        raise UsageError(f"interrupted; rank(s) {format_ranks(run.running_ranks())} did not stop within {INTERRUPT_WAIT_S} s "
                         f"(a C call that blocks?): `%mesh restart RANK` ends it")
    if error is not None:
        raise error
    if interrupted:
        raise KeyboardInterrupt
    return None


def _show_error(run: Any, error: Any) -> None:
    """``error`` (a MeshCellError) as IPython would show it, on ``run``'s stderr."""
    run.output.stream("stderr", "\n".join(error._render_traceback_()) + "\n")
    run.output.flush()


def _pump_background(run: Any) -> None:
    try:
        run.pump()
        run.show_results()
        error = run.error()
        if error is not None:
            _show_error(run, error)
    except Exception:
        log.exception("showing the output of %r failed", run)
