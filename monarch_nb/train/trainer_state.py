"""A trainer's full state as one byte stream: healing a joiner live, and snapshots in shared memory. Runs in procs.

The state of a replica is its model's state dict, its optimizer's state dict, its counters
(updates applied, next step = data position) and its RNG states. :func:`capture` lays it out as
a *skeleton* (the two state dicts with each tensor replaced by a :class:`TensorSlot`) plus the
list of tensors; the stream is the tensors' bytes, in order. A :func:`manifest` describes a stream
(skeleton, counters, size, SHA-256); :class:`Incoming` rebuilds a state from one, writing the
bytes straight into the receiver's own tensors and checking the SHA-256 before anything is
loaded.

Two uses:

- **heal**: a donor sends its stream in chunks (views of its live tensors, no copy on CPU) through
  the controller to a restarted rank (see :class:`~monarch_nb.train.trainer.Trainer`).
- **snapshots** (:class:`SnapshotWriter`, :func:`read_snapshot`): every few steps one trainer per
  host copies its stream into a file in ``/dev/shm`` — outside every trainer process, so it
  survives all of them — and a background thread hashes it and publishes it, while training
  goes on. When every replica is lost, restarted trainers load the newest snapshot.

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
import random
import struct
import threading
import time
from typing import Any

__all__ = ["TensorSlot", "capture", "manifest", "Incoming", "stream_slice", "bytes_view", "SnapshotWriter",
           "read_snapshot", "snapshot_tmp_path"]

log = logging.getLogger(__name__)

MAGIC = b"MNBSNAP1"
_PREFIX = struct.Struct("<8sQQ")  # magic, payload bytes, header bytes
_PREFIX_BYTES = 64


class TensorSlot:
    """Stands for tensor ``index`` of the state stream in a skeleton."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: tuple, dtype: str):
        self.index, self.shape, self.dtype = index, shape, dtype

    def __reduce__(self):
        return TensorSlot, (self.index, self.shape, self.dtype)


# -- the state as a stream ------------------------------------------------------------------------
def capture(model, optimizer, applied_steps: int, next_step: int, rank: int) -> tuple[list, dict, dict]:
    """``(tensors, skeleton, meta)`` of a replica's state: the live tensors (not copies), the state
    dicts with tensors replaced by :class:`TensorSlot`, and the counters and RNG states."""
    import numpy as np
    import torch

    tensors: list = []

    def strip(obj):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach())
            return TensorSlot(len(tensors) - 1, tuple(obj.shape), str(obj.dtype).replace("torch.", ""))
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    skeleton = {"model": strip(model.state_dict()), "optimizer": strip(optimizer.state_dict())}
    meta = {
        "applied_steps": applied_steps,
        "next_step": next_step,
        "data_position": next_step,
        "torch_rng": torch.get_rng_state().numpy().tobytes(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "donor": rank,
    }
    return tensors, skeleton, meta


def meta_digest(meta: dict) -> bytes:
    """The bytes of ``meta`` that the stream's SHA-256 covers (counters, donor, torch RNG)."""
    scalars = {k: meta[k] for k in ("applied_steps", "next_step", "data_position", "donor")}
    return pickle.dumps((scalars, meta["torch_rng"]), protocol=4)


def manifest(views: list, skeleton: dict, meta: dict, chunk_bytes: int, sha256: str | None = None) -> dict:
    """Describe a stream of byte ``views`` for a receiver: ``{"skeleton", "meta", "nbytes",
    "chunk_bytes", "chunks", "sha256"}`` (the SHA-256 covers the bytes, then :func:`meta_digest`)."""
    if sha256 is None:
        h = hashlib.sha256()
        for view in views:
            h.update(view)
        h.update(meta_digest(meta))
        sha256 = h.hexdigest()
    nbytes = sum(v.nbytes for v in views)
    return {"skeleton": skeleton, "meta": meta, "nbytes": nbytes, "chunk_bytes": chunk_bytes,
            "chunks": max(1, -(-nbytes // chunk_bytes)), "sha256": sha256}


def bytes_view(tensor, writable: bool = False):
    """A uint8 numpy view of ``tensor``'s bytes (a copy for GPU tensors, which cannot be written)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        if writable:
            raise ValueError("writable byte views need CPU tensors")
        t = t.cpu()
    if not t.is_contiguous():
        if writable:
            raise ValueError("writable byte views need contiguous tensors")
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8).numpy()
    return t.reshape(-1).view(torch.uint8).numpy()


def stream_slice(views: list, start: int, end: int) -> list:
    """Bytes ``[start, end)`` of the stream made of ``views``, as a list of views (no copy)."""
    out, offset = [], 0
    for view in views:
        lo, hi = max(start, offset), min(end, offset + view.nbytes)
        if lo < hi:
            out.append(view[lo - offset : hi - offset])
        offset += view.nbytes
        if offset >= end:
            break
    return out


def _stream_write(views: list, start: int, piece) -> None:
    import numpy as np

    data = np.frombuffer(piece, dtype=np.uint8) if not isinstance(piece, np.ndarray) else piece
    offset, pos = 0, 0
    end = start + len(data)
    for view in views:
        lo, hi = max(start, offset), min(end, offset + view.nbytes)
        if lo < hi:
            view[lo - offset : hi - offset] = data[pos : pos + (hi - lo)]
            pos += hi - lo
        offset += view.nbytes
        if offset >= end:
            break


class Incoming:
    """Receives a stream described by ``manifest`` into ``model`` / ``optimizer``.

    Model tensors of the right shape and dtype (on CPU) are written in place; the others are
    staged in new CPU tensors. Nothing is loaded until :meth:`finish` has checked the SHA-256.
    """

    def __init__(self, manifest: dict, model, device):
        import torch

        self.manifest = manifest
        own = model.state_dict()
        targets: list = []

        def collect(skel, live):
            if isinstance(skel, TensorSlot):
                dtype = getattr(torch, skel.dtype)
                cpu = device.type == "cpu"
                if cpu and live is not None and tuple(live.shape) == skel.shape and live.dtype == dtype:
                    targets.append((skel.index, live))
                else:
                    targets.append((skel.index, torch.empty(skel.shape, dtype=dtype)))  # staged on CPU
            elif isinstance(skel, dict):
                for k, v in skel.items():
                    collect(v, live.get(k) if isinstance(live, dict) else None)
            elif isinstance(skel, (list, tuple)):
                for v in skel:
                    collect(v, None)

        collect(manifest["skeleton"]["model"], own)
        collect(manifest["skeleton"]["optimizer"], None)
        targets.sort(key=lambda t: t[0])
        self.tensors = [t for _, t in targets]
        self.views = [bytes_view(t, writable=True) for t in self.tensors]
        self.offset = 0
        self.sha = hashlib.sha256()

    def write(self, start: int, pieces: list) -> int:
        """Write ``pieces`` (byte buffers, in stream order) at byte ``start``; returns bytes so far.

        Raises:
            RuntimeError: ``start`` is not where the previous piece ended.
        """
        if start != self.offset:
            raise RuntimeError(f"state stream out of order: expected byte {self.offset}, got {start}")
        for piece in pieces:
            self.sha.update(piece)
            _stream_write(self.views, self.offset, piece)
            self.offset += len(piece)
        return self.offset

    def finish(self, model, optimizer) -> dict:
        """Check size and SHA-256, then load the state; returns the manifest's ``meta``.

        Raises:
            ValueError: the size or the checksum does not match the manifest.
        """
        import numpy as np
        import torch

        manifest = self.manifest
        meta = manifest["meta"]
        self.sha.update(meta_digest(meta))
        if self.offset != manifest["nbytes"] or self.sha.hexdigest() != manifest["sha256"]:
            raise ValueError(
                f"state from rank {meta['donor']} failed its check: {self.offset} of {manifest['nbytes']} "
                f"bytes, sha256 {self.sha.hexdigest()[:12]} != {manifest['sha256'][:12]}"
            )
        tensors = self.tensors

        def fill(skel):
            if isinstance(skel, TensorSlot):
                return tensors[skel.index]
            if isinstance(skel, dict):
                return {k: fill(v) for k, v in skel.items()}
            if isinstance(skel, (list, tuple)):
                return type(skel)(fill(v) for v in skel)
            return skel

        model.load_state_dict(fill(manifest["skeleton"]["model"]))
        optimizer.load_state_dict(fill(manifest["skeleton"]["optimizer"]))
        torch.set_rng_state(torch.from_numpy(np.frombuffer(meta["torch_rng"], dtype=np.uint8).copy()))
        np.random.set_state(meta["numpy_rng"])
        random.setstate(meta["python_rng"])
        return meta


# -- snapshots in shared memory -------------------------------------------------------------------
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
        every: snapshot every this many steps; 0 chooses it so that a snapshot's cost (the pause
            plus the background CPU time) stays near ``budget`` of the training time.
        budget: the share of step time snapshots may cost when ``every`` is 0.
    """

    def __init__(self, path: str, every: int = 0, budget: float = 0.005):
        self.path = path
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
        if self._busy.is_set():
            self.skipped += 1
            self.next_at = step + 1
            return
        self._busy.set()
        self.next_at = step + max(1, self.every)  # provisional: the publication sets the real one
        t0 = time.perf_counter() if t_begin is None else t_begin
        tmp = snapshot_tmp_path(self.path)
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
        threading.Thread(target=self._publish, args=(fd, tmp, nbytes, skeleton, meta, pause_ms, step_ms),
                         name="monarch_nb-snapshot", daemon=True).start()

    def _publish(self, fd: int, tmp: str, nbytes: int, skeleton: dict, meta: dict, pause_ms: float,
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
            os.replace(tmp, self.path)
            cpu_ms = (time.thread_time() - cpu0) * 1e3
            cost_ms = pause_ms + cpu_ms
            with self._lock:
                self.count += 1
                self.published.append({"step": meta["next_step"], "nbytes": nbytes, "pause_ms": round(pause_ms, 4),
                                       "cpu_ms": round(cpu_ms, 4), "path": self.path, "sha256": h.hexdigest()})
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
