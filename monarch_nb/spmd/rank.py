"""The worker side of a script run: one actor per rank runs the script as ``__main__``.

The script runs on the actor's thread (not the proc's main thread: ``signal.signal`` raises
there, as in any thread), with ``sys.argv`` set to ``[script, *args]``, the script's folder first
on ``sys.path`` and the working directory the controller's (where it exists on this host), as
``python script.py ARGS`` would have them. After it, the default process group it left behind is
destroyed, so the next run can form one again; modules it imported stay imported (the point of
reserving the mesh: the second run does not import torch again).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from ..actor.endpoint import Actor, endpoint

__all__ = ["ScriptRank", "ScriptExited"]


class ScriptExited(RuntimeError):
    """The script called ``sys.exit`` with a non-zero status or a message (its ``code`` attribute)."""

    _STATUS = "the script exited with status "
    _MESSAGE = "the script exited: "

    def __init__(self, code: object):
        self.code = code
        super().__init__(f"{self._STATUS}{code}" if isinstance(code, int) else f"{self._MESSAGE}{code}")

    @classmethod
    def read(cls, remote: dict) -> tuple[int, str] | None:
        """What a ScriptExited says, as its caller received it (``ActorError.remote``, a plain-data
        traceback: the exception stays on the rank): the process status (the script's int, or 1
        for a message, as Python's own exit) and the message ("" for an int); None for another error."""
        if remote.get("type") != cls.__qualname__:
            return None
        said = str(remote.get("message", ""))
        if said.startswith(cls._STATUS):
            try:
                return int(said[len(cls._STATUS):]), ""
            except ValueError:
                pass
        return 1, said.removeprefix(cls._MESSAGE)


class ScriptRank(Actor):
    """Runs a script as ``__main__`` on this rank (see the module docstring)."""

    @endpoint
    def run(self, path: str, args: list[str], cwd: str | None, synced_root: str | None = None) -> int:
        """Run ``path`` with ``sys.argv = [path, *args]``; once it returned (or exited 0), return
        the number of lines it printed through ``sys.stdout`` and ``sys.stderr`` (the controller
        waits for them, so a run's last lines come before its end). Where ``path`` (or ``cwd``)
        does not exist on this host but lies in ``synced_root`` (the controller's folder that
        ``sync_workspace`` copied), this host's copy of it is used.

        Raises:
            ScriptExited: it called ``sys.exit`` with a non-zero status.
            FileNotFoundError: ``path`` does not exist on this host, nor in its workspace copy.
            whatever the script raises (its traceback is the caller's ActorError; the frames stay
                here for ``%mesh debug``).
        """
        path = _here(path, synced_root)
        cwd = _here(cwd, synced_root) if cwd else cwd
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist on this host (sync it there with `%mesh sync` or "
                                    "procs.sync_workspace(), or run from a folder every host shares)")
        saved_argv, saved_path, saved_cwd = list(sys.argv), list(sys.path), os.getcwd()
        saved_streams = sys.stdout, sys.stderr
        out, err = _LineCounter(sys.stdout), _LineCounter(sys.stderr)
        sys.stdout, sys.stderr = out, err  # counting proxies of the streams
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(path))
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise ScriptExited(exc.code) from None
        finally:
            out.flush()
            err.flush()
            sys.stdout, sys.stderr = saved_streams
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.chdir(saved_cwd)
            _destroy_default_group()
        return out.lines + err.lines


def _here(path: str, synced_root: str | None) -> str:
    """``path`` if it exists on this host, else its place in this host's workspace copy when it
    lies in ``synced_root``, else ``path``."""
    from ..runtime.proc import current
    from ..runtime.workspace_files import inside

    proc = current()
    copy = proc.env.workspace if proc is not None else ""
    if os.path.exists(path) or not synced_root or not copy:
        return path
    if os.path.abspath(path) == os.path.abspath(synced_root):
        return copy
    rel = inside(path, synced_root)
    return path if rel is None else os.path.join(copy, rel)


class _LineCounter:
    """A text stream that counts the newlines written through it (and passes everything on)."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.lines = 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _destroy_default_group() -> None:
    """Destroy the default process group the script left (if it used torch.distributed at all)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers are gone: dropping it is all that is left to do
            pass
