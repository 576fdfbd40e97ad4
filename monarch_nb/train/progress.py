"""Following a training run in a terminal: a tqdm progress bar, one line per recovery event."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["follow", "describe_recovery"]

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
    """Block until ``run`` ends, showing a progress bar on stderr if ``progress``.

    The bar starts counting when the first step is committed, so its rate is the training's,
    not the set-up's; worker output goes through ``tqdm.write`` so the bar stays intact.

    Raises:
        KeyboardInterrupt: after stopping the run (its partial report is ``run.report()``).
    """
    bar = restore_sinks = None
    if progress:
        bar, restore_sinks = _progress(run)
    try:
        while not run.wait(0.25):
            pass
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


def _progress(run: Any):
    """A tqdm bar fed by the run's metrics; worker output goes through ``tqdm.write``."""
    from tqdm import tqdm

    from ..runtime.controller import Controller, print_output

    total = run.options.steps
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="setting up")
    state = {"failures": 0, "started": False, "post": 0.0, "test_acc": None}

    def on_item(item: dict) -> None:
        kind = item.get("type")
        if kind == "step":
            if not state["started"]:  # the rate from here on is training's, not set-up's
                state["started"] = True
                bar.reset(total=total)
                bar.set_description("train")
                bar.update(item["step"])
            bar.update(1)
            now = time.monotonic()
            if now - state["post"] > 0.2 or item["step"] + 1 >= total:
                state["post"] = now
                post = {"loss": "-" if item["loss"] is None else f"{item['loss']:.4f}", "live": len(item["live_ranks"]),
                        "quorum": item["quorum"]}
                if state["test_acc"] is not None:
                    post["test_acc"] = state["test_acc"]
                if state["failures"]:
                    post["failures"] = state["failures"]
                bar.set_postfix(post, refresh=False)
        elif kind == "eval" and item.get("test_accuracy") is not None:
            state["test_acc"] = f"{item['test_accuracy']:.3f}"
        elif kind == "recovery":
            if item["event"] == "failed":
                state["failures"] += 1
            if item["event"] == "restored":
                bar.n = item["step"]
                bar.refresh()
            bar.write("  " + describe_recovery(item))
        elif kind == "phase" and not state["started"]:
            bar.set_description(item["phase"])
        elif kind == "phase" and item["phase"] == "finishing" and item.get("waiting_for"):
            bar.set_description("finishing")
            ranks = ", ".join(map(str, item["waiting_for"]))
            bar.write(f"  every step is committed; waiting (at most {item['up_to_s']:.0f} s) for rank(s) {ranks} to "
                      "rejoin, so that every replica is compared at the end")

    run.subscribe(on_item)
    controller = Controller.get()

    def sink(line) -> None:
        bar.write(f"[{line.rank}] {line.text}")

    if print_output in controller.output_sinks:
        controller.output_sinks[controller.output_sinks.index(print_output)] = sink

        def restore() -> None:
            if sink in controller.output_sinks:
                controller.output_sinks[controller.output_sinks.index(sink)] = print_output

        return bar, restore
    return bar, None
