"""The supervision-tree widget's cost at cluster size: refresh time and bytes sent per update, grid vs list.

    python bench/tree_widget.py [--updates 200] [--quick]

Measured in one run on a synthetic cluster (tests/synthetic_cluster.py: real records, the real
snapshot, no processes), for 4 ranks (1 host), 64 (8 hosts x 8 GPUs), 1,024 (128 x 8) and
8,192 (1,024 x 8; issue 25's size), in the list layout (one row per node: the widget's view
before the grid, the peer) and the grid layout (the list only up to 1,024 ranks: at 8,192 it
is seconds per refresh); at 1,024 ranks and more, at most 20 updates:

- ``refresh_ms``: median time of one model refresh (snapshot, grid, details, diff), in the kernel;
- ``idle_bytes``: median bytes of the state message of one update when nothing but the clock
  moved (the once-a-second tick: heartbeat ages);
- ``change_bytes``: median bytes of one update after a rank failed or came back;
- ``whole_grid_bytes``: the JSON of the whole grid, what each change cost when the grid was
  one synced trait (before it went out as row deltas: ``SupervisionTree._push_grid``);
- both with rank 3 selected (its details shown), as a user looking at the tree has.

Bytes are the JSON of the comm messages the widget sends (what the browser receives), counted by
replacing the widget's ``_send``. At 10 updates a second (the widget's cap), multiply by 10.
Prints a table and writes bench/results/tree_widget.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(hosts: int, per_host: int, view: str, updates: int) -> dict:
    import torch  # noqa: F401  (the kernel a widget lives in has it: a bigger heap for the garbage collector)

    from monarch_nb.jupyter.tree_widget import SupervisionTree
    from tests.synthetic_cluster import SyntheticController

    controller = SyntheticController(hosts=hosts, per_host=per_host)
    widget = SupervisionTree(controller=controller, view=view, max_hz=0.001)  # refreshed here only
    sent: list[int] = []
    widget._send = lambda msg, buffers=None: sent.append(len(json.dumps(msg, default=str)))
    try:
        widget.select(3)
        times, idle, change = [], [], []
        for i in range(updates):
            changed = i % 2 == 1
            if changed:  # a rank fails, then comes back at the next change
                rank = 1
                if controller.record(rank).serving:
                    controller.fail(rank, "SIGKILL", "killed by signal SIGKILL")
                else:
                    controller.restart_proc(controller.mesh, rank)
            time.sleep(0.002)  # the clock moves: heartbeat ages change
            before = len(sent)
            t0 = time.perf_counter()
            widget.refresh()
            times.append((time.perf_counter() - t0) * 1000)
            (change if changed else idle).append(sum(sent[before:]))
        return {"ranks": hosts * per_host, "layout": widget.layout, "refresh_ms": round(statistics.median(times), 3),
                "idle_bytes": int(statistics.median(idle)), "change_bytes": int(statistics.median(change)),
                "whole_grid_bytes": len(json.dumps(widget.grid, default=str))}
    finally:
        widget.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=200, help="updates per size (default 200; 20 at 1,024 ranks and more)")
    parser.add_argument("--quick", action="store_true", help="up to 1,024 ranks, 20 updates each")
    args = parser.parse_args()
    sizes = ((1, 4), (8, 8), (128, 8)) if args.quick else ((1, 4), (8, 8), (128, 8), (1024, 8))
    updates = 20 if args.quick else args.updates
    rows = [measure(hosts, per_host, view, updates if hosts * per_host < 1024 else min(updates, 20))
            for hosts, per_host in sizes for view in ("list", "grid") if view == "grid" or hosts * per_host <= 1024]
    print(f"{'ranks':>5}  {'layout':<6}  {'refresh ms':>10}  {'bytes/update idle':>17}  {'bytes/update change':>19}  "
          f"{'whole grid bytes':>16}")
    for r in rows:
        print(f"{r['ranks']:>5}  {r['layout']:<6}  {r['refresh_ms']:>10.2f}  {r['idle_bytes']:>17}  {r['change_bytes']:>19}  "
              f"{r['whole_grid_bytes']:>16}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_widget.json").write_text(json.dumps({"updates": args.updates, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
