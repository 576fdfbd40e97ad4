"""The worker core: hosts actors, runs their endpoints, sends heartbeats. Runs inside each proc.

A proc is started by its host agent as ``python -m monarch_nb.proc_main <identity>``, which
builds a :class:`Proc` and installs the features' worker plugins (faults, debugger) before it
serves. The core knows no feature: a plugin registers a handler for its message kind
(:meth:`Proc.register`), hooks around endpoint calls (:meth:`Proc.add_call_hook`), fields of the
heartbeat (:meth:`Proc.add_heartbeat_field`) and observers of endpoint failures
(:meth:`Proc.add_failure_hook`).

The main thread runs the IO loop (it also sends heartbeats, so a busy actor does not look hung,
while a GIL-holding C call or SIGSTOP does). Heartbeats go to the host agent, which summarizes
its procs' in one message per interval (:mod:`.heartbeat_relay`). The actors live in an
:class:`~monarch_nb.runtime.actors.ActorHost`: each has its own thread (and asyncio loop, if
async), so an endpoint may block on another actor's reply (``.get()`` inside an endpoint), even
one living in the same proc, without deadlock. Messages from one sender to one actor are run in
order.

What an actor asks of the runtime beyond calls (spawning procs or actors, stopping meshes,
``get_or_spawn_controller``) goes to the controller as a ``control`` request: the controller
owns every mesh, and the asking actor becomes the owner of what it spawned.

The proc dies with its host agent (PR_SET_PDEATHSIG). Told to stop, it stops its actors
(``__cleanup__``), then returns from its main so that the interpreter finalizes normally
(module-level finalizers run, as in Monarch).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..actor import backend
from ..actor.context import _ROOT_POINT, Context, Instance, _set_default
from ..actor.context import context as current_context
from ..actor.backend import Target
from ..actor.future import Future
from ..actor.shape import Extent
from ..errors import SupervisionError
from ..transport.channel import Channel
from ..transport.keys import load_trust
from ..transport.wire import Header, Signer, route_id
from . import import_grace
from .actor_host import ActorHost
from .actors import ActorRunner
from ..actor.log_prefix import install_log_prefix
from .messenger import Messenger
from .heartbeat_relay import HeartbeatSender
from ..transport.local_peers import LocalPeers
from .proc_link import link_to_agent
from .protocol import (CONTROLLER, CallHeader, FailedProc, Handler, HeartbeatFields, HeartbeatHeader, HelloHeader, InterruptHeader, Kind,
                       LogLevelHeader, PeerHeader, ProcEnv, ProcsFailedHeader, RendezvousHeader)

__all__ = ["Proc", "CallHook", "Plugin", "PeerFailure", "current", "main"]

log = logging.getLogger("monarch_nb.proc")

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class PeerFailure(FailedProc):
    """A proc of this proc's mesh failed: what the controller said (``proc_failed``, a
    :class:`~.protocol.FailedProc`), and when it was heard.

    Attributes:
        monotonic: ``time.monotonic()`` here when it was heard.
    """

    monotonic: float

    def describe(self) -> str:
        return f"rank {self.rank} failed ({self.cause}): {self.detail}"


class CallHook(Protocol):
    """Runs around every endpoint call on a proc (the faults plugin's ``raise``, ``slow``, ``nan``)."""

    def before_call(self, actor: str, endpoint: str) -> None:
        """Before the endpoint runs, on the actor's thread; may raise (the call then fails)."""

    def after_call(self, result: Any, actor: str, endpoint: str) -> Any:
        """After it returned, on the actor's thread; returns the result to send."""


#: A worker plugin: ``install(proc)`` registers its handlers and hooks.
Plugin = Callable[["Proc"], None]


def die_with_parent(expected_parent: int) -> None:
    """Ask Linux to SIGKILL us when our parent exits; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the host agent's orphan check still covers us
        pass
    if expected_parent and os.getppid() != expected_parent:
        os._exit(1)


class Proc:
    """The worker process: its channel, messenger, actors, and the plugins' handlers and hooks.

    It is the actor API's backend inside the worker: actors call other actors through it.

    Args:
        identity: the routing identity (``"pm0.3"``).
        env: the proc's environment (:class:`~monarch_nb.runtime.protocol.ProcEnv`).
    """

    def __init__(self, identity: str, env: ProcEnv) -> None:
        self.identity = identity
        self.mesh_name, rank = identity.rsplit(".", 1)
        self.rank = int(rank)
        self.env = env
        self.extent = Extent(env.extent)
        self.channel = Channel(
            f"{identity}#{os.getpid()}", Signer(bytes.fromhex(env.key_hex)), self._on_message,
            shm_run_id=env.run_id or None, hub=CONTROLLER,
        )
        self.messenger = Messenger(self.channel)
        self.host = ActorHost(identity, self.mesh_name, self.rank, self.extent, self.channel.send, self.messenger,
                              self.send_to_controller, python=os.environ.get("MONARCH_NB_PYTHON", ""),
                              lead=self.channel.lead, wake=self.channel.wake, call_later=self.channel.call_later)
        self.messenger.local[identity] = self.host.dispatch  # an actor calling an actor of this proc
        self.identity_route = route_id(identity)
        self._heartbeat_fields: list[Callable[[], HeartbeatFields]] = []
        self._to_agent = HeartbeatSender(env.heartbeat_dir) if env.heartbeat_dir else None
        self._peer_failure_hooks: list[Callable[[PeerFailure], None]] = []
        #: peers of this proc's mesh that failed, in the order heard (``%%mesh`` cells name them)
        self.peer_failures: list[PeerFailure] = []
        self._handlers: dict[str, Handler] = {
            Kind.CALL: self.host.dispatch,
            Kind.SPAWN: self.host.dispatch,
            Kind.STOP_ACTORS: self.host.dispatch,
            Kind.SUPERVISE: self.host.dispatch,
            Kind.REPLY: self.messenger.on_reply,
            Kind.PORT: self.messenger.on_port,
            Kind.PROC_FAILED: self._on_proc_failed,
            Kind.RENDEZVOUS: self._on_rendezvous,
            Kind.PROC_RECOVERED: self._on_proc_recovered,
            Kind.INTERRUPT: self._on_interrupt,
            Kind.LOG_LEVEL: self._on_log_level,
            Kind.STOP: lambda header, body, buffers: self.stop(),
        }
        self._stopping = False
        self._exit = threading.Event()
        _set_default(Context(Instance(
            "proc", identity, self.extent.point(self.rank) if len(self.extent) else _ROOT_POINT, None, None,
            self.mesh_name, self.rank, self.extent, f"<root>.<proc {identity}>", self.host.python), _ROOT_POINT))
        backend.install(self)

    @property
    def actors(self) -> dict[str, ActorRunner]:
        """Actor id -> its runner (``name``, ``thread``, ``current``, ``instance``)."""
        return self.host.runners

    @property
    def call_hooks(self) -> tuple[CallHook, ...]:
        return self.host.call_hooks

    # -- plugins ---------------------------------------------------------------------------------
    def register(self, kind: Kind, handler: Handler) -> None:
        """Handle messages of ``kind`` with ``handler(header, body, buffers)`` on the IO thread
        (it must not block)."""
        self._handlers[kind] = handler

    def add_call_hook(self, hook: CallHook) -> None:
        """Run ``hook`` around every endpoint call (any thread; once per hook)."""
        if hook not in self.host.call_hooks:
            self.host.call_hooks = (*self.host.call_hooks, hook)

    def remove_call_hook(self, hook: CallHook) -> None:
        """Stop running ``hook`` around endpoint calls (any thread; a hook not added is ignored)."""
        self.host.call_hooks = tuple(h for h in self.host.call_hooks if h is not hook)

    def add_heartbeat_field(self, fields: Callable[[], HeartbeatFields]) -> None:
        """Merge ``fields()`` into every heartbeat (e.g. ``{"paused": [...]}``)."""
        self._heartbeat_fields.append(fields)

    def add_failure_hook(self, hook: Callable[[str, str, BaseException], None]) -> None:
        """Call ``hook(actor, endpoint, exc)`` on the actor's thread when an endpoint raises."""
        self.host.failure_hooks.append(hook)

    def add_peer_failure_hook(self, hook: Callable[["PeerFailure"], None]) -> None:
        """Call ``hook(failure)`` on the IO thread (it must not block) when a peer proc fails."""
        self._peer_failure_hooks.append(hook)

    def send_to_controller(self, header: Header, body: bytes = b"") -> None:
        """Send a message of a plugin's kind (e.g. ``fault_fired``) to the controller."""
        self.channel.send(CONTROLLER, header, body)

    # -- IO thread -------------------------------------------------------------------------------
    def _on_message(self, header: Header, body: memoryview, buffers: list[memoryview], frames: list[Any]) -> None:
        handler = self._handlers.get(header["kind"])
        if handler is None:
            log.warning("unknown message kind %r from %s", header["kind"], header["src"])
            return
        handler(header, body, buffers)

    def _on_proc_failed(self, header: ProcsFailedHeader, body: Any, buffers: list[memoryview]) -> None:
        now = time.monotonic()
        for failed in FailedProc.decode(body):
            failure = PeerFailure(failed.identity, failed.rank, failed.cause, failed.detail, failed.signal, now)
            self.messenger.proc_failed(failure.identity, SupervisionError(failure.rank, failure.cause, failure.detail, failure.signal))
            if failure.identity.rsplit(".", 1)[0] != self.mesh_name:
                continue  # a proc of another mesh: not a peer of this one's process groups
            self.peer_failures.append(failure)
            for hook in self._peer_failure_hooks:
                try:
                    hook(failure)
                except Exception:
                    log.exception("a peer-failure hook failed")

    def _on_proc_recovered(self, header: PeerHeader, body: Any, buffers: list[memoryview]) -> None:
        self.messenger.proc_recovered(header["proc"])

    def _on_log_level(self, header: LogLevelHeader, body: Any, buffers: list[memoryview]) -> None:
        logging.getLogger().setLevel(int(header["level"]))

    def _on_rendezvous(self, header: RendezvousHeader, body: Any, buffers: list[memoryview]) -> None:
        """A new rendezvous round of this mesh: ``env://`` finds a fresh store from now on."""
        os.environ.update(MASTER_ADDR=str(header["addr"]), MASTER_PORT=str(header["port"]),
                          TORCHELASTIC_RESTART_COUNT=str(header["round"]))

    def _on_interrupt(self, header: InterruptHeader, body: Any, buffers: list[memoryview]) -> None:
        runner = self.actors.get(header.get("actor", ""))
        if runner is not None:
            runner.interrupt()

    def heartbeat(self) -> None:
        """Send a heartbeat now (any thread): what runs, plus the plugins' fields."""
        now = time.monotonic()
        busy = {name: [r.current[0], round(now - r.current[1], 3)] for name, r in list(self.actors.items()) if r.current}
        beat: HeartbeatFields = {"busy": busy}
        for fields in self._heartbeat_fields:
            beat.update(fields())
        loading = import_grace.loading()  # a heavy import may hold the GIL for seconds: not a hang
        if loading:
            beat["loading"] = loading
        if self._to_agent is not None:  # summarized in the host agent's heartbeat (see heartbeat_relay)
            if time.monotonic() >= self.channel.muted_until:  # a partition fault cuts this path too
                self._to_agent.send(beat)
            return
        hb: HeartbeatHeader = {"kind": Kind.HEARTBEAT, **beat}
        self.channel.send(CONTROLLER, hb)

    # -- any thread ------------------------------------------------------------------------------
    def reply(self, header: CallHeader, ok: bool, value: Any) -> None:
        """Answer the request ``header`` (a plugin's request, or a call)."""
        self.host.reply(header, ok, value)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        threading.Thread(target=self._graceful_exit, name="stopper", daemon=True).start()

    def _graceful_exit(self) -> None:
        self.host.stop_all()
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit.set()
        self.channel.close()  # the main thread's IO loop returns: main() returns, the interpreter finalizes

    # -- the actor API's backend, inside a worker ------------------------------------------------
    def send(self, targets: Sequence[Target], actor: str, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any], *,
             extent: Extent | None, want_reply: bool = True, **how: Any) -> Any:
        return self.messenger.send(targets, actor, endpoint, args, kwargs, extent=extent, want_reply=want_reply, **how)

    def failure_of(self, proc: str) -> SupervisionError | None:
        return self.messenger.failure_of(proc)

    def mesh_stopped(self, mesh: str) -> bool:
        return False

    def _ask(self, op: str, payload: Any) -> Any:
        """Ask the controller to do ``op``; the calling actor is the owner of what it makes."""
        inst = current_context().actor_instance
        owner = [self.identity_route, inst.mesh_id] if inst.class_name else None
        return self.messenger.control(CONTROLLER, op, {"owner": owner, "creator": inst, **payload})

    def spawn_procs(self, hosts: list[str], extent: Extent, name: str | None, python: str = "", *, spares: int = 0,
                    preload: Sequence[str] = ()) -> str:
        return self._ask("spawn_procs", {"hosts": hosts, "extent": extent, "name": name, "python": python,
                                         "spares": spares, "preload": list(preload)}).get()

    def spawn_actors(self, mesh: str, ranks: list[int], name: str, cls: type, args: tuple, kwargs: dict,
                     spawn_extent: Extent) -> str:
        return self._ask("spawn_actors", {"mesh": mesh, "ranks": ranks, "name": name, "cls": cls, "args": args,
                                          "kwargs": kwargs, "spawn_extent": spawn_extent}).get()

    def actor_initialized(self, actor_id: str) -> Future:
        return self._ask("initialized", {"actor": actor_id})

    def stop_actors(self, actor_id: str) -> None:
        self._ask("stop_actors", {"actor": actor_id}).get()

    def attach_hosts(self, workers: list[str], ca: str | None) -> list[str]:
        return self._controller_only("attaching hosts")

    def detach_hosts(self, names: list[str]) -> None:
        self._controller_only("detaching hosts")

    def sync_workspace(self, path: Any, **how: Any) -> Any:
        return self._controller_only("syncing a workspace (its folder is the controller's)")

    def stop_procs(self, mesh: str) -> None:
        self._ask("stop_procs", {"mesh": mesh}).get()

    def get_or_spawn_controller(self, name: str, cls: type, args: tuple, kwargs: dict) -> Future:
        return self._ask("get_or_spawn_controller", {"name": name, "cls": cls, "args": args, "kwargs": kwargs})

    def set_log_level(self, mesh: str, level: int) -> None:
        self._ask("set_log_level", {"mesh": mesh, "level": level}).get()

    def open_port(self, receiver: Any) -> tuple[str, str]:
        return self.messenger.open_port(receiver)

    def send_to_port(self, owner: str, port_id: str, ok: bool, value: Any, rank: int | None) -> None:
        self.messenger.send_to_port(owner, port_id, ok, value, rank)

    def _controller_only(self, what: str) -> Any:
        raise RuntimeError(f"{what} from inside a worker is not supported; do it from the controller")

    def restart_proc(self, mesh: str, rank: int, timeout_s: float) -> None:
        self._controller_only("restarting procs")

    def supervise(self, mesh: str, policy: Any) -> Any:
        return self._controller_only("supervising meshes")

    def tree(self, mesh: str | None, ranks: Any) -> dict:
        return self._controller_only("reading the supervision tree")

    def inject(self, mesh: str, rank: int, kind: str, params: dict) -> Any:
        return self._controller_only("injecting faults")

    def interrupt(self, mesh: str, rank: int, actor: str) -> None:
        self._controller_only("interrupting actors")

    def shutdown(self) -> None:
        self.stop()

    # -- main --------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Connect, say hello and run the IO loop until stopped."""
        trust = None
        if self.env.curve_dir:
            trust = load_trust(self.env.curve_dir).with_key(bytes.fromhex(self.env.key_hex))
        self.channel.connect(self.env.controller, trust)
        self.channel.every(self.env.heartbeat_interval_s, self.heartbeat)
        hello: HelloHeader = {"kind": Kind.HELLO, "pid": os.getpid()}
        inbox = False
        if self.env.agent_link.startswith("ipc://"):  # peers of this host send it their messages straight
            peers = LocalPeers(os.path.dirname(self.env.agent_link[len("ipc://"):]), self.identity_route)
            inbox = peers.open()  # bound before the link: a peer told of it may send at once
            self.channel.add_local_peers(peers)
        link = link_to_agent(self.env.agent_link, self.identity_route, inbox=inbox) if self.env.agent_link else None
        if link is not None:  # the controller's messages come through the host agent (see proc_link)
            self.channel.add_link(link)
            hello["linked"] = True
        self.channel.send(CONTROLLER, hello)
        self.channel.run_forever()


_current: "Proc | None" = None


def current() -> "Proc | None":
    """The running worker proc, or None outside a worker (on the controller)."""
    return _current


def main(identity: str, plugins: Sequence[Plugin] = ()) -> None:
    """Run this process as proc ``identity``, with ``plugins`` installed before it serves."""
    env = ProcEnv.from_env(os.environ)
    die_with_parent(env.agent_pid)
    sys.path[:0] = [p for p in env.sys_path if p not in sys.path]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("monarch_nb").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are delivered per actor thread, not by SIGINT
    global _current
    proc = _current = Proc(identity, env)
    for install in plugins:
        install(proc)
    import_grace.install(proc.heartbeat, env.import_lock_dir, env.import_slots)
    install_log_prefix()
    proc.serve()
    # stopped: return, so the interpreter finalizes normally (module finalizers run)
