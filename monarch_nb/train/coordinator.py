"""The controller's side of the step loop: windows of steps sent ahead, committed from their records.

The controller is off the steps' critical path. It sends every member of the quorum the same
*window* (``Trainer.run_window(quorum, start, count)``), and keeps ``pipeline`` windows in flight,
so a rank starts its next window the moment it finishes one, without waiting for the controller.
Each reply carries one compact record per step (loss, batch accuracy, a digest of the sample ids
the rank used, step time). A step is *committed* when every member reported it: it goes into the
:class:`~monarch_nb.train.data.SampleLedger` and out to subscribers as a metric. Windows last
about ``window_s`` seconds (``window_steps`` fixes their length; ``window_steps=1, pipeline=1`` is
the per-step loop: one round trip per step). They end early where the controller must act at a
precise step: a planned fault, an evaluation, a disk checkpoint, the last step.

The controller steps in only at a boundary (no window in flight), for: a failure (a member died,
hung, raised; the survivors' all-reduce failed), a non-finite gradient, a restarted rank ready to
rejoin, a planned fault, every replica lost. After a failure (see :mod:`.trainer` for why the
survivors are at most one step apart) the survivors agree on the last committed step
(:meth:`~.recovery.Membership.catch_up`), form a new quorum and go on from the next step; a
restarted rank is healed from a live peer and joins at the next boundary; when no replica is
left, restarted ranks load the newest shared-memory snapshot and the steps after it are redone.
Evaluations and disk checkpoints are queued on one member right behind the window that ends at
their step (messages from one sender are FIFO), so they cost no round trip either.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import statistics
import threading
import time
from typing import Any, Callable

from ..errors import ActorError
from ..faults.spec import FaultSpec
from .recovery import Membership, RankState, Stopped, TrainingError, own_failure, wait_all
from .report import TrainReport

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)

_MAX_WINDOW = 4096
#: what a warm spare imports while it waits, so that a Trainer's setup on it is quick: torch,
#: torch._dynamo (which an optimizer's constructor imports, ~1.5 s), the kernels and the trainer
SPARE_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "hip_ext", "monarch_nb.train.trainer")
_SNAPSHOT_N = 7_700_000_000  # the <n> of snapshot file names: a band no transport buffer reaches
_run_seq = iter(range(1 << 30))


class _Window:
    """Steps ``start .. start+count-1``, sent to ``members`` of ``quorum``; replies by rank."""

    __slots__ = ("id", "quorum", "members", "start", "count", "replies", "oldest_since")

    def __init__(self, wid: int, quorum: int, members: list[int], start: int, count: int):
        self.id, self.quorum, self.members, self.start, self.count = wid, quorum, tuple(members), start, count
        self.replies: dict[int, Any] = {}
        self.oldest_since = time.monotonic()

    @property
    def complete(self) -> bool:
        return len(self.replies) == len(self.members)


class Coordinator:
    """Runs one :class:`~monarch_nb.train.run.TrainingRun` on its training thread."""

    def __init__(self, run: Any):
        self.run = run
        self.o = run.options
        self.events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.m = Membership(run, self.events)
        self.procs: Any = None
        self.mesh_name = ""
        self.spares = 0
        self.windows: list[_Window] = []
        self.history: list[tuple[int, int, tuple]] = []  # (start, count, members) of every window sent
        self._wids = iter(range(1 << 62))
        self.next_commit = 0
        self.next_dispatch = 0
        self.start_step = 0
        self.recover = False
        self.nonfinite_at: int | None = None
        self.rank_next: dict[int, int] = {}
        self.planned: dict[int, list[FaultSpec]] = {}
        self.split_steps: set[int] = set()
        self.step_s: float | None = None
        self.window_counts: list[int] = []
        self.step_ms: list[float] = []
        self.productive_s = 0.0
        self.attempts_failed = 0
        self.pending_evals: dict[int, dict] = {}
        self.checkpoint_lost = False
        self.snapshot_path = ""
        self.snapshots: list[dict] = []
        self.restores: list[dict] = []
        self.redone_from_snapshot = 0
        self.chaos: Any = None
        self.t_train0 = time.monotonic()
        self.t_last_commit = self.t_train0
        self.setup_s = 0.0

    # -- the run ------------------------------------------------------------------------------------
    def run_all(self) -> None:
        """Set up, train, finish (writes ``run._report``). Raises what ends the run."""
        t0 = time.monotonic()
        try:
            self._spawn()
            self._construct()
            self._resume()
            self.m.form_quorum()
            self.setup_s = time.monotonic() - t0
            self._train()
        except Stopped:
            pass
        self._finish()

    def wake(self) -> None:
        self.events.put(("wake",))

    # -- set-up ---------------------------------------------------------------------------------------
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
        from ..runtime.rendezvous import loopback_store

        o = self.o
        self.run.phase("spawning")
        self.m.store = loopback_store(timeout_s=o.collective_timeout_s)  # here, never in a worker
        extra: dict = {}
        if o.spares:
            if "spares" in inspect.signature(HostMesh.spawn_procs).parameters:
                extra = {"spares": o.spares, "preload": SPARE_PRELOAD}
                self.spares = o.spares
            else:
                log.info("this runtime keeps no warm spares; a failed rank restarts in a fresh process")
        host = this_host()
        for attempt in range(3):
            name = self.mesh_name = self.run.mesh_name = self._mesh_name()

            def stop_mesh(name: str = name) -> None:
                Controller.get().stop_procs(name, timeout_s=1.0)

            try:
                self.procs = self._stoppable(lambda: host.spawn_procs(per_host={"gpus": o.procs}, name=name, **extra),
                                             stop_mesh)
                break
            except RuntimeError as exc:  # a proc died or did not say hello while starting
                first = str(exc).splitlines()[0]
                if attempt == 2:
                    raise TrainingError(f"could not start {o.procs} procs: {first}") from None
                log.warning("starting the procs failed (%s); starting them again", first)
        self.m.procs = self.procs
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
        a rank that fails while it sets up is restarted and set up again without the others."""
        from ..errors import SupervisionError
        from .trainer import Trainer

        o, m = self.o, self.m
        self.run.phase("constructing")
        args = (o.workload, o.seed, o.lr, o.global_batch, "127.0.0.1", m.store.port, o.backend,
                o.collective_timeout_s, o.chunk_bytes)
        for rank in range(o.procs):
            m.state[rank] = RankState.LIVE
        mesh = None
        for attempt in range(4):
            self._settle_restarts()
            name = "trainer" if not attempt else f"trainer_{attempt}"
            try:
                mesh = self._stoppable(lambda: self.procs.spawn(name, Trainer, *args), lambda: None)
                break
            except SupervisionError as exc:  # a proc failed meanwhile: restart it, spawn again
                if attempt == 3:
                    raise TrainingError(f"could not build the trainers: {exc}") from None
                m.fail_rank(exc.rank, exc)
            except ActorError as exc:
                raise TrainingError(f"the Trainer could not be built: {exc}") from None
        m.trainers = {r: mesh.slice(gpus=r) for r in range(o.procs)}
        live = m.live
        futures = {r: m.trainers[r].setup.call_one() for r in live}
        values, errors = wait_all(futures, o.restart_timeout_s, self.run.stop_event)
        if errors and not values and all(isinstance(e, ActorError) for e in errors.values()):
            rank, exc = min(errors.items())
            raise TrainingError(f"setting up the Trainer failed on every rank; rank {rank}: {exc}")
        for rank, exc in errors.items():
            m.fail_rank(rank, exc)
        self._settle_restarts()
        if not m.live:
            raise TrainingError("no rank could set up its Trainer")

    def _settle_restarts(self) -> None:
        """Before training: wait until no rank is restarting (a rank back from a restart is set up
        and identical to the others, so it is live at once)."""
        deadline = time.monotonic() + self.o.restart_timeout_s * 3
        while self.m.restarting and time.monotonic() < deadline:
            if self.run.stopping:
                raise Stopped()
            self._wait_event(0.05)
            for rank in self.m.ready:
                self.m.state[rank] = RankState.LIVE

    def _resume(self) -> None:
        from .run import latest_checkpoint

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
            raise TrainingError(f"no rank could load the checkpoint {path}")
        start = min(values.values())
        self.start_step = self.next_commit = self.next_dispatch = start
        self.run.step = start

    # -- training -------------------------------------------------------------------------------------
    def _train(self) -> None:
        o = self.o
        for fault in o.faults:
            self.planned.setdefault(fault.step, []).append(fault)
        self.run.phase("training")
        self.t_train0 = self.t_last_commit = time.monotonic()
        self.run.t_train0 = self.t_train0
        if o.chaos_mtbf_s:
            from ..faults.chaos import ChaosSchedule

            self.chaos = ChaosSchedule(o.chaos_mtbf_s, kinds=o.chaos_kinds, seed=o.seed).start(self.procs)
        rejoin_deadline = None
        while not self.run.stopping:
            if self.next_commit >= o.steps and not self.windows and not self._needs_recovery():
                # every step is committed; let restarting ranks rejoin (bounded), so that every
                # replica is checked and every latency measured
                if rejoin_deadline is None:
                    rejoin_deadline = time.monotonic() + o.restart_timeout_s
                    self.run.phase("finishing")
                    if self.chaos is not None:
                        self.chaos.stop()
                if not (self.m.restarting or self.m.ready) or time.monotonic() > rejoin_deadline:
                    break
                if self._needs_boundary():
                    self._boundary()
                else:
                    self._wait_event(0.05)
                continue
            if self._needs_boundary():
                if any(not w.complete for w in self.windows):
                    self._wait_event()
                else:
                    self._boundary()
                continue
            self._dispatch()
            self._wait_event()

    def _needs_recovery(self) -> bool:
        return self.recover or self.nonfinite_at is not None or not self.m.live or self.m.dirty

    def _needs_boundary(self) -> bool:
        m = self.m
        return (self.recover or self.nonfinite_at is not None or m.dirty or bool(m.ready) or not m.live
                or self.next_dispatch in self.planned or self.checkpoint_lost)

    def _in_flight(self) -> int:
        return sum(1 for w in self.windows if not w.complete)

    def _window_size(self) -> int:
        o = self.o
        if o.window_steps:
            return o.window_steps
        if self.step_s is None:
            return 1
        return max(1, min(_MAX_WINDOW, int(o.window_s / max(self.step_s, 1e-6))))

    def _window_end(self, start: int) -> int:
        o = self.o
        end = min(o.steps, start + self._window_size())
        later = [f for f in self.planned if f > start]
        if later:
            end = min(end, min(later))
        for every in (o.eval_every, o.checkpoint_every):
            if every:
                end = min(end, (start // every + 1) * every)
        return end

    def _dispatch(self) -> None:
        o, m = self.o, self.m
        while (self._in_flight() < o.pipeline and self.next_dispatch < o.steps and not self._needs_boundary()
               and not self.run.stopping):
            start = self.next_dispatch
            end = self._window_end(start)
            win = _Window(next(self._wids), m.quorum, m.members, start, end - start)
            split = sorted(s for s in self.split_steps if start <= s < end) or None
            writer = m.members[0]
            snapshot = ({"path": self.snapshot_path, "every": o.snapshot_every or 0, "budget": o.snapshot_budget}
                        if self.snapshot_path else None)
            self.windows.append(win)
            self.history.append((start, end - start, win.members))
            for rank in win.members:
                future = m.trainers[rank].run_window.call_one(m.quorum, start, end - start, split,
                                                              snapshot if rank == writer else None)
                future.add_done_callback(lambda f, w=win, r=rank: self.events.put(("reply", w, r, f)))
            self.next_dispatch = end
            last = end - 1
            if o.eval_every and end % o.eval_every == 0 and end < o.steps:
                self.run.phase("evaluating")
                future = m.trainers[writer].evaluate.call_one()
                future.add_done_callback(lambda f, s=last, r=writer: self.events.put(("eval", s, r, f)))
            if o.checkpoint_every and end % o.checkpoint_every == 0:
                self.run.phase("checkpointing")
                self._send_checkpoint(writer, end)
            if self.run.phase_name != "training":
                self.run.phase("training")

    def _send_checkpoint(self, rank: int, next_step: int) -> None:
        path = os.path.abspath(os.path.join(self.o.checkpoint_dir, f"step{next_step:08d}.pt"))
        os.makedirs(self.o.checkpoint_dir, exist_ok=True)
        future = self.m.trainers[rank].save_checkpoint.call_one(path, next_step)
        future.add_done_callback(lambda f, s=next_step, r=rank: self.events.put(("checkpoint", s, r, f)))

    # -- events ----------------------------------------------------------------------------------------
    def _wait_event(self, timeout_s: float = 1.0) -> None:
        """Handle the next event (and every one already queued); check window deadlines."""
        deadline = self._window_deadline()
        wait = max(0.0, min(timeout_s, deadline - time.monotonic())) if deadline is not None else timeout_s
        try:
            item = self.events.get(timeout=wait)
        except queue.Empty:
            self._check_deadlines()
            return
        self._handle(item)
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                break
            self._handle(item)
        self._check_deadlines()

    def _window_deadline(self) -> float | None:
        pending = [w for w in self.windows if not w.complete]
        if not pending:
            return None
        w = pending[0]
        per_step = max(self.step_s or 0.05, 0.001)
        return w.oldest_since + 10 * w.count * per_step + self.o.collective_timeout_s + 5.0

    def _check_deadlines(self) -> None:
        deadline = self._window_deadline()
        if deadline is None or time.monotonic() < deadline:
            return
        w = next(w for w in self.windows if not w.complete)
        for rank in w.members:
            if rank not in w.replies:
                w.replies[rank] = TimeoutError(f"rank {rank}: window of steps {w.start}-{w.start + w.count - 1} "
                                               "did not end in time")
                if self.m.state.get(rank) == RankState.LIVE:
                    self.m.fail_rank(rank, w.replies[rank])
        self.recover = True
        self._window_done(w)

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "reply":
            self._on_reply(*item[1:])
        elif kind == "failed":
            self._on_failed(*item[1:])
        elif kind == "ready":
            self.m.on_ready(item[1])
        elif kind == "restart_failed":
            self.m.on_restart_failed(item[1])
            log.warning("rank %d could not be restarted; training goes on without it", item[1])
        elif kind == "eval":
            self._on_eval(*item[1:])
        elif kind == "checkpoint":
            self._on_checkpoint(*item[1:])

    def _on_failed(self, rank: int, exc: BaseException, pid: int | None = None) -> None:
        if pid and pid != self.m.current_pid(rank):
            return  # a stale report about an incarnation already replaced
        if self.m.state.get(rank) in (RankState.LIVE, RankState.READY):
            if rank in self.m.members:
                self.recover = True
            self.m.fail_rank(rank, exc)

    def _on_reply(self, win: _Window, rank: int, future: Any) -> None:
        if rank in win.replies:
            return  # already given up on (deadline)
        exc = future.exception(0)
        if exc is None:
            rep = win.replies[rank] = future.get(0)
            self.rank_next[rank] = rep["next_step"]
            if rep["snapshots"]:
                self.snapshots.extend(rep["snapshots"])
            status = rep["status"]
            if status == "nonfinite" and self.nonfinite_at is None:
                self.nonfinite_at = rep["failed_step"]
            elif status != "ok":
                self.recover = True
                if status == "collective_failed":
                    self.m.broken = True
            if rep["local_nonfinite"]:
                self._poisoned(rank)
        else:
            win.replies[rank] = exc
            self.recover = True
            if own_failure(exc) and self.m.state.get(rank) == RankState.LIVE and win.quorum == self.m.quorum:
                self.m.fail_rank(rank, exc)
        if win.complete:
            self._window_done(win)

    def _poisoned(self, rank: int) -> None:
        now = time.monotonic()
        with self.run.lock:
            for rec in self.m.open_for(rank):
                rec.disrupted = True
                self.m.detect(rec, now, "nonfinite gradient")

    def _window_done(self, win: _Window) -> None:
        """Every member answered ``win``: commit the steps all of them applied, in order."""
        later = [w for w in self.windows if w is not win and not w.complete and w.id > win.id]
        if later:
            later[0].oldest_since = max(later[0].oldest_since, time.monotonic())
        reps = [r for r in win.replies.values() if isinstance(r, dict)]
        all_ok = len(reps) == len(win.members) and all(r["status"] == "ok" for r in reps)
        if reps and win.start == self.next_commit:
            if all_ok:
                self._learn_step_time(reps[0]["step_ms"])
            self._commit_upto(win.start + min(len(r["loss"]) for r in reps))
        if self.next_commit >= win.start + win.count:
            self.windows.remove(win)
        if not all_ok and self.nonfinite_at is None:
            self.recover = True

    def _learn_step_time(self, step_ms: list) -> None:
        if not step_ms:
            return
        s = statistics.median(step_ms) / 1e3
        self.step_s = s if self.step_s is None else 0.7 * self.step_s + 0.3 * s

    # -- commits ---------------------------------------------------------------------------------------
    def _records_for(self, step: int) -> tuple[tuple, dict, dict | None, int, float | None]:
        """``(members, {rank: digest or None}, a reply holding the step's record, its index, the
        largest local gradient norm reported)`` of ``step``."""
        for win in reversed(self.windows):
            if win.start <= step < win.start + win.count:
                digests: dict = {}
                source = None
                norm = None
                i = step - win.start
                for rank in win.members:
                    rep = win.replies.get(rank)
                    if isinstance(rep, dict) and i < len(rep["digest"]):
                        digests[rank] = rep["digest"][i]
                        source = source or rep
                        norm = rep["grad_norm"][i] if norm is None else max(norm, rep["grad_norm"][i])
                    else:
                        digests[rank] = None
                return win.members, digests, source, i, norm
        for start, count, members in reversed(self.history):
            if start <= step < start + count:
                return members, {r: None for r in members}, None, 0, None
        raise TrainingError(f"step {step} was committed by no known quorum")

    def _commit_upto(self, upto: int) -> None:
        """Commit steps ``next_commit .. upto-1`` (every one applied by every live member)."""
        if upto <= self.next_commit:
            return
        now = time.monotonic()
        run = self.run
        metrics = []
        while self.next_commit < upto:
            step = self.next_commit
            members, digests, rep, i, norm = self._records_for(step)
            run.ledger.record_shards(step, members, digests)
            metric = {"type": "step", "step": step, "loss": None, "batch_accuracy": None,
                      "time_s": round(now - self.t_train0, 4), "quorum": self.m.quorum, "live_ranks": list(members),
                      "step_ms": None, "grad_norm": None}
            if rep is not None:
                ms = rep["step_ms"][i]
                metric.update(loss=rep["loss"][i], batch_accuracy=rep["accuracy"][i], step_ms=round(ms, 3),
                              grad_norm=norm)
                self.step_ms.append(ms)
                self.productive_s += ms / 1e3
            ev = self.pending_evals.pop(step, None)
            if ev is not None:
                metric.update(test_accuracy=ev["test_accuracy"], test_loss=ev["test_loss"])
            metrics.append(metric)
            self.next_commit += 1
        self.t_last_commit = now
        run.step = self.next_commit
        if self.next_dispatch < self.next_commit:
            self.next_dispatch = self.next_commit
        self.m.mark_resumed(now)
        run.add_metrics(metrics)

    def _on_eval(self, step: int, rank: int, future: Any) -> None:
        exc = future.exception(0)
        if exc is not None:
            if own_failure(exc) and self.m.state.get(rank) == RankState.LIVE:
                self._on_failed(rank, exc)
            return
        ev = future.get(0)
        if ev["next_step"] != step + 1:
            return  # the window before it stopped early: this evaluation is of another step
        if step < self.next_commit:
            self.run.add_eval(step, ev)
        else:
            self.pending_evals[step] = ev

    def _on_checkpoint(self, next_step: int, rank: int, future: Any) -> None:
        exc = future.exception(0)
        if exc is not None:
            self.checkpoint_lost = True
            if own_failure(exc) and self.m.state.get(rank) == RankState.LIVE:
                self._on_failed(rank, exc)
            return
        if future.get(0)["path"] is None:
            self.checkpoint_lost = True

    # -- boundaries ------------------------------------------------------------------------------------
    def _boundary(self) -> None:
        """Nothing is in flight: recover, restore, inject, heal, re-form, as needed."""
        m = self.m
        if self.recover or self.nonfinite_at is not None:
            self._recover()
        if not m.live:
            self._restore()
            return
        for fault in self.planned.pop(self.next_commit, []) if self.next_dispatch == self.next_commit else []:
            self._inject(fault)
        joined = m.heal_ready() if m.ready and m.live else []
        if m.dirty and m.live:
            m.form_quorum()
            for rank in m.members:
                self.rank_next[rank] = self.next_commit
        if joined:
            self._rejoined(joined)
        if self.checkpoint_lost and m.live and not m.dirty:
            self.checkpoint_lost = False
            self._checkpoint_now()

    def _recover(self) -> None:
        """After a failure or a non-finite gradient: agree on the last committed step."""
        m = self.m
        nonfinite, self.nonfinite_at = self.nonfinite_at, None
        self.recover = False
        self.attempts_failed += 1
        failed_step = nonfinite if nonfinite is not None else self.next_commit
        outcome = self._outcome()
        self.run.ledger.record_attempt(failed_step, m.quorum, list(m.members), outcome)
        if self.attempts_failed > 50 * max(1, self.o.steps):
            raise TrainingError("steps keep failing (e.g. gradients stay non-finite); giving up")
        live = m.live
        if not live:
            self.windows.clear()
            return
        missing = [r for r in live if r not in self.rank_next]
        if missing:
            values, errors = wait_all({r: m.trainers[r].status.call_one() for r in missing},
                                      self.o.collective_timeout_s, self.run.stop_event)
            for r, v in values.items():
                self.rank_next[r] = v["next_step"]
            for r, exc in errors.items():
                m.fail_rank(r, exc)
        next_steps = {r: self.rank_next[r] for r in m.live if r in self.rank_next}
        agreed = m.catch_up(next_steps) if m.broken else (max(next_steps.values()) if next_steps else self.next_commit)
        agreed = max(agreed, self.next_commit)
        self._commit_upto(agreed)
        for r in m.live:
            self.rank_next[r] = agreed
        self.windows.clear()
        self.next_dispatch = self.next_commit

    def _outcome(self) -> str:
        parts = []
        failed = set()
        for win in self.windows:
            for rank, rep in sorted(win.replies.items()):
                if isinstance(rep, dict):
                    if rep["status"] == "nonfinite" and rep["local_nonfinite"]:
                        parts.append(f"nonfinite gradient from rank {rank}")
                    elif rep["status"] == "collective_failed":
                        parts.append(f"{rank}: CollectiveError")
                else:
                    failed.add(rank)
                    parts.append(f"{rank}: {type(rep).__name__}")
        failed |= {r for r in self.m.members if self.m.state.get(r) != RankState.LIVE}
        poisoned = sorted({int(p.split()[-1]) for p in parts if p.startswith("nonfinite")})
        head = f"nonfinite gradient from ranks {poisoned}" if poisoned else f"failed ranks {sorted(failed)}"
        return head + ("; " + "; ".join(dict.fromkeys(parts)) if parts else "")

    def _inject(self, fault: FaultSpec) -> None:
        if fault.rank not in self.m.live:
            log.warning("fault %s skipped: rank %d is not live", fault, fault.rank)
            return
        if fault.phase == "collective":
            try:
                self.m._get(self.m.trainers[fault.rank].arm_kill_in_collective.call_one(fault.step),
                            self.o.collective_timeout_s)
            except Stopped:
                raise
            except Exception as exc:
                self.m.fail_rank(fault.rank, exc)
                return
            self.split_steps.add(fault.step)
            self.m.open_record("kill", fault.rank, time.monotonic(), cause="in collective")
            return
        try:
            self.procs.inject(fault.rank, fault.kind, **fault.params)
        except RuntimeError as exc:
            log.warning("fault %s skipped: %s", fault, exc)

    def _rejoined(self, joined: list[int]) -> None:
        sums = self.m.checksums()
        identical = len({v["params_checksum"] for v in sums.values()}) <= 1
        now = time.monotonic()
        for rank in joined:
            if self.m.state.get(rank) == RankState.LIVE:
                self.m.mark_rejoined(rank, now, "heal", identical)
        if not identical:
            raise TrainingError(f"replicas differ after rank(s) {joined} rejoined: {sums}")

    def _checkpoint_now(self) -> None:
        rank = self.m.live[0]
        self.run.phase("checkpointing")
        path = os.path.abspath(os.path.join(self.o.checkpoint_dir, f"step{self.next_commit:08d}.pt"))
        try:
            self.m._get(self.m.trainers[rank].save_checkpoint.call_one(path, self.next_commit), self.o.collective_timeout_s)
        except Stopped:
            raise
        except Exception as exc:
            self.checkpoint_lost = True
            if own_failure(exc):
                self.m.fail_rank(rank, exc)

    def _restore(self) -> None:
        """No live replica: wait for restarted ranks, then load the newest snapshot into them."""
        m, o = self.m, self.o
        self.windows.clear()
        deadline = time.monotonic() + o.restart_timeout_s * 2
        while not m.ready:
            if not m.restarting:
                raise TrainingError("every rank failed and none could be restarted")
            if time.monotonic() > deadline:
                raise TrainingError(f"every rank failed and none came back within {o.restart_timeout_s * 2:.0f} s")
            if self.run.stopping:
                raise Stopped()
            self._wait_event(0.1)
        settle = time.monotonic() + 1.0  # let the other restarts finish too: restore them together
        while m.restarting and time.monotonic() < settle and not self.run.stopping:
            self._wait_event(0.05)
        if not (self.snapshot_path and (self.snapshots or os.path.exists(self.snapshot_path))):
            if self.next_commit == self.start_step == 0:  # nothing trained yet: fresh trainers are the state
                for rank in m.ready:
                    m.state[rank] = RankState.LIVE
                m.broken = True
                return
            raise TrainingError(
                "every rank failed at once and no snapshot had been published yet: nothing holds the training "
                "state (use checkpoint_dir/checkpoint_every and resume=True for full-job restarts)")
        t0 = time.monotonic()
        restored = m.restore(self.snapshot_path)
        step = next(iter(restored.values()))["next_step"]
        redone = 0
        if step < self.next_commit:
            redone = self.next_commit - step
            self.run.ledger.forget_from(step)
            self.run.forget_metrics_from(step)
            self.next_commit = step
            self.run.step = step
        elif step > self.next_commit:
            self._commit_upto(step)
        self.next_dispatch = self.next_commit
        for rank in restored:
            self.rank_next[rank] = step
        self.redone_from_snapshot += redone
        took = time.monotonic() - t0
        self.restores.append({"step": step, "steps_redone": redone, "restore_s": round(took, 4),
                              "ranks": sorted(restored)})
        self.run.add_recovery({"type": "recovery", "event": "restored", "step": step, "steps_redone": redone,
                       "restore_s": round(took, 4), "ranks": sorted(restored),
                       "time_s": round(time.monotonic() - self.t_train0, 4)})
        now = time.monotonic()
        for rank in restored:
            m.mark_rejoined(rank, now, "snapshot")
        m.broken = True

    # -- the end ---------------------------------------------------------------------------------------
    def _finish(self) -> None:
        o, m, run = self.o, self.m, self.run
        run.phase("finishing" if not run.stopping else "stopping")
        if self.chaos is not None:
            self.chaos.stop()
        if not m.trainers:
            run.set_report(None)
            return
        deadline = time.monotonic() + 2.0 + o.pipeline * o.window_s
        while any(not w.complete for w in self.windows) and time.monotonic() < deadline:
            self._wait_event(0.05)
        timeout = 2.0 if run.stopping else o.collective_timeout_s
        stop = threading.Event()  # the final reads run even when the run was asked to stop
        values, _ = wait_all({r: m.trainers[r].checksum.call_one() for r in m.live}, timeout, stop)
        digests = {v["params_checksum"] for v in values.values()}
        applied = {v["applied_steps"] for v in values.values()}
        ev = {"test_accuracy": None, "test_loss": None}
        mem: dict = {}
        if not run.stopping and m.live:
            evs, _ = wait_all({r: m.trainers[r].evaluate.call_one() for r in m.live[:1]}, timeout, stop)
            ev = next(iter(evs.values()), ev)
            mem, _ = wait_all({r: m.trainers[r].memory.call_one() for r in m.live}, timeout, stop)
            if o.keep_parameters:
                run.parameters, _ = wait_all({r: m.trainers[r].parameters.call_one() for r in m.live}, timeout, stop)
        self._report(values, digests, applied, ev, mem)

    def _report(self, sums: dict, digests: set, applied: set, ev: dict, mem: dict) -> None:
        o, run = self.o, self.run
        audit = run.ledger.audit(run.order, self.next_commit, start=self.start_step)
        wall = max(1e-9, self.t_last_commit - self.t_train0)
        committed = self.next_commit - self.start_step
        # an update missing from the parameters is lost; one applied twice too, but a stopped run's
        # ranks may hold updates of a window whose replies the stop did not wait for
        off = [self.next_commit - a if a < self.next_commit else (0 if run.stopping else a - self.next_commit)
               for a in applied]
        steps_lost = max(off, default=0)
        ordered = sorted(self.step_ms)
        snaps = self.snapshots
        snapshot_info: dict = {"count": len(snaps)}
        if snaps:
            pause = statistics.median(s["pause_ms"] for s in snaps)
            cpu = statistics.median(s["cpu_ms"] for s in snaps)
            steps_between = [b["step"] - a["step"] for a, b in zip(snaps, snaps[1:]) if b["step"] > a["step"]]
            interval = statistics.median(steps_between) if steps_between else float(max(1, self.next_commit))
            step_med = ordered[len(ordered) // 2] if ordered else 0.0
            snapshot_info.update(bytes=snaps[-1]["nbytes"], pause_ms_median=pause, cpu_ms_median=cpu,
                                 interval_steps=interval,
                                 cost_pct_of_step_time=round(100 * (pause + cpu) / max(1e-9, interval * step_med), 4)
                                 if step_med else 0.0)
        last_loss = next((mm["loss"] for mm in reversed(run.metrics) if mm.get("loss") is not None), None)
        report = TrainReport(
            final_loss=last_loss,
            test_accuracy=ev.get("test_accuracy"),
            test_loss=ev.get("test_loss"),
            steps=len(run.ledger),
            procs=o.procs,
            workload=o.workload.name,
            backend=o.backend or _default_backend(),
            global_batch=o.global_batch,
            failures=[r.to_dict() for r in self.m.failures],
            steps_lost=int(steps_lost + audit["steps_missing"]),
            steps_redone=self.attempts_failed,
            steps_redone_from_snapshot=self.redone_from_snapshot,
            samples_lost=audit["samples_lost"],
            samples_repeated=audit["samples_repeated"],
            goodput=round(min(1.0, self.productive_s / wall), 4) if committed else 0.0,
            wall_time_s=round(wall, 3),
            setup_time_s=round(self.setup_s, 3),
            throughput_samples_per_s=round(committed * o.global_batch / wall, 1),
            quorums=self.m.quorum,
            replicas_identical=len(digests) == 1 if digests else None,
            params_checksum=next(iter(digests)) if len(digests) == 1 else "",
            step_time_ms_median=round(ordered[len(ordered) // 2], 3) if ordered else 0.0,
            stopped_early=self.next_commit < o.steps,
            worker_peak_rss_bytes=[mem[r]["peak_rss_bytes"] for r in sorted(mem)],
            spares=self.spares,
            window_steps_median=float(statistics.median(c for _, c, _ in self.history)) if self.history else 0.0,
            snapshots=snapshot_info,
            restores=list(self.restores),
            ledger=run.ledger.to_dict(),
        )
        run.set_report(report)


def _default_backend() -> str:
    try:
        from .. import device

        return device.backend()
    except Exception:
        return "gloo"
