"""Every notebook in notebooks/ runs top to bottom on the CPU, in a python3 kernel."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=120,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.monotonic()
    client.execute()  # raises CellExecutionError naming the cell that failed
    elapsed = time.monotonic() - start
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    if path.stem == "slot_decisions":
        images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
        assert len(images) >= 3, "expected the occupancy, hit-rate and wait plots"
        assert elapsed < 90, f"the notebook took {elapsed:.0f} s"


def test_slot_decisions_notebook_is_present():
    assert "slot_decisions" in [p.stem for p in NOTEBOOKS]
