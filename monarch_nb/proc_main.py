"""The program every proc runs: the runtime's worker core with the features' worker plugins.

The host agent starts ``python -m monarch_nb.proc_main <identity>``, or, for a warm spare,
``python -m monarch_nb.proc_main --spare <fd> [module ...]``: a spare imports the modules (torch,
the workload), writes one byte to ``fd`` and waits for its spec (one JSON line on stdin, see
:func:`monarch_nb.runtime.launch.proc_specs`); then it becomes that rank's proc. This is where
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
from .runtime import proc
from .runtime.protocol import ProcEnv
from .train import group_worker

PLUGINS = (faults_worker.install, debug_worker.install, group_worker.install)


def _wait_as_spare(ready_fd: int, preload: list[str]) -> str:
    """Import ``preload``, say so on ``ready_fd``, then read the spec: return the identity."""
    proc.die_with_parent(int(os.environ.get("MONARCH_NB_AGENT_PID", "0")))
    sys.path[:0] = [p for p in json.loads(os.environ.get("MONARCH_NB_SYS_PATH", "[]")) if p not in sys.path]
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a spare that cannot preload still serves, just slower
            print(f"spare: preloading {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    line = sys.stdin.buffer.readline()
    if not line:  # the agent retired this spare
        os._exit(0)
    spec = json.loads(line)
    os.environ.update(ProcEnv.from_json(spec["env"]).to_env())
    return spec["identity"]


def main() -> None:
    if sys.argv[1] == "--spare":
        identity = _wait_as_spare(int(sys.argv[2]), sys.argv[3:])
    else:
        identity = sys.argv[1]
    proc.main(identity, PLUGINS)


if __name__ == "__main__":
    main()
