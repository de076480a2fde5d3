"""notebooks/quickstart.ipynb runs top to bottom (nbclient, on the CPU) in a kernel of this interpreter, with
this checkout's lcjax, and is stored without outputs."""
from __future__ import annotations

import json
import os
import sys

import pytest

INSTALL = "pip install -e '.[test]'"
nbformat = pytest.importorskip("nbformat", reason=f"the notebook is read by nbformat: {INSTALL}")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")


def test_notebook_is_stored_without_outputs():
  with open(NOTEBOOK) as f:
    raw = json.load(f)
  nb = nbformat.reads(json.dumps(raw), as_version=4)
  nbformat.validate(nb)
  code = [c for c in raw["cells"] if c["cell_type"] == "code"]
  assert code
  for c in code:
    assert c["outputs"] == [] and c["execution_count"] is None, "".join(c["source"])[:80]
  assert raw["metadata"]["kernelspec"]["name"] == "python3"


def _kernel_spec(path) -> None:
  """A `python3` kernel spec that runs this interpreter (found first: JUPYTER_PATH precedes every other place)."""
  os.makedirs(path / "kernels" / "python3")
  (path / "kernels" / "python3" / "kernel.json").write_text(json.dumps(dict(
      argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      display_name="Python 3 (lcjax tests)", language="python")))


def test_quickstart_notebook_runs(tmp_path, monkeypatch, smollm2_checkpoint):
  # The kernel inherits the run's LCJAX_CACHE_DIR: the notebook's bundled_checkpoint() finds the run's conversion
  # of the bundled model there (tests/conftest.py) instead of converting it again.
  nbclient = pytest.importorskip("nbclient", reason=f"the notebook runs in nbclient: {INSTALL}")
  pytest.importorskip("ipykernel", reason=f"the notebook's kernel is ipykernel: {INSTALL}")
  assert os.path.dirname(smollm2_checkpoint) == os.environ["LCJAX_CACHE_DIR"]
  _kernel_spec(tmp_path / "jupyter")
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  # The kernel imports this checkout's lcjax on one CPU device, as the other tools' tests run.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  n_cells = len(nb.cells)
  nb.cells.append(nbformat.v4.new_code_cell("import sys, lcjax; print(sys.executable); print(lcjax.__file__)"))
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=170,
                                   resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  client.execute()     # raises CellExecutionError naming the cell on any error
  outputs = [c.get("outputs", []) for c in nb.cells]
  text = lambda i: "".join(o.get("text", "") for o in outputs[i] if o["output_type"] == "stream")
  exe, lcjax_file = text(n_cells).split()
  assert os.path.realpath(exe) == os.path.realpath(sys.executable)
  assert os.path.realpath(lcjax_file) == os.path.realpath(os.path.join(REPO, "lcjax", "__init__.py"))
  everything = "\n".join(text(i) for i in range(n_cells))
  assert "Paris" in everything and "memory plan per device" in everything
  assert "PELICAN-42" in everything      # the first question about the context
  images = sum(1 for outs in outputs for o in outs if "image/png" in o.get("data", {}))
  assert images == 2       # the CPU runs' figure and the H200 results' figure
