"""Worker process main: hosts actors, runs their endpoints, sends heartbeats.

Started by a host agent as ``python -m monarch_nb.runtime.proc <identity>``. The main thread
runs the IO loop (the only user of the ZeroMQ socket; it also sends heartbeats, so a busy actor
does not look hung, while a GIL-holding C call or SIGSTOP does). Each actor gets its own thread
and mailbox, so an endpoint may block on another actor's reply (``.get()`` inside an endpoint),
even one living in the same proc, without deadlock. Messages from one sender to one actor are run
in order.

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
from typing import Any

from ..actor import context as actor_context
from ..actor.endpoint import endpoints_of
from ..actor.shape import Extent
from ..debug.agent import DebugAgent
from ..errors import UnknownEndpointError, capture_traceback
from ..transport.channel import Channel
from ..transport.serialization import SerializationError, dumps, loads
from ..transport.wire import Signer
from . import import_grace
from . import messenger as messenger_mod
from .messenger import Messenger

log = logging.getLogger("monarch_nb.proc")

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    """Ask Linux to SIGKILL us when our parent exits; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the host agent's orphan check still covers us
        pass
    if os.getppid() != expected_parent:
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
            value = self._spawn(header, body, buffers) if header["kind"] == "spawn" else self._call(header, body, buffers)
            ok = True
        except BaseException as exc:  # report everything, KeyboardInterrupt from an interrupt included
            ok, value = False, capture_traceback(exc)
            self.proc.debug.record_failure(self.name, endpoint, exc)  # post-mortem
            self.proc.report_actor_error(self.name, endpoint, value)
        finally:
            self.current = None
        if "cid" in header:
            self.proc.reply(header, ok, value)

    def _spawn(self, header: dict, body: Any, buffers: list) -> None:
        cls, args, kwargs, extent, ranks = loads(body, buffers)
        point = extent.point(ranks.index(self.proc.rank))
        actor_context._set(
            actor_context.ActorContext(self.name, point, self.proc.mesh_name, self.proc.rank, os.getpid())
        )
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
        self.proc.faults.before_call(self.name, endpoint)
        result = prop.fn(self.instance, *args, **kwargs)
        if inspect.isawaitable(result):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            result = self._loop.run_until_complete(result)
        return self.proc.faults.after_call(result, self.name, endpoint)

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


class ProcFaults:
    """Faults that act inside the proc's own code path: raise, slow, nan, partition, stall.

    kill / segfault / hang are signals sent by the host agent; exit is ``os._exit`` here.
    """

    def __init__(self, proc: "Proc"):
        self.proc = proc
        self.raise_next = 0
        self.slow_ms = 0.0
        self.slow_reported = True
        self.nan_next = 0

    def fired(self, kind: str, detail: str) -> None:
        """Tell the controller an injected fault took effect (a ``fault_fired`` event)."""
        self.proc.channel.send("ctrl", {"kind": "fault_fired", "fault": kind, "detail": detail})

    def apply(self, kind: str, params: dict) -> None:
        if kind == "raise":
            self.raise_next += 1
        elif kind == "slow":
            self.slow_ms = float(params.get("ms", 100.0))
            self.slow_reported = False
        elif kind == "nan":
            self.nan_next += 1
        elif kind == "partition":
            self.proc.channel.muted_until = time.monotonic() + float(params.get("seconds", 5.0))
        elif kind == "stall":
            _hold_gil(float(params.get("seconds", 5.0)))
        elif kind == "exit":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(params.get("code", 1)))
        elif kind == "segfault":
            ctypes.string_at(0)
        elif kind == "heal":
            self.raise_next = self.nan_next = 0
            self.slow_ms = 0.0

    def before_call(self, actor: str, endpoint: str) -> None:
        if self.slow_ms:
            if not self.slow_reported:
                self.slow_reported = True
                self.fired("slow", f"{actor}.{endpoint} delayed by {self.slow_ms:g} ms")
            time.sleep(self.slow_ms / 1000.0)
        if self.raise_next:
            self.raise_next -= 1
            raise RuntimeError(f"injected fault: raise (rank {self.proc.rank}, {actor}.{endpoint})")

    def after_call(self, result: Any, actor: str = "", endpoint: str = "") -> Any:
        if self.nan_next and _is_tensor(result):
            self.nan_next -= 1
            result = result.clone()
            result.view(-1)[0] = float("nan")
            self.fired("nan", f"{actor}.{endpoint} result poisoned with NaN")
        return result

    def take_nan(self) -> bool:
        """True once per injected nan fault: training code poisons its next gradient."""
        if self.nan_next:
            self.nan_next -= 1
            self.fired("nan", "gradient poisoned with NaN")
            return True
        return False


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0


def _hold_gil(seconds: float) -> None:
    """Sleep in C *without* releasing the GIL: every thread of this proc stalls (a stuck C call)."""
    libc = ctypes.PyDLL(None)  # PyDLL: calls keep the GIL
    libc.usleep(ctypes.c_uint(int(min(seconds, 4000.0) * 1e6)))


class Proc:
    """The worker process: its channel, messenger, actors and faults."""

    def __init__(self, identity: str):
        self.identity = identity
        self.mesh_name, rank = identity.rsplit(".", 1)
        self.rank = int(rank)
        key = bytes.fromhex(os.environ.pop("MONARCH_NB_KEY"))
        self.controller_address = os.environ["MONARCH_NB_CONTROLLER"]
        self.heartbeat_interval_s = float(os.environ.get("MONARCH_NB_HEARTBEAT_INTERVAL_S", "0.25"))
        self.extent = Extent(json.loads(os.environ.get("MONARCH_NB_EXTENT", "{}")))
        self.channel = Channel(
            f"{identity}#{os.getpid()}", Signer(key), self._on_message, shm_run_id=os.environ.get("MONARCH_NB_RUN_ID") or None
        )
        self.messenger = Messenger(self.channel)
        messenger_mod.install(self.messenger)
        self.actors: dict[str, ActorRunner] = {}
        self.faults = ProcFaults(self)
        self.debug = DebugAgent(self, notify=self._heartbeat)  # failures, pdb sessions, stacks
        self._stopping = False

    # -- IO thread -------------------------------------------------------------------------------
    def _on_message(self, header: dict, body: Any, buffers: list, frames: list) -> None:
        kind = header["kind"]
        if kind == "call":
            runner = self.actors.get(header["actor"])
            if runner is None:
                self.reply(header, False, _error_info(LookupError(f"no actor {header['actor']!r} on proc {self.identity}")))
            else:
                runner.mailbox.put((header, body, buffers))
        elif kind == "reply":
            self.messenger.on_reply(header, body, buffers)
        elif kind == "spawn":
            name = header["actor"]
            if name in self.actors:
                self.reply(header, False, _error_info(ValueError(f"an actor named {name!r} already lives on {self.identity}")))
                return
            runner = self.actors[name] = ActorRunner(self, name)
            runner.mailbox.put((header, body, buffers))
        elif kind == "proc_failed":
            from ..errors import SupervisionError

            info = json.loads(bytes(body)) if body else {}
            self.messenger.proc_failed(header["proc"], SupervisionError(info.get("rank", -1), info.get("cause", "failed"), info.get("detail", ""), info.get("signal")))
        elif kind == "proc_recovered":
            self.messenger.proc_recovered(header["proc"])
        elif kind == "fault":
            self.faults.apply(header["fault"], header.get("params", {}))
        elif kind == "interrupt":
            runner = self.actors.get(header.get("actor", ""))
            if runner is not None:
                runner.interrupt()
        elif kind == "debug":
            self.debug.on_message(header, body, buffers)
        elif kind == "stop":
            self.stop()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        busy = {name: [r.current[0], round(now - r.current[1], 3)] for name, r in list(self.actors.items()) if r.current}
        hb = {"kind": "hb", "busy": busy}
        paused = self.debug.paused()  # breakpoint sessions: paused, not hung
        if paused:
            hb["paused"] = paused
        loading = import_grace.loading()  # a heavy import may hold the GIL for seconds: not a hang
        if loading:
            hb["loading"] = loading
        self.channel.send("ctrl", hb)

    # -- any thread ------------------------------------------------------------------------------
    def reply(self, header: dict, ok: bool, value: Any) -> None:
        try:
            body, buffers = dumps(value)
        except SerializationError as exc:
            ok, (body, buffers) = False, dumps(_error_info(exc, f"the result of {header.get('ep')} cannot be pickled"))
        self.channel.send(
            header["reply_to"], {"kind": "reply", "cid": header["cid"], "idx": header["idx"], "ok": ok}, body, buffers
        )

    def report_actor_error(self, actor: str, endpoint: str, info: dict) -> None:
        detail = f"{actor}.{endpoint}: {info.get('type')}: {info.get('message')}"
        self.channel.send("ctrl", {"kind": "actor_error", "actor": actor, "ep": endpoint, "detail": detail})

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

    def main(self) -> None:
        self.channel.connect(self.controller_address)
        self.channel.every(self.heartbeat_interval_s, self._heartbeat)
        self.channel.send("ctrl", {"kind": "hello", "pid": os.getpid()})
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


def main() -> None:
    identity = sys.argv[1]
    die_with_parent(int(os.environ["MONARCH_NB_AGENT_PID"]))
    sys.path[:0] = [p for p in json.loads(os.environ.get("MONARCH_NB_SYS_PATH", "[]")) if p not in sys.path]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("monarch_nb").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are delivered per actor thread, not by SIGINT
    global _current
    proc = _current = Proc(identity)
    import_grace.install(proc._heartbeat)
    proc.main()


if __name__ == "__main__":
    # run as `python -m`, this module is __main__; alias it so `import monarch_nb.runtime.proc`
    # elsewhere in the worker (faults.take_nan, current()) finds this very module, not a second copy
    sys.modules.setdefault("monarch_nb.runtime.proc", sys.modules[__name__])
    main()
