"""Worker side of a workspace sync: a running proc reloads the workspace modules that changed.

Installed into every proc (:func:`install`). A ``reload`` request (sent by
:meth:`.workspaces.Workspaces.sync` with ``auto_reload``) reloads, with :func:`importlib.reload`,
each imported module of the workspace (loaded from this host's copy, ``ProcEnv.workspace``, or
from the controller's folder where the proc shares its filesystem) whose file in the copy was
modified after the module was imported or last reloaded (a finder first on ``sys.meta_path``
notes when each module is looked up), whichever sync changed it. They are reloaded in the order
their imports completed, so a module that imports another finds the new one. As with IPython's
autoreload, names bound by ``from mod import f`` elsewhere keep the old object, while ``mod.f``
gives the new one; a module whose new code raises gets its old namespace back (what ran of the
new code before the error is undone), is reported, and is tried again at the next reload. The
reload runs on a thread of its own (the IO thread keeps heartbeats going) and answers ``{"reloaded": [names], "failed": {name: error}}``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import capture_traceback
from .protocol import CallHeader, Kind
from .workspace_files import inside

if TYPE_CHECKING:
    from .proc import Proc

__all__ = ["install", "stale_modules", "reload_stale"]

log = logging.getLogger(__name__)


class ImportTimes:
    """When each module was last imported (or reloaded), ns since the epoch: a meta path finder
    that only notes the time of every lookup and finds nothing (the real finders do)."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        self.at[name] = time.time_ns()
        return None

    def changed_since_import(self, name: str, source: str) -> bool:
        try:
            return os.stat(source).st_mtime_ns > self.at.get(name, 0)
        except OSError:
            return False  # gone: nothing to reload from


_import_times = ImportTimes()


def stale_modules(copy: str, synced_root: str = "", times: ImportTimes | None = None) -> list[str]:
    """Names of the imported modules of the workspace whose copy changed since their import, in
    the order to reload them: their imports' completion order (a module's imports complete
    before it does, so dependencies come first).

    A module of the workspace is one loaded from the host's ``copy``, or from ``synced_root``
    (the controller's folder, which a proc sharing its filesystem may have imported from before
    the first sync): its file in the copy is what counts.
    """
    times = times or _import_times
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py"):
            continue
        rel = inside(path, copy)
        if rel is None and synced_root:
            rel = inside(path, synced_root)
        if rel is not None and times.changed_since_import(name, os.path.join(copy, rel)):
            names.append(name)
    return names


def reload_stale(copy: str, synced_root: str = "") -> dict[str, Any]:
    """Reload :func:`stale_modules`; ``{"reloaded": [...], "failed": {name: error}}``. A module
    found again on ``sys.path`` (the copy first) is loaded from the copy; one whose new code
    raises gets its old namespace back."""
    importlib.invalidate_caches()  # new files of the workspace are found by later imports
    if copy and copy not in sys.path:
        sys.path.insert(0, copy)
    reloaded, failed = [], {}
    for name in stale_modules(copy, synced_root) if copy else []:
        module = sys.modules.get(name)
        if module is None:
            continue
        saved = dict(module.__dict__)
        try:
            importlib.reload(module)
            reloaded.append(name)
        except Exception as exc:  # the user's new code: reported, the old module stays
            module.__dict__.clear()
            module.__dict__.update(saved)
            sys.modules[name] = module
            failed[name] = f"{type(exc).__name__}: {exc}"
            _import_times.at[name] = 0  # still the old code: stale until a reload succeeds
    return {"reloaded": reloaded, "failed": failed}


def install(proc: "Proc") -> None:
    """Handle ``reload`` requests on ``proc`` (its workspace copy is ``proc.env.workspace``) and
    start noting import times."""
    if _import_times not in sys.meta_path:
        sys.meta_path.insert(0, _import_times)

    def on_reload(header: CallHeader, body: Any, buffers: list[memoryview]) -> None:
        def run() -> None:
            try:
                request = json.loads(bytes(body)) if body else {}
                proc.reply(header, True, reload_stale(proc.env.workspace, str(request.get("synced_root", ""))))
            except Exception as exc:
                log.exception("workspace reload failed")
                proc.reply(header, False, capture_traceback(exc))

        threading.Thread(target=run, name="monarch_nb-reload", daemon=True).start()

    proc.register(Kind.RELOAD, on_reload)
