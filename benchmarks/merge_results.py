"""Merge the part files one step of benchmarks/reproduce_h200.sh wrote into one topic file pair.

  python benchmarks/merge_results.py TOPIC OUT PART [PART ...]    # PART: a part's .json, or a folder of them
  python benchmarks/merge_results.py --keep TOPIC OUT [PART ...]  # the parts given replace those of the same name

Each part is the `<name>.json` + `<name>.md` pair a tool wrote (its `--name`). The merge writes OUT/TOPIC.json:
{"topic", "title", "command", "parts": [{"name", "command", "device", "versions", "commit", ... the part's own
JSON}]} (`commit`: the part's `source`, the revision tools/benchlib.py records: $LCJAX_SOURCE_REVISION, else git),
and OUT/TOPIC.md: each part's own markdown under a heading of its name, its command first. Parts go in name order.
The merge reads every part before it writes anything: a part without a command or a commit, two parts of one name
or a missing markdown is one line naming it. WITHOUT_COMMIT names the committed parts measured before parts
recorded their commit, each with why; they merge with `commit: null` until they are measured again.

With --keep, the parts of OUT/TOPIC.json that no PART replaces (by name, as REPLACED_BY says, or as NAME-h200
replaces its H100 twin NAME-h100: `twins_replaced`) stay as committed (their JSON, and their sections of
OUT/TOPIC.md): `reproduce_h200.sh STEP:PART` measures some parts of a step again and merges them this way.

Topic `longctx` also gets a combined view (LONGCTX_VIEW): the rows of its parts that make the context-length
sweep, each with the `part` that measured it, at the top level of longctx.json ({"device", "model", "rows",
"goals"}, what lcjax.plot and benchmarks/tables.py read), its table in longctx.md, and the plots
longctx-{memory,prefill}.png drawn from it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# topic: title (the first line of TOPIC.md). Every result file pair under benchmarks/results is one of these.
TOPICS = {
  "attention": "attention kernels (bf16, 8-bit prefill, fp8 paged decode) beside cuDNN, FA3 and torch SDPA",
  "longctx": "Llama-3-8B shape, batch 1, one H200: lcjax beside HF and the dense baseline, 8K to 1M tokens",
  "longctx-8bit": "Llama-3-8B shape, batch 1, one H200: 8-bit attention and the fp8 KV cache end to end",
  "exact": "logits against a float32 HF transformers oracle on the same weights",
  "needle": "needle retrieval with the real SmolLM2-135M-Instruct",
  "quality": "8-bit attention on FA3's outlier test, and fp8 weights against transformers",
  "fp8w": "fp8 weights end to end (Llama-3.1-70B and Llama-3-8B shapes, one H200)",
  "context": "the context cache: cached questions, restores from host memory and disk",
  "startup": "CLI start-up with the compilation cache off, cold and warm",
  "stream": "decode steps per device call: ms/token of streamed decoding",
  "multigpu": "the 70B shape on one H200 (8 of 80 layers), and its extrapolation to 8 GPUs",
  "lengths": "prefill and question times at unaligned lengths beside aligned ones, checked to grow with length",
  "speculation": "prompt-lookup speculative decoding: tokens per model call on real answers, a verify step's cost",
}


# Parts measured before result files named their commit (tools/benchlib.py's `source`, since aeedb17 of
# 2026-12-01 23:26 UTC), each awaiting a run of `bash benchmarks/reproduce_h200.sh TOPIC` at a commit: part ->
# why it has none and what else is stale in it. Only these merge without a commit; tests/test_results.py fails on
# a part without one that is not listed and on a listed part that has one, so the list only shrinks.
# benchmarks/tables.py writes it into docs/performance.md.
_BEFORE = "measured before result files named their commit"
_V2 = "; measured the v2 context format (no checksums, no fsync), which the current code refuses"
WITHOUT_COMMIT = {
  "attention-h200": _BEFORE,
  "context-h200-512k-fp8": _BEFORE + _V2,
  "exact-fp8-smollm2-h200": _BEFORE,
  "exact-int8-smollm2-h200": _BEFORE,
  "longctx-h200-j": _BEFORE,
  "longctx-h200-q": _BEFORE,
  "8xh200-predicted": _BEFORE + "; extrapolated from l70b-8layers-h200, which has none either",
  "l70b-8layers-h200": _BEFORE,
  "needle-fp8-smollm2-h200": _BEFORE,
  "needle-fp8decode-smollm2-h200": _BEFORE,
  "needle-int8-smollm2-h200": _BEFORE,
}
# Committed parts measured on an H100 when no H200 was lent, by another name than their H200 part's twin
# (`twins_replaced`) -> the H200 part of reproduce_h200.sh that replaces each: a --keep merge that brings the H200
# part drops the H100 one.
REPLACED_BY = {
  "attention-chunk-fp8pages-h100": "attention-chunk-paged-h200",
}


def twins_replaced(new: set[str]) -> set[str]:
  """The H100 twins of the H200 parts in `new`, matched by name (-h200 read -h100: `AS_GPU=h100 reproduce_h200.sh`
  names the parts it runs so), which they replace in a --keep merge."""
  return {name.replace("-h200", "-h100") for name in new if "-h200" in name}


# The `source` tools/benchlib.py records when neither $LCJAX_SOURCE_REVISION nor git gave a revision.
NO_SOURCE = (None, "", "unknown")


def lacks_commit(name: str, commit) -> bool:
  """Whether part `name` recorded no commit (`commit`: its `source`) and is not one WITHOUT_COMMIT lets merge."""
  return commit in NO_SOURCE and name not in WITHOUT_COMMIT


def fail(msg: str):
  raise SystemExit(f"merge_results: {msg}")


def _part_files(paths: list[str]) -> list[str]:
  files = []
  for p in paths:
    if os.path.isdir(p):
      files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".json"))
    elif p.endswith(".json") and os.path.isfile(p):
      files.append(p)
    else:
      fail(f"{p} is neither a part's .json file nor a folder")
  if not files:
    fail(f"no part files (.json) in {', '.join(paths)}")
  return files


def read_parts(paths: list[str]) -> list[tuple[dict, str]]:
  """(part, markdown) for every part under `paths`, in name order; the part is the file's JSON with its name,
  command, device, versions and commit first."""
  seen, parts = {}, []
  for path in _part_files(paths):
    name = os.path.basename(path)[:-len(".json")]
    if name in seen:
      fail(f"two parts named {name!r}: {seen[name]} and {path}")
    seen[name] = path
    try:
      with open(path) as f:
        d = json.load(f)
    except json.JSONDecodeError as e:
      fail(f"{path} is not JSON: {e}")
    if not isinstance(d, dict):
      fail(f"{path} holds a {type(d).__name__}, not a result object")
    if not d.get("command"):
      fail(f"{path} has no 'command' (a part names the command that measured it; keys: {sorted(d)[:10]})")
    for key in ("name", "commit"):
      if key in d:
        fail(f"{path} has its own {key!r} ({d[key]!r}); the merge sets it")
    if lacks_commit(name, d.get("source")):
      fail(f"{path} has no commit (source={d.get('source')!r}): measure it again with $LCJAX_SOURCE_REVISION set "
           "or from a git checkout")
    md = path[:-len(".json")] + ".md"
    if not os.path.isfile(md):
      fail(f"{path} has no markdown beside it ({md})")
    with open(md) as f:
      text = f.read()
    parts.append((dict(name=name, command=d["command"], device=d.get("device"), versions=d.get("versions"),
                       commit=d.get("source"), **{k: v for k, v in d.items() if k not in ("command", "device",
                                                                                           "versions")}), text))
  return sorted(parts, key=lambda p: p[0]["name"])


def part_section(part: dict, text: str) -> list[str]:
  """A part's markdown under `## name`: its own title line dropped, its other headings one level down, its
  command first when its markdown does not name it."""
  lines = text.rstrip("\n").split("\n")
  if lines and lines[0].startswith("# "):
    lines = lines[1:]
  lines = ["#" + ln if re.match(r"#+ ", ln) else ln for ln in lines]
  head = [f"## {part['name']}", ""]
  if not any(ln.startswith("command: ") for ln in lines):
    head += [f"command: `{part['command']}`", ""]
  while lines and not lines[0].strip():
    lines = lines[1:]
  return head + lines


def kept_parts(out: str, topic: str, replaced: set[str]) -> list[tuple[dict, list[str]]]:
  """(part, its section of OUT/TOPIC.md) for each part of the committed OUT/TOPIC.json not named in `replaced`."""
  path, md = os.path.join(out, topic + ".json"), os.path.join(out, topic + ".md")
  for p in (path, md):
    if not os.path.isfile(p):
      fail(f"--keep: no {p} to keep parts of")
  with open(path) as f:
    parts = json.load(f).get("parts")
  if not isinstance(parts, list):
    fail(f"--keep: {path} has no list of 'parts'")
  with open(md) as f:
    lines = f.read().rstrip("\n").split("\n")
  starts = []
  for p in parts:
    heads = [i for i, ln in enumerate(lines) if ln == f"## {p['name']}"]
    if len(heads) != 1:
      fail(f"--keep: {topic}.md has {len(heads)} sections headed '## {p['name']}', not one")
    starts.append(heads[0])
  if starts != sorted(starts):
    fail(f"--keep: the sections of {topic}.md are not in the order of {topic}.json's parts")
  if any(lines[s - 1] for s in starts):
    fail(f"--keep: a section of {topic}.md does not follow a blank line")
  ends = [s - 1 for s in starts[1:]] + [len(lines)]          # a blank line before each section
  for p in parts:
    if lacks_commit(p["name"], p["commit"]):
      fail(f"--keep: {topic}.json's part {p['name']} has no commit")
  return [(p, lines[a:b]) for p, a, b in zip(parts, starts, ends) if p["name"] not in replaced]


def merge(topic: str, paths: list[str], keep: str | None = None) -> tuple[dict, str, dict | None]:
  """The topic's JSON, its markdown and its combined view (None for topics without one); with `keep` (a folder of
  topic files), the parts of its TOPIC.json that `paths` do not replace join them."""
  if topic not in TOPICS:
    fail(f"unknown topic {topic!r}; known: {', '.join(TOPICS)}")
  parts = [(p, part_section(p, text)) for p, text in read_parts(paths)] if paths else []
  if keep is not None:
    new = {p["name"] for p, _ in parts}
    replaced = new | {old for old, by in REPLACED_BY.items() if by in new} | twins_replaced(new)
    parts = sorted(parts + kept_parts(keep, topic, replaced), key=lambda p: p[0]["name"])
  if not parts:
    fail(f"no parts for topic {topic}")
  names = [p["name"] for p, _ in parts]
  result = dict(topic=topic, title=TOPICS[topic],
                command=f"python benchmarks/merge_results.py {topic} OUT " + " ".join(names))
  lines = [f"# {topic}: {TOPICS[topic]}", "",
           f"Merged by `python benchmarks/merge_results.py` from the parts below (`bash benchmarks/reproduce_h200.sh "
           f"{topic}` measures them); each part keeps its own command, device, versions and commit (`source:`), and "
           f"`{topic}.json` holds each part's JSON under `parts`.", ""]
  lines += [f"- `{p['name']}` ({p.get('date') or 'no date'}): `{p['command']}`" for p, _ in parts]
  view = VIEWS[topic]([p for p, _ in parts]) if topic in VIEWS else None
  if view:
    result.update(view["fields"])
    lines += ["", *view["markdown"]]
  result["parts"] = [p for p, _ in parts]
  heads = {f"## {n}" for n in names}
  for p, section in parts:
    clash = [ln for ln in section[1:] if ln in heads]
    if clash:
      fail(f"part {p['name']}'s markdown has the line {clash[0]!r}, the heading of a part's section")
    lines += ["", *section]
  return result, "\n".join(lines) + "\n", view


def write(out: str, topic: str, result: dict, markdown: str, view: dict | None) -> list[str]:
  """Write the view's plots (drawn before any file is written), TOPIC.json and TOPIC.md under `out`, each file
  through a temporary one."""
  os.makedirs(out, exist_ok=True)
  written = view["plot"](result, os.path.join(out, topic)) if view and view.get("plot") else []
  for suffix, text in ((".json", json.dumps(result, indent=1) + "\n"), (".md", markdown)):
    path = os.path.join(out, topic + suffix)
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
    written.append(path)
  return written


# ---- topic longctx: the context-length sweep as one table ----

# (part, implementations taken from it or None for all, contexts taken from it or None for all, what its rows'
# impl adds). -w: the 8K-128K sweep with HF; -v: its 256K row with HF; -q: 512K with HF; -o-8layers: 1M with fp8
# KV on 8 of the 32 layers (the layers added to impl from the part's model); -j: the dense baseline (8K ran, out of
# memory from 32K); longctx-fp8prefill-1m-h200: 1M with all 32 layers.
LONGCTX_VIEW = [("longctx-h200-w", None, None, None), ("longctx-h200-v", None, {262144}, None),
                ("longctx-h200-q", None, None, None), ("longctx-h200-o-8layers", None, None, None),
                ("longctx-h200-j", {"dense"}, None, None),
                ("longctx-fp8prefill-1m-h200", None, None, "fp8 KV, float8_e4m3fn attention")]
# The goals of the long-context issue (one H200, Llama-3-8B shape, batch 1, peers in the same part).
GOALS = dict(prefill_over_hf={131072: 0.85, 262144: 0.85, 524288: 0.75}, decode_ms={131072: 9.0, 524288: 22.0},
             overhead_gib=4.0)


def _longctx_goals(rows: list[dict]) -> list[dict]:
  """Each measured lcjax row against the goals; HF from the same part."""
  out = []
  for r in rows:
    if not r["impl"].startswith("lcjax") or not r.get("prefill_s"):
      continue
    h = next((x for x in rows if x["impl"] == "hf" and x["S"] == r["S"] and x["part"] == r["part"]
              and x.get("prefill_s")), None)
    div = lambda k: r[k] / h[k] if h and r.get(k) and h.get(k) else None
    out.append(dict(impl=r["impl"], S=r["S"], part=r["part"], prefill_over_hf=div("prefill_s"),
                    decode_over_hf=div("decode_ms_per_token"), peak_over_hf=div("peak_gib"),
                    decode_ms=r["decode_ms_per_token"], overhead_gib=r["peak_gib"] - r["weights_gib"] - r["kv_gib"],
                    goal_prefill_over_hf=GOALS["prefill_over_hf"].get(r["S"]),
                    goal_decode_ms=GOALS["decode_ms"].get(r["S"]), goal_overhead_gib=GOALS["overhead_gib"]))
  return out


def longctx_view(parts: list[dict]) -> dict:
  """The sweep's rows from LONGCTX_VIEW's parts, as measured (planned GiB: the planner of the part's own run)."""
  if REPO not in sys.path:
    sys.path.insert(0, REPO)
  from tools.benchlib import IMPLIED_OOM, cell, longctx_markdown as markdown   # noqa: E402
  by_name = {p["name"]: p for p in parts}
  missing = [name for name, *_ in LONGCTX_VIEW if name not in by_name]
  if missing:
    fail(f"topic longctx: its table needs the parts {missing} (have {sorted(by_name)})")
  rows = []
  for name, impls, contexts, label in LONGCTX_VIEW:
    part = by_name[name]
    layers = (part.get("model") or {}).get("layers")
    oomed = set()
    for r in sorted(part["rows"], key=lambda r: r["S"]):
      if (impls is not None and r["impl"] not in impls) or (contexts is not None and r["S"] not in contexts):
        continue
      r = dict(r, part=name)
      if r.get("oom") and r["impl"] in oomed and not r.get("skipped"):
        r["skipped"] = IMPLIED_OOM          # the bench's rule, for rows of runs made before it labelled them
      if r.get("oom"):
        oomed.add(r["impl"])
      if layers:
        r["layers"] = layers
        r["impl"] = f"{r['impl']} ({layers} of 32 layers)"
      if label:
        r["impl"] = f"{r['impl']} ({label})"
      if r["impl"] == "dense":
        r.pop("planned_gib", None)        # the planner models lcjax, not the dense baseline's O(S^2) scores
      rows.append(r)
  rows.sort(key=lambda r: (r["impl"], r["S"]))
  goals = _longctx_goals(rows)
  first = by_name[LONGCTX_VIEW[0][0]]
  fields = dict(device=first["device"], versions=first["versions"],
                model=dict(preset="llama3-8b", dtype="bfloat16", weights="random", batch=1, page_size=64),
                rows=rows, goals=goals)
  md = ["## The sweep", "",
        "The rows of the parts named in `part` (lcjax with HF measured in the same part; the dense baseline's from "
        "longctx-h200-j); planned GiB: the memory planner of that part's run. `longctx.json` holds them as `rows`; "
        "`longctx-memory.png` and `longctx-prefill.png` draw them.", "", markdown(rows), "",
        "Against the goals (lcjax / HF from the same part; overhead = peak - weights - KV cache):", "",
        "| impl | S | part | prefill / HF (goal) | decode ms/token (goal) | decode / HF | peak / HF | "
        "overhead GiB (goal) |", "|---|---|---|---|---|---|---|---|"]
  for q in goals:
    md.append(f"| {q['impl']} | {q['S']:,} | {q['part']} | "
              f"{cell(q, 'prefill_over_hf', '{:.2f}')} ({cell(q, 'goal_prefill_over_hf', '{:.2f}')}) | "
              f"{cell(q, 'decode_ms', '{:.2f}')} ({cell(q, 'goal_decode_ms', '{:.0f}')}) | "
              f"{cell(q, 'decode_over_hf', '{:.2f}')} | {cell(q, 'peak_over_hf', '{:.2f}')} | "
              f"{cell(q, 'overhead_gib', '{:.1f}')} ({q['goal_overhead_gib']:.0f}) |")
  return dict(fields=fields, markdown=md, plot=_longctx_plots)


def _longctx_plots(result: dict, stem: str) -> list[str]:
  from lcjax import plot   # noqa: E402  (matplotlib only where the plots are drawn)
  return plot.save_figures(result, stem)


VIEWS = {"longctx": longctx_view}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("topic", help=f"one of {', '.join(TOPICS)}")
  ap.add_argument("out", help="folder for TOPIC.json and TOPIC.md")
  ap.add_argument("parts", nargs="*", help="the parts' .json files, or folders of them")
  ap.add_argument("--keep", action="store_true",
                  help="keep the parts of OUT/TOPIC.json that no PART replaces (their JSON and markdown as committed)")
  args = ap.parse_args(argv)
  if not args.parts and not args.keep:
    fail("no parts given (PART: a part's .json or a folder of them; --keep merges into OUT/TOPIC.json)")
  result, markdown, view = merge(args.topic, args.parts, keep=args.out if args.keep else None)
  for path in write(args.out, args.topic, result, markdown, view):
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
