"""Snapshots of a trainer's state in shared memory, outside every trainer process. Runs in procs.

Every few steps one trainer per host copies its state stream (see :mod:`.trainer_state`) into a
file in ``/dev/shm`` — outside every trainer process, so it survives all of them — and a
background thread hashes it and publishes it while training goes on. When every replica is lost,
restarted trainers load the newest snapshot.

A snapshot file is ``MAGIC | payload bytes | header length | header bytes`` behind a fixed
64-byte prefix, where the header (pickled) holds the skeleton, the counters and the payload's
SHA-256. It is written to a temporary name and renamed over the published name only when
complete (the MAGIC is written last), so a writer SIGKILLed at any moment leaves the previous
snapshot in place and never a partial file under the published name; a reader checks the MAGIC,
the sizes and the SHA-256 anyway. File names follow the runtime's shared-memory pattern
(``monarch_nb-<run id>-<pid>-<n>``, see :mod:`monarch_nb.transport.shm`), so the controller's and
the host agent's clean-up remove them.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pickle
import struct
import threading
import time

from .trainer_stream import bytes_view, meta_digest

__all__ = ["SnapshotWriter", "read_snapshot", "snapshot_tmp_path"]

log = logging.getLogger(__name__)

MAGIC = b"MNBSNAP1"
_PREFIX = struct.Struct("<8sQQ")  # magic, payload bytes, header bytes
_PREFIX_BYTES = 64


def snapshot_tmp_path(path: str, pid: int | None = None) -> str:
    """The temporary name a writer with ``pid`` uses for published snapshot ``path``: the same
    name with the writer's pid, so it is the writer's shared-memory file as the runtime sees it."""
    folder, name = os.path.split(path)
    prefix, _pid, n = name.rsplit("-", 2)
    return os.path.join(folder, f"{prefix}-{os.getpid() if pid is None else pid}-{n}")


class SnapshotWriter:
    """Publishes a trainer's state to ``path`` every so often without stopping training.

    :meth:`capture` (on the training thread, at a step boundary) copies the stream into a
    temporary shared-memory file: that copy is the only pause. A background thread then hashes
    the file, appends the header, writes the MAGIC and renames it over ``path``. A capture due
    while the previous one is still being published is skipped.

    Args:
        path: the published name (``/dev/shm/monarch_nb-<run>-<pid>-<n>``).
        slots: names to publish to in turn instead (a sharded run's two per shard, see
            :func:`~.sharding.snapshot_slots`); the first is ``path``.
        wait: a capture due while the previous one is still being published waits for it
            instead of being skipped (a sharded run: every shard's writer snapshots the same steps).
        every: snapshot every this many steps; 0 chooses it so that a snapshot's cost (the pause
            plus the background CPU time) stays near ``budget`` of the training time.
        budget: the share of step time snapshots may cost when ``every`` is 0.
    """

    def __init__(self, path: str, every: int = 0, budget: float = 0.005, slots: list[str] | None = None,
                 wait: bool = False):
        self.path = path
        self.slots = list(slots) if slots else [path]
        self.wait = wait
        self.captures = 0
        self.every = every
        self.budget = budget
        self.next_at = 0
        self.published: list[dict] = []  # reported once each, then cleared by :meth:`take_published`
        self.count = 0
        self.skipped = 0
        self._busy = threading.Event()
        self._lock = threading.Lock()

    def due(self, next_step: int) -> bool:
        return next_step >= self.next_at

    def capture(self, tensors: list, skeleton: dict, meta: dict, step_ms: float | None,
                t_begin: float | None = None) -> None:
        """Copy the state (``next_step = meta["next_step"]``) and publish it in the background.

        Args:
            step_ms: the trainer's recent step time (for the automatic interval); None if unknown.
            t_begin: ``time.perf_counter()`` when the trainer began capturing (the pause's start).

        Raises:
            OSError: the temporary file cannot be created or written.
        """
        step = meta["next_step"]
        if self._busy.is_set() and self.wait:
            self.wait_idle(60.0)  # a sharded run's writers must all snapshot the same steps
        if self._busy.is_set():
            self.skipped += 1
            self.next_at = step + 1
            return
        self._busy.set()
        target = self.slots[self.captures % len(self.slots)]
        self.captures += 1
        self.next_at = step + max(1, self.every)  # provisional: the publication sets the real one
        t0 = time.perf_counter() if t_begin is None else t_begin
        tmp = snapshot_tmp_path(target)
        sizes = []
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError:
            self._busy.clear()
            raise
        try:
            offset = _PREFIX_BYTES
            for t in tensors:
                view = bytes_view(t)
                if view.nbytes:
                    os.pwrite(fd, memoryview(view), offset)
                offset += view.nbytes
                sizes.append(view.nbytes)
        except BaseException:
            os.close(fd)
            self._busy.clear()
            raise
        pause_ms = (time.perf_counter() - t0) * 1e3
        nbytes = offset - _PREFIX_BYTES
        threading.Thread(target=self._publish, args=(fd, tmp, target, nbytes, skeleton, meta, pause_ms, step_ms),
                         name="monarch_nb-snapshot", daemon=True).start()

    def _publish(self, fd: int, tmp: str, target: str, nbytes: int, skeleton: dict, meta: dict, pause_ms: float,
                 step_ms: float | None) -> None:
        cpu0 = time.thread_time()
        try:
            h = hashlib.sha256()
            if nbytes:
                with mmap.mmap(fd, _PREFIX_BYTES + nbytes, prot=mmap.PROT_READ) as mapped:
                    h.update(memoryview(mapped)[_PREFIX_BYTES:])
            h.update(meta_digest(meta))
            header = pickle.dumps({"skeleton": skeleton, "meta": meta, "nbytes": nbytes, "sha256": h.hexdigest(),
                                   "time": time.time()}, protocol=4)
            os.pwrite(fd, header, _PREFIX_BYTES + nbytes)
            os.pwrite(fd, _PREFIX.pack(MAGIC, nbytes, len(header)), 0)  # last: the file is complete
            os.close(fd)
            fd = -1
            os.replace(tmp, target)
            cpu_ms = (time.thread_time() - cpu0) * 1e3
            cost_ms = pause_ms + cpu_ms
            with self._lock:
                self.count += 1
                self.published.append({"step": meta["next_step"], "nbytes": nbytes, "pause_ms": round(pause_ms, 4),
                                       "cpu_ms": round(cpu_ms, 4), "path": target, "sha256": h.hexdigest()})
            if self.every > 0:
                self.next_at = meta["next_step"] + self.every
            elif step_ms is None:  # no step timed yet (the first snapshot): measure again soon
                self.next_at = meta["next_step"] + 4
            else:  # keep the cost near the budget: cost / (interval * step time) = budget
                interval = cost_ms / (self.budget * max(step_ms, 1e-3))
                self.next_at = meta["next_step"] + max(1, int(interval + 0.999))
        except Exception:
            log.warning("publishing the snapshot of step %s failed", meta.get("next_step"), exc_info=True)
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
        finally:
            self._busy.clear()

    def take_published(self) -> list[dict]:
        """The snapshots published since the last call (``{"step", "nbytes", "pause_ms", "cpu_ms",
        "path", "sha256"}``)."""
        with self._lock:
            out, self.published = self.published, []
        return out

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Wait for a publication in progress to finish."""
        deadline = time.monotonic() + timeout_s
        while self._busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)


def read_snapshot(path: str) -> tuple[dict, memoryview]:
    """``(manifest, payload)`` of the snapshot published at ``path``, checked.

    Raises:
        FileNotFoundError: no snapshot there.
        ValueError: it is incomplete or fails its SHA-256 (the message says which).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < _PREFIX_BYTES:
            raise ValueError(f"snapshot {path} is incomplete ({size} bytes)")
        magic, nbytes, header_bytes = _PREFIX.unpack(os.pread(fd, _PREFIX.size, 0))
        if magic != MAGIC or size != _PREFIX_BYTES + nbytes + header_bytes:
            raise ValueError(f"snapshot {path} is incomplete (magic {magic!r}, {size} bytes)")
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    view = memoryview(mapped)
    header = pickle.loads(view[_PREFIX_BYTES + nbytes :])
    payload = view[_PREFIX_BYTES : _PREFIX_BYTES + nbytes]
    h = hashlib.sha256(payload)
    h.update(meta_digest(header["meta"]))
    if h.hexdigest() != header["sha256"]:
        raise ValueError(f"snapshot {path} fails its SHA-256 check ({h.hexdigest()[:12]} != {header['sha256'][:12]})")
    man = {"skeleton": header["skeleton"], "meta": header["meta"], "nbytes": nbytes, "chunk_bytes": max(1, nbytes),
           "chunks": 1, "sha256": header["sha256"]}
    return man, payload
