"""Debugging failed, paused and hung ranks from the notebook: post-mortem pdb, breakpoints, live stacks.

The controller-side API lives in :mod:`monarch_nb.debug.client` (``debug_targets``,
``DebugSession``, ``cast``, ``continue_all``, ``stacks``, ``format_stacks``); the ``%mesh debug``
and ``%mesh stack`` magics in :mod:`monarch_nb.debug.magic`. Worker-side parts:
:mod:`~monarch_nb.debug.postmortem` (kept failures), :mod:`~monarch_nb.debug.remote_pdb` (pdb
driven by messages), :mod:`~monarch_nb.debug.stacks` and :mod:`~monarch_nb.debug.worker` (the
plugin each proc installs).
Names load lazily.

May import: the core (``actor``, ``supervision``, ``transport``, ``config``, ``errors``,
``device``) and ``runtime``. Never another feature.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "DebugError": "monarch_nb.debug.client",
    "DebugSession": "monarch_nb.debug.client",
    "DebugTarget": "monarch_nb.debug.client",
    "debug_targets": "monarch_nb.debug.client",
    "format_targets": "monarch_nb.debug.client",
    "cast": "monarch_nb.debug.client",
    "continue_all": "monarch_nb.debug.client",
    "clear_failures": "monarch_nb.debug.client",
    "format_stacks": "monarch_nb.debug.client",
    "record_failure": "monarch_nb.debug.worker",
    "debug_command": "monarch_nb.debug.magic",
    "stack_command": "monarch_nb.debug.magic",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('monarch_nb.debug', _EXPORTS, globals())
