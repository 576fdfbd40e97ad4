"""Wire format of a message: multipart frames, HMAC-SHA256 signature, replay guard.

A message after ZeroMQ's routing frames is::

    [b"MNB1", signature, header, body, buffer_0, ..., buffer_n-1]

- ``header``: compact JSON object. Always holds ``kind``, ``src`` (sender identity), ``dst``
  (receiver identity), ``seq`` (per-sender sequence number, strictly increasing) and ``nbuf``
  (the byte sizes of the buffers). Kind-specific small fields ride along.
- ``body``: a pickle stream (see :mod:`monarch_nb.transport.serialization`), possibly empty.
- ``buffers``: pickle protocol 5 out-of-band buffers (tensor and array memory).

The signature is HMAC-SHA256 over the version, header and body with the per-cluster key, as in
Jupyter's wire protocol. Buffer *contents* are raw numbers read by the reconstructors named in the
signed pickle stream, never code, so like Jupyter we leave them out of the MAC (hashing 64 MiB
would cost more than sending it); their count and sizes are in the signed header, so a frame cannot
be added, dropped or resized. ``sign_buffers=True`` covers them too.

Everything is checked, in constant time, before a byte is unpickled. A bad frame raises
:class:`BadMessage`; receivers drop it and count it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Sequence

__all__ = ["BadMessage", "MAGIC", "Signer", "ReplayGuard", "encode", "decode"]

MAGIC = b"MNB1"
_DIGEST = hashlib.sha256


class BadMessage(ValueError):
    """A frame sequence that is not a valid, correctly signed message of this cluster."""


class Signer:
    """HMAC-SHA256 signer for one cluster key (bytes, at least 16 of them)."""

    def __init__(self, key: bytes, *, sign_buffers: bool = False):
        if len(key) < 16:
            raise ValueError("cluster key must be at least 16 bytes; use secrets.token_bytes(32)")
        self._key = key
        self.sign_buffers = sign_buffers

    def signature(self, header: bytes, body: bytes | memoryview, buffers: Sequence[Any] = ()) -> bytes:
        mac = hmac.new(self._key, MAGIC, _DIGEST)
        mac.update(header)
        mac.update(body)
        if self.sign_buffers:
            for buf in buffers:
                mac.update(buf)
        return mac.digest()


def encode(signer: Signer, header: dict, body: bytes = b"", buffers: Sequence[Any] = ()) -> list:
    """Return the frames of one message. ``header`` must hold kind, src, dst and seq."""
    header["nbuf"] = [memoryview(b).nbytes for b in buffers]
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    return [MAGIC, signer.signature(raw_header, body, buffers), raw_header, body, *buffers]


def _bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def decode(signer: Signer, frames: Sequence[Any]) -> tuple[dict, Any, list]:
    """Verify and split ``frames`` (bytes or zmq.Frame) into (header, body, buffers).

    Raises:
        BadMessage: wrong frame count or magic, bad signature, malformed header.
    """
    if len(frames) < 4:
        raise BadMessage(f"expected at least 4 frames, got {len(frames)}")
    if _bytes(frames[0]) != MAGIC:
        raise BadMessage("bad magic frame (not a monarch_nb message, or another protocol version)")
    signature = _bytes(frames[1])
    raw_header = _bytes(frames[2])
    body = frames[3].buffer if hasattr(frames[3], "buffer") else frames[3]
    buffers = [f.buffer if hasattr(f, "buffer") else f for f in frames[4:]]
    expected = signer.signature(raw_header, body, buffers)
    if not hmac.compare_digest(signature, expected):
        raise BadMessage("bad signature (unsigned, forged, or signed with another cluster key)")
    try:
        header = json.loads(raw_header)
    except ValueError as exc:
        raise BadMessage(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not all(k in header for k in ("kind", "src", "dst", "seq", "nbuf")):
        raise BadMessage("header lacks kind/src/dst/seq/nbuf")
    sizes = [memoryview(b).nbytes for b in buffers]
    if header["nbuf"] != sizes:
        raise BadMessage(f"buffer sizes {sizes} differ from the signed header's {header['nbuf']}")
    return header, body, buffers


class ReplayGuard:
    """Drops messages whose (src, seq) is not newer than the last accepted one from that src."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def accept(self, header: dict) -> bool:
        src, seq = header["src"], header["seq"]
        if not isinstance(seq, int):
            return False
        if seq <= self._last.get(src, -1):
            return False
        self._last[src] = seq
        return True
