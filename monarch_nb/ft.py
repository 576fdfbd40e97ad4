"""``monarch_nb.ft``: fault tolerance for your own training loop (the public face of
:mod:`monarch_nb.train.ft`; see there, and docs/training.md)."""

from __future__ import annotations

from .train.ft import RankReport, batches, device, evaluator, rank, register, report, step, world_size, wrap

__all__ = ["wrap", "batches", "step", "register", "evaluator", "report", "device", "rank", "world_size", "RankReport"]
