"""Workspace sync: a project folder pushed to the mesh's hosts, first time, unchanged, one file edited.

    python bench/workspace_sync.py [--files 300] [--data-mib 16] [--repeats 5] [--quick]

The project is synthetic and the same every run: ``--files`` Python modules of about 4 KiB each in
ten packages, plus one data file of ``--data-mib`` MiB. The hosts are two Linux network
namespaces running real worker loops, attached over CurveZMQ (tests/netns_cluster.py; needs
root), or this machine's own host agent where namespaces are not available (the JSON says which).
Two procs per host import one module of the project. Measured in one run, seconds:

- first sync: every file to every host (fresh agents), once;
- unchanged: a sync when nothing changed (the scan and hashing, one round trip per host);
- one file edited: one module changed, synced; and the same with ``auto_reload`` (the procs that
  imported it reload it: the round trip to every proc included);
- peer: what a push without content hashes costs, the whole folder copied once per host with
  ``shutil.copytree`` into a fresh folder on local disk: a lower bound for a full ``scp``/``tar``
  push over a network (rsync is not installed here; Monarch's code sync uses rsync).

Prints a table, writes bench/results/workspace_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import monarch_nb  # noqa: E402
from monarch_nb import Actor, endpoint  # noqa: E402
from monarch_nb.transport.keys import create_keys  # noqa: E402
from tests.netns_cluster import NetnsCluster, namespaces_unavailable  # noqa: E402

RESULTS = ROOT / "bench" / "results"


class Importer(Actor):
    @endpoint
    def value(self) -> int:
        from bench_pkg0 import mod0

        return mod0.VALUE


def make_project(root: Path, files: int, data_mib: int) -> None:
    body = "".join(f"def f{i}(x):\n    return x * {i} + {i}  # padding padding padding padding\n" for i in range(50))
    for i in range(files):
        pkg = root / f"bench_pkg{i % 10}"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
        (pkg / f"mod{i // 10}.py").write_text(f"VALUE = 0\n{body}")
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "tokens.bin").write_bytes(os.urandom(data_mib * 2**20))


def _median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=300, help="Python modules in the project (default 300)")
    p.add_argument("--data-mib", type=int, default=16, help="size of the project's data file, MiB (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="samples per figure (default 5)")
    p.add_argument("--quick", action="store_true", help="100 files, 4 MiB, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.files, args.data_mib, args.repeats = 100, 4, 3
    work = Path(tempfile.mkdtemp(prefix="bench-workspace-"))
    project = work / "project"
    make_project(project, args.files, args.data_mib)
    why_not = namespaces_unavailable()
    cluster = None
    try:
        if why_not is None:
            cluster = NetnsCluster(2, create_keys(str(work / "keys"))).start()
            hosts = monarch_nb.attach_to_workers(cluster.addresses, ca=cluster.ca)
            where = "2 namespace hosts, CurveZMQ"
        else:
            hosts = monarch_nb.this_host()
            where = f"this machine's host agent only ({why_not})"
        n_hosts = len(hosts.host_names)
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        t0 = time.perf_counter()
        first = procs.sync_workspace(project, max_bytes=(args.data_mib + 64) * 2**20)
        first_s = time.perf_counter() - t0
        actors = procs.spawn("importer", Importer)
        assert set(actors.value.call().get(timeout=60).values()) == {0}
        unchanged, edited, reloaded, peer = [], [], [], []
        module = project / "bench_pkg0" / "mod0.py"
        text = module.read_text()
        for r in range(args.repeats):
            t0 = time.perf_counter()
            done = procs.sync_workspace(project, max_bytes=(args.data_mib + 64) * 2**20)
            unchanged.append(time.perf_counter() - t0)
            assert done.written == 0
            module.write_text(text.replace("VALUE = 0", f"VALUE = {2 * r + 1}", 1))
            t0 = time.perf_counter()
            done = procs.sync_workspace(project, max_bytes=(args.data_mib + 64) * 2**20)
            edited.append(time.perf_counter() - t0)
            assert done.written == n_hosts
            module.write_text(text.replace("VALUE = 0", f"VALUE = {2 * r + 2}", 1))
            t0 = time.perf_counter()
            done = procs.sync_workspace(project, max_bytes=(args.data_mib + 64) * 2**20, auto_reload=True)
            reloaded.append(time.perf_counter() - t0)
            assert all(rel.reloaded == ("bench_pkg0.mod0",) for rel in done.reloads), done.reloads
            assert set(actors.value.call().get(timeout=60).values()) == {2 * r + 2}
            t0 = time.perf_counter()
            for h in range(n_hosts):
                shutil.copytree(project, work / f"peer{r}-{h}")
            peer.append(time.perf_counter() - t0)
            for h in range(n_hosts):
                shutil.rmtree(work / f"peer{r}-{h}")
        procs.stop()
        out = {
            "where": where, "hosts": n_hosts, "procs": 2 * n_hosts, "files": first.files, "bytes": first.total_bytes,
            "repeats": args.repeats,
            "first_sync_s": first_s, "first_sync_bytes_per_host": first.hosts[0].bytes,
            "unchanged_s": _median(unchanged), "one_file_s": _median(edited), "one_file_reload_s": _median(reloaded),
            "peer_full_copy_s": _median(peer),
            "samples": {"unchanged": unchanged, "one_file": edited, "one_file_reload": reloaded, "peer_full_copy": peer},
        }
    finally:
        from monarch_nb.runtime.controller import Controller

        controller = Controller.existing()
        if controller is not None:
            controller.shutdown()
        if cluster is not None:
            cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "workspace_sync.json").write_text(json.dumps(out, indent=1))
    mib = out["bytes"] / 2**20
    print(f"workspace sync: {out['files']} files, {mib:.1f} MiB, to {where} ({out['procs']} procs)")
    print(f"  {'first sync (everything)':<34} {out['first_sync_s']:8.3f} s")
    print(f"  {'unchanged':<34} {out['unchanged_s']:8.3f} s")
    print(f"  {'one file edited':<34} {out['one_file_s']:8.3f} s")
    print(f"  {'one file edited, auto_reload':<34} {out['one_file_reload_s']:8.3f} s")
    print(f"  {'peer: full copy per host (disk)':<34} {out['peer_full_copy_s']:8.3f} s")
    print(f"JSON: {RESULTS / 'workspace_sync.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
