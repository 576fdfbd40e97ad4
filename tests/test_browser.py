"""End to end in a real browser: JupyterLab in Debian's Chromium, driven by Playwright.

Opens notebook 02, runs it through the supervision tree, clicks "kill" on rank 3 in the tree,
sees the rank fail and come back healthy (the training run restarts and heals it), then runs the
rest of the notebook to its report. Screenshots go to test-artifacts/browser/.

Chromium is the apt package (``.ci/run`` installs it when missing); Playwright gets its path
through ``executable_path`` and never downloads a browser. Without Chromium the test is skipped,
except in CI, where it fails.
"""

from __future__ import annotations

import json
import os
import pathlib
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
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with a token, serving a copy of notebooks/ (the
    "Monarch (Python 3)" kernelspec installed where it looks)."""
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI (.ci/run installs the apt package `chromium`)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    root = tmp_path / "lab"
    shutil.copytree(ROOT / "notebooks", root)
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
    pids.discard(0)
    wait_until(lambda: not [q for q in pids if pid_alive(q)], 10.0, message=f"the notebook kernel's workers {sorted(pids)} gone")


def test_kill_from_the_tree_in_jupyterlab(lab):
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pids: set[int] = lab["pids"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab['base']}/lab/tree/{NOTEBOOK}?token={lab['token']}")
            indicator = page.locator(".jp-Notebook-ExecutionIndicator")
            expect(indicator.first).to_have_attribute("data-status", "idle", timeout=60_000)
            expect(page.locator(".jp-Toolbar-kernelName").first).to_contain_text("Monarch", timeout=10_000)
            cells = page.locator(".jp-Notebook .jp-Cell")
            tree_cell = _index_of(page, "%mesh tree")
            cells.nth(0).locator(".jp-InputPrompt").first.click()
            page.keyboard.press("Escape")
            for _ in range(tree_cell + 1):  # run the cells up to the tree (markdown renders)
                page.keyboard.press("Shift+Enter")
            rank3 = page.locator('.mnb-tree .mnb-proc[data-rank="3"]')
            # training is under way once the dashboard shows a loss curve
            expect(page.locator(".mnb-chart-loss path").first).to_be_visible(timeout=120_000)
            expect(rank3).to_have_count(1, timeout=30_000)
            for row in page.locator(".mnb-tree .mnb-proc").all():
                pids.add(int(row.get_attribute("data-pid") or 0))
            kill = rank3.locator('button[data-kind="kill"]')
            expect(kill).to_be_enabled(timeout=30_000)
            old_pid = rank3.get_attribute("data-pid")
            kill.click()
            # a warm spare takes the rank's place within milliseconds: the failure count shows the kill
            expect(rank3).to_have_attribute("data-failures", "1", timeout=10_000)
            page.screenshot(path=str(ARTIFACTS / "02_tree_rank3_failed.png"), full_page=True)
            expect(rank3).to_have_attribute("data-state", _HEALTHY, timeout=60_000)
            assert rank3.get_attribute("data-pid") != old_pid
            assert int(rank3.get_attribute("data-restarts")) >= 1
            pids.add(int(rank3.get_attribute("data-pid") or 0))
            page.screenshot(path=str(ARTIFACTS / "02_tree_rank3_healthy_again.png"), full_page=True)
            # the dashboard marked the fault and the recovery
            expect(page.locator(".mnb-dash .mnb-tl-fault", has_text="rank 3").first).to_be_visible(timeout=10_000)
            expect(page.locator(".mnb-dash .mnb-tl-recovered", has_text="rank 3").first).to_be_visible(timeout=60_000)
            expect(page.locator(".mnb-dash .mnb-marker-fault").first).to_be_attached()
            page.locator(".mnb-dash").first.screenshot(path=str(ARTIFACTS / "02_dashboard.png"))
            # run the rest: a fault from a magic, then the report
            page.keyboard.press("Escape")
            cells.nth(tree_cell + 1).locator(".jp-InputPrompt, .jp-Cell-inputCollapser").first.click()
            for _ in range(cells.count() - tree_cell - 1):
                page.keyboard.press("Shift+Enter")
            expect(page.locator(".jp-OutputArea-output", has_text="training report").first).to_be_visible(timeout=150_000)
            expect(indicator.first).to_have_attribute("data-status", "idle", timeout=30_000)
            assert not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']", has_text="Error").count()
            page.screenshot(path=str(ARTIFACTS / "02_after_report.png"), full_page=True)
        except Exception:
            try:
                page.screenshot(path=str(ARTIFACTS / "02_failure.png"), full_page=True)
            except Exception:
                pass
            raise
        finally:
            browser.close()


_HEALTHY = __import__("re").compile(r"^(healthy|busy)$")


def _index_of(page, text: str) -> int:
    """The index of the first cell whose source contains ``text``."""
    sources = page.locator(".jp-Notebook .jp-Cell").evaluate_all("cells => cells.map(c => c.innerText)")
    for i, src in enumerate(sources):
        if text in src:
            return i
    raise AssertionError(f"no cell contains {text!r}")
