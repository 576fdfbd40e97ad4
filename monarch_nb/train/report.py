"""What a training run reports: per-failure recovery figures and the run's totals (TrainReport)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .coordinator_state import CoordinatorState
    from .recovery import Membership

__all__ = ["FailureRecord", "TrainReport", "GOODPUT_MEANS", "build_report"]

#: what the goodput figure means, said wherever it is shown
GOODPUT_MEANS = "share of the training wall time spent in steps that were kept (not lost to failures, redone or waiting)"


@dataclass
class FailureRecord:
    """One failure and its recovery. Times are ``time.monotonic()`` seconds.

    Latencies (seconds, from the fault's injection, or from its detection for a real crash):
    ``detection_latency_s`` until the controller knew; ``resume_latency_s`` until the survivors
    committed their next step; ``rejoin_latency_s`` until the restarted rank was back in a quorum.
    """

    kind: str
    rank: int
    step: int
    injected_at: float
    cause: str = ""
    detected_at: float | None = None
    resumed_at: float | None = None
    rejoined_at: float | None = None
    disrupted: bool = False
    restarted: bool = False
    heal_ms: float | None = None
    heal_bytes: int | None = None
    heal_chunks: int | None = None
    replicas_identical: bool | None = None
    how: str = ""  # how the rank came back: "heal" from a peer, "snapshot"
    pid: int | None = None  # the incarnation that failed (not reported)

    def _lat(self, t: float | None) -> float | None:
        return None if t is None else round(max(0.0, t - self.injected_at), 4)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "rank": self.rank, "step": self.step, "cause": self.cause,
            "detection_latency_s": self._lat(self.detected_at), "resume_latency_s": self._lat(self.resumed_at),
            "rejoin_latency_s": self._lat(self.rejoined_at), "restarted": self.restarted,
            "heal_ms": None if self.heal_ms is None else round(self.heal_ms, 2), "heal_bytes": self.heal_bytes,
            "heal_chunks": self.heal_chunks, "replicas_identical_after_rejoin": self.replicas_identical,
            "rejoined_by": self.how or None,
        }


@dataclass
class TrainReport:
    """What a run did. ``str(report)`` is a readable table; :meth:`to_json` writes it and
    :meth:`from_json` reads it back (``monarch-nb report FILE.json`` prints it).

    Attributes (units in names; losses are mean per sample):
        final_loss: training loss of the last committed step.
        test_accuracy: accuracy on the held-out test set (None for language models).
        test_loss: loss on the test set.
        steps: committed steps. procs: worker processes (ranks). hosts: the hosts they ran on.
        workload: its name.
        failures: one dict per failure (see :class:`FailureRecord`).
        steps_lost: steps whose update is missing from (or doubled in) the final parameters.
        steps_redone: step attempts that failed and were redone.
        steps_redone_from_snapshot: committed steps undone by restores from a snapshot (every
            replica lost) and trained again.
        samples_lost, samples_repeated: from the sample ledger's audit against the pure order.
        goodput: :data:`GOODPUT_MEANS`.
        wall_time_s: first step sent -> end of training: the last step committed, then (see
            ``rejoin_wait_s``) the wait for restarting ranks, or the stop. setup_time_s: procs,
            trainers and the first quorum.
        rejoin_wait_s: of ``wall_time_s``, the time after the last commit spent waiting for
            restarting ranks to rejoin (so that every replica is compared at the end).
        throughput_samples_per_s: committed samples / wall_time_s.
        interrupted: the run was stopped (``stop()``, Ctrl-C) before it ended by itself.
        test_step: the step after which ``test_accuracy`` / ``test_loss`` were measured (the last
            committed one, or an earlier evaluation's when the stop left no time for a new one).
        quorums: quorums formed (one at the start, one per failure and per rejoin).
        replicas_identical: all live replicas' parameters equal at the end (per-tensor 64-bit checksums).
        params_checksum: the replicas' parameter checksum (16 hex digits), "" when they differ.
        spares: warm spare procs kept per host. window_steps_median: steps per window.
        snapshots: ``{"count", "bytes", "pause_ms_median", "cpu_ms_median", "interval_steps",
            "cost_pct_of_step_time"}`` of the in-memory snapshots.
        restores: one ``{"step", "steps_redone", "restore_s"}`` per restore from a snapshot.
        parallelism: how a replica is split inside its group ("ddp": not split; "fsdp"; "custom"
            for the user's own ``parallelize``). group_size: ranks per replica group.
        groups: a sharded run's replica groups, one ``{"group", "ranks", "state" ("live", or the
            members' :class:`~.recovery.RankState` values joined by "/"), "incarnations" (1 + restarts
            of the group), "failures" (records of its ranks)}`` each; empty when unsharded.
    """

    final_loss: float | None
    test_accuracy: float | None
    test_loss: float | None
    steps: int
    procs: int
    workload: str
    backend: str
    global_batch: int
    failures: list = field(default_factory=list)
    steps_lost: int = 0
    steps_redone: int = 0
    steps_redone_from_snapshot: int = 0
    samples_lost: int = 0
    samples_repeated: int = 0
    goodput: float = 0.0
    wall_time_s: float = 0.0
    setup_time_s: float = 0.0
    throughput_samples_per_s: float = 0.0
    quorums: int = 0
    replicas_identical: bool | None = None
    params_checksum: str = ""
    step_time_ms_median: float = 0.0
    stopped_early: bool = False
    worker_peak_rss_bytes: list = field(default_factory=list)
    spares: int = 0
    window_steps_median: float = 0.0
    snapshots: dict = field(default_factory=dict)
    restores: list = field(default_factory=list)
    ledger: dict | None = None
    hosts: int = 1
    rejoin_wait_s: float = 0.0
    interrupted: bool = False
    test_step: int | None = None
    parallelism: str = "ddp"
    group_size: int = 1
    groups: list = field(default_factory=list)

    def to_dict(self, ledger: bool = False) -> dict:
        d = asdict(self)
        if not ledger:
            d.pop("ledger", None)
        return d

    def to_json(self, path: str, ledger: bool = True) -> str:
        """Write the report (with the sample ledger unless ``ledger=False``) as JSON; returns ``path``."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(ledger=ledger), f, indent=1)
        return path

    @classmethod
    def from_dict(cls, data: dict) -> "TrainReport":
        """A report from :meth:`to_dict`'s form; unknown keys are ignored, missing ones defaulted.

        Raises:
            ValueError: a field without a default (e.g. ``steps``) is missing.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "quorums" not in values and "epochs" in data:  # reports written before quorums were called so
            values["quorums"] = data["epochs"]
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"not a training report: fields {missing} are missing")
        return cls(**values)

    @classmethod
    def from_json(cls, path: str) -> "TrainReport":
        """Read a report written by :meth:`to_json`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON, or not a training report.
        """
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a training report (a JSON object)")
        return cls.from_dict(data)

    def __str__(self) -> str:
        def fmt(v, spec=".4f"):
            return "-" if v is None else format(v, spec)

        snap = self.snapshots or {}
        on_hosts = f" on {self.hosts} hosts" if self.hosts > 1 else ""
        ended = "  (interrupted: stopped before the last step)" if self.interrupted and self.stopped_early else (
            "  (interrupted while finishing)" if self.interrupted else "  (stopped early)" if self.stopped_early else "")
        measured = (f"   (after step {self.test_step})" if self.test_step is not None and self.test_step != self.steps - 1
                    else "")
        waited = f", {self.rejoin_wait_s:.2f} s of it waiting for ranks to rejoin" if self.rejoin_wait_s >= 0.005 else ""
        lines = [
            f"training report: {self.workload} on {self.procs} procs{on_hosts} ({self.backend}), global batch {self.global_batch}",
            f"  steps committed     {self.steps}{ended}",
            f"  final loss          {fmt(self.final_loss)}   (training loss of the last step)",
            f"  test accuracy       {fmt(self.test_accuracy)}{measured}",
            f"  test loss           {fmt(self.test_loss)}{measured}",
            f"  wall time           {self.wall_time_s:.2f} s{waited} (setup {self.setup_time_s:.2f} s)",
            f"  throughput          {self.throughput_samples_per_s:.0f} samples/s, median step {self.step_time_ms_median:.2f} ms",
            f"  goodput             {self.goodput:.3f}   (share of the wall time in steps kept, see below)",
            f"  steps lost          {self.steps_lost}   (attempts redone: {self.steps_redone})",
            f"  samples lost        {self.samples_lost}",
            f"  samples repeated    {self.samples_repeated}",
            f"  quorums             {self.quorums}",
            f"  replicas identical  {self.replicas_identical}",
        ]
        if self.groups:
            lines.append(f"  replica groups      {len(self.groups)} of {self.group_size} ranks ({self.parallelism} inside, "
                         "replicated across)")
            for g in self.groups:
                ranks = g["ranks"]
                lines.append(f"    group {g['group']}: ranks {ranks[0]}-{ranks[-1]}  {g['state']:<8} incarnation "
                             f"{g['incarnations']}, {g['failures']} failure record(s)")
        if snap.get("count"):
            lines.append(f"  snapshots           {snap['count']} in shared memory, every ~{snap.get('interval_steps', 0):.0f} "
                         f"steps, cost {snap.get('cost_pct_of_step_time', 0):.2f}% of step time")
        for r in self.restores:
            lines.append(f"  every replica lost: restored from the snapshot of step {r['step']} in {r['restore_s']:.2f} s, "
                         f"{r['steps_redone']} step(s) redone")
        if self.failures:
            lines.append(f"  failures ({len(self.failures)}):")
            lines.append("    kind       rank  step  cause           detect_s  resume_s  rejoin_s  heal_ms")
            for f in self.failures:
                lines.append(
                    f"    {f['kind']:<10} {f['rank']:>4}  {f['step']:>4}  {f['cause'][:15]:<15} "
                    f"{fmt(f['detection_latency_s'], '8.3f'):>8}  {fmt(f['resume_latency_s'], '8.3f'):>8}  "
                    f"{fmt(f['rejoin_latency_s'], '8.3f'):>8}  {fmt(f['heal_ms'], '7.1f'):>7}"
                )
        else:
            lines.append("  failures            none")
        lines.append(f"  (goodput: {GOODPUT_MEANS})")
        return "\n".join(lines)


def build_report(c: "CoordinatorState", digests: set, applied: set, ev: dict, mem: dict) -> TrainReport:
    """The report of the run that coordinator ``c`` ran (its ledger audited against the pure order).

    Args:
        digests: the live replicas' parameter checksums. applied: their applied-update counts.
        ev: the final evaluation (``test_accuracy``, ``test_loss``). mem: ``{rank: memory()}``.
    """
    o, run = c.o, c.run
    ledger, order = run.sample_ledger(), run.order
    assert order is not None  # known with the ledger
    audit = ledger.audit(order, c.next_commit, start=c.start_step)
    end = c.t_end if c.t_end is not None else c.t_last_commit
    wall = max(1e-9, end - c.t_train0)
    rejoin_wait = 0.0 if run.stopping else max(0.0, end - c.t_last_commit)
    test_step: int | None = c.next_commit - 1 if ev.get("test_loss") is not None else None
    if ev.get("test_loss") is None:  # the stop left no time for an evaluation: the last one of the run
        last_eval = next((mm for mm in reversed(run.metrics) if mm.get("test_loss") is not None), None)
        if last_eval is not None:
            ev, test_step = {"test_accuracy": last_eval.get("test_accuracy"), "test_loss": last_eval["test_loss"]}, last_eval["step"]
    committed = c.next_commit - c.start_step
    # an update missing from the parameters is lost; one applied twice too, but a stopped run's
    # ranks may hold updates of a window whose replies the stop did not wait for
    off = [c.next_commit - a if a < c.next_commit else (0 if run.stopping else a - c.next_commit)
           for a in applied]
    steps_lost = max(off, default=0)
    ordered = sorted(c.step_ms)
    snaps = c.snapshots
    snapshot_info: dict = {"count": len(snaps)}
    if snaps:
        pause = statistics.median(s["pause_ms"] for s in snaps)
        cpu = statistics.median(s["cpu_ms"] for s in snaps)
        steps_between = [b["step"] - a["step"] for a, b in zip(snaps, snaps[1:]) if b["step"] > a["step"]]
        interval = statistics.median(steps_between) if steps_between else float(max(1, c.next_commit))
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
        steps=len(ledger),
        procs=o.procs,
        hosts=o.procs // o.procs_per_host,
        workload=o.name,
        backend=o.backend or _default_backend(),
        global_batch=o.global_batch,
        failures=[r.to_dict() for r in c.m.failures],
        steps_lost=int(steps_lost + audit["steps_missing"]),
        steps_redone=c.attempts_failed,
        steps_redone_from_snapshot=c.redone_from_snapshot,
        samples_lost=audit["samples_lost"],
        samples_repeated=audit["samples_repeated"],
        goodput=round(min(1.0, c.productive_s / wall), 4) if committed else 0.0,
        wall_time_s=round(wall, 3),
        setup_time_s=round(c.setup_s, 3),
        throughput_samples_per_s=round(committed * o.global_batch / wall, 1),
        quorums=c.m.quorum,
        replicas_identical=len(digests) == 1 if digests else None,
        params_checksum=next(iter(digests)) if len(digests) == 1 else "",
        step_time_ms_median=round(ordered[len(ordered) // 2], 3) if ordered else 0.0,
        stopped_early=c.next_commit < o.steps,
        worker_peak_rss_bytes=[mem[r]["peak_rss_bytes"] for r in sorted(mem)],
        spares=c.spares,
        window_steps_median=float(statistics.median(n for _, n, _ in c.history)) if c.history else 0.0,
        snapshots=snapshot_info,
        restores=list(c.restores),
        ledger=ledger.to_dict(),
        rejoin_wait_s=round(rejoin_wait, 3),
        interrupted=run.stopping,
        test_step=test_step,
        parallelism=o.parallelism if isinstance(o.parallelism, str) else "custom",
        group_size=o.group_size,
        groups=_groups(c.m, o.procs) if c.m.layout.size > 1 else [],
    )
    return report


def _groups(m: "Membership", procs: int) -> list[dict]:
    """The report's ``groups`` of a sharded run's :class:`~.recovery.Membership` ``m`` over ``procs`` ranks."""
    out = []
    for first in range(0, procs, m.layout.size):
        ranks = m.layout.members(first)
        states = sorted({m.state[r].value for r in ranks if r in m.state})
        g = m.layout.group_of(first)
        out.append({"group": g, "ranks": ranks, "state": "/".join(states) or "-",
                    "incarnations": 1 + m.generation.get(g, 0),
                    "failures": sum(1 for rec in m.failures if rec.rank in ranks)})
    return out


def _default_backend() -> str:
    try:
        from .. import device

        return device.backend()
    except Exception:
        return "gloo"
