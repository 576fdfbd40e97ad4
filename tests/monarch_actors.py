"""Actor classes for tests/test_monarch_api.py, written against ``monarch_nb.actor`` only (the
import a Monarch user changes); importable by workers, which share the controller's sys.path."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

from monarch_nb.actor import (
    Actor, MeshFailure, Port, ProcMesh, concurrent_endpoint, context, current_actor_name, current_rank, endpoint,
    get_or_spawn_controller, this_host, this_proc,
)

from . import actors


class Counter(actors.Counter):
    """tests.actors.Counter, with what these tests ask of it."""

    @endpoint
    def get(self) -> int:
        return self.value

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    def actor_name(self) -> str:
        return current_actor_name()

    @endpoint
    def instance_id(self) -> int:
        return id(self)


class Sender(Actor):
    """Sends values into ports it is given."""

    @endpoint
    def send_range(self, port: Port, n: int) -> None:
        tag = context().actor_instance.rank.rank
        for i in range(n):
            port.send((tag, i))

    @endpoint
    def send_from_threads(self, port: Port, threads: int, n: int) -> None:
        def run(t: int) -> None:
            for i in range(n):
                port.send((t, i))

        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    @endpoint
    def send_twice(self, port: Port) -> str:
        port.send(1)
        try:
            port.send(2)
        except ValueError as exc:
            return str(exc)
        return "no error"

    @endpoint
    def hold_then_die(self, port: Port, release: str) -> None:
        port.send("before")
        # os._exit does not wait for queued messages to leave: die once the client got "before"
        # (it creates ``release`` then), not after a guessed delay
        deadline = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(9)

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Ported(Actor):
    @endpoint(explicit_response_port=True)
    def add(self, port: Port, b: int) -> None:
        port.send(3 + b)


class Odd(Actor):
    """A constructor whose parameters are named like spawn's own."""

    def __init__(self, name: str, cls: str = "", rank: int = 0):
        self.args = (name, cls, rank)

    @endpoint
    def args_seen(self) -> tuple:
        return self.args


class BadOnRank(Actor):
    """Its constructor raises on the ranks listed; the others write a file when cleaned up."""

    def __init__(self, bad_ranks: list, marker_dir: str):
        self.marker_dir = marker_dir
        if current_rank().rank in bad_ranks:
            raise ValueError(f"no good on rank {current_rank().rank}")

    @endpoint
    def ok(self) -> str:
        return "ok"

    def __cleanup__(self, exc):
        with open(os.path.join(self.marker_dir, f"cleanup-{current_rank().rank}"), "w") as f:
            f.write("cleaned")


class HeldCleanup(Actor):
    """Its ``__cleanup__`` writes ``cleaning-<rank>``, then holds until ``release`` exists (30 s
    at most): a stop that is under way, for as long as the test needs."""

    def __init__(self, marker_dir: str):
        self.marker_dir = marker_dir

    @endpoint
    def ok(self) -> str:
        return "ok"

    def __cleanup__(self, exc):
        _hold_in_cleanup(self.marker_dir)


class AsyncHeldCleanup(Actor):
    """HeldCleanup with ``async`` endpoints (an actor on an asyncio loop)."""

    def __init__(self, marker_dir: str):
        self.marker_dir = marker_dir

    @endpoint
    async def ok(self) -> str:
        return "ok"

    async def __cleanup__(self, exc):
        await asyncio.to_thread(_hold_in_cleanup, self.marker_dir)


def _hold_in_cleanup(marker_dir: str) -> None:
    with open(os.path.join(marker_dir, f"cleaning-{current_rank().rank}"), "w") as f:
        f.write("cleaning")
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(marker_dir, "release")) and time.monotonic() < deadline:
        time.sleep(0.01)


class SelfCaller(Actor):
    """Calls the mesh it is given (its own, or a slice of it) and waits for the reply."""

    @endpoint
    def ok(self) -> str:
        return "ok"

    @endpoint
    def wait_for(self, mesh) -> list:
        return list(mesh.ok.call().get(timeout=60).values())


class AsyncSelfCaller(Actor):
    """SelfCaller with async endpoints: ``await`` in a plain endpoint and in a concurrent one."""

    @endpoint
    async def ok(self) -> str:
        return "ok"

    @endpoint
    async def wait_for(self, mesh) -> list:
        return list((await mesh.ok.call()).values())

    @concurrent_endpoint
    async def wait_concurrently(self, mesh) -> list:
        return list((await mesh.ok.call()).values())


class Fixed(Actor):
    def __init__(self, bad_ranks: list, marker_dir: str):
        pass

    @endpoint
    def ok(self) -> str:
        return "fixed"


class Raiser(Actor):
    @endpoint
    def boom(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    def chained(self) -> None:
        try:
            raise KeyError("inner")
        except KeyError:
            raise RuntimeError("outer")  # noqa: B904 - the implicit chain is what is tested

    @endpoint
    def unprintable(self, kind: str) -> None:
        class BadStr(Exception):
            def __str__(self):
                raise RuntimeError("str failed")

        class BadRepr(Exception):
            def __repr__(self):
                raise RuntimeError("repr failed")

        class Unpicklable(Exception):
            def __init__(self):
                super().__init__("holds a lock")
                self.lock = threading.Lock()

        if kind == "str":
            raise BadStr()
        if kind == "repr":
            raise BadRepr("fine message")
        if kind == "unpicklable":
            raise Unpicklable()
        try:
            raise BadStr()
        except BadStr as cause:
            raise ValueError("has a bad cause") from cause

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def fatal(self) -> None:
        raise SystemExit("a BaseException fails the actor")

    @endpoint
    def slow(self, seconds: float) -> float:
        threading.Event().wait(seconds)
        return seconds


class AsyncWorker(Actor):
    def __init__(self):
        self.ticks = 0
        self.gate = asyncio.Event()

    @endpoint
    async def start_ticking(self) -> None:
        async def tick():
            while True:
                self.ticks += 1
                await asyncio.sleep(0.01)

        self.task = asyncio.create_task(tick())

    @endpoint
    async def ticks_now(self) -> int:
        return self.ticks

    @concurrent_endpoint
    async def wait_gate(self) -> str:
        await self.gate.wait()
        return "opened"

    @endpoint
    async def open_gate(self) -> str:
        self.gate.set()
        return "opening"


class Owner(Actor):
    """Spawns a child mesh on a proc mesh it is given, and procs of its own; records failures."""

    def __init__(self, procs: ProcMesh, handle: bool = True):
        self.child = procs.spawn("child", Raiser)
        self.own_procs = this_host().spawn_procs(per_host={"gpus": 1})
        self.own_child = self.own_procs.spawn("own_child", Counter)
        self.failures: list[str] = []
        self.handle = handle
        self.seen = asyncio.Event()

    @endpoint
    async def break_child(self) -> None:
        await self.child.ping.call()
        self.child.boom.broadcast("child broke")
        await asyncio.wait_for(self.seen.wait(), timeout=30)

    @endpoint
    async def failures_seen(self) -> list:
        return self.failures

    @endpoint
    async def child_pids(self) -> list:
        return list((await self.own_child.pid.call()).values())

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.failures.append(str(failure))
        self.seen.set()
        return self.handle


class ControllerUser(Actor):
    @endpoint
    def singleton_id(self, name: str) -> int:
        return get_or_spawn_controller(name, Counter).get().instance_id.call_one().get()

    @endpoint
    def spawn_here(self) -> int:
        return this_proc().spawn("here", Counter).pid.call_one().get()


class Logs(Actor):
    @endpoint
    def log_to(self, path: str) -> None:
        logger = logging.getLogger("tests.monarch_actors")
        handler = logging.FileHandler(path)
        logger.addHandler(handler)
        logger.warning("hello from an actor")
        logger.warning("")
        handler.flush()
        logger.removeHandler(handler)
        handler.close()


class Finalized(Actor):
    """Keeps a module-level object whose finalizer writes a file (interpreter finalization)."""

    def __init__(self, path: str):
        global _KEEP
        _KEEP = _WritesOnDel(path)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    def __cleanup__(self, exc):
        sys.stdout.write("cleanup ran\n")


class _WritesOnDel:
    def __init__(self, path: str):
        self.file = open(path, "w")

    def __del__(self):
        self.file.write("finalized")
        self.file.close()


_KEEP = None
