"""A torchrun DDP script under torchrun and under monarch_nb: launch, second launch, kill -> training again.

    python bench/spmd.py [--procs 4] [--repeats 3] [--quick]

The same script (bench/_spmd_script.py: env:// rendezvous, gloo, a DDP MLP, one line per step
with its wall-clock time) runs, in this one run, on this one machine:

- ``torchrun --nproc-per-node=N --max-restarts=1 script`` (torch's own launcher, a subprocess);
- ``monarch-nb run --procs N --max-restarts 1 script`` (a subprocess: a cold start, like torchrun's);
- ``run_script(procs, script, max_restarts=1)`` on a mesh reserved once in this process (the
  notebook's and Monarch's ``run_spmd`` way: "reserve once, iterate many times").

Figures, seconds (median of ``--repeats``):

- launch -> first step: from starting the launcher (or calling ``run_script``) to the first
  "step 0" line of any rank.
- second launch: the same for a second run right after the first; for torchrun and the cold
  command, a launch is a launch; for the reserved mesh the procs and ``import torch`` are paid.
- kill -> training again: a rank SIGKILLed (by pid, from here) at step ``--kill-at``, to the first
  step line of the restarted attempt (torchrun and monarch_nb both restart the whole group).

Targets (issue 26): second launch <= 0.2x torchrun's; kill -> training again <= 0.5x torchrun's.
Writes bench/results/spmd.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
SCRIPT = ROOT / "bench" / "_spmd_script.py"
_STEP = re.compile(r"t=([0-9.]+) pid=(\d+) rank=(\d+) attempt=(\S+) step (\d+)")


class Lines:
    """Step lines seen (from a subprocess's output, or from the controller's output events)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int, str, int]] = []  # (t, pid, rank, attempt, step)
        self.other: list[str] = []  # lines that are not step lines (a launcher's errors)
        self.cond = threading.Condition()

    def feed(self, line: str) -> None:
        found = [(float(m[1]), int(m[2]), int(m[3]), m[4], int(m[5])) for m in _STEP.finditer(line)]  # ranks' lines interleave on one pipe
        if not found:
            self.other.append(line.rstrip())
        if found:
            with self.cond:
                self.steps.extend(found)
                self.cond.notify_all()

    def wait(self, predicate, timeout_s: float = 120.0, alive=lambda: True):
        """The first step line that ``predicate`` accepts, or None when ``alive()`` turns false
        (the launcher exited) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                found = [s for s in self.steps if predicate(s)]
                if found:
                    return found[0]
                if time.monotonic() > deadline or not alive():
                    return None
                self.cond.wait(0.2)


def _pump(popen: subprocess.Popen, lines: Lines) -> threading.Thread:
    def run() -> None:
        for line in popen.stdout:
            lines.feed(line)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _launch_subprocess(argv: list[str], steps: int, kill_at: int | None) -> dict:
    """Run a launcher; time its first step and, with ``kill_at``, kill -> first step after."""
    lines = Lines()
    t0 = time.time()
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    _pump(popen, lines)
    out: dict = {}
    alive = lambda: popen.poll() is None  # noqa: E731
    try:
        first = lines.wait(lambda s: s[4] == 0, alive=alive)
        out["launch_to_first_step_s"] = first[0] - t0 if first else None
        if kill_at is not None and first is not None:
            victim = lines.wait(lambda s: s[2] == 1 and s[4] == kill_at, alive=alive)
            t_kill = time.time()
            os.kill(victim[1], signal.SIGKILL)
            again = lines.wait(lambda s: s[0] > t_kill and s[1] != victim[1] and s[4] == 0, alive=alive)
            out["kill_to_training_again_s"] = again[0] - t_kill if again else None
        popen.wait(timeout=300)
        out["exit"] = popen.returncode
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    if out.get("exit"):
        out["error"] = [line for line in lines.other if "Error" in line][-3:]
    return out


def _two_launches(argv: list[str], steps: int, kill_at: int) -> dict:
    first = _launch_subprocess(argv, steps, None)
    second = _launch_subprocess(argv, steps, kill_at)
    return {"launch_to_first_step_s": first["launch_to_first_step_s"],
            "second_launch_to_first_step_s": second["launch_to_first_step_s"],
            "kill_to_training_again_s": second.get("kill_to_training_again_s"), "exits": [first["exit"], second["exit"]],
            "errors": first.get("error", []) + second.get("error", [])}


def bench_torchrun(procs: int, steps: int, kill_at: int) -> dict:
    return _two_launches([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
                          "--max-restarts=1", str(SCRIPT), str(steps)], steps, kill_at)


def bench_command(procs: int, steps: int, kill_at: int) -> dict:
    return _two_launches([sys.executable, "-m", "monarch_nb.cli", "run", "--procs", str(procs), "--max-restarts", "1",
                          str(SCRIPT), str(steps)], steps, kill_at)


def bench_reserved(procs: int, steps: int, kill_at: int) -> dict:
    """On a mesh reserved once in this process (its spawn not counted: it is paid once per session)."""
    import monarch_nb
    from monarch_nb.runtime.controller import Controller
    from monarch_nb.spmd import run_script
    from monarch_nb.spmd.cli import SCRIPT_PRELOAD

    lines = Lines()
    ctrl = Controller.get()
    t_spawn = time.time()
    mesh = monarch_nb.this_host().spawn_procs(per_host={"gpus": procs}, preload=SCRIPT_PRELOAD)
    spawn_s = time.time() - t_spawn
    sink = _output_sink(ctrl, lines)
    try:
        out = {"reserve_s": spawn_s}
        for name in ("launch_to_first_step_s", "second_launch_to_first_step_s"):
            t0 = time.time()
            run_script(mesh, str(SCRIPT), [str(steps)])
            out[name] = lines.wait(lambda s, t0=t0: s[0] > t0 and s[4] == 0)[0] - t0
        t0 = time.time()
        done = threading.Event()
        result: dict = {}

        def go() -> None:
            try:
                result["run"] = run_script(mesh, str(SCRIPT), [str(steps)], max_restarts=1)
            except Exception as exc:  # noqa: BLE001 - reported in the JSON
                result["error"] = repr(exc)
            done.set()

        threading.Thread(target=go, daemon=True).start()
        victim = lines.wait(lambda s: s[0] > t0 and s[2] == 1 and s[4] == kill_at)
        t_kill = time.time()
        os.kill(victim[1], signal.SIGKILL)
        again = lines.wait(lambda s: s[0] > t_kill and s[1] != victim[1] and s[4] == 0)
        out["kill_to_training_again_s"] = again[0] - t_kill
        done.wait(300)
        out["attempts"] = result["run"].attempts if "run" in result else result.get("error")
        return out
    finally:
        sink()
        mesh.stop()


def _output_sink(ctrl, lines: Lines):
    """Feed every rank's output line to ``lines`` (an output sink); returns the function that removes it."""
    def sink(line) -> None:
        lines.feed(line.text)
    ctrl.output_sinks.append(sink)
    return lambda: ctrl.output_sinks.remove(sink)


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, missing: str = "-", unit: str = "") -> str:
    return f"{value:.2f}{unit}" if value is not None else missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="steps per run (about 25 ms each)")
    p.add_argument("--kill-at", type=int, default=10, help="the step at which rank 1 is SIGKILLed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one repeat")
    args = p.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[dict]] = {"torchrun": [], "monarch-nb run (cold command)": [], "run_script (reserved mesh)": []}
    for i in range(repeats):
        print(f"repeat {i + 1} of {repeats}", file=sys.stderr)
        runs["torchrun"].append(bench_torchrun(args.procs, args.steps, args.kill_at))
        runs["monarch-nb run (cold command)"].append(bench_command(args.procs, args.steps, args.kill_at))
        runs["run_script (reserved mesh)"].append(bench_reserved(args.procs, args.steps, args.kill_at))
    figures = ("launch_to_first_step_s", "second_launch_to_first_step_s", "kill_to_training_again_s")
    summary = {name: {f: _median([r.get(f) for r in rs]) for f in figures} for name, rs in runs.items()}
    ref = summary["torchrun"]
    for s in summary.values():
        s["second_launch_vs_torchrun"] = _ratio(s["second_launch_to_first_step_s"], ref["second_launch_to_first_step_s"])
        s["kill_to_training_again_vs_torchrun"] = _ratio(s["kill_to_training_again_s"], ref["kill_to_training_again_s"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"procs": args.procs, "steps": args.steps, "kill_at": args.kill_at, "repeats": repeats, "cpus": os.cpu_count(),
           "summary": summary, "runs": runs, "targets": {"second_launch_vs_torchrun": 0.2, "kill_to_training_again_vs_torchrun": 0.5}}
    (RESULTS / "spmd.json").write_text(json.dumps(out, indent=1))
    print(f"\n{args.procs} ranks on {os.cpu_count()} cores, median of {repeats} (seconds; 'failed': the launcher's restart never trained again)")
    print(f"{'':32} {'launch':>8} {'2nd launch':>11} {'kill->again':>12} {'2nd vs tr':>10} {'kill vs tr':>11}")
    for name, s in summary.items():
        print(f"{name:32} {_fmt(s['launch_to_first_step_s']):>8} {_fmt(s['second_launch_to_first_step_s']):>11} "
              f"{_fmt(s['kill_to_training_again_s'], 'failed'):>12} {_fmt(s['second_launch_vs_torchrun'], '-', 'x'):>10} "
              f"{_fmt(s['kill_to_training_again_vs_torchrun'], '-', 'x'):>11}")
    for name, rs in runs.items():
        for err in {e for r in rs for e in r.get("errors", [])}:
            print(f"  {name}: {err[:160]}")
    print(f"targets: 2nd launch <= 0.20x torchrun's, kill -> training again <= 0.50x; JSON: {RESULTS / 'spmd.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
