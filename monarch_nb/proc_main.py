"""The program every proc runs: the runtime's worker core with the features' worker plugins.

The host agent starts ``python -m monarch_nb.proc_main <identity>``, or, for a warm spare,
``python -m monarch_nb.proc_main --spare <fd> [module ...]``: a spare imports the modules (torch,
the workload), writes one byte to ``fd`` and waits for its spec (one JSON line on stdin, see
:func:`monarch_nb.runtime.launch.proc_specs`); then it becomes that rank's proc. With
``--forkserver <sock> <fd> [module ...]`` it is a fork server
(:mod:`monarch_nb.runtime.forkserver`): it imports the modules once and each proc forked from it
continues here as a spare does, waiting for its spec on stdin. This is where
the worker is composed: :mod:`monarch_nb.runtime.proc` knows no feature, and each feature's
worker side (``faults.worker``, ``debug.worker``, ``train.group_worker``) installs itself here as
a plugin.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from .debug import worker as debug_worker
from .faults import worker as faults_worker
from .runtime import forkserver, proc, workspace_reload
from .runtime.protocol import ProcEnv
from .train import group_worker

PLUGINS = (faults_worker.install, debug_worker.install, group_worker.install, workspace_reload.install)


def _preload(preload: list[str]) -> None:
    """Import ``preload`` (after the controller's ``sys.path``); a module that fails is reported, not fatal."""
    sys.path[:0] = [p for p in json.loads(os.environ.get("MONARCH_NB_SYS_PATH", "[]")) if p not in sys.path]
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a spare that cannot preload still serves, just slower
            print(f"spare: preloading {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def _take_spec() -> str:
    """Wait for the spec on stdin (a spare, or a proc forked from a server); return the identity."""
    proc.die_with_parent(int(os.environ.get("MONARCH_NB_AGENT_PID", "0")))
    line = sys.stdin.buffer.readline()
    if not line:  # the agent retired this spare
        os._exit(0)
    spec = json.loads(line)
    os.environ.update(ProcEnv.from_json(spec["env"]).to_env())
    return spec["identity"]


def main() -> None:
    if sys.argv[1] == "--spare":
        proc.die_with_parent(int(os.environ.get("MONARCH_NB_AGENT_PID", "0")))
        _preload(sys.argv[3:])
        os.write(int(sys.argv[2]), b"r")
        os.close(int(sys.argv[2]))
        identity = _take_spec()
    elif sys.argv[1] == "--forkserver":
        proc.die_with_parent(int(os.environ.get("MONARCH_NB_AGENT_PID", "0")))
        forkserver.serve(int(sys.argv[2]), int(sys.argv[3]), lambda: _preload(sys.argv[4:]))
        identity = _take_spec()  # in a proc forked from the server
        forkserver.retitle([sys.executable, "-m", "monarch_nb.proc_main", identity])
    else:
        identity = sys.argv[1]
    proc.main(identity, PLUGINS)


if __name__ == "__main__":
    main()
