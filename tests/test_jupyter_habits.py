"""The everyday moves of %px / nbdistributed users, through a real kernel: auto mode, moving
values, --local, per-rank names, status, barrier, waits that keep widgets alive, interrupts,
progress bars and rich output per rank, and widgets that leave a static fallback behind."""

from __future__ import annotations

import base64
import glob
import re
import time

import pytest

from .conftest import pid_alive, wait_until
from .jupyter_kernel import Kernel

pytestmark = [pytest.mark.timeout(180), pytest.mark.kernel]


@pytest.fixture(scope="module")
def mesh():
    k = Kernel()
    pids: list[int] = []
    try:
        k.ok("procs = %mesh start 4")
        yield k
        pids = k.worker_pids()
    finally:
        k.shutdown()
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 10.0, message=f"kernel's workers {pids} gone")


def _outs(ex) -> list[str]:
    return [d["text/plain"] for d in ex.displays()]


def test_auto_mode_on_and_off_around_three_cells(mesh):
    assert "auto mode on" in mesh.ok("%mesh auto on").stream_text()
    assert _outs(mesh.ok("auto_x = rank * 3\nauto_x")) == [f"Out[{r}]: {r * 3}" for r in range(4)]
    failed = mesh.execute("raise ValueError(f'auto {rank}')")  # an error cell keeps the mode
    assert failed.status == "error" and failed.error["ename"] == "MeshCellError"
    assert _outs(mesh.ok("auto_x + 1")) == [f"Out[{r}]: {r * 3 + 1}" for r in range(4)]
    assert "auto mode on" in mesh.ok("%mesh status").stream_text()  # a line magic runs in the kernel
    assert "auto mode off" in mesh.ok("%automesh").stream_text()
    assert mesh.ok("'auto_x' in dir()").displays()[0]["text/plain"] == "False"  # in the kernel again


def test_push_pull_scatter_gather_ints_arrays_tensors(mesh):
    mesh.ok("import numpy as np, torch\nn = 7\narr = np.arange(10) * 1.5\nten = torch.arange(12.0).reshape(6, 2)")
    assert "pushed n, arr, ten to rank(s) 0-3" in mesh.ok("%mesh push n arr ten").stream_text()
    got = _outs(mesh.ok("%%mesh\n(n, float(arr.sum()), ten.shape[0], float(ten.sum()))"))
    assert got == [f"Out[{r}]: (7, 67.5, 6, 66.0)" for r in range(4)]
    mesh.ok("%%mesh\nimport torch\nmine = torch.full((2,), float(rank))\nsq = rank * rank")
    ex = mesh.ok("pulled = %mesh pull sq\nprint(pulled.values())")
    assert ex.stream_text().strip() == "[0, 1, 4, 9]"
    assert "0: 3, 1: 3, 2: 2, 3: 2" in mesh.ok("%mesh scatter arr").stream_text()
    assert _outs(mesh.ok("%%mesh\narr.tolist()")) == ["Out[0]: [0.0, 1.5, 3.0]", "Out[1]: [4.5, 6.0, 7.5]",
                                                       "Out[2]: [9.0, 10.5]", "Out[3]: [12.0, 13.5]"]
    mesh.ok("back = %mesh gather arr\nassert (back == np.arange(10) * 1.5).all() and back.dtype == arr.dtype")
    mesh.ok("%mesh scatter ten\nback_t = %mesh gather ten\nassert torch.equal(back_t, ten)")
    mesh.ok("gathered = %mesh gather mine\nassert torch.equal(gathered, torch.tensor([0., 0., 1., 1., 2., 2., 3., 3.]))")
    mesh.ok("words = list('abcdefg')\n%mesh scatter words --ranks 1,3\nback_w = %mesh gather words --ranks 1,3\nassert back_w == words")
    mesh.ok("procs.push(k=41)\nassert procs.pull('k').values() == [41] * 4\n"
            "procs.scatter('chunk', list(range(8)))\nassert procs.gather('chunk') == list(range(8))")
    for code, expected in [("%mesh pull nope", "name 'nope' is not defined on rank 0"),
                           ("%mesh push nope", "no variable 'nope' in this kernel"),
                           ("%mesh scatter n", "scatter needs a sequence")]:
        ex = mesh.execute(code)
        assert ex.status == "error" and expected in ex.stream_text("stderr") + str(ex.error), code


def test_local_runs_the_cell_in_the_kernel_too(mesh):
    ex = mesh.ok("%%mesh --local --ranks 0,1\nboth = 'here'\nprint('ran', globals().get('rank', 'kernel'))")
    assert "ran kernel" in ex.stream_text() and "[stdout:1] ran 1" in ex.stream_text()
    assert ex.stream_text().index("ran kernel") < ex.stream_text().index("[stdout:0]")  # local first
    mesh.ok("assert both == 'here'")
    assert _outs(mesh.ok("%%mesh --ranks 0,1\nboth")) == ["Out[0]: 'here'", "Out[1]: 'here'"]


def test_device_and_local_rank_without_importing_torch_first(mesh):
    mesh.ok("%mesh restart 2")  # a fresh namespace: nothing imported torch on rank 2
    assert _outs(mesh.ok("%%mesh --ranks 2\nimport sys\n'torch' in sys.modules")) == ["Out[2]: False"]
    assert _outs(mesh.ok("%%mesh --ranks 2\n(str(device), local_rank)")) == ["Out[2]: ('cpu', 2)"]
    assert _outs(mesh.ok("%%mesh --ranks 2\n'torch' in sys.modules")) == ["Out[2]: True"]


def test_status_answers_the_first_question(mesh, tmp_path):
    started = tmp_path / "started"
    mesh.ok(f"%%mesh --no-block --ranks 1 --out busy\nimport time\nopen({str(started)!r}, 'w').close()\n"
            "for _ in range(100):\n    time.sleep(0.05)")
    wait_until(started.exists, 20, message="rank 1 running its cell")
    text = mesh.ok("%mesh status").stream_text()
    lines = text.splitlines()
    header = next(line for line in lines if line.strip().startswith("rank"))
    for column in ("state", "pid", "heartbeat", "device", "memory used / total", "cpu %", "rss", "running"):
        assert column in header, header
    rows = {int(line.split()[0]): line for line in lines if re.match(r"^\s+\d+\s", line)}
    assert sorted(rows) == [0, 1, 2, 3]
    assert all(" cpu " in row and "MiB" in row for row in rows.values()), rows
    assert "<mesh-cell-" in rows[1] and "<mesh-cell-" not in rows[0]
    assert "cells running: <mesh-cell-" in text
    mesh.ok("%mesh barrier\nassert busy.done()")


def test_barrier_waits_for_every_rank_to_be_idle(mesh):
    ex = mesh.ok("%%mesh --no-block --out slow\nimport time\ntime.sleep(0.5 + rank * 0.2)\nprint('finished', rank)")
    t0 = time.monotonic()
    mesh.ok("assert not slow.done()\n%mesh barrier\nassert slow.done() and not slow.errors")
    assert time.monotonic() - t0 >= 0.5

    def every_rank_finished(outputs) -> bool:
        text = "".join(c.get("text", "") for t, c in outputs)
        return all(f"finished {r}" in text for r in range(4))

    outs = mesh.drain(ex.msg_id, 5, until=every_rank_finished)
    assert every_rank_finished(outs), outs  # "finished 3" included: rank 3 sleeps longest
    mesh.ok("procs.barrier(timeout_s=30)")


def test_wait_interactive_in_a_kernel(mesh):
    mesh.ok("%%mesh --no-block --out waited\nimport time\ntime.sleep(0.3)")
    ex = mesh.ok("assert waited.wait_interactive(timeout=30)\nassert waited.done()")
    bars = [d for d in ex.displays() if "application/vnd.jupyter.widget-view+json" in d]
    assert bars, ex.outputs  # tqdm.auto's notebook bar


def test_an_interrupt_during_a_local_cell_stops_background_cells(mesh, tmp_path):
    mesh.ok("%%mesh --no-block --out bg2\nimport time, os\n"
            f"while True:\n    open(os.path.join({str(tmp_path)!r}, str(rank)), 'w').write(repr(time.time()))\n"
            "    time.sleep(0.01)")
    wait_until(lambda: len(glob.glob(f"{tmp_path}/[0-9]")) == 4, 20, message="all ranks looping")
    local = tmp_path / "local-started"
    msg_id = mesh.send(f"import time\nopen({str(local)!r}, 'w').close()\nwhile True:\n    time.sleep(0.05)")
    wait_until(local.exists, 20, message="a local cell keeping the kernel busy")
    mesh.km.interrupt_kernel()
    ex = mesh.collect(msg_id, 20)
    assert ex.status == "error" and ex.error["ename"] == "KeyboardInterrupt"
    wait_until(lambda: mesh.ok("bg2.done()").displays()[0]["text/plain"] == "True", 10, 0.05,
               message="the background cell stopped by the interrupt of another cell")
    stamps = sorted(glob.glob(f"{tmp_path}/[0-9]"))
    before = [open(p).read() for p in stamps]
    time.sleep(0.2)
    assert [open(p).read() for p in stamps] == before  # stopped on every rank
    mesh.ok("%%mesh\nassert rank in range(4)")  # the mesh serves


def test_a_wait_keeps_the_tree_widget_answering_clicks(mesh, tmp_path):
    ex = mesh.ok("%mesh tree")
    view = next(d["application/vnd.jupyter.widget-view+json"] for d in ex.displays()
                if "application/vnd.jupyter.widget-view+json" in d)
    started = tmp_path / "waiting"
    until = "Controller.get().proc_record(procs.name, 3).state in ('failed', 'restarting', 'starting')"
    msg_id = mesh.send(f"from monarch_nb.runtime.controller import Controller\nopen({str(started)!r}, 'w').close()\n"
                       f"%mesh wait --until \"{until}\" --timeout 60")
    wait_until(started.exists, 20, message="the cell running")  # from here on, only a click can end it
    mesh.send_comm(view["model_id"], {"method": "custom", "content": {"action": "fault", "kind": "kill", "mesh": "pm0", "rank": 3}})
    waited = mesh.collect(msg_id, 90)
    assert waited.status == "ok", waited.error
    mesh.ok("%mesh restart 3")


def test_progress_bars_are_redrawn_in_place_per_rank(mesh):
    ex = mesh.ok("%%mesh --ranks 0,1\nfrom tqdm.auto import tqdm\nimport time\n"
                 "for i in tqdm(range(8), mininterval=0):\n    time.sleep(0.1)\nprint('after the bar', rank)", 60)
    ids = ex.display_ids()
    assert len(ids) == 2, ex.outputs  # one live line per rank's bar
    for display_id in ids:
        updates = [d["text/plain"] for d in ex.updates(display_id)]
        assert len(updates) >= 3, updates  # redrawn, not appended
        assert re.search(r"^\[stderr:[01]\] 100%.*8/8", updates[-1]), updates[-1]
    assert "\r" not in ex.stream_text() and "it/s" not in ex.stream_text()
    assert "[stdout:0] after the bar 0" in ex.stream_text()


def test_partial_line_shows_after_a_quiet_period_then_completes(mesh):
    ex = mesh.ok("%%mesh --ranks 0\nimport time\nprint('loading...', end='', flush=True)\ntime.sleep(0.8)\nprint('ok')")
    [display_id] = ex.display_ids()
    assert ex.displays()[0]["text/plain"] == "[stdout:0] loading..."
    assert ex.updates(display_id)[-1]["text/plain"] == "[stdout:0] loading...ok"
    quick = mesh.ok("%%mesh --ranks 0\nprint('a', 'b', 'c')")  # pieces of one line: one stream line
    assert quick.display_ids() == [] and "[stdout:0] a b c\n" in quick.stream_text()


def test_rich_output_per_rank_in_order_with_the_text(mesh):
    ex = mesh.ok(
        "%%mesh --ranks 0,1\n"
        "from IPython.display import display, HTML, Markdown\n"
        "import pandas as pd\nimport matplotlib.pyplot as plt\n"
        "print('first', rank)\n"
        "display(HTML(f'<b>html {rank}</b>'))\n"
        "display(Markdown(f'*md {rank}*'))\n"
        "display(pd.DataFrame({'rank': [rank]}))\n"
        "plt.plot([0, rank])\nplt.show()\n"
        "print('last', rank)\n"
        "fig = plt.figure()\nplt.plot([1, 0])\nfig\n", 120)
    for rank in (0, 1):
        seq = []
        for t, c in ex.outputs:
            if t == "stream":
                seq += [line for line in c["text"].splitlines() if line.startswith((f"[stdout:{rank}]", f"[output:{rank}]"))]
            elif t == "display_data" and seq and seq[-1] == f"[output:{rank}]":
                seq[-1] = next(k for k in ("text/html", "text/markdown", "image/png") if k in c["data"])
        assert seq == [f"[stdout:{rank}] first {rank}", "text/html", "text/markdown", "text/html", "image/png",
                       f"[stdout:{rank}] last {rank}"], seq
    htmls = [d.get("text/html", "") for d in ex.displays()]
    assert any("<b>html 1</b>" in h for h in htmls) and any("<table" in h and "rank" in h for h in htmls)
    pngs = [d for d in ex.displays() if d.get("text/plain", "").startswith("Out[")]
    assert [d["text/plain"].split(":")[0] for d in pngs] == ["Out[0]", "Out[1]"]
    assert all(base64.b64decode(d["image/png"])[:4] == b"\x89PNG" for d in pngs)


def test_stopped_widgets_leave_their_last_state_as_html(mesh):
    tree = mesh.ok("%mesh tree")
    [display_id] = tree.display_ids()
    assert "text/html" in tree.displays()[0] and "mnb-tree-static" in tree.displays()[0]["text/html"]
    stop = mesh.ok("%mesh stop")
    frozen = stop.updates(display_id)
    assert frozen, stop.outputs
    assert "application/vnd.jupyter.widget-view+json" not in frozen[-1]
    assert "rank 3" in frozen[-1]["text/html"] and "healthy" in frozen[-1]["text/plain"]
    mesh.ok("procs = %mesh start 4")


def test_await_wait_in_python(mesh):
    mesh.ok("%%mesh --no-block --out awaited\nimport time\ntime.sleep(0.3)")
    mesh.ok("from monarch_nb.jupyter import wait\nassert await wait(awaited, timeout_s=30)\nassert awaited.done()")
    ex = mesh.execute("%mesh wait --until 'False' --timeout 0.2")
    assert ex.status == "error" and "still waiting for False after 0.2 s" in ex.stream_text("stderr") + str(ex.error)


def test_an_endpoints_progress_bar_outside_any_cell_is_redrawn_in_place(mesh):
    ex = mesh.ok(
        "from monarch_nb import Actor, endpoint\n"
        "class Bar(Actor):\n"
        "    @endpoint\n"
        "    def go(self):\n"
        "        import sys, time\n"
        "        for i in range(5):\n"
        "            sys.stderr.write(f'\\rstep {i}/5')\n"
        "            sys.stderr.flush()\n"
        "            time.sleep(0.15)\n"
        "        sys.stderr.write('\\rstep 5/5\\n')\n"
        "bars = procs.spawn('bars', Bar)\n"
        "bars.slice(gpus=0).go.call_one().get(timeout=30)\n", 60)

    def finished(outputs):
        return any(t == "update_display_data" and c["data"]["text/plain"] == "[0] step 5/5" for t, c in outputs)

    outputs = ex.outputs if finished(ex.outputs) else ex.outputs + mesh.drain(ex.msg_id, 10, until=finished)
    created = [c for t, c in outputs if t == "display_data" and c.get("transient", {}).get("display_id")]
    assert len(created) == 1 and created[0]["data"]["text/plain"].startswith("[0] step "), outputs
    display_id = created[0]["transient"]["display_id"]
    updates = [c["data"]["text/plain"] for t, c in outputs
               if t == "update_display_data" and c["transient"]["display_id"] == display_id]
    assert updates and updates[-1] == "[0] step 5/5", outputs
    assert "\r" not in "".join(c.get("text", "") for t, c in outputs if t == "stream")
