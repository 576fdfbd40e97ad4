"""Starting a training run: its procs (with warm spares), its trainers, a resumed checkpoint.

:class:`Launch` is a part of :class:`~monarch_nb.train.coordinator.Coordinator` (a mixin: it
works on the coordinator's state, on the run's training thread), kept here so that each room does
one thing. Every step of the start handles a rank's failure like a failure during training: a
proc that dies while the mesh starts makes the whole start again (with a new mesh); a rank that
fails while its trainer is built or set up is restarted and set up again without the others; no
wait is without a deadline, and a stop ends every wait at once.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import threading
import time
from functools import partial
from typing import Any, Callable

from ..errors import ActorError
from .checkpoints import latest_checkpoint
from .recovery import RankState, TrainingError
from .waits import Stopped, wait_all
from .coordinator_state import CoordinatorState
from .rank_procs import MeshProcs

__all__ = ["Launch", "SPARE_PRELOAD"]

log = logging.getLogger(__name__)

#: what a warm spare imports while it waits, so that a Trainer's setup on it is quick: torch,
#: torch._dynamo (which an optimizer's constructor imports, ~1.5 s), the kernels, the trainer and ft
SPARE_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.utils.data", "hip_ext",
                 "monarch_nb.train.trainer", "monarch_nb.train.ft", "monarch_nb.train.workload_loop")
_SNAPSHOT_N = 7_700_000_000  # the <n> of snapshot file names: a band no transport buffer reaches
_run_seq = iter(range(1 << 30))


class Launch(CoordinatorState):
    """Spawning, building and resuming, for the coordinator (see the module docstring)."""

    def _stoppable(self, fn: Callable[[], Any], on_stop: Callable[[], None]) -> Any:
        """Run ``fn`` on a helper thread; return its result, or run ``on_stop`` and raise Stopped
        if the run is stopped first (the helper then ends on its own, quietly)."""
        box: dict = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=call, name="monarch_nb-train-setup", daemon=True).start()
        while not done.wait(0.05):
            if self.run.stopping:
                on_stop()
                raise Stopped()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _mesh_name(self) -> str:
        from ..runtime.controller import Controller

        taken = Controller.get().meshes
        i = 0
        while f"train{i}" in taken:
            i += 1
        return f"train{i}"

    def _spawn(self) -> None:
        from ..actor.context import this_host
        from ..actor.mesh import HostMesh
        from ..runtime.controller import Controller
        from ..runtime.rendezvous import controller_store

        o = self.o
        self.run.phase("spawning")
        # the run's store needs torch.distributed here (1-2 s to import): meanwhile the procs start. Not a
        # daemon: an interpreter that exits meanwhile (Ctrl-C during set-up) lets the import end, instead of
        # finalizing a half-imported torch (its finalizers' TypeErrors, printed at exit)
        threading.Thread(target=_import_quietly, args=("torch.distributed",), name="monarch_nb-import", daemon=False).start()
        extra: dict = {}
        if o.spares:
            if "spares" in inspect.signature(HostMesh.spawn_procs).parameters:
                extra = {"spares": o.spares, "preload": SPARE_PRELOAD + (o.workload.preload if o.workload else ())}
                self.spares = o.spares
            else:
                log.info("this runtime keeps no warm spares; a failed rank restarts in a fresh process")
        host = o.host_mesh if o.host_mesh is not None else this_host()
        for attempt in range(3):
            name = self.mesh_name = self.run.mesh_name = self._mesh_name()

            def stop_mesh(name: str = name) -> None:
                Controller.get().stop_procs(name, timeout_s=1.0)

            try:
                self.procs = self._stoppable(partial(host.spawn_procs, per_host={"gpus": o.procs_per_host}, name=name, **extra),
                                             stop_mesh)
                break
            except RuntimeError as exc:  # a proc died or did not say hello while starting
                first = str(exc).splitlines()[0]
                if attempt == 2:
                    raise TrainingError(f"could not start {o.procs} procs: {first}") from None
                log.warning("starting the procs failed (%s); starting them again", first)
        # the run's own store (here, never in a worker; one it can abort), where every host reaches it
        self.store_host = Controller.get().rendezvous_host(self.procs.name)
        self.m.store = controller_store(self.store_host, timeout_s=o.collective_timeout_s)
        self.m.procs = MeshProcs(self.procs)
        if o.group_size > 1:
            Controller.get().set_replica_groups(self.procs.name, o.group_size)
        self.run.procs_ready(self.procs)
        self.run.unsubscribe_events = Controller.get().events.subscribe(self.m.on_event)
        self.procs.supervise("escalate", owner=self.m.supervise)  # this run restarts and heals its ranks
        self.snapshot_path = self._snapshot_name()

    def _snapshot_name(self) -> str:
        from ..runtime.controller import Controller
        from ..transport import shm

        if self.o.snapshot_every == 0 or not shm.available():
            return ""
        return os.path.join(shm.SHM_DIR, f"monarch_nb-{Controller.get().run_id}-{os.getpid()}-{_SNAPSHOT_N + next(_run_seq)}")

    def _construct(self) -> None:
        """A Trainer on every proc (a light constructor), then ``setup()`` on each rank on its own:
        a rank that fails while it sets up is restarted and set up again without the others. The
        setups say what the training function's ``ft.batches`` asked for (steps, global batch,
        dataset size): the run learns its geometry from them."""
        from ..errors import SupervisionError
        from .trainer import Trainer

        o, m = self.o, self.m
        self.run.phase("constructing")
        args = (o.loop, o.seed, self.store_host, m.store.port, o.backend, o.collective_timeout_s, o.chunk_bytes,
                o.group_size, o.parallelism)
        for rank in range(o.procs):
            m.move(rank, RankState.LIVE)
        mesh = None
        for attempt in range(4):
            self._settle_restarts()
            name = "trainer" if not attempt else f"trainer_{attempt}"
            try:
                mesh = self._stoppable(partial(_constructed_mesh, self.procs, name, Trainer, args), lambda: None)
                break
            except SupervisionError as exc:  # a proc failed meanwhile: restart it, spawn again
                if attempt == 3:
                    raise TrainingError(f"could not build the trainers: {exc}") from None
                m.fail_rank(exc.rank, exc)
            except ActorError as exc:
                raise TrainingError(f"the Trainer could not be built: {exc}") from None
        assert mesh is not None  # the loop breaks with one or raises
        ranks = mesh.flatten("rank")  # host by host: {hosts: H, gpus: G} -> rank = host * G + gpu
        m.trainers = {r: ranks.slice(rank=r) for r in range(o.procs)}
        live = m.live
        futures = {r: m.trainers[r].setup.call_one() for r in live}
        values, errors = wait_all(futures, self._setup_timeout_s(), self.run.stop_event)
        if errors and not values and all(isinstance(e, ActorError) for e in errors.values()):
            rank, first = min(errors.items())
            raise TrainingError(f"the training function {o.name} failed on every rank before its first step; "
                                f"rank {rank}: {first}")
        for rank, error in errors.items():
            m.fail_rank(rank, error)
        if values:
            self._learn_geometry(values)
        self._settle_restarts()
        if not m.live:
            raise TrainingError("no rank could set up its Trainer")

    def _setup_timeout_s(self) -> float:
        """How long the ranks' setups may take: ``restart_timeout_s`` for one rank alone, that many
        times the procs per core on a crowded machine (the setups' heavy imports take turns: 24
        ranks on 2 cores set up in about 12 rounds, a minute on a laptop)."""
        from ..runtime.controller import Controller

        try:
            crowding = Controller.get().procs_per_core(self.procs.name)
        except (AttributeError, ValueError):  # a mesh of another runtime, or already gone
            crowding = 1.0
        return self.o.restart_timeout_s * max(1.0, crowding)

    def _learn_geometry(self, setups: dict[int, dict]) -> None:
        """What the ranks' ``ft.batches`` asked for: the same on every rank, or the run cannot go on.

        Raises:
            TrainingError: ranks disagree, or the geometry is unusable (fewer samples than ranks).
        """
        o = self.o
        seen = {(v["num_samples"], v["global_batch"], v["steps"]) for v in setups.values()}
        if len(seen) > 1:
            by_rank = {r: (v["num_samples"], v["global_batch"], v["steps"]) for r, v in sorted(setups.items())}
            raise TrainingError(f"the ranks' ft.batches disagree on (dataset size, batch_size, steps): {by_rank}; "
                                "every rank must loop over the same data")
        num_samples, global_batch, steps = seen.pop()
        try:
            self.run.learn_geometry(num_samples, global_batch, steps)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        if not any(v["evaluator"] for v in setups.values()):
            o.eval_every = 0  # the function registered no ft.evaluator: nothing to evaluate

    def _settle_restarts(self) -> None:
        """Before training: wait until no rank is restarting (a rank back from a restart is set up
        and identical to the others, so it is live at once)."""
        deadline = time.monotonic() + self.o.restart_timeout_s * 3
        while self.m.restarting and time.monotonic() < deadline:
            if self.run.stopping:
                raise Stopped()
            self._wait_event(0.05)
            for rank in self.m.ready:
                self.m.move(rank, RankState.LIVE)

    def _resume(self) -> None:
        o = self.o
        if not (o.resume and o.checkpoint_dir):
            return
        path = latest_checkpoint(o.checkpoint_dir)
        if not path:
            return
        futures = {r: self.m.trainers[r].load_checkpoint.call_one(path) for r in self.m.live}
        values, errors = wait_all(futures, o.collective_timeout_s, self.run.stop_event)
        for rank, exc in errors.items():
            self.m.fail_rank(rank, exc)
        if not values:
            first = next(iter(errors.values()), None)
            raise TrainingError(f"no rank could load the checkpoint {path}" + (f": {first}" if first else ""))
        start = min(values.values())
        self.start_step = self.next_commit = self.next_dispatch = start
        self.run.step = start


def _import_quietly(name: str) -> None:
    """Import ``name`` ahead of its use (its error, if any, comes again where it is used)."""
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001
        pass


def _constructed_mesh(procs: Any, name: str, actor: type, args: tuple) -> Any:
    """``procs.spawn(name, actor, *args)`` once every actor of it is constructed (``spawn``
    returns at once); raises the constructor's ActorError or the SupervisionError of a proc that
    failed meanwhile."""
    mesh = procs.spawn(name, actor, *args)
    mesh.initialized.get()
    return mesh
