"""The worker loop of a remote host: waits for a controller, runs its host agent, waits for the next.

Runs on each host of a cluster (``monarch-nb worker --address tcp://HOST:PORT --curve-keys DIR``,
or :func:`run_worker_loop_forever`; Monarch's name). It listens on ``address`` for an ``attach``
from a controller that holds the cluster's key (the message is HMAC-signed with it and, with a
key folder, the connection is CurveZMQ-encrypted and authenticated). On attach it starts a host
agent (:mod:`monarch_nb.runtime.host_agent`) that connects back to the controller and spawns,
watches and restarts this host's procs. When that controller is gone past
``controller_timeout_s`` the agent kills its procs and exits, and the loop waits for the next
controller. While one controller is attached, another is refused; the same controller (same run)
attaching again replaces its agent (a host it declared lost comes back fresh: no split brain).

It refuses to listen on a non-loopback address without a key.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import zmq

from ..transport.channel import curve_server
from ..transport.keys import Trust, load_trust, unseal
from ..transport.wire import BadMessage, Signer, decode, encode
from .launch import package_root, sweep_stale_run_dirs
from .protocol import CONTROLLER, AgentEnv, Kind

__all__ = ["run_worker_loop_forever", "LOOPBACK_KEY", "ATTACH_MAX_AGE_S"]

log = logging.getLogger("monarch_nb.worker_loop")

#: The key of loopback-only workers started without a cluster key (local tests and one-machine jobs).
LOOPBACK_KEY = b"monarch_nb loopback worker, no cluster key"
#: An attach message older than this (seconds) is refused (with its nonce, it cannot be replayed).
ATTACH_MAX_AGE_S = 60.0


def _host_of(address: str) -> str:
    if not address.startswith("tcp://") or address.count(":") < 2:
        raise ValueError(f"worker address {address!r} must look like tcp://HOST:PORT")
    return address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def is_loopback(address: str) -> bool:
    """True if ``address`` (``tcp://HOST:PORT``) names this machine's loopback interface."""
    host = _host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def trust_for(address: str, ca: str | None) -> Trust:
    """The trust of a worker at ``address``: ``ca``'s keys, or the loopback key where allowed.

    Raises:
        ValueError: ``address`` is not loopback and no ``ca`` was given.
    """
    if ca is not None:
        return load_trust(ca)
    if not is_loopback(address):
        raise ValueError(
            f"refusing to listen on {address} without a cluster key: anyone who can reach it could run code here. "
            "Make keys with `monarch-nb keys DIR`, copy DIR to every host, and pass ca=DIR (--curve-keys DIR)"
        )
    return Trust(LOOPBACK_KEY, source="loopback")


def interface_for(ip: str) -> tuple[str, str]:
    """(local IP, interface name) this host uses to reach ``ip``."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))
        local_ip = probe.getsockname()[0]
    finally:
        probe.close()
    iface = "lo"
    for name in os.listdir("/sys/class/net"):
        try:
            out = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", name], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            break
        if f" {local_ip}/" in out:
            iface = name
            break
    return local_ip, iface


def _gpu_inventory() -> dict:
    from .. import device

    inventory = device.detect_gpus()
    return {"vendor": inventory.vendor, "count": inventory.count}


class WorkerLoop:
    """The loop behind :func:`run_worker_loop_forever` (one listening socket, at most one agent)."""

    def __init__(self, address: str, ca: str | None, name: str | None = None):
        self.trust = trust_for(address, ca)
        self.signer = Signer(self.trust.hmac_key)
        self.name = name or socket.gethostname()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        with curve_server(self.sock, self.trust):
            self.sock.bind(address)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.agent: subprocess.Popen | None = None
        self.run_id = ""
        self._nonces: dict[str, float] = {}
        self._seq = 0
        self.dropped = 0

    def serve(self, stop_after: float | None = None) -> None:
        """Answer attaches until killed (or ``stop_after`` seconds, for tests)."""
        deadline = None if stop_after is None else time.monotonic() + stop_after
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while deadline is None or time.monotonic() < deadline:
            if self.agent is not None and self.agent.poll() is not None:
                log.info("the host agent of run %s exited (%s); waiting for a controller", self.run_id, self.agent.returncode)
                self.agent, self.run_id = None, ""
                sweep_stale_run_dirs()  # its folder, if it was killed
            if not poller.poll(200):
                continue
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._handle(frames[0].bytes, frames[1:])

    def _reply(self, peer: bytes, header: dict) -> None:
        self._seq += 1
        header.update(src=self.name, dst=CONTROLLER, seq=self._seq)
        self.sock.send_multipart([peer, *encode(self.signer, header)])

    def _handle(self, peer: bytes, frames: list) -> None:
        try:
            header, _body, _buffers = decode(self.signer, frames)
        except BadMessage as exc:  # unsigned, forged, malformed: never unpickled, never answered
            self.dropped += 1
            log.warning("dropped a bad message on %s: %s", self.address, exc)
            return
        if header.get("kind") != Kind.ATTACH:
            self.dropped += 1
            return
        now = time.time()
        self._nonces = {n: t for n, t in self._nonces.items() if now - t < 2 * ATTACH_MAX_AGE_S}
        nonce = str(header.get("nonce", ""))
        sent = header.get("time")
        if not isinstance(sent, (int, float)) or abs(now - sent) > ATTACH_MAX_AGE_S or nonce in self._nonces:
            self.dropped += 1
            log.warning("dropped a stale or replayed attach on %s", self.address)
            return
        self._nonces[nonce] = now
        run_id = str(header.get("run_id", ""))
        if self.agent is not None and self.agent.poll() is None:
            if run_id != self.run_id:
                self._reply(peer, {"kind": Kind.ATTACHED, "ok": False,
                                   "error": f"host {self.name} is attached to another controller (run {self.run_id})"})
                return
            self._stop_agent()  # the same controller lost this host and takes it back: start fresh
        try:
            session_key = unseal(self.trust.hmac_key, nonce, str(header["sealed_key"]))
            controller_ip = _host_of(str(header["controller"]))
            local_ip, iface = interface_for(controller_ip)
            env = AgentEnv(
                # the agent exits (its procs with it) when this worker loop dies: a loop started again
                # never shares the host with the old loop's procs
                controller=str(header["controller"]), key_hex=session_key.hex(), controller_pid=os.getpid(), run_id="",
                orphan_check_s=float(header.get("heartbeat_interval_s", 0.25)),
                heartbeat_interval_s=float(header.get("heartbeat_interval_s", 0.25)),
                controller_timeout_s=float(header.get("controller_timeout_s", 5.0)),
                curve_dir=self.trust.curve_dir, iface=iface,
            )
            name = str(header.get("name") or self.name)
            self.agent = self._start_agent(name, env)
            self.run_id = run_id
        except Exception as exc:
            log.exception("attach from %s failed", header.get("controller"))
            self._reply(peer, {"kind": Kind.ATTACHED, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return
        self._reply(peer, {"kind": Kind.ATTACHED, "ok": True, "host": name, "pid": self.agent.pid,
                           "hostname": socket.gethostname(), "ip": local_ip, "iface": iface,
                           "cores": len(os.sched_getaffinity(0)), "gpus": _gpu_inventory()})

    def _start_agent(self, name: str, env: AgentEnv) -> subprocess.Popen:
        environ = dict(os.environ)
        environ.update(env.to_env())
        environ["PYTHONPATH"] = os.pathsep.join(p for p in [package_root(), environ.get("PYTHONPATH", "")] if p)
        return subprocess.Popen([sys.executable, "-m", "monarch_nb.runtime.host_agent", name], env=environ,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def _stop_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is None or agent.poll() is not None:
            return
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(5.0)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()

    def close(self) -> None:
        self._stop_agent()
        self.sock.close(0)


def run_worker_loop_forever(address: str, ca: str | None = None, *, name: str | None = None,
                            announce: str | None = None) -> None:
    """Serve as a host of a cluster: wait for a controller at ``address``, run its procs, repeat.

    Args:
        address: where to listen, ``tcp://HOST:PORT`` (an address of this host).
        ca: what the cluster trusts: a key file (HMAC) or a key folder (HMAC + CurveZMQ), made
            by ``monarch-nb keys``. Required unless ``address`` is loopback.
        name: this host's name in the controller's tree (default: the hostname).
        announce: a file to write the announcement to (jobs read it): one JSON line
            ``{"worker", "address", "encrypted", "pid"}``, also printed on stdout. With port 0 in
            ``address``, the address in it has the port chosen.

    Raises:
        ValueError: a non-loopback ``address`` without ``ca``, or a malformed address.
        FileNotFoundError, PermissionError: ``ca`` is missing or readable by others.
    """
    loop = WorkerLoop(address, ca, name)

    def stop(signum: int, _frame: Any) -> None:
        loop.close()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    line = json.dumps({"worker": loop.name, "address": loop.address, "encrypted": loop.trust.encrypted, "pid": os.getpid()})
    if announce:
        tmp = f"{announce}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(line + "\n")
        os.replace(tmp, announce)
    print(line, flush=True)
    try:
        loop.serve()
    finally:
        loop.close()
