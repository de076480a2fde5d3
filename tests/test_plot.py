"""lcjax.plot against the committed results it draws: every plotted point is the JSON's value, read back from the
figure's lines; bad input is one line naming the missing field, and writes nothing; without matplotlib the import
says how to install it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

matplotlib = pytest.importorskip("matplotlib", reason="lcjax.plot draws with matplotlib: pip install -e '.[plot]'")
matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from lcjax import plot  # noqa: E402
from lcjax.engine.engine import GenerationResult  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
LONGCTX = os.path.join(RESULTS, "longctx.json")        # a topic file with combined rows


def _part(topic: str, name: str) -> dict:
  """One part of a committed topic file (benchmarks/merge_results.py): a result dict with its own rows."""
  (part,) = [p for p in json.load(open(os.path.join(RESULTS, f"{topic}.json")))["parts"] if p["name"] == name]
  return part


def _lines(fig) -> dict:
  """{label: [(x, y), ...]} of the figure's one axes, legend labels and the hidden OOM lines alike."""
  (ax,) = fig.axes
  return {ln.get_label(): list(zip(ln.get_xdata(), ln.get_ydata())) for ln in ax.get_lines()}


def _expected(rows, key):
  """{impl: points} straight from the JSON: rows that ran, at their value (a predicted row without a peak at its
  planned memory)."""
  out = {}
  for r in sorted(rows, key=lambda r: r["S"]):
    v = r.get(key)
    if v is None and key == "peak_gib" and r.get("predicted"):
      v = r["planned_gib"]
    if not r.get("oom") and v is not None:
      out.setdefault(r["impl"], []).append((r["S"], v))
  return out


def _new_ax():
  return Figure().add_subplot()


@pytest.mark.parametrize("kind,key", [("memory", "peak_gib"), ("prefill", "prefill_s"),
                                      ("decode", "decode_ms_per_token")])
def test_figures_plot_the_committed_h200_rows(kind, key):
  res = json.load(open(LONGCTX))
  fig = getattr(plot, f"{kind}_figure")(LONGCTX, ax=_new_ax())
  lines = _lines(fig)
  want = _expected(res["rows"], key)
  assert {"lcjax", "hf", "dense", "lcjax-fp8kv (8 of 32 layers)", "lcjax-fp8 (fp8 KV, float8_e4m3fn attention)"} \
    <= set(want)
  for impl, pts in want.items():
    assert lines[impl] == pts, impl
  # dense ran out of memory from 32K: a vertical line there, no point.
  assert lines["_oom dense"] == [(32768, 0), (32768, 1)]
  assert all(s != 32768 for s, _ in lines["dense"])
  ax = fig.axes[0]
  assert ax.get_xscale() == "log" and ax.get_title() == "llama3-8b, NVIDIA H200"
  # Times spanning more than 20x (the committed prefill: 0.21 s to 396 s) get a log scale; memory stays linear.
  values = [v for pts in want.values() for _, v in pts]
  assert ax.get_yscale() == ("log" if kind != "memory" and max(values) / min(values) > 20 else "linear")
  if kind == "prefill":
    assert ax.get_yscale() == "log"
  if kind == "memory":
    assert lines["lcjax planned"] == [(r["S"], r["planned_gib"]) for r in res["rows"] if r["impl"] == "lcjax"]
    (dev,) = [v for k, v in lines.items() if k.startswith("device memory")]
    assert dev[0][1] == pytest.approx(143771 / 1024)
    assert "device memory 140 GiB" in lines
  else:
    assert not any(k.startswith(("device memory", "lcjax planned")) for k in lines)
  legend = [t.get_text() for t in ax.get_legend().get_texts()]
  assert not any(t.startswith("_") for t in legend) and "lcjax" in legend


def test_rows_of_several_meshes_are_separate_lines():
  res = _part("multigpu", "8xh200-predicted")
  for kind, key in (("prefill", "prefill_s"), ("memory", "peak_gib")):
    lines = _lines(getattr(plot, f"{kind}_figure")(res, ax=_new_ax()))
    # A predicted row without a measured peak is drawn at its planned memory.
    value = lambda r: r[key] if r.get(key) is not None or not r.get("predicted") else r["planned_gib"]
    mesh = lambda t, s: sorted((r["S"], value(r)) for r in res["rows"] if (r["tensor"], r["seq"]) == (t, s))
    for t, s in ((2, 4), (4, 2), (8, 1)):
      assert lines[f"lcjax (tensor={t}, seq={s})"] == mesh(t, s)
    assert lines["lcjax"] == mesh(1, 1)
  assert any(r.get("predicted") and r.get("peak_gib") is None for r in res["rows"])


def _result(prompt_tokens, prefill_s, decode_ms, peak):
  stats = dict(prompt_tokens=prompt_tokens, prefill_s=prefill_s, decode_ms_per_token=decode_ms,
               peak_device_bytes=peak, cached_tokens=0)
  return GenerationResult("x", [1], prompt_tokens, "length", stats)


def test_figures_from_generation_results():
  gib = 1024 ** 3
  results = [_result(4096, 2.0, 11.0, 3 * gib), _result(1024, 0.5, 10.0, 2 * gib),
             _result(2048, 1.0, float("nan"), int(2.5 * gib))]
  fig = plot.prefill_figure(results, ax=_new_ax(), label="mine")
  assert _lines(fig)["mine"] == [(1024, 0.5), (2048, 1.0), (4096, 2.0)]
  assert fig.axes[0].get_yscale() == "linear"      # within a decade
  assert _lines(plot.memory_figure(results, ax=_new_ax()))["lcjax"] == [(1024, 2.0), (2048, 2.5), (4096, 3.0)]
  # A result with one new token has no decode time (NaN): no point for it.
  assert _lines(plot.decode_figure(results, ax=_new_ax()))["lcjax"] == [(1024, 10.0), (4096, 11.0)]
  # The stats dicts alone work too.
  assert _lines(plot.prefill_figure([{"stats": r.stats} for r in results], ax=_new_ax()))["lcjax"][0] == (1024, 0.5)
  # A CPU run keeps no device memory counter: the memory figure says so.
  cpu = [_result(1024, 0.5, 10.0, None)]
  with pytest.raises(ValueError, match=r"no row has 'peak_gib' or 'planned_gib'.*CPU"):
    plot.memory_figure(cpu, ax=_new_ax())


def test_overview_and_pyplot_figures():
  import matplotlib.pyplot as plt
  fig = plot.overview(LONGCTX)
  assert [ax.get_ylabel() for ax in fig.axes] == ["peak device memory (GiB)", "prefill time (s)",
                                                  "decode time (ms/token)"]
  plt.close(fig)
  fig = plot.memory_figure(LONGCTX)
  assert isinstance(fig, matplotlib.figure.Figure) and len(fig.axes) == 1
  plt.close(fig)
  # Panels for what the rows have: no decode times here, no device memory on a CPU.
  fig = plot.overview([dict(impl="a", S=1024, prefill_s=1.0, peak_gib=2.0)])
  assert [ax.get_ylabel() for ax in fig.axes] == ["peak device memory (GiB)", "prefill time (s)"]
  plt.close(fig)
  fig = plot.overview([_result(1024, 0.5, 10.0, None)])
  assert [ax.get_ylabel() for ax in fig.axes] == ["prefill time (s)", "decode time (ms/token)"]
  plt.close(fig)
  with pytest.raises(ValueError, match="nothing to draw"):
    plot.overview([dict(impl="a", S=1024)])


def test_save_figures_writes_pngs(tmp_path):
  paths = plot.save_figures(LONGCTX, str(tmp_path / "new" / "lc"), kinds=("memory", "prefill", "decode"))
  assert [os.path.basename(p) for p in paths] == ["lc-memory.png", "lc-prefill.png", "lc-decode.png"]
  assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in paths)


def _one_line_error(source, match, kind="memory", tmp_path=None):
  with pytest.raises(ValueError, match=match) as e:
    if tmp_path is None:
      getattr(plot, f"{kind}_figure")(source, ax=_new_ax())
    else:
      plot.save_figures(source, str(tmp_path / "bad"))
  msg = str(e.value)
  assert "\n" not in msg and len(msg) < 400, msg
  return msg


def test_bad_input_is_one_line_naming_what_is_missing(tmp_path):
  no_rows = tmp_path / "no_rows.json"
  no_rows.write_text(json.dumps(dict(device="GPU", results=[])))
  msg = _one_line_error(str(no_rows), "has no 'rows' list")
  assert str(no_rows) in msg and "'results'" in msg
  no_s = tmp_path / "no_s.json"
  no_s.write_text(json.dumps(dict(rows=[dict(impl="lcjax", S=8, prefill_s=1.0), dict(impl="lcjax", ctx=16)])))
  assert "row 1 has no 'S'" in _one_line_error(str(no_s), "no 'S'", "prefill")
  _one_line_error([dict(S=8, prefill_s=1.0)], "row 0 has no 'impl'", "prefill")
  _one_line_error([dict(impl="a", S="8K", prefill_s=1.0)], r"row 0: 'S' \(the context length\) is '8K'", "prefill")
  # A committed file of another benchmark (kernel timings: no prefill seconds, no peak memory).
  attention = _part("attention", "attention-h200")
  _one_line_error(attention, r"no row has 'prefill_s': nothing to draw the prefill figure", "prefill")
  _one_line_error(attention, r"no row has 'peak_gib' or 'planned_gib'", "memory")
  # A topic file without combined rows: its parts are what can be drawn.
  msg = _one_line_error(os.path.join(RESULTS, "attention.json"), "a topic file without combined rows", "prefill")
  assert "'attention-h200'" in msg
  _one_line_error([_result(8, 1.0, 1.0, None).stats | {"prefill_s": 1.0}], "no 'impl'", "prefill")
  _one_line_error([{"stats": {"prefill_s": 1.0}}], "the stats have no 'prompt_tokens'", "prefill")
  _one_line_error([], "nothing to draw", "prefill")
  _one_line_error([3], "is a int", "prefill")
  not_json = tmp_path / "x.json"
  not_json.write_text("{")
  _one_line_error(str(not_json), "is not JSON", "prefill")
  with pytest.raises(ValueError, match=r"unknown figure kind\(s\) \['latency'\]"):
    plot.save_figures(LONGCTX, str(tmp_path / "k"), kinds=("memory", "latency"))
  # save_figures draws everything first: a failing second figure leaves no first file behind.
  _one_line_error([dict(impl="a", S=8, peak_gib=1.0)], "no row has 'prefill_s'", tmp_path=tmp_path)
  assert not list(tmp_path.glob("bad-*")) and not list(tmp_path.glob("k-*"))


def test_import_without_matplotlib_says_how_to_install():
  code = "import sys; sys.modules['matplotlib'] = None\nimport lcjax.plot"
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                     env=dict(os.environ, PYTHONPATH=REPO))
  assert p.returncode != 0
  last = p.stderr.strip().splitlines()[-1]
  assert last == "ImportError: lcjax.plot needs matplotlib: pip install 'lcjax[plot]'", p.stderr[-500:]
