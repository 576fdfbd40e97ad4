"""README's examples run as written, so the documentation cannot rot: the actor API's, and every
block of the "Monarch's names" section (each name there points at one of them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section(heading: str) -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    return readme.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _snippet(heading: str) -> str:
    return re.search(r"```python\n(.*?)```", _section(heading), re.S).group(1)


def _run(tmp_path, source: str, timeout_s: float) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_example.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )


def test_actor_api_example_runs(tmp_path):
    result = _run(tmp_path, _snippet("The actor API"), 120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # broadcast() adds 1, call(by=2) adds 2 on each of the 4 ranks; then rank 0 alone adds 1
    assert lines[0] == "ValueMesh({'gpus': 4}, {(gpus=0): 3, (gpus=1): 3, (gpus=2): 3, (gpus=3): 3})"
    assert lines[1] == "4"


def test_every_monarch_name_example_runs(tmp_path):
    section = _section("Monarch's names")
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 5
    listed = set(re.findall(r"`(\w+)`", section.split("\n1. ", 1)[0]))
    import monarch_nb.actor

    assert set(monarch_nb.actor.__all__) - {"Instance", "RankedPortReceiver"} <= listed  # every exported name is documented
    for number, block in enumerate(blocks, 1):
        result = _run(tmp_path, block, 180)
        assert result.returncode == 0, f"example {number} failed:\n{result.stderr[-3000:]}"


def test_own_loop_example_runs(tmp_path):
    """The ``ft`` example, as written (the function defined in the script's __main__ goes to the
    procs by value): 300 steps through a kill, nothing lost, replicas identical."""
    source = _snippet("Your own training loop, fault tolerant: `monarch_nb.ft`")
    source += "\nprint('RESULT', report.steps, report.samples_lost, report.samples_repeated, report.replicas_identical)\n"
    result = _run(tmp_path, source, 240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT 300 0 0 True" in result.stdout, result.stdout[-2000:]
