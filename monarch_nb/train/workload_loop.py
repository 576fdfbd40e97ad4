"""The built-in workloads' training function: a loop written with ``ft``, like a user's. Runs in procs.

``mt.fit("digits", ...)`` and ``mt.fit(Workload.custom(...), ...)`` run :func:`workload_loop` on
every rank: it builds the workload's model and optimizer, wraps them with ``ft``, registers the
workload's test set as the evaluator, and loops over ``ft.batches``. So the built-in trainer and a
user's own loop are one implementation (the Trainer and ``ft``), and every guarantee of one is
the other's.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import ft
from .workloads import Workload

__all__ = ["workload_loop"]


def workload_loop(workload: Workload, lr: float, global_batch: int, steps: int) -> ft.RankReport:
    """Train ``workload`` for ``steps`` steps of ``global_batch`` samples with learning rate ``lr``."""
    workload.setup()
    device = ft.device()
    model = workload.build_model().to(device)
    optimizer = workload.build_optimizer([p for p in model.parameters() if p.requires_grad], lr)
    model, optimizer = ft.wrap(model, optimizer)
    if workload.name != "custom":
        # the built-in workloads never change a model's output in place, so FSDP2's warning that it
        # is a view (a Linear over 3-D input returns one) tells their users nothing
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    @ft.evaluator
    def evaluate() -> dict:
        return _evaluate(workload, model, device)

    model.train()
    for _step, (inputs, targets) in ft.batches(workload.train_batch, global_batch, steps,
                                               num_samples=workload.num_train):
        inputs, targets = inputs.to(device), targets.to(device)
        loss_sum, correct = workload.loss_sum(model, inputs, targets)
        (loss_sum / len(targets)).backward()
        ft.step(optimizer, loss=loss_sum.detach() / len(targets), correct=correct)
    return ft.report()


def _evaluate(workload: Workload, model: Any, device: Any) -> dict:
    """Loss and accuracy on the workload's test set: ``{"test_loss", "test_accuracy" (or None),
    "test_samples"}``."""
    loss = correct = n = 0.0
    for inputs, targets in workload.test_batches():
        ls, c = workload.loss_sum(model, inputs.to(device), targets.to(device))
        loss += float(ls)
        correct += float(c or 0)
        n += len(targets)
    if not n:
        return {"test_loss": None, "test_accuracy": None, "test_samples": 0}
    acc = correct / n if workload.classification else None
    return {"test_loss": loss / n, "test_accuracy": acc, "test_samples": int(n)}
