"""A Trainer joining quorums: one process group of the live ranks at a time. Runs in procs.

(In a sharded run, one process group per shard index across the live replica groups; see
:mod:`.sharding`.)

A *quorum* (torchft's term) is formed by the controller: every member calls
:meth:`QuorumEndpoints.init_quorum` with the same number and ranks; they meet at a barrier in the
controller's rendezvous store, then build a gloo (or nccl) process group under the quorum's key
prefix. The controller can abort both the barrier and the group's rendezvous (the key
``quorum<n>/abort``), so a peer that fails meanwhile never holds the others for the rendezvous
timeout.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from ..actor.endpoint import endpoint
from .trainer_fields import TrainerFields

__all__ = ["CollectiveError", "QuorumAborted", "QuorumEndpoints"]

log = logging.getLogger(__name__)


#: Seconds a quorum's gloo group may take to connect its members. A connect takes milliseconds;
#: a member that dies after the barrier but before it connected leaves the others in gloo's
#: ``Pair::waitUntilConnected`` until this timeout (seen: 8-16 s with the whole
#: ``collective_timeout_s``), after which the controller forms another quorum. The group's
#: collectives then get the whole ``collective_timeout_s`` (``_set_pg_timeout``).
QUORUM_CONNECT_TIMEOUT_S = 3.0


class CollectiveError(RuntimeError):
    """The all-reduce of a step failed because a peer failed (connection reset, fenced, timeout)."""


class QuorumAborted(RuntimeError):
    """The controller abandoned the quorum this trainer was joining (a peer failed meanwhile)."""


def _abortable_store(real, base, abort_key: str, timeout_s: float):
    """A c10d Store over ``real`` whose blocking reads give up as soon as ``abort_key`` appears in
    ``base``: a process group being formed with a peer that died after the barrier fails at once
    (the controller sets the key) instead of waiting for the rendezvous timeout."""
    import torch.distributed as dist

    class AbortableStore(dist.Store):
        def _wait_for(self, keys: list) -> None:
            deadline = time.monotonic() + timeout_s
            while not real.check(keys):
                if base.check([abort_key]):
                    raise QuorumAborted("the quorum was aborted by the controller while its process group formed")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"keys {keys} did not appear within {timeout_s} s")
                time.sleep(0.002)

        def set(self, key, value):
            real.set(key, value)

        def get(self, key):
            self._wait_for([key])
            return real.get(key)

        def add(self, key, value):
            return real.add(key, value)

        def check(self, keys):
            return real.check(keys)

        def wait(self, keys, timeout=None):
            self._wait_for(list(keys))

        def compare_set(self, key, expected, desired):
            return real.compare_set(key, expected, desired)

        def delete_key(self, key):
            return real.delete_key(key)

        def num_keys(self):
            return real.num_keys()

    return AbortableStore()


class QuorumEndpoints(TrainerFields):
    """Joining and leaving quorums. A room of :class:`~monarch_nb.train.trainer.Trainer` (its shared
    fields: :class:`~.trainer_fields.TrainerFields`; ``store_host``, ``store_port`` its own)."""

    _store = None
    _pg_ready = False
    _cross = None

    def _store_client(self):
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(
                self.store_host, self.store_port, is_master=False, timeout=timedelta(seconds=self.collective_timeout_s)
            )
        return self._store

    @endpoint
    def init_quorum(self, quorum: int, ranks: list[int], broadcast_from: int | None = None) -> dict:
        """Join quorum ``quorum`` of ``ranks`` (proc ranks; this one among them).

        Builds a new process group under the store prefix ``quorum<quorum>/`` after a barrier; the
        controller can abort both (key ``quorum<quorum>/abort``), so a peer that fails meanwhile
        never holds the others for the rendezvous timeout. With ``broadcast_from`` (the first
        quorum of a run), every member then takes that rank's model state (as DDP does when it
        is built): replicas start identical whatever the training function's initialisation.
        Returns ``{"rank", "quorum", "init_ms", "next_step"}``.

        Raises:
            QuorumAborted: the controller aborted the quorum.
            TimeoutError: the others did not arrive within ``collective_timeout_s``.
        """
        import torch.distributed as dist

        t0 = time.monotonic()
        ranks = sorted(ranks)
        self.watch.begin(ranks)
        self._leave_group()
        self._broken = True
        store = self._store_client()
        prefix = f"quorum{quorum}/"
        store.add(prefix + "joined", 1)
        deadline = t0 + self.collective_timeout_s
        while int(store.add(prefix + "joined", 0)) < len(ranks):
            if store.check([prefix + "abort"]):
                raise QuorumAborted(f"quorum {quorum} was aborted by the controller")
            if time.monotonic() > deadline:
                raise TimeoutError(f"quorum {quorum}: peers {ranks} did not all arrive within {self.collective_timeout_s} s")
            time.sleep(0.002)
        abortable = _abortable_store(dist.PrefixStore(prefix + "pg/", store), store, prefix + "abort",
                                     self.collective_timeout_s)
        if self._sharded:
            self._join_cross_group(abortable, ranks, broadcast_from)
        elif len(ranks) > 1:
            connect_s = self._connect_timeout_s()
            dist.init_process_group(
                self.backend,
                store=abortable,
                rank=ranks.index(self.rank),
                world_size=len(ranks),
                timeout=timedelta(seconds=connect_s),
            )
            self._pg_ready = True
            if connect_s < self.collective_timeout_s:
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.collective_timeout_s))
            if broadcast_from is not None:
                for tensor in self.model.state_dict().values():
                    dist.broadcast(tensor, src=ranks.index(broadcast_from))
        self._quorum, self._ranks = quorum, ranks
        self._pos, self._world = ranks.index(self.rank), len(ranks)
        self._broken = False
        return {"rank": self.rank, "quorum": quorum, "init_ms": (time.monotonic() - t0) * 1e3, "next_step": self.next_step}

    def _connect_timeout_s(self) -> float:
        """The quorum's group's timeout while it connects (:data:`QUORUM_CONNECT_TIMEOUT_S` for
        gloo where torch can set its collectives' timeout afterwards; else the whole one)."""
        import torch.distributed as dist

        if self.backend != "gloo" or not hasattr(dist.distributed_c10d, "_set_pg_timeout"):
            return self.collective_timeout_s
        return min(self.collective_timeout_s, QUORUM_CONNECT_TIMEOUT_S)

    def _join_cross_group(self, store, ranks: list[int], broadcast_from: int | None) -> None:
        """A sharded run: the process group of this rank's shard index across the quorum's groups
        (:func:`~.sharding.cross_group`); with ``broadcast_from``, every shard takes the one of
        ``broadcast_from``'s group."""
        import torch.distributed as dist

        from .sharding import broadcast, cross_group, local

        shard = self.layout.shard_of(self.rank)
        peers = [r for r in ranks if self.layout.shard_of(r) == shard]
        if len(peers) <= 1:
            return
        self._cross = cross_group(self.backend, dist.PrefixStore(f"shard{shard}/", store), peers.index(self.rank),
                                  len(peers), self.collective_timeout_s)
        if broadcast_from is not None:
            root = peers.index(self.layout.members(broadcast_from)[shard])
            for tensor in self.model.state_dict().values():
                broadcast(self._cross, local(tensor), root)

    def _leave_group(self) -> None:
        """Leave the quorum's process group (a sharded run keeps its replica group: FSDP's)."""
        import torch.distributed as dist

        cross, self._cross = self._cross, None
        if cross is not None:
            try:
                cross.abort()
            except Exception:  # a group broken by a peer's death: dropped anyway
                log.debug("aborting the cross-group process group failed", exc_info=True)
        if self._pg_ready:
            self._pg_ready = False
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a peer's death: drop it anyway
                log.debug("destroy_process_group failed", exc_info=True)

    def _leave_replica_group(self) -> None:
        """A sharded run's end: its replica group too."""
        import torch.distributed as dist

        self._leave_group()
        if self._sharded and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                log.debug("destroying the replica group failed", exc_info=True)
