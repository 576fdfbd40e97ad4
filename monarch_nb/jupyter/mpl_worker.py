"""matplotlib backend of procs that run ``%%mesh`` cells: Agg drawing, figures shown as PNG.

Selected with ``MPLBACKEND=module://monarch_nb.jupyter.mpl_worker`` by the cell executor
(:func:`.display_worker.install`). ``plt.show()`` displays every open figure in the cell that
runs now, on its rank, and closes it, as matplotlib-inline does in a notebook.
"""

from __future__ import annotations

from typing import Any

from matplotlib._pylab_helpers import Gcf
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from .display_worker import display

__all__ = ["FigureCanvas", "FigureManager", "show"]

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: Any, **kwargs: Any) -> None:
    """Display each open figure (PNG) and close it."""
    for manager in Gcf.get_all_fig_managers():
        display(manager.canvas.figure)
    Gcf.destroy_all()
