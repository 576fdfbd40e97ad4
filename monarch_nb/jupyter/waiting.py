"""Waits that keep the notebook responsive: ``%mesh wait``, ``%mesh barrier`` and ``await wait(...)``.

A cell that blocks (``run.wait()``, a ``time.sleep`` loop) keeps the kernel from handling widget
messages: the supervision tree's buttons do nothing until it ends. An *awaiting* cell does not:
since ipykernel 7.4 a cell that awaits lets the kernel dispatch comm (widget) messages meanwhile
(ipykernel's async cell execution). So every wait here has an awaitable form that polls a
condition with ``asyncio.sleep`` (every 50 ms), and:

- ``await wait(run)``, ``await wait(run, step=50)``, ``await wait(until=lambda: ...)`` in Python;
- ``%mesh wait ...`` and ``%mesh barrier`` at the top level of a cell are rewritten by the
  extension's input transformer (:mod:`.automode`) into ``await line_async(...)``, so the magic
  form keeps widgets alive too; indented (inside a block) they block, as any magic.

An interrupt cancels an awaiting cell (ipykernel turns SIGINT into cancellation) and stops the
background ``%%mesh`` cells (:mod:`.interrupts`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

__all__ = ["wait", "done_check", "steps_check", "background_check", "wait_until", "wait_until_async", "line_async", "POLL_S"]

#: how often a wait checks its condition (s)
POLL_S = 0.05

Check = Callable[[], bool]


def done_check(obj: Any) -> Check:
    """A function saying whether ``obj`` has finished: its ``done()``, or its ``wait(0)``.

    Raises:
        TypeError: ``obj`` has neither.
    """
    done = getattr(obj, "done", None)
    if callable(done):
        return lambda: bool(done())
    wait_fn = getattr(obj, "wait", None)
    if callable(wait_fn):
        return lambda: bool(wait_fn(0))
    raise TypeError(f"cannot wait for a {type(obj).__name__}: it has neither done() nor wait(timeout)")


def steps_check(run: Any, steps: int) -> Check:
    """True once ``run`` (a training run) has committed ``steps`` steps (its ``metrics`` hold one
    entry per committed step), or has ended."""
    finished = done_check(run)
    return lambda: finished() or len(getattr(run, "metrics", None) or ()) >= steps


def _check_for(target: Any, step: int | None, until: Check | None) -> Check:
    """True when any given condition holds: ``target`` done (or its ``step`` steps), ``until()``."""
    checks: list[Check] = []
    if target is not None:
        checks.append(steps_check(target, step) if step is not None else done_check(target))
    if until is not None:
        checks.append(lambda: bool(until()))
    if not checks:
        raise TypeError("wait for what? give a target (a run), step=N with it, or until=callable")
    return lambda: any(check() for check in checks)


def background_check() -> Check:
    """True once the background ``%%mesh`` cells and the ``%mesh train`` run have finished."""
    from . import session as session_mod

    sess = session_mod.current(required=False)
    runs = list(sess.running()) if sess is not None else []
    train = session_mod.training_run()
    checks = [done_check(r) for r in runs] + ([done_check(train)] if train is not None else [])
    return lambda: all(check() for check in checks)


def wait_until(check: Check, timeout_s: float | None = None, poll_s: float = POLL_S) -> bool:
    """Block until ``check()`` is true (True) or ``timeout_s`` passes (False)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not check():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


async def wait_until_async(check: Check, timeout_s: float | None = None, poll_s: float = POLL_S) -> bool:
    """Await until ``check()`` is true (True) or ``timeout_s`` passes (False); the kernel handles
    widget messages meanwhile."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not check():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


async def wait(target: Any = None, *, step: int | None = None, until: Check | None = None,
               timeout_s: float | None = None) -> bool:
    """``await wait(run)``: until ``target`` finishes (``done()`` or ``wait(0)``); with
    ``step=N``, until it committed N steps or ended; with ``until``, until ``until()`` is true.
    The notebook's widgets stay live meanwhile. Returns False if ``timeout_s`` passed first.

    Raises:
        TypeError: nothing to wait for, or a target that cannot be waited for.
    """
    return await wait_until_async(_check_for(target, step, until), timeout_s)


def line_check(shell: Any, args: Any) -> tuple[Check, str]:
    """The condition and a description of a parsed ``%mesh wait`` or ``%mesh barrier`` line."""
    from IPython.core.error import UsageError

    from . import session as session_mod

    if args.command == "barrier":
        sess = session_mod.current()
        ranks = None if args.ranks is None else sess.ranks(args.ranks)
        return sess.idle_check(ranks), "every rank idle"
    if args.step is not None and args.target is None:
        raise UsageError("--step N needs the run to wait for: %mesh wait NAME --step N")
    until = None
    if args.until:
        try:
            code = compile(args.until, "<%mesh wait --until>", "eval")
        except SyntaxError as exc:
            raise UsageError(f"--until {args.until!r} is not a Python expression: {exc.msg}") from None
        until = lambda: eval(code, shell.user_ns)  # noqa: E731
    if args.target is not None:
        if args.target not in shell.user_ns:
            raise UsageError(f"%mesh wait {args.target}: no variable {args.target!r} in this kernel")
        target = shell.user_ns[args.target]
        try:
            check = _check_for(target, args.step, until)
        except TypeError as exc:
            raise UsageError(f"%mesh wait {args.target}: {exc}") from None
        return check, args.target + (f" to commit {args.step} steps" if args.step is not None else "")
    if until is not None:
        return until, args.until
    return background_check(), "the background work"


def timed_out(what: str, timeout_s: float) -> Exception:
    from IPython.core.error import UsageError

    return UsageError(f"still waiting for {what} after {timeout_s} s")


async def line_async(shell: Any, line: str) -> None:
    """``%mesh wait ...`` / ``%mesh barrier ...`` as an awaitable (what the input transformer
    writes for such a line at the top level of a cell)."""
    from .parsers import HelpShown, build_line_parser, split_line

    try:
        args = build_line_parser().parse_args(split_line(line))
    except HelpShown:
        return
    check, what = line_check(shell, args)
    if not await wait_until_async(check, args.timeout):
        raise timed_out(what, args.timeout)
