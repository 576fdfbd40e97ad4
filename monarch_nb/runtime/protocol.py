"""The process contract: message kinds and their headers, the fault catalogue, the worker environment.

Controller, host agents and procs agree on exactly what is here and nothing else:

- :class:`Kind`: every message kind, an enum whose members are their wire strings (``Kind.CALL ==
  "call"``), so a dispatch table keyed by ``Kind`` is indexed by the raw header field directly.
  The ``*Header`` TypedDicts are each kind's header: they extend
  :class:`~monarch_nb.transport.wire.Header` (``kind``, and the ``src``, ``dst``, ``seq``,
  ``nbuf`` the transport adds to every message). Headers are built as them, and each handler
  of a kind declares its kind's type. Kinds with no field of their own (STOP, SHUTDOWN,
  SPAWN_PROCS, KEEP_SPARES, CONTROLLER_HEARTBEAT: a JSON body, or nothing) are a plain ``Header``.
- :data:`FAULT_KINDS` and :func:`validate_fault`: which faults exist, their parameters and
  defaults, and which are delivered as a signal by the host agent (the rest act in the proc).
- :class:`ProcEnv` / :class:`AgentEnv`: the environment a proc / host agent is started with,
  written and read in one place, so every default lives once.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from enum import Enum, IntEnum
from typing import Any, Callable, Mapping, NamedTuple, TypedDict

from ..transport.wire import Header

__all__ = [
    "Kind",
    "CONTROLLER",
    "FaultKind",
    "FAULT_KINDS",
    "validate_fault",
    "ProcEnv",
    "AgentEnv",
    "AgentExit",
]

#: The controller's routing identity.
CONTROLLER = "ctrl"


class Kind(str, Enum):
    """Message kinds. ``str`` members: ``Kind.CALL == "call"`` and ``{Kind.CALL: f}["call"] is f``."""

    # controller or proc -> proc: actors
    CALL = "call"  # run an endpoint (CallHeader)
    SPAWN = "spawn"  # construct an actor (CallHeader, ep "__init__")
    REPLY = "reply"  # the answer to a call or spawn (ReplyHeader), to the caller
    PORT = "port"  # a value for a port (PortHeader), to the process that opened it
    STOP_ACTORS = "stop_actors"  # stop an actor mesh's actors on this proc (CallHeader, ep "__stop__"), replied
    SUPERVISE = "supervise"  # a MeshFailure for an owner actor's __supervise__ (CallHeader: actor; + pickled body)
    LOG_LEVEL = "log_level"  # set the root logger's level (LogLevelHeader)
    # controller -> proc: control
    STOP = "stop"  # exit cleanly (actors' __cleanup__ run)
    INTERRUPT = "interrupt"  # interrupt the endpoint an actor runs (InterruptHeader)
    PROC_FAILED = "proc_failed"  # peer procs failed (one, or a lost host's): fail calls to them (ProcsFailedHeader)
    PROC_RECOVERED = "proc_recovered"  # a peer proc serves again (PeerHeader)
    RENDEZVOUS = "rendezvous"  # the mesh's membership changed: a new rendezvous round (RendezvousHeader)
    FAULT = "fault"  # an in-proc fault to apply (FaultHeader); handled by the faults plugin
    DEBUG = "debug"  # a debugger request (CallHeader: a call with a pickled body); handled by the debug plugin
    RELOAD = "reload"  # reload the workspace's changed modules (CallHeader, JSON body), replied {"reloaded", "failed"}
    # proc -> controller
    HELLO = "hello"  # the proc is up (HelloHeader)
    HEARTBEAT = "hb"  # alive, and what runs (HeartbeatHeader)
    ACTOR_ERROR = "actor_error"  # an endpoint raised (ActorErrorHeader)
    FAULT_FIRED = "fault_fired"  # an injected in-proc fault took effect (FaultFiredHeader)
    ACTOR_FAILED = "actor_failed"  # an actor failed (ActorFailedHeader + pickled MeshFailure)
    CONTROL = "control"  # a request an actor makes of the controller: spawn, stop, ... (ControlHeader), replied
    # controller -> host agent
    SPAWN_PROCS = "spawn_procs"  # start procs (JSON list of proc specs as the body)
    SIGNAL = "signal"  # send a signal to a proc (SignalHeader)
    SHUTDOWN = "shutdown"  # kill every proc and exit
    KEEP_SPARES = "keep_spares"  # keep N warm spare procs for a mesh (JSON SparesSpec body; count 0 retires them)
    CONTROLLER_HEARTBEAT = "ctrl_hb"  # the controller is alive (to remote host agents)
    WORKSPACE = "workspace"  # make the host's workspace copy this manifest (WorkspaceHeader; JSON manifest body, files as buffers)
    RELAY_SERVE = "relay_serve"  # relay the heartbeats of other agents of the cluster: bind the relay socket (answered RELAY_READY)
    RELAY_JOIN = "relay_join"  # heartbeat through this relay from now on, or straight again (RelayJoinHeader)
    # controller <-> worker loop (a remote host waiting for a controller)
    ATTACH = "attach"  # become my host (AttachHeader), signed with the cluster key
    ATTACHED = "attached"  # the answer (AttachedHeader)
    # host agent -> controller
    AGENT_HELLO = "agent_hello"  # the agent is up (AgentHelloHeader)
    AGENT_HEARTBEAT = "agent_hb"  # the agent is alive; what the OS says of its procs (AgentHeartbeatHeader)
    SPARES = "spares"  # the warm spares of a mesh now (SparesHeader)
    AGENT_EXITING = "agent_exiting"  # the agent exits on its own, its procs with it (AgentExitingHeader)
    PROC_SPAWNED = "proc_spawned"  # a proc process exists (ProcSpawnedHeader)
    PROC_EXITED = "proc_exited"  # a proc process ended (ProcExitedHeader)
    REPLIES = "replies"  # the replies of this host's procs to one call, gathered (RepliesHeader; their bodies, joined)
    PROC_STACKS = "proc_stacks"  # a hung proc's Python stacks, taken just before it was fenced (ProcStacksHeader; JSON body)
    OUTPUT = "output"  # bytes a proc wrote to stdout/stderr (OutputHeader; the bytes are the body)
    WORKSPACE_SYNCED = "workspace_synced"  # what a WORKSPACE did (WorkspaceSyncedHeader)
    RELAY_READY = "relay_ready"  # the relay socket is bound, or could not be (RelayReadyHeader)
    RELAY_UNREACHED = "relay_unreached"  # members a cast down the tree could not be passed to (RelayUnreachedHeader)
    # relay agent -> its member agents (on the relay's own socket)
    RELAY_BEAT = "relay_beat"  # the relay is alive, and when it last heard the controller (RelayBeatHeader)

    def __str__(self) -> str:
        return self.value


#: ``handler(header, body, buffers)`` for one kind of message. A dispatch table keyed by
#: :class:`Kind` picks it, so each handler declares its kind's header type (``HelloHeader``, ...).
Handler = Callable[[Any, Any, list[memoryview]], None]

#: SPAWN's field whose name is a Python keyword (so not declarable in a class body).
SpawnFlags = TypedDict("SpawnFlags", {"async": int}, total=False)  # 1: the actor's endpoints are async


class CallHeader(Header, SpawnFlags, total=False):
    """A message for an actor: CALL, SPAWN (ep ``"__init__"``), STOP_ACTORS (ep ``"__stop__"``),
    SUPERVISE (``actor`` only: the owner's mesh id on this proc), a plugin's request (DEBUG)."""

    actor: str  # the actor mesh's name
    ep: str  # the endpoint
    rank: int  # the target's flat rank
    cid: str  # call id (absent for broadcast: no reply wanted)
    reply_to: str  # the caller's identity
    idx: int  # the target's index in the call
    port: list[str]  # [owner, port id]: the reply goes to this port instead (send(..., port=))
    mx: list[list[Any]]  # [labels, sizes] of the slice the call went to, when not the spawn mesh (current_rank)
    mi: int  # the target's index in that slice
    gth: int  # 1: the replies may be gathered per host (a call whose future takes them all, not a stream)
    _fanned: int  # set where the call is served: it came in a cast to this many procs of the host (never sent)
    asep: int  # 1: call a method not marked @endpoint (as_endpoint)
    _done: bool  # set where the call is served, once it was answered (never sent)


class ControlHeader(CallHeader):
    """A request an actor makes of the controller (CONTROL): a call of endpoint ``op`` of actor ``""``."""

    op: str  # spawn_procs, spawn_actors, stop_actors, stop_procs, initialized, get_or_spawn_controller, ...


class ReplyHeader(Header):
    cid: str
    idx: int
    ok: bool


class _RepliesCount(TypedDict, total=False):
    n: int  # up the relay tree: how many of the call's procs on the sender's host this accounts for (gathered or straight)


class RepliesHeader(Header, _RepliesCount):
    """REPLIES: a host agent's gathering of its procs' replies to call ``cid``: ``gathered`` holds
    ``[src, gk, idx, ok, nbytes]`` per reply (the proc's identity, its gathered-reply number,
    the ReplyHeader's ``idx`` and ``ok``, the length of its body); the bodies follow one another
    in the message's body, in that order. From a relay: its hosts' replies to the call, merged."""

    cid: str


class PortHeader(Header, total=False):
    port: str  # the port's id at its owner
    ok: bool  # False: the body is an exception for the receiver
    prank: int  # the sender's rank, for replies sent to a port (absent for port.send)


class ActorFailedHeader(Header):
    actor: str  # the failed actor mesh's id
    rank: int  # the failed actor's rank in its mesh


class LogLevelHeader(Header):
    level: int


class InterruptHeader(Header):
    actor: str


class PeerHeader(Header):
    """PROC_RECOVERED: a peer proc serves again."""

    proc: str  # the peer's identity


class ProcsFailedHeader(Header):
    """PROC_FAILED: procs that failed together (one proc, or every proc of a lost host: one
    message per peer, not one per failed proc); the body is :meth:`FailedProc.encode`'s,
    ``count`` the procs in it."""

    count: int


@dataclass(frozen=True)
class FailedProc:
    """One failed proc as PROC_FAILED tells it to its peers.

    Attributes:
        identity: its routing identity. rank: its rank. cause: ``SIGKILL``, ``hung``,
        ``host_lost``, ``exit 3``, ... detail: a sentence. signal: the signal's name, or None.
    """

    identity: str
    rank: int
    cause: str
    detail: str
    signal: str | None

    @staticmethod
    def encode(failed: "list[FailedProc]") -> bytes:
        """A PROC_FAILED body: a JSON list of ``[identity, rank, cause, detail, signal]``."""
        return json.dumps([[f.identity, f.rank, f.cause, f.detail, f.signal] for f in failed]).encode()

    @staticmethod
    def decode(body: Any) -> "list[FailedProc]":
        """The failed procs of a PROC_FAILED body (bytes or a memoryview).

        Raises:
            ValueError: the body is not such a list (a proc's IO loop logs it and goes on).
        """
        try:
            rows = json.loads(bytes(body))
            if not isinstance(rows, list):
                raise TypeError(f"a JSON {type(rows).__name__}")
            return [FailedProc(str(identity), int(rank), str(cause), str(detail), None if signal is None else str(signal))
                    for identity, rank, cause, detail, signal in rows]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a proc_failed message whose body is not a list of failed procs: {exc}") from exc


class FaultHeader(Header):
    fault: str
    params: dict[str, Any]


class _HelloFlags(TypedDict, total=False):
    linked: bool  # linked to its host agent: the controller's messages for it go through the agent


class HelloHeader(Header, _HelloFlags):
    pid: int


class HeartbeatFields(TypedDict, total=False):
    """A heartbeat's fields (a plugin adds its own: ``Proc.add_heartbeat_field``)."""

    busy: dict[str, list[Any]]  # actor -> [endpoint, seconds running]
    paused: list[dict[str, Any]]  # breakpoint sessions holding actors (debug plugin)
    loading: list[str]  # heavy modules being imported (the GIL may be held for seconds)


class HeartbeatHeader(Header, HeartbeatFields, total=False):
    pass


class ActorErrorHeader(Header):
    actor: str
    ep: str
    detail: str


class FaultFiredHeader(Header):
    fault: str
    detail: str


class _SignalFlags(TypedDict, total=False):
    stacks_first: bool  # a SIGKILL that fences a hung proc: take its Python stacks first (PROC_STACKS)


class SignalHeader(Header, _SignalFlags):
    proc: str
    signal: str


class ProcStacksHeader(Header):
    """A hung proc's stacks, as its host agent took them through its faulthandler just before the
    fencing SIGKILL (the body: :func:`.signal_stacks.dump_with_signal`'s dict, as JSON)."""

    proc: str  # its identity
    pid: int  # the incarnation the stacks are of


class AgentHelloHeader(Header):
    pid: int
    host: str


class AttachHeader(Header):
    controller: str  # the address the host agent and its procs connect to
    run_id: str  # the controller's run (the same run may attach a host it lost again)
    name: str  # the host's name in the tree
    time: float  # wall clock when sent (stale attaches are refused)
    nonce: str  # hex; never accepted twice
    sealed_key: str  # the controller's session key, sealed with the cluster key (transport.keys.seal)
    heartbeat_interval_s: float
    hang_timeout_s: float  # the controller loses a host silent this long; the worker judges it the same way
    controller_timeout_s: float  # the agent kills its procs when the controller is silent this long
    controller_host: str  # the controller's machine (hostname) and pid, for the worker's log
    controller_pid: int
    relay_heartbeats: bool  # the agent relays its procs' heartbeats (config.heartbeats_via_agents)
    link_procs: bool  # the agent passes the controller's messages on to its procs (config.messages_via_agents)


class AttachedHeader(Header, total=False):
    ok: bool
    error: str
    attached_as: str  # refused: this worker already serves this controller as that host
    host: str
    pid: int  # the host agent's
    hostname: str
    ip: str  # the host's address on the interface that reaches the controller
    iface: str  # that interface's name
    cores: int
    gpus: dict[str, Any]  # {"vendor", "count"}
    machine: str  # the kernel's boot id: hosts that share it share CPUs (network namespaces, local jobs)


class RelayedHeartbeat(TypedDict):
    """One member agent's heartbeat as its relay passes it on (an entry of
    :attr:`AgentHeartbeatHeader.members`): the member's own fields, and who sent it."""

    src: str  # the member agent's identity (host name # its pid)
    load: float
    stopped: list[str]
    heard: list[str]
    changed: dict[str, HeartbeatFields]


class QuietMember(NamedTuple):
    """A member agent whose heartbeat said nothing new, as its relay vouches for it (an entry of
    :attr:`AgentHeartbeatHeader.quiet`): every one of its ``procs`` procs with a rank was heard
    since its last heartbeat, no proc's fields changed, none is stopped. The controller takes
    each of that host's serving procs as heard (one record lookup per host, not one per proc).

    Attributes:
        src: the member agent's identity (host name # its pid).
        load: its host's runnable procs per core.
        procs: how many procs it heard (all it runs with a rank).

    A named tuple, not a dataclass: the controller reads ~2,000 of them a second at 1,024 idle
    hosts, and a tuple is made in a fifth of the time.
    """

    src: str
    load: float
    procs: int

    def to_wire(self) -> list[Any]:
        """``[src, load, procs]``: what a relay's heartbeat carries (3 items, not a dict per host)."""
        return [self.src, self.load, self.procs]

    @staticmethod
    def from_wire(row: Any) -> "QuietMember":
        """One entry of a relay's ``quiet`` list.

        Raises:
            ValueError, TypeError: not ``[str, number, int]`` (one bad entry costs only itself).
        """
        src, load, procs = row
        if not isinstance(src, str) or isinstance(procs, bool) or not isinstance(procs, int):
            raise TypeError(f"not [src, load, procs]: {row!r}")
        return QuietMember(src, float(load), procs)


class RelayedHeartbeats(TypedDict, total=False):
    members: list[RelayedHeartbeat]  # a relay's: its members' heartbeats since its last heartbeat (monarch_nb.runtime.relay)
    quiet: list[list[Any]]  # a relay's: its members whose heartbeat said nothing new (QuietMember.to_wire each)
    relay_left: str  # a member's first heartbeat straight again: the relay it stopped hearing
    all_heard: int  # this heartbeat says nothing new: all of the agent's this many procs with a rank heard,
    # no fields changed, none stopped (its relay may pass it on as a QuietMember); absent otherwise


class RelayJoinHeader(Header):
    relay: str  # the relay's host name ("": heartbeat straight to the controller again)
    endpoint: str  # the relay socket's address (tcp://IP:PORT; "" with relay "")


class RelayReadyHeader(Header):
    endpoint: str  # where the relay socket is bound ("" when it could not be)
    error: str  # why it could not be ("" when bound)


class RelayBeatHeader(Header):
    controller_age_s: float  # seconds since the relay last heard its controller


class RelayUnreachedHeader(Header):
    cast: int  # the controller's number of the cast (its relay routing frame's, @@CAST;...)
    hosts: list[str]  # the member hosts it could not be passed to: the controller sends them their part straight


class AgentHeartbeatHeader(Header, RelayedHeartbeats):
    load: float  # runnable procs of this host per core (1.0: every core busy)
    stopped: list[str]  # identities of procs the OS reports stopped (SIGSTOP, state T): hung whatever they do
    heard: list[str]  # procs that heartbeated to the agent since its last heartbeat, fields unchanged
    changed: dict[str, HeartbeatFields]  # procs heard whose fields changed (or first heard): their latest fields


class RendezvousHeader(Header):
    addr: str  # MASTER_ADDR from now on
    port: int  # MASTER_PORT from now on: a fresh store, with none of the previous round's keys
    round: int  # TORCHELASTIC_RESTART_COUNT from now on (torchrun's restart count)


class AgentExitingHeader(Header):
    why: str  # what made it exit ("its worker loop exited", "the controller was silent for 4.0 s")


class SparesHeader(Header):
    mesh: str
    spares: list[dict[str, Any]]  # [{"pid": int, "ready": bool}]


class WorkspaceHeader(Header):
    request: int  # the controller's request id, echoed in the reply
    files: list[str]  # the paths whose contents are the buffers, in order


class WorkspaceSyncedHeader(Header):
    request: int
    root: str  # the copy's folder on the host (first on its procs' sys.path)
    written: list[str]
    removed: list[str]
    bytes: int  # bytes written
    missing: list[str]  # in the manifest, not held, not sent: send them
    error: str  # "" when it applied; else why nothing was written


class ProcSpawnedHeader(Header, total=False):
    proc: str
    pid: int
    spare: bool  # a warm spare took the rank's place


class ProcExitedHeader(Header, total=False):
    proc: str
    pid: int
    returncode: int
    signal: str | None
    detail: str
    time: float
    on_request: bool  # it was alive when the controller last asked to signal it (a SIGNAL), and was signalled


class OutputHeader(Header):
    proc: str
    rank: int
    stream: str  # "stdout" or "stderr"
    oseq: int  # per (proc, stream) chunk number


# -- faults ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FaultKind:
    """One kind of fault.

    Attributes:
        params: parameter name -> default.
        signal: the signal the host agent sends for it, or None if it acts inside the proc.
        help: what happens, one line.
    """

    params: Mapping[str, Any]
    signal: str | None
    help: str


#: Every fault kind; ``procs.inject(rank, kind, **params)``, ``%mesh fault`` and fault specs use these.
FAULT_KINDS: dict[str, FaultKind] = {
    "kill": FaultKind({}, "SIGKILL", "SIGKILL from the host agent"),
    "segfault": FaultKind({}, None, "the proc dereferences NULL (SIGSEGV)"),
    "exit": FaultKind({"code": 1}, None, "os._exit(code) in the proc"),
    "hang": FaultKind({}, "SIGSTOP", "SIGSTOP: the proc freezes"),
    "stall": FaultKind({"seconds": 5.0}, None, "a C call holds the GIL for `seconds`"),
    "raise": FaultKind({}, None, "the next endpoint call raises"),
    "nan": FaultKind({}, None, "the next tensor result / gradient is NaN"),
    "slow": FaultKind({"ms": 100.0}, None, "every endpoint call sleeps `ms` first"),
    "partition": FaultKind({"seconds": 5.0}, None, "every message to and from the proc is dropped for `seconds`"),
}


def validate_fault(kind: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``kind`` and ``params``; return the params with defaults filled in.

    Raises:
        ValueError: unknown kind, unknown parameter, or a negative duration; the message lists
            what is valid.
    """
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; valid kinds: {', '.join(FAULT_KINDS)}")
    allowed = FAULT_KINDS[kind].params
    unknown = set(params) - set(allowed)
    if unknown:
        accepted = ", ".join(allowed) or "no parameters"
        raise ValueError(f"fault {kind!r} takes {accepted}; got {sorted(unknown)}")
    filled = {**allowed, **params}
    for name, value in filled.items():
        if name == "code":
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"fault {kind!r}: code must be an int, got {value!r}")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"fault {kind!r}: {name} must be a non-negative number, got {value!r}")
    return filled


# -- environments ---------------------------------------------------------------------------------
_PREFIX = "MONARCH_NB_"


def _read(environ: Mapping[str, str], name: str, default: str) -> str:
    return environ.get(_PREFIX + name, default)


@dataclass
class ProcEnv:
    """What a proc is started with. The controller fills the proc's part, the host agent adds
    ``key_hex`` and ``agent_pid``. torchrun's variables are set too, so ``env://`` code runs
    unchanged.

    Attributes:
        controller: the controller's address (``ipc://...`` or ``tcp://...``).
        rank / local_rank / world_size / local_world_size / group_rank: as torchrun sets them.
        coords: the proc's coordinates, dim -> index.
        extent: its proc mesh's dims, dim -> size.
        heartbeat_interval_s: seconds between heartbeats.
        run_id: the run's id for same-host shared-memory buffers ("" when none).
        sys_path: the controller's ``sys.path``, prepended in the proc so user modules import.
        key_hex: the cluster key (popped from the environment when read).
        agent_pid: the host agent's pid (the proc exits if its parent is not this pid).
        import_lock_dir: where the host's import slots live ("" for none): at most
            ``import_slots`` procs of a host import a heavy module (torch) at once.
        import_slots: how many heavy imports may run at once on the host.
        curve_dir: the cluster's CurveZMQ key folder on this host ("" for plain transport).
        workspace: the host's copy of the synced workspace (first on ``sys_path``; "" for none),
            see :mod:`.workspace_files`.
        heartbeat_dir: the host agent's folder of heartbeat files (see :mod:`.heartbeat_relay`;
            "": the proc heartbeats to the controller).
        agent_link: the host agent's link for the controller's messages (``ipc://...``, see
            :mod:`.proc_link`; "": they come straight from the controller).
        extra: further variables, verbatim (per-rank device visibility, MASTER_ADDR, ...).
    """

    controller: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    coords: dict[str, int] = field(default_factory=dict)
    extent: dict[str, int] = field(default_factory=dict)
    heartbeat_interval_s: float = 0.25
    run_id: str = ""
    sys_path: list[str] = field(default_factory=list)
    key_hex: str = ""
    agent_pid: int = 0
    import_lock_dir: str = ""
    import_slots: int = 0
    curve_dir: str = ""
    workspace: str = ""
    heartbeat_dir: str = ""
    agent_link: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def to_env(self) -> dict[str, str]:
        """The variables to start the proc with (merge over the agent's own environment)."""
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            _PREFIX + "CONTROLLER": self.controller,
            _PREFIX + "COORDS": json.dumps(self.coords),
            _PREFIX + "EXTENT": json.dumps(self.extent),
            _PREFIX + "HEARTBEAT_INTERVAL_S": repr(float(self.heartbeat_interval_s)),
            _PREFIX + "RUN_ID": self.run_id,
            _PREFIX + "SYS_PATH": json.dumps(list(self.sys_path)),
            **{str(k): str(v) for k, v in self.extra.items()},
        }
        if self.key_hex:
            env[_PREFIX + "KEY"] = self.key_hex
        if self.agent_pid:
            env[_PREFIX + "AGENT_PID"] = str(self.agent_pid)
        if self.import_lock_dir:
            env[_PREFIX + "IMPORT_LOCK_DIR"] = self.import_lock_dir
            env[_PREFIX + "IMPORT_SLOTS"] = str(self.import_slots)
        if self.curve_dir:
            env[_PREFIX + "CURVE_DIR"] = self.curve_dir
        if self.workspace:
            env[_PREFIX + "WORKSPACE"] = self.workspace
        if self.heartbeat_dir:
            env[_PREFIX + "HEARTBEAT_DIR"] = self.heartbeat_dir
        if self.agent_link:
            env[_PREFIX + "AGENT_LINK"] = self.agent_link
        return env

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ProcEnv":
        return cls(**data)

    @classmethod
    def from_env(cls, environ: "os._Environ[str] | dict[str, str]") -> "ProcEnv":
        """Read the proc's environment; the key is popped (children of the proc never see it).

        Raises:
            KeyError: a variable the controller always sets is missing (not started as a proc).
        """
        return cls(
            controller=environ[_PREFIX + "CONTROLLER"],
            rank=int(environ.get("RANK", "0")),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=int(environ.get("WORLD_SIZE", "1")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1")),
            group_rank=int(environ.get("GROUP_RANK", "0")),
            coords=json.loads(_read(environ, "COORDS", "{}")),
            extent=json.loads(_read(environ, "EXTENT", "{}")),
            heartbeat_interval_s=float(_read(environ, "HEARTBEAT_INTERVAL_S", repr(cls.heartbeat_interval_s))),
            run_id=_read(environ, "RUN_ID", ""),
            sys_path=json.loads(_read(environ, "SYS_PATH", "[]")),
            key_hex=environ.pop(_PREFIX + "KEY", ""),
            agent_pid=int(_read(environ, "AGENT_PID", "0")),
            import_lock_dir=_read(environ, "IMPORT_LOCK_DIR", ""),
            import_slots=int(_read(environ, "IMPORT_SLOTS", "0")),
            curve_dir=_read(environ, "CURVE_DIR", ""),
            workspace=_read(environ, "WORKSPACE", ""),
            heartbeat_dir=_read(environ, "HEARTBEAT_DIR", ""),
            agent_link=_read(environ, "AGENT_LINK", ""),
        )


@dataclass
class AgentEnv:
    """What a host agent is started with.

    Attributes:
        controller: the controller's address.
        key_hex: the cluster key (popped when read).
        controller_pid: the agent exits when its parent is no longer this pid: the controller of a
            local agent, the worker loop that started a remote one (0: no check).
        run_id: the run's id for same-host shared-memory buffers ("" when none).
        orphan_check_s: how often the agent checks its parent, seconds.
        heartbeat_interval_s: seconds between the agent's heartbeats.
        controller_timeout_s: a remote agent kills its procs and exits when the controller is
            silent this long (0: no check; a local agent watches its parent pid instead).
        curve_dir: the cluster's CurveZMQ key folder on this host ("" for plain transport).
        iface: the network interface that reaches the controller (procs' GLOO/NCCL_SOCKET_IFNAME).
        status_path: a file whose modification time the agent keeps at the wall-clock time it
            last heard its controller ("" for none): the worker loop reads it to tell a dead
            controller from a live one when another controller asks for the host.
    """

    controller: str
    key_hex: str
    controller_pid: int = 0
    run_id: str = ""
    orphan_check_s: float = 0.1
    heartbeat_interval_s: float = 0.25
    controller_timeout_s: float = 0.0
    curve_dir: str = ""
    iface: str = "lo"
    status_path: str = ""
    relay_heartbeats: bool = True
    link_procs: bool = True

    def to_env(self) -> dict[str, str]:
        return {
            _PREFIX + "CONTROLLER": self.controller,
            _PREFIX + "KEY": self.key_hex,
            _PREFIX + "CONTROLLER_PID": str(self.controller_pid),
            _PREFIX + "RUN_ID": self.run_id,
            _PREFIX + "ORPHAN_CHECK_S": repr(float(self.orphan_check_s)),
            _PREFIX + "HEARTBEAT_INTERVAL_S": repr(float(self.heartbeat_interval_s)),
            _PREFIX + "CONTROLLER_TIMEOUT_S": repr(float(self.controller_timeout_s)),
            _PREFIX + "CURVE_DIR": self.curve_dir,
            _PREFIX + "IFACE": self.iface,
            _PREFIX + "STATUS_PATH": self.status_path,
            _PREFIX + "RELAY_HEARTBEATS": "1" if self.relay_heartbeats else "0",
            _PREFIX + "LINK_PROCS": "1" if self.link_procs else "0",
        }

    @classmethod
    def from_env(cls, environ: "os._Environ[str] | dict[str, str]") -> "AgentEnv":
        """Read the agent's environment; the key is popped.

        Raises:
            KeyError: not started by a controller (no controller address or key).
        """
        return cls(
            controller=environ[_PREFIX + "CONTROLLER"],
            key_hex=environ.pop(_PREFIX + "KEY"),
            controller_pid=int(_read(environ, "CONTROLLER_PID", "0")),
            run_id=_read(environ, "RUN_ID", ""),
            orphan_check_s=float(_read(environ, "ORPHAN_CHECK_S", repr(cls.orphan_check_s))),
            heartbeat_interval_s=float(_read(environ, "HEARTBEAT_INTERVAL_S", repr(cls.heartbeat_interval_s))),
            controller_timeout_s=float(_read(environ, "CONTROLLER_TIMEOUT_S", "0")),
            curve_dir=_read(environ, "CURVE_DIR", ""),
            iface=_read(environ, "IFACE", "lo"),
            status_path=_read(environ, "STATUS_PATH", ""),
            relay_heartbeats=_read(environ, "RELAY_HEARTBEATS", "1") == "1",
            link_procs=_read(environ, "LINK_PROCS", "1") == "1",
        )


class AgentExit(IntEnum):
    """Why a host agent exited: its exit status, read by the worker loop that started it."""

    SHUTDOWN = 0  # its controller told it to stop (SHUTDOWN, or SIGTERM from its worker loop)
    PARENT_GONE = 3  # its parent exited: the controller of a local agent, the worker loop of a remote one
    CONTROLLER_SILENT = 4  # its controller was silent past controller_timeout_s (dead or cut off)

    @property
    def why(self) -> str:
        return {AgentExit.SHUTDOWN: "the controller stopped using this host",
                AgentExit.PARENT_GONE: "its parent process exited",
                AgentExit.CONTROLLER_SILENT: "the controller went silent (dead or cut off); its procs were killed"}[self]
