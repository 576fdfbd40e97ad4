"""Liveness on the controller: hellos, heartbeats and exits become proc states and events.

:class:`Liveness` runs on the controller's IO thread. It learns of a proc's exit from its host
agent (the agent is the parent: SIGCHLD, with the proc's last output drained first), of a hang
from heartbeats (summarized per host by its agent: :mod:`.heartbeat_relay`) missing for
``hang_timeout_s`` (``import_grace_s`` while the proc announces a heavy import), and of a
debugger pause from the heartbeats' ``paused`` field. A failure fails the calls in flight to the
proc, tells every other proc, and goes to the supervisor thread. Of its
controller it sees only :class:`LivenessController`: the records, the socket and the messenger,
the event log and the acts of the other rooms it sets off (a new rendezvous round, a failure for
the supervisor, a restarted proc's actors).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol

from ..config import config
from ..errors import SupervisionError
from ..supervision.records import SERVING, ProcRecord, ProcState, ProcTable
from ..transport.wire import route_id
from .heartbeat_relay import IDLE_HEARTBEAT_EVERY
from .protocol import FailedProc, HeartbeatFields, HelloHeader, Kind, PeerHeader, ProcExitedHeader, ProcsFailedHeader

if TYPE_CHECKING:
    from ..actor.future import Future
    from ..supervision.events import Event
    from ..supervision.records import HostRecord
    from ..transport.channel import Channel
    from .messenger import Messenger

__all__ = ["Liveness", "LivenessController"]

log = logging.getLogger(__name__)

#: The procs a host agent's word "all heard" applies to: those the hang check judges.
_HEARD_ALL = SERVING | {ProcState.HUNG}
_HUNG = ProcState.HUNG  # an Enum member read off its class costs 0.2 us (Python 3.11): 8 a host, ~2,000 hosts a second


class LivenessController(Protocol):
    """What :class:`Liveness` uses of its controller (:class:`~.controller.Controller` is one)."""

    @property
    def procs(self) -> ProcTable:
        """Proc identity -> its record (the states this room moves), each host's at hand."""

    @property
    def hosts(self) -> dict[str, HostRecord]:
        """Host agent name -> its record (its load, its last heartbeat)."""

    @property
    def channel(self) -> Channel:
        """The controller's socket: tells procs of a peer's failure or recovery."""

    @property
    def messenger(self) -> Messenger:
        """Fails the calls in flight to a failed proc, and lets them through again once it recovers."""

    def record_event(self, kind: str, rec: ProcRecord, **fields: Any) -> Event:
        """Append an event about ``rec``'s proc to the log."""

    def emit_lines(self, rec: ProcRecord | None, stream: str, lines: list[str], *, mesh: str = "", rank: int = -1,
                   partial: bool = False) -> None:
        """Hand ``lines`` of ``rec``'s proc to the output sinks (a debugger pause's hint)."""

    def flush_output(self, rec: ProcRecord) -> None:
        """Emit the partial lines ``rec``'s proc left unterminated (it exited)."""

    def signal_proc(self, identity: str, signame: str, *, stacks_first: bool = False) -> None:
        """Have the proc's host agent send it ``signame`` (fencing a hung proc: ``"SIGKILL"``, its
        Python stacks taken first with ``stacks_first``)."""

    def respawn_actors(self, rec: ProcRecord) -> list[Future]:
        """Construct every actor of ``rec``'s rank again (a restarted proc); one Future each."""

    def new_rendezvous_round(self, mesh: str) -> None:
        """Give ``mesh``'s procs a fresh rendezvous store (a member failed)."""

    def report_failure(self, rec: ProcRecord, cause: str, detail: str, signame: str | None, *, handle: bool = True) -> None:
        """Hand ``rec``'s failure to the supervisor thread (not ``handle``: recorded only). Never blocks."""


class Liveness:
    """Tracks the procs of ``controller``: their hellos, heartbeats, exits and hangs."""

    def __init__(self, controller: LivenessController) -> None:
        self.ctrl = controller

    # -- messages (IO thread) -------------------------------------------------------------------
    def on_hello(self, rec: ProcRecord, header: HelloHeader) -> None:
        if header.get("linked"):  # casts to it go through its host agent; every message numbered
            self.ctrl.channel.route_via(rec.identity, rec.host, header["pid"])
        else:
            self.ctrl.channel.route_direct(rec.identity)
        rec.pid = header["pid"]
        rec.last_heartbeat = time.monotonic()
        rec.exit_info = None
        rec.fenced = False
        rec.failure = None
        rec.started_at = rec.last_heartbeat
        if rec.state == ProcState.STOPPING:  # its mesh was stopped while it started, and neither the stop
            # nor the kill after it could reach it (its agent did not know its pid yet): it has no actor
            # to stop politely, so it is killed now (and asked to stop, should its agent still not know it)
            self.ctrl.record_event("proc_started", rec, detail=f"pid {rec.pid}; killed at once: its mesh was stopped while it started")
            self.ctrl.signal_proc(rec.identity, "SIGKILL")
            self.ctrl.channel.send(rec.identity, {"kind": Kind.STOP})
            return
        restarting = rec.move(ProcState.HEALTHY, "hello") == ProcState.RESTARTING
        if restarting:
            self._respawn_actors(rec)
        else:
            self.ctrl.record_event("proc_started", rec, detail=f"pid {rec.pid}")
            rec.ready.set()

    def on_host_heartbeats(self, host: str, heard: Iterable[str], changed: Mapping[str, HeartbeatFields]) -> None:
        """Host agent ``host`` summarized its procs' heartbeats since its last one (see
        :mod:`.heartbeat_relay`): each proc heard counts as a heartbeat now; those in ``changed``
        take their new fields. Procs of other hosts are ignored (an agent speaks for its own)."""
        now = time.monotonic()
        for identity in heard:
            rec = self.ctrl.procs.get(route_id(identity))
            if rec is None or rec.host != host:
                continue
            if rec.state == ProcState.HUNG:  # silent, then heard again: the full path (it may resume)
                self._resume_hung(rec)
            else:
                rec.last_heartbeat = now
        for identity, fields in changed.items():
            rec = self.ctrl.procs.get(route_id(identity))
            if rec is not None and rec.host == host:
                self.on_heartbeat(rec, fields)

    def on_host_heard_all(self, host: str, procs: int, now: float | None = None) -> bool:
        """Host agent ``host`` heard all its ``procs`` procs with a rank, none changed (a relay's
        :class:`~.protocol.QuietMember`): every alive proc of the host counts as heard now, in one
        write (the host's :class:`~monarch_nb.supervision.records.HostHeard`, read through
        :attr:`ProcRecord.last_heard`), and the hang check skips the host. A proc it had found
        hung, and not fenced, resumes.

        Returns False, and takes none as heard, when the controller has more serving (or hung)
        procs on ``host`` than the agent heard: the agent does not run one of them (an exit on its
        way, or a mismatch for the hang check to judge); its next heartbeat is taken afresh. The
        count is compared without a look at each record while the host has no more records than
        the agent heard (no dead proc's record kept there). ``now``: when it was heard
        (``time.monotonic()``; None: now)."""
        recs = self.ctrl.procs.on_host(host)
        if len(recs) > procs:
            judged = sum(1 for rec in recs if rec.state in _HEARD_ALL)
            if judged > procs:
                log.debug("host %s heard %d procs; the controller has %d serving there: none taken as heard", host,
                          procs, judged)
                return False
        self.ctrl.procs.host_heard(host).at = time.monotonic() if now is None else now
        for rec in recs:
            if rec.state is _HUNG:  # silent, then heard again: the full path (it may resume)
                self._resume_hung(rec)
        return True

    def _resume_hung(self, rec: ProcRecord) -> None:
        """A hung proc heard again, its fields as they were: :meth:`on_heartbeat` (it resumes unless fenced)."""
        self.on_heartbeat(rec, {"busy": rec.busy, "loading": rec.loading, "paused": rec.paused})

    def on_heartbeat(self, rec: ProcRecord, header: HeartbeatFields) -> None:
        """A heartbeat of ``rec``'s proc (straight from it, or in its agent's summary)."""
        ctrl = self.ctrl
        rec.last_heartbeat = time.monotonic()
        rec.busy = header.get("busy", {})
        rec.loading = header.get("loading", [])
        paused = header.get("paused", [])
        if bool(paused) != bool(rec.paused):  # a user is debugging it: paused, not hung
            where = ", ".join(f"{p.get('actor')}.{p.get('function')}:{p.get('line')}" for p in paused)
            ctrl.record_event("proc_paused" if paused else "proc_continued", rec, detail=where or "continued", cause="debugger")
            if paused:  # a hint where the user looks: the rank's output, in the notebook
                ctrl.emit_lines(rec, "stderr", [f"paused at breakpoint() in {where}: %mesh debug attaches"])
        rec.paused = paused
        if rec.serving:
            rec.move(ProcState.BUSY if rec.busy else ProcState.HEALTHY, "heartbeat")
        elif rec.state == ProcState.HUNG and not rec.fenced:  # it was only slow (fencing off): serving again
            rec.move(ProcState.BUSY if rec.busy else ProcState.HEALTHY, "heartbeats resumed")
            rec.failure = None
            self._tell_recovered(rec, include_starting=False)
            ctrl.record_event("proc_resumed", rec, detail="heartbeats resumed", cause="heartbeat")

    def on_exit(self, rec: ProcRecord, header: ProcExitedHeader) -> None:
        ctrl = self.ctrl
        ctrl.flush_output(rec)
        if rec.state == ProcState.FAILED and rec.failure is not None and rec.failure.cause == "host_lost":
            rec.exit_info = {**(rec.exit_info or {}), "returncode": header["returncode"], "signal": header.get("signal")}
            return  # a proc of a lost host, fenced when its host came back: already failed
        rec.exit_info = {"returncode": header["returncode"], "signal": header.get("signal")}
        rec.busy = {}
        rec.paused = []
        if rec.state == ProcState.STOPPING:
            rec.move(ProcState.STOPPED, "exit")
            ctrl.record_event("proc_stopped", rec, detail=f"exit {header['returncode']}", cause="stopped")
            return
        if rec.state == ProcState.RESTARTING and header.get("pid") == rec.restart_kill_pid:
            if header.get("on_request", True):  # a restart killed it
                ctrl.record_event("proc_stopped", rec, detail="killed to restart in place", cause="restart")
                return
            # it had died on its own before the restart's kill reached it (its exit not heard yet when
            # the restart began): logged as its own exit (the restart goes on; the restart's owner
            # may read why the old incarnation ended: MeshProcs.own_exit)
            signame = header.get("signal")
            ctrl.record_event("proc_exited", rec, cause=signame or f"exit {header['returncode']}",
                              detail=f"killed by {signame}" if signame else f"exited with code {header['returncode']}")
            return
        signame = header.get("signal")
        if rec.fenced:
            cause = "fenced"
        elif signame:
            cause = signame
        else:
            cause = f"exit {header['returncode']}"
        detail = header.get("detail") or (f"killed by {signame}" if signame else f"exited with code {header['returncode']}")
        starting = rec.move(ProcState.FAILED, "exit") == ProcState.STARTING
        ctrl.record_event("proc_exited", rec, detail=detail, cause=cause)
        self.fail_proc(rec, cause, detail, signame, supervise=not starting)

    # -- timer (IO thread) ----------------------------------------------------------------------
    def allowance_s(self, rec: ProcRecord) -> float:
        """How long ``rec`` may be silent before it is hung (seconds).

        ``hang_timeout_s``, stretched by its host's load (runnable procs per core, at most 8x: a
        starved proc is late, not hung) and raised to ``import_grace_s`` while it announces a heavy
        import. A proc its host agent reports *stopped* (SIGSTOP) gets ``hang_timeout_s`` alone:
        the OS says it is frozen, whatever it was doing.
        """
        if rec.os_stopped:
            return config.hang_timeout_s
        host = self.ctrl.hosts.get(rec.host)
        allowed = config.hang_timeout_s * min(8.0, max(1.0, host.load if host is not None else 1.0))
        return max(allowed, config.import_grace_s) if rec.loading else allowed

    def check_heartbeats(self) -> None:
        """Report procs silent past their allowance hung; fence them (SIGKILL) if configured."""
        ctrl = self.ctrl
        now = time.monotonic()
        cutoff = now - config.hang_timeout_s  # no allowance is shorter: only procs silent this long are judged
        late: list[ProcRecord] = []
        for heard, recs in ctrl.procs.by_host():
            if heard.at >= cutoff:
                continue  # its agent heard all its procs since the cutoff (on_host_heard_all): none is late
            late.extend(rec for rec in recs if rec.last_heartbeat < cutoff)  # one comparison per proc
        if not late:
            return
        host_silent_s = (IDLE_HEARTBEAT_EVERY + 1) * config.heartbeat_interval_s  # an idle agent beats every 2nd interval
        # ... and a relay passes a member's heartbeat on up to an interval later (monarch_nb.runtime.relay)
        silent_hosts = {h.name for h in ctrl.hosts.values() if h.last_heartbeat and now - h.last_heartbeat
                        > host_silent_s + (config.heartbeat_interval_s if h.via_relay else 0.0)}
        for rec in late:
            if not rec.serving or rec.host in silent_hosts:
                continue  # not serving, or its whole host is silent: a lost host (the host check's), not a hang
            allowed = self.allowance_s(rec)
            silent_s = now - rec.last_heard  # its own heartbeat, or its agent's word before the cutoff
            if silent_s > allowed:
                rec.move(ProcState.HUNG, "no heartbeat")
                detail = self._silence_detail(rec, silent_s, allowed, now)
                ctrl.record_event("proc_hung", rec, detail=detail, cause="heartbeat")
                self.fail_proc(rec, "hung", detail, None)
                if config.fence_hung:
                    rec.fenced = True
                    ctrl.signal_proc(rec.identity, "SIGKILL", stacks_first=True)  # where it hung, for the user
                    ctrl.record_event("proc_fenced", rec, detail="SIGKILL after hang", cause="fencing")

    def _silence_detail(self, rec: ProcRecord, silent_s: float, allowed_s: float, now: float) -> str:
        """Why ``rec`` is hung, with what tells a frozen proc from a late report: its allowance and
        when its host agent (which relays its heartbeats) was last heard."""
        host = self.ctrl.hosts.get(rec.host)
        why = "stopped (SIGSTOP)" if rec.os_stopped else f"host load {host.load:.2f}" if host is not None else "no host load"
        heard = f"; its host agent heard {now - host.last_heartbeat:.2f} s ago" if host is not None and host.last_heartbeat else ""
        return f"no heartbeat for {silent_s:.2f} s (allowed {allowed_s:.2f} s: {why}{heard})"

    def host_lost(self, host: str, why: str) -> None:
        """Every proc of ``host`` failed with cause ``host_lost`` (its agent is silent or gone):
        each live peer hears of them all in one message (8 procs of a lost host at 1,024 hosts:
        8,184 sends, not 65,472)."""
        ctrl = self.ctrl
        detail = f"host {host} lost: {why}"
        failed: list[ProcRecord] = []
        unsupervised: set[str] = set()
        for rec in ctrl.procs.on_host(host):  # its records only (a tuple: safe while others are written)
            if rec.state in (ProcState.FAILED, ProcState.STOPPED):
                continue
            stopping, starting = rec.state == ProcState.STOPPING, rec.state == ProcState.STARTING
            rec.move(ProcState.STOPPED if stopping else ProcState.FAILED, "host lost")
            rec.exit_info = {"returncode": None, "signal": None, "host_lost": True}
            rec.busy, rec.paused = {}, []
            if stopping:
                continue
            ctrl.record_event("proc_exited", rec, detail=detail, cause="host_lost")
            failed.append(rec)
            if starting:
                unsupervised.add(rec.identity)
        self.fail_procs(failed, "host_lost", detail, None, unsupervised=frozenset(unsupervised))
        for rec in failed:
            rec.ready.set()

    # -- failure and recovery -------------------------------------------------------------------
    def fail_proc(self, rec: ProcRecord, cause: str, detail: str, signame: str | None, *, supervise: bool = True) -> None:
        """Fail the calls in flight to ``rec``, tell the other procs, hand it to the supervisor
        (unless not ``supervise``: a proc that never served fails its ``spawn_procs``, which says so)."""
        self.fail_procs([rec], cause, detail, signame, unsupervised=frozenset() if supervise else frozenset({rec.identity}))

    def fail_procs(self, recs: list[ProcRecord], cause: str, detail: str, signame: str | None, *,
                   unsupervised: frozenset[str] = frozenset()) -> None:
        """:meth:`fail_proc` for procs that failed together for one reason (a lost host's): every
        other live proc is told of them all in one PROC_FAILED message."""
        if not recs:
            return
        ctrl = self.ctrl
        for rec in recs:
            ctrl.messenger.proc_failed(rec.identity, SupervisionError(rec.rank, cause, detail, signame))
        note = FailedProc.encode([FailedProc(rec.identity, rec.rank, cause, detail, signame) for rec in recs])
        failed: ProcsFailedHeader = {"kind": Kind.PROC_FAILED, "count": len(recs)}
        peers = self._peers({rec.identity for rec in recs}, include_starting=False)
        ctrl.channel.send_many([other.identity for other in peers], failed, note)  # one message a host
        for mesh in dict.fromkeys(rec.mesh for rec in recs):
            ctrl.new_rendezvous_round(mesh)  # after the peers know: none forms a group on the new round meanwhile
        for rec in recs:
            ctrl.report_failure(rec, cause, detail, signame, handle=rec.identity not in unsupervised)

    def _peers(self, exclude: set[str], include_starting: bool) -> list[ProcRecord]:
        return [other for other in list(self.ctrl.procs.values())
                if other.identity not in exclude and other.alive and (include_starting or other.state != ProcState.STARTING)]

    def _tell_recovered(self, rec: ProcRecord, include_starting: bool) -> None:
        self.ctrl.messenger.proc_recovered(rec.identity)
        recovered: PeerHeader = {"kind": Kind.PROC_RECOVERED, "proc": rec.identity}
        peers = self._peers({rec.identity}, include_starting)
        self.ctrl.channel.send_many([other.identity for other in peers], recovered)  # one message a host

    def _respawn_actors(self, rec: ProcRecord) -> None:
        """A restarted proc said hello: construct its actors again, then it serves."""
        ctrl = self.ctrl
        futures = ctrl.respawn_actors(rec)

        def finish() -> None:
            failed = [e for e in (f.exception() for f in futures) if e is not None]
            if failed:
                rec.move(ProcState.FAILED, "actor respawn failed")
                ctrl.record_event("proc_exited", rec, detail=f"actor respawn failed: {failed[0]}", cause="respawn")
                rec.ready.set()
                return
            self._tell_recovered(rec, include_starting=True)
            spare = " (a warm spare)" if rec.on_spare else ""
            ctrl.record_event("proc_restarted", rec, detail=f"pid {rec.pid}{spare}, restart {rec.restarts}", cause="restart")
            rec.ready.set()

        threading.Thread(target=finish, name="respawn", daemon=True).start()
