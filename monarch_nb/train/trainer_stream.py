"""A trainer's full state as one byte stream: capture, describe, receive. Runs in procs.

The state of a replica is its model's state dict (parameters and buffers), its optimizer's
state dict, the state dicts of what the loop registered (``ft.register``: LR schedulers, a
GradScaler, a stateful sampler), its counters (updates applied, next step = data position) and
its RNG states. :func:`capture` lays it out as
a *skeleton* (the two state dicts with each tensor replaced by a :class:`TensorSlot`) plus the
list of tensors; the stream is the tensors' bytes, in order. A :func:`manifest` describes a stream
(skeleton, counters, size, SHA-256); :class:`Incoming` rebuilds a state from one, writing the
bytes straight into the receiver's own tensors and checking the SHA-256 before anything is
loaded. Heals (:mod:`.trainer_state`) and snapshots (:mod:`.trainer_snapshot`) both move this
stream.
"""

from __future__ import annotations

import hashlib
import pickle
import random

from .sharding import like_sharded, local

__all__ = ["TensorSlot", "capture", "manifest", "meta_digest", "Incoming", "stream_slice", "bytes_view"]


class TensorSlot:
    """Stands for tensor ``index`` of the state stream in a skeleton; ``sharded``: it is this
    rank's shard of a DTensor (``shape`` is the shard's), laid out again like the receiver's."""

    __slots__ = ("index", "shape", "dtype", "sharded")

    def __init__(self, index: int, shape: tuple, dtype: str, sharded: bool = False):
        self.index, self.shape, self.dtype, self.sharded = index, shape, dtype, sharded

    def __reduce__(self):
        return TensorSlot, (self.index, self.shape, self.dtype, self.sharded)


# -- the state as a stream ------------------------------------------------------------------------
def capture(model, optimizer, applied_steps: int, next_step: int, rank: int,
            registered: dict | None = None) -> tuple[list, dict, dict]:
    """``(tensors, skeleton, meta)`` of a replica's state: the live tensors (not copies), the state
    dicts (model, optimizer, each of ``registered``: name -> object with ``state_dict``) with
    tensors replaced by :class:`TensorSlot`, and the counters and RNG states."""
    import numpy as np
    import torch

    tensors: list = []

    def strip(obj):
        if isinstance(obj, torch.Tensor):
            part = local(obj)  # a DTensor's shard (a sharded run): its bytes, in the receiver's shard
            tensors.append(part.detach())
            return TensorSlot(len(tensors) - 1, tuple(part.shape), str(part.dtype).replace("torch.", ""),
                              part is not obj)
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    skeleton = {"model": strip(model.state_dict()), "optimizer": strip(optimizer.state_dict()),
                "registered": {name: strip(obj.state_dict()) for name, obj in (registered or {}).items()}}
    meta = {
        "applied_steps": applied_steps,
        "next_step": next_step,
        "data_position": next_step,
        "torch_rng": torch.get_rng_state().numpy().tobytes(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "donor": rank,
    }
    return tensors, skeleton, meta


def meta_digest(meta: dict) -> bytes:
    """The bytes of ``meta`` that the stream's SHA-256 covers (counters, donor, torch RNG)."""
    scalars = {k: meta[k] for k in ("applied_steps", "next_step", "data_position", "donor")}
    return pickle.dumps((scalars, meta["torch_rng"]), protocol=4)


def manifest(views: list, skeleton: dict, meta: dict, chunk_bytes: int, sha256: str | None = None) -> dict:
    """Describe a stream of byte ``views`` for a receiver: ``{"skeleton", "meta", "nbytes",
    "chunk_bytes", "chunks", "sha256"}`` (the SHA-256 covers the bytes, then :func:`meta_digest`)."""
    if sha256 is None:
        h = hashlib.sha256()
        for view in views:
            h.update(view)
        h.update(meta_digest(meta))
        sha256 = h.hexdigest()
    nbytes = sum(v.nbytes for v in views)
    return {"skeleton": skeleton, "meta": meta, "nbytes": nbytes, "chunk_bytes": chunk_bytes,
            "chunks": max(1, -(-nbytes // chunk_bytes)), "sha256": sha256}


def bytes_view(tensor, writable: bool = False):
    """A uint8 numpy view of ``tensor``'s bytes (a copy for GPU tensors, which cannot be written)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        if writable:
            raise ValueError("writable byte views need CPU tensors")
        t = t.cpu()
    if not t.is_contiguous():
        if writable:
            raise ValueError("writable byte views need contiguous tensors")
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8).numpy()
    return t.reshape(-1).view(torch.uint8).numpy()


def stream_slice(views: list, start: int, end: int) -> list:
    """Bytes ``[start, end)`` of the stream made of ``views``, as a list of views (no copy)."""
    out, offset = [], 0
    for view in views:
        lo, hi = max(start, offset), min(end, offset + view.nbytes)
        if lo < hi:
            out.append(view[lo - offset : hi - offset])
        offset += view.nbytes
        if offset >= end:
            break
    return out


def _stream_write(views: list, start: int, piece) -> None:
    import numpy as np

    data = np.frombuffer(piece, dtype=np.uint8) if not isinstance(piece, np.ndarray) else piece
    offset, pos = 0, 0
    end = start + len(data)
    for view in views:
        lo, hi = max(start, offset), min(end, offset + view.nbytes)
        if lo < hi:
            view[lo - offset : hi - offset] = data[pos : pos + (hi - lo)]
            pos += hi - lo
        offset += view.nbytes
        if offset >= end:
            break


class Incoming:
    """Receives a stream described by ``manifest`` into ``model`` / ``optimizer``.

    Model tensors of the right shape and dtype (on CPU) are written in place; the others are
    staged in new CPU tensors. Nothing is loaded until :meth:`finish` has checked the SHA-256.
    """

    def __init__(self, manifest: dict, model, device):
        import torch

        self.manifest = manifest
        own = model.state_dict()
        targets: list = []

        def collect(skel, live):
            if isinstance(skel, TensorSlot):
                dtype = getattr(torch, skel.dtype)
                cpu = device.type == "cpu"
                part = local(live) if live is not None else None
                if cpu and part is not None and tuple(part.shape) == skel.shape and part.dtype == dtype:
                    targets.append((skel.index, part))
                else:
                    targets.append((skel.index, torch.empty(skel.shape, dtype=dtype)))  # staged on CPU
            elif isinstance(skel, dict):
                for k, v in skel.items():
                    collect(v, live.get(k) if isinstance(live, dict) else None)
            elif isinstance(skel, (list, tuple)):
                for v in skel:
                    collect(v, None)

        collect(manifest["skeleton"]["model"], own)
        collect(manifest["skeleton"]["optimizer"], None)
        collect(manifest["skeleton"].get("registered", {}), None)
        targets.sort(key=lambda t: t[0])
        self.tensors = [t for _, t in targets]
        self.views = [bytes_view(t, writable=True) for t in self.tensors]
        self.offset = 0
        self.sha = hashlib.sha256()

    def write(self, start: int, pieces: list) -> int:
        """Write ``pieces`` (byte buffers, in stream order) at byte ``start``; returns bytes so far.

        Raises:
            RuntimeError: ``start`` is not where the previous piece ended.
        """
        if start != self.offset:
            raise RuntimeError(f"state stream out of order: expected byte {self.offset}, got {start}")
        for piece in pieces:
            self.sha.update(piece)
            _stream_write(self.views, self.offset, piece)
            self.offset += len(piece)
        return self.offset

    def finish(self, model, optimizer, registered: dict | None = None) -> dict:
        """Check size and SHA-256, then load the state (into ``registered`` too: name -> object
        with ``load_state_dict``); returns the manifest's ``meta``.

        Raises:
            ValueError: the size or the checksum does not match the manifest, or the stream's
                registered names are not the ones registered here.
        """
        import numpy as np
        import torch

        manifest = self.manifest
        meta = manifest["meta"]
        self.sha.update(meta_digest(meta))
        if self.offset != manifest["nbytes"] or self.sha.hexdigest() != manifest["sha256"]:
            raise ValueError(
                f"state from rank {meta['donor']} failed its check: {self.offset} of {manifest['nbytes']} "
                f"bytes, sha256 {self.sha.hexdigest()[:12]} != {manifest['sha256'][:12]}"
            )
        tensors = self.tensors

        def fill(skel, like=None):
            """The state ``skel`` stands for; a shard laid out like ``like`` (the receiver's own)."""
            if isinstance(skel, TensorSlot):
                value = tensors[skel.index]
                return like_sharded(value, like) if skel.sharded and like is not None else value
            if isinstance(skel, dict):
                return {k: fill(v, like.get(k) if isinstance(like, dict) else like) for k, v in skel.items()}
            if isinstance(skel, (list, tuple)):
                return type(skel)(fill(v, like) for v in skel)
            return skel

        params = [p for group in optimizer.param_groups for p in group["params"]]
        opt_skel = manifest["skeleton"]["optimizer"]
        opt_state = fill(opt_skel)
        if isinstance(opt_skel, dict) and isinstance(opt_skel.get("state"), dict):  # torch.optim's layout
            opt_state["state"] = {i: fill(s, params[i] if isinstance(i, int) and i < len(params) else None)
                                  for i, s in opt_skel["state"].items()}

        theirs = manifest["skeleton"].get("registered", {})
        mine = registered or {}
        if set(theirs) != set(mine):
            raise ValueError(f"state from rank {meta['donor']} has registered state {sorted(theirs)}, this rank "
                             f"{sorted(mine)}: every rank must ft.register the same names")
        model.load_state_dict(fill(manifest["skeleton"]["model"], model.state_dict()))
        optimizer.load_state_dict(opt_state)
        for name, skel in theirs.items():
            mine[name].load_state_dict(fill(skel))
        torch.set_rng_state(torch.from_numpy(np.frombuffer(meta["torch_rng"], dtype=np.uint8).copy()))
        np.random.set_state(meta["numpy_rng"])
        random.setstate(meta["python_rng"])
        return meta
