"""The notebooks run top to bottom on the committed results (no GPU needed)."""
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(path.parent)
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors


def test_there_are_notebooks():
    assert {"normal_mode.ipynb", "low_latency.ipynb", "01_semantics.ipynb"} <= {p.name for p in NOTEBOOKS}


def test_committed_notebooks_are_small():
    """Notebooks are committed with small outputs (figures are redrawn when they run): at most 200 KB each."""
    big = {p.name: p.stat().st_size for p in NOTEBOOKS if p.stat().st_size > 200_000}
    assert not big, big
