"""A training run's options, checked before any worker starts (:func:`make_options`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..faults.spec import FaultSpec, check_faults, parse_fault
from .sharding import check_parallelism
from .workloads import Workload, get_workload

__all__ = ["TrainOptions", "make_options", "CHAOS_KINDS"]

#: fault kinds a chaos schedule draws from by default
CHAOS_KINDS = ("kill", "hang", "exit", "segfault", "raise", "nan")


@dataclass
class TrainOptions:
    """Everything a run needs, validated (see :func:`~monarch_nb.train.fit` for the meaning).

    Times are seconds; ``window_steps`` None means windows sized to last about ``window_s``;
    ``snapshot_every`` None means snapshots as often as ``snapshot_budget`` of the step time
    allows, 0 means none. ``procs`` is the number of ranks (``procs_per_host`` on each host of
    ``host_mesh``; ``host_mesh`` None: this machine).

    ``loop`` is what every rank runs: a built-in ``workload``'s loop, or the user's training
    function (``workload`` None). For a function, ``steps`` and ``global_batch`` are what its
    ``ft.batches`` asks for, known once the ranks are set up (:meth:`learn_geometry`); until then
    they are 0.
    """

    loop: Any  # monarch_nb.train.trainer.TrainingLoop
    name: str
    workload: Workload | None
    procs: int
    procs_per_host: int
    host_mesh: Any
    steps: int
    faults: list
    seed: int
    lr: float
    global_batch: int
    backend: str | None
    chaos_mtbf_s: float | None
    chaos_kinds: tuple
    eval_every: int
    collective_timeout_s: float
    restart_timeout_s: float
    chunk_bytes: int
    checkpoint_dir: str | None
    checkpoint_every: int
    resume: bool
    report_json: str | None
    keep_parameters: bool
    spares: int
    window_steps: int | None
    window_s: float
    pipeline: int
    snapshot_every: int | None
    snapshot_budget: float
    num_samples: int = field(default=0)
    group_size: int = 1
    parallelism: Any = "ddp"

    @property
    def sharded(self) -> bool:
        """The model is split inside replica groups (``group_size > 1`` or a parallelism other than "ddp")."""
        return (self.group_size, self.parallelism) != (1, "ddp")

    def learn_geometry(self, num_samples: int, global_batch: int, steps: int) -> None:
        """What the ranks' ``ft.batches`` asked for (a training function's run), checked as
        :func:`make_options` checks a workload's.

        Raises:
            ValueError: fewer samples per step than ranks, or a fault at a step the run never reaches.
        """
        if global_batch < self.procs:
            raise ValueError(f"batch_size {global_batch} is smaller than the {self.procs} ranks: every rank needs at "
                             f"least one sample per step; use batch_size >= {self.procs}")
        self.global_batch, self.steps, self.num_samples = global_batch, steps, num_samples
        check_faults(self.faults, self.procs, steps)


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def check_report_path(path: str | None) -> None:
    """Check that ``path`` can be the report's JSON file (``report_json``) before a run starts.

    Missing folders above it are made when the report is written.

    Raises:
        ValueError: ``path`` is a folder, lies under a file, or in a folder this user cannot
            write to (the message names a path that works).
    """
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"report_json {path!r} is a folder; give a file's path, e.g. {os.path.join(path, 'report.json')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # the nearest folder that exists: the rest is made on writing
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"report_json {path!r} lies under {folder!r}, which is a file; give a path in a folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"report_json {path!r}: this user cannot write in {folder!r}; give a path in a folder you can write to")


def _host_count(hosts: Any) -> int:
    """How many hosts ``hosts`` (None: this machine, or a HostMesh) has.

    Raises:
        TypeError: ``hosts`` is something else (the message says where a HostMesh comes from).
    """
    if hosts is None:
        return 1
    from ..actor.mesh import HostMesh

    if not isinstance(hosts, HostMesh):
        raise TypeError(
            f"hosts must be a HostMesh, got {type(hosts).__name__}: attach the workers with "
            "monarch_nb.attach_to_workers(['tcp://HOST:PORT', ...], ca=KEYS) or take a job's "
            "(job.state().trainers); leave hosts out to train on this machine")
    if len(hosts) == 0:
        raise ValueError("hosts is an empty HostMesh: attach at least one worker")
    return len(hosts)


def check_backend(backend: str | None) -> None:
    """Refuse a collective backend the host cannot run, naming the fix.

    Raises:
        ValueError: not "gloo", "nccl" or None; or "nccl" on a host with no GPU.
    """
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' (RCCL on ROCm) or None for automatic, got {backend!r}")
    if backend == "nccl":
        from .. import device

        gpus = device.detect_gpus()
        if not gpus.count:
            raise ValueError(
                "backend 'nccl' needs an NVIDIA (CUDA) or AMD (ROCm) GPU and this host has none visible; "
                "use backend 'gloo' (--backend gloo), or leave the backend out to get gloo on CPU and nccl on GPUs"
            )


def make_options(
    workload: "str | Workload | Callable[..., Any]" = "digits",
    procs: int = 4,
    steps: int = 300,
    faults: "list[str | FaultSpec | dict] | None" = None,
    seed: int = 0,
    *,
    lr: float | None = None,
    batch_size: int | None = None,
    text: str | None = None,
    backend: str | None = None,
    chaos_mtbf_s: float | None = None,
    chaos_kinds: "tuple[str, ...]" = CHAOS_KINDS,
    eval_every: int = 50,
    collective_timeout_s: float | None = None,
    restart_timeout_s: float = 60.0,
    chunk_bytes: int = 4 << 20,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    report_json: str | None = None,
    keep_parameters: bool = False,
    spares: int = 1,
    window_steps: int | None = None,
    window_s: float = 0.1,
    pipeline: int = 2,
    snapshot_every: int | None = None,
    snapshot_budget: float = 0.005,
    hosts: Any = None,
    args: tuple = (),
    kwargs: dict | None = None,
    actor_args: tuple = (),
    actor_kwargs: dict | None = None,
    group_size: int = 1,
    parallelism: "str | Callable[..., Any]" = "ddp",
) -> TrainOptions:
    """Check every option and build :class:`TrainOptions`; nothing is started.

    ``workload`` is a built-in workload's name, a :class:`Workload`, or a training function
    written with ``ft`` (run on every rank with ``args`` and ``kwargs``; its ``ft.batches``
    decides the steps and the batch, so ``steps``, ``batch_size``, ``lr`` and ``text`` are not
    taken then), or an actor class's endpoint written with ``ft`` (``MyTrainer.train``: each rank
    makes its own ``MyTrainer(*actor_args, **actor_kwargs)`` and runs the endpoint, see
    :class:`~monarch_nb.train.trainer.EndpointLoop`).

    ``group_size`` and ``parallelism`` split the model inside replica groups of ``group_size``
    ranks (``"fsdp"``: FSDP2 over the group, HSDP across groups; or ``parallelize(model,
    device_mesh)``); fault tolerance then works across groups (see :mod:`.sharding`).

    Raises:
        ValueError: a bad value, ``report_json`` included (the message names the option and the fix).
        TypeError: ``hosts`` is not a HostMesh; a function given options only a workload takes.
        FileNotFoundError: the ``text`` file does not exist.
    """
    from ..config import config
    from ..actor.endpoint import Endpoint, EndpointProperty
    from .trainer import EndpointLoop, TrainingLoop
    from .workload_loop import workload_loop

    _positive_int("procs", procs)
    per_host = procs
    procs = per_host * _host_count(hosts)
    check_backend(backend)
    specs = [parse_fault(f) for f in (faults or [])]
    if isinstance(workload, Endpoint):
        raise TypeError(f"{workload.name} is an endpoint of a spawned actor mesh: pass the class's endpoint "
                        f"(e.g. MyTrainer.{workload.name}); each rank of the run makes its own actor "
                        "(actor_args=/actor_kwargs= for its constructor)")
    if isinstance(workload, EndpointProperty):
        workload = EndpointLoop(workload, actor_args, actor_kwargs)
    elif actor_args or actor_kwargs:
        raise TypeError("actor_args=/actor_kwargs= are for an actor class's endpoint (mt.start(MyTrainer.train, ...))")
    if callable(workload) and not isinstance(workload, (Workload, str)):
        given = [name for name, value in (("batch_size", batch_size), ("lr", lr), ("text", text)) if value is not None]
        if given:
            raise TypeError(f"a training function decides its own {', '.join(given)} (ft.batches(..., batch_size=...), "
                            "its optimizer): pass them as args=/kwargs= of the function instead")
        loop = TrainingLoop(workload, tuple(args), kwargs)
        wl, global_batch, lr_used = None, 0, 0.0
        check_faults(specs, procs, None)
        steps = 0
    else:
        _positive_int("steps", steps)
        wl = get_workload(workload, text=text, seed=seed)
        if procs > wl.num_train:
            raise ValueError(f"{procs} procs but the {wl.name} training set has only {wl.num_train} samples; use fewer procs")
        global_batch = batch_size or wl.default_batch
        if global_batch < 1:
            raise ValueError(f"batch_size must be positive, got {global_batch}")
        if global_batch > wl.num_train:
            raise ValueError(f"batch_size {global_batch} is larger than the {wl.name} training set ({wl.num_train} samples)")
        if global_batch < procs:
            raise ValueError(f"batch_size {global_batch} is smaller than the {procs} ranks: every rank needs at least "
                             f"one sample per step; use batch_size >= {procs} or fewer procs")
        check_faults(specs, procs, steps)
        lr_used = lr or wl.default_lr
        loop = TrainingLoop(workload_loop, (wl, lr_used, global_batch, steps), name=wl.name)
    if chaos_mtbf_s is not None:
        _positive_number("chaos_mtbf_s", chaos_mtbf_s)
    _positive_int("eval_every", eval_every, 0)
    _positive_int("checkpoint_every", checkpoint_every, 0)
    _positive_int("spares", spares, 0)
    _positive_int("pipeline", pipeline)
    if window_steps is not None:
        _positive_int("window_steps", window_steps)
    _positive_number("window_s", window_s)
    if snapshot_every is not None:
        _positive_int("snapshot_every", snapshot_every, 0)
    _positive_number("snapshot_budget", snapshot_budget)
    _positive_number("restart_timeout_s", restart_timeout_s)
    check_report_path(report_json)
    if checkpoint_every and not checkpoint_dir:
        raise ValueError("checkpoint_every needs checkpoint_dir (the folder to write the checkpoints to)")
    if (group_size, parallelism) != (1, "ddp"):  # a sharded run
        check_parallelism(parallelism, group_size, procs)
    if collective_timeout_s is None:
        collective_timeout_s = max(10.0, 4 * config.hang_timeout_s)
    _positive_number("collective_timeout_s", collective_timeout_s)
    return TrainOptions(
        loop=loop, name=loop.name, workload=wl, procs=procs, steps=steps, faults=specs, seed=seed, lr=lr_used,
        procs_per_host=per_host, host_mesh=hosts, global_batch=global_batch, backend=backend, chaos_mtbf_s=chaos_mtbf_s,
        chaos_kinds=tuple(chaos_kinds),
        eval_every=eval_every, collective_timeout_s=collective_timeout_s, restart_timeout_s=restart_timeout_s,
        chunk_bytes=chunk_bytes, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
        report_json=report_json, keep_parameters=keep_parameters, spares=spares, window_steps=window_steps,
        window_s=window_s, pipeline=pipeline, snapshot_every=snapshot_every, snapshot_budget=snapshot_budget,
        num_samples=wl.num_train if wl is not None else 0, group_size=group_size, parallelism=parallelism,
    )
