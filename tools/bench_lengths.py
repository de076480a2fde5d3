"""Length sweep: prefill time of documents and time to first token of questions at the lengths users have,
unaligned beside aligned, each sweep checked for time that grows with length.

  python tools/bench_lengths.py                                               # H200: 8B shape, two variants
  python tools/bench_lengths.py --preset=llama3.1-70b --variants=float8_e4m3fn+fp8w \\
      --documents=129024,131072 --questions= --name=lengths-70b-h200          # H200, the 70B row
  JAX_PLATFORMS=cpu python tools/bench_lengths.py --preset=llama3-8b --layers=1 --documents=1536,2048 \\
      --questions=16,100 --context=2048 --prefill_chunk=1024 --name=lengths-cpu         # CPU smoke run

For each --variants entry (tools/benchlib.variant: a cache dtype with +fp8attn / +fp8w), one engine with random
weights of the preset's shape:
  documents   each --documents length: the programs of its prefill chunks compiled first (Engine.warm_up, nothing
              run), then a fresh random document prefilled and pinned (`Engine.prefill`), wall time.
  questions   a --context-token document pinned; each --questions length compiled first, then --reps questions of
              that length on the context (`generate(q, context=ctx, max_new_tokens=1)`): the median wall time to
              the first token.
  check       a sweep is monotone when for every two lengths n < m, time(n) <= --tolerance * time(m); the rows
              that break it are listed, the result says `monotone: false` and the command exits with status 1
              (after writing the result).
Rows go to --out/--name.{json,md}.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3.1-8b", "model preset (random weights made on the device)")
flags.DEFINE_integer("layers", 0, "keep only this many layers (0: all)")
flags.DEFINE_list("variants", ["float8_e4m3fn+fp8attn+fp8w", "float8_e4m3fn+fp8w"],
                  "cache dtype with +fp8attn (FP8 attention) / +fp8w (fp8 weights) / +cudnnprefill (cuDNN reads the "
                  "cached prefix), one engine each")
flags.DEFINE_list("documents", ["98304", "114688", "126976", "129024", "130048", "131072"], "document lengths")
flags.DEFINE_list("questions", ["16", "100", "520", "1000", "1024", "1100", "1152", "2048", "3000"],
                  "question lengths (1,152: the rows a 1,100-token question computes once its padding is left out)")
flags.DEFINE_integer("context", 131072, "tokens of the pinned context the questions are asked on")
flags.DEFINE_integer("reps", 3, "questions timed per length (the median is reported)")
flags.DEFINE_integer("document_reps", 1, "documents timed per length, each a fresh one (the median is reported)")
flags.DEFINE_integer("max_context", 0, "the engine's max_context at least this many tokens (rounded up to whole "
                     "pages; 0: sized to the longest document, or the context and the longest question, plus one)")
flags.DEFINE_float("tolerance", 1.05, "monotone: time(n) <= tolerance * time(m) for every n < m of a sweep")
flags.DEFINE_integer("prefill_chunk", 16384, "prefill chunk")
flags.DEFINE_integer("page_size", 64, "page size")
flags.DEFINE_string("dtype", "bfloat16", "parameter / activation dtype")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "lengths", "output file stem")


def _stage(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _engine(variant: str, documents: list[int], questions: list[int]):
  from lcjax.config import RunConfig
  from lcjax.engine.engine import Engine
  # A document or question needs room for one token after it; --max_context is the engine's size as given.
  need = max(max(documents, default=0) + 1, FLAGS.context + max(questions) + 1 if questions else 0, FLAGS.max_context)
  ctx = -(-need // FLAGS.page_size) * FLAGS.page_size
  cfg = benchlib.random_model_cfg(FLAGS.preset, ctx, FLAGS.layers)
  # One pinned document at a time; the prefix cache off, so no length reuses another's pages.
  run = RunConfig(dtype=FLAGS.dtype, page_size=FLAGS.page_size, max_context=ctx, max_batch=1,
                  prefill_chunk=FLAGS.prefill_chunk, prefix_cache=False, **benchlib.variant(variant))
  return Engine.random(cfg, run=run, seed=0)


def sweep(variant: str) -> list[dict]:
  import numpy as np
  from lcjax.engine.scheduler import chunk_buckets
  documents = sorted(map(int, FLAGS.documents))
  questions = sorted(map(int, FLAGS.questions))
  eng = _engine(variant, documents, questions)
  V, C = eng.cfg.vocab_size, eng.run.prefill_chunk
  rng = np.random.default_rng(0)
  rows = []
  common = dict(variant=variant, **eng.kernels, attention_dtype=eng.run.attention_dtype,
                cache_dtype=eng.run.resolved_cache_dtype, weight_dtype=eng.weights.name or eng.run.dtype)
  for n in documents:
    _stage(f"{variant}: document of {n:,} tokens")
    t0 = time.perf_counter()
    eng.warm_up(None, context_tokens=n)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(FLAGS.document_reps):
      doc = rng.integers(3, V, n).tolist()
      t0 = time.perf_counter()
      with eng.prefill(doc):
        times.append(time.perf_counter() - t0)
    rows.append(dict(common, kind="document", tokens=n, seconds=statistics.median(times), all_s=times,
                     compile_s=compile_s, max_context=eng.run.max_context, chunks=sorted(chunk_buckets(n, C))))
    print(json.dumps(rows[-1]), flush=True)
  if questions:
    _stage(f"{variant}: a pinned context of {FLAGS.context:,} tokens")
    eng.warm_up(None, context_tokens=FLAGS.context, more_buckets=sorted(
        set().union(*(chunk_buckets(q, C) for q in questions))))
    with eng.prefill(rng.integers(3, V, FLAGS.context).tolist()) as ctx:
      for n in questions:
        _stage(f"{variant}: questions of {n:,} tokens")
        times, ttft = [], []
        for _ in range(FLAGS.reps):
          q = rng.integers(3, V, n).tolist()
          t0 = time.perf_counter()
          res = eng.generate(q, context=ctx, max_new_tokens=1)
          times.append(time.perf_counter() - t0)
          ttft.append(res.stats["time_to_first_token_s"])
        rows.append(dict(common, kind="question", tokens=n, context=FLAGS.context, seconds=statistics.median(times),
                         all_s=times, ttft_s=statistics.median(ttft), chunks=sorted(chunk_buckets(n, C))))
        print(json.dumps(rows[-1]), flush=True)
  del eng
  gc.collect()
  return rows


def checks(rows: list[dict]) -> list[dict]:
  """One monotone check per (variant, kind) sweep."""
  out = []
  for key in sorted({(r["variant"], r["kind"]) for r in rows}):
    pts = [(r["tokens"], r["seconds"]) for r in rows if (r["variant"], r["kind"]) == key]
    bad = benchlib.monotone_violations(pts, FLAGS.tolerance)
    out.append(dict(variant=key[0], kind=key[1], monotone=not bad, tolerance=FLAGS.tolerance, violations=bad))
  return out


def markdown(rows: list[dict], checked: list[dict]) -> str:
  lines = []
  for c in checked:
    sel = sorted((r for r in rows if (r["variant"], r["kind"]) == (c["variant"], c["kind"])),
                 key=lambda r: r["tokens"])
    what = (f"{c['kind']}s (median of {len(sel[0]['all_s'])}, max_context {sel[0]['max_context']:,})"
            if c["kind"] == "document" else
            f"questions on a pinned {sel[0]['context']:,}-token context (median of {FLAGS.reps})")
    lines += [f"**{c['variant']}** ({sel[0]['attention']}, attention {sel[0]['attention_dtype']}), {what}: "
              f"{'monotone' if c['monotone'] else 'NOT MONOTONE'} within {c['tolerance']}x", "",
              "| tokens | " + " | ".join(f"{r['tokens']:,}" for r in sel) + " |",
              "|---|" + "---|" * len(sel),
              "| seconds | " + " | ".join(f"{r['seconds']:.3f}" for r in sel) + " |",
              "| padded chunks | " + " | ".join("+".join(f"{b:,}" for b in r["chunks"]) for r in sel) + " |", ""]
    for v in c["violations"]:
      lines.append(f"- {v['shorter']:,} tokens took {v['shorter_s']:.3f} s, {v['longer']:,} tokens "
                   f"{v['longer_s']:.3f} s")
  return "\n".join(lines).rstrip()


def main(argv):
  del argv
  rows = []
  for variant in FLAGS.variants:
    benchlib.variant(variant)            # refuse a bad entry before any engine is made
  for variant in FLAGS.variants:
    rows += sweep(variant)
    checked = checks(rows)
    table = markdown(rows, checked)
    # After every variant, so that a run stopped later still leaves its results.
    benchlib.write_result(FLAGS.out, FLAGS.name, rows, table, checks=checked,
                          model=dict(preset=FLAGS.preset, layers=FLAGS.layers or None, dtype=FLAGS.dtype,
                                     prefill_chunk=FLAGS.prefill_chunk, page_size=FLAGS.page_size))
  print(table)
  if not all(c["monotone"] for c in checked):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
