"""Disk checkpoints for whole-job restarts: where they are, and a sharded run's through DCP.

An unsharded run (every rank a whole replica) writes one ``torch.save`` file per checkpoint,
``step<next step>.pt``, from one rank. A sharded run (``group_size > 1``) writes a
``torch.distributed.checkpoint`` (DCP) folder, ``step<next step>.dcp``, from every rank of one
replica group: each rank its own shards, DCP's ``.metadata`` naming which slice of which tensor
each file holds. DCP reshards on load, so the folder loads into any layout: another group size,
or an unsharded run (``torch.distributed.checkpoint``'s own resharding; see
:func:`load_sharded`). The trainer's counters and registered objects (LR schedulers, scalers),
the same on every rank, go to ``trainer.pt`` beside the shards.

Both kinds appear whole or not at all: a file is written to a temporary name and renamed; a
folder is written as ``<name>.tmp`` and renamed by the group's first rank after DCP's collective
save has returned on every rank.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any

__all__ = ["checkpoint_path", "latest_checkpoint", "save_sharded", "load_sharded", "TRAINER_FILE"]

#: the trainer's counters and registered objects inside a sharded checkpoint's folder
TRAINER_FILE = "trainer.pt"

_NAME = re.compile(r"^step(\d+)\.(pt|dcp)$")


def checkpoint_path(directory: str, next_step: int, sharded: bool) -> str:
    """The absolute path of the checkpoint taken before step ``next_step``: ``step%08d.pt``
    (unsharded) or ``step%08d.dcp`` (a sharded run's DCP folder) in ``directory``."""
    return os.path.abspath(os.path.join(directory, f"step{next_step:08d}.{'dcp' if sharded else 'pt'}"))


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint in ``directory`` (absolute path: a ``step*.pt`` file or a
    ``step*.dcp`` folder, the highest step; a ``.dcp`` at the same step as a ``.pt`` wins), or None."""
    if not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), match.group(2) == "dcp", name))
    return os.path.abspath(os.path.join(directory, max(found)[2])) if found else None


def save_sharded(path: str, model: Any, optimizer: Any, trainer_state: dict, group_rank: int, incarnation: int) -> None:
    """Write this rank's shards of ``model`` and ``optimizer`` to the DCP folder ``path``, with
    the rest of the group (collective over the proc's default process group: every rank of the
    group calls it). The group's rank 0 also writes ``trainer_state`` (counters, registered
    objects: the same on every rank) and renames ``<path>.tmp<incarnation>`` to ``path`` (a
    temporary folder per incarnation of the group, so a writer group being taken out never
    touches its successor's), then removes what earlier incarnations left.

    Raises:
        torch.distributed.checkpoint's CheckpointException, RuntimeError or OSError: a partner
            failed during the save, or the disk did; nothing is renamed then, so no half-written
            checkpoint looks complete.
    """
    import glob

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = f"{path}.tmp{incarnation}"
    if group_rank == 0:  # a folder left by a save that was killed: partners write only after the plan is agreed
        shutil.rmtree(tmp, ignore_errors=True)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    if group_rank == 0:
        torch.save(trainer_state, os.path.join(tmp, TRAINER_FILE))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        for stale in glob.glob(glob.escape(path) + ".tmp*"):
            shutil.rmtree(stale, ignore_errors=True)


def load_sharded(path: str, model: Any, optimizer: Any, distributed: bool) -> dict:
    """Load the DCP folder ``path`` into ``model`` and ``optimizer`` as they are laid out here
    (resharded by DCP to this group's size; ``distributed=False``: a whole model, no process
    group); returns the trainer state saved beside the shards.

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint.
        RuntimeError: the checkpoint's tensors do not fit this model (another architecture).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    trainer_file = os.path.join(path, TRAINER_FILE)
    if not os.path.isfile(trainer_file):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (no {TRAINER_FILE})")
    # get_state_dict creates a fresh optimizer's state (a zero step) only when no parameter has a
    # gradient; an unsharded trainer's are views of its flat buffer from the start: set aside
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        # fresh dicts: set_state_dict replaces the tensors of the dict it is given
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        with warnings.catch_warnings():  # no_dist: DCP warns that it "assumes a single process", which it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=not distributed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return torch.load(trainer_file, weights_only=False)
