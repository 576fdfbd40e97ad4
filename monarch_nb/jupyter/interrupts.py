"""An interrupt of the kernel stops the ``%%mesh --no-block`` cells, whatever the kernel is doing.

Three moments, one rule (README: interrupting the kernel stops the cell on every rank, blocking
or not):

- a ``%%mesh`` cell blocks: it interrupts itself (:mod:`.cell_magic`) and the background cells;
- another cell runs (a local loop, ``time.sleep``, a ``%mesh wait``): IPython's ``pre_run_cell``
  event wraps the SIGINT handler that ipykernel installed for the cell, so the signal first
  stops the background cells, then does what it did (KeyboardInterrupt, or cancelling an
  ``await``); ``post_run_cell`` puts the handler back;
- the kernel is idle (ipykernel ignores SIGINT then): the handler ipykernel restores between
  requests (``kernel.saved_sigint_handler``) is :func:`_idle_sigint`.

The background cells are interrupted from a short-lived thread: a signal handler must not take
locks the interrupted code may hold.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

from . import session as session_mod

__all__ = ["install", "stop_background", "install_idle_interrupt"]


def stop_background() -> None:
    """Interrupt the background ``%%mesh`` cells, if any (safe from a signal handler)."""
    sess = session_mod.current(required=False)
    if sess is not None and any(not r.done() for r in sess.background):
        threading.Thread(target=sess.interrupt_background, name="mesh-interrupt", daemon=True).start()


def _idle_sigint(signum: int, frame: Any) -> None:
    """SIGINT while no cell executes (ipykernel ignores it then): stop the background cells."""
    stop_background()


class _ChainedSigint:
    """The SIGINT handler during a cell: stop the background cells, then call ``previous``."""

    def __init__(self, previous: Callable | int | None) -> None:
        self.previous = previous

    def __call__(self, signum: int, frame: Any) -> None:
        stop_background()
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _pre_run_cell(*_args: Any) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, _ChainedSigint) or current in (signal.SIG_IGN, None):
        return
    signal.signal(signal.SIGINT, _ChainedSigint(current))


def _post_run_cell(*_args: Any) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, _ChainedSigint):
        signal.signal(signal.SIGINT, current.previous)


def install_idle_interrupt(shell: Any) -> None:
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


_installed: dict[int, bool] = {}


def install(shell: Any) -> None:
    """Register the cell-time handler with ``shell``'s events (once per shell)."""
    if _installed.get(id(shell)):
        return
    shell.events.register("pre_run_cell", _pre_run_cell)
    shell.events.register("post_run_cell", _post_run_cell)
    _installed[id(shell)] = True


def uninstall(shell: Any) -> None:
    if _installed.pop(id(shell), False):
        for name, fn in (("pre_run_cell", _pre_run_cell), ("post_run_cell", _post_run_cell)):
            try:
                shell.events.unregister(name, fn)
            except ValueError:
                pass
