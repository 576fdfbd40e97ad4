"""The program every proc runs: the runtime's worker core with the features' worker plugins.

The host agent starts ``python -m monarch_nb.proc_main <identity>``. This is where the worker
is composed: :mod:`monarch_nb.runtime.proc` knows no feature, and each feature's worker side
(``faults.worker``, ``debug.worker``) installs itself here as a plugin.
"""

from __future__ import annotations

import sys

from .debug import worker as debug_worker
from .faults import worker as faults_worker
from .runtime import proc

PLUGINS = (faults_worker.install, debug_worker.install)


def main() -> None:
    proc.main(sys.argv[1], PLUGINS)


if __name__ == "__main__":
    main()
