"""Proc heartbeats through the host agent: one message per host per interval reaches the controller.

A proc heartbeats 4 times a second; with every proc sending straight to the controller, the
controller's cost grows with procs (about 175 µs of its CPU per heartbeat, most of it the wake-up
per message: docs/scale.md). Here a proc writes its heartbeat (its fields and a sequence number)
to a small file of its own in the host agent's run folder, overwritten in place by one
``pwrite`` (a CRC-32 in front, so that a read that met a write half done is seen as such and
skipped); the agent reads its procs' files once per interval, on its own heartbeat tick, and puts them into its heartbeat
(:class:`~.protocol.AgentHeartbeatHeader`): the identities heard since its last one (a new
sequence number) and the fields of those whose fields changed. No message and no wake-up per
proc heartbeat, anywhere: the controller's work per idle proc is one timestamp, its messages per
interval one per host (every second interval while the host has nothing new to say:
:class:`IdleCadence`); the agent's is one file read per proc per interval.

Detection stays where it was: a proc's exit is the agent's SIGCHLD, pushed at once; a proc silent
for the hang timeout is hung, seen up to one interval later than with direct heartbeats (the
agent reads on its next tick); a silent host is the agent's own heartbeats missing.

Why the files carry no HMAC: they live in the agent's run folder (mode 0700, the user's own), a
file is JSON read as plain data (nothing unpickled), and the agent reads only the files named
after its own children's pids. ``config.heartbeats_via_agents = False`` keeps the older path
(each proc heartbeats to the controller), for comparison (bench/scale.py measures both).

Classes:
    :class:`HeartbeatRelay`: the agent's end (the folder, each child's last beat, the summary).
    :class:`HeartbeatSender`: the proc's end (writes one beat; never blocks on the agent).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .protocol import HeartbeatFields

__all__ = ["HeartbeatRelay", "HeartbeatSender", "IdleCadence", "RelaySummary", "FOLDER_NAME", "IDLE_HEARTBEAT_EVERY",
           "HEARTBEAT_SLOTS", "tick_phase_s", "frame_beat", "unframe_beat"]

log = logging.getLogger(__name__)

#: The beats' folder inside the agent's run folder.
FOLDER_NAME = "heartbeats"
#: Longest beat file read (bytes); a heartbeat is a few hundred. Longer ones are dropped.
MAX_BEAT_BYTES = 1 << 16
#: An agent whose heartbeat would say nothing new (every proc heard, no field, load or stopped
#: proc changed) sends it every this many intervals (:class:`IdleCadence`): an idle cluster's
#: controller hears half the messages; a silent host is still lost within ``hang_timeout_s`` +
#: this many intervals.
IDLE_HEARTBEAT_EVERY = 2
#: Agents tick in this many slots of the heartbeat interval, chosen by host name
#: (:func:`tick_phase_s`), so that the controller's IO thread gets the heartbeats of 1/8 of the
#: hosts at a time and wakes once per slot, not once per message: at 1,024 simulated hosts its
#: idle CPU went from ~26 % to ~17 % of a core (one slot: ~15 %; bench/scale.py).
HEARTBEAT_SLOTS = 8


def tick_phase_s(host: str, interval_s: float, slots: int = HEARTBEAT_SLOTS) -> float:
    """When in each ``interval_s`` (seconds past a multiple of it, wall clock) ``host``'s agent
    ticks: one of ``slots`` evenly spaced slots, by a CRC-32 of the host's name, the same on every
    machine (``Channel.every``'s ``phase_s``)."""
    return interval_s * (zlib.crc32(host.encode()) % slots) / slots


def beat_path(folder: str, pid: int) -> str:
    """The file proc ``pid`` writes its heartbeat to."""
    return os.path.join(folder, f"{pid}.json")


@dataclass(frozen=True)
class RelaySummary:
    """What the agent's next heartbeat says of its procs (the procs heard since the last one).

    Attributes:
        heard: identities heard whose fields are the same as last sent.
        changed: identity -> its latest fields, for those heard whose fields changed (or first heard).
    """

    heard: tuple[str, ...] = ()
    changed: dict[str, HeartbeatFields] = field(default_factory=dict)
    complete: bool = True  # every proc with a rank was heard (False: one was silent, or has not beaten yet)


@dataclass
class _Seen:
    seq: int = -1  # the last sequence number read
    sent: HeartbeatFields | None = None  # the fields as last summarized, None: never


class HeartbeatRelay:
    """The agent's end: the beats' folder and what it last read of each child.

    Args:
        run_folder: the agent's run folder (private to the user); the beats go in a folder inside it.
        children: () -> (pid, identity) of the agent's procs that have a rank (not spares).
        enabled: False: no folder (``config.heartbeats_via_agents`` off): procs heartbeat to the controller.

    Attributes:
        folder: the beats' folder, "" when disabled or it could not be made.
        dropped: beat files that were unreadable (not JSON, too long, no sequence number, a CRC-32
            that does not match: a read that met a write half done, or the empty file of a sender
            that has just opened it).
    """

    def __init__(self, run_folder: str, children: Callable[[], Iterable[tuple[int, str]]], *, enabled: bool = True) -> None:
        self._children = children
        self._seen: dict[int, _Seen] = {}  # pid -> what was read of it
        self.dropped = 0
        self.folder = ""
        if not enabled:
            return
        folder = os.path.join(run_folder, FOLDER_NAME)
        try:
            os.mkdir(folder, 0o700)
        except OSError as exc:
            log.warning("no heartbeat folder (%s): procs heartbeat to the controller", exc)
            return
        self.folder = folder

    def summary(self) -> RelaySummary:
        """Read every child's beat file: those with a new sequence number since the last summary
        are heard (with their fields where they changed)."""
        heard: list[str] = []
        changed: dict[str, HeartbeatFields] = {}
        if not self.folder:
            return RelaySummary()
        complete = True
        for pid, identity in self._children():
            beat = self._read(pid)
            if beat is None:
                complete = False
                continue
            seq, fields = beat
            seen = self._seen.setdefault(pid, _Seen())
            if seq == seen.seq:
                complete = False
                continue  # silent since the last summary
            seen.seq = seq
            if fields == seen.sent:
                heard.append(identity)
            else:
                seen.sent = fields
                changed[identity] = fields
        return RelaySummary(tuple(heard), changed, complete)

    def _read(self, pid: int) -> tuple[int, HeartbeatFields] | None:
        try:
            with open(beat_path(self.folder, pid), "rb") as f:
                data = f.read(MAX_BEAT_BYTES + 1)
        except OSError:  # not written yet (a proc starting), or gone
            return None
        try:
            if len(data) > MAX_BEAT_BYTES:
                raise ValueError("too long")
            beat = json.loads(unframe_beat(data))
            return int(beat.pop("seq")), beat
        except (ValueError, TypeError, KeyError, AttributeError):
            self.dropped += 1
            return None

    def forget(self, pid: int) -> None:
        """``pid`` exited: its beats end with it (a new incarnation starts as never heard)."""
        self._seen.pop(pid, None)
        if self.folder:
            try:
                os.unlink(beat_path(self.folder, pid))
            except OSError:
                pass

    def close(self) -> None:
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""


class IdleCadence:
    """Which of the agent's heartbeat ticks send a heartbeat: every tick while it has something new
    to say, every :data:`IDLE_HEARTBEAT_EVERY`-th tick while it has not.

    Nothing new: every proc was heard (:attr:`RelaySummary.complete`), no proc's fields changed,
    and the host's load and stopped procs are what the last heartbeat said. The procs heard in a
    skipped tick are sent with the next heartbeat, so the controller takes them as heard when it
    gets it: up to one interval later than they were, never earlier (a proc is never judged
    silent for longer than it was; a hang is seen at most one interval later on an idle host).
    A proc that goes silent makes the very next tick send.
    """

    def __init__(self, every: int = IDLE_HEARTBEAT_EVERY) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1 tick, not {every}")
        self.every = every
        self._held: dict[str, None] = {}  # heard in skipped ticks, in order
        self._said: tuple[float, tuple[str, ...]] | None = None  # (load, stopped procs) as last sent
        self._quiet = 0  # ticks skipped since the last heartbeat

    def take(self, summary: RelaySummary, load: float, stopped: Iterable[str], *, force: bool = False) -> RelaySummary | None:
        """This tick's summary in, the one to send out (with the procs heard in skipped ticks), or
        None: skip this tick. ``force``: send this tick whatever it says (a relay with its
        members' heartbeats to pass on, a member going straight to the controller again)."""
        state = (load, tuple(sorted(stopped)))
        self._held.update(dict.fromkeys(summary.heard))
        if (not force and summary.complete and not summary.changed and state == self._said
                and self._quiet + 1 < self.every):
            self._quiet += 1
            return None
        self._quiet, self._said = 0, state
        heard, self._held = tuple(self._held), {}
        return RelaySummary(heard, summary.changed, summary.complete)


class HeartbeatSender:
    """The proc's end: writes its heartbeat to its file in the agent's beats folder ``folder``.

    The file is opened once and each beat overwrites it in place with one ``pwrite`` (padded with
    spaces over a longer beat before it; :func:`frame_beat`): ~2 µs a beat on this machine's ext4,
    where writing a file aside and renaming it over the last took ~100 µs of metadata work a beat
    (128 procs: 512 a second; docs/scale.md). A beat that cannot be written (the folder is gone:
    the agent exited, and this proc follows it) is dropped and counted; a file unlinked under an
    open descriptor is seen (``fstat``) and the beat opens the path again, as does one whose
    descriptor was closed by other code and now names another file (never written to).
    """

    def __init__(self, folder: str) -> None:
        self.pid = os.getpid()
        self.path = beat_path(folder, self.pid)
        self._fd = -1  # opened at the first beat
        self._file = (0, 0)  # the open file's (device, inode)
        self._length = 0  # the longest beat written: a shorter one is padded over it
        self._seq = 0
        self._lock = threading.Lock()  # any thread may beat (an import announces itself at once)
        self.failures = 0

    def send(self, fields: HeartbeatFields) -> bool:
        """Write one heartbeat (any thread); False when it was dropped."""
        with self._lock:
            self._seq += 1
            data = frame_beat(json.dumps({"seq": self._seq, **fields}).encode())
            try:
                if self._fd >= 0:
                    seen = os.fstat(self._fd)
                    if (seen.st_dev, seen.st_ino) != self._file:  # the descriptor was closed under us and is another file's now
                        self._close(owned=False)
                    elif seen.st_nlink == 0:  # unlinked: the next beat would go nowhere
                        self._close()
                if self._fd < 0:
                    self._open()
                self._length = max(self._length, len(data))
                os.pwrite(self._fd, data.ljust(self._length), 0)
                return True
            except OSError as exc:  # the next beat opens the path again (never writes through a stale descriptor)
                self._close(owned=exc.errno != errno.EBADF)  # EBADF: closed under us
                self.failures += 1
                if self.failures == 1:
                    log.warning("heartbeat to the host agent dropped (%s)", exc)
                return False

    def close(self) -> None:
        """Close the beat file (the file stays: the agent removes it when this proc exits)."""
        with self._lock:
            self._close()

    def _open(self) -> None:
        """Open the beat file at :attr:`path` (again, when the one open was unlinked). Raises OSError."""
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        opened = os.fstat(self._fd)
        self._file = (opened.st_dev, opened.st_ino)

    def _close(self, owned: bool = True) -> None:
        """Let the descriptor go; close it only if ``owned`` (not when other code closed it under
        us: its number may be another file's now)."""
        if owned and self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._length = -1, 0


_HEX_DIGITS = b"0123456789abcdef"


def frame_beat(beat: bytes) -> bytes:
    """One beat file's bytes: the CRC-32 of ``beat`` (8 hex digits and a space), then ``beat``."""
    return b"%08x %s" % (zlib.crc32(beat), beat)


def unframe_beat(data: bytes) -> bytes:
    """The beat in a beat file's ``data`` (:func:`frame_beat`, trailing padding allowed).

    Raises:
        ValueError: no CRC in front, or one that does not match (a read that met a write half
            done, or a file not written by :class:`HeartbeatSender`).
    """
    crc, beat = data[:8], data[9:].rstrip(b" ")
    if len(crc) < 8 or data[8:9] != b" " or crc.strip(_HEX_DIGITS) or int(crc, 16) != zlib.crc32(beat):
        raise ValueError("beat file without a matching CRC-32")
    return beat
