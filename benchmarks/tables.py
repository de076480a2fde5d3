"""Regenerates the measured tables of README.md and docs/*.md from the benchmarks/results topic files they cite.

A generated table sits between `<!-- table: NAME -->` and `<!-- /table -->`; NAME picks its function in TABLES,
which reads its JSON and returns the table's lines. `python benchmarks/tables.py` rewrites every marked region in
place; `--check` rewrites nothing and exits 1, naming each page and table whose text differs from its JSON.
Tables without markers are hand-written (assembled from several runs, or carrying notes).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
REGION = re.compile(r"^<!-- table: ([\w-]+) -->\n(.*?)^<!-- /table -->$", re.M | re.S)


def _part(topic: str, part: str) -> dict:
  """Part `part` of a topic file (`benchmarks/merge_results.py`): its JSON, rows and the tool's own fields."""
  d = json.loads((RESULTS / f"{topic}.json").read_text())
  hits = [p for p in d["parts"] if p["name"] == part]
  if not hits:
    raise ValueError(f"{topic}.json has no part {part!r}; parts: {[p['name'] for p in d['parts']]}")
  return hits[0]


def _rows(topic: str, part: str | None = None) -> list[dict]:
  """The rows of a topic file: its combined rows, or those of its part `part`."""
  if part is None:
    return json.loads((RESULTS / f"{topic}.json").read_text())["rows"]
  return _part(topic, part)["rows"]


def _file(topic: str, part: str) -> str:
  """Where a table row's figures are: the topic's markdown and the part's heading in it."""
  return f"`{topic}.md`, part {part}"


def _one(rows: list[dict], **match) -> dict | None:
  """The single row whose fields equal `match`; None when no row has them."""
  hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
  if len(hits) > 1:
    raise ValueError(f"{len(hits)} rows match {match}; a table cell needs exactly one")
  return hits[0] if hits else None


# Number formats, each the rounding the pages use for that quantity.
def _s(x: float) -> str:
  """Seconds: 2 decimals below 100 s, 1 from 100 s (0.22, 11.12, 143.9)."""
  return f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _sig3(x: float) -> str:
  """3 significant figures, trailing zeros kept (5.12, 21.0, 109)."""
  return f"{x:#.3g}".rstrip(".")


def _ctx(tokens: int) -> str:
  """Context length: 8192 -> 8K, 1048576 -> 1M."""
  return f"{tokens >> 20}M" if tokens >= 1 << 20 and tokens % (1 << 20) == 0 else f"{tokens >> 10}K"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  line = lambda cells: "| " + " | ".join(cells) + " |"
  return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


# Long context, Llama-3-8B shape: lcjax, HF and dense from the combined rows of longctx.json.
LONGCTX = "longctx"
LONGCTX_S = (8192, 32768, 131072, 262144, 524288)
LONGCTX_HEADLINE_S = (8192, 32768, 131072, 524288)
HF_WARMUP = {8192: "†"}            # HF's first context of its run includes its warm-up (the pages' footnote)


def _dense(rows: list[dict], S: int) -> str:
  d = _one(rows, impl="dense", S=S)
  if d is None:
    return "not run"
  if d.get("skipped"):
    return "OOM (implied by 32K)" if "ran out of memory" in d["skipped"] else "not run"
  if d["oom"]:
    return "OOM"
  return f"{_s(d['prefill_s'])} s, {d['peak_gib']:.1f} GiB"


def _over(r: dict) -> str:
  """Peak above weights + KV cache, GiB."""
  return f"{r['peak_gib'] - r['weights_gib'] - r['kv_gib']:.1f}"


def longctx_8b() -> list[str]:
  rows = _rows(LONGCTX)
  out = []
  for S in LONGCTX_S:
    lc, hf = _one(rows, impl="lcjax", S=S), _one(rows, impl="hf", S=S)
    out.append([_ctx(S), f"{_s(lc['prefill_s'])} s ({lc['prefill_tflops']:.0f} TF/s)",
                f"{_s(hf['prefill_s'])} s{HF_WARMUP.get(S, '')}", f"{_sig3(lc['decode_ms_per_token'])} ms/tok",
                f"{_sig3(hf['decode_ms_per_token'])} ms/tok", f"{lc['peak_gib']:.1f} GiB (+{_over(lc)})",
                f"{hf['peak_gib']:.1f} GiB", _dense(rows, S)])
  r = _one(rows, impl="lcjax-fp8kv (8 of 32 layers)", S=1 << 20)
  out.append([f"1M, fp8 KV, {r['layers']} of 32 layers", f"{_s(r['prefill_s'])} s ({r['prefill_tflops']:.0f} TF/s)",
              "not run", f"{_sig3(r['decode_ms_per_token'])} ms/tok", "-",
              f"{r['peak_gib']:.1f} GiB (+{_over(r)}; planned {r['planned_gib']:.1f})", "-", "not run"])
  r = _one(rows, impl="lcjax-fp8 (fp8 KV, float8_e4m3fn attention)", S=1 << 20)
  out.append(["1M, fp8 KV + `float8_e4m3fn` attention, 32 layers ¹",
              f"{_s(r['prefill_s'])} s ({r['prefill_tflops']:.0f} TF/s)", "not run‡",
              f"{_sig3(r['decode_ms_per_token'])} ms/tok", "-",
              f"{r['peak_gib']:.1f} GiB (+{_over(r)}; planned {r['planned_gib']:.1f})", "-", "not run"])
  return _table(["context", "lcjax prefill", "HF prefill", "lcjax decode", "HF decode", "lcjax peak (W+KV+)",
                 "HF peak", "dense"], out)


def longctx_8b_headline() -> list[str]:
  rows = _rows(LONGCTX)
  out = []
  for S in LONGCTX_HEADLINE_S:
    lc, hf = _one(rows, impl="lcjax", S=S), _one(rows, impl="hf", S=S)
    out.append([_ctx(S), f"{_s(lc['prefill_s'])} s", f"{_s(hf['prefill_s'])} s{HF_WARMUP.get(S, '')}",
                f"{_sig3(lc['decode_ms_per_token'])} ms/tok", f"{_sig3(hf['decode_ms_per_token'])} ms/tok",
                f"{lc['peak_gib']:.1f} GiB", f"{hf['peak_gib']:.1f} GiB", _dense(rows, S)])
  return _table(["context", "lcjax prefill", "HF prefill", "lcjax decode", "HF decode", "lcjax peak", "HF peak",
                 "dense"], out)


# FP8 weights: one row per (part of fp8w.json, context, implementation).
L70, L8 = "Llama-3.1-70B shape, all 80 layers, fp8 weights", "Llama-3-8B shape"
FP8W = [("fp8w-70b-kv-h200", 32768, "lcjax-fp8w", L70, "bf16 KV, bf16"),
        ("fp8w-70b-kv-h200", 32768, "lcjax-fp8w-fp8kv", L70, "fp8 KV, bf16"),
        ("fp8w-70b-kv-h200", 131072, "lcjax-fp8w", L70, "bf16 KV, bf16"),
        ("fp8w-70b-h200", 131072, "lcjax-fp8w-fp8kv", L70, "fp8 KV, bf16"),
        ("fp8w-70b-256k-h200", 262144, "lcjax-fp8w-fp8kv", L70, "fp8 KV, bf16"),
        ("fp8w-8b-h200", 32768, "lcjax-fp8w-fp8", L8 + ", fp8 weights", "fp8 KV, FP8"),
        ("fp8w-8b-h200", 32768, "lcjax-fp8", L8 + ", bf16 weights", "fp8 KV, FP8"),
        ("fp8w-8b-h200", 32768, "hf", L8 + ", HF transformers (bf16)", "bf16 KV, SDPA"),
        ("fp8w-8b-h200", 131072, "lcjax-fp8w-fp8", L8 + ", fp8 weights", "fp8 KV, FP8"),
        ("fp8w-8b-h200", 131072, "lcjax-fp8", L8 + ", bf16 weights", "fp8 KV, FP8"),
        ("fp8w-8b-h200", 131072, "hf", L8 + ", HF transformers (bf16)", "bf16 KV, SDPA"),
        ("fp8w-8b-512k-h200", 524288, "lcjax-fp8w-fp8", L8 + ", fp8 weights", "fp8 KV, FP8"),
        ("fp8w-8b-1m-h200", 1048576, "lcjax-fp8w-fp8", L8 + ", fp8 weights", "fp8 KV, FP8")]


def _fp8w_cells(r: dict) -> list[str]:
  plan = "-" if r.get("planned_gib") is None else f"{r['planned_gib']:.1f}"
  return [f"{_sig3(r['prefill_s'])} s", f"{_sig3(r['decode_ms_per_token'])} ms/token",
          f"{r['peak_gib']:.1f} / {plan} GiB"]


def fp8w() -> list[str]:
  out = [[model, attention, _ctx(S), *_fp8w_cells(_one(_rows("fp8w", part), S=S, impl=impl)), _file("fp8w", part)]
         for part, S, impl, model, attention in FP8W]
  return _table(["model", "KV, attention", "context", "prefill", "decode", "peak / plan", "file"], out)


def fp8w_70b_headline() -> list[str]:
  r = _one(_rows("fp8w", "fp8w-70b-h200"), S=131072)
  return _table(["model", "context", "prefill", "decode", "peak / planned"],
                [["Llama-3.1-70B shape, fp8 weights, fp8 KV", _ctx(r["S"]), *_fp8w_cells(r)]])


# Context cache: one part of context.json per row, each with one row.
CONTEXT = ["context-h200-128k", "context-h200-512k-fp8"]
CACHE_DTYPE = {"bfloat16": "bf16 KV", "float8_e4m3fn": "fp8 KV"}


def context_cache() -> list[str]:
  out = []
  for part in CONTEXT:
    (r,) = _rows("context", part)
    out.append([f"{_ctx(r['S'])}, {CACHE_DTYPE[r['cache_dtype']]} ({r['kv_gb']:.1f} GB)", f"{r['prefill_s']:.2f} s",
                f"{r['ttft_s']:.3f} s ({r['speedup']:.0f}x)",
                f"{r['restore_host_s']:.2f} s, {r['restore_host_gbs']:.1f} GB/s "
                f"({100 * r['restore_host_vs_floor']:.0f}% of {r['h2d_floor_gbs']:.1f})",
                f"{r['restore_disk_s']:.1f} s, {r['restore_disk_gbs']:.2f} GB/s "
                f"({100 * r['restore_disk_vs_floor']:.0f}% of {r['disk_floor_gbs']:.2f})", _file("context", part)])
  return _table(["context", "cold prefill", "time to first token, cached", "restore from host (vs floor)",
                 "restore from disk (vs floor)", "file"], out)


# Lengths: each part of lengths.json is one engine's sweep; a table row per (part, kind), a column per length.
LENGTHS = [("lengths-8b-h200", "Llama-3.1-8B shape, fp8 weights + fp8 KV, FP8 attention"),
           ("lengths-8b-bf16attn-h200", "Llama-3.1-8B shape, fp8 weights + fp8 KV, bf16 attention"),
           ("lengths-70b-h200", "Llama-3.1-70B shape, fp8 weights + fp8 KV, bf16 attention")]


def _lengths_checks(part: str) -> list[dict]:
  """The growth checks tools/bench_lengths.py recorded in part `part` of lengths.json (one per variant and kind)."""
  return _part("lengths", part)["checks"]


def _lengths_table(sweeps: list[tuple[str, str, list[dict], dict]]) -> list[str]:
  """A row per sweep (label, part, its rows, its growth check): seconds at each length any sweep has, and whether
  it grew with length."""
  tokens = sorted({r["tokens"] for _, _, rows, _ in sweeps for r in rows})
  out = []
  for label, part, rows, check in sweeps:
    by = {r["tokens"]: r for r in rows}
    out.append([label, *(f"{by[n]['seconds']:.3f}" if n in by else "-" for n in tokens),
                "yes" if check["monotone"] else "**no**", _file("lengths", part)])
  return _table(["tokens", *(f"{n:,}" for n in tokens), "grows with length", "file"], out)


def lengths(kind: str) -> list[str]:
  """Seconds at each length of the `kind` sweep ("document": prefill; "question": time to the first token on the
  pinned context), one row per part that has the sweep, with whether it grew with length."""
  sweeps = []
  for part, label in LENGTHS:
    rows = [r for r in _rows("lengths", part) if r["kind"] == kind]
    if rows:
      (check,) = [c for c in _lengths_checks(part) if c["kind"] == kind]
      sweeps.append((label, part, rows, check))
  return _lengths_table(sweeps)


# Short documents in an engine of 128K tokens (max_context): a sweep part whose rows hold several variants.
LENGTHS_SHORT = "lengths-short-8b-h200"
VARIANT_LABELS = {"float8_e4m3fn+fp8attn+fp8w": "Llama-3.1-8B shape, fp8 weights + fp8 KV, FP8 attention",
                  "float8_e4m3fn+fp8w": "Llama-3.1-8B shape, fp8 weights + fp8 KV, bf16 attention"}


def lengths_short() -> list[str]:
  """Prefill seconds of short documents in an engine whose page table is 128K tokens, a row per variant."""
  rows = [r for r in _rows("lengths", LENGTHS_SHORT) if r["kind"] == "document"]
  checks = {c["variant"]: c for c in _lengths_checks(LENGTHS_SHORT) if c["kind"] == "document"}
  return _lengths_table([(VARIANT_LABELS[v], LENGTHS_SHORT, [r for r in rows if r["variant"] == v], checks[v])
                         for v in dict.fromkeys(r["variant"] for r in rows)])


# Speculation: the parts of speculation.json that measured tokens per model call on real answers
# (tools/bench_speculation.py --task=answers), and the device each ran on.
SPECULATION_ANSWERS = [("speculation-smollm2-cpu", "CPU")]
ANSWER_KINDS = [("quote", "quoting answers"), ("summary", "summaries"), ("unrelated", "answers not about it")]


def speculation_answers() -> list[str]:
  """Per setting (plain, then each draft_ngram x draft_tokens): decoded tokens per model call, the mean over each
  kind's questions; drafts kept of those proposed; answers with the same tokens as plain decoding."""
  out = []
  for part, device in SPECULATION_ANSWERS:
    rows = _rows("speculation", part)
    for setting in dict.fromkeys(r["setting"] for r in rows):
      mine = [r for r in rows if r["setting"] == setting]
      per = [sum(r["tokens_per_call"] for r in mine if r["kind"] == k) / sum(r["kind"] == k for r in mine)
             for k, _ in ANSWER_KINDS]
      kept = f"{sum(r['drafts_accepted'] for r in mine)} of {sum(r['drafts_proposed'] for r in mine)}"
      same = f"{sum(r['same_tokens_as_plain'] for r in mine)} of {len(mine)}"
      out.append([setting, *(f"{x:.2f}" for x in per), kept, same, f"{device}; {_file('speculation', part)}"])
  return _table(["setting", *(f"tokens / call, {label}" for _, label in ANSWER_KINDS), "drafts kept",
                 "same tokens as plain", "device; file"], out)


def _merger():
  """benchmarks/merge_results.py, loaded from its path (benchmarks/ is not a package)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("lcjax_bench_merge_results", REPO / "benchmarks" / "merge_results.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def without_commit() -> list[str]:
  """Every committed part without a commit, by topic, with its date and merge_results.WITHOUT_COMMIT's reason."""
  m = _merger()
  out = []
  for path in sorted(RESULTS.glob("*.json")):
    for p in json.loads(path.read_text())["parts"]:
      if p.get("commit") in m.NO_SOURCE:
        if p["name"] not in m.WITHOUT_COMMIT:
          raise ValueError(f"{path.name}: part {p['name']} has no commit and merge_results.WITHOUT_COMMIT does "
                           "not list it")
        out.append([f"`{path.stem}.md`", p["name"], (p.get("date") or "-")[:10], m.WITHOUT_COMMIT[p["name"]]])
  return _table(["file", "part", "measured", "why it has no commit, and what else is stale"], out)


TABLES = {"longctx-8b": longctx_8b, "longctx-8b-headline": longctx_8b_headline, "fp8w": fp8w,
          "fp8w-70b-headline": fp8w_70b_headline, "context-cache": context_cache,
          "lengths-documents": lambda: lengths("document"), "lengths-questions": lambda: lengths("question"),
          "lengths-short": lengths_short,
          "speculation-answers": speculation_answers, "without-commit": without_commit}


def pages(repo: pathlib.Path = REPO) -> list[pathlib.Path]:
  return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def render(text: str, where: str = "page") -> tuple[str, list[str]]:
  """`text` with every marked table regenerated, and the names of the tables that changed."""
  changed = []

  def one(m: re.Match) -> str:
    name = m.group(1)
    if name not in TABLES:
      raise SystemExit(f"{where}: <!-- table: {name} --> names no table; known: {', '.join(TABLES)}")
    new = "\n".join(TABLES[name]()) + "\n"
    if new != m.group(2):
      changed.append(name)
    return f"<!-- table: {name} -->\n{new}<!-- /table -->"

  return REGION.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 when a table differs")
  args = ap.parse_args(argv)
  stale = []
  for page in pages():
    text = page.read_text()
    new, changed = render(text, str(page.relative_to(REPO)))
    stale += [f"{page.relative_to(REPO)}: table {name}" for name in changed]
    if changed and not args.check:
      page.write_text(new)
  for line in stale:
    print(("differs from its JSON: " if args.check else "rewrote ") + line)
  return 1 if stale and args.check else 0


if __name__ == "__main__":
  sys.exit(main())
