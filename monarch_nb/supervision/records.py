"""What the controller knows of each supervised node: proc states and the records of hosts, procs and meshes.

Plain data, written by the runtime (the controller's IO and supervisor threads) and read by the
supervision tree, the widgets, the debugger and the training loop. States are a
:class:`ProcState` enum whose members are their strings, so they compare with and serialise as
``"healthy"``, ``"failed"``, ...
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..transport.wire import route_id

if TYPE_CHECKING:
    from .policy import Failure, SupervisionPolicy

__all__ = [
    "ProcState",
    "ALIVE",
    "SERVING",
    "ProcRecord",
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


def proc_identity(proc_mesh: str, rank: int) -> str:
    """The routing identity of rank ``rank`` of proc mesh ``proc_mesh``: ``"pm0.3"``."""
    return f"{proc_mesh}.{rank}"


@dataclass
class ProcRecord:
    """One proc: a node of the supervision tree.

    Attributes:
        identity: routing identity (``"pm0.3"``).
        mesh / rank / coords: its proc mesh, flat rank and coordinates.
        host: the name of the host agent that runs it.
        spec: how to start it again (what the host agent was sent).
        state: a :class:`ProcState`.
        pid: the current incarnation's pid (0 until known).
        restarts: times it was restarted.
        last_heartbeat: ``time.monotonic()`` of its last heartbeat.
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

    @property
    def alive(self) -> bool:
        """The process may exist: starting, serving, hung, restarting or stopping."""
        return self.state in ALIVE

    @property
    def serving(self) -> bool:
        """It answers calls (healthy or busy)."""
        return self.state in SERVING


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
