"""Figures of memory, prefill time and decode time against context length.

    from lcjax import plot
    plot.overview("benchmarks/results/longctx.json")               # memory, prefill and decode side by side
    fig = plot.memory_figure("benchmarks/results/longctx.json")
    plot.prefill_figure([engine.generate(p, max_new_tokens=8) for p in prompts], label="my run")
    plot.save_figures(result, "out/longctx")                       # out/longctx-memory.png, -prefill.png

A source is a benchmark result (a JSON file written by tools/bench_longctx.py, a topic file of
benchmarks/merge_results.py that has combined rows, one of a topic file's `parts`, or the same object as a dict:
{"device": ..., "rows": [...]}), a list of its rows ({"impl", "S", "prefill_s",
"decode_ms_per_token", "peak_gib", ...}), or a list of `GenerationResult`s (or their `stats` dicts as a
`{"stats": ...}` mapping), whose context is the prompt's tokens, cached ones included (its prefill time covers
the tokens it prefilled: `stats["prefill_tokens"]`), and whose memory is the peak device memory (none on a CPU).
One line per implementation (`impl`, with the mesh when a row ran on several devices); a row marked `predicted` is
drawn with hollow markers and, without a measured peak, at its planned memory; the first context an
implementation ran out of memory at is a dotted vertical line.

Needs matplotlib: `pip install 'lcjax[plot]'`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

try:
  import matplotlib.figure
  import matplotlib.ticker
except ImportError:
  raise ImportError("lcjax.plot needs matplotlib: pip install 'lcjax[plot]'") from None

__all__ = ["Results", "load", "memory_figure", "prefill_figure", "decode_figure", "overview", "save_figures"]

GiB = 1024 ** 3

# kind: (row field, y label, file suffix)
KINDS = {"memory": ("peak_gib", "peak device memory (GiB)", "memory"),
         "prefill": ("prefill_s", "prefill time (s)", "prefill"),
         "decode": ("decode_ms_per_token", "decode time (ms/token)", "decode")}


@dataclasses.dataclass
class Results:
  """Rows to draw, with where they came from (a file name, for errors) and the device's memory in GiB."""
  rows: list[dict]
  source: str = "results"
  device_gib: float | None = None
  title: str | None = None


def device_gib(device: str | None) -> float | None:
  """The memory of one device from a result's device string ("NVIDIA H200, 143771 MiB, 580.159.04"), or None
  where the string names none (a CPU)."""
  m = re.search(r"(\d+)\s*MiB", device or "")
  return int(m.group(1)) / 1024 if m else None


def _number(x) -> float | None:
  return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _result_row(stats: dict, label: str, where: str) -> dict:
  missing = [k for k in ("prompt_tokens", "prefill_s") if k not in stats]
  if missing:
    raise ValueError(f"{where}: the stats have no {', '.join(map(repr, missing))} (a GenerationResult's stats "
                     f"hold prompt_tokens, prefill_s, decode_ms_per_token, peak_device_bytes)")
  peak = stats.get("peak_device_bytes")
  return dict(impl=label, S=int(stats["prompt_tokens"]), prefill_s=_number(stats["prefill_s"]),
              decode_ms_per_token=_number(stats.get("decode_ms_per_token")),
              peak_gib=None if peak is None else peak / GiB, oom=False)


def _as_row(item, i: int, label: str, source: str) -> dict:
  where = f"{source}: row {i}"
  stats = getattr(item, "stats", None)
  if stats is None and isinstance(item, dict) and isinstance(item.get("stats"), dict):
    stats = item["stats"]
  if isinstance(stats, dict):
    return _result_row(stats, label, where)
  if not isinstance(item, dict):
    raise ValueError(f"{where} is a {type(item).__name__}: give benchmark rows (dicts with 'impl' and 'S') or "
                     "GenerationResults")
  missing = [k for k in ("impl", "S") if k not in item]
  if missing:
    raise ValueError(f"{where} has no {' and no '.join(map(repr, missing))} (a benchmark row names its "
                     f"implementation 'impl' and context length 'S'; it has {sorted(item)[:8]})")
  if isinstance(item["S"], bool) or not isinstance(item["S"], (int, float)):
    raise ValueError(f"{where}: 'S' (the context length) is {item['S']!r}, not a number")
  return item


def load(source, *, label: str = "lcjax") -> Results:
  """The rows of a source (see the module's docstring); `label` names the line of GenerationResults."""
  if isinstance(source, Results):
    return source
  name, meta = "results", {}
  if isinstance(source, (str, os.PathLike)):
    name = os.fspath(source)
    try:
      with open(name) as f:
        source = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{name} is not JSON: {e}") from None
  if isinstance(source, dict):
    if not isinstance(source.get("rows"), list) and isinstance(source.get("parts"), list):
      names = [p.get("name") for p in source["parts"] if isinstance(p, dict)]
      raise ValueError(f"{name} is a topic file without combined rows: draw one of its parts (its 'parts' list: "
                       f"{names})")
    if not isinstance(source.get("rows"), list):
      raise ValueError(f"{name} has no 'rows' list (a benchmark result is {{'device': ..., 'rows': [{{'impl', "
                       f"'S', ...}}]}}; it has {sorted(source)[:8]})")
    meta, source = source, source["rows"]
  if not isinstance(source, (list, tuple)) or not source:
    raise ValueError(f"{name}: nothing to draw: give a result file, a result dict, or a non-empty list of rows or "
                     "GenerationResults")
  rows = [_as_row(item, i, label, name) for i, item in enumerate(source)]
  model = meta.get("model") or {}
  title = None
  if isinstance(model, dict) and model.get("preset"):
    dev = str(meta.get("device", "")).split(",")[0]
    title = model["preset"] + (f", {dev}" if dev else "")
  return Results(rows, name, device_gib(meta.get("device")), title)


def _series(r: dict) -> str:
  """The line a row belongs to: its implementation, and its mesh when it ran on several devices."""
  t, s = r.get("tensor", 1) or 1, r.get("seq", 1) or 1
  return r["impl"] if t * s == 1 else f"{r['impl']} (tensor={t}, seq={s})"


def _value(r: dict, key: str) -> float | None:
  """A row's value of `key`; a predicted row without a measured peak is drawn at its planned memory."""
  v = _number(r.get(key))
  if v is None and key == "peak_gib" and r.get("predicted"):
    v = _number(r.get("planned_gib"))
  return v


def _tokens(x, _pos=None) -> str:
  for div, unit in ((1 << 20, "M"), (1 << 10, "K")):
    if x >= div:
      return f"{x / div:g}{unit}"
  return f"{x:g}"


def _draw(res: Results, kind: str, ax, device_gib_: float | None) -> None:
  key, ylabel, _ = KINDS[kind]
  rows = res.rows
  # lcjax's planned memory, beside its measured peak (the only memory a CPU run has).
  planned = sorted((r["S"], r["planned_gib"]) for r in rows if kind == "memory" and _series(r) == "lcjax"
                   and not r.get("oom") and not r.get("predicted") and _number(r.get("planned_gib")) is not None)
  if not planned and not any(_value(r, key) is not None for r in rows):
    what = "'peak_gib' or 'planned_gib'" if key == "peak_gib" else repr(key)
    cpu = (" (GenerationResults on a CPU have no device memory counter)"
           if key == "peak_gib" and all("peak_gib" in r and r["peak_gib"] is None for r in rows) else "")
    raise ValueError(f"{res.source}: no row has {what}: nothing to draw the {kind} figure from{cpu}")
  ys = [y for _, y in planned]
  for name in sorted({_series(r) for r in rows}):
    mine = sorted((r for r in rows if _series(r) == name), key=lambda r: r["S"])
    pts = [(r["S"], _value(r, key)) for r in mine if not r.get("oom") and _value(r, key) is not None]
    color = "gray"
    ys += [y for _, y in pts]
    if pts:
      hollow = all(r.get("predicted") for r in mine)
      line, = ax.plot(*zip(*pts), marker="o", label=name,
                      **(dict(markerfacecolor="none", markersize=9) if hollow else {}))
      color = line.get_color()
    ooms = [r["S"] for r in mine if r.get("oom")]
    if ooms:
      ax.axvline(min(ooms), linestyle=":", color=color, alpha=0.6, label=f"_oom {name}")
      ax.annotate(f"{name} OOM", (min(ooms), 0.95), xycoords=("data", "axes fraction"), rotation=90, fontsize=8,
                  va="top")
  if planned:
    ax.plot(*zip(*planned), linestyle="--", color="gray", label="lcjax planned")
  if kind == "memory" and device_gib_:
    ax.axhline(device_gib_, color="red", linewidth=1, label=f"device memory {device_gib_:.0f} GiB")
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_tokens))
  if kind != "memory" and min(ys) > 0 and max(ys) / min(ys) > 20:   # times over decades: a log scale
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _pos: f"{y:g}"))
  else:
    ax.set_ylim(bottom=0)
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel(ylabel)
  if res.title:
    ax.set_title(res.title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)


def _figure(source, kind: str, *, ax=None, label: str = "lcjax", device_gib: float | None = None):
  res = load(source, label=label)
  if ax is None:
    import matplotlib.pyplot as plt
    _, ax = plt.subplots(figsize=(7, 4.5), layout="tight")
  _draw(res, kind, ax, device_gib if device_gib is not None else res.device_gib)
  return ax.figure


def memory_figure(source, *, ax=None, label: str = "lcjax", device_gib: float | None = None):
  """Peak device memory (GiB) against context length, with lcjax's planned memory (dashed) and the device's
  memory (red; from the result's device string, or `device_gib`). Draws on `ax` if given; returns the Figure."""
  return _figure(source, "memory", ax=ax, label=label, device_gib=device_gib)


def prefill_figure(source, *, ax=None, label: str = "lcjax"):
  """Prefill seconds against context length (both axes logarithmic). Returns the Figure."""
  return _figure(source, "prefill", ax=ax, label=label)


def decode_figure(source, *, ax=None, label: str = "lcjax"):
  """Decode milliseconds per token against context length. Returns the Figure."""
  return _figure(source, "decode", ax=ax, label=label)


def _has(res: Results, kind: str) -> bool:
  key = KINDS[kind][0]
  return any(_value(r, key) is not None or (kind == "memory" and _number(r.get("planned_gib")) is not None)
             for r in res.rows)


def overview(source, *, label: str = "lcjax", device_gib: float | None = None):
  """Memory, prefill and decode side by side, each where the rows have it (GenerationResults on a CPU have no
  device memory). Returns the Figure."""
  import matplotlib.pyplot as plt
  res = load(source, label=label)
  kinds = [k for k in KINDS if _has(res, k)]
  if not kinds:
    raise ValueError(f"{res.source}: no row has 'peak_gib', 'planned_gib', 'prefill_s' or 'decode_ms_per_token': "
                     "nothing to draw")
  fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), layout="tight", squeeze=False)
  for kind, ax in zip(kinds, axes[0]):
    _draw(res, kind, ax, device_gib if device_gib is not None else res.device_gib)
  return fig


def save_figures(source, path_stem: str, *, kinds=("memory", "prefill"), device_gib: float | None = None,
                 dpi: int = 110) -> list[str]:
  """Write `path_stem`-{memory,prefill,decode}.png for `kinds` (making the folder), without pyplot (no display
  needed); returns the paths. Every figure is drawn before any file is written, so bad input writes nothing."""
  unknown = sorted(set(kinds) - set(KINDS))
  if unknown:
    raise ValueError(f"unknown figure kind(s) {unknown}; choose from {sorted(KINDS)}")
  res = load(source)
  figs = []
  for kind in kinds:
    fig = matplotlib.figure.Figure(figsize=(7, 4.5), layout="tight")
    _draw(res, kind, fig.add_subplot(), device_gib if device_gib is not None else res.device_gib)
    figs.append((fig, f"{path_stem}-{KINDS[kind][2]}.png"))
  os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
  for fig, path in figs:
    fig.savefig(path, dpi=dpi)
  return [p for _, p in figs]
