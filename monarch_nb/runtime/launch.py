"""Starting things: the local host agent process, and the specs of the procs a host agent starts.

:class:`LocalAgent` runs ``python -m monarch_nb.runtime.host_agent NAME`` on this machine, in a
session of its own (a terminal's Ctrl-C reaches the controller, which decides). :func:`proc_specs`
gives, for each point of a proc mesh, what its host agent needs to start it: the identity, the
environment (:class:`~monarch_nb.runtime.protocol.ProcEnv`: torchrun's variables, coordinates,
per-rank device visibility) and the working directory.

Environment of a new proc: the controller's ``os.environ`` as it is when ``spawn_procs`` runs,
plus the proc's own variables. A restart reuses the spec, so a restarted proc gets the
environment its mesh was spawned with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Sequence

from ..actor.shape import Extent
from ..supervision.records import proc_identity
from .protocol import AgentEnv, ProcEnv

__all__ = ["LocalAgent", "proc_specs", "spare_proc_env", "package_root", "RUN_DIR_PREFIX", "sweep_stale_run_dirs"]

#: Temporary folders of a controller or host agent: ``<tmp>/monarch_nb-<pid>-...``.
RUN_DIR_PREFIX = "monarch_nb-"


def package_root() -> str:
    """The folder holding the ``monarch_nb`` package (put on the children's PYTHONPATH)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LocalAgent:
    """The host agent process of this machine.

    Args:
        name: its name and routing identity (``"host0"``).
        env: what it is started with.
    """

    def __init__(self, name: str, env: AgentEnv):
        self.name = name
        environ = dict(os.environ)
        environ.update(env.to_env())
        environ["PYTHONPATH"] = os.pathsep.join(p for p in [package_root(), environ.get("PYTHONPATH", "")] if p)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "monarch_nb.runtime.host_agent", name],
            env=environ,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout_s: float) -> None:
        """Wait for it to exit; SIGKILL it after ``timeout_s`` seconds."""
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def proc_specs(
    mesh: str,
    extent: Extent,
    hosts: list[str],
    placements: dict[str, dict],
    *,
    heartbeat_interval_s: float,
    master: tuple[str, int],
    python: str = "",
    threads: dict[str, int] | None = None,
    preload: Sequence[str] = (),
) -> list[dict]:
    """The start specs of every proc of mesh ``mesh``, in rank order.

    Args:
        mesh: the proc mesh's name.
        extent: its dims; ranks are laid out host-major over ``hosts``.
        hosts: host agent names, one per host.
        placements: host -> ``{"controller", "base_env", "run_id"}`` (see ``Hosts.placement``):
            the controller's address as that host reaches it, whether its procs inherit the
            controller's environment (this machine only) and the shared-memory run id.
        heartbeat_interval_s: seconds between a proc's heartbeats.
        master: (address, port) of the mesh's rendezvous store (``MASTER_ADDR``, ``MASTER_PORT``).
        python: the interpreter to start the procs with ("" for this one); their actors' own
            ``this_host().spawn_procs()`` use it too (``MONARCH_NB_PYTHON``).
        threads: host -> CPU threads per proc (``MONARCH_NB_CPU_THREADS``, and ``OMP_NUM_THREADS``
            unless the controller's environment sets it, as torchrun does): the cores of the
            host's machine shared among this mesh's procs on it.
        preload: modules every proc of the mesh imports (torch, the trainer): its host agent
            forks the procs from a server that imported them once.

    Returns:
        One dict per proc: ``{"identity", "rank", "host", "env" (ProcEnv as JSON), "base_env"
        (the controller's environment now, or None), "cwd", "preload"}`` (``preload``: the
        modules its host agent's fork server imports, see :mod:`.forkserver`; ``[]`` for none).
    """
    world = extent.nelements
    per_host = world // max(1, len(hosts))
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in [package_root(), base_env.get("PYTHONPATH", "")] if p)
    specs = []
    for point in extent.points():
        host = hosts[min(point.rank // per_host, len(hosts) - 1)]
        where = placements[host]
        env = ProcEnv(
            controller=where["controller"],
            rank=point.rank,
            local_rank=point.rank % per_host,
            world_size=world,
            local_world_size=per_host,
            group_rank=point.rank // per_host,
            coords=dict(point),
            extent=dict(extent),
            heartbeat_interval_s=heartbeat_interval_s,
            run_id=where["run_id"],
            sys_path=[p for p in sys.path if p],
            # torchrun's variables: env:// finds the controller's store, which every rank (rank 0
            # too) joins as a client, as under torchrun's agent
            extra={"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "TORCHELASTIC_USE_AGENT_STORE": "True",
                   **({"MONARCH_NB_PYTHON": python} if python else {}),
                   **_thread_env(threads.get(host) if threads else None)},
        )
        specs.append({
            "identity": proc_identity(mesh, point.rank),
            "rank": point.rank,
            "host": host,
            "env": env.to_json(),
            "base_env": base_env if where["base_env"] else None,
            "cwd": os.getcwd() if where["base_env"] else None,
            "preload": list(preload),
            **({"python": python} if python else {}),
        })
    return specs


def spare_proc_env(proc_env: dict) -> dict:
    """The part of a proc's :class:`ProcEnv` (as JSON) that every proc of its mesh on its host
    shares: what a warm spare or a fork server imports with, before it takes a rank. The CPU
    thread budget is kept (OpenMP reads it when torch is imported); ``rank`` is -1."""
    shared = {k: v for k, v in proc_env.items() if k not in ("rank", "local_rank", "group_rank", "coords", "extra")}
    shared["extra"] = {k: v for k, v in proc_env["extra"].items() if k in ("OMP_NUM_THREADS", "MONARCH_NB_CPU_THREADS")}
    shared["rank"] = -1
    return shared


def _thread_env(threads: int | None) -> dict[str, str]:
    if threads is None:
        return {}
    env = {"MONARCH_NB_CPU_THREADS": str(threads)}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def sweep_stale_run_dirs() -> int:
    """Remove run folders (and worker status files) of processes that are gone (their pid is in
    the name); return how many."""
    removed = 0
    root = tempfile.gettempdir()
    for entry in os.listdir(root):
        if not entry.startswith(RUN_DIR_PREFIX):
            continue
        pid_text = entry[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _pid_exists(int(pid_text)):
            continue
        path = os.path.join(root, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:  # a worker loop's status file
            try:
                os.unlink(path)
            except OSError:
                pass
        removed += 1
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
