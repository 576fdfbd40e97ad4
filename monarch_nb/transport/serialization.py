"""Serialization of message bodies: pickle protocol 5 with out-of-band buffers, cloudpickle by value.

``dumps(obj)`` returns the pickle stream and a list of raw buffers. Large contiguous CPU
torch tensors and numpy arrays are not copied into the stream: their memory travels as separate
ZeroMQ frames (zero-copy on send), and ``loads`` rebuilds them on top of the received frames.
Classes and functions defined in ``__main__`` (a notebook cell, a script) are pickled by value
with cloudpickle, so an actor class written in a cell runs on remote procs.

torch is never imported here: a tensor can only be pickled by a process that already imported
torch, and it is rebuilt by ``_rebuild_tensor``, which imports torch on first use.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import sys
import types
from typing import Any, Sequence

import cloudpickle

__all__ = ["dumps", "loads", "SerializationError", "OUT_OF_BAND_MIN_BYTES"]

#: Buffers smaller than this stay in the pickle stream: a separate frame costs more than a copy.
OUT_OF_BAND_MIN_BYTES = 8 * 1024


class SerializationError(TypeError):
    """A value could not be pickled (or unpickled) for the wire."""


def _rebuild_tensor(buffer: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    if len(buffer) == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        raw = memoryview(buffer)
        if raw.readonly:  # a stream-embedded bytes object: one copy into writable memory
            raw = memoryview(bytearray(raw))
        tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _reduce_tensor(tensor: Any) -> Any:
    """Reduce a dense CPU tensor to (its bytes as a PickleBuffer, dtype, shape)."""
    import torch

    if (
        tensor.device.type != "cpu"
        or tensor.layout is not torch.strided
        or tensor.is_quantized
        or type(tensor) is not torch.Tensor
        or (tensor.requires_grad and not tensor.is_leaf)
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return NotImplemented
    data = tensor.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    nbytes = data.numel() * data.element_size()
    if nbytes:
        flat = data.reshape(-1).view(torch.uint8)
        # an ndarray exports the buffer protocol; numpy declares it (__buffer__) for Python 3.12+ only
        raw = pickle.PickleBuffer(flat.numpy()) if nbytes >= OUT_OF_BAND_MIN_BYTES else flat.numpy().tobytes()  # type: ignore[arg-type]
    else:
        raw = b""
    dtype_name = str(data.dtype).removeprefix("torch.")
    return _rebuild_tensor, (raw, dtype_name, tuple(data.shape), tensor.requires_grad)


def _rebuild_code(ctor: Any, args: tuple[Any, ...], filename: str, lines: list[str] | None) -> types.CodeType:
    if lines and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    code: types.CodeType = ctor(*args)
    return code


def _reduce_code(code: types.CodeType) -> Any:
    """cloudpickle's code reduction, keeping the real file name and shipping the source lines.

    cloudpickle renames every by-value code object's file to ``<dynamic-code>``, which would
    leave remote tracebacks and pdb's ``l`` without source. A notebook cell's "file" exists only
    in the controller's linecache, so its lines travel with the code (pickle's memo sends each
    cell's lines once) and are put into the worker's linecache.
    """
    code_reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)
    if code_reduce is None:
        return NotImplemented
    ctor, args = code_reduce(code)
    args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
    lines = None if os.path.exists(code.co_filename) else (linecache.getlines(code.co_filename) or None)
    return _rebuild_code, (ctor, args, code.co_filename, lines)


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle's pickler plus a zero-copy reduction for torch tensors and source-keeping code."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        # no torch.Tensor yet while another thread is still importing torch: nothing is a tensor then
        tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
        if tensor_type is not None and kind is tensor_type:
            reduced = _reduce_tensor(obj)
            if reduced is not NotImplemented:
                return reduced
        elif kind is types.CodeType:
            reduced = _reduce_code(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str, bytes, complex})
_PLAIN_CONTAINERS = frozenset({tuple, list, dict})


def _plain(obj: Any, budget: list[int]) -> bool:
    """True if ``obj`` is built only of builtin scalars and small containers (no class that
    cloudpickle would need to send by value): the C pickler then gives the same stream, faster."""
    kind = type(obj)
    if kind in _PLAIN_SCALARS:
        return kind is not bytes or len(obj) < OUT_OF_BAND_MIN_BYTES
    if kind not in _PLAIN_CONTAINERS:
        return False
    budget[0] -= len(obj)
    if budget[0] < 0:
        return False
    if kind is dict:
        return all(type(k) is str and _plain(v, budget) for k, v in obj.items())
    return all(_plain(v, budget) for v in obj)


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; return (pickle stream, out-of-band buffers).

    Values made only of builtin scalars and small containers (most calls' arguments and results)
    take the C pickler directly; everything else goes through cloudpickle's pickler.

    Raises:
        SerializationError: ``obj`` (or something it holds) cannot be pickled; the message names
            the type and the original error.
    """
    if _plain(obj, [64]):
        return pickle.dumps(obj, protocol=5), []
    buffers: list[memoryview] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < OUT_OF_BAND_MIN_BYTES:
            return True  # serialize in-band
        buffers.append(raw)
        return False

    stream = io.BytesIO()
    try:
        _Pickler(stream, protocol=5, buffer_callback=keep).dump(obj)
    except Exception as exc:  # pickling raises many types: normalise to one
        raise SerializationError(f"cannot pickle {type(obj).__name__} value: {type(exc).__name__}: {exc}") from exc
    return stream.getvalue(), buffers


def loads(data: bytes | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """Unpickle a stream produced by :func:`dumps` with its out-of-band ``buffers``.

    Raises:
        SerializationError: the stream cannot be unpickled here (a missing module, a bad stream).
    """
    try:
        return pickle.loads(data, buffers=buffers)
    except Exception as exc:
        raise SerializationError(f"cannot unpickle message body: {type(exc).__name__}: {exc}") from exc
