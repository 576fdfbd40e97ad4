"""Every notebook in notebooks/ runs top to bottom through nbclient, with a real kernel and mesh,
in the kernel its metadata names (the "Monarch (Python 3)" kernel). Each notebook loads the
extension in its first code cell, so it runs in the stock "python3" ipykernel kernel of the venv
too (what VS Code, an existing JupyterLab or a hosted service picks): the quickstart runs there
as well (the other notebooks would only repeat what the first cell check below asserts).

Cells tagged ``parameters`` may be followed by overrides (as papermill injects them), so the
tests train for fewer steps than a person would. Executed notebooks are saved under
test-artifacts/notebooks/ for inspection.
"""

from __future__ import annotations

import json
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from .conftest import pid_alive, wait_until
from .jupyter_kernel import kernelspec_prefix

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "notebooks"
#: parameter overrides per notebook (injected after its "parameters" cell)
OVERRIDES = {"02_fault_tolerant_training.ipynb": {"steps": 300}}

_PIDS_CELL = (
    "from monarch_nb.runtime.controller import Controller as _C\n"
    "_c = _C.existing()\n"
    "print('PIDS', _c.pids() if _c else [])"
)


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_fault_tolerant_training.ipynb", "04_workshop.ipynb"} <= names


def test_the_first_code_cell_loads_the_extension():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        first = next(c for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", []))
        assert first.source.strip() == "%load_ext monarch_nb", f"{path.name}: first code cell is {first.source[:40]!r}"


#: (notebook, kernel): each in its own kernel; the quickstart in the stock python3 kernel too
RUNS = [(p, "monarch") for p in NOTEBOOKS] + [(p, "python3") for p in NOTEBOOKS if p.name == "01_quickstart.ipynb"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("path", "kernel"), RUNS, ids=[f"{p.stem}-{k}" for p, k in RUNS])
def test_notebook_runs_top_to_bottom(path, kernel):
    kernelspec_prefix()
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name") == "monarch", f"{path.name}: metadata.kernelspec is not monarch"
    overrides = OVERRIDES.get(path.name, {})
    if overrides:
        index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        source = "\n".join(f"{k} = {v!r}" for k, v in overrides.items())
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
        nb.cells.insert(index + 1, cell)
    nb.cells.append(nbformat.v4.new_code_cell(_PIDS_CELL))
    client = NotebookClient(nb, kernel_name=kernel, timeout=240, resources={"metadata": {"path": str(ROOT / "notebooks")}})
    try:
        client.execute()
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / f"{path.stem}.{kernel}.ipynb")
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    pids = json.loads(text.split("PIDS", 1)[1].strip()) if "PIDS" in text else []
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 10.0, message=f"{path.name}'s workers {pids} gone")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"
              and "raises-exception" not in c.metadata.get("tags", [])]
    assert not errors
    if any(c.source.strip() == "%mesh stop" for c in nb.cells):
        _assert_widgets_left_snapshots(nb)


def _assert_widgets_left_snapshots(nb) -> None:
    """After ``%mesh stop``, the saved notebook holds the widgets' last state as HTML (nbclient
    applies update_display_data as a frontend does), never a widget view without its model."""
    shown = {"%mesh tree": "mnb-tree-static", "%mesh train": "mnb-dash-static"}
    for cell in nb.cells:
        for magic, css in shown.items():
            if cell.cell_type == "code" and magic in cell.source:
                datas = [o.get("data", {}) for o in cell.outputs if o.get("output_type") == "display_data"]
                ours = [d for d in datas if css in d.get("text/html", "")]
                assert ours, f"{magic}: no snapshot in {[list(d) for d in datas]}"
                assert all("application/vnd.jupyter.widget-view+json" not in d for d in ours), magic
