"""Parallelism inside a replica group, fault tolerance across groups (HSDP). Runs in procs and the controller.

With ``group_size=G`` the run's ranks form replica groups of ``G`` consecutive ranks: rank ``r`` is
shard ``r % G`` of group ``r // G`` (:class:`GroupLayout`). Inside a group the model is split by
``parallelism`` — ``"fsdp"``: torch's FSDP2 (``fully_shard``) over the group, each rank holding
``1/G`` of every parameter, gradient and optimizer state; or the user's own
``parallelize(model, device_mesh)`` (tensor parallel, per-layer FSDP wrapping) — and across groups
the shards are replicated: HSDP, the layout of torchtitan's ``dp_replicate x dp_shard`` mesh.

Fault tolerance works across groups, as torchft's replica groups do:

- the group's process group (the proc's default group, which FSDP uses) is formed once per
  *incarnation* of the group (:func:`form_group`, under the store prefix
  ``group<g>/gen<k>/``): a failed rank fails its whole group (its partners' collectives cannot go
  on), every member restarts, and the new incarnation forms a new group;
- each quorum gives every shard index its own process group over the live groups
  (:func:`cross_group`: ranks ``g*G + s`` of every live group ``g``), outside torch's group
  registry, used only by the Trainer's own all-reduce after ``backward()`` — never by an
  autograd hook, so a peer's death there is an exception of ``ft.step``, not of FSDP;
- a restarted group heals shard by shard: each of its ranks takes the state of the rank with the
  same shard index in a live group (same shapes, so the bytes land in its own tensors);
- snapshots are shard by shard too: the first group's ranks each publish their shard to two
  shared-memory slots in turn (:func:`snapshot_slots`), at the same fixed steps, and a restore
  takes the newest step every shard has.

Where the figures come from: FSDP2's ``fully_shard`` (``torch.distributed.fsdp``); HSDP's
reduce-scatter inside the shard group then all-reduce across replicas is FSDP2's own order
(``_fsdp_collectives.foreach_reduce``), so with power-of-two group and replica counts the result
is bit-identical to native HSDP.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import says_peer_gone

__all__ = ["GroupLayout", "PARALLELISMS", "check_parallelism", "form_group", "parallelize", "cross_group",
           "local", "grad_like", "like_sharded", "all_reduce_sum", "broadcast", "snapshot_slots",
           "SNAPSHOT_EVERY", "GroupCollectiveError", "broke_the_group"]

#: steps between a sharded run's snapshots when ``snapshot_every`` is not given: the shards'
#: writers must snapshot the same steps, so the interval is fixed, not sized by each one's cost
SNAPSHOT_EVERY = 20

#: the built-in ways to split a model inside a group (or a callable ``parallelize(model, mesh)``)
PARALLELISMS = ("ddp", "fsdp")


@dataclass(frozen=True)
class GroupLayout:
    """Which ranks form which replica group: ``size`` consecutive ranks each.

    Attributes:
        size: ranks per group (1: every rank is a whole replica, plain data parallel).
    """

    size: int = 1

    def group_of(self, rank: int) -> int:
        return rank // self.size

    def shard_of(self, rank: int) -> int:
        return rank % self.size

    def members(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s group (itself among them), in shard order."""
        first = self.group_of(rank) * self.size
        return list(range(first, first + self.size))

    def whole_groups(self, ranks: list[int]) -> list[int]:
        """The ranks of ``ranks`` whose every group partner is in ``ranks`` too (sorted)."""
        present = set(ranks)
        return sorted(r for r in present if all(p in present for p in self.members(r)))


def snapshot_slots(path: str, shard: int) -> list[str]:
    """The two shared-memory files shard ``shard``'s writer publishes to in turn, named from the
    run's snapshot ``path`` (``.../monarch_nb-<run>-<pid>-<n>``: ``<n>`` becomes
    ``<n>*100 + 2*shard + slot``, the runtime's pattern, so its clean-up removes them). Two, so
    that while one is being replaced the other still holds a step every shard has."""
    head, n = path.rsplit("-", 1)
    return [f"{head}-{int(n) * 100 + 2 * shard + slot}" for slot in (0, 1)]


def check_parallelism(parallelism: Any, group_size: Any, procs: int) -> None:
    """Refuse a layout the run cannot use, naming the fix.

    Raises:
        ValueError: ``group_size`` is not a positive divisor of ``procs``; ``parallelism`` is not
            one of :data:`PARALLELISMS` or a callable; ``"ddp"`` with ``group_size > 1``.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if procs % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {procs} procs: every replica group needs "
                         f"{group_size} ranks (use procs={procs - procs % group_size or group_size} or another group_size)")
    if not (parallelism in PARALLELISMS or callable(parallelism)):
        raise ValueError(f"parallelism must be 'ddp', 'fsdp' or a callable parallelize(model, device_mesh), "
                         f"got {parallelism!r}")
    if parallelism == "ddp" and group_size > 1:
        raise ValueError(f"group_size {group_size} splits the model inside each group: use parallelism='fsdp' "
                         "(FSDP2 over the group, HSDP across groups) or your own parallelize(model, device_mesh)")


# -- in the procs ------------------------------------------------------------------------------------
class GroupCollectiveError(RuntimeError):
    """A collective of this rank's replica group failed inside the training step (FSDP's
    all-gather or reduce-scatter, or the user's own): a partner died or hung. The rank cannot go
    on (its step is half done inside autograd), so it fails with its group: the controller
    records it as kind ``group`` and restarts the group."""


def broke_the_group(exc: BaseException) -> bool:
    """True if ``exc`` (raised out of a training step) is a collective's failure, not the step's own bug."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and says_peer_gone(str(exc))


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def form_group(store_host: str, store_port: int, layout: GroupLayout, rank: int, generation: int, backend: str,
               rendezvous_timeout_s: float, timeout_s: float) -> None:
    """Make this proc's default process group the group of ``rank`` (incarnation ``generation``):
    the ``layout.size`` partners meet under ``group<g>/gen<generation>/`` of the run's store.
    The partners of a restarted group may arrive far apart (one took a warm spare, another
    started cold), so they wait up to ``rendezvous_timeout_s`` for each other; the group's
    collectives then time out after ``timeout_s`` seconds.

    Raises:
        torch's DistStoreError / RuntimeError: a partner did not arrive in time.
    """
    import torch.distributed as dist

    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=_timeout(rendezvous_timeout_s))
    prefix = f"group{layout.group_of(rank)}/gen{generation}/"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=layout.shard_of(rank),
                            world_size=layout.size, timeout=_timeout(rendezvous_timeout_s))
    try:
        dist.distributed_c10d._set_pg_timeout(_timeout(timeout_s))
    except Exception:  # a torch without it: the group's collectives keep the rendezvous timeout
        pass


def parallelize(model: Any, optimizer: Any, parallelism: "str | Callable[..., Any]", device_type: str) -> tuple[Any, Any]:
    """Split ``model`` over this proc's default group (the replica group) and point the
    optimizer's param groups at the new parameters (FSDP2 replaces every parameter by a sharded
    DTensor one: an optimizer built before would step tensors the model no longer uses).

    Every member first takes member 0's full state (as DDP does when it is built), so the shards
    come from one initialisation.

    Returns:
        ``(model, optimizer)``: the split model (``parallelism(model, mesh)``'s return value, or
        the model itself if it returned None) and the same optimizer, over its parameters.

    Raises:
        RuntimeError: the optimizer already holds state (it stepped before ``ft.wrap``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if optimizer.state:
        raise RuntimeError("ft.wrap with parallelism: the optimizer has already stepped; build it fresh, "
                           "ft.wrap shards the model and points the optimizer at the shards")
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    names = {id(p): n for n, p in model.named_parameters()}
    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    if parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    elif callable(parallelism):
        model = parallelism(model, mesh) or model
    else:
        raise ValueError(f"parallelize: {parallelism!r} does not split a model (use 'fsdp' or a callable)")
    now = dict(model.named_parameters())
    for group in optimizer.param_groups:  # the same optimizer (a scheduler built on it still works)
        group["params"] = [now[names[id(p)]] for p in group["params"]]
    return model, optimizer


def cross_group(backend: str, store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A process group of ``size`` ranks (this one is ``rank`` in it) over ``store``, outside
    torch's group registry (so it is never the default group FSDP uses): the shard index's
    group across replicas, used only through :func:`all_reduce_sum` and :func:`broadcast`."""
    import torch.distributed as dist

    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)  # type: ignore[call-arg]  # the stub wants options; the binding defaults them
    return dist.ProcessGroupGloo(store, rank, size, _timeout(timeout_s))


def all_reduce_sum(group: Any, tensor: Any, wait: Callable[[Any, Any], None] | None = None) -> None:
    """Sum ``tensor`` in place over ``group`` (a :func:`cross_group`); raises what the backend
    raises. ``wait(work, group)`` waits for the collective (default: ``work.wait()``)."""
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's stub: RedOpType is what the binding takes
    work = group.allreduce([tensor], opts)
    if wait is None:
        work.wait()
    else:
        wait(work, group)


def broadcast(group: Any, tensor: Any, root: int) -> None:
    """Overwrite ``tensor`` with member ``root``'s over ``group`` (a :func:`cross_group`)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


def local(tensor: Any) -> Any:
    """This rank's part of ``tensor``: a DTensor's local shard (its storage), else the tensor.

    The DTensor's ``_local_tensor`` itself where it has one: ``to_local()`` goes through an
    autograd function, which cost 2.7 % of a sharded charlm step here (py-spy), and these reads
    are outside autograd (the gradient's copy in and out of the flat buffer, the state stream)."""
    part = getattr(tensor, "_local_tensor", None)
    if part is not None:
        return part
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def grad_like(param: Any, flat: Any) -> Any:
    """A gradient for ``param`` holding ``flat`` (a 1-D float32 slice with the numel of
    ``param``'s local part): a DTensor with ``param``'s mesh and placements, or a plain tensor."""
    part = local(param)
    values = flat.view(part.shape).to(part.dtype)
    if part is param:
        return values
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(values, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def like_sharded(values: Any, like: Any) -> Any:
    """``values`` (this rank's part, a plain tensor) as a tensor laid out like ``like``: a DTensor
    with its mesh and placements (``like`` itself when ``values`` is already its local storage),
    or ``values`` when ``like`` is a plain tensor."""
    part = local(like)
    if part is like:
        return values
    if values.data_ptr() == part.data_ptr() and values.shape == part.shape:
        return like
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(values.to(part.device), like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride())
