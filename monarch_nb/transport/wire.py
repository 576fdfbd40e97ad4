"""Wire format of a message: multipart frames, HMAC-SHA256 signature, replay guard.

A message after ZeroMQ's routing frames is::

    [envelope, (body,) buffer_0, ..., buffer_n-1]
    envelope = b"MNB2" + layout + signature (32 bytes) + header length (4 bytes, big-endian) + header (+ body)

``layout`` is ``b"I"`` when a small body rides inline at the end of the envelope (one frame for a
typical call: each ZeroMQ frame costs Python-level work on both sides) or ``b"S"`` when the body
is a frame of its own (large bodies are not copied).

- ``header``: a dict of plain values (str, int, float, bool, None, lists and dicts of them) in
  Python's ``marshal`` format: it encodes and decodes about five times faster than JSON, which
  is most of a small message's cost (measured; see docs/messaging.md), and like the pickled body
  it is only read after its signature checked out. Always holds ``kind``, ``src`` (sender
  identity), ``dst`` (receiver identity), ``seq`` (per-sender sequence number, strictly
  increasing) and ``nbuf`` (the byte sizes of the buffers). Kind-specific small fields ride along.
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
import marshal
from typing import Any, Mapping, Sequence, TypedDict

__all__ = ["route_id", "BadMessage", "MAGIC", "Signer", "ReplayGuard", "encode", "decode", "INLINE_BODY_MAX", "Header",
           "fields_at", "columns_at"]

MAGIC = b"MNB2"
_DIGEST = hashlib.sha256
_MARSHAL_VERSION = 4


class _KindField(TypedDict):
    kind: str  # a monarch_nb.runtime.protocol.Kind member when sent; its plain value once received


class Header(_KindField, total=False):
    """A message header: its ``kind`` and the fields the transport fills in.

    :meth:`~monarch_nb.transport.channel.Channel.send` sets ``src``, ``dst`` and ``seq``,
    :func:`encode` sets ``nbuf``; a received header holds all five (:func:`decode` checks it).
    Each kind's own fields are a TypedDict that extends this one
    (:mod:`monarch_nb.runtime.protocol`), so a header built as one of them is a ``Header``.
    """

    src: str  # the sender's identity
    dst: str  # the receiver's identity
    seq: int  # the sender's sequence number (the replay guard's)
    nbuf: list[int]  # the byte sizes of the out-of-band buffers
    shm: list[list[Any]]  # [buffer index, shared-memory name, bytes] of buffers sent through /dev/shm
    fan: dict[str, list[Any]]  # one message for several procs of a host: "to": their routes, and a column per field that differs by proc
    pseq: list[int]  # [incarnation, n]: the n-th message the controller's socket sent this incarnation of a linked proc
    gk: int  # a linked proc's reply sent through its host agent for gathering: its n-th such
    after: int  # a linked proc's message to the controller: the replies it had sent for gathering (gk) before it
    gathered: list[list[Any]]  # a host agent's gathered replies: [src, gk, ...the kind's fields] each


def _encode_header(header: Header) -> bytes:
    kind = header.get("kind")
    if type(kind) is not str and isinstance(kind, str):
        header["kind"] = str.__str__(kind)  # an enum member (Kind): its plain value
    plain: dict[str, Any] = header  # type: ignore[assignment]  # a TypedDict is a plain dict at run time (no typing.cast: a call a message)
    try:
        return marshal.dumps(plain, _MARSHAL_VERSION)
    except ValueError:  # a str or int subclass somewhere: plain values via a JSON round trip
        return marshal.dumps(json.loads(json.dumps(plain)), _MARSHAL_VERSION)


def route_id(identity: str) -> str:
    """The routing identity of ``identity``: its part before any ``#incarnation`` (``"pm0.3#4211"``)."""
    return identity.split("#", 1)[0]


def fields_at(columns: Mapping[str, Sequence[Any]], index: int, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fields of one destination of a message to several, its fields given as columns
    (``columns[name][index]`` each: a cast's ``fan``), added to a copy of ``base`` when given
    (the message's header: one dict built per destination, not two). Raises IndexError,
    KeyError or TypeError for columns that do not hold ``index``."""
    fields = {} if base is None else dict(base)
    for name, column in columns.items():
        fields[name] = column[index]
    return fields


def columns_at(columns: Mapping[str, Sequence[Any]], indices: Sequence[int]) -> dict[str, list[Any]]:
    """The columns of the destinations at ``indices`` only, in that order."""
    return {name: [column[index] for index in indices] for name, column in columns.items()}


class BadMessage(ValueError):
    """A frame sequence that is not a valid, correctly signed message of this cluster."""


def _keyed_mac(key: bytes) -> Any:
    """An HMAC-SHA256 keyed with ``key`` over :data:`MAGIC`, whose ``copy``, ``update`` and
    ``digest`` run in C: OpenSSL's HMAC object (``_hashlib.hmac_new``, what ``hmac.new`` wraps)
    where this Python has it, else ``hmac.new``'s. ``hmac.HMAC``'s own methods are Python (five
    calls a signature: ``copy``, ``update`` twice, ``digest``, ``_current``; a message is signed
    once and verified once), and in a mesh of 128 procs on 2 cores every proc runs them cold
    (docs/scale.md)."""
    try:
        from _hashlib import hmac_new
    except ImportError:  # a Python built without OpenSSL
        return hmac.new(key, MAGIC, _DIGEST)
    return hmac_new(key, MAGIC, "sha256")


class Signer:
    """HMAC-SHA256 signer for one cluster key (bytes, at least 16 of them)."""

    def __init__(self, key: bytes, *, sign_buffers: bool = False) -> None:
        if len(key) < 16:
            raise ValueError("cluster key must be at least 16 bytes; use secrets.token_bytes(32)")
        self._key = key
        self.sign_buffers = sign_buffers
        self._base = _keyed_mac(key)  # keyed once; each message copies it

    @property
    def key(self) -> bytes:
        """The cluster key (to hand to processes of the same cluster)."""
        return self._key

    def signature(self, header: bytes | memoryview, body: bytes | memoryview, buffers: Sequence[Any] = ()) -> bytes:
        mac = self._base.copy()
        mac.update(header)
        mac.update(body)
        if self.sign_buffers:
            for buf in buffers:
                mac.update(buf)
        digest: bytes = mac.digest()
        return digest


#: Bodies up to this size are copied into the envelope frame.
INLINE_BODY_MAX = 64 * 1024
_SIG_BYTES = 32
# the envelope: MAGIC, the layout byte, the signature, the header's length (4 bytes), the header
_LAYOUT_AT = len(MAGIC)
_SIG_END = _LAYOUT_AT + 1 + _SIG_BYTES
_PREFIX = _SIG_END + 4
_INLINE, _SEPARATE = ord("I"), ord("S")  # the layout byte
_REQUIRED_FIELDS = frozenset(("kind", "src", "dst", "seq", "nbuf"))


def encode(signer: Signer, header: Header, body: bytes = b"", buffers: Sequence[Any] = ()) -> list[Any]:
    """Return the frames of one message. ``header`` must hold kind, src, dst and seq."""
    header["nbuf"] = [memoryview(b).nbytes for b in buffers] if buffers else []  # (a list comprehension is a call)
    raw_header = _encode_header(header)
    signature = signer.signature(raw_header, body, buffers)
    head = b"".join((MAGIC, b"I" if len(body) <= INLINE_BODY_MAX else b"S", signature, len(raw_header).to_bytes(4, "big"), raw_header))
    if len(body) <= INLINE_BODY_MAX:
        return [head + body, *buffers]
    return [head, body, *buffers]


def _view(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode(signer: Signer, frames: Sequence[Any]) -> tuple[Header, memoryview, list[memoryview]]:
    """Verify and split ``frames`` (bytes or zmq.Frame) into (header, body, buffers).

    Raises:
        BadMessage: wrong frame count, layout or magic, bad signature, malformed header.
    """
    if not frames:
        raise BadMessage("empty message")
    first = frames[0]
    envelope = first if type(first) is bytes else _view(first)  # a small envelope: copied out of the frame when received
    size = len(envelope)
    if size < _PREFIX or envelope[:_LAYOUT_AT] != MAGIC:
        raise BadMessage("bad envelope (not a monarch_nb message, or another protocol version)")
    header_end = _PREFIX + int.from_bytes(envelope[_SIG_END:_PREFIX], "big")
    if header_end > size:
        raise BadMessage("header length runs past the envelope")
    raw_header = envelope[_PREFIX:header_end]
    layout = envelope[_LAYOUT_AT]
    if layout == _INLINE:
        body = memoryview(envelope)[header_end:]
        rest = frames[1:]
    elif layout == _SEPARATE and len(frames) >= 2:
        body = _view(frames[1])
        rest = frames[2:]
    else:
        raise BadMessage(f"bad layout {bytes([layout])!r} for {len(frames)} frame(s)")
    buffers = [_view(f) for f in rest] if rest else []
    if not hmac.compare_digest(envelope[_LAYOUT_AT + 1:_SIG_END], signer.signature(raw_header, body, buffers)):
        raise BadMessage("bad signature (unsigned, forged, or signed with another cluster key)")
    try:
        header = marshal.loads(raw_header)
    except (ValueError, EOFError, TypeError) as exc:
        raise BadMessage(f"header is not readable: {exc}") from None
    if type(header) is not dict or not _REQUIRED_FIELDS <= header.keys():
        raise BadMessage("header lacks kind/src/dst/seq/nbuf")
    sizes = [b.nbytes for b in buffers] if buffers else []
    if header["nbuf"] != sizes:
        raise BadMessage(f"buffer sizes {sizes} differ from the signed header's {header['nbuf']}")
    return header, body, buffers  # type: ignore[return-value]  # a dict holding the five fields: checked above


class ReplayGuard:
    """Drops messages whose (src, seq) is not newer than the last accepted one from that src."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def accept(self, header: Header) -> bool:
        src, seq = header["src"], header["seq"]
        if not isinstance(seq, int):
            return False
        if seq <= self._last.get(src, -1):
            return False
        self._last[src] = seq
        return True
