"""The worker core: hosts actors, runs their endpoints, sends heartbeats. Runs inside each proc.

A proc is started by its host agent as ``python -m monarch_nb.proc_main <identity>``, which
builds a :class:`Proc` and installs the features' worker plugins (faults, debugger) before it
serves. The core knows no feature: a plugin registers a handler for its message kind
(:meth:`Proc.register`), hooks around endpoint calls (:meth:`Proc.add_call_hook`), fields of the
heartbeat (:meth:`Proc.add_heartbeat_field`) and observers of endpoint failures
(:meth:`Proc.add_failure_hook`).

The main thread runs the IO loop (the only user of the ZeroMQ socket; it also sends heartbeats,
so a busy actor does not look hung, while a GIL-holding C call or SIGSTOP does). Each actor gets
its own thread and mailbox, so an endpoint may block on another actor's reply (``.get()`` inside
an endpoint), even one living in the same proc, without deadlock. Messages from one sender to
one actor are run in order.

The proc dies with its host agent (PR_SET_PDEATHSIG) and exits when told to stop.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from ..actor import backend
from ..actor import context as actor_context
from ..actor.backend import Target
from ..actor.endpoint import endpoints_of
from ..actor.future import Future
from ..actor.shape import Extent
from ..errors import SupervisionError, UnknownEndpointError, capture_traceback
from ..transport.channel import Channel
from ..transport.keys import load_trust
from ..transport.serialization import SerializationError, dumps, loads
from ..transport.wire import Signer
from . import import_grace
from .messenger import Messenger
from .protocol import CONTROLLER, Kind, ProcEnv

__all__ = ["Proc", "CallHook", "Plugin", "current", "main"]

log = logging.getLogger("monarch_nb.proc")

PR_SET_PDEATHSIG = 1

Handler = Callable[[dict, Any, list], None]


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


class ActorRunner:
    """One actor: its instance, its mailbox and the thread that runs its endpoints in order."""

    def __init__(self, proc: "Proc", name: str):
        self.proc = proc
        self.name = name
        self.instance: Any = None
        self.endpoints: dict = {}
        self.mailbox: queue.SimpleQueue = queue.SimpleQueue()
        self.current: tuple[str, float] | None = None  # (endpoint, monotonic start)
        self.thread = threading.Thread(target=self._run, name=f"actor-{name}", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.mailbox.get()
            if item is None:
                break
            header, body, buffers = item
            self._handle(header, body, buffers)
        cleanup = getattr(self.instance, "__cleanup__", None)
        if cleanup is not None:
            try:
                cleanup(None)
            except Exception:
                log.exception("%s.__cleanup__ raised", self.name)

    def _handle(self, header: dict, body: Any, buffers: list) -> None:
        endpoint = header.get("ep", "__init__")
        self.current = (endpoint, time.monotonic())
        try:
            value = self._spawn(body, buffers) if header["kind"] == Kind.SPAWN else self._call(header, body, buffers)
            ok = True
        except BaseException as exc:  # report everything, KeyboardInterrupt from an interrupt included
            ok, value = False, capture_traceback(exc)
            self.proc.endpoint_failed(self.name, endpoint, exc, value)
        finally:
            self.current = None
        if "cid" in header:
            self.proc.reply(header, ok, value)

    def _spawn(self, body: Any, buffers: list) -> None:
        cls, args, kwargs, extent, ranks = loads(body, buffers)
        point = extent.point(ranks.index(self.proc.rank))
        actor_context._set(actor_context.ActorContext(
            self.name, point, self.proc.mesh_name, self.proc.rank, os.getpid(), proc_extent=self.proc.extent,
        ))
        self.endpoints = endpoints_of(cls)
        self.instance = cls(*args, **kwargs)

    def _call(self, header: dict, body: Any, buffers: list) -> Any:
        if self.instance is None:
            raise RuntimeError(f"actor {self.name!r} was not constructed (its constructor failed)")
        args, kwargs = loads(body, buffers)
        endpoint = header["ep"]
        prop = self.endpoints.get(endpoint)
        if prop is None:
            raise UnknownEndpointError(
                f"{type(self.instance).__name__} has no endpoint {endpoint!r}; its endpoints are {sorted(self.endpoints)}"
            )
        prop.check_arguments(type(self.instance).__name__, args, kwargs)
        for hook in self.proc.call_hooks:
            hook.before_call(self.name, endpoint)
        result = prop.fn(self.instance, *args, **kwargs)
        if inspect.isawaitable(result):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            result = self._loop.run_until_complete(result)
        for hook in self.proc.call_hooks:
            result = hook.after_call(result, self.name, endpoint)
        return result

    def stop(self) -> None:
        self.mailbox.put(None)

    def interrupt(self) -> None:
        """Interrupt the endpoint running now (IO thread): the actor's ``__interrupt__`` hook
        decides how (``%%mesh`` cells raise KeyboardInterrupt in their thread); no hook, no-op."""
        hook = getattr(self.instance, "__interrupt__", None)
        if hook is not None and self.current is not None:
            try:
                hook(self.thread.ident)
            except Exception:
                log.exception("%s.__interrupt__ raised", self.name)


class Proc:
    """The worker process: its channel, messenger, actors, and the plugins' handlers and hooks.

    It is the actor API's backend inside the worker: actors call other actors through it.

    Args:
        identity: the routing identity (``"pm0.3"``).
        env: the proc's environment (:class:`~monarch_nb.runtime.protocol.ProcEnv`).
    """

    def __init__(self, identity: str, env: ProcEnv):
        self.identity = identity
        self.mesh_name, rank = identity.rsplit(".", 1)
        self.rank = int(rank)
        self.env = env
        self.extent = Extent(env.extent)
        self.channel = Channel(
            f"{identity}#{os.getpid()}", Signer(bytes.fromhex(env.key_hex)), self._on_message,
            shm_run_id=env.run_id or None,
        )
        self.messenger = Messenger(self.channel)
        self.actors: dict[str, ActorRunner] = {}
        self.call_hooks: list[CallHook] = []
        self._heartbeat_fields: list[Callable[[], dict]] = []
        self._failure_hooks: list[Callable[[str, str, BaseException], None]] = []
        self._handlers: dict[str, Handler] = {
            Kind.CALL: self._on_call,
            Kind.REPLY: self.messenger.on_reply,
            Kind.SPAWN: self._on_spawn,
            Kind.PROC_FAILED: self._on_proc_failed,
            Kind.PROC_RECOVERED: lambda header, body, buffers: self.messenger.proc_recovered(header["proc"]),
            Kind.INTERRUPT: self._on_interrupt,
            Kind.STOP: lambda header, body, buffers: self.stop(),
        }
        self._stopping = False
        backend.install(self)

    # -- plugins ---------------------------------------------------------------------------------
    def register(self, kind: Kind, handler: Handler) -> None:
        """Handle messages of ``kind`` with ``handler(header, body, buffers)`` on the IO thread
        (it must not block)."""
        self._handlers[kind] = handler

    def add_call_hook(self, hook: CallHook) -> None:
        """Run ``hook`` around every endpoint call."""
        self.call_hooks.append(hook)

    def add_heartbeat_field(self, fields: Callable[[], dict]) -> None:
        """Merge ``fields()`` into every heartbeat (e.g. ``{"paused": [...]}``)."""
        self._heartbeat_fields.append(fields)

    def add_failure_hook(self, hook: Callable[[str, str, BaseException], None]) -> None:
        """Call ``hook(actor, endpoint, exc)`` on the actor's thread when an endpoint raises."""
        self._failure_hooks.append(hook)

    def send_to_controller(self, header: dict, body: bytes = b"") -> None:
        """Send a message of a plugin's kind (e.g. ``fault_fired``) to the controller."""
        self.channel.send(CONTROLLER, header, body)

    # -- IO thread -------------------------------------------------------------------------------
    def _on_message(self, header: dict, body: Any, buffers: list, frames: list) -> None:
        handler = self._handlers.get(header["kind"])
        if handler is None:
            log.warning("unknown message kind %r from %s", header["kind"], header["src"])
            return
        handler(header, body, buffers)

    def _on_call(self, header: dict, body: Any, buffers: list) -> None:
        runner = self.actors.get(header["actor"])
        if runner is None:
            self.reply(header, False, _error_info(LookupError(f"no actor {header['actor']!r} on proc {self.identity}")))
        else:
            runner.mailbox.put((header, body, buffers))

    def _on_spawn(self, header: dict, body: Any, buffers: list) -> None:
        name = header["actor"]
        if name in self.actors:
            self.reply(header, False, _error_info(ValueError(f"an actor named {name!r} already lives on {self.identity}")))
            return
        runner = self.actors[name] = ActorRunner(self, name)
        runner.mailbox.put((header, body, buffers))

    def _on_proc_failed(self, header: dict, body: Any, buffers: list) -> None:
        info = json.loads(bytes(body)) if body else {}
        error = SupervisionError(info.get("rank", -1), info.get("cause", "failed"), info.get("detail", ""), info.get("signal"))
        self.messenger.proc_failed(header["proc"], error)

    def _on_interrupt(self, header: dict, body: Any, buffers: list) -> None:
        runner = self.actors.get(header.get("actor", ""))
        if runner is not None:
            runner.interrupt()

    def heartbeat(self) -> None:
        """Send a heartbeat now (any thread): what runs, plus the plugins' fields."""
        now = time.monotonic()
        busy = {name: [r.current[0], round(now - r.current[1], 3)] for name, r in list(self.actors.items()) if r.current}
        hb: dict = {"kind": Kind.HEARTBEAT, "busy": busy}
        for fields in self._heartbeat_fields:
            hb.update(fields())
        loading = import_grace.loading()  # a heavy import may hold the GIL for seconds: not a hang
        if loading:
            hb["loading"] = loading
        self.channel.send(CONTROLLER, hb)

    # -- any thread ------------------------------------------------------------------------------
    def reply(self, header: dict, ok: bool, value: Any) -> None:
        try:
            body, buffers = dumps(value)
        except SerializationError as exc:
            ok, (body, buffers) = False, dumps(_error_info(exc, f"the result of {header.get('ep')} cannot be pickled"))
        self.channel.send(
            header["reply_to"], {"kind": Kind.REPLY, "cid": header["cid"], "idx": header["idx"], "ok": ok}, body, buffers
        )

    def endpoint_failed(self, actor: str, endpoint: str, exc: BaseException, info: dict) -> None:
        """An endpoint of ``actor`` raised ``exc`` (actor thread): tell the hooks and the controller."""
        for hook in self._failure_hooks:
            try:
                hook(actor, endpoint, exc)
            except Exception:
                log.exception("failure hook %r raised", hook)
        detail = f"{actor}.{endpoint}: {info.get('type')}: {info.get('message')}"
        self.channel.send(CONTROLLER, {"kind": Kind.ACTOR_ERROR, "actor": actor, "ep": endpoint, "detail": detail})

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        threading.Thread(target=self._graceful_exit, name="stopper", daemon=True).start()

    def _graceful_exit(self) -> None:
        for runner in self.actors.values():
            runner.stop()
        for runner in self.actors.values():
            runner.thread.join(timeout=2.0)
        sys.stdout.flush()
        sys.stderr.flush()
        self.channel.close()
        os._exit(0)

    # -- the actor API's backend, inside a worker ------------------------------------------------
    def send(self, targets: Sequence[Target], actor: str, endpoint: str, args: tuple, kwargs: dict, *,
             extent: Extent | None, want_reply: bool = True) -> Future | None:
        return self.messenger.send(targets, actor, endpoint, args, kwargs, extent=extent, want_reply=want_reply)

    def failure_of(self, proc: str) -> SupervisionError | None:
        return self.messenger.failure_of(proc)

    def mesh_stopped(self, mesh: str) -> bool:
        return False

    def _controller_only(self, what: str) -> Any:
        raise RuntimeError(f"{what} from inside a worker is not supported; do it from the controller")

    def spawn_procs(self, hosts: list[str], extent: Extent, name: str | None, *, spares: int = 0,
                    preload: Sequence[str] = ()) -> str:
        return self._controller_only("spawning procs")

    def spawn_actors(self, mesh: str, ranks: list[int], name: str, cls: type, args: tuple, kwargs: dict) -> None:
        self._controller_only("spawning actors")

    def attach_hosts(self, workers: list[str], ca: str | None) -> list[str]:
        return self._controller_only("attaching hosts")

    def stop_procs(self, mesh: str) -> None:
        self._controller_only("stopping procs")

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

    # -- main --------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Connect, say hello and run the IO loop until stopped."""
        trust = None
        if self.env.curve_dir:
            trust = load_trust(self.env.curve_dir).with_key(bytes.fromhex(self.env.key_hex))
        self.channel.connect(self.env.controller, trust)
        self.channel.every(self.env.heartbeat_interval_s, self.heartbeat)
        self.channel.send(CONTROLLER, {"kind": Kind.HELLO, "pid": os.getpid()})
        self.channel.run_forever()


def _error_info(exc: BaseException, message: str | None = None) -> dict:
    info = capture_traceback(exc)
    if message:
        info["message"] = f"{message}: {info['message']}"
    return info


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
    proc.serve()
