"""The worker loop of a remote host: waits for a controller, runs its host agent, waits for the next.

Runs on each host of a cluster (``monarch-nb worker --address tcp://HOST:PORT --curve-keys DIR``,
or :func:`run_worker_loop_forever`; Monarch's name). It listens on ``address`` for an ``attach``
from a controller that holds the cluster's key (the message is HMAC-signed with it and, with a
key folder, the connection is CurveZMQ-encrypted and authenticated). On attach it starts a host
agent (:mod:`monarch_nb.runtime.host_agent`) that connects back to the controller and spawns,
watches and restarts this host's procs. When that controller is gone past
``controller_timeout_s`` the agent kills its procs and exits, and the loop waits for the next
controller. The same controller (same run) attaching again replaces its agent (a host it declared
lost comes back fresh: no split brain); attaching it under another spelling of this address is
refused with the host name it already has (one worker is one host).

Another controller is refused while the attached one is alive, and served once it is dead: the
agent keeps a status file's modification time at the moment it last heard its controller, and
the loop waits (at most that controller's hang timeout) until it is either heard again (alive:
refused) or silent for the hang timeout (dead: its agent and procs are fenced, the new
controller attached). So a restarted kernel re-attaches a job's hosts at any moment after the
old kernel died, and never takes a host from a live controller. Attaches and departures are
logged (``monarch_nb.worker_loop`` at INFO: who, when, why).

It refuses to listen on a non-loopback address without a key.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, cast

import zmq

from ..transport.channel import curve_server
from ..transport.keys import Trust, load_trust, unseal
from ..transport.wire import BadMessage, Signer, decode, encode
from .launch import RUN_DIR_PREFIX, package_root, sweep_stale_run_dirs
from .protocol import CONTROLLER, AgentEnv, AgentExit, AttachedHeader, AttachHeader, Kind

__all__ = ["run_worker_loop_forever", "LOOPBACK_KEY", "ATTACH_MAX_AGE_S", "Attachment", "machine_id"]

log = logging.getLogger("monarch_nb.worker_loop")

#: The key of loopback-only workers started without a cluster key (local tests and one-machine jobs).
LOOPBACK_KEY = b"monarch_nb loopback worker, no cluster key"
#: An attach message older than this (seconds) is refused (with its nonce, it cannot be replayed).
ATTACH_MAX_AGE_S = 60.0


def _host_of(address: str) -> str:
    """The HOST of ``tcp://HOST:PORT``.

    Raises:
        ValueError: ``address`` does not look like that, or PORT is not a port number (0 to 65535).
    """
    if not address.startswith("tcp://") or address.count(":") < 2:
        raise ValueError(f"worker address {address!r} must look like tcp://HOST:PORT")
    host, port = address[len("tcp://"):].rsplit(":", 1)
    if not (port.isdigit() and 0 <= int(port) <= 65535):
        raise ValueError(f"worker address {address!r}: the port must be a number from 0 to 65535 (0: any free port)")
    return host.strip("[]")


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
            "Make keys with `monarch-nb keys DIR`, copy DIR to every host, and pass it: "
            "`monarch-nb worker --curve-keys DIR` on the command line, ca=DIR in Python"
        )
    return Trust(LOOPBACK_KEY, source="loopback")


def local_ip_for(ip: str) -> str:
    """The local IP this host uses to reach ``ip`` (no packet is sent)."""
    probe = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))
        return str(probe.getsockname()[0])
    finally:
        probe.close()


def interface_for(ip: str) -> tuple[str, str]:
    """(local IP, interface name) this host uses to reach ``ip``."""
    local_ip = local_ip_for(ip)
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


@dataclass(frozen=True)
class Attachment:
    """The controller this worker serves now (what its log says of it).

    Attributes:
        run_id: the controller's run; the same run may take its host back after losing it.
        controller: the address the agent connects to.
        controller_host / controller_pid: where the controller runs.
        name: this host's name in that controller's tree.
        hang_timeout_s: that controller loses a host silent this long; this worker judges the
            controller dead after the same silence.
        since: wall-clock time of the attach.
    """

    run_id: str
    controller: str
    controller_host: str
    controller_pid: int
    name: str
    hang_timeout_s: float
    since: float

    def describe(self) -> str:
        where = f"pid {self.controller_pid} on {self.controller_host}" if self.controller_pid else self.controller
        return f"run {self.run_id} ({where}, {self.controller})"


class WorkerLoop:
    """The loop behind :func:`run_worker_loop_forever` (one listening socket, at most one agent)."""

    def __init__(self, address: str, ca: str | None, name: str | None = None):
        self.trust = trust_for(address, ca)
        self.signer = Signer(self.trust.hmac_key)
        self.name = name or socket.gethostname()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            with curve_server(self.sock, self.trust):
                self.sock.bind(address)
        except zmq.ZMQError as exc:
            self.sock.close(0)
            if exc.errno == errno.EADDRINUSE:
                raise OSError(f"{address} is already in use (another worker there?): "
                              "pick another port, or stop what listens on it") from None
            raise OSError(f"cannot listen on {address}: {exc}") from None
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sweep_stale_run_dirs()  # a loop killed before it could clean up: its status file, its agent's folder
        self.agent: subprocess.Popen | None = None
        self.attachment: Attachment | None = None
        self._status = tempfile.NamedTemporaryFile(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-worker-", delete=False)
        self._status.close()
        self._nonces: dict[str, float] = {}
        self._seq = 0
        self.dropped = 0

    @property
    def run_id(self) -> str:
        return self.attachment.run_id if self.attachment is not None else ""

    def serve(self, stop_after: float | None = None) -> None:
        """Answer attaches until killed (or ``stop_after`` seconds, for tests)."""
        deadline = None if stop_after is None else time.monotonic() + stop_after
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while deadline is None or time.monotonic() < deadline:
            if self.agent is not None and self.agent.poll() is not None:
                self._agent_exited()
            if not poller.poll(200):
                continue
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._handle(frames[0].bytes, frames[1:])

    def _agent_exited(self) -> None:
        agent, attachment = self.agent, self.attachment
        self.agent, self.attachment = None, None
        code = agent.returncode if agent is not None else None
        why = f"its host agent exited with status {code}"
        if code is not None:
            with contextlib.suppress(ValueError):  # not one of AgentExit's statuses
                why = AgentExit(code).why
        if attachment is not None:
            log.info("the controller of %s left after %s: %s; waiting for a controller", attachment.describe(),
                     _duration(time.time() - attachment.since), why)
        sweep_stale_run_dirs()  # its folder, if it was killed

    def _reply(self, peer: bytes, header: AttachedHeader) -> None:
        self._seq += 1
        header["src"], header["dst"], header["seq"] = self.name, CONTROLLER, self._seq
        self.sock.send_multipart([peer, *encode(self.signer, header)])

    def _refuse(self, peer: bytes, error: str, attached_as: str = "") -> None:
        header: AttachedHeader = {"kind": Kind.ATTACHED, "ok": False, "error": error}
        if attached_as:
            header["attached_as"] = attached_as
        self._reply(peer, header)

    def _handle(self, peer: bytes, frames: list[Any]) -> None:
        try:
            received, _body, _buffers = decode(self.signer, frames)
        except BadMessage as exc:  # unsigned, forged, malformed: never unpickled, never answered
            self.dropped += 1
            log.warning("dropped a bad message on %s: %s", self.address, exc)
            return
        if received.get("kind") != Kind.ATTACH:
            self.dropped += 1
            return
        header = cast(AttachHeader, received)  # its kind says so; its fields are read with care all the same
        now = time.time()
        self._nonces = {n: t for n, t in self._nonces.items() if now - t < 2 * ATTACH_MAX_AGE_S}
        nonce = str(header.get("nonce", ""))
        sent = header.get("time")
        if not isinstance(sent, (int, float)) or abs(now - sent) > ATTACH_MAX_AGE_S or nonce in self._nonces:
            self.dropped += 1
            log.warning("dropped a stale or replayed attach on %s", self.address)
            return
        self._nonces[nonce] = now
        wanted = Attachment(
            run_id=str(header.get("run_id", "")), controller=str(header.get("controller", "")),
            controller_host=str(header.get("controller_host", "")), controller_pid=int(header.get("controller_pid", 0)),
            name=str(header.get("name") or self.name), hang_timeout_s=float(header.get("hang_timeout_s", 2.0)),
            since=now,
        )
        current = self.attachment
        if self.agent is not None and self.agent.poll() is None and current is not None:
            if wanted.run_id == current.run_id and wanted.name != current.name:
                # the same worker under another spelling of its address: one worker is one host
                self._refuse(peer, f"this worker already serves this controller as host {current.name}",
                             attached_as=current.name)
                return
            if wanted.run_id == current.run_id:
                log.info("the controller of %s takes host %s back (it had lost it): a fresh agent, the old procs killed",
                         current.describe(), current.name)
            else:
                heard = self._controller_heard(current)
                if heard is not None:
                    log.info("refused an attach from %s: serving %s, heard from %.2f s ago", wanted.describe(),
                             current.describe(), heard)
                    self._refuse(peer, f"host {self.name} is attached to another controller ({current.describe()}, "
                                       f"heard from {heard:.2f} s ago); stop that one first (%mesh stop, job.kill())")
                    return
                log.info("the controller of %s is silent past its hang timeout (%.1f s): fencing its agent and procs "
                         "for %s", current.describe(), current.hang_timeout_s, wanted.describe())
            self._stop_agent()
        elif self.agent is not None:
            self._agent_exited()
        try:
            session_key = unseal(self.trust.hmac_key, nonce, str(header["sealed_key"]))
            controller_ip = _host_of(wanted.controller)
            local_ip, iface = interface_for(controller_ip)
            os.utime(self._status.name, (now, now))  # heard it just now
            env = AgentEnv(
                # the agent exits (its procs with it) when this worker loop dies: a loop started again
                # never shares the host with the old loop's procs
                controller=wanted.controller, key_hex=session_key.hex(), controller_pid=os.getpid(), run_id="",
                orphan_check_s=float(header.get("heartbeat_interval_s", 0.25)),
                heartbeat_interval_s=float(header.get("heartbeat_interval_s", 0.25)),
                controller_timeout_s=float(header.get("controller_timeout_s", 5.0)),
                curve_dir=self.trust.curve_dir, iface=iface, status_path=self._status.name,
                relay_heartbeats=bool(header.get("relay_heartbeats", True)),
                link_procs=bool(header.get("link_procs", True)),
            )
            self.agent = self._start_agent(wanted.name, env)
            self.attachment = wanted
        except Exception as exc:
            log.exception("attach from %s failed", wanted.describe())
            self._refuse(peer, f"{type(exc).__name__}: {exc}")
            return
        log.info("attached to the controller of %s as host %s (agent pid %d)", wanted.describe(), wanted.name,
                 self.agent.pid)
        self._reply(peer, {"kind": Kind.ATTACHED, "ok": True, "host": wanted.name, "pid": self.agent.pid,
                           "hostname": socket.gethostname(), "ip": local_ip, "iface": iface,
                           "cores": len(os.sched_getaffinity(0)), "gpus": _gpu_inventory(), "machine": machine_id()})

    def _silence_s(self) -> float:
        """Seconds since the agent last heard its controller (its status file's modification time)."""
        try:
            return time.time() - os.stat(self._status.name).st_mtime
        except OSError:
            return float("inf")

    def _controller_heard(self, current: Attachment) -> float | None:
        """How long ago the agent heard ``current``'s controller, if it is alive; None if it is dead.

        Alive: heard while we wait (a live controller heartbeats every interval). Dead: silent for
        its hang timeout (the controller itself would have lost this host by then). So the answer
        takes at most one hang timeout, and a live controller never loses its host to another.
        """
        t0 = time.time()
        deadline = time.monotonic() + current.hang_timeout_s + 1.0
        while time.monotonic() < deadline:
            silence = self._silence_s()
            if silence >= current.hang_timeout_s or self.agent is None or self.agent.poll() is not None:
                return None
            if time.time() - silence > t0:
                return silence
            time.sleep(0.02)
        return self._silence_s()

    def _start_agent(self, name: str, env: AgentEnv) -> subprocess.Popen:
        environ = dict(os.environ)
        environ.update(env.to_env())
        environ["PYTHONPATH"] = os.pathsep.join(p for p in [package_root(), environ.get("PYTHONPATH", "")] if p)
        return subprocess.Popen([sys.executable, "-m", "monarch_nb.runtime.host_agent", name], env=environ,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def _stop_agent(self) -> None:
        agent, self.agent, self.attachment = self.agent, None, None
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
        try:
            os.unlink(self._status.name)
        except OSError:
            pass


def machine_id() -> str:
    """This kernel's boot id: processes that share it share CPUs (hosts in network namespaces, a
    local job's workers), whatever their addresses."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


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
    _host_of(address)
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
