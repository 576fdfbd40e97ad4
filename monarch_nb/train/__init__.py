"""Fault-tolerant data-parallel training on a local mesh: ``fit`` (blocking) and ``start`` (background).

    import monarch_nb.train as mt
    report = mt.fit("digits", procs=4, steps=300, faults=["kill@120:rank=2", "hang@200:rank=1"])
    print(report)                       # final loss, test accuracy, failures and their latencies
    run = mt.start("digits", procs=4)   # in a notebook: returns at once
    run.subscribe(print); run.wait(); run.report().to_json("report.json")

See :mod:`monarch_nb.train.loop` for how failures are handled, :mod:`.trainer` for the actor,
:mod:`.data` for the sample order and ledger, :mod:`.workloads` for what can be trained.
Names load lazily, so importing this package does not import torch. ``trainer`` (the Trainer
actor) runs inside each proc; the rest runs on the controller.

May import: the core, ``runtime`` and ``faults``; ``hip_ext`` (outside this package) for kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "fit": "monarch_nb.train.loop",
    "start": "monarch_nb.train.loop",
    "TrainingRun": "monarch_nb.train.loop",
    "TrainReport": "monarch_nb.train.report",
    "FailureRecord": "monarch_nb.train.report",
    "TrainingError": "monarch_nb.train.loop",
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
    from .data import SampleLedger, SampleOrder
    from ..faults.spec import FaultSpec, parse_fault
    from .loop import TrainingError, TrainingRun, fit, start
    from .report import FailureRecord, TrainReport
    from .trainer import Trainer
    from .workloads import Workload, get_workload


__getattr__, __dir__ = lazy_exports('monarch_nb.train', _EXPORTS, globals())
