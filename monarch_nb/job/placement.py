"""Where ``%mesh start`` and ``monarch-nb train`` put their procs: this host, the workers named
by ``--hosts``, or a saved job's hosts (``--job``).

- ``%mesh start 4``: four procs on this machine (``this_host()``).
- ``%mesh start 2 --hosts tcp://h1:26600,h2:26600 --ca DIR``: attaches the worker loops at those
  addresses (``monarch-nb worker --address ...``; :func:`monarch_nb.attach_to_workers`) and puts
  2 procs on each: dims ``{"hosts": H, "gpus": 2}``. ``--ca`` (the folder or file made by
  ``monarch-nb keys``) may be left out only when every address is this machine's loopback.
- ``%mesh start 2 --job .monarch/job_state.json [--mesh NAME]``: loads the job written there
  (:func:`monarch_nb.job.job_load`) and re-attaches its running hosts (``job.state()``), using its
  first host mesh or ``NAME``.

Hosts attached by ``%mesh start`` are detached by ``%mesh stop`` (their worker loops then wait
for the next controller; a job's allocation keeps running). Nothing here imports IPython: errors
are :class:`PlacementError`, which the magic shows as a usage error and the CLI as its message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["PlacementError", "Placement", "parse_workers", "resolve", "procs_per_host", "run_placed"]

#: ``--hosts`` values that mean this machine (no worker loop, no port)
_THIS_HOST = ("localhost", "127.0.0.1")


class PlacementError(ValueError):
    """The procs cannot be placed as asked (the message says how to fix it)."""


@dataclass
class Placement:
    """Where the procs go: ``host_mesh`` (None: this machine), how to say it (``where``), and
    the hosts attached for it (``attached``: ``%mesh stop`` detaches them, so their workers wait
    for the next controller)."""

    host_mesh: Any = None
    where: str = "this host"
    attached: list = field(default_factory=list)


def parse_workers(spec: str) -> list[str]:
    """``"tcp://h1:26600,h2:26600"`` -> ``["tcp://h1:26600", "tcp://h2:26600"]`` (the scheme is
    optional; ``[::1]:26600`` for IPv6).

    Raises:
        PlacementError: an entry without a port, a bad port, or a repeated address.
    """
    out: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        address = item if item.startswith("tcp://") else f"tcp://{item}"
        match = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d+)", address)
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise PlacementError(f"--hosts: {item!r} is not HOST:PORT (or tcp://HOST:PORT), the address "
                                 "`monarch-nb worker --address` listens on, e.g. --hosts 10.0.0.2:26600,10.0.0.3:26600")
        if address in out:
            raise PlacementError(f"--hosts: {item} is given twice; each worker is one host of the mesh")
        out.append(address)
    if not out:
        raise PlacementError("--hosts needs at least one HOST:PORT")
    return out


def run_placed(command: str, args: Any, main: "Callable[[Placement], int]") -> int:
    """A command's body on the hosts of its ``--hosts``/``--ca``/``--job``/``--mesh`` (``args``):
    ``main(placement)``'s exit status, or 2 with ``monarch-nb COMMAND: error: ...`` on stderr for
    options that cannot be placed. Hosts attached for it are detached after (their worker loops
    wait for the next controller; a job keeps running)."""
    import sys

    try:
        placement = resolve(args.hosts, args.job, args.ca, args.mesh)
    except ValueError as exc:
        print(f"monarch-nb {command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return main(placement)
    finally:
        if placement.attached:
            from ..runtime.controller import Controller

            Controller.get().detach_hosts(placement.attached)


def resolve(hosts: str | None, job: str | None, ca: str | None, mesh: str | None) -> Placement:
    """The hosts of ``--hosts``/``--ca`` or ``--job``/``--mesh`` (attached); this machine when neither.

    Raises:
        PlacementError: bad or conflicting options, missing keys, a job that is not running, a
            worker that cannot be attached (the message names the fix).
    """
    if hosts and job:
        raise PlacementError("give --hosts or --job, not both")
    if mesh and not job:
        raise PlacementError("--mesh picks one of a job's host meshes: use it with --job FILE")
    if ca and not (hosts or job):
        raise PlacementError("--ca gives the keys of the workers in --hosts; without --hosts the procs run here")
    if not job and (not hosts or all(h.strip() in _THIS_HOST for h in hosts.split(",") if h.strip())):
        return Placement()
    from ..runtime.controller import Controller

    controller = Controller.get()
    known = set(controller.hosts)
    try:
        if job:
            placement = _from_job(job, mesh)
        else:
            assert hosts  # without --job and --hosts this machine was returned above
            placement = _from_workers(parse_workers(hosts), ca)
    except PlacementError:  # forget what this call attached before it failed (a worker of several)
        controller.detach_hosts([name for name in controller.hosts if name not in known])
        raise
    placement.attached = [name for name in placement.host_mesh.host_names if name not in known]
    return placement


def _from_workers(workers: list[str], ca: str | None) -> Placement:
    from ..actor.host_attach import attach_to_workers
    from ..runtime.worker_loop import is_loopback

    remote = [w for w in workers if not is_loopback(w)]
    if remote and ca is None:
        raise PlacementError(
            f"--hosts: {', '.join(remote)} {'is' if len(remote) == 1 else 'are'} not on this machine: give the cluster's keys "
            "with --ca DIR, the folder made by `monarch-nb keys DIR` that each worker was started with "
            "(`monarch-nb worker --address tcp://HOST:PORT --curve-keys DIR`)")
    if ca is not None and not os.path.exists(ca):
        raise PlacementError(f"--ca {ca}: no such file or folder; make the cluster's keys with `monarch-nb keys {ca}` "
                             "and start each worker with them")
    try:
        host_mesh = attach_to_workers(workers, ca=ca)
    except (ConnectionError, ValueError, PermissionError, FileNotFoundError) as exc:
        raise PlacementError(f"--hosts {','.join(workers)}: {exc}") from None
    return Placement(host_mesh, f"{len(workers)} host(s) ({', '.join(workers)})")


def _from_job(path: str, mesh: str | None) -> Placement:
    from ..job import job_load

    try:
        job = job_load(path)
    except FileNotFoundError:
        raise PlacementError(f"--job {path}: no such file; a job writes its state there when job.state() runs "
                             "(default .monarch/job_state.json)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise PlacementError(f"--job {path}: {exc}") from None
    names = list(job.meshes)
    if mesh is not None and mesh not in names:
        raise PlacementError(f"--mesh {mesh!r}: the job in {path} has the host meshes {', '.join(names)}")
    if not job.active:
        raise PlacementError(
            f"--job {path}: its {type(job).__name__} is not running any more; start it again in Python "
            f"(`from monarch_nb.job import job_load; job_load({path!r}).state(cached_path={path!r})`) and rerun this")
    chosen = mesh or names[0]
    try:
        state = job.state(cached_path=path)
    except (ConnectionError, TimeoutError, ValueError) as exc:
        raise PlacementError(f"--job {path}: its hosts could not be attached: {exc}") from None
    return Placement(getattr(state, chosen), f"host mesh {chosen!r} of the {type(job).__name__} in {path}")


def procs_per_host(placement: Placement, n: int | None, gpus: int | None, hosts_record: dict) -> int:
    """How many procs ``%mesh start`` puts on each attached host: N or --gpus N, else one per GPU
    the hosts report (the fewest among them), else 1.

    Raises:
        PlacementError: --gpus N on a host reporting fewer GPUs.
    """
    counts = {}
    for name in placement.host_mesh.host_names:
        record = hosts_record.get(name)
        inventory = (record.detail.get("gpus") if record is not None else None) or {}
        counts[name] = int(inventory.get("count", 0)) if isinstance(inventory, dict) else 0
    if gpus is not None:
        short = {h: c for h, c in counts.items() if c < gpus}
        if short:
            raise PlacementError(f"--gpus {gpus}: {', '.join(f'{h} has {c}' for h, c in short.items())} visible GPU(s); "
                                 f"use `%mesh start {gpus} --hosts ...` for CPU procs")
        return gpus
    if n is not None:
        return n
    fewest = min(counts.values(), default=0)
    return fewest if fewest > 0 else 1
