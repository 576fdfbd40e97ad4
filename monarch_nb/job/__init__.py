"""Jobs (a feature): what starts worker loops on hosts and hands back their addresses, as in Monarch's ``monarch.job``.

A job is an object with a lifecycle: ``apply()`` starts its hosts' worker loops (idempotent),
``state()`` attaches them and returns a :class:`JobState` whose attributes are the requested host
meshes (``job.state().trainers``), ``kill()`` ends them. The running allocation is written to a
small state file (``.monarch/job_state.json`` by default), so a restarted kernel calling
``state()`` again re-attaches instead of submitting a new job.

- :class:`LocalJob`: worker loops on this machine (tests, a laptop, one big box).
- :class:`SSHJob`: worker loops started on hosts through the system ``ssh``.
- :class:`SlurmJob`: worker loops started by ``srun`` inside an ``sbatch`` allocation.
- :mod:`.placement`: ``--hosts``/``--ca`` and ``--job``/``--mesh`` (of ``%mesh start`` and
  ``monarch-nb train``) resolved to an attached host mesh.

May import: the core and ``runtime``. Never another feature.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "Job": "monarch_nb.job.base",
    "JobState": "monarch_nb.job.base",
    "job_load": "monarch_nb.job.base",
    "LocalJob": "monarch_nb.job.local",
    "SSHJob": "monarch_nb.job.ssh",
    "SlurmJob": "monarch_nb.job.slurm",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("monarch_nb.job", _EXPORTS, globals())
