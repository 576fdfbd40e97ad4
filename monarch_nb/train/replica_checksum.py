"""Replica checksums: is every replica bit-identical, and if not, which part of the state differs.

A rank's state (its model's state dict, its optimizer's, the state of what the loop registered
with ``ft.register``) is hashed part by part, a part being one entry of the model's state dict,
one parameter's optimizer state, the optimizer's param groups, or one registered object. The
replica's digest is the hash of its parts' digests, so two replicas with one digest hold the same
state (barring a 64-bit collision), and two that differ say which parts do
(:func:`describe_divergence`): "``model.1.running_mean``, ``optimizer.state.3``" instead of three
opaque digests.

Runs in procs (:func:`state_checksum`, from ``Trainer.checksum``) and in the controller (the rest).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

__all__ = ["ReplicaChecksum", "state_checksum", "replica_digests", "describe_divergence"]


@dataclass(frozen=True)
class ReplicaChecksum:
    """One rank's checksum (``Trainer.checksum``'s answer).

    Attributes:
        rank: the rank that computed it.
        digest: 16 hex digits (BLAKE2b-64) over every part's digest, in order.
        applied_steps: steps this rank applied.
        next_step: the step it would run next.
        shard: its shard index in its replica group (0 unsharded): only ranks of one shard index
            hold the same state.
        parts: ``(part name, 16 hex digits)`` per part, in the state's order.
    """

    rank: int
    digest: str
    applied_steps: int
    next_step: int
    shard: int = 0
    parts: tuple[tuple[str, str], ...] = ()


def _parts(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of each part of ``state`` (``{"model": sd, "optimizer": sd, "registered":
    {name: sd}}``): one per entry of each top-level dict, the optimizer's ``state`` one per
    parameter."""
    for name, value in state.items():
        if not isinstance(value, Mapping):
            yield name, value
            continue
        for key, item in value.items():
            if name == "optimizer" and key == "state" and isinstance(item, Mapping):
                for index, per_param in item.items():
                    yield f"optimizer.state.{index}", per_param
            else:
                yield f"{name}.{key}", item


def state_checksum(state: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The digest of ``state`` and of each of its parts (see the module docstring).

    A part's digest is BLAKE2b-64 over each leaf's dotted name and, for a tensor, its dtype, shape
    and ``hip_ext.checksum`` (a 64-bit hash of its bytes, computed on its own device with no copy
    to the host; a DTensor's local shard), for anything else its ``repr``, in order.

    Returns:
        ``(digest, parts)``: 16 hex digits, and ``(part name, 16 hex digits)`` per part.
    """
    import torch
    from hip_ext import checksum

    from .sharding import local

    def feed(h: Any, prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            obj = local(obj)
            h.update(f"{prefix}|{obj.dtype}|{tuple(obj.shape)}|{checksum(obj)}\n".encode())
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                feed(h, f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                feed(h, f"{prefix}[{i}]", v)
        else:
            h.update(f"{prefix}={obj!r}\n".encode())

    whole = hashlib.blake2b(digest_size=8)
    parts = []
    for name, value in _parts(state):
        h = hashlib.blake2b(digest_size=8)
        feed(h, name, value)
        parts.append((name, h.hexdigest()))
        whole.update(f"{name}|{parts[-1][1]}\n".encode())
    return whole.hexdigest(), tuple(parts)


def _by_shard(checksums: Mapping[int, ReplicaChecksum]) -> dict[int, dict[str, list[int]]]:
    """``{shard: {digest: [ranks]}}``."""
    out: dict[int, dict[str, list[int]]] = {}
    for rank in sorted(checksums):
        c = checksums[rank]
        out.setdefault(c.shard, {}).setdefault(c.digest, []).append(rank)
    return out


def replica_digests(checksums: Mapping[int, ReplicaChecksum]) -> set[str]:
    """The distinct replica digests among ``checksums`` (``{rank: ReplicaChecksum}``): one when
    every replica is identical, none when there are no checksums. A sharded run's replica is its
    shards: when every shard index has one digest, the one replica digest is the BLAKE2b-64 of
    them in shard order."""
    by_shard = _by_shard(checksums)
    if len(by_shard) <= 1:
        return set(next(iter(by_shard.values()), {}))
    if any(len(d) > 1 for d in by_shard.values()):
        return {f"{shard}:{digest}" for shard, d in by_shard.items() for digest in d}
    joined = ",".join(next(iter(by_shard[shard])) for shard in sorted(by_shard))
    return {hashlib.blake2b(joined.encode(), digest_size=8).hexdigest()}


def describe_divergence(checksums: Mapping[int, ReplicaChecksum], most: int = 8) -> str:
    """Which ranks agree and which parts differ, per shard index whose replicas differ, e.g.
    ``"ranks [0, 2] | [1] | [3] differ in model.1.running_mean, optimizer.state.3"`` (at most
    ``most`` part names, then how many more); ``"identical"`` when none differ."""
    lines = []
    by_shard = _by_shard(checksums)
    for shard, digests in sorted(by_shard.items()):
        if len(digests) <= 1:
            continue
        groups = sorted(digests.values())
        parts = [dict(checksums[ranks[0]].parts) for ranks in groups]
        names = list(dict.fromkeys(n for p in parts for n in p))
        differ = [n for n in names if len({p.get(n) for p in parts}) > 1]
        shown = ", ".join(differ[:most]) + (f" and {len(differ) - most} more" if len(differ) > most else "")
        head = f"shard {shard}: " if len(by_shard) > 1 else ""
        lines.append(f"{head}ranks {' | '.join(str(g) for g in groups)} differ in {shown or 'their digests only'}")
    return "; ".join(lines) or "identical"
