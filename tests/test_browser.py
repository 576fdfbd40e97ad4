"""End to end in a real browser: JupyterLab in Debian's Chromium, driven by Playwright.

Opens notebook 02 and runs all its cells. While the kernel is busy in the cell that waits for
training to end (``%mesh wait run``), clicks "kill" on rank 3 in the supervision tree: the click
is handled during the wait, the rank fails and comes back healthy (the training run restarts and
heals it), the run reaches its report. The last cell (``%mesh stop``) turns the widgets into
snapshots of their last state, which stay after the notebook is saved and opened again.
Screenshots go to test-artifacts/browser/.

The tree at cluster size: a notebook shows the widget over a synthetic 8 hosts x 8 GPUs
controller (real records and snapshot, no processes: tests/synthetic_cluster.py) and waits; the
test checks the grid (64 cells, 8 host rows, a failed rank, a lost host), clicks cells and a
host, toggles the list, kills and restarts a rank from the details, and finds the static grid in
the saved notebook.

Every check waits on a condition (Playwright's ``expect`` with ``has_text`` locators, which retry
until their deadline), never on one read of a DOM that is still rendering: JupyterLab attaches
and renders cells lazily. The server runs with ``windowingMode: none`` (every cell attached) and
``expose_app_in_browser`` (the test runs "Run All Cells" through JupyterLab's command registry,
as the Run menu does).

Chromium is the apt package (``.ci/run`` installs it when missing); Playwright gets its path
through ``executable_path`` and never downloads a browser. Without Chromium the test is skipped,
except in CI, where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from .conftest import pid_alive, wait_until
from .jupyter_kernel import kernelspec_prefix

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
NOTEBOOK = "02_fault_tolerant_training.ipynb"
#: training steps in the browser's copy of notebook 02: more than the test ever lets it train (about
#: 10 ms a step on the 2-core CI machine); it ends the run with the dashboard's "stop training"
#: button once it saw a rank heal while the last cell waited
STEPS = 20_000
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET") -> object:
    req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        body = resp.read()
    return json.loads(body) if body else None


@pytest.fixture
def lab(tmp_path, request):
    """A JupyterLab server on 127.0.0.1 with a token, serving a copy of notebooks/ (the
    "Monarch (Python 3)" kernelspec installed where it looks). When the test failed, the end of
    the server's log (its kernels' stderr: the runtime's and the trainer's warnings) is printed
    and the whole log kept beside the screenshots."""
    failed_before = request.session.testsfailed
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI (.ci/run installs the apt package `chromium`)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    root = tmp_path / "lab"
    shutil.copytree(ROOT / "notebooks", root)
    _set_parameter(root / NOTEBOOK, "steps", STEPS)
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env["JUPYTER_PATH"] = os.pathsep.join(p for p in [kernelspec_prefix(), env.get("JUPYTER_PATH", "")] if p)
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        env[name] = str(tmp_path / name.lower())
    env["JUPYTERLAB_SETTINGS_DIR"] = str(tmp_path / "settings")
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / "workspaces")
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=",
        "--LabApp.expose_app_in_browser=True",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    pids: set[int] = set()  # the kernel's workers, as the tree showed them: gone after shutdown

    def up() -> bool:
        if server.poll() is not None:
            pytest.fail(f"jupyter lab exited: {(tmp_path / 'jupyterlab.log').read_text()[-3000:]}")
        try:
            _api(base, token, "/api/status")
            return True
        except OSError:
            return False

    try:
        wait_until(up, 60, 0.2, message="jupyter lab answering")
        yield {"base": base, "token": token, "root": root, "log": tmp_path / "jupyterlab.log", "pids": pids}
    finally:
        try:
            for kernel in _api(base, token, "/api/kernels") or []:
                _api(base, token, f"/api/kernels/{kernel['id']}", method="DELETE")
        except OSError:
            pass
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        if request.session.testsfailed > failed_before:
            text = (tmp_path / "jupyterlab.log").read_text(errors="replace")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / f"{request.node.name}.jupyterlab.log").write_text(text)
            print(f"--- the end of jupyter lab's log ({request.node.name}) ---\n{text[-6000:]}")
    pids.discard(0)
    wait_until(lambda: not [q for q in pids if pid_alive(q)], 10.0, message=f"the notebook kernel's workers {sorted(pids)} gone")


@contextlib.contextmanager
def _page(failure_png: str):
    """A Chromium page (1400 x 1000); a full-page screenshot ``failure_png`` if the block fails."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = None
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            yield page
        except Exception:
            if page is not None:
                try:
                    page.screenshot(path=str(ARTIFACTS / failure_png), full_page=True)
                except Exception:
                    pass
            raise
        finally:
            browser.close()


def _save_and_reopen(page) -> None:
    """Save the notebook (Ctrl+S) and load the page again: what opening the saved notebook shows."""
    from playwright.sync_api import expect

    page.keyboard.press("Control+s")
    expect(page.locator(".jp-mod-dirty")).to_have_count(0, timeout=10_000)
    page.reload()


def _open_and_run_all(page, lab, notebook: str, last_cell_text: str):
    """Open ``notebook`` in JupyterLab, wait for its kernel, start "Run All Cells" and return the
    execution indicator and the cell holding ``last_cell_text``."""
    from playwright.sync_api import expect

    page.goto(f"{lab['base']}/lab/tree/{notebook}?token={lab['token']}")
    indicator = page.locator(".jp-Notebook-ExecutionIndicator").first
    expect(indicator).to_have_attribute("data-status", "idle", timeout=60_000)
    expect(page.locator(".jp-Toolbar-kernelName").first).to_contain_text("Monarch", timeout=10_000)
    cell = page.locator(".jp-Notebook .jp-CodeCell", has_text=last_cell_text)
    expect(cell).to_have_count(1, timeout=30_000)  # rendered: the notebook is on screen
    page.wait_for_function(_KERNEL_READY, timeout=60_000)
    # start "Run All Cells" and return: the command's promise resolves only when every cell ran
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    return indicator, cell


def test_kill_from_the_tree_while_a_cell_waits(lab):
    from playwright.sync_api import expect

    pids: set[int] = lab["pids"]
    with _page("02_failure.png") as page:
        indicator, wait_cell = _open_and_run_all(page, lab, NOTEBOOK, "report = run.report()")

        # the cell before the last wait ran (a magic killed rank 1): the kernel now awaits training's end
        expect(page.locator(".jp-OutputArea-output", has_text="injected kill into rank 1")).to_have_count(1, timeout=120_000)
        expect(page.locator(".mnb-chart-loss path").first).to_be_visible(timeout=60_000)
        rank3 = page.locator('.mnb-tree .mnb-proc[data-rank="3"]')
        expect(rank3).to_have_count(1, timeout=30_000)
        for row in page.locator(".mnb-tree .mnb-proc").all():
            pids.add(int(row.get_attribute("data-pid") or 0))
        kill = rank3.locator('button[data-kind="kill"]')
        expect(kill).to_be_enabled(timeout=30_000)
        expect(wait_cell.locator(".jp-InputPrompt")).to_contain_text("*")  # still waiting
        old_pid = rank3.get_attribute("data-pid")
        kill.click()
        # a warm spare takes the rank's place within milliseconds: the failure count shows the kill
        expect(rank3).to_have_attribute("data-failures", "1", timeout=10_000)
        # the click was handled while the cell still waited for training to end
        expect(wait_cell.locator(".jp-InputPrompt")).to_contain_text("*")
        expect(indicator).to_have_attribute("data-status", "busy")
        page.screenshot(path=str(ARTIFACTS / "02_tree_rank3_failed.png"), full_page=True)
        # healthy again in a new proc, restarted: wait for all of it at once, then read it
        healed = page.locator(f'.mnb-tree .mnb-proc[data-rank="3"]:not([data-pid="{old_pid}"]):not([data-restarts="0"])')
        expect(healed).to_have_attribute("data-state", _HEALTHY, timeout=60_000)
        assert rank3.get_attribute("data-pid") != old_pid
        assert int(rank3.get_attribute("data-restarts")) >= 1
        pids.add(int(rank3.get_attribute("data-pid") or 0))
        page.screenshot(path=str(ARTIFACTS / "02_tree_rank3_healthy_again.png"), full_page=True)
        # the dashboard marked the fault and the recovery
        expect(page.locator(".mnb-dash .mnb-tl-fault", has_text="rank 3").first).to_be_visible(timeout=10_000)
        expect(page.locator(".mnb-dash .mnb-tl-recovered", has_text="rank 3").first).to_be_visible(timeout=60_000)
        expect(page.locator(".mnb-dash .mnb-marker-fault").first).to_be_attached()
        page.locator(".mnb-dash").first.screenshot(path=str(ARTIFACTS / "02_dashboard.png"))

        # "stop training" ends the run at a step boundary: the waiting cell goes on, the report
        # shows (every step so far kept), %mesh stop leaves snapshots of the widgets
        stop = page.locator(".mnb-dash .mnb-dash-stop")
        expect(stop).to_be_enabled(timeout=10_000)
        # a person's click lasts ~100 ms, over which the dashboard redraws: press, let it redraw
        # (the step moves), release: the click must hold (a button made anew at each redraw lost it)
        stop.scroll_into_view_if_needed()
        box = stop.bounding_box()
        assert box is not None
        progress = page.locator(".mnb-dash .mnb-progress-text").first
        before = progress.text_content()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        expect(progress).not_to_have_text(before or "", timeout=10_000)
        page.mouse.up()
        expect(page.locator(".jp-OutputArea-output", has_text="training report").first).to_be_visible(timeout=60_000)
        stopped = page.locator(".jp-OutputArea-output:not(:has(.mnb-dash, .mnb-dash-static))", has_text="stopped before the last step")
        expect(stopped).to_have_count(1, timeout=10_000)  # the printed report (the dashboard shows it too)
        expect(page.locator(".mnb-tree-static")).to_have_count(1, timeout=60_000)
        expect(page.locator(".mnb-dash-static")).to_have_count(1, timeout=10_000)
        expect(indicator).to_have_attribute("data-status", "idle", timeout=30_000)
        expect(page.locator(".mnb-tree-static", has_text="rank 3")).to_have_count(1)
        assert not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']", has_text="Error").count()
        page.screenshot(path=str(ARTIFACTS / "02_after_stop.png"), full_page=True)

        # saved, then opened again: the snapshots, not "Error displaying widget: model not found"
        _save_and_reopen(page)
        expect(page.locator(".mnb-tree-static", has_text="rank 3")).to_have_count(1, timeout=60_000)
        expect(page.locator(".mnb-dash-static")).to_have_count(1)
        expect(page.get_by_text("model not found")).to_have_count(0)
        page.screenshot(path=str(ARTIFACTS / "02_reopened.png"), full_page=True)


#: the cluster-size notebook: the tree widget over a synthetic 8 hosts x 8 GPUs controller (real
#: records and snapshot; no processes), a cell that waits (the kernel busy, the widget answering)
#: until rank 27 was killed and restarted from the browser, then one that freezes the widget
GRID_NOTEBOOK = "tree_at_cluster_size.ipynb"
_GRID_CELLS = [
    f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.synthetic_cluster import SyntheticController\n"
    "from monarch_nb.jupyter import SupervisionTree, wait\n"
    "controller = SyntheticController(hosts=8, per_host=8)\ntree = SupervisionTree(controller=controller)\ntree",
    "assert await wait(until=lambda: controller.record(27).restarts >= 1 and tree.proc_states()[27] == 'healthy', timeout_s=240)\n"
    "print('rank 27 came back')",
    "from monarch_nb.jupyter.fallback import freeze_all\nprint('froze', freeze_all(), 'widget(s)')",
]


def _cell_of(page, rank: int):
    return page.locator(f'.mnb-tree .mnb-cell[data-rank="{rank}"]')


def test_the_tree_at_cluster_size(lab):
    """64 ranks on 8 hosts: a grid of cells per host, a failed rank and a lost host shown as
    such, a click on a cell shows that rank's details and buttons, a kill and a restart from
    them, the list toggle, and the static grid left in the saved notebook."""
    from playwright.sync_api import expect

    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
                    for src in _GRID_CELLS],
          "metadata": {"kernelspec": {"name": "monarch", "display_name": "Monarch (Python 3)", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (lab["root"] / GRID_NOTEBOOK).write_text(json.dumps(nb))
    with _page("tree_grid_failure.png") as page:
        indicator, _ = _open_and_run_all(page, lab, GRID_NOTEBOOK, "freeze_all")
        tree = page.locator(".mnb-tree").first
        expect(tree).to_have_attribute("data-layout", "grid", timeout=60_000)
        expect(page.locator(".mnb-tree .mnb-hostrow")).to_have_count(8)
        expect(page.locator(".mnb-tree .mnb-cell")).to_have_count(64)
        expect(page.locator('.mnb-tree .mnb-hostrow[data-name="host3"] .mnb-cell')).to_have_count(8)
        expect(_cell_of(page, 19)).to_have_attribute("data-state", "failed")
        expect(_cell_of(page, 58)).to_have_attribute("data-state", "hung")
        lost = page.locator('.mnb-tree .mnb-hostrow[data-name="host6"]')
        expect(lost).to_have_attribute("data-lost", "true")
        expect(lost.locator(".mnb-badge")).to_have_text("LOST")
        expect(lost.locator('.mnb-cell[data-state="failed"]')).to_have_count(8)
        expect(page.locator('.mnb-tree .mnb-hostrow[data-lost="true"]')).to_have_count(1)
        expect(page.locator('.mnb-tree .mnb-hostrow[data-name="host2"]')).to_contain_text("load 0.36")
        expect(page.locator(".mnb-tree .mnb-legend")).to_contain_text("failed 9")
        tree.screenshot(path=str(ARTIFACTS / "tree_grid_64.png"))

        # a click on a cell: that rank's details, with its buttons (a dead rank's fault buttons off)
        _cell_of(page, 19).click()
        details = page.locator(".mnb-tree .mnb-details")
        expect(details.locator(".mnb-title").first).to_contain_text("rank 19 of pm0", timeout=10_000)
        expect(details).to_contain_text("host3 (gpu-node-03)")
        expect(details).to_contain_text("SIGKILL")
        expect(details.locator('button[data-kind="kill"]')).to_be_disabled()
        expect(_cell_of(page, 19)).to_have_class(re.compile("mnb-cell-selected"))
        # the host's row: its details
        lost.locator(".mnb-hostlabel").click()
        expect(details.locator(".mnb-title").first).to_have_text("host host6 (gpu-node-06) · LOST", timeout=10_000)
        expect(details).to_contain_text("host_lost")

        # the list toggle, and back (the last step, a restart of rank 27, lets the notebook end)
        page.locator('.mnb-tree button.mnb-view[data-view="list"]').click()
        expect(tree).to_have_attribute("data-layout", "list", timeout=10_000)
        expect(page.locator(".mnb-tree .mnb-proc")).to_have_count(64)
        page.locator('.mnb-tree button.mnb-view[data-view="grid"]').click()
        expect(page.locator(".mnb-tree .mnb-cell")).to_have_count(64, timeout=10_000)

        _cell_of(page, 27).click()
        expect(details.locator(".mnb-title").first).to_contain_text("rank 27 of pm0", timeout=10_000)
        kill = details.locator('button[data-kind="kill"]')
        expect(kill).to_be_enabled()
        # the kernel is busy in the cell that waits; the widget still answers
        expect(indicator).to_have_attribute("data-status", "busy")
        kill.click()
        expect(_cell_of(page, 27)).to_have_attribute("data-state", "failed", timeout=10_000)
        expect(page.locator(".mnb-tree .mnb-status")).to_contain_text("injected kill into rank 27")
        tree.screenshot(path=str(ARTIFACTS / "tree_grid_64_rank27_failed.png"))
        restart = details.locator('button[data-kind="restart"]')
        expect(restart).to_be_enabled(timeout=10_000)
        restart.click()  # the waiting cell ends once the widget shows rank 27 healthy; the next freezes it
        expect(page.locator(".jp-OutputArea-output", has_text="rank 27 came back")).to_have_count(1, timeout=30_000)

        # the last cell froze the widget: the static grid, also after saving and opening again
        static = page.locator(".mnb-tree-static")
        expect(static).to_have_count(1, timeout=60_000)
        expect(static.locator('.mnb-cell[data-rank="27"]')).to_have_attribute("data-state", "healthy")
        expect(indicator).to_have_attribute("data-status", "idle", timeout=30_000)
        _save_and_reopen(page)
        expect(page.locator(".mnb-tree-static .mnb-cell")).to_have_count(64, timeout=60_000)
        expect(page.locator('.mnb-tree-static [data-name="host6"][data-lost="true"]')).to_have_count(1)
        expect(page.get_by_text("model not found")).to_have_count(0)
        page.locator(".mnb-tree-static").first.screenshot(path=str(ARTIFACTS / "tree_grid_64_static.png"))


_HEALTHY = re.compile(r"^(healthy|busy)$")
#: the notebook's kernel is connected and idle (JupyterLab's session API; "Run All" before it is lost)
_KERNEL_READY = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
  return !!kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
}"""


def _set_parameter(path: pathlib.Path, name: str, value: object) -> None:
    """Set ``name = value`` in the notebook's cell tagged ``parameters`` (its copy under test)."""
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    lines = "".join(cell["source"]).splitlines()
    cell["source"] = "\n".join(f"{name} = {value!r}" if line.startswith(f"{name} =") else line for line in lines)
    path.write_text(json.dumps(nb, indent=1))
