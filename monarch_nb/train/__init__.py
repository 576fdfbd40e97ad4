"""Fault-tolerant data-parallel training on a local mesh: ``fit`` (blocking) and ``start`` (background).

    import monarch_nb.train as mt
    report = mt.fit("digits", procs=4, steps=300, faults=["kill@120:rank=2", "hang@200:rank=1"])
    print(report)                       # final loss, test accuracy, failures and their latencies
    run = mt.start("digits", procs=4)   # in a notebook: returns at once
    run.subscribe(print); run.wait(); run.report().to_json("report.json")

The rooms, on the controller: :mod:`.run` (``fit``, ``start``, the :class:`TrainingRun` handle),
:mod:`.options` (checked options), :mod:`.coordinator` (windows of steps, commits), with
:mod:`.launch` (procs, trainers) and :mod:`.boundaries` (recover, restore, inject, heal) as its
parts, :mod:`.recovery` (failures, restarts, quorums, heals), :mod:`.report`, :mod:`.progress`
(the terminal's progress bar), :mod:`.cli`; shared: :mod:`.data` (the sample order and ledger),
:mod:`.workloads`. In each proc: :mod:`.trainer` (the Trainer actor) with :mod:`.trainer_quorum`,
:mod:`.trainer_state`, :mod:`.trainer_stream` and :mod:`.trainer_snapshot`. Design and figures:
``docs/training.md``. Names load lazily, so importing this package does not import torch.

May import: the core, ``runtime`` and ``faults``; ``hip_ext`` (outside this package) for kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "fit": "monarch_nb.train.run",
    "start": "monarch_nb.train.run",
    "TrainingRun": "monarch_nb.train.run",
    "TrainReport": "monarch_nb.train.report",
    "FailureRecord": "monarch_nb.train.report",
    "TrainingError": "monarch_nb.train.recovery",
    "TrainOptions": "monarch_nb.train.options",
    "Workload": "monarch_nb.train.workloads",
    "get_workload": "monarch_nb.train.workloads",
    "FaultSpec": "monarch_nb.faults.spec",
    "parse_fault": "monarch_nb.faults.spec",
    "SampleOrder": "monarch_nb.train.data",
    "SampleLedger": "monarch_nb.train.data",
    "Trainer": "monarch_nb.train.trainer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from ..faults.spec import FaultSpec, parse_fault
    from .data import SampleLedger, SampleOrder
    from .options import TrainOptions
    from .recovery import TrainingError
    from .report import FailureRecord, TrainReport
    from .run import TrainingRun, fit, start
    from .trainer import Trainer
    from .workloads import Workload, get_workload


__getattr__, __dir__ = lazy_exports('monarch_nb.train', _EXPORTS, globals())
