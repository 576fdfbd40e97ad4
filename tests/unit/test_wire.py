"""Wire format, signatures, replay guard, serialization and shared-memory buffers (no processes)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from monarch_nb.transport import shm
from monarch_nb.transport.serialization import SerializationError, dumps, loads
from monarch_nb.transport.wire import BadMessage, ReplayGuard, Signer, decode, encode

KEY = b"0123456789abcdef0123456789abcdef"


def _header(seq: int = 1) -> dict:
    return {"kind": "call", "src": "a#1", "dst": "b", "seq": seq}


def test_round_trip_small_and_large_bodies():
    signer = Signer(KEY)
    for body in (b"", b"x" * 100, b"y" * (200 * 1024)):
        frames = encode(signer, _header(), body, [b"z" * 10])
        header, got_body, buffers = decode(signer, frames)
        assert header["kind"] == "call" and bytes(got_body) == body and [bytes(b) for b in buffers] == [b"z" * 10]


def test_tampering_is_detected():
    signer = Signer(KEY)
    frames = encode(signer, _header(), b"body", [b"buf"])
    with pytest.raises(BadMessage, match="signature"):
        decode(Signer(b"another key of 32 bytes........."), frames)
    tampered = [frames[0][:-1] + b"X", *frames[1:]]
    with pytest.raises(BadMessage, match="signature"):
        decode(signer, tampered)
    with pytest.raises(BadMessage, match="buffer sizes"):
        decode(signer, [frames[0], b"bufbuf"])  # a resized buffer
    with pytest.raises(BadMessage, match="buffer sizes"):
        decode(signer, [frames[0]])  # a dropped buffer
    with pytest.raises(BadMessage):
        decode(signer, [b"garbage"])
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Signer(b"short")


def test_replay_guard_drops_old_and_repeated_sequence_numbers():
    guard = ReplayGuard()
    assert guard.accept(_header(1)) and guard.accept(_header(2))
    assert not guard.accept(_header(2)) and not guard.accept(_header(1))
    assert guard.accept({**_header(1), "src": "a#2"})  # a new incarnation has its own sequence


def test_tensors_and_arrays_travel_out_of_band():
    tensor = torch.randn(256, 256)
    array = np.arange(100_000, dtype=np.float64)
    stream, buffers = dumps({"t": tensor, "a": array, "small": torch.ones(3)})
    assert len(stream) < 2048 and len(buffers) == 2
    back = loads(stream, [bytearray(b) for b in buffers])
    assert torch.equal(back["t"], tensor) and np.array_equal(back["a"], array)
    assert torch.equal(back["small"], torch.ones(3))
    leaf = torch.ones(4, requires_grad=True)
    assert loads(*dumps(leaf)).requires_grad


def test_unpicklable_value_is_a_clear_error():
    import threading

    with pytest.raises(SerializationError, match="cannot pickle"):
        dumps(threading.Lock())
    with pytest.raises(SerializationError, match="cannot unpickle"):
        loads(b"not a pickle")


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_shared_memory_buffers_are_mapped_once_and_cleaned_up():
    run_id = "0123abcd"
    data = np.arange(1 << 18, dtype=np.float32)
    name = shm.export_buffer(memoryview(data).cast("B"), run_id)
    view = shm.import_buffer(name, data.nbytes)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))  # unlinked on receipt
    assert np.array_equal(np.frombuffer(view, dtype=np.float32), data) and not view.readonly
    with pytest.raises(ValueError, match="not a monarch_nb"):
        shm.import_buffer("../../etc/passwd", 10)
    orphan = shm.export_buffer(memoryview(b"x" * 100), run_id)
    with pytest.raises(ValueError, match="holds 100 bytes"):
        shm.import_buffer(orphan, 5)
    orphan2 = shm.export_buffer(memoryview(b"x" * 100), run_id)
    assert shm.remove_orphans(run_id) == 1 and not os.path.exists(os.path.join(shm.SHM_DIR, orphan2))


class _Point:
    def __init__(self, x: int):
        self.x = x


def test_pickling_while_another_thread_is_still_importing_torch(monkeypatch):
    """While a thread imports torch, ``sys.modules["torch"]`` is a module without ``Tensor`` yet
    (importlib marks its spec ``_initializing``): calls pickled meanwhile must go out, and code
    that looks at a loaded torch must see none."""
    import importlib.machinery
    import types

    from monarch_nb.device import loaded_torch

    half = types.ModuleType("torch")
    half.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    half.__spec__._initializing = True
    monkeypatch.setitem(sys.modules, "torch", half)
    assert loaded_torch() is None
    body, buffers = dumps((_Point, (_Point(3),), {"k": [_Point(4)]}))
    cls, args, kwargs = loads(body, buffers)
    assert (cls, args[0].x, kwargs["k"][0].x) == (_Point, 3, 4)
    monkeypatch.undo()
    assert loaded_torch() is torch
