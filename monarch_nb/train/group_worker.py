"""The user's own torch.distributed groups follow the mesh's membership. Runs in procs (a plugin).

Code that forms a process group from the environment a mesh gives every proc
(``dist.init_process_group("gloo")``, ``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``) — a ``%%mesh`` cell, an actor's endpoint, a script — gets from this plugin what
torchrun's agent would do for it when a peer dies:

- the default group of this proc, if it spans the mesh (its world size is ``WORLD_SIZE``), is
  aborted at once, so a collective blocked on the dead peer raises now instead of at the
  collective timeout, on every survivor: torch's abort removes the group, and the group's TCP
  connections (those ``init_process_group`` opened) are shut down, because gloo's abort leaves
  them open and a ring neighbour of a survivor, not of the dead rank, waits on them while a
  ``DistributedDataParallel`` in the user's namespace keeps the group alive; a survivor still
  *forming* that group is released by the runtime, which closes the rendezvous round's store;
- while a peer of the mesh is failed, ``init_process_group`` of a group over the mesh's ranks is
  refused at once, naming the dead rank and the fix (``%mesh restart R``), instead of waiting for
  it until the rendezvous timeout;
- the aborted group is gone (torch's abort removes the default group), so after ``%mesh
  restart`` both ``init_process_group()`` alone and the usual ``destroy_process_group();
  init_process_group()`` work: destroying the group this plugin released is a no-op (once),
  and an aborted group still there is destroyed by the next ``init_process_group``. The runtime
  has started a new rendezvous round meanwhile (a fresh store: ``MASTER_PORT`` and
  ``TORCHELASTIC_RESTART_COUNT`` updated in every proc), so the new group never reads the dead
  rank's address.

``init_process_group`` and ``destroy_process_group`` of ``torch.distributed`` are wrapped for
that, in this proc only, when ``torch.distributed`` is imported (a post-import hook; at once if
it already is). The error a
``%%mesh`` cell shows names the failed rank and its cause (:func:`failure_note`). A training
run's Trainer forms and leaves its quorums itself: its groups are not touched here.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runtime.proc import PeerFailure, Proc

__all__ = ["install", "failure_note", "looks_like_a_peer_error", "GroupFollower", "PeerDeadError"]

log = logging.getLogger(__name__)


class PeerDeadError(RuntimeError):
    """A process group over the mesh cannot form: a rank of it is dead (the message says which)."""


class GroupFollower:
    """Aborts this proc's default process group when a peer of its mesh fails, refuses to form
    one while a peer is dead, and replaces an aborted one at the next ``init_process_group``."""

    def __init__(self, proc: "Proc"):
        self.proc = proc
        self.aborted: Any = None  # the default group that was aborted (until replaced or destroyed)
        self.released = False  # a group was released here and the user has not formed another yet
        self.connections: dict[int, str] = {}  # fd -> "socket:[inode]" the default group's init opened
        self.round_seen = ""  # the rendezvous round of the last group formed here
        self.groups_in_round = 0  # groups formed from the mesh's environment in that round
        self.destroyed: list[Any] = []  # groups destroyed here, kept until nothing else holds them
        self._wrapped = False
        self._lock = threading.Lock()

    # -- a peer fails (IO thread) --------------------------------------------------------------------
    def on_peer_failure(self, failure: "PeerFailure") -> None:
        """Abort the default group on a thread of its own (an abort may block); a Trainer's
        quorum is told instead (its collectives give up on the dead member, see
        :mod:`.quorum_watch`)."""
        from . import current

        trainer = current.trainer
        if trainer is not None:
            trainer.peer_failed(failure.rank)
            return
        dist = _distributed()
        if dist is None or not dist.is_initialized():
            return
        try:
            group = dist.group.WORLD
            spans_mesh = dist.get_world_size() == _mesh_world()
        except Exception:  # a group torn down meanwhile
            return
        with self._lock:
            if not spans_mesh or group is self.aborted:
                return
            self.aborted, self.released = group, True
        threading.Thread(target=self._abort, args=(dist, failure), name="monarch_nb-group-abort", daemon=True).start()

    def _abort(self, dist: Any, failure: "PeerFailure") -> None:
        t0 = time.monotonic()
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as exc:  # a backend that cannot abort: its connections are shut down below
            log.debug("aborting the default group failed: %s", exc)
        with self._lock:
            connections, self.connections = self.connections, {}
        closed = _shut_down(connections)
        log.info("rank %d: %s; the default process group was aborted in %.3f s (%d connections shut down)",
                 self.proc.rank, failure.describe(), time.monotonic() - t0, closed)

    @staticmethod
    def _trainer_owns_groups() -> bool:
        from . import current

        return current.trainer is not None

    # -- init_process_group (the caller's thread) ------------------------------------------------------
    def wrap(self, dist: Any) -> None:
        """Wrap ``dist.init_process_group`` (once): refuse a doomed group, replace an aborted one."""
        if self._wrapped or not hasattr(dist, "init_process_group"):
            return
        self._wrapped = True
        original = dist.init_process_group
        follower = self

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            follower.release_destroyed()
            if follower._trainer_owns_groups():
                return original(*args, **kwargs)
            follower.before_init(dist, kwargs)
            before = _tcp_connections()
            kwargs = follower.mesh_store(dist, kwargs)
            result = original(*args, **kwargs)
            after = _tcp_connections()
            with follower._lock:  # what this group's init opened: gloo's pairs, its store client
                follower.connections = {fd: link for fd, link in after.items() if before.get(fd) != link}
            return result

        original_destroy = dist.destroy_process_group

        @functools.wraps(original_destroy)
        def destroy_process_group(group: Any = None) -> Any:
            if group is None and follower.released and not dist.is_initialized():
                follower.released = False  # the group this plugin released: it is gone already
                return None
            if not follower._trainer_owns_groups():  # a Trainer's quorum groups are its own to tear down
                follower.keep_destroyed(dist, group)
            return original_destroy(group)

        for module in (dist, getattr(dist, "distributed_c10d", None)):
            if module is not None:
                module.init_process_group = init_process_group
                module.destroy_process_group = destroy_process_group

    def keep_destroyed(self, dist: Any, group: Any) -> None:
        """Hold the groups ``destroy_process_group(group)`` is about to destroy (all of them for
        None) until :meth:`release_destroyed`.

        Why: a ``DistributedDataParallel`` dropped right after its group was destroyed (a
        script's ``destroy_process_group()`` and then its ``main()`` returning) frees the group
        in its reducer's destructor, which torch runs holding the GIL; gloo's destructor joins its
        worker threads, and a worker still dropping the last collective it ran needs the GIL for
        that: the proc deadlocks, its heartbeats stop and it is fenced as hung (seen in CI, 1 run
        in ~8; a two-process loop of init, DDP, backward, destroy and drop deadlocked within 5
        rounds, torch 2.13, pytorch/pytorch#56297). Held here, the group's last reference is this
        list's, whose release goes through the ``ProcessGroup`` binding that lets the GIL go. Not
        a Trainer's groups (it forms and leaves its quorums itself)."""
        world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
        try:
            groups = list(world.pg_map) if group is None and world is not None else [group]
        except Exception:  # a torch whose registry of groups looks otherwise: nothing to hold
            return
        with self._lock:
            self.destroyed.extend(g for g in groups if g is not None)

    def release_destroyed(self) -> None:
        """Drop the destroyed groups held by :meth:`keep_destroyed` (at the next
        ``init_process_group``: the objects that used them are gone by then, so this is their last
        reference), on a thread of its own: a group destroyed while a collective of it still
        waited on a dead peer is freed only when gloo's worker gives up (its timeout), which must
        not hold up the new group."""
        with self._lock:
            held, self.destroyed = self.destroyed, []
        if held:  # each group's destructor runs there, the GIL let go while gloo joins its threads
            threading.Thread(target=held.clear, name="monarch_nb-group-release", daemon=True).start()

    def before_init(self, dist: Any, kwargs: dict) -> None:
        """Raises PeerDeadError if the group would span the mesh while a rank of it is dead;
        destroys the aborted default group otherwise."""
        world = kwargs.get("world_size", -1)
        over_mesh = world in (-1, None, _mesh_world()) and kwargs.get("store") is None and \
            kwargs.get("init_method") in (None, "env://")
        if over_mesh:
            dead = self._dead_peers()
            if dead:
                ranks = " ".join(str(f.rank) for f in dead)
                raise PeerDeadError(
                    f"cannot form a process group over the mesh's {_mesh_world()} ranks: "
                    + "; ".join(f.describe() for f in dead)
                    + f". Restart it first (%mesh restart {ranks}, or procs.restart(rank)), then call "
                    "dist.init_process_group() again on every rank")
        with self._lock:
            aborted, self.aborted, self.released = self.aborted, None, False
        if aborted is not None and dist.is_initialized() and dist.group.WORLD is aborted:
            try:
                dist.destroy_process_group()
            except Exception as exc:  # an aborted group may not tear down cleanly: it is gone either way
                log.debug("destroying the aborted default group: %s", exc)
        if not dist.is_initialized():
            # an init that failed (its peer died while it formed) left torch's group counter up, so
            # this rank would name the next group otherwise than a fresh rank does and the two
            # would wait for each other's keys; destroying the default group resets it the same way
            world = getattr(dist.distributed_c10d, "_world", None)
            if world is not None and hasattr(world, "group_count"):
                world.group_count = 0

    def mesh_store(self, dist: Any, kwargs: dict) -> dict:
        """For a group formed from the mesh's environment (no store, ``env://``): the same
        rendezvous, under a prefix of its own — ``monarch_nb/round<R>/group<N>/``, ``R`` the mesh's
        rendezvous round, ``N`` this rank's groups formed in it — so forming a group again
        (``destroy_process_group(); init_process_group()``) never reads the keys of the last one
        (a peer's old, closed listener: "connectFullMesh failed ... Connection refused")."""
        if kwargs.get("store") is not None or kwargs.get("init_method") not in (None, "env://"):
            return kwargs
        import datetime

        rendezvous_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if self.round_seen != rendezvous_round:  # a new round: every rank counts from 0 again
            self.round_seen, self.groups_in_round = rendezvous_round, 0
        n, self.groups_in_round = self.groups_in_round, self.groups_in_round + 1
        timeout = kwargs.get("timeout") or datetime.timedelta(minutes=30)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        prefix = f"monarch_nb/round{rendezvous_round}/group{n}/"
        return {**kwargs, "init_method": None, "store": dist.PrefixStore(prefix, store),
                "rank": kwargs.get("rank", int(os.environ["RANK"])),
                "world_size": kwargs.get("world_size") if kwargs.get("world_size", -1) != -1 else _mesh_world()}

    def _dead_peers(self) -> list["PeerFailure"]:
        """The last failure of each peer of this mesh that is failed now (not yet back)."""
        failed = self.proc.messenger.failed_procs()
        last: dict[str, "PeerFailure"] = {}
        for f in self.proc.peer_failures:
            if f.identity in failed:
                last[f.identity] = f
        return sorted(last.values(), key=lambda f: f.rank)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls ``patch(module)`` right after ``torch.distributed`` is first imported."""

    def __init__(self, patch: Any):
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.distributed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module
        patch = self.patch

        def exec_module(module: Any) -> None:
            real_exec(module)
            try:
                patch(module)
            except Exception:
                log.exception("wrapping torch.distributed.init_process_group failed")

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _tcp_connections() -> dict[int, str]:
    """fd -> ``"socket:[inode]"`` of this process's established TCP connections (Linux /proc)."""
    established: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == "01":  # ESTABLISHED: never a listener
                        established.add(fields[9])
        except OSError:
            continue
    found: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in established:
            found[int(name)] = link
    return found


def _shut_down(connections: dict[int, str]) -> int:
    """``shutdown(SHUT_RDWR)`` each connection still open under the same fd (the peer and any
    local reader see its end at once); the fds stay open for their owner. Returns how many."""
    closed = 0
    for fd, link in connections.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed and its number reused meanwhile: not ours to touch
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return closed


def _mesh_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "-1"))


def _distributed() -> Any:
    """``torch.distributed`` if this proc imported it (a group can exist only then), else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not getattr(dist, "is_available", lambda: False)():
        return None
    return dist


#: words of the errors a dead peer causes in torch.distributed (gloo, NCCL/RCCL, the store)
_PEER_ERROR_WORDS = ("gloo", "nccl", "connection reset", "connection closed", "read error", "connection refused",
                     "remote server", "socket")


def looks_like_a_peer_error(exc: BaseException) -> bool:
    """``exc`` is what torch.distributed raises when a peer dies (a socket error of gloo, NCCL, the store)."""
    text = f"{type(exc).__name__} {type(exc).__module__} {exc}".lower()
    return "distributed" in text or any(word in text for word in _PEER_ERROR_WORDS)


def failure_note(since: float, wait_s: float = 0.0) -> str:
    """A line naming the peers of this proc's mesh that failed after ``since`` (``time.monotonic()``)
    or are dead now, for an error a dead peer may have caused; "" when none did. ``wait_s``: how
    long to wait to hear of one (a collective sees the dead peer's reset before the controller's
    word arrives)."""
    from ..runtime import proc as proc_mod

    proc = proc_mod.current()
    if proc is None:
        return ""
    deadline = time.monotonic() + wait_s
    while True:
        dead = proc.messenger.failed_procs()
        failed = list({f.identity: f for f in proc.peer_failures if f.monotonic >= since or f.identity in dead}.values())
        if failed or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if not failed:
        return ""
    names = "; ".join(f.describe() for f in failed)
    return (f"{names}. Its torch.distributed group here was released; once the rank is back (%mesh restart), "
            "dist.init_process_group() forms a new one over every rank")


def install(proc: "Proc") -> None:
    follower = GroupFollower(proc)
    proc.add_peer_failure_hook(follower.on_peer_failure)
    dist = sys.modules.get("torch.distributed")
    if dist is not None:  # a spare imported it before it took this rank
        follower.wrap(dist)
    else:
        sys.meta_path.insert(0, _PatchOnImport(follower.wrap))
