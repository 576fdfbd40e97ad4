"""The notebook (a feature): ``%mesh`` / ``%%mesh`` magics, widgets, waits, the workshop, the kernelspec.

Kernel side: the magics (:mod:`.magics`, parsed by :mod:`.parsers`; the cell magic in
:mod:`.cell_magic`), the session and its values (:mod:`.session`, :mod:`.values`), cell runs and
their output (:mod:`.cells`, :mod:`.routing`, :mod:`.cell_errors`), where ``%mesh start`` puts
procs (:mod:`monarch_nb.job.placement`: this host, ``--hosts``, ``--job``), status, waits, auto
mode, interrupts, the widgets (:mod:`.tree_widget` with its layouts :mod:`.tree_grid` and browser
side :mod:`.tree_view`; :mod:`.dashboard`; :mod:`.fallback`) and the workshop's checkers. Worker
side (run inside procs): :mod:`.worker` (the ``%%mesh`` cell executor and the status probe),
:mod:`.display_worker` and :mod:`.mpl_worker` (rich output).

Nothing here is imported by ``import monarch_nb``; ``%load_ext monarch_nb`` loads it, and the
names below load on first use.

May import: the core, ``runtime`` and the other features (``train``, ``debug``, ``faults``, ``job``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "wait": "monarch_nb.jupyter.waiting",
    "MeshProcs": "monarch_nb.jupyter.session",
    "MeshSession": "monarch_nb.jupyter.session",
    "CellRun": "monarch_nb.jupyter.cells",
    "MeshCellError": "monarch_nb.jupyter.cell_errors",
    "SupervisionTree": "monarch_nb.jupyter.tree_widget",
    "TrainingDashboard": "monarch_nb.jupyter.dashboard",
    "Workshop": "monarch_nb.jupyter.workshop",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .cell_errors import MeshCellError
    from .cells import CellRun
    from .dashboard import TrainingDashboard
    from .session import MeshProcs, MeshSession
    from .tree_widget import SupervisionTree
    from .waiting import wait
    from .workshop import Workshop

__getattr__, __dir__ = lazy_exports("monarch_nb.jupyter", _EXPORTS, globals())
