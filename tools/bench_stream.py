"""Streaming benchmark: the decode cost per token of `decode_steps` tokens per device call, to choose
RunConfig.stream_decode_steps (1: every token streamed as soon as it is sampled; larger: tokens arrive in bursts
of that many, with fewer device calls and host syncs).

  python tools/bench_stream.py --preset=llama3-8b --contexts=1024,32768,131072          # H200
  python tools/bench_stream.py --checkpoint=bundled --contexts=512 --tokens=64           # CPU, SmolLM2

For each context S, one engine (random weights for a preset; real ones with --checkpoint) prefills a document of
S random token ids once as a pinned Context; then for each --steps value k, a --question-token question on it
generates --tokens greedy tokens with `generate(..., decode_steps=k)`, first once untimed (compiles the loop of k
steps), then --repeats times timed. Row figures (medians over the repeats):
  wall_ms_per_token    (wall time of the call - its prefill) / (tokens - 1): what a caller waits per token
  calls_ms_per_token   the engine's own decode_ms_per_token (the decode calls only, host bookkeeping excluded)
  stream_ms_per_token  with a tokenizer: wall_ms_per_token of generate_stream, text decoding included
  vs_largest           wall_ms_per_token over that of the largest k at the same S
Rows go to --out/--name.{json,md}.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3-8b", "model preset (random weights made on the device, no EOS)")
flags.DEFINE_string("checkpoint", None, "a checkpoint instead of a preset ('bundled': the bundled SmolLM2)")
flags.DEFINE_list("contexts", ["1024", "32768", "131072"], "context lengths (document tokens)")
flags.DEFINE_list("steps", ["1", "8", "64"], "decode tokens per device call to compare (64: RunConfig's default)")
flags.DEFINE_integer("tokens", 256, "tokens generated per timed call")
flags.DEFINE_integer("question", 16, "question tokens after the document")
flags.DEFINE_integer("repeats", 3, "timed calls per (context, steps)")
flags.DEFINE_integer("batch", 1, "questions decoded together")
flags.DEFINE_string("dtype", "auto", "parameter / activation dtype (auto: bfloat16 on a GPU)")
flags.DEFINE_string("cache_dtype", "auto", "KV cache dtype")
flags.DEFINE_string("attention", "auto", "attention backend")
flags.DEFINE_integer("prefill_chunk", 16384, "prefill chunk")
flags.DEFINE_integer("page_size", 64, "page size")
flags.DEFINE_float("time_budget_s", 540.0, "start no new context once this much wall time is spent")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "stream", "output file stem")


def _engine(S: int, steps: list[int]):
  from lcjax.config import RunConfig, preset
  from lcjax.engine.engine import Engine
  Z = FLAGS.page_size
  need = FLAGS.question + FLAGS.tokens + 1
  ctx = -(-(S + need) // Z) * Z
  # The pinned document's pages, and for each question its own pages after them plus a copy of the last one.
  pages = -(-S // Z) + FLAGS.batch * (-(-need // Z) + 2) + 1
  run = RunConfig(dtype=FLAGS.dtype, cache_dtype=FLAGS.cache_dtype, attention=FLAGS.attention, page_size=Z,
                  max_context=ctx, num_pages=pages, max_batch=FLAGS.batch,
                  prefill_chunk=min(FLAGS.prefill_chunk, -(-S // Z) * Z), decode_steps=max(steps))
  if FLAGS.checkpoint:
    from lcjax.checkpoint.bundled import bundled_checkpoint
    path = bundled_checkpoint() if FLAGS.checkpoint == "bundled" else FLAGS.checkpoint
    return Engine.load(path, run=run.replace(allow_beyond_trained_context=True))
  cfg = preset(FLAGS.preset)
  # Random weights: no token is special, so every call generates exactly --tokens tokens.
  cfg = dataclasses.replace(cfg, eos_ids=(), max_position=max(ctx, cfg.max_position))
  return Engine.random(cfg, run=run, seed=0)


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def bench(S: int, steps: list[int]) -> list[dict]:
  import numpy as np
  eng = _engine(S, steps)
  rng = np.random.default_rng(S)
  V = eng.cfg.vocab_size
  doc = rng.integers(3, V, S).tolist()
  qs = [rng.integers(3, V, FLAGS.question).tolist() for _ in range(FLAGS.batch)]
  T = FLAGS.tokens
  rows = []
  with eng, eng.prefill(doc) as ctx:
    for k in steps:
      eng.generate(qs, max_new_tokens=min(T, k + 2), context=ctx, decode_steps=k)        # compile k steps a call
      wall, calls, stream = [], [], []
      for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        res = eng.generate(qs, max_new_tokens=T, context=ctx, decode_steps=k)
        dt = time.perf_counter() - t0
        n = min(len(r.token_ids) for r in res)
        wall.append(1e3 * (dt - max(r.stats["prefill_s"] for r in res)) / max(n - 1, 1))
        calls.append(statistics.mean(r.stats["decode_ms_per_token"] for r in res))
        if eng.tokenizer is not None:
          t0 = time.perf_counter()
          for _ in eng.generate_stream(qs, max_new_tokens=T, context=ctx, decode_steps=k):
            pass
          dt = time.perf_counter() - t0
          res = eng.last_results
          n = min(len(r.token_ids) for r in res)
          stream.append(1e3 * (dt - max(r.stats["prefill_s"] for r in res)) / max(n - 1, 1))
      row = dict(S=S, steps=k, tokens=n, batch=FLAGS.batch, **eng.kernels, dtype=eng.run.dtype,
                 cache_dtype=eng.run.resolved_cache_dtype, wall_ms_per_token=statistics.median(wall),
                 calls_ms_per_token=statistics.median(calls),
                 stream_ms_per_token=statistics.median(stream) if stream else None)
      print(row, flush=True)
      rows.append(row)
  largest = rows[-1]["wall_ms_per_token"]
  for r in rows:
    r["vs_largest"] = r["wall_ms_per_token"] / largest
  return rows


def _table(rows: list[dict]) -> str:
  lines = ["| S | steps per call | ms/token (wall) | ms/token (decode calls) | ms/token (stream) | vs largest |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    if "skipped" in r:
      lines.append(f"| {r['S']} | skipped: {r['skipped']} | | | | |")
      continue
    stream = "-" if r["stream_ms_per_token"] is None else f"{r['stream_ms_per_token']:.2f}"
    lines.append(f"| {r['S']} | {r['steps']} | {r['wall_ms_per_token']:.2f} | {r['calls_ms_per_token']:.2f} | "
                 f"{stream} | {r['vs_largest']:.3f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  steps = sorted({int(s) for s in FLAGS.steps})
  if steps[0] < 1 or FLAGS.tokens < 2 or FLAGS.repeats < 1:
    raise SystemExit(f"--steps={','.join(FLAGS.steps)} must be >= 1, --tokens={FLAGS.tokens} >= 2 and "
                     f"--repeats={FLAGS.repeats} >= 1")
  t_start = time.time()
  rows = []
  for S in sorted(map(int, FLAGS.contexts)):
    if time.time() - t_start > FLAGS.time_budget_s:
      rows.append(dict(S=S, skipped="time budget"))
      continue
    rows += bench(S, steps)
  model = dict(checkpoint=FLAGS.checkpoint) if FLAGS.checkpoint else dict(preset=FLAGS.preset)
  note = (f"{FLAGS.tokens} greedy tokens per call after a {FLAGS.question}-token question on a pinned context of S "
          f"tokens, batch {FLAGS.batch}, median of {FLAGS.repeats} calls.")
  benchlib.write_result(FLAGS.out, FLAGS.name, rows, _table(rows), note=note, model=model, tokens=FLAGS.tokens,
                        question=FLAGS.question, batch=FLAGS.batch)
  print(_table(rows))


if __name__ == "__main__":
  app.run(main)
