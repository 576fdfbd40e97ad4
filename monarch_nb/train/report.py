"""What a training run reports: per-failure recovery figures and the run's totals (TrainReport)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

__all__ = ["FailureRecord", "TrainReport"]


@dataclass
class FailureRecord:
    """One failure and its recovery. Times are ``time.monotonic()`` seconds.

    Latencies (seconds, from the fault's injection, or from its detection for a real crash):
    ``detection_latency_s`` until the controller knew; ``resume_latency_s`` until the survivors
    committed their next step; ``rejoin_latency_s`` until the restarted rank was back in an epoch.
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

    def _lat(self, t: float | None) -> float | None:
        return None if t is None else round(max(0.0, t - self.injected_at), 4)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "rank": self.rank, "step": self.step, "cause": self.cause,
            "detection_latency_s": self._lat(self.detected_at), "resume_latency_s": self._lat(self.resumed_at),
            "rejoin_latency_s": self._lat(self.rejoined_at), "restarted": self.restarted,
            "heal_ms": None if self.heal_ms is None else round(self.heal_ms, 2), "heal_bytes": self.heal_bytes,
            "heal_chunks": self.heal_chunks, "replicas_identical_after_rejoin": self.replicas_identical,
        }


@dataclass
class TrainReport:
    """What a run did. ``str(report)`` is a readable table; :meth:`to_json` writes it.

    Attributes (units in names; losses are mean per sample):
        final_loss: training loss of the last committed step.
        test_accuracy: accuracy on the held-out test set (None for language models).
        test_loss: loss on the test set.
        steps: committed steps. procs: worker processes. workload: its name.
        failures: one dict per failure (see :class:`FailureRecord`).
        steps_lost: steps whose update is missing from (or doubled in) the final parameters.
        steps_redone: step attempts that failed and were redone.
        samples_lost, samples_repeated: from the sample ledger's audit against the pure order.
        goodput: productive time (committed step attempts) / wall time of the training loop.
        wall_time_s: first step sent -> last step committed. setup_time_s: procs + first epoch.
        throughput_samples_per_s: committed samples / wall_time_s.
        replicas_identical: all live replicas' parameters equal at the end (per-tensor 64-bit checksums).
        params_checksum: the replicas' parameter checksum (16 hex digits), "" when they differ.
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
    samples_lost: int = 0
    samples_repeated: int = 0
    goodput: float = 0.0
    wall_time_s: float = 0.0
    setup_time_s: float = 0.0
    throughput_samples_per_s: float = 0.0
    epochs: int = 0
    replicas_identical: bool | None = None
    params_checksum: str = ""
    step_time_ms_median: float = 0.0
    stopped_early: bool = False
    worker_peak_rss_bytes: list = field(default_factory=list)
    ledger: dict | None = None

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

    def __str__(self) -> str:
        def fmt(v, spec=".4f"):
            return "-" if v is None else format(v, spec)

        lines = [
            f"training report: {self.workload} on {self.procs} procs ({self.backend}), global batch {self.global_batch}",
            f"  steps committed     {self.steps}{'  (stopped early)' if self.stopped_early else ''}",
            f"  final loss          {fmt(self.final_loss)}",
            f"  test accuracy       {fmt(self.test_accuracy)}",
            f"  test loss           {fmt(self.test_loss)}",
            f"  wall time           {self.wall_time_s:.2f} s (setup {self.setup_time_s:.2f} s)",
            f"  throughput          {self.throughput_samples_per_s:.0f} samples/s, median step {self.step_time_ms_median:.2f} ms",
            f"  goodput             {self.goodput:.3f}",
            f"  steps lost          {self.steps_lost}   (attempts redone: {self.steps_redone})",
            f"  samples lost        {self.samples_lost}",
            f"  samples repeated    {self.samples_repeated}",
            f"  membership epochs   {self.epochs}",
            f"  replicas identical  {self.replicas_identical}",
        ]
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
        return "\n".join(lines)
