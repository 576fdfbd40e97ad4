"""Actor classes the tests spawn (importable by workers, which share the controller's sys.path)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading

from monarch_nb import Actor, context, current_rank, current_size, endpoint


class Counter(Actor):
    def __init__(self, start: int = 0):
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    def get_value(self) -> int:
        return self.value

    @endpoint
    def whoami(self) -> dict:
        point = current_rank()  # the message's rank: this actor's place in the slice called
        fixed = context().actor_instance.rank  # its place in the mesh it was spawned on
        return {"rank": point.rank, "coords": dict(point), "size": current_size(), "pid": os.getpid(),
                "mesh_rank": fixed.rank, "mesh_coords": dict(fixed),
                "env_rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"])}



class AsyncCounter(Actor):
    """The same with async endpoints (an actor's endpoints are all sync or all async)."""

    def __init__(self, start: int = 0):
        self.value = start

    @endpoint
    async def incr(self, by: int = 1) -> int:
        await asyncio.sleep(0.001)
        self.value += by
        return self.value


class Worker(Actor):
    @endpoint
    def echo(self, value):
        return value

    @endpoint
    def fail(self, message: str):
        local_marker = 42  # noqa: F841 - read by post-mortem tests
        raise ValueError(message)

    @endpoint
    def sleep(self, seconds: float) -> float:
        threading.Event().wait(seconds)
        return seconds

    @endpoint
    def block(self, started: str, seconds: float) -> float:
        """Hold this actor's thread ``seconds``, having created the file ``started`` first."""
        with open(started, "w"):
            pass
        threading.Event().wait(seconds)
        return seconds

    @endpoint
    def unpicklable_result(self):
        return threading.Lock()

    @endpoint
    def write_output(self, lines: int) -> int:
        rank = current_rank().rank
        log = logging.getLogger("tests.worker")
        for i in range(lines):
            print(f"print rank={rank} i={i}")
            log.warning("logging rank=%d i=%d", rank, i)
            os.write(1, f"fd rank={rank} i={i}\n".encode())
        sys.stdout.flush()
        return lines

    @endpoint
    def print_then_die(self, text: str) -> None:
        print(text, flush=True)
        os.write(2, b"last words on stderr\n")
        os._exit(3)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def add_sys_path(self, path: str) -> None:
        sys.path.insert(0, path)

    @endpoint
    def import_module(self, name: str) -> str:
        import importlib

        return importlib.import_module(name).__name__


class Caller(Actor):
    """Calls another actor mesh from inside an endpoint, blocking on .get()."""

    def __init__(self, peers):
        self.peers = peers

    @endpoint
    def sum_of_peers(self) -> int:
        return sum(self.peers.incr.call(by=0).get().values())

    @endpoint
    def call_peer_of_same_rank(self) -> int:
        return self.peers.slice(**context().actor_instance.rank).incr.call_one(by=1).get()


class WorkshopWorker(Actor):
    """The workshop notebook's Worker: ``work(x)`` is ``x * (rank + 1)``."""

    def __init__(self):
        self.rank = current_rank().rank  # its rank in the mesh (in an endpoint: the rank of the call)

    @endpoint
    def work(self, x: int) -> int:
        return x * (self.rank + 1)


class Whereabouts(Actor):
    """Says what a proc was started with: parent, session, environment, modules, a random draw."""

    @endpoint
    def where(self) -> dict:
        import numpy
        import random

        from monarch_nb.config import config

        print(f"rank {os.environ['RANK']} says hello", flush=True)
        return {"pid": os.getpid(), "ppid": os.getppid(), "own_session": os.getsid(0) == os.getpid(),
                "rank": int(os.environ["RANK"]), "marker": os.environ.get("MONARCH_NB_TEST_MARKER"),
                "hang_timeout_s": config.hang_timeout_s, "cwd": os.getcwd(),
                "preloaded": sorted(m for m in ("json.tool", "forkserver_probe") if m in sys.modules),
                "numpy_draw": float(numpy.random.random()), "random_draw": random.random()}
