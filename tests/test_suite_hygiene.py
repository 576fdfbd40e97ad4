"""The suite's own leak check judges what the suite made, and only that: a run folder another
program left behind (a user's script SIGKILLed earlier) does not turn a developer's suite red,
and a folder a test leaves behind still does. Runs pytest on a small copy of the suite's
conftest, in a process of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dead_pid() -> int:
    """A pid that ran and ended (no process has it now)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _pytest(folder, test_body: str) -> subprocess.CompletedProcess:
    suite = folder / "suite"
    suite.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), suite / "conftest.py")
    (suite / "test_it.py").write_text(test_body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)], cwd=folder,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))


def test_a_stale_folder_of_another_program_is_not_the_suites_leak(tmp_path):
    stale = os.path.join(tempfile.gettempdir(), f"monarch_nb-{_dead_pid()}-left-by-someone")
    os.makedirs(stale)
    try:
        result = _pytest(tmp_path, "def test_nothing():\n    pass\n")
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def test_a_folder_a_test_leaves_behind_is_still_found(tmp_path):
    result = _pytest(tmp_path, (
        "import os, tempfile\n"
        "def test_leaves_a_run_folder():\n"
        "    os.makedirs(os.path.join(tempfile.gettempdir(), f'monarch_nb-{os.getpid()}-leaked'))\n"
    ))
    try:
        assert result.returncode != 0 and "no run folder or /dev/shm file left" in result.stdout, result.stdout
    finally:
        for name in os.listdir(tempfile.gettempdir()):
            if name.startswith("monarch_nb-") and name.endswith("-leaked"):
                shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)
