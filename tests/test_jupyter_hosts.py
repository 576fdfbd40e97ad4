"""``%mesh start --hosts`` and ``--job`` through a real kernel, with worker loops on this machine's loopback.

Two ``monarch-nb worker`` processes (``python -m monarch_nb.cli worker --address
tcp://127.0.0.1:0``) are this test's hosts; a LocalJob saved to a file is the ``--job``. The
kernel attaches them and runs ``%%mesh`` cells, ``%mesh status``, ``%mesh tree``, ``%mesh fault``
and ``%mesh restart`` on a mesh with dims {hosts, gpus}; every rank's proc is checked to be a
child of its worker's host agent (it runs on that "host").
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

import pytest

from monarch_nb.job import LocalJob
from monarch_nb.job.base import read_announcement

from .conftest import pid_alive, wait_until
from .jupyter_kernel import Kernel

pytestmark = [pytest.mark.timeout(240), pytest.mark.kernel]


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _announcement(popen: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    """The JSON line a worker prints first (its address), read with a deadline."""
    sel = selectors.DefaultSelector()
    sel.register(popen.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(0.1):
            return read_announcement(popen.stdout.readline())
        if popen.poll() is not None:
            pytest.fail(f"a worker exited with {popen.returncode} before announcing itself")
    pytest.fail(f"a worker did not announce itself within {timeout_s} s")


def _stop(popens: list[subprocess.Popen]) -> None:
    for p in popens:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in popens:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


@pytest.fixture(scope="module")
def workers():
    """Two worker loops on 127.0.0.1 (no keys: loopback), stopped by pid at the end."""
    popens = [subprocess.Popen([sys.executable, "-m", "monarch_nb.cli", "worker", "--address", "tcp://127.0.0.1:0"],
                               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
              for _ in range(2)]
    try:
        announced = [_announcement(p) for p in popens]
        yield {"addresses": [a["address"] for a in announced], "pids": [p.pid for p in popens]}
    finally:
        _stop(popens)


@pytest.fixture(scope="module")
def kernel(workers):
    k = Kernel()
    pids: list[int] = []
    try:
        yield k
        pids = k.worker_pids()  # procs and host agents, remote ones included
    finally:
        k.shutdown()
    # the workers' host agents kill their procs once the controller (the kernel) is gone
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 30.0, message=f"kernel's procs and agents {pids} gone")


def _stdout(ex) -> str:
    return ex.stream_text("stdout")


def _error_text(ex) -> str:
    return ex.stream_text("stderr") + str(ex.error)


def test_bad_host_options_say_how_to_fix_them(kernel):
    cases = [
        ("%mesh start --hosts 10.0.0.5:26600", ["not on this machine", "--ca DIR", "monarch-nb keys"]),
        ("%mesh start --hosts 10.0.0.5", ["is not HOST:PORT", "monarch-nb worker --address"]),
        ("%mesh start --hosts 10.0.0.5:26600 --ca /nonexistent/keys", ["no such file", "monarch-nb keys /nonexistent/keys"]),
        ("%mesh start --hosts 127.0.0.1:1 --job x.json", ["--hosts or --job, not both"]),
        ("%mesh start 2 --mesh trainers", ["use it with --job FILE"]),
        ("%mesh start --job /nonexistent/job.json", ["no such file", "job.state()"]),
    ]
    for line, expected in cases:
        ex = kernel.execute(line)
        assert ex.status == "error", line
        text = _error_text(ex)
        assert "UsageError" in text and all(e in text for e in expected), (line, text)
    assert kernel.ok("print(1 + 1)").stream_text() == "2\n"  # the kernel is fine


def test_a_mesh_on_two_hosts_runs_cells_status_and_tree(kernel, workers):
    first, second = workers["addresses"]
    second_bare = second[len("tcp://"):]  # the scheme is optional
    ex = kernel.ok(f"procs = %mesh start 2 --hosts {first},{second_bare}", 120)
    assert "4 procs (dims {'hosts': 2, 'gpus': 2}) on 2 host(s)" in _stdout(ex), _stdout(ex)

    ex = kernel.ok("%%mesh\nimport os\nprint('hello', rank, coords['hosts'], coords['gpus'], os.getpid())", 60)
    got = sorted(re.findall(r"^\[stdout:(\d)\] hello (\d) (\d) (\d) (\d+)$", _stdout(ex), re.M))  # ranks interleave
    assert [(int(r), int(h), int(g)) for r, _, h, g, _ in got] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], _stdout(ex)
    pids = {int(r): int(p) for r, _, _, _, p in got}

    # each rank runs under its host's agent, which the worker loop at that address started
    facts = json.loads(kernel.ok(
        "import json\nfrom monarch_nb.runtime.controller import Controller\n_c = Controller.get()\n"
        "print(json.dumps({'hosts': [_c.proc_record(procs.name, r).host for r in range(4)],\n"
        "  'agents': {h.name: [h.address, h.pid] for h in _c.hosts.values() if h.address}}))").stream_text().strip())
    agents = facts["agents"]
    one, two = (next(n for n, a in agents.items() if a[0] == address) for address in (first, second))
    assert facts["hosts"] == [one, one, two, two]  # ranks numbered host by host
    for rank, pid in pids.items():
        agent = agents[facts["hosts"][rank]][1]
        assert _ppid(pid) == agent, f"rank {rank} (pid {pid}) is not a child of its host's agent {agent}"
        assert _ppid(agent) == workers["pids"][rank // 2], f"the agent of rank {rank} was not started by its worker"

    status = _stdout(kernel.ok("%mesh status", 60))
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s+(\d)\s+(host\d+)\s+healthy\s", status, re.M)}
    assert rows == {0: one, 1: one, 2: two, 3: two}, status
    assert re.search(rf"^  {one}: healthy, \S+ at {first}, load ", status, re.M), status
    assert re.search(rf"^  {two}: healthy, \S+ at {second}, load ", status, re.M), status

    ex = kernel.ok("%mesh tree")
    assert any("application/vnd.jupyter.widget-view+json" in d for d in ex.displays())
    tree = json.loads(kernel.ok(
        "from monarch_nb.jupyter.session import current\n_t = current().tree_widget\n_t.refresh()\n"
        "print(json.dumps({'layout': _t.layout, 'rows': [[r['name'], r['address'], [c['rank'] for c in r['cells']]]\n"
        "  for r in _t.grid['hosts'] if r['cells']]}))").stream_text().strip())
    assert tree == {"layout": "list", "rows": [[one, first, [0, 1]], [two, second, [2, 3]]]}


def test_fault_and_restart_on_a_remote_host(kernel, workers):
    old = int(kernel.ok("from monarch_nb.runtime.controller import Controller\n"
                        "print(Controller.get().proc_record(procs.name, 3).pid)").stream_text())
    ex = kernel.ok("%mesh fault kill 3", 60)
    assert "injected kill into rank 3" in _stdout(ex) and "SIGKILL" in _stdout(ex), _stdout(ex)
    status = _stdout(kernel.ok("%mesh status", 60))
    assert re.search(r"^\s+3\s+host\d+\s+failed\s", status, re.M), status
    assert re.search(r"^\s+2\s+host\d+\s+healthy\s", status, re.M), status  # isolated to rank 3
    ex = kernel.execute("%%mesh --ranks 3\nrank")
    assert ex.status == "error" and "SupervisionError" in "\n".join(ex.error["traceback"])
    assert "restarted" in _stdout(kernel.ok("%mesh restart 3", 120))
    ex = kernel.ok("%%mesh --ranks 2,3\nimport os\n(rank, os.getpid())", 60)
    values = [eval(d["text/plain"].split(": ", 1)[1]) for d in ex.displays()]
    assert [r for r, _ in values] == [2, 3]
    new = values[1][1]
    agent = int(kernel.ok("_c = Controller.get()\nprint(_c.hosts[_c.proc_record(procs.name, 3).host].pid)").stream_text())
    assert new != old and _ppid(new) == agent  # a new incarnation, on the same host


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _ppid(int(entry)) == pid and pid_alive(int(entry)):
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_stop_detaches_the_hosts_then_the_same_hosts_again_with_torch_distributed(kernel, workers):
    first, second = workers["addresses"]
    assert "stopped" in _stdout(kernel.ok("%mesh stop", 60))
    # %mesh stop detached the hosts it attached: their agents are gone, the workers wait for a controller
    assert kernel.ok("from monarch_nb.runtime.controller import Controller\n"
                     f"print([h.name for h in Controller.get().hosts.values() if h.address in ({first!r}, {second!r})])"
                     ).stream_text().strip() == "[]"
    wait_until(lambda: not any(_children(pid) for pid in workers["pids"]), 15, message="the workers' host agents gone")
    ex = kernel.ok(f"%mesh start 1 --hosts {first},{second} --dist", 180)
    assert "2 procs (dims {'hosts': 2, 'gpus': 1})" in _stdout(ex) and "torch.distributed up (gloo)" in _stdout(ex), _stdout(ex)
    ex = kernel.ok("%%mesh\nimport torch\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n(world_size, t.item())", 120)
    assert [d["text/plain"] for d in ex.displays()] == ["Out[0]: (2, 3.0)", "Out[1]: (2, 3.0)"]
    kernel.ok("%mesh stop", 60)


@pytest.fixture
def saved_job(tmp_path):
    """A LocalJob of two hosts, running, saved to a file (this process does not attach it)."""
    path = tmp_path / "job_state.json"
    job = LocalJob({"trainers": 2, "loaders": 1})
    job.apply()
    job.dump(str(path))
    pids = list(job.running["pids"])
    try:
        yield str(path), job
    finally:
        job.kill(cached_path=None)
        wait_until(lambda: not any(pid_alive(p) for p in pids), 15, message="the job's workers gone")


def test_start_from_a_saved_job(kernel, saved_job):
    path, job = saved_job
    ex = kernel.execute(f"%mesh start --job {path} --mesh evaluators")
    assert ex.status == "error" and "has the host meshes trainers, loaders" in _error_text(ex)
    ex = kernel.ok(f"procs = %mesh start 1 --job {path}", 120)  # its first host mesh: trainers
    assert "2 procs (dims {'hosts': 2, 'gpus': 1}) on host mesh 'trainers'" in _stdout(ex), _stdout(ex)
    ex = kernel.ok("%%mesh\nprint('from', rank, coords)", 60)
    assert "[stdout:0] from 0 {'hosts': 0, 'gpus': 0}" in _stdout(ex)
    assert "[stdout:1] from 1 {'hosts': 1, 'gpus': 0}" in _stdout(ex)
    hosts = json.loads(kernel.ok(
        "import json\nfrom monarch_nb.runtime.controller import Controller\n"
        "print(json.dumps([Controller.get().hosts[Controller.get().proc_record(procs.name, r).host].address for r in range(2)]))"
    ).stream_text())
    assert hosts == job.running["workers"]["trainers"]
    kernel.ok("%mesh stop", 60)
    ex = kernel.ok(f"%mesh start 1 --job {path} --mesh loaders", 120)
    assert "1 procs (dims {'hosts': 1, 'gpus': 1}) on host mesh 'loaders'" in _stdout(ex), _stdout(ex)
    kernel.ok("%mesh stop", 60)


def test_a_job_that_ended_is_refused(kernel, tmp_path):
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    job = LocalJob({"trainers": 1})
    job.running = {"workers": {"trainers": ["tcp://127.0.0.1:9"]}, "pids": [done.pid]}
    path = tmp_path / "ended.json"
    job.dump(str(path))
    ex = kernel.execute(f"%mesh start --job {path}")
    assert ex.status == "error" and "is not running any more" in _error_text(ex) and "job_load" in _error_text(ex)
    assert os.path.exists(path)  # nothing was started or removed


def test_a_lost_host_shows_as_lost_and_its_rank_restarts_when_it_is_back(kernel, workers):
    first, second = workers["addresses"]
    kernel.ok(f"%mesh start 1 --hosts {first},{second}", 120)
    kernel.ok("%mesh tree")
    # what the widget sends the browser: the names of the hosts its grid shows lost, as it shows them
    kernel.ok("import json\nfrom monarch_nb.runtime.controller import Controller\n"
              "from monarch_nb.jupyter.session import current\n"
              f"name = next(h.name for h in Controller.get().hosts.values() if h.address == {second!r})\n"
              "shown_lost = []\n"
              "since = Controller.get().events.next_seq\n"
              "current().tree_widget.observe(lambda change: shown_lost.extend(\n"
              "    r['name'] for r in change['new'].get('hosts', []) if r['lost']), names=['grid'])")
    agent = int(kernel.ok("print(Controller.get().hosts[name].pid)").stream_text())
    assert _ppid(agent) == workers["pids"][1]
    os.kill(agent, signal.SIGKILL)  # the host agent of the second worker dies: the host is lost
    kernel.ok("%mesh wait --until \"name in shown_lost\" --timeout 30", 60)
    assert _stdout(kernel.ok("%%mesh --ranks 0\nprint('still here', rank)", 60)).strip() == "[stdout:0] still here 0"
    # the worker loop is alive: the controller attaches it again (a fresh agent); the lost rank stays
    # failed (cause host_lost) until restarted there
    # healthy, and the return recorded (after the state, on the attaching thread): what the row shows
    kernel.ok("%mesh wait --until \"Controller.get().hosts[name].state == 'healthy' and any(e.host == name for e in "
              "Controller.get().events.events('host_returned', since_seq=since))\" --timeout 60", 90)
    row = json.loads(kernel.ok(
        "_t = current().tree_widget\n_t.refresh()\nprint(json.dumps(next(r for r in _t.grid['hosts'] if r['name'] == name)))"
    ).stream_text())
    assert not row["lost"] and row["last_event"]["kind"] == "host_returned"
    assert [(c["rank"], c["state"], c["cause"]) for c in row["cells"]] == [(1, "failed", "host_lost")]
    status = _stdout(kernel.ok("%mesh status", 60))
    assert re.search(r"^\s+1\s+host\d+\s+failed\s", status, re.M) and "host_lost" in status and "host_returned" in status, status
    assert "restarted" in _stdout(kernel.ok("%mesh restart 1", 120))
    ex = kernel.ok("%%mesh\nrank * 10", 60)
    assert [d["text/plain"] for d in ex.displays()] == ["Out[0]: 0", "Out[1]: 10"]
    kernel.ok("%mesh stop", 60)


def test_a_worker_with_the_clusters_keys_takes_ca(kernel, tmp_path):
    from monarch_nb.transport.keys import create_keys

    keys = create_keys(str(tmp_path / "keys"))
    popen = subprocess.Popen([sys.executable, "-m", "monarch_nb.cli", "worker", "--address", "tcp://127.0.0.1:0",
                              "--curve-keys", keys], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    try:
        announced = _announcement(popen)
        assert announced["encrypted"]
        address = announced["address"][len("tcp://"):]
        # without its keys: no answer (CurveZMQ drops the handshake); said after start_timeout_s
        kernel.ok("import monarch_nb\nfrom monarch_nb.config import config\n_saved = config.start_timeout_s\n"
                  "monarch_nb.configure(start_timeout_s=3.0)")
        ex = kernel.execute(f"%mesh start 1 --hosts {address}", 60)
        kernel.ok("monarch_nb.configure(start_timeout_s=_saved)")
        assert ex.status == "error" and "did not answer within 3.0 s" in _error_text(ex) and "same keys" in _error_text(ex)
        assert kernel.ok("from monarch_nb.runtime.controller import Controller\n"
                         f"print([h.name for h in Controller.get().hosts.values() if h.address == 'tcp://{address}'])"
                         ).stream_text().strip() == "[]"  # the failed attach left no host behind
        ex = kernel.ok(f"%mesh start 2 --hosts {address} --ca {keys}", 120)
        assert "2 procs (dims {'hosts': 1, 'gpus': 2})" in _stdout(ex), _stdout(ex)
        ex = kernel.ok("%%mesh\nrank + 100", 60)
        assert [d["text/plain"] for d in ex.displays()] == ["Out[0]: 100", "Out[1]: 101"]
        kernel.ok("%mesh stop", 60)
    finally:
        _stop([popen])
