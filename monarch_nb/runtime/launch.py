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
import subprocess
import sys
from typing import Callable

from ..actor.shape import Extent
from ..supervision.records import proc_identity
from .protocol import AgentEnv, ProcEnv

__all__ = ["LocalAgent", "proc_specs", "package_root"]


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
    *,
    controller: str,
    heartbeat_interval_s: float,
    run_id: str,
    master_port: int,
    visibility: Callable[[int], dict],
    python: str = "",
) -> list[dict]:
    """The start specs of every proc of mesh ``mesh``, in rank order.

    Args:
        mesh: the proc mesh's name.
        extent: its dims; ranks are laid out host-major over ``hosts``.
        hosts: host agent names, one per host.
        controller: the controller's address.
        heartbeat_interval_s: seconds between a proc's heartbeats.
        run_id: the shared-memory run id ("" for none).
        master_port: the mesh's rendezvous store port (``MASTER_PORT``; ``MASTER_ADDR`` is 127.0.0.1).
        visibility: ``visibility(local_rank) -> dict`` of device-visibility variables.
        python: the interpreter to start the procs with ("" for this one); their actors' own
            ``this_host().spawn_procs()`` use it too (``MONARCH_NB_PYTHON``).

    Returns:
        One dict per proc: ``{"identity", "rank", "host", "env" (ProcEnv as JSON),
        "base_env" (the controller's environment now), "cwd"}``.
    """
    world = extent.nelements
    per_host = world // max(1, len(hosts))
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in [package_root(), base_env.get("PYTHONPATH", "")] if p)
    specs = []
    for point in extent.points():
        local_rank = point.rank % per_host
        env = ProcEnv(
            controller=controller,
            rank=point.rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=per_host,
            group_rank=point.rank // per_host,
            coords=dict(point),
            extent=dict(extent),
            heartbeat_interval_s=heartbeat_interval_s,
            run_id=run_id,
            sys_path=[p for p in sys.path if p],
            extra={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), **visibility(local_rank),
                   **({"MONARCH_NB_PYTHON": python} if python else {})},
        )
        specs.append({
            "identity": proc_identity(mesh, point.rank),
            "rank": point.rank,
            "host": hosts[min(point.rank // per_host, len(hosts) - 1)],
            "env": env.to_json(),
            "base_env": base_env,
            "cwd": os.getcwd(),
            **({"python": python} if python else {}),
        })
    return specs
