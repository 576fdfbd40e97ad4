"""A workspace: a local folder's files by content hash, and the copy of it a host agent keeps.

The controller scans the folder (:func:`scan`): every file under it that no exclusion names —
``.gitignore`` files in the folder and below, :data:`DEFAULT_EXCLUDE`, the caller's patterns, all
in git's syntax (matched by ``pathspec``'s ``GitIgnoreSpec``) — with its SHA-256, size and mode:
a :class:`Manifest`. A host agent holds one :class:`WorkspaceCopy`: a folder that its procs have
first on ``sys.path``, and what it wrote there. :meth:`WorkspaceCopy.apply` makes the copy the
manifest: files it is sent are checked against their hash and written atomically (a temporary
file, then ``os.replace``; the compiled cache of a changed ``.py`` is removed, so no proc imports
stale bytecode), files it already holds with the same hash are kept, files the manifest no longer
has are removed; files it lacks and was not sent are returned, to be sent again.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Callable, Iterable, Mapping, Sequence

from pathspec import GitIgnoreSpec

from ..actor.workspace import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES, human_bytes

__all__ = ["FileEntry", "Manifest", "WorkspaceError", "WorkspaceTooLarge", "WorkspaceCopy", "ApplyResult", "scan",
           "read_current", "inside", "DEFAULT_EXCLUDE"]

#: Never copied (git syntax): version control, caches, environments, notebook checkpoints.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    ".git/", ".hg/", ".svn/", "__pycache__/", "*.py[cod]", ".ipynb_checkpoints/", ".venv/", "/venv/", "/env/",
    "*.egg-info/", "node_modules/", ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", ".tox/", ".DS_Store",
)
_IGNORE_FILE = ".gitignore"


@dataclass(frozen=True)
class FileEntry:
    """One file of a workspace: ``sha256`` (hex digest of its bytes), ``size`` (bytes), ``mode``
    (permission bits, e.g. ``0o755``)."""

    sha256: str
    size: int
    mode: int

    def to_json(self) -> list:
        return [self.sha256, self.size, self.mode]

    @classmethod
    def from_json(cls, data: Sequence) -> "FileEntry":
        sha, size, mode = data
        if not isinstance(sha, str) or len(sha) != 64 or not isinstance(size, int) or not isinstance(mode, int):
            raise ValueError(f"a bad file entry {data!r}: want [sha256 hex, size, mode]")
        return cls(sha, size, mode & 0o7777)

    @classmethod
    def of(cls, data: bytes | memoryview, mode: int) -> "FileEntry":
        return cls(hashlib.sha256(data).hexdigest(), len(data), mode)


@dataclass(frozen=True)
class Manifest:
    """What a workspace holds: relative POSIX path -> :class:`FileEntry`; ``root`` the local folder."""

    root: str
    files: Mapping[str, FileEntry] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> dict[str, list]:
        return {rel: entry.to_json() for rel, entry in self.files.items()}


class WorkspaceError(ValueError):
    """The folder cannot be synced as it is (an unreadable file, a name no host can take, a bad
    pattern); the message names the file or pattern and the fix."""


class WorkspaceTooLarge(WorkspaceError):
    """The folder holds more than the limit allows; the message names the largest files and the fix."""


def _compile(lines: Sequence[str], bad: "Callable[[str, Exception], None]") -> GitIgnoreSpec:
    """``lines`` (``.gitignore`` syntax; blanks and comments dropped) as one spec; ``bad(line,
    error)`` is called for each line git would not take (it raises, or the line is skipped)."""
    good = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            GitIgnoreSpec.from_lines([line])
            good.append(line)
        except Exception as exc:  # noqa: BLE001 - pathspec raises its own error or re.error
            bad(line, exc)
    return GitIgnoreSpec.from_lines(good)


def exclusion_spec(patterns: Sequence[str], source: str = "exclude") -> GitIgnoreSpec:
    """The caller's patterns (``.gitignore`` syntax) as one spec.

    Raises:
        WorkspaceError: a pattern git would not take, named.
    """
    def refuse(line: str, exc: Exception) -> None:
        raise WorkspaceError(f"bad pattern {line!r} in {source}: {exc}") from None

    return _compile(patterns, refuse)


def _ignore_file_spec(path: str) -> GitIgnoreSpec:
    """A ``.gitignore``'s spec; lines git would not take are skipped, as git does."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return _compile(f.read().splitlines(), lambda line, exc: None)


def scan(root: str, exclude: Sequence[str] = (), max_bytes: int = DEFAULT_MAX_BYTES,
         max_files: int = DEFAULT_MAX_FILES) -> Manifest:
    """The manifest of folder ``root`` (see the module docstring). Symbolic links to files are
    followed; links to folders are not entered. The limits are checked on the files' sizes before
    anything is hashed.

    Args:
        root: the folder.
        exclude: more patterns in ``.gitignore`` syntax (``"data/*.bin"``, ``"runs/"``); they and
            :data:`DEFAULT_EXCLUDE` cannot be re-included by a ``.gitignore``. Within the
            ``.gitignore`` files, as in git, the deepest matching rule decides (``!keep.log``
            re-includes).
        max_bytes: the most bytes the files may hold together.
        max_files: the most files.

    Raises:
        NotADirectoryError: ``root`` is not a folder.
        WorkspaceTooLarge: over ``max_bytes`` or ``max_files``.
        WorkspaceError: a bad pattern, an unreadable file or folder, or a file name that is not a
            plain relative path on every host (a backslash or newline in it).
    """
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise NotADirectoryError(f"no folder {root!r} to sync")
    base = exclusion_spec([*DEFAULT_EXCLUDE, *exclude])
    specs: list[tuple[str, GitIgnoreSpec]] = []  # (folder relative to root, its .gitignore's spec)
    sizes: dict[str, int] = {}
    total = 0

    def unreadable(exc: OSError) -> None:
        raise WorkspaceError(f"cannot read {exc.filename}: {exc.strerror}; exclude it (exclude=[...] or a .gitignore "
                             "line) or make it readable") from None

    for folder, dirs, names in os.walk(root, onerror=unreadable):
        rel_folder = os.path.relpath(folder, root).replace(os.sep, "/")
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        specs = [(where, spec) for where, spec in specs if rel_folder.startswith(where)]
        if _IGNORE_FILE in names:
            specs.append((rel_folder, _ignore_file_spec(os.path.join(folder, _IGNORE_FILE))))
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(folder, d))
                         and not _excluded(f"{rel_folder}{d}/", base, specs))
        for name in sorted(names):
            rel = rel_folder + name
            path = os.path.join(folder, name)
            if _excluded(rel, base, specs) or not os.path.isfile(path):
                continue
            if "\\" in rel or "\n" in rel or "\0" in rel:
                raise WorkspaceError(f"cannot sync {rel!r}: a backslash or newline in a file name is not portable to "
                                     "every host; rename it or exclude it")
            try:
                size = os.stat(path).st_size
            except OSError as exc:
                unreadable(exc)
            sizes[rel] = size
            total += size
            if len(sizes) > max_files:
                raise WorkspaceTooLarge(f"{root} holds more than {max_files} files to sync; exclude folders "
                                        f"(exclude=[\"data/\"] or a .gitignore line) or allow more (max_files=)")
    if total > max_bytes:
        largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
        listed = ", ".join(f"{rel} ({human_bytes(size)})" for rel, size in largest)
        raise WorkspaceTooLarge(f"{root} holds {human_bytes(total)} to sync, over the {human_bytes(max_bytes)} limit; the "
                                f"largest: {listed}. Exclude them (exclude=[...] or a .gitignore line) or allow more "
                                f"(max_bytes=, or --max-mib for %mesh sync)")
    files: dict[str, FileEntry] = {}
    for rel in sizes:
        try:
            files[rel] = _entry(os.path.join(root, *rel.split("/")))
        except FileNotFoundError:
            continue  # removed since the walk: not part of the workspace
        except OSError as exc:
            unreadable(exc)
    return Manifest(root, files)


def _excluded(rel: str, base: GitIgnoreSpec, specs: list[tuple[str, GitIgnoreSpec]]) -> bool:
    """``rel`` (a folder's ends with "/") matches the base patterns, or the deepest ``.gitignore``
    rule that matches it excludes it (each matched relative to its own folder)."""
    if base.match_file(rel):
        return True
    verdict = False
    for where, spec in specs:  # root first: a deeper file's rule overrides
        include = spec.check_file(rel[len(where):]).include
        if include is not None:
            verdict = include
    return verdict


def _entry(path: str) -> FileEntry:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(digest.hexdigest(), size, stat.S_IMODE(os.stat(path).st_mode))


def read_current(manifest: Manifest, rels: Iterable[str]) -> tuple[Manifest, list[str], list[bytes]]:
    """Read ``rels`` (paths of ``manifest``) now, for sending: the manifest as it stands after the
    read (a file changed since the scan gets the hash of the bytes read, one removed since is
    dropped), the paths read and their contents, in order.

    Raises:
        WorkspaceError: a file that cannot be read.
    """
    files = dict(manifest.files)
    sent, contents = [], []
    for rel in rels:
        path = os.path.join(manifest.root, *rel.split("/"))
        try:
            with open(path, "rb") as f:
                data = f.read()
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            files.pop(rel, None)  # removed since the scan: not part of the workspace any more
            continue
        except OSError as exc:
            raise WorkspaceError(f"cannot read {path}: {exc.strerror}; exclude it or make it readable") from None
        files[rel] = FileEntry.of(data, mode)
        sent.append(rel)
        contents.append(data)
    return Manifest(manifest.root, files), sent, contents


@dataclass(frozen=True)
class ApplyResult:
    """What :meth:`WorkspaceCopy.apply` did: paths ``written`` and ``removed``, ``bytes`` written,
    and paths ``missing`` (in the manifest, neither held with that hash nor sent)."""

    written: tuple[str, ...]
    removed: tuple[str, ...]
    bytes: int
    missing: tuple[str, ...]


def inside(path: str, folder: str) -> str | None:
    """``path`` relative to ``folder`` when it lies inside it (both made absolute), else None."""
    folder = os.path.join(os.path.abspath(folder), "")
    path = os.path.abspath(path)
    return path[len(folder):] if path.startswith(folder) else None


def safe_relative(rel: str) -> str:
    """``rel`` if it is a plain relative POSIX path inside its root.

    Raises:
        ValueError: absolute, empty, or climbing out (``..``), or holding a NUL or backslash.
    """
    path = PurePosixPath(rel)
    if (not rel or "\0" in rel or "\\" in rel or path.is_absolute() or any(part in ("..", ".", "") for part in rel.split("/"))):
        raise ValueError(f"refused workspace path {rel!r}: not a plain relative path")
    return rel


class WorkspaceCopy:
    """A host's copy of the workspace, in folder ``root`` (created here; the host agent's own).

    Only the agent writes it, so what it holds is what it wrote (:attr:`files`), not rescanned.
    """

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.files: dict[str, FileEntry] = {}

    def apply(self, manifest: Mapping[str, FileEntry], sent: Mapping[str, bytes | memoryview]) -> ApplyResult:
        """Make the copy hold ``manifest`` (see the module docstring), ``sent`` the contents given.

        Raises:
            ValueError: a path that is not plain and relative, a file sent that is not in the
                manifest, or one whose bytes do not match its hash (nothing is written then).
        """
        for rel in [*manifest, *sent]:
            safe_relative(rel)
        for rel, data in sent.items():
            entry = manifest.get(rel)
            if entry is None:
                raise ValueError(f"workspace file {rel!r} was sent but is not in the manifest")
            if FileEntry.of(data, entry.mode) != entry:
                raise ValueError(f"workspace file {rel!r} arrived damaged (its bytes do not match its hash)")
        removed = tuple(rel for rel in list(self.files) if rel not in manifest)
        for rel in removed:  # first: a path may turn from a file into a folder, or back
            self._remove(rel)
            del self.files[rel]
        written, nbytes = [], 0
        for rel, data in sent.items():
            if self.files.get(rel) == manifest[rel]:
                continue
            self._write(rel, data, manifest[rel].mode)
            self.files[rel] = manifest[rel]
            written.append(rel)
            nbytes += len(data)
        missing = tuple(rel for rel, entry in manifest.items() if rel not in sent and self.files.get(rel) != entry)
        return ApplyResult(tuple(written), removed, nbytes, missing)

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def _write(self, rel: str, data: bytes | memoryview, mode: int) -> None:
        path = self._path(rel)
        folder = os.path.dirname(path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # a folder of files this copy no longer holds (only caches are left in one)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".sync-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _drop_bytecode(path)

    def _remove(self, rel: str) -> None:
        path = self._path(rel)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        _drop_bytecode(path)
        folder = os.path.dirname(path)
        while folder != self.root and os.path.isdir(folder) and not [n for n in os.listdir(folder) if n != "__pycache__"]:
            shutil.rmtree(folder)  # nothing left but compiled caches
            folder = os.path.dirname(folder)


def _drop_bytecode(path: str) -> None:
    """Remove the compiled caches of source file ``path``, for every interpreter (a same-size edit
    within a second would otherwise look unchanged to the import system, which compares the
    source's mtime in seconds and its size)."""
    if not path.endswith(".py"):
        return
    folder, name = os.path.split(path)
    for cached in glob.glob(os.path.join(glob.escape(folder), "__pycache__", glob.escape(name[:-3]) + ".*.pyc")):
        try:
            os.unlink(cached)
        except FileNotFoundError:
            pass
