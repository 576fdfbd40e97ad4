"""The controller's workspace syncs: a local folder copied to hosts, only what changed, and reloaded.

:meth:`Workspaces.sync` scans the folder (:func:`~.workspace_files.scan`), then sends each host's
agent one ``workspace`` message: the whole manifest, with the contents of the files this host's
agent is not known to hold (per agent incarnation: a replaced agent is sent everything). The
agent makes its copy the manifest and answers what it wrote, removed, and still lacks (a file its
controller thought it held); those are sent in a second round. Files are read when sent: one
written to during the sync is sent as it is then (with that hash), one removed is left out. Everything travels on the
controller's own channel to the agent: signed, and CurveZMQ-encrypted across hosts.

The copy is first on ``sys.path`` of every proc the agent starts afterwards (restarts and warm
spares included). Running procs reload on request (``auto_reload``): a ``reload`` request each
(:mod:`.workspace_reload`), answered with the modules reloaded and those whose new code raised.

A host whose agent is replaced (its worker loop restarted it after a loss) is sent the workspace
again as soon as the new agent says hello, before any proc can be started there: the copy is
rescanned from the folder then, so it is what the folder holds at that moment.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

from ..actor.workspace import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES, HostSync, ModuleReload, WorkspaceSync, WorkspaceSyncError
from ..supervision.records import HostRecord, ProcRecord, ProcState
from .protocol import Kind, WorkspaceHeader, WorkspaceSyncedHeader
from .workspace_files import FileEntry, Manifest, read_current, scan

if TYPE_CHECKING:
    from ..actor.future import Future
    from ..transport.channel import Channel

__all__ = ["Workspaces", "WorkspacesController"]

log = logging.getLogger(__name__)

#: Rounds of "send what it lacks" before a host is reported as failing (the second sends what the
#: controller wrongly thought the agent held).
_ROUNDS = 2


class WorkspacesController(Protocol):
    """What :class:`Workspaces` uses of the controller."""

    @property
    def channel(self) -> "Channel": ...

    @property
    def hosts(self) -> dict[str, HostRecord]: ...

    def resolve_host(self, host: str) -> HostRecord: ...

    def send_request(self, rec: ProcRecord, kind: Kind, body: bytes, buffers: list, op: str) -> "Future": ...


@dataclass(frozen=True)
class _Source:
    """What was synced to a host last: rescanned for a replacement agent."""

    path: str
    exclude: tuple[str, ...]
    max_bytes: int
    max_files: int


@dataclass
class _Pending:
    """A ``workspace`` message awaiting its host's answer."""

    host: str
    agent_pid: int
    manifest: Manifest
    done: threading.Event = field(default_factory=threading.Event)
    reply: WorkspaceSyncedHeader | None = None


class Workspaces:
    """The controller's room for workspace syncs (see the module docstring)."""

    def __init__(self, controller: WorkspacesController):
        self._c = controller
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._held: dict[str, tuple[int, dict[str, FileEntry]]] = {}  # host -> (agent pid, what it holds)
        self._sources: dict[str, _Source] = {}
        self._root: str | None = None
        self._sync_lock = threading.Lock()

    @property
    def root(self) -> str | None:
        """The local folder synced last (one workspace per controller), or None."""
        return self._root

    def sync(self, hosts: Sequence[str], path: "str | os.PathLike[str]", exclude: Sequence[str] | str | None = (),
             max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = 60.0, reload: Sequence[ProcRecord] = (),
             max_files: int = DEFAULT_MAX_FILES) -> WorkspaceSync:
        """Copy folder ``path`` to ``hosts`` (names as meshes give them, "localhost" for this
        machine), then have those of ``reload``'s procs that run on these hosts reload their
        changed modules. Blocks until every host
        answered (or ``timeout_s``). One sync at a time: a second waits for the first.

        Raises:
            TypeError, ValueError: a bad argument or an unknown host (nothing was sent).
            NotADirectoryError, WorkspaceTooLarge, WorkspaceError: from the scan (nothing was sent).
            WorkspaceSyncError: a host is lost, refused the copy, or did not answer in time (the
                other hosts were synced).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"the workspace is a folder's path (str or os.PathLike), got {type(path).__name__}")
        patterns = (exclude,) if isinstance(exclude, str) else tuple(exclude or ())
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"exclude takes .gitignore-style patterns (str), got {patterns!r}")
        for name, value in (("max_bytes", max_bytes), ("max_files", max_files)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        with self._sync_lock:
            return self._sync(list(dict.fromkeys(hosts)), os.fspath(path), patterns, max_bytes, max_files, float(timeout_s),
                              reload)

    def _sync(self, hosts: list[str], path: str, exclude: tuple[str, ...], max_bytes: int, max_files: int,
              timeout_s: float, reload: Sequence[ProcRecord]) -> WorkspaceSync:
        t0 = time.monotonic()
        manifest = scan(path, exclude, max_bytes, max_files)
        records: list[HostRecord] = []
        lost: list[str] = []
        for host in hosts:
            try:
                records.append(self._c.resolve_host(host))
            except ConnectionError as exc:  # lost for now (an unknown host's ValueError is the caller's)
                lost.append(f"{host}: {exc}")
        self._root = manifest.root
        source = _Source(manifest.root, exclude, max_bytes, max_files)
        results: dict[str, HostSync] = {}
        refused: list[str] = []
        deadline = t0 + timeout_s
        todo: dict[str, list[str] | None] = {r.name: None for r in records}  # host -> paths to send (None: all it may lack)
        for _ in range(_ROUNDS):
            pending = {name: self._send(name, manifest, want) for name, want in todo.items()}
            todo = {}
            for name, request in pending.items():
                reply = self._await(request, deadline)
                if reply is None:
                    lost.append(f"{name}: no answer within {timeout_s:g} s")
                elif reply["error"]:
                    refused.append(f"{name} refused it: {reply['error']}")
                else:
                    before = results.get(name) or HostSync(name, reply["root"], (), (), 0)
                    results[name] = HostSync(name, reply["root"], (*before.written, *reply["written"]),
                                             (*before.removed, *reply["removed"]), before.bytes + reply["bytes"])
                    self._sources[name] = source
                    if reply["missing"]:
                        todo[name] = list(reply["missing"])
            if not todo:
                break
        refused += [f"{name} still lacks {', '.join((want or [])[:5])}" for name, want in todo.items()]
        targets = [r for r in reload if r.host in results]
        reloads = self._reload([r for r in targets if r.serving], manifest.root, deadline)
        done = WorkspaceSync(manifest.root, len(manifest.files), manifest.total_bytes, tuple(results.values()),
                             tuple(reloads), time.monotonic() - t0,
                             tuple((r.mesh, r.rank) for r in targets if not r.serving))
        if lost or refused:
            advice = " Sync again once the host serves (a lost host is attached again by itself)." if lost else ""
            raise WorkspaceSyncError(f"the workspace {manifest.root} did not reach every host ({len(results)} of "
                                     f"{len(results) + len(lost) + len(refused)} synced): " + "; ".join(lost + refused) +
                                     "." + advice)
        return done

    def _send(self, host: str, manifest: Manifest, want: list[str] | None) -> int:
        """Send ``host`` the manifest with the files it lacks (``want``, or all it is not known to
        hold), read now (a file changed since the scan is sent as it is now); the request's id.

        Raises:
            WorkspaceError: a file that cannot be read (nothing was sent).
        """
        record = self._c.hosts[host]
        with self._lock:
            pid, held = self._held.get(host, (0, {}))
        if pid != record.pid:
            held = {}
        if want is None:
            want = [rel for rel, entry in manifest.files.items() if held.get(rel) != entry]
        current, sent, contents = read_current(manifest, want)
        with self._lock:
            request = next(self._ids)
            self._pending[request] = _Pending(host, record.pid, current)
        header: WorkspaceHeader = {"kind": Kind.WORKSPACE, "request": request, "files": sent}
        self._c.channel.send(host, header, json.dumps(current.to_json()).encode(), contents)
        return request

    def _await(self, request: int, deadline: float) -> WorkspaceSyncedHeader | None:
        pending = self._pending[request]
        pending.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._pending.pop(request, None)
        return pending.reply

    def on_synced(self, header: WorkspaceSyncedHeader) -> None:
        """A host agent's answer (IO thread): what it holds now is remembered, a waiter woken."""
        with self._lock:
            pending = self._pending.get(int(header.get("request", -1)))
            if pending is None:
                return
            if not header.get("error"):
                missing = set(header.get("missing", []))
                self._held[pending.host] = (pending.agent_pid, {rel: entry for rel, entry in pending.manifest.files.items()
                                                                if rel not in missing})
            pending.reply = header
        pending.done.set()

    def on_agent_hello(self, host: str) -> None:
        """A host's agent said hello (IO thread): a replacement for one that held a workspace is
        sent it again now, ahead of any proc spawned there (FIFO), its answer not awaited."""
        source = self._sources.get(host)
        record = self._c.hosts.get(host)
        if source is None or record is None or record.state != ProcState.HEALTHY:
            return
        try:
            manifest = scan(source.path, source.exclude, source.max_bytes, source.max_files)
            request = self._send(host, manifest, None)
        except (OSError, ValueError) as exc:
            log.warning("could not sync the workspace %s to %s's new agent again: %s", source.path, host, exc)
            return
        threading.Thread(target=self._await, args=(request, time.monotonic() + 60.0), daemon=True,
                         name="monarch_nb-workspace-resync").start()

    def _reload(self, records: Sequence[ProcRecord], synced_root: str, deadline: float) -> list[ModuleReload]:
        body = json.dumps({"synced_root": synced_root}).encode()
        futures = [(r, self._c.send_request(r, Kind.RELOAD, body, [], "reload")) for r in records]
        out = []
        for rec, future in futures:
            try:
                got = future.get(timeout=max(0.1, deadline - time.monotonic()))
                out.append(ModuleReload(rec.mesh, rec.rank, tuple(got["reloaded"]), dict(got["failed"])))
            except Exception as exc:  # the proc died or did not answer: its reload failed, the others stand
                out.append(ModuleReload(rec.mesh, rec.rank, (), {"*": f"{type(exc).__name__}: {exc}"}))
        return out

