"""The Trainer's endpoints that move its state: heals, snapshots, disk checkpoints. Runs in procs.

:class:`StateEndpoints` (a part of :class:`~monarch_nb.train.trainer.Trainer`) moves the state
stream of :mod:`.trainer_stream` three ways:

- **heal**: a donor sends its stream in chunks (views of its live tensors, no copy on CPU) through
  the controller to a restarted rank, which checks the SHA-256 before loading it;
- **snapshots**: every few steps one trainer per host publishes its stream to shared memory,
  outside every trainer (:mod:`.trainer_snapshot`), and restarted trainers load the newest when
  every replica was lost;
- **disk checkpoints** for whole-job restarts (a sharded run's through DCP, :mod:`.checkpoints`).
"""

from __future__ import annotations

import logging
import os
import time

from ..actor.endpoint import endpoint
from .checkpoints import load_sharded, save_sharded
from .trainer_snapshot import SnapshotWriter, read_snapshot
from .trainer_stream import Incoming, bytes_view, capture, manifest, stream_slice
from .trainer_fields import TrainerFields

__all__ = ["StateEndpoints"]

log = logging.getLogger(__name__)


class StateEndpoints(TrainerFields):
    """The Trainer's endpoints that move its state: heal (donor and joiner), snapshots, disk
    checkpoints, memory. A room of :class:`~monarch_nb.train.trainer.Trainer` (its shared fields:
    :class:`~.trainer_fields.TrainerFields`)."""

    _writer: SnapshotWriter | None = None
    _incoming: Incoming | None = None
    _outgoing: list = []

    # -- healing: donor side --------------------------------------------------------------------
    @endpoint
    def state_manifest(self) -> dict:
        """Describe this rank's state for a joiner (see :func:`manifest`); pins it until :meth:`state_done`."""
        tensors, skeleton, meta = capture(self.model, self.optimizer, self.applied_steps, self.next_step, self.rank, self.registered)
        self._outgoing = [bytes_view(t) for t in tensors]
        return manifest(self._outgoing, skeleton, meta, self.chunk_bytes)

    @endpoint
    def state_chunk(self, index: int) -> list:
        """Bytes ``[index*chunk_bytes, (index+1)*chunk_bytes)`` of the state stream, as uint8 array views."""
        return stream_slice(self._outgoing, index * self.chunk_bytes, (index + 1) * self.chunk_bytes)

    @endpoint
    def state_done(self) -> None:
        self._outgoing = []

    # -- healing: joiner side -------------------------------------------------------------------
    @endpoint
    def load_begin(self, manifest: dict) -> None:
        """Prepare to receive a donor's state: its model tensors land in this model's own tensors."""
        self._leave_group()
        self._broken = True
        self._incoming = Incoming(manifest, self.model, self.device)

    @endpoint
    def load_chunk(self, index: int, pieces: list) -> int:
        """Write chunk ``index`` (uint8 arrays, in stream order); returns bytes received so far."""
        if self._incoming is None:
            raise RuntimeError("load_chunk before load_begin")
        return self._incoming.write(index * self._incoming.manifest["chunk_bytes"], pieces)

    @endpoint
    def load_end(self) -> dict:
        """Verify the stream's SHA-256 and load it; returns ``{"rank", "applied_steps", "next_step", "sha256"}``.

        Raises:
            ValueError: the checksum or the size does not match the donor's manifest.
        """
        inc, self._incoming = self._incoming, None
        if inc is None:
            raise RuntimeError("load_end before load_begin")
        meta = inc.finish(self.model, self.optimizer, self.registered)
        return self._loaded(meta, inc.manifest["sha256"])

    def _loaded(self, meta: dict, sha256: str) -> dict:
        self.applied_steps, self.next_step = meta["applied_steps"], meta["next_step"]
        self._reduced_step = [-1, -1]
        self._forget_attempt()
        return {"rank": self.rank, "applied_steps": self.applied_steps, "next_step": self.next_step, "sha256": sha256}

    # -- snapshots (outside the trainers, in shared memory) -------------------------------------
    def _snapshot_writer(self, snapshot: dict | None) -> SnapshotWriter | None:
        if snapshot is None:
            return None
        w = self._writer
        if w is None or w.path != snapshot["path"]:
            w = self._writer = SnapshotWriter(snapshot["path"], snapshot.get("every", 0), snapshot.get("budget", 0.005),
                                              slots=snapshot.get("slots"), wait=snapshot.get("wait", False))
        return w

    def _snapshot(self, writer: SnapshotWriter) -> None:
        t0 = time.perf_counter()
        tensors, skeleton, meta = capture(self.model, self.optimizer, self.applied_steps, self.next_step, self.rank, self.registered)
        try:
            writer.capture(tensors, skeleton, meta, self._step_ms_avg, t_begin=t0)
        except OSError as exc:  # /dev/shm full or gone: training goes on without this snapshot
            log.warning("rank %d: snapshot of step %d not written: %s", self.rank, self.next_step, exc)

    @endpoint
    def snapshot_steps(self, paths: list) -> dict:
        """``{path: next_step}`` of the snapshots among ``paths`` that are complete and pass their
        SHA-256 (a sharded run's restore picks the newest step every shard has)."""
        steps = {}
        for path in paths:
            try:
                man, _payload = read_snapshot(path)
            except (FileNotFoundError, ValueError):
                continue
            steps[path] = man["meta"]["next_step"]
        return steps

    @endpoint
    def restore_snapshot(self, path: str) -> dict:
        """Load the snapshot published at ``path`` (checked); returns ``{"rank", "applied_steps",
        "next_step", "sha256", "restore_ms"}``.

        Raises:
            FileNotFoundError: there is none.
            ValueError: it is incomplete or fails its SHA-256.
        """
        t0 = time.monotonic()
        man, payload = read_snapshot(path)
        self._leave_group()
        self._broken = True
        inc = Incoming(man, self.model, self.device)
        inc.write(0, [payload])
        meta = inc.finish(self.model, self.optimizer, self.registered)
        return dict(self._loaded(meta, man["sha256"]), restore_ms=(time.monotonic() - t0) * 1e3)

    # -- disk checkpoints (full-job restarts only) ----------------------------------------------
    @endpoint
    def save_checkpoint(self, path: str, next_step: int | None = None) -> dict:
        """Save model, optimizer and counters to ``path``; returns ``{"path" (None if not saved),
        "next_step"}``. Unsharded: one ``torch.save`` file (atomically). Sharded: this rank's
        shards into the DCP folder ``path`` — every rank of the group calls it (see
        :func:`~.checkpoints.save_sharded`). With ``next_step``, saves only if this rank is at that
        step (a checkpoint queued behind a window that stopped early is skipped).

        Raises:
            CheckpointException / RuntimeError / OSError: a group partner failed during a sharded
                save, or the disk did.
        """
        import torch

        at_step = next_step is None or next_step == self.next_step
        if self._sharded:  # the group's ranks save together or not at all (DCP's save is collective)
            at_step = self._group_agrees(at_step)
        if not at_step:
            return {"path": None, "next_step": self.next_step}
        trainer_state = {"registered": {name: obj.state_dict() for name, obj in self.registered.items()},
                         "applied_steps": self.applied_steps, "next_step": self.next_step}
        if self._sharded:
            save_sharded(path, self.model, self.optimizer, trainer_state, self.layout.shard_of(self.rank),
                         self._group_generation)
            return {"path": path, "next_step": self.next_step}
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), **trainer_state}, tmp)
        os.replace(tmp, path)
        return {"path": path, "next_step": self.next_step}

    def _group_agrees(self, mine: bool) -> bool:
        """True if every rank of this rank's replica group says True (a MIN all-reduce over the
        proc's default group, the replica group)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    @endpoint
    def load_checkpoint(self, path: str) -> int:
        """Load a :meth:`save_checkpoint` file or DCP folder (any group size: DCP reshards it to
        this rank's); returns its next step. Every rank of a sharded run's group calls it.

        Raises:
            ValueError: a sharded run given an unsharded run's ``.pt`` file.
            FileNotFoundError: an incomplete DCP folder.
        """
        import torch

        if os.path.isdir(path):
            state = load_sharded(path, self.model, self.optimizer, distributed=self._sharded)
        elif self._sharded:
            raise ValueError(f"{path} is an unsharded run's checkpoint (one torch.save file); a sharded run "
                             "resumes from a sharded run's step*.dcp folder: resume this one with "
                             "parallelism='ddp', group_size=1")
        else:
            state = torch.load(path, weights_only=False)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.registered.items():
            if name in state.get("registered", {}):
                obj.load_state_dict(state["registered"][name])
        self.applied_steps, self.next_step = state["applied_steps"], state["next_step"]
        self._reduced_step = [-1, -1]
        self._forget_attempt()
        return self.next_step

    @endpoint
    def memory(self) -> dict:
        """``{"rss_bytes", "peak_rss_bytes", "state_bytes"}`` of this proc."""
        import resource

        tensors, _, _ = capture(self.model, self.optimizer, self.applied_steps, self.next_step, self.rank, self.registered)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"rss_bytes": rss, "peak_rss_bytes": peak, "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
