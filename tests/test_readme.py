"""README's actor-API example runs as written, so the documentation cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snippet(heading: str) -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split(f"## {heading}", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_actor_api_example_runs(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(_snippet("The actor API"))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # broadcast() adds 1, call(by=2) adds 2 on each of the 4 ranks; then rank 0 alone adds 1
    assert lines[0] == "ValueMesh({'gpus': 4}, {(gpus=0): 3, (gpus=1): 3, (gpus=2): 3, (gpus=3): 3})"
    assert lines[1] == "4"
