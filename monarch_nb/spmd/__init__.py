"""Run what users already have: a ``torchrun`` script on a mesh, every rank as ``__main__`` (SPMD).

``monarch-nb run --procs 4 train.py ARGS`` from a terminal, ``%mesh run train.py ARGS`` in a
notebook, or :func:`run_script` from Python. Each rank runs the script with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a
fresh rendezvous store per run, so ``init_process_group("gloo")`` with ``env://`` works
unchanged). On a rank's failure the others are stopped at once (their procs killed, no collective
timeout) and, with ``max_restarts``, the whole group runs again on restarted procs: torchrun's
semantics, but the mesh stays up between runs, so a second run pays neither for procs nor for
``import torch`` (see Monarch's ``run_spmd``: "reserve once, iterate many times").

Modules: :mod:`.rank` (the actor every rank runs the script in), :mod:`.runner` (the controller's
side: rounds, failures, restarts).
"""

from .runner import ScriptFailed, ScriptRun, run_script

__all__ = ["ScriptFailed", "ScriptRun", "run_script"]
