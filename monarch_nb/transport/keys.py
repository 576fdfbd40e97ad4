"""What the hosts of a cluster trust: the HMAC cluster key, and CurveZMQ keys for traffic between hosts.

``ca`` (as in Monarch's ``attach_to_workers(..., ca=...)``) names what both sides trust:

- the path of a **key file** (``monarch-nb keys --hmac-only FILE``): 32 random bytes as hex, mode
  0600. Messages are HMAC-SHA256 signed with it (authenticated, not encrypted);
- the path of a **key folder** (``monarch-nb keys DIR``): ``hmac.secret`` as above plus a CurveZMQ
  certificate pair (``curve.key``, ``curve.key_secret``, made by :func:`zmq.auth.create_certificates`).
  Traffic between hosts is then encrypted and both ends authenticated: a client must prove it
  holds the cluster's secret key (a ZAP handler admits only the cluster's public key).

The key files are read on each host; secrets never travel in a message or a command line. A
controller's own per-run session key travels to an attached worker sealed with the cluster key
(:func:`seal` / :func:`unseal`: XOR with an HMAC-SHA256 keystream over a fresh nonce, inside a
message that is itself signed with the cluster key).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass

__all__ = ["Trust", "create_keys", "load_trust", "seal", "unseal", "HMAC_FILE"]

HMAC_FILE = "hmac.secret"
CURVE_NAME = "curve"


@dataclass(frozen=True)
class Trust:
    """What one side trusts.

    Attributes:
        hmac_key: the cluster key (bytes, 32) that signs every message.
        curve_public / curve_secret: the cluster's CurveZMQ key pair (z85 bytes), or None for
            plain TCP.
        curve_dir: the folder holding the CurveZMQ certificates ("" without CURVE).
        source: the ``ca`` path it was read from.
    """

    hmac_key: bytes
    curve_public: bytes | None = None
    curve_secret: bytes | None = None
    curve_dir: str = ""
    source: str = ""

    @property
    def encrypted(self) -> bool:
        return self.curve_secret is not None

    def with_key(self, hmac_key: bytes) -> "Trust":
        """The same transport security, signing with ``hmac_key`` (a controller's session key)."""
        return Trust(hmac_key, self.curve_public, self.curve_secret, self.curve_dir, self.source)


def _write_secret(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def create_keys(path: str, *, curve: bool = True) -> str:
    """Create the keys of a new cluster at ``path``; return ``path``.

    With ``curve`` (default), ``path`` is a new folder holding ``hmac.secret`` and the CurveZMQ
    certificates; without, ``path`` is a single key file.

    Raises:
        FileExistsError: ``path`` exists (keys are never overwritten).
    """
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; keys are never overwritten (remove it or pick another path)")
    key = secrets.token_hex(32).encode() + b"\n"
    if not curve:
        _write_secret(path, key)
        return path
    import zmq.auth

    os.makedirs(path, mode=0o700)
    _write_secret(os.path.join(path, HMAC_FILE), key)
    _, secret_file = zmq.auth.create_certificates(path, CURVE_NAME)
    os.chmod(secret_file, 0o600)
    return path


def _read_hmac(path: str) -> bytes:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{path} is readable by others (mode {oct(mode & 0o777)}); run `chmod 600 {path}`")
    text = open(path, "rb").read().strip()
    try:
        key = bytes.fromhex(text.decode())
    except ValueError:
        raise ValueError(f"{path} does not hold a hex key; make one with `monarch-nb keys`") from None
    if len(key) < 16:
        raise ValueError(f"{path}: the key is {len(key)} bytes, at least 16 are needed")
    return key


def load_trust(ca: str) -> Trust:
    """Read ``ca``: a key file (HMAC only) or a key folder (HMAC + CurveZMQ).

    Raises:
        FileNotFoundError: ``ca`` does not exist.
        PermissionError: a secret is readable by other users.
        ValueError: the files are not keys made by ``monarch-nb keys``.
    """
    if not os.path.exists(ca):
        raise FileNotFoundError(f"ca {ca!r} does not exist; make the cluster's keys with `monarch-nb keys {ca}`")
    if os.path.isfile(ca):
        return Trust(_read_hmac(ca), source=ca)
    import zmq.auth

    secret_file = os.path.join(ca, f"{CURVE_NAME}.key_secret")
    if not os.path.exists(secret_file):
        raise ValueError(f"{ca} has no {CURVE_NAME}.key_secret; make the folder with `monarch-nb keys {ca}`")
    public, secret = zmq.auth.load_certificate(secret_file)
    return Trust(_read_hmac(os.path.join(ca, HMAC_FILE)), public, secret, os.path.abspath(ca), ca)


def _keystream(key: bytes, nonce: bytes, length: int) -> bytes:
    out = b""
    counter = 0
    while len(out) < length:
        out += hmac.new(key, b"monarch_nb-seal" + nonce + counter.to_bytes(4, "big"), hashlib.sha256).digest()
        counter += 1
    return out[:length]


def seal(key: bytes, secret: bytes) -> tuple[str, str]:
    """Encrypt ``secret`` under ``key`` with a fresh nonce; returns (nonce hex, sealed hex).
    Authenticate the message carrying them separately (it is signed with ``key``)."""
    nonce = secrets.token_bytes(16)
    sealed = bytes(a ^ b for a, b in zip(secret, _keystream(key, nonce, len(secret))))
    return nonce.hex(), sealed.hex()


def unseal(key: bytes, nonce_hex: str, sealed_hex: str) -> bytes:
    """The inverse of :func:`seal`."""
    sealed = bytes.fromhex(sealed_hex)
    return bytes(a ^ b for a, b in zip(sealed, _keystream(key, bytes.fromhex(nonce_hex), len(sealed))))
