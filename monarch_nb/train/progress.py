"""Following a training run in a terminal: a tqdm progress bar, one line per recovery event."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["follow", "describe_recovery"]

#: without a terminal, a progress line at least this often (seconds), and at every tenth of the steps
LINE_EVERY_S = 30.0

_RECOVERY_LINES = {
    "failed": "rank {rank} failed ({kind})",
    "detected": "rank {rank}'s {kind} detected after {latency_s:.3f} s",
    "resumed": "survivors committed the next step {latency_s:.3f} s after rank {rank}'s {kind} (at step {fault_step})",
    "rejoined": "rank {rank} rejoined {latency_s:.3f} s after its {kind} (at step {fault_step})",
}


def describe_recovery(item: dict) -> str:
    """One line for a recovery record of :attr:`TrainingRun.recoveries`, naming the step it happened at."""
    if item.get("event") == "restored":
        return (f"step {item['step']}: every replica was lost; restored ranks {item['ranks']} from the snapshot of "
                f"step {item['step']} in {item['restore_s']:.2f} s ({item['steps_redone']} step(s) to redo)")
    what = _RECOVERY_LINES.get(item["event"], "rank {rank} {event} ({kind})")
    return f"step {item['step']}: " + what.format(**item)


def follow(run: Any, progress: bool = True) -> None:
    """Block until ``run`` ends, showing its progress on stderr if ``progress``.

    On a terminal: a tqdm bar whose elapsed time ticks during set-up and whose rate, once the
    first step is committed, is the training's, not the set-up's; worker output and recovery
    lines go through ``tqdm.write`` so the bar stays whole. Elsewhere (a log file, a pipe, CI): no
    bar, whose redraws would be fragments there, but one plain line per tenth of the steps.

    Raises:
        KeyboardInterrupt: after stopping the run (its partial report is ``run.report()``).
    """
    bar = restore_sinks = None
    if progress:
        bar, restore_sinks = _progress(run, tty=_stderr_is_tty())
    try:
        while not run.wait(0.25):
            if bar is not None:
                bar.tick()
    except KeyboardInterrupt:
        if bar is not None:
            bar.write("interrupted: stopping the run (the report covers the steps committed so far)")
        run.stop()
        raise
    finally:
        if bar is not None:
            bar.close()
        if restore_sinks is not None:
            restore_sinks()


def _stderr_is_tty() -> bool:
    import sys

    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Progress:
    """What ``follow`` shows: a tqdm bar on a terminal, plain lines elsewhere. Fed by the run's
    items (training thread) and ticked by ``follow`` (caller's thread)."""

    def __init__(self, run: Any, tty: bool):
        self.run = run
        self.total = run.options.steps
        self.tty = tty
        self.started = False
        self.failures = 0
        self.test_acc: str | None = None
        self.loss: float | None = None
        self.quorum = 0
        self.post_at = 0.0
        self.next_line = 0
        self.first_step = 0
        self.t0 = self.created = self.line_at = time.monotonic()
        self.bar = None
        if tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total or None, unit="step", dynamic_ncols=True, desc="setting up")

    def write(self, text: str) -> None:
        """A line above the bar, on stderr with it (stdout holds only the report)."""
        import sys

        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def tick(self) -> None:
        """Keep the set-up bar's elapsed time moving: a bar that stands still looks hung."""
        if self.bar is not None and not self.started:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _postfix(self, loss: float | None, live: int, quorum: int) -> dict:
        post: dict = {"loss": "-" if loss is None else f"{loss:.4f}", "live": live}
        if self.failures:
            post["failures"] = self.failures
        if self.test_acc is not None:
            post["test_acc"] = self.test_acc
        post["quorum"] = quorum
        return post

    def on_item(self, item: dict) -> None:
        kind = item.get("type")
        if kind == "step":
            self._on_step(item)
        elif kind == "eval" and item.get("test_accuracy") is not None:
            self.test_acc = f"{item['test_accuracy']:.3f}"
        elif kind == "recovery":
            if item["event"] == "failed":
                self.failures += 1
            if item["event"] == "restored" and self.bar is not None:
                self.bar.n = item["step"]
            if self.bar is not None and self.started:  # the live count follows a failure or a rejoin at once
                self.bar.set_postfix(self._postfix(self.loss, len(self.run.live_ranks), self.quorum), refresh=True)
            self.write("  " + describe_recovery(item))
        elif kind == "phase" and not self.started:
            if self.bar is not None:
                self.bar.set_description(item["phase"])
        elif kind == "phase" and item["phase"] == "finishing" and item.get("waiting_for"):
            if self.bar is not None:
                self.bar.set_description("finishing")
            ranks = ", ".join(map(str, item["waiting_for"]))
            self.write(f"  every step is committed; waiting (at most {item['up_to_s']:.0f} s) for rank(s) {ranks} to "
                       "rejoin, so that every replica is compared at the end")

    def _on_step(self, item: dict) -> None:
        step = item["step"]
        if not self.started:  # the rate from here on is training's, not set-up's
            self.started = True
            self.total = self.run.options.steps  # a training function's is known once its ranks are set up
            self.t0 = time.monotonic()
            self.first_step = step
            self.next_line = step + 1 + max(1, self.total // 10)
            self.line_at = self.t0
            if self.bar is None:
                self.write(f"  training: step {step + 1} committed, {self.t0 - self.created:.1f} s after the start "
                           f"(set-up); a line every {max(1, self.total // 10)} steps or {LINE_EVERY_S:.0f} s")
            if self.bar is not None:
                self.bar.reset(total=self.total)
                self.bar.set_description("train")
                self.bar.update(step)
        if self.bar is not None:
            self.bar.update(1)
        now = time.monotonic()
        last = step + 1 >= self.total
        self.loss, self.quorum = item["loss"], item["quorum"]
        if self.bar is not None and (now - self.post_at > 0.2 or last):
            self.post_at = now
            self.bar.set_postfix(self._postfix(self.loss, len(self.run.live_ranks), self.quorum), refresh=False)
        elif self.bar is None and (step + 1 >= self.next_line or last or now - self.line_at >= LINE_EVERY_S):
            self.next_line = step + 1 + max(1, self.total // 10)
            self.line_at = now
            rate = (step - self.first_step) / max(1e-9, now - self.t0)
            loss = "-" if item["loss"] is None else f"{item['loss']:.4f}"
            self.write(f"  step {step + 1}/{self.total}  loss {loss}  live {len(self.run.live_ranks)}  "
                       f"{rate:.1f} steps/s" + (f"  test_acc {self.test_acc}" if self.test_acc else ""))


def _progress(run: Any, tty: bool):
    """A :class:`_Progress` fed by the run's items; worker output goes through its ``write``."""
    from ..runtime.controller import Controller, print_output

    shown = _Progress(run, tty)
    run.subscribe(shown.on_item)
    controller = Controller.get()

    def sink(line) -> None:
        shown.write(f"[{line.rank}] {line.text}")

    if print_output in controller.output_sinks:
        controller.output_sinks[controller.output_sinks.index(print_output)] = sink

        def restore() -> None:
            if sink in controller.output_sinks:
                controller.output_sinks[controller.output_sinks.index(sink)] = print_output

        return shown, restore
    return shown, None
