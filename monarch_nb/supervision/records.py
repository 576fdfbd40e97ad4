"""What the controller knows of each supervised node: proc states and the records of hosts, procs and meshes.

Plain data, written by the runtime (the controller's IO and supervisor threads) and read by the
supervision tree, the widgets, the debugger and the training loop. States are a
:class:`ProcState` enum whose members are their strings, so they compare with and serialise as
``"healthy"``, ``"failed"``, ... A proc's state changes only through :meth:`ProcRecord.move`,
which checks the move against :data:`MOVES`.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Mapping

from ..transport.wire import route_id

if TYPE_CHECKING:
    from .policy import Failure, SupervisionPolicy

__all__ = [
    "ProcState",
    "ALIVE",
    "SERVING",
    "MOVES",
    "RACY_MOVES",
    "ProcRecord",
    "HostHeard",
    "ProcTable",
    "ActorSpawn",
    "ProcMeshRecord",
    "HostRecord",
    "proc_identity",
    "route_id",
]


class ProcState(str, Enum):
    """The state of a proc (also of a host agent and of an actor, in the tree)."""

    STARTING = "starting"  # spawned, not yet said hello
    HEALTHY = "healthy"  # serving, idle
    BUSY = "busy"  # serving, an endpoint runs
    PAUSED = "paused"  # a user holds an actor at breakpoint() (tree only; never fenced)
    HUNG = "hung"  # missed heartbeats past the hang timeout
    FAILED = "failed"  # exited, was killed or fenced, or could not respawn its actors
    RESTARTING = "restarting"  # being replaced by a new incarnation
    STOPPING = "stopping"  # asked to stop
    STOPPED = "stopped"  # stopped on purpose

    def __str__(self) -> str:
        return self.value


#: States of a proc whose process may still exist.
ALIVE = frozenset({ProcState.STARTING, ProcState.HEALTHY, ProcState.BUSY, ProcState.HUNG, ProcState.RESTARTING, ProcState.STOPPING})
#: States in which a proc answers calls.
SERVING = frozenset({ProcState.HEALTHY, ProcState.BUSY})

_S = ProcState
#: The moves the runtime makes, state -> the states it may move to (and who moves it):
#: ``hello``, ``heartbeat``, ``exit``, the hang timer (``hung``) and a lost host
#: (:mod:`monarch_nb.runtime.liveness`), a failed actor respawn, ``restart`` and ``stop``
#: (:mod:`monarch_nb.runtime.proc_meshes`). STARTING is only a record's first state; PAUSED is
#: the tree's (a proc held at breakpoint()), never a record's. A hello and an exit come from
#: different senders (the proc, its host agent), so either may be handled first: hence the
#: moves to HEALTHY from FAILED, STOPPING and STOPPED.
_SEQUENTIAL: dict[ProcState, frozenset[ProcState]] = {
    _S.STARTING: frozenset({_S.HEALTHY, _S.FAILED, _S.RESTARTING, _S.STOPPING}),  # hello; exit, lost host; restart; stop
    _S.HEALTHY: frozenset({_S.HEALTHY, _S.BUSY, _S.HUNG, _S.FAILED, _S.RESTARTING, _S.STOPPING}),  # heartbeat; hung; ...
    _S.BUSY: frozenset({_S.HEALTHY, _S.BUSY, _S.HUNG, _S.FAILED, _S.RESTARTING, _S.STOPPING}),
    _S.HUNG: frozenset({_S.HEALTHY, _S.BUSY, _S.FAILED, _S.RESTARTING, _S.STOPPING}),  # heartbeats again (not fenced)
    # a hello handled after the exit; the exit of a proc whose actors failed to respawn; a restart
    _S.FAILED: frozenset({_S.HEALTHY, _S.FAILED, _S.RESTARTING}),
    # the new incarnation's hello; it died, its host was lost, its actors failed to respawn; a
    # restart again (the last one timed out); stop
    _S.RESTARTING: frozenset({_S.HEALTHY, _S.FAILED, _S.RESTARTING, _S.STOPPING}),
    # exit, lost host; the hello of a proc stopped while it started; a respawn that failed meanwhile
    _S.STOPPING: frozenset({_S.STOPPED, _S.HEALTHY, _S.FAILED}),
    # a hello handled after the exit; the exit of a proc stopped with its lost host, reported once
    # the host is heard again; a respawn that failed meanwhile
    _S.STOPPED: frozenset({_S.HEALTHY, _S.FAILED}),
    _S.PAUSED: frozenset(),
}
#: Moves made only when a thread acts on a state it read before another thread moved the proc
#: (no lock orders the readers of a proc's state): the IO thread's heartbeat, hang timer and
#: exit against a stop, a restart or a failed respawn on another thread, and those against
#: each other. Today's code makes them, so they are legal; each is a race to close some day.
RACY_MOVES: Mapping[ProcState, frozenset[ProcState]] = {
    _S.FAILED: frozenset({_S.BUSY, _S.HUNG, _S.STOPPING, _S.STOPPED}),
    _S.RESTARTING: frozenset({_S.BUSY, _S.HUNG, _S.STOPPED}),
    _S.STOPPING: frozenset({_S.BUSY, _S.HUNG, _S.RESTARTING, _S.STOPPING}),
    _S.STOPPED: frozenset({_S.RESTARTING, _S.STOPPING}),
}
#: Every legal move of a proc's state: state -> the states :meth:`ProcRecord.move` may move it to.
MOVES: Mapping[ProcState, frozenset[ProcState]] = {
    state: _SEQUENTIAL[state] | RACY_MOVES.get(state, frozenset()) for state in ProcState
}
del _S


def proc_identity(proc_mesh: str, rank: int) -> str:
    """The routing identity of rank ``rank`` of proc mesh ``proc_mesh``: ``"pm0.3"``."""
    return f"{proc_mesh}.{rank}"


@dataclass
class HostHeard:
    """When a host agent last said, through its relay, that all its procs were heard and nothing
    changed (:class:`~monarch_nb.runtime.protocol.QuietMember`): one cell per host, shared by the
    records of its procs (:class:`ProcTable`), so the controller takes a host's word in one write.

    Attributes:
        at: ``time.monotonic()`` of the word (0: never).
    """

    at: float = 0.0


@dataclass
class ProcRecord:
    """One proc: a node of the supervision tree.

    Attributes:
        identity: routing identity (``"pm0.3"``).
        mesh / rank / coords: its proc mesh, flat rank and coordinates.
        host: the name of the host agent that runs it.
        spec: how to start it again (what the host agent was sent).
        state: a :class:`ProcState`; changed only by :meth:`move`.
        pid: the current incarnation's pid (0 until known).
        restarts: times it was restarted.
        last_heartbeat: ``time.monotonic()`` of its last heartbeat of its own (:attr:`last_heard`
            counts its agent's word that all of the host's procs were heard, too).
        host_heard: its host's :class:`HostHeard` (set by :class:`ProcTable`).
        hung_stacks: the Python stacks of the last incarnation judged hung, taken by its host agent
            just before it was fenced (:func:`monarch_nb.runtime.signal_stacks.dump_with_signal`'s dict,
            its ``pid`` that incarnation's), or None.
        busy: actor -> [endpoint, seconds running], from the last heartbeat.
        output_tail: its last 200 output lines.
        exit_info: ``{"returncode", "signal"}`` of the last exit, or None.
        fenced: it was killed after a hang.
        loading: heavy modules it is importing (the GIL may be held: see ``import_grace_s``).
        restart_kill_pid: the pid a restart killed on purpose (its exit is no failure).
        paused: breakpoint() sessions holding its actors.
        ready: set when it serves (after hello, and after a restart's actors are respawned).
        started_at: ``time.monotonic()`` of this incarnation's hello.
        failure: the supervision Failure of this incarnation, once it failed.
        os_stopped: the host agent reports the process stopped (SIGSTOP): hung, even mid-import.
        restart_lock: held while the proc is being restarted (one restart at a time).
        on_spare: this incarnation is a warm spare that took the rank.
    """

    identity: str
    mesh: str
    rank: int
    coords: dict[str, int]
    host: str
    spec: dict[str, Any]
    state: ProcState = ProcState.STARTING
    pid: int = 0
    restarts: int = 0
    last_heartbeat: float = 0.0
    busy: dict[str, list[Any]] = field(default_factory=dict)
    output_tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=200))
    exit_info: dict[str, Any] | None = None
    fenced: bool = False
    loading: list[str] = field(default_factory=list)
    restart_kill_pid: int = 0
    paused: list[dict[str, Any]] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    failure: Failure | None = None
    os_stopped: bool = False
    restart_lock: threading.Lock = field(default_factory=threading.Lock)
    on_spare: bool = False
    host_heard: HostHeard = field(default_factory=HostHeard, repr=False, compare=False)
    hung_stacks: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    _state_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def move(self, new: ProcState, why: str) -> ProcState:
        """Move the proc to state ``new`` (``why``: what moves it, for the error) and return the
        state it was in; the one place a proc's state changes.

        Called by the controller's IO thread (a hello, a heartbeat, an exit, the hang timer, a
        lost host: :mod:`monarch_nb.runtime.liveness`), by the thread that respawns a restarted
        proc's actors (they failed), and by the threads that start, stop and restart proc meshes
        (the user's, the supervisor's, a control request's: :mod:`monarch_nb.runtime.proc_meshes`).
        Callers hold no lock of the controller; the record's own lock makes the check and the
        change one step, so the move checked is the move made (:data:`RACY_MOVES` are the moves a
        caller makes when another thread moved the proc after it looked).

        Raises:
            RuntimeError: ``new`` is not in :data:`MOVES` of the current state (a bug in the caller).
        """
        with self._state_lock:
            old = self.state
            if new not in MOVES[old]:
                legal = ", ".join(sorted(s.value for s in MOVES[old])) or "none"
                raise RuntimeError(f"proc {self.identity}: {old.value} -> {new.value} is not a legal move ({why}); "
                                   f"from {old.value} it may move to {legal}")
            self.state = new
            return old

    @property
    def alive(self) -> bool:
        """The process may exist: starting, serving, hung, restarting or stopping."""
        return self.state in ALIVE

    @property
    def serving(self) -> bool:
        """It answers calls (healthy or busy)."""
        return self.state in SERVING

    @property
    def last_heard(self) -> float:
        """``time.monotonic()`` the proc was last heard: its own heartbeat, or (while alive) its
        host agent's word that all its procs were heard, whichever is later (0: never)."""
        if self.state in ALIVE:
            return max(self.last_heartbeat, self.host_heard.at)
        return self.last_heartbeat


class ProcTable(dict[str, ProcRecord]):
    """The controller's proc records: identity -> :class:`ProcRecord`, and each host's at hand.

    A dict whose records are written and removed one at a time (``table[identity] = record``,
    ``table.pop(identity, None)``). It keeps each host's records together (:meth:`on_host`,
    :meth:`by_host`: no scan of every proc) and gives them the host's :class:`HostHeard` cell,
    so a relay's word that all of a host's procs were heard is one write
    (:meth:`~monarch_nb.runtime.liveness.Liveness.on_host_heard_all`). A host's records are an
    immutable tuple, replaced whole, so a reader on another thread never sees one half written.

    Raises:
        TypeError: on ``update``, ``setdefault``, ``popitem``, ``clear`` and ``|=``: one at a time.
    """

    def __init__(self) -> None:
        super().__init__()
        self._by_host: dict[str, tuple[ProcRecord, ...]] = {}
        self._heard: dict[str, HostHeard] = {}

    def __setitem__(self, identity: str, record: ProcRecord) -> None:
        self._unindex(self.get(identity))
        record.host_heard = self.host_heard(record.host)
        super().__setitem__(identity, record)
        self._by_host[record.host] = (*self._by_host.get(record.host, ()), record)

    def __delitem__(self, identity: str) -> None:
        self._unindex(self.get(identity))
        super().__delitem__(identity)

    def pop(self, identity: str, *default: Any) -> Any:
        self._unindex(self.get(identity))
        return super().pop(identity, *default)

    def on_host(self, host: str) -> tuple[ProcRecord, ...]:
        """The records of the procs host agent ``host`` runs or ran, in the order written."""
        return self._by_host.get(host, ())

    def by_host(self) -> list[tuple[HostHeard, tuple[ProcRecord, ...]]]:
        """(host's cell, its records) for every host with records (a copy: safe while others write)."""
        heard = self._heard
        return [(heard[host], records) for host, records in list(self._by_host.items())]

    def host_heard(self, host: str) -> HostHeard:
        """``host``'s cell (made on first use; kept, so a record written later shares it)."""
        cell = self._heard.get(host)
        if cell is None:
            cell = self._heard.setdefault(host, HostHeard())
        return cell

    def _unindex(self, record: ProcRecord | None) -> None:
        if record is not None:
            rest = tuple(r for r in self._by_host.get(record.host, ()) if r is not record)
            if rest:
                self._by_host[record.host] = rest
            else:
                self._by_host.pop(record.host, None)

    def _one_at_a_time(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("proc records are written one at a time: table[identity] = record")

    update = setdefault = popitem = clear = __ior__ = _one_at_a_time


@dataclass
class ActorSpawn:
    """How an actor mesh was built, kept to respawn it on a restarted proc.

    Attributes:
        name: the actor mesh's name.
        cls: the actor class.
        body / buffers: the pickled ``(cls, args, kwargs, extent, ranks)``.
        ranks: the proc ranks it lives on.
    """

    name: str
    cls: type
    body: bytes
    buffers: list[memoryview]
    ranks: list[int]


@dataclass
class ProcMeshRecord:
    """A proc mesh: its extent, its procs' identities in rank order, its actor meshes and policy."""

    name: str
    extent: Any  # monarch_nb.actor.shape.Extent
    procs: list[str]
    actors: list[ActorSpawn] = field(default_factory=list)
    stopped: bool = False
    supervision: SupervisionPolicy | None = None
    rendezvous_round: int = 0  # bumped at every membership change (torchrun's restart count)
    replica_group_size: int = 1  # ranks per replica group of a sharded training run (1: none)


@dataclass
class HostRecord:
    """A host agent.

    Attributes:
        name: its name (``"host0"``), also its routing identity.
        state: a :class:`ProcState` (starting, healthy, failed, stopped).
        pid: its pid (0 until it said hello).
        ready: set once it said hello.
        started_at: ``time.monotonic()`` when it was started.
        last_heartbeat: ``time.monotonic()`` of its last heartbeat (0 before the first).
        load: runnable procs per core on the host, from its last heartbeat.
        spares: proc mesh -> its warm spares here, ``[{"pid", "ready"}]``.
        address: a remote host's worker address (``tcp://HOST:PORT``); "" for this machine.
        detail: what an attached host said of itself (hostname, ip, iface, cores, gpus).
        stopped: identities of its procs the OS reported stopped (SIGSTOP) in its last heartbeat.
        via_relay: the host whose agent passed its last heartbeat on (:mod:`monarch_nb.runtime.relay`);
            "" when it came straight (the controller then heartbeats to it itself).
    """

    name: str
    state: ProcState = ProcState.STARTING
    pid: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    started_at: float = field(default_factory=time.monotonic)
    last_heartbeat: float = 0.0
    load: float = 0.0
    spares: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    address: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    stopped: frozenset[str] = frozenset()
    via_relay: str = ""
