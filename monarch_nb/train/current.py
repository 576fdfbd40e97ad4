"""The Trainer of this proc's training run, for ``ft`` to find (None outside a run). Runs in procs."""

from __future__ import annotations

from typing import Any

__all__ = ["trainer"]

#: set by ``Trainer.setup`` before the training function starts
trainer: Any = None
