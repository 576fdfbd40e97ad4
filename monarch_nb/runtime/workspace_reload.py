"""Worker side of a workspace sync: a running proc reloads the workspace modules that changed.

Installed into every proc (:func:`install`). A ``reload`` request (sent by
:meth:`.workspaces.Workspaces.sync` with ``auto_reload``) reloads, with :func:`importlib.reload`,
each imported module whose source lies in this host's workspace copy (``ProcEnv.workspace``) and
was modified after the module was imported or last reloaded (a finder first on ``sys.meta_path``
notes when each module is looked up), whichever sync changed it. They are reloaded in the order
their imports completed, so a module that imports another finds the new one. As with IPython's
autoreload, names bound by ``from mod import f`` elsewhere keep the old object, while ``mod.f``
gives the new one; a module whose new code raises keeps its old version, is reported, and is
tried again at the next reload. The reload runs on a thread of its own (the IO thread keeps heartbeats going)
and answers ``{"reloaded": [names], "failed": {name: error}}``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import capture_traceback
from .protocol import CallHeader, Kind

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


def stale_modules(root: str, times: ImportTimes | None = None) -> list[str]:
    """Names of the imported modules whose source is in folder ``root`` and changed since their
    import, in the order to reload them: their import's completion order (a module's imports
    complete before it does, so dependencies come first)."""
    times = times or _import_times
    prefix = os.path.join(os.path.abspath(root), "")
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.endswith(".py") and os.path.abspath(path).startswith(prefix) \
                and times.changed_since_import(name, path):
            names.append(name)
    return names


def reload_stale(root: str) -> dict[str, Any]:
    """Reload :func:`stale_modules` of ``root``; ``{"reloaded": [...], "failed": {name: error}}``."""
    importlib.invalidate_caches()  # new files of the workspace are found by later imports
    if root and root not in sys.path:
        sys.path.insert(0, root)
    reloaded, failed = [], {}
    for name in stale_modules(root) if root else []:
        module = sys.modules.get(name)
        if module is None:
            continue
        try:
            importlib.reload(module)
            reloaded.append(name)
        except Exception as exc:  # the user's new code: reported, the old module stays
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
                proc.reply(header, True, reload_stale(proc.env.workspace))
            except Exception as exc:
                log.exception("workspace reload failed")
                proc.reply(header, False, capture_traceback(exc))

        threading.Thread(target=run, name="monarch_nb-reload", daemon=True).start()

    proc.register(Kind.RELOAD, on_reload)
