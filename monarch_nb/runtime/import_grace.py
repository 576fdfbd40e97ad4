"""Heavy imports in a worker announce themselves, so a GIL held by ``import torch`` is no hang.

Loading libtorch (or numpy, scipy, ...) runs inside the import system with the GIL held: on a
busy 2-core machine ``import torch`` can keep every thread of a proc, the heartbeat sender too,
silent for longer than ``hang_timeout_s``, and the proc would be fenced as hung. A meta-path
finder wraps the loader of each known heavy top-level module: while it executes, the proc's
heartbeats carry ``loading: [names]`` (one is sent at once, from the importing thread), and the
controller then waits up to ``import_grace_s`` instead of ``hang_timeout_s``. A frozen proc
(SIGSTOP) is still found at once: its host agent reports it stopped.

Heavy imports also take one of the host's *import slots* (lock files in the host agent's
folder, one per core), so at most that many procs of a host import torch at once: 64 procs on 2
cores import in turn instead of thrashing for minutes. While a proc waits for a slot it holds no
GIL and keeps heartbeating.
"""

from __future__ import annotations

import fcntl
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from typing import Any, Callable

__all__ = ["HEAVY_MODULES", "install", "loading"]

#: Top-level modules whose first import may hold the GIL for seconds.
HEAVY_MODULES = frozenset({"torch", "numpy", "scipy", "sklearn", "pandas", "jax", "jaxlib", "tensorflow", "transformers"})

_active: dict[str, int] = {}
_lock = threading.Lock()
_slots: "ImportSlots | None" = None


class ImportSlots:
    """``count`` host-wide slots for heavy imports: lock files ``slot<i>`` in ``folder``."""

    def __init__(self, folder: str, count: int):
        self.paths = [os.path.join(folder, f"import-slot{i}") for i in range(max(1, count))]
        self._held: int | None = None

    def acquire(self) -> None:
        """Block (releasing the GIL: sleeps and flock) until a slot is free, then hold it."""
        while True:
            for path in self.paths:
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self._held = fd
                return
            time.sleep(0.02)

    def release(self) -> None:
        fd, self._held = self._held, None
        if fd is not None:
            os.close(fd)  # closing drops the lock


def loading() -> list[str]:
    """Names of heavy modules being imported right now."""
    with _lock:
        return sorted(_active)


class _GraceLoader(importlib.abc.Loader):
    def __init__(self, real: Any, name: str, notify: Callable[[], None]):
        self._real = real
        self._name = name
        self._notify = notify

    def create_module(self, spec: Any) -> Any:
        return self._real.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with _lock:
            first = not _active
        slots = _slots if first else None  # the outermost heavy import takes the slot
        if slots is not None:
            slots.acquire()
        with _lock:
            _active[self._name] = _active.get(self._name, 0) + 1
        self._notify()
        try:
            self._real.exec_module(module)
        finally:
            with _lock:
                _active[self._name] -= 1
                if not _active[self._name]:
                    del _active[self._name]
            if slots is not None:
                slots.release()

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._real, attr)


class _HeavyImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, notify: Callable[[], None]):
        self._notify = notify
        self._finding = threading.local()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in HEAVY_MODULES or getattr(self._finding, "on", False):
            return None
        self._finding.on = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            self._finding.on = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _GraceLoader(spec.loader, name, self._notify)
        return spec


def install(notify: Callable[[], None], slot_folder: str = "", slots: int = 0) -> None:
    """Watch heavy imports in this process; ``notify()`` is called (on the importing thread) as one
    starts. With ``slot_folder``, each heavy import first takes one of ``slots`` host-wide slots."""
    global _slots
    _slots = ImportSlots(slot_folder, slots) if slot_folder and slots else None
    sys.meta_path.insert(0, _HeavyImportFinder(notify))
