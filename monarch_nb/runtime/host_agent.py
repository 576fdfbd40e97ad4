"""Host agent main: spawns this host's procs, keeps warm spares, forwards output, reports exits at once.

Runs in the host agent process, started by the controller as ``python -m
monarch_nb.runtime.host_agent <name>`` (environment: :class:`~.protocol.AgentEnv`). It is the parent
of every proc on its host, so it learns of a proc's death from the OS (SIGCHLD -> waitpid) with
no polling, and it owns the procs' stdout/stderr pipes, so output written just before a crash is
still read and forwarded — before the exit report, on the same socket, so in order.

What only the host can know goes into its heartbeat (:class:`~.protocol.AgentHeartbeatHeader`):
which procs the OS reports *stopped* (SIGSTOP: hung, whatever they were doing — an import does
not hide it) and how loaded the host is (runnable procs per core), so the controller does not
mistake a starved proc for a hung one.

Rules it keeps:

- One incarnation per rank: before starting a proc it kills (and reaps) any live process of the
  same identity.
- Warm spares: for a mesh that asks (``keep_spares``), it keeps N procs started ahead of need,
  which imported the mesh's ``preload`` modules and wait for a spec on their stdin. Restarting a
  rank of that mesh hands the spec to a ready spare (same rank and coordinates, new pid: no
  interpreter start, no ``import torch``) and starts a replacement in the background.
- Procs of a mesh that names modules to ``preload`` (a training mesh: torch, the trainer) are
  forked from a fork server that imported them once (:mod:`.forkserver`), spares included; the
  agent is a child subreaper, so it stays the parent of every proc. Without a ready server (none
  yet for that interpreter and environment, or it failed) procs start as fresh interpreters.
- Heavy imports take a slot: at most one proc per core imports torch (or another heavy module) at
  a time (lock files in the agent's folder), so 64 procs on 2 cores do not thrash for minutes.

It exits, taking its procs with it (they have PR_SET_PDEATHSIG), when its controller goes away:
checked every ``orphan_check_s`` through the parent pid (and, for a remote agent, the
controller's silence). Its exit status says why (:class:`~.protocol.AgentExit`); when it exits
on its own it first tells the controller (``agent_exiting``), so the host is lost at once, with
that reason, instead of after the hang timeout. A remote agent keeps ``status_path``'s
modification time at the moment it last heard its controller, for its worker loop.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from .. import device
from ..transport import shm
from ..transport.channel import Channel
from ..transport.keys import load_trust
from ..transport.wire import Header, Signer, route_id
from .forkserver import ForkedProc, ForkServer, ServerState, become_subreaper, server_key
from .heartbeat_relay import HeartbeatRelay, IdleCadence, tick_phase_s
from .proc_link import AgentLink
from .reply_gather import KeptReplies, ReplyGather, ReplyMerge
from .relay import RELAY_SILENT_INTERVALS, AgentRelay, Relayed, RelayMember, pass_cast_down
from .signal_stacks import dump_with_signal, os_state
from .launch import RUN_DIR_PREFIX, spare_proc_env, sweep_stale_run_dirs
from .protocol import (CONTROLLER, AgentEnv, AgentExit, AgentExitingHeader, AgentHeartbeatHeader, AgentHelloHeader, Handler, Kind,
                       OutputHeader, ProcEnv, ProcExitedHeader, ProcSpawnedHeader, ProcStacksHeader, RelayJoinHeader, RelayReadyHeader, RepliesHeader,
                       SignalHeader, SparesHeader, WorkspaceHeader, WorkspaceSyncedHeader)
from .workspace_files import FileEntry, WorkspaceCopy
from .worker_loop import local_ip_for

log = logging.getLogger("monarch_nb.host_agent")

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP, "SIGCONT": signal.SIGCONT, "SIGTERM": signal.SIGTERM,
           "SIGSEGV": signal.SIGSEGV, "SIGINT": signal.SIGINT}
#: Spares that die this many times in a row, each within SPARE_MIN_LIFE_S of its start, are not replaced.
SPARE_MAX_QUICK_DEATHS = 3
SPARE_MIN_LIFE_S = 5.0
#: Seconds the agent waits for a hung proc's faulthandler to write its stacks before it fences it anyway.
HUNG_STACKS_TIMEOUT_S = 0.5
#: Seconds the dump file must stay the same size to count as written (delays the fencing SIGKILL by as much).
HUNG_STACKS_SETTLE_S = 0.01
#: Fork servers kept per agent (one per interpreter, environment and preload; the least recently used goes).
MAX_FORK_SERVERS = 2


@dataclass
class ChildProc:
    """A process this agent started: a rank's proc, or a warm spare (``identity`` None until used)."""

    identity: str | None
    rank: int
    popen: subprocess.Popen[bytes] | ForkedProc
    mesh: str = ""
    fds: dict[int, str] = field(default_factory=dict)  # fd -> stream name
    seq: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    ready_fd: int = -1  # a spare writes one byte here once its preload is done
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)
    signalled: bool = False  # signalled at the controller's request while still alive (not a zombie)


@dataclass
class SparePool:
    """What the controller asked to keep for one mesh (the JSON body of ``keep_spares``)."""

    mesh: str
    count: int
    preload: list
    base_env: dict | None  # the controller's environment (this machine), or None: the agent's own
    proc_env: dict  # ProcEnv fields shared by the mesh's procs (controller, run_id, extent, ...)
    cwd: str | None
    python: str | None = None
    quick_deaths: int = 0


@dataclass
class ForkRequest:
    """A proc asked of a fork server, its reply not read yet: a rank's (``spec``) or a spare of ``mesh``."""

    mesh: str
    spec: dict | None = None  # None: a spare
    cancelled: bool = False  # a newer incarnation of the rank was started meanwhile


class HostAgent:
    def __init__(self, name: str, env: AgentEnv) -> None:
        self.name = name
        self.env = env
        key = bytes.fromhex(env.key_hex)
        self.trust = load_trust(env.curve_dir).with_key(key) if env.curve_dir else None
        self._terminate = False
        self._published_seen = 0.0
        self.signer = Signer(key)
        self.channel = Channel(f"{name}#{os.getpid()}", self.signer, self._on_message)
        self.inventory = device.detect_gpus()
        self.controller_seen = time.monotonic()
        self._handlers: dict[str, Handler] = {
            Kind.SPAWN_PROCS: self._on_spawn_procs,
            Kind.SIGNAL: self._on_signal,
            Kind.KEEP_SPARES: lambda header, body, buffers: self._keep_spares(json.loads(bytes(body))),
            Kind.SHUTDOWN: lambda header, body, buffers: self.shutdown(AgentExit.SHUTDOWN),
            Kind.CONTROLLER_HEARTBEAT: lambda header, body, buffers: None,  # any message counts (see _on_message)
            Kind.WORKSPACE: self._on_workspace,
            Kind.RELAY_SERVE: lambda header, body, buffers: self._serve_relay(),
            Kind.RELAY_JOIN: self._on_relay_join,
        }
        self.relay: AgentRelay | None = None  # other agents' heartbeats pass through us (monarch_nb.runtime.relay)
        self.member: RelayMember | None = None  # ours go through another agent
        self.children: dict[int, ChildProc] = {}  # pid -> child
        self._taking_stacks: set[int] = set()  # pids being fenced, their stacks taken first (a thread each)
        self.pools: dict[str, SparePool] = {}  # mesh -> what to keep
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        sweep_stale_run_dirs()  # of agents killed before they could clean up
        self.folder = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-agent-")
        self.workspace = WorkspaceCopy(os.path.join(self.folder, "workspace"))  # first on every proc's sys.path
        # procs' heartbeats, summarized in ours
        self.heartbeats = HeartbeatRelay(self.folder, self._ranked_children, enabled=env.relay_heartbeats)
        self.link = AgentLink(self.folder, enabled=env.link_procs)  # the controller's messages for our procs, passed on
        self.channel.on_routed = self.link.forward
        self.channel.on_relayed = self._on_relayed  # a cast down the relay tree, for our procs and our members'
        # our procs' replies to a cast, sent to the controller as one message
        self.replies = ReplyGather(self.signer, self._send_replies, self.channel.call_later)
        # those sent up to our relay lately, sent straight if we leave it (it may have been lost holding them)
        self.kept_replies = KeptReplies(max(5.0, 2 * RELAY_SILENT_INTERVALS * env.heartbeat_interval_s + 1.0))
        self.link.on_gathered = self.replies.on_link_message
        self.cadence = IdleCadence()  # an idle host's heartbeat every second interval
        self.subreaper = become_subreaper()
        self.servers: dict[str, ForkServer] = {}  # server_key -> server (a dead one stays: no retry storm)
        self._unclaimed_exits: dict[int, int] = {}  # pid -> status of a forked proc reaped before its reply was read
        self._sigchld_r, self._sigchld_w = os.pipe()
        os.set_blocking(self._sigchld_r, False)
        os.set_blocking(self._sigchld_w, False)

    # -- messages from the controller ----------------------------------------------------------------
    def _on_message(self, header: Header, body: memoryview, buffers: list[memoryview], frames: list[Any]) -> None:
        self.controller_seen = time.monotonic()
        handler = self._handlers.get(header["kind"])
        if handler is None:
            log.warning("unknown message kind %r from %s", header["kind"], header["src"])
            return
        handler(header, body, buffers)

    def _on_workspace(self, header: WorkspaceHeader, body: memoryview, buffers: list[memoryview]) -> None:
        """Make this host's workspace copy the manifest sent (see :mod:`.workspace_files`); reply
        what was written, removed and is still missing. A bad request writes nothing."""
        reply: WorkspaceSyncedHeader = {"kind": Kind.WORKSPACE_SYNCED, "request": int(header.get("request", -1)),
                                        "root": self.workspace.root, "written": [], "removed": [], "bytes": 0,
                                        "missing": [], "error": ""}
        try:
            manifest = {str(rel): FileEntry.from_json(entry) for rel, entry in json.loads(bytes(body)).items()}
            names = list(header.get("files", []))
            if len(names) != len(buffers):
                raise ValueError(f"{len(names)} workspace files named but {len(buffers)} sent")
            done = self.workspace.apply(manifest, dict(zip(names, buffers)))
            reply["written"], reply["removed"], reply["missing"] = list(done.written), list(done.removed), list(done.missing)
            reply["bytes"] = done.bytes
        except (ValueError, TypeError, OSError) as exc:
            log.warning("workspace sync refused: %s", exc)
            reply["error"] = f"{type(exc).__name__}: {exc}"
        self.channel.send(CONTROLLER, reply)

    # -- the relay tree of heartbeats (monarch_nb.runtime.relay) ------------------------------------
    def _serve_relay(self) -> None:
        """Bind the relay socket (once) where this host reaches the controller; say where."""
        reply: RelayReadyHeader = {"kind": Kind.RELAY_READY, "endpoint": "", "error": ""}
        try:
            if self.relay is None:
                relay = AgentRelay(self.channel.identity, self.signer, self.trust, _local_ip_toward(self.env.controller))
                relay.merge = ReplyMerge(lambda header, body: self.channel.send(CONTROLLER, header, body), self.channel.call_later)
                self.channel.add_reader(relay.fd, relay.on_readable)
                self.relay = relay
            reply["endpoint"] = self.relay.endpoint
        except (OSError, zmq.ZMQError, ValueError) as exc:
            log.warning("host %s cannot serve as a heartbeat relay: %s", self.name, exc)
            reply["error"] = f"{type(exc).__name__}: {exc}"
        self.channel.send(CONTROLLER, reply)

    def _on_relayed(self, routing: bytes, frames: list[Any]) -> None:
        """A cast down the relay tree: our procs' part through the link, each member's over the
        relay socket (:func:`~.relay.pass_cast_down`); those not reached named to the controller,
        which sends them their part straight."""
        try:
            unreached = pass_cast_down(self.signer, self.relay, route_id(self.channel.identity).encode(), routing, frames,
                                       self.link.forward)
        except ValueError as exc:
            log.warning("dropped a cast down the relay tree: %s", exc)
            return
        if unreached is not None:
            self.channel.send(CONTROLLER, unreached)

    def _on_relay_join(self, header: RelayJoinHeader, body: memoryview, buffers: list[memoryview]) -> None:
        """Heartbeat through the relay named from now on (none: straight to the controller)."""
        self._leave_relay()
        if header.get("endpoint"):
            member = RelayMember(self.channel.identity, self.signer, self.trust, header["relay"], header["endpoint"],
                                 self.env.heartbeat_interval_s)
            member.on_routed = self.link.forward  # our part of the casts down the tree
            self.channel.add_reader(member.fd, self._on_relay_beat)
            self.member = member

    def _on_relay_beat(self, fd: int) -> None:
        member = self.member
        if member is None:
            return
        member.on_readable()
        if member.controller_heard is not None and member.controller_heard > self.controller_seen:
            self.controller_seen = member.controller_heard  # the relay heard it: it is alive

    def _leave_relay(self) -> None:
        if self.member is not None:
            self.member.on_readable()  # pass on the casts already here (the controller resends what did not come)
            self.channel.remove_reader(self.member.fd)
            self.member.close()
            self.member = None
            kept = self.kept_replies.take()
            for header, body in kept:  # the relay may have been lost holding them: the controller drops those it had
                self.channel.send(CONTROLLER, header, body)
            if kept:
                log.info("host %s left its relay: %d gathered replies sent through it lately sent straight", self.name, len(kept))

    def _send_replies(self, header: RepliesHeader, body: bytes, *, straight: bool = False) -> None:
        """Our procs' gathered replies to a call: up to our relay (kept for a resend), into our
        own merge when we relay, else (or ``straight``) to the controller. A count alone (no
        replies: they went straight) is only for a relay's merge."""
        if not straight and self.member is not None and self.member.send_replies(header, body):
            if header["gathered"]:
                self.kept_replies.add(header, body)
        elif not straight and self.relay is not None and self.relay.merge is not None:
            self.relay.merge.add(header, body)
        elif header["gathered"]:
            self.channel.send(CONTROLLER, header, body)

    def _replies_before_exit(self, identity: str) -> None:
        """Proc ``identity`` exited: every reply it gave reaches the controller before its exit
        report, which goes straight: those held here, and those held in our relay's merge (ours,
        or the one we sent them up to: sent again straight, the controller drops what it had),
        since a call that a failure reaches before its reply fails."""
        self.replies.flush_all(lambda header, body: self._send_replies(header, body, straight=True))
        if self.relay is not None and self.relay.merge is not None:
            self.relay.merge.flush_all()
        for header, body in self.kept_replies.naming(route_id(identity)):
            self.channel.send(CONTROLLER, dict(header), body)  # type: ignore[arg-type]  # a copy of a replies header

    def _on_spawn_procs(self, header: Header, body: memoryview, buffers: list[memoryview]) -> None:
        for spec in json.loads(bytes(body)):
            self._spawn(spec)

    def _on_signal(self, header: SignalHeader, body: memoryview, buffers: list[memoryview]) -> None:
        self._signal(header["proc"], header["signal"], stacks_first=bool(header.get("stacks_first")))

    def _host_env(self, proc_env: ProcEnv) -> ProcEnv:
        """Add what only this host knows to a proc's environment."""
        proc_env.key_hex = self.env.key_hex
        proc_env.agent_pid = os.getpid()
        proc_env.import_lock_dir = self.folder
        proc_env.import_slots = self.cores
        proc_env.curve_dir = self.env.curve_dir
        proc_env.workspace = self.workspace.root
        proc_env.heartbeat_dir = self.heartbeats.folder
        proc_env.agent_link = self.link.address
        proc_env.sys_path = [self.workspace.root, *(p for p in proc_env.sys_path if p != self.workspace.root)]
        if proc_env.rank >= 0:
            proc_env.extra.update(device.visibility_env(proc_env.local_rank, self.inventory))
        # collectives leave through the interface that reaches the controller (lo on one host)
        proc_env.extra.setdefault("GLOO_SOCKET_IFNAME", self.env.iface)
        proc_env.extra.setdefault("NCCL_SOCKET_IFNAME", self.env.iface)
        return proc_env

    def _spawn(self, spec: dict) -> None:
        """Start one proc from its spec (see :func:`monarch_nb.runtime.launch.proc_specs`): on a
        ready warm spare of its mesh when there is one, else forked from its fork server, else as
        a fresh interpreter."""
        identity = spec["identity"]
        self._end_incarnations(identity)
        mesh = identity.rsplit(".", 1)[0]
        spare = next((c for c in self.children.values() if c.identity is None and c.mesh == mesh and c.ready), None)
        if spare is not None and self._assign(spare, spec):
            self._refill(mesh)
            return
        env = self._proc_environ(spec.get("base_env"), self._host_env(ProcEnv.from_json(spec["env"])))
        server = self._server(spec.get("python"), spec.get("cwd"), spec.get("preload", []), spec.get("base_env"), spec["env"])
        if server is not None and server.state == ServerState.STARTING:
            server.held.append(spec)  # forked when the server is ready (see _on_server_ready)
            return
        if server is not None and server.fork(env, spec.get("cwd"), ForkRequest(mesh, spec)):
            return  # adopted when the reply comes (see _on_server_reply)
        self._start_fresh(spec, env)

    def _start_fresh(self, spec: dict, env: dict[str, str]) -> None:
        identity = spec["identity"]
        try:
            popen = self._popen([identity], env, spec.get("cwd"), python=spec.get("python"))
        except OSError as exc:
            exited: ProcExitedHeader = {"kind": Kind.PROC_EXITED, "proc": identity, "pid": 0, "returncode": 127,
                                        "signal": None, "detail": f"could not start: {exc}"}
            self.channel.send(CONTROLLER, exited)
            return
        self._adopt(ChildProc(identity, spec["rank"], popen, identity.rsplit(".", 1)[0]))
        spawned: ProcSpawnedHeader = {"kind": Kind.PROC_SPAWNED, "proc": identity, "pid": popen.pid}
        self.channel.send(CONTROLLER, spawned)

    @staticmethod
    def _proc_environ(base_env: dict | None, proc_env: ProcEnv) -> dict[str, str]:
        """A proc's whole environment: the controller's (or this agent's), then the proc's own."""
        env = dict(base_env) if base_env is not None else dict(os.environ)
        env.update(proc_env.to_env())
        env["PYTHONUNBUFFERED"] = "1"
        return env

    # -- fork servers --------------------------------------------------------------------------------
    def _server(self, python: str | None, cwd: str | None, preload: list[str], base_env: dict | None,
                proc_env: dict) -> ForkServer | None:
        """The fork server for procs with these settings, started if there is none; None when
        procs of this kind are not forked (nothing to preload, or not a subreaper) or it failed."""
        if not preload or not self.subreaper:
            return None
        env = self._proc_environ(base_env, self._host_env(ProcEnv.from_json(spare_proc_env(proc_env))))
        python = python or sys.executable
        key = server_key(python, cwd, preload, env)
        server = self.servers.get(key)
        if server is None:
            live = sorted((s for s in self.servers.values() if s.state != ServerState.DEAD), key=lambda s: s.last_used)
            for old in live[:max(0, len(live) - MAX_FORK_SERVERS + 1)]:
                self._close_server(old, forget=True)
            try:
                server = ForkServer(key, python, env, cwd, preload)
            except OSError as exc:
                log.warning("could not start a fork server (%s): procs start as fresh interpreters", exc)
                return None
            self.servers[key] = server
            started = server  # the callbacks' server (``server`` is not bound again below)
            self.channel.add_reader(server.ready_fd, lambda _fd: self._on_server_ready(started))
            self.channel.add_reader(server.sock.fileno(), lambda _fd: self._on_server_reply(started))
        if server.state == ServerState.DEAD:
            return None
        return server

    def _on_server_ready(self, server: ForkServer) -> None:
        self.channel.remove_reader(server.ready_fd)
        server.on_ready()
        if server.state == ServerState.DEAD:
            log.warning("fork server %d exited while importing %s: procs start as fresh interpreters", server.pid, server.preload)
            self._close_server(server)
        held, server.held = server.held, []
        for spec in held:
            self._spawn(spec)
        for mesh in list(self.pools):
            self._refill(mesh)

    def _on_server_reply(self, server: ForkServer) -> None:
        for request, forked in server.replies():
            self._on_forked(request, forked)
        if server.state == ServerState.DEAD:
            self._close_server(server)

    def _on_forked(self, request: ForkRequest, forked: ForkedProc | None) -> None:
        """A fork server answered ``request``: adopt the new proc (or start it another way)."""
        if forked is not None and request.cancelled:
            try:
                os.kill(forked.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for f in (forked.stdin, forked.stdout, forked.stderr):
                f.close()
            return
        if request.spec is None:  # a spare: ready at once, its imports are the server's
            if forked is None:
                self._refill(request.mesh, fresh=True)
                return
            self._adopt(ChildProc(None, -1, forked, request.mesh, ready=True))
            self._report_spares(request.mesh)
        else:
            spec = request.spec
            if forked is None:
                self._start_fresh(spec, self._proc_environ(spec.get("base_env"), self._host_env(ProcEnv.from_json(spec["env"]))))
                return
            child = ChildProc(None, -1, forked, request.mesh)
            self._adopt(child)
            if not self._assign(child, spec, spare=False):
                log.warning("forked proc %d of %s closed its stdin at once", forked.pid, spec["identity"])
                child.identity, child.rank = spec["identity"], spec["rank"]
        status = self._unclaimed_exits.pop(forked.pid, None)
        if status is not None:  # it died before its reply was read
            self._forget(forked.pid, self.children[forked.pid], report=True, status=status)

    def _close_server(self, server: ForkServer, *, forget: bool = False) -> None:
        """Stop ``server`` (its procs live on); what it will not answer starts another way."""
        for fd in (server.ready_fd, server.sock.fileno()):
            if fd >= 0:
                self.channel.remove_reader(fd)
        held, server.held = server.held, []
        for request, forked in server.close():
            self._on_forked(request, forked)
        for spec in held:
            self._spawn(spec)
        if forget:
            self.servers.pop(server.key, None)

    def _popen(self, args: list[str], env: dict, cwd: str | None, pass_fds: tuple = (), python: str | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [python or sys.executable, "-m", "monarch_nb.proc_main", *args],
            env=env,
            stdin=subprocess.PIPE if pass_fds else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C goes to the controller, not to workers
            cwd=cwd or None,
            pass_fds=pass_fds,
        )

    def _adopt(self, child: ChildProc) -> None:
        for stream, pipe in (("stdout", child.popen.stdout), ("stderr", child.popen.stderr)):
            assert pipe is not None  # procs are started with their output piped here
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            child.fds[fd] = stream
            self.channel.add_reader(fd, self._read_output)
        self.children[child.popen.pid] = child

    def _end_incarnations(self, identity: str) -> None:
        """Kill and reap every live process of ``identity``: never two incarnations of one rank
        (a fork of it not answered yet is killed when its reply comes)."""
        for server in self.servers.values():
            for request in server.pending_tags():
                if request.spec is not None and request.spec["identity"] == identity:
                    request.cancelled = True
            server.held = [s for s in server.held if s["identity"] != identity]
        for pid, child in list(self.children.items()):
            if child.identity != identity:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            self._forget(pid, child, report=True, status=-signal.SIGKILL)

    def _signal(self, identity: str, signame: str, stacks_first: bool = False) -> None:
        for pid, child in self.children.items():
            if child.identity == identity:
                state = os_state(pid)
                # a proc that already died (a zombie not reaped yet) is not the last signal's doing:
                # its exit report says so, and the controller does not take a crash for its own kill
                child.signalled = state not in ("Z", "X", "?")
                if signame == "SIGKILL" and pid in self._taking_stacks:
                    continue  # its stacks are being taken (a fencing): that thread kills it right after
                if (stacks_first and signame == "SIGKILL" and child.signalled and state not in ("T", "t")
                        and self._kill_after_stacks(pid, identity)):
                    continue  # a stopped proc has no stack to give until it continues: killed at once
                try:
                    os.kill(pid, SIGNALS[signame])
                except ProcessLookupError:
                    pass

    def _kill_after_stacks(self, pid: int, identity: str) -> bool:
        """Fence hung proc ``pid``, its Python stacks first: on a thread of its own, the stacks
        are taken through the proc's faulthandler (:func:`.signal_stacks.dump_with_signal`,
        up to :data:`HUNG_STACKS_TIMEOUT_S`; it works while a C call holds the GIL) and sent to the
        controller (``proc_stacks``) before the SIGKILL, on the socket its exit report takes after,
        so they arrive first. The kill goes through a pidfd, so a pid reaped and reused meanwhile is
        not hit. Another SIGKILL asked for meanwhile (a restart of the hung rank, right behind the
        fencing) waits for it (:attr:`_taking_stacks`), so the stacks are not lost to it. False
        (kill it now, without stacks) when no pidfd can be had."""
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # gone already, or a kernel before 5.3
            return False
        self._taking_stacks.add(pid)

        def stacks_then_kill() -> None:
            try:
                stacks = dump_with_signal(pid, timeout_s=HUNG_STACKS_TIMEOUT_S, settle_s=HUNG_STACKS_SETTLE_S)
                header: ProcStacksHeader = {"kind": Kind.PROC_STACKS, "proc": identity, "pid": pid}
                self.channel.send(CONTROLLER, header, json.dumps(stacks).encode())
            except Exception:  # the fencing must happen whatever the dump did
                log.exception("host %s: the stacks of hung proc %s (pid %d) could not be taken", self.name, identity, pid)
            finally:
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except OSError:  # ProcessLookupError: it exited meanwhile
                    pass
                os.close(pidfd)
                self._taking_stacks.discard(pid)

        threading.Thread(target=stacks_then_kill, name=f"stacks-{identity}", daemon=True).start()
        return True

    # -- warm spares ---------------------------------------------------------------------------------
    def _keep_spares(self, spec: dict) -> None:
        mesh = spec["mesh"]
        if spec["count"] <= 0:
            self.pools.pop(mesh, None)
            for pid, child in list(self.children.items()):
                if child.identity is None and child.mesh == mesh:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return
        self.pools[mesh] = SparePool(mesh, spec["count"], list(spec.get("preload", [])), spec["base_env"],
                                     spec["proc_env"], spec.get("cwd"), spec.get("python"))
        self._refill(mesh)

    def _spares(self, mesh: str) -> list[ChildProc]:
        return [c for c in self.children.values() if c.identity is None and c.mesh == mesh]

    def _refill(self, mesh: str, *, fresh: bool = False) -> None:
        """Start spares until ``mesh``'s pool is full: forked from its fork server when there is
        one (``fresh``: not, because the server just failed), else as fresh interpreters."""
        pool = self.pools.get(mesh)
        if pool is None:
            return
        server = None if fresh else self._server(pool.python, pool.cwd, pool.preload, pool.base_env, pool.proc_env)
        if server is not None and server.state == ServerState.STARTING:
            return  # refilled when it is ready
        forking = sum(1 for s in self.servers.values() for r in s.pending_tags() if r.spec is None and r.mesh == mesh)
        while len(self._spares(mesh)) + forking < pool.count and pool.quick_deaths < SPARE_MAX_QUICK_DEATHS:
            env = self._proc_environ(pool.base_env, self._host_env(ProcEnv.from_json(spare_proc_env(pool.proc_env))))
            if server is not None and server.fork(env, pool.cwd, ForkRequest(mesh)):
                forking += 1
                continue
            ready_r, ready_w = os.pipe()
            try:
                popen = self._popen(["--spare", str(ready_w), *pool.preload], env, pool.cwd, pass_fds=(ready_w,),
                                    python=pool.python)
            except OSError as exc:
                log.warning("could not start a spare for %s: %s", mesh, exc)
                os.close(ready_r)
                os.close(ready_w)
                return
            os.close(ready_w)
            child = ChildProc(None, -1, popen, mesh, ready_fd=ready_r)
            self._adopt(child)
            os.set_blocking(ready_r, False)
            self.channel.add_reader(ready_r, self._on_spare_ready)
        self._report_spares(mesh)

    def _on_spare_ready(self, fd: int) -> None:
        self.channel.remove_reader(fd)
        child = next((c for c in self.children.values() if c.ready_fd == fd), None)
        try:
            os.read(fd, 16)
        except OSError:
            pass
        os.close(fd)
        if child is not None:
            child.ready_fd = -1
            child.ready = True
            self._report_spares(child.mesh)

    def _assign(self, child: ChildProc, spec: dict, *, spare: bool = True) -> bool:
        """Hand ``spec`` to ``child`` (a warm spare, or a proc just forked for it): it becomes
        the rank's proc, with the rank's environment as this host sees it (device visibility
        included). False if it could not take it."""
        env = self._host_env(ProcEnv.from_json(spec["env"])).to_json()
        stdin = child.popen.stdin
        assert stdin is not None  # a spare and a forked proc read their rank's spec from it
        try:
            stdin.write(json.dumps({**spec, "env": env}).encode() + b"\n")
            stdin.close()
        except (BrokenPipeError, OSError):
            return False
        child.identity, child.rank = spec["identity"], spec["rank"]
        spawned: ProcSpawnedHeader = {"kind": Kind.PROC_SPAWNED, "proc": spec["identity"], "pid": child.popen.pid}
        if spare:
            spawned["spare"] = True
        self.channel.send(CONTROLLER, spawned)
        if spare:
            self._report_spares(child.mesh)
        return True

    def _report_spares(self, mesh: str) -> None:
        spares = [{"pid": c.popen.pid, "ready": c.ready} for c in self._spares(mesh)]
        header: SparesHeader = {"kind": Kind.SPARES, "mesh": mesh, "spares": spares}
        self.channel.send(CONTROLLER, header)

    # -- output --------------------------------------------------------------------------------------
    def _child_of_fd(self, fd: int) -> ChildProc | None:
        for child in self.children.values():
            if fd in child.fds:
                return child
        return None

    def _read_output(self, fd: int) -> None:
        child = self._child_of_fd(fd)
        if child is None:
            self.channel.remove_reader(fd)
            return
        self._drain(child, fd)

    def _drain(self, child: ChildProc, fd: int) -> None:
        """Read and forward everything buffered in ``fd``; close it at EOF. A spare's output
        before it takes a rank (warnings of its preload) is dropped."""
        stream = child.fds[fd]
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    log.warning("read from %s failed: %s", child.identity, exc)
                data = b""
            if not data:
                self.channel.remove_reader(fd)
                del child.fds[fd]
                _close_pipe(child, fd)
                return
            if child.identity is None:
                continue
            child.seq[stream] += 1
            header: OutputHeader = {"kind": Kind.OUTPUT, "proc": child.identity, "rank": child.rank, "stream": stream,
                                    "oseq": child.seq[stream]}
            self.channel.send(CONTROLLER, header, data)

    # -- exits ---------------------------------------------------------------------------------------
    def _on_sigchld(self, _fd: int) -> None:
        try:
            os.read(self._sigchld_r, 4096)
        except BlockingIOError:
            pass
        self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.get(pid)
            if child is not None:
                self._forget(pid, child, report=True, status=os.waitstatus_to_exitcode(status))
                continue
            server = next((s for s in self.servers.values() if s.pid == pid), None)
            if server is not None:
                server.popen.returncode = os.waitstatus_to_exitcode(status)
                if server.state != ServerState.DEAD:
                    log.warning("fork server %d exited (%s): procs start as fresh interpreters", pid, server.popen.returncode)
                    self._close_server(server)
            elif any(s.pending_tags() for s in self.servers.values()):  # a forked proc, its reply not read yet
                self._unclaimed_exits[pid] = os.waitstatus_to_exitcode(status)

    def _forget(self, pid: int, child: ChildProc, *, report: bool, status: int) -> None:
        """``child`` exited with ``status``: forward its last output, then report the exit."""
        self.children.pop(pid, None)
        self.heartbeats.forget(pid)
        for fd in list(child.fds):  # output written before death goes out before the exit report
            self._drain(child, fd)
        for fd in list(child.fds):  # a grandchild may hold the pipe: stop reading it
            self.channel.remove_reader(fd)
            _close_pipe(child, fd)
        child.fds.clear()
        if child.ready_fd >= 0:
            self.channel.remove_reader(child.ready_fd)
            os.close(child.ready_fd)
            child.ready_fd = -1
        child.popen.returncode = status
        if child.identity is None:  # a spare died before it was used: replace it (not a storm)
            pool = self.pools.get(child.mesh)
            if pool is not None:
                quick = time.monotonic() - child.started_at < SPARE_MIN_LIFE_S
                pool.quick_deaths = pool.quick_deaths + 1 if quick else 0
                if pool.quick_deaths == SPARE_MAX_QUICK_DEATHS:
                    log.warning("spares of %s keep dying at start (exit %s); not replacing them", child.mesh, status)
                self._refill(child.mesh)
            else:
                self._report_spares(child.mesh)
            return
        self.link.leave(child.identity, pid)  # its peers on this host send through the controller again
        if report:
            self.link.on_readable()  # what it answered (read off the link now) goes out before its exit report
            self._replies_before_exit(child.identity)
            signame = signal.Signals(-status).name if status < 0 else None
            exited: ProcExitedHeader = {"kind": Kind.PROC_EXITED, "proc": child.identity, "pid": pid, "returncode": status,
                                        "signal": signame, "time": time.time(), "on_request": child.signalled}
            self.channel.send(CONTROLLER, exited)

    # -- what the OS says ----------------------------------------------------------------------------
    def _ranked_children(self) -> list[tuple[int, str]]:
        return [(pid, child.identity) for pid, child in list(self.children.items()) if child.identity is not None]

    def _heartbeat(self) -> None:
        """Our heartbeat: the host's load, the procs the OS reports stopped, and the procs'
        heartbeats since the last one (see :mod:`.heartbeat_relay`)."""
        stopped, runnable = [], 0
        for pid, child in list(self.children.items()):
            state = os_state(pid)
            if state in ("T", "t") and child.identity is not None:
                stopped.append(child.identity)
            elif state == "R":
                runnable += 1
        load = round(runnable / self.cores, 2)
        members = self.relay.take() if self.relay is not None else Relayed()
        left = ""
        if self.member is not None and self.member.silent():  # straight again, at once, before the hang timeout
            left = self.member.relay
            log.warning("host %s: relay %s silent for %.2f s; heartbeating straight to the controller", self.name, left,
                        time.monotonic() - self.member.relay_heard)
            self._leave_relay()
        procs = self.cadence.take(self.heartbeats.summary(), load, stopped, force=bool(members or left))
        if procs is not None:  # None: nothing new to say, and it was said one interval ago
            header: AgentHeartbeatHeader = {"kind": Kind.AGENT_HEARTBEAT, "load": load, "stopped": stopped,
                                            "heard": list(procs.heard), "changed": procs.changed}
            if procs.complete and not procs.changed and not stopped:  # nothing new: a relay may say so in a few bytes
                header["all_heard"] = len(procs.heard)
            members.into(header)
            if left:
                header["relay_left"] = left
            if self.member is not None:
                self.member.send(header)
            else:
                self.channel.send(CONTROLLER, header)
        if self.relay is not None:
            self.relay.beat_members(time.monotonic() - self.controller_seen)
        self._publish_seen()

    def _publish_seen(self) -> None:
        """Set ``status_path``'s modification time to the wall-clock time the controller was last heard."""
        if not self.env.status_path or self.controller_seen == self._published_seen:
            return
        self._published_seen = self.controller_seen
        wall = time.time() - (time.monotonic() - self.controller_seen)
        try:
            os.utime(self.env.status_path, (wall, wall))
        except OSError:  # the worker loop removed it: it no longer asks
            pass

    def _check_parent(self) -> None:
        """Exit (taking the procs along) when told to, when the parent is gone (the controller of a
        local agent, the worker loop of a remote one) or when a remote agent's controller is silent."""
        if self._terminate:
            self.shutdown(AgentExit.SHUTDOWN)
        if self.env.controller_pid and os.getppid() != self.env.controller_pid:
            parent = "worker loop" if self.env.controller_timeout_s else "controller"
            self.shutdown(AgentExit.PARENT_GONE, f"the {parent} of host {self.name} exited")
        silent = time.monotonic() - self.controller_seen
        if self.env.controller_timeout_s and silent > self.env.controller_timeout_s:
            log.warning("controller %s silent for %.1f s: killing this host's procs", self.env.controller, silent)
            self.shutdown(AgentExit.CONTROLLER_SILENT, f"the controller was silent for {silent:.1f} s")

    def shutdown(self, code: AgentExit = AgentExit.SHUTDOWN, why: str = "") -> None:
        """Kill every proc and exit with ``code``; first tell the controller ``why`` unless it asked."""
        if code != AgentExit.SHUTDOWN:  # the host is lost now, for this reason (its procs' exits follow)
            exiting: AgentExitingHeader = {"kind": Kind.AGENT_EXITING, "why": why or code.why}
            self.channel.send(CONTROLLER, exiting)
        self.pools.clear()
        for server in self.servers.values():
            server.kill()  # dead first: its exit, reaped below, is this shutdown's (no warning of it)
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2.0
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.005)
        self._leave_relay()
        if self.relay is not None:
            self.relay.close()
        self.channel.close()
        self.link.close()
        self.heartbeats.close()
        if self.env.run_id:  # files of messages that were never received (their receiver died)
            shm.remove_orphans(self.env.run_id)
        shutil.rmtree(self.folder, ignore_errors=True)
        os._exit(int(code))

    def main(self) -> None:
        signal.set_wakeup_fd(self._sigchld_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_terminate", True))  # acted on by the next check
        self.channel.add_reader(self._sigchld_r, self._on_sigchld)
        if self.link.fd >= 0:
            self.channel.add_reader(self.link.fd, self.link.on_readable)
        self.channel.connect(self.env.controller, self.trust)
        self.channel.every(self.env.orphan_check_s, self._check_parent)
        interval = self.env.heartbeat_interval_s
        self.channel.every(interval, self._heartbeat, phase_s=tick_phase_s(self.name, interval))
        hello: AgentHelloHeader = {"kind": Kind.AGENT_HELLO, "pid": os.getpid(), "host": self.name}
        self.channel.send(CONTROLLER, hello)
        self._check_parent()
        self.channel.run_forever()


def _close_pipe(child: ChildProc, fd: int) -> None:
    """Close ``child``'s output pipe ``fd`` through the file object that owns it: an ``os.close``
    of the bare number would leave the file object to close it again when it is collected, by
    then perhaps another pipe's (a new fork's) reused number."""
    for pipe in (child.popen.stdout, child.popen.stderr):
        if pipe is not None and not pipe.closed and pipe.fileno() == fd:
            pipe.close()
            return
    try:
        os.close(fd)
    except OSError:
        pass


def _local_ip_toward(controller: str) -> str:
    """This host's address on the way to the controller at ``controller`` (``tcp://IP:PORT``): a
    relay binds there, where its peers (which reach the same controller) can reach it.

    Raises:
        ValueError: ``controller`` is not a tcp:// address (an ipc:// one is this machine's own agent).
    """
    if not controller.startswith("tcp://"):
        raise ValueError(f"a relay needs a tcp:// controller address, not {controller!r}")
    ip = controller[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return local_ip_for(ip)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    HostAgent(sys.argv[1], AgentEnv.from_env(os.environ)).main()


if __name__ == "__main__":
    main()
