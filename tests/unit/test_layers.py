"""The house is one-way: no module imports up the layer order or across into a feature.

Every import of every module of ``monarch_nb`` is read with ``ast`` — at the top, inside
functions and under ``TYPE_CHECKING`` alike — and checked against :data:`ALLOWED`. The layers,
bottom up (docs/architecture.md draws them):

- base: ``transport``, ``config``, ``errors``, ``device``, ``_lazy``, ``argtypes``
- ``supervision``: records, events, policies, the tree (data)
- ``actor``: the public actor API, over the ``actor.backend`` Protocol
- ``runtime``: implements the backend (controller, host agent, proc core)
- features: ``faults``, ``debug`` and ``job``, then ``train`` and ``spmd``, then ``jupyter``

The package's ``__init__``, ``proc_main`` and ``cli`` are composition roots and entry points:
they may import anything.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "monarch_nb"

BASE = {"transport", "config", "errors", "device", "_lazy", "argtypes"}
CORE = BASE | {"supervision", "actor"}
ALLOWED: dict[str, set[str]] = {
    "transport": set(),
    "config": set(),
    "errors": set(),
    "device": set(),
    "_lazy": set(),
    "argtypes": set(),
    "supervision": {"transport", "config", "errors"},
    "actor": {"supervision", "transport", "config", "errors", "_lazy"},
    "runtime": CORE - {"_lazy", "argtypes"},
    "faults": CORE | {"runtime"},
    "debug": CORE | {"runtime"},
    "job": CORE | {"runtime"},
    "train": CORE | {"runtime", "faults", "job"},
    "spmd": CORE | {"runtime", "job"},
    "jupyter": CORE | {"runtime", "faults", "debug", "train", "job", "spmd"},
    "ft": {"train"},  # the public face of train.ft
}
ROOTS = {"__init__", "proc_main", "cli", "__main__"}


def _room(module: str) -> str:
    """``monarch_nb.actor.mesh`` -> ``actor``; ``monarch_nb.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path`` that names monarch_nb."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None:  # from .. import device: each name may be a module
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    as_path = PACKAGE.parent / sub.replace(".", os.sep)
                    found.append((node.lineno, sub if as_path.with_suffix(".py").exists() or as_path.is_dir() else target))
            else:
                found.append((node.lineno, target))
    return [(line, name) for line, name in found if name == "monarch_nb" or name.startswith("monarch_nb.")]


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        room = _room(module)
        if room in ROOTS:
            continue
        allowed = ALLOWED.get(room)
        if allowed is None:
            bad.append(f"{path.relative_to(PACKAGE.parent)}: package {room!r} has no place in the layer table")
            continue
        for line, target in _imports(path):
            other = _room(target)
            if other == room:
                continue
            if other not in allowed:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {room} imports {target} ({other!r} is not below {room!r})")
    return bad


def test_every_import_runs_down_the_layers():
    assert _violations() == []


@pytest.mark.parametrize("room, target", [("actor", "runtime"), ("runtime", "debug"), ("supervision", "actor"), ("faults", "train")])
def test_the_table_forbids_the_cycles_it_exists_to_prevent(room, target):
    assert target not in ALLOWED[room]
