"""What a workspace sync did: :meth:`HostMesh.sync_workspace` and :meth:`ProcMesh.sync_workspace` return it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..errors import MonarchError

__all__ = ["WorkspaceSync", "HostSync", "ModuleReload", "WorkspaceSyncError", "human_bytes", "DEFAULT_MAX_BYTES",
           "DEFAULT_MAX_FILES"]

#: Largest workspace copied unless the caller allows more, bytes (64 MiB): it travels to every host.
DEFAULT_MAX_BYTES = 64 * 2**20
#: Most files copied unless the caller allows more (a home folder by mistake is refused fast).
DEFAULT_MAX_FILES = 10_000


class WorkspaceSyncError(MonarchError, RuntimeError):
    """A host could not take the workspace (lost, refused a file, did not answer in time). The
    other hosts' copies were made; sync again once the host serves."""


@dataclass(frozen=True)
class HostSync:
    """One host's copy after a sync.

    Attributes:
        host: the host's name. root: the copy's folder there (first on its procs' ``sys.path``).
        written: relative paths written (new or changed). removed: relative paths removed.
        bytes: bytes written.
    """

    host: str
    root: str
    written: tuple[str, ...]
    removed: tuple[str, ...]
    bytes: int


@dataclass(frozen=True)
class ModuleReload:
    """One proc's reload of the workspace's changed modules.

    Attributes:
        mesh, rank: the proc. reloaded: module names reloaded, in the order they ran.
        failed: module name -> the error its new code raised (the old module stays in use).
    """

    mesh: str
    rank: int
    reloaded: tuple[str, ...]
    failed: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkspaceSync:
    """The result of a workspace sync.

    Attributes:
        path: the local folder synced. files: how many files it holds (after exclusions).
        total_bytes: their size, bytes. hosts: each host's copy. reloads: each reloaded proc's
        modules (empty without ``auto_reload``). seconds: the sync's duration, wall clock.
        skipped: (mesh, rank) of the procs that were to reload but were not serving (dead,
        restarting): they import the new code when they start again.
    """

    path: str
    files: int
    total_bytes: int
    hosts: tuple[HostSync, ...]
    reloads: tuple[ModuleReload, ...] = ()
    seconds: float = 0.0
    skipped: tuple[tuple[str, int], ...] = ()

    @property
    def written(self) -> int:
        """Files written, summed over hosts."""
        return sum(len(h.written) for h in self.hosts)

    @property
    def failed_reloads(self) -> dict[tuple[str, int], Mapping[str, str]]:
        """(mesh, rank) -> module -> error, for the procs where a reload failed."""
        return {(r.mesh, r.rank): r.failed for r in self.reloads if r.failed}

    def summary(self) -> str:
        """One line per fact, as ``%mesh sync`` prints it."""
        lines = [f"synced {self.path}: {self.files} files ({human_bytes(self.total_bytes)}) to {len(self.hosts)} host(s) "
                 f"in {self.seconds:.2f} s; " + self._changes()]
        names = sorted({m for r in self.reloads for m in r.reloaded})
        if names:
            lines.append(f"reloaded on {len(self.reloads)} proc(s): {', '.join(names)}")
        elif self.reloads and not self.failed_reloads:
            lines.append(f"reloaded on {len(self.reloads)} proc(s): no module needed it")
        for (mesh, rank), failed in sorted(self.failed_reloads.items()):
            for module, error in failed.items():
                lines.append(f"  rank {rank} ({mesh}): reloading {module} failed: {error}")
        for mesh, rank in self.skipped:
            lines.append(f"  rank {rank} ({mesh}) is not serving: not reloaded (it imports the new code when it starts again)")
        return "\n".join(lines)

    def _changes(self) -> str:
        parts = []
        for what, paths in (("written", sorted({p for h in self.hosts for p in h.written})),
                            ("removed", sorted({p for h in self.hosts for p in h.removed}))):
            if paths:
                shown = ", ".join(paths[:8]) + (f", ... ({len(paths) - 8} more)" if len(paths) > 8 else "")
                parts.append(f"{what}: {shown}")
        return "; ".join(parts) if parts else "nothing changed"


def human_bytes(n: int) -> str:
    """``n`` bytes as people read it: ``"512 B"``, ``"48.0 KiB"``, ``"100.0 MiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
