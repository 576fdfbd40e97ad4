"""The peers' virtual environment for benchmarks: torchmonarch, ipyparallel and torchft beside torch==2.13.0.

Peers live in their own venv (``bench/.peers-venv``), created on request (``--with-peers``), so
the project's install stays lean. :func:`run_peer` runs a measurement script there and returns
its JSON; any failure (no venv, a peer that will not install or start) returns None, which the
benchmarks print as "not measured". :func:`run_json_script` is how every benchmark runs such a
script, with any python (a peer's, this one on another checkout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

__all__ = ["PEERS_VENV", "ensure_peers_venv", "peer_python", "run_peer", "run_json_script"]

PEERS_VENV = Path(__file__).resolve().parent / ".peers-venv"
PEER_PACKAGES = ["torch==2.13.0", "numpy", "torchmonarch", "ipyparallel", "torchft"]


def peer_python() -> Path | None:
    python = PEERS_VENV / "bin" / "python"
    return python if python.exists() else None


def ensure_peers_venv() -> Path | None:
    """Create the peers' venv if missing; return its python, or None if it cannot be made."""
    python = peer_python()
    if python is not None and (PEERS_VENV / ".installed").exists():
        return python
    try:
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        pip = [str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run(pip + ["torch==2.13.0", "numpy"], check=True)  # pinned: the local CPU wheel
        for package in PEER_PACKAGES[2:]:
            result = subprocess.run(pip + [package], capture_output=True, text=True)
            if result.returncode != 0:
                print(f"peers: could not install {package}: {result.stderr.strip()[-300:]}", file=sys.stderr)
        (PEERS_VENV / ".installed").touch()
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"peers: no peers venv: {exc}", file=sys.stderr)
        return None
    return peer_python()


def run_peer(source: str, timeout_s: float = 600) -> dict | None:
    """Run ``source`` with the peers' python; it must print one JSON object on its last line."""
    python = peer_python()
    if python is None:
        return None
    return run_json_script(str(python), source, label="peer", timeout_s=timeout_s)


def run_json_script(python: str, source: str, args: tuple[str, ...] = (), *, env_extra: dict | None = None,
                    label: str = "script", timeout_s: float = 900) -> dict | None:
    """Run ``python -c source ARGS`` and return the JSON object its last ``{`` line prints, or None
    if it failed or ran past ``timeout_s`` seconds (said on stderr, with the end of its stderr).

    The script runs without the caller's PYTHONPATH (``env_extra`` may set one: another checkout)
    and in a folder of its own: ``-c`` puts the current folder first on ``sys.path``, and a
    checkout there would be imported instead.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    try:
        with tempfile.TemporaryDirectory(prefix="mnb-bench-") as cwd:
            result = subprocess.run([python, "-c", textwrap.dedent(source), *args], capture_output=True, text=True,
                                    env=env, cwd=cwd, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"{label}: timed out after {timeout_s} s", file=sys.stderr)
        return None
    lines = [ln for ln in result.stdout.splitlines() if ln.strip().startswith("{")]
    if result.returncode != 0 or not lines:
        print(f"{label} failed (exit {result.returncode}): {result.stderr.strip()[-1500:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])
