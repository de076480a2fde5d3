"""Where the device time of a decode call (or a prefill) goes: kernel time by name from a jax.profiler trace.

  python tools/profile_step.py --preset=llama3-8b --context=32768 --steps=16 --xla_flags="..."

Prefills `context` random tokens, times one untraced decode call of `steps` tokens (wall ms/token), then traces a
second one (with --draft_tokens=k, a speculative decode call: figures per model call, each a verify step of k + 1
rows) and sums the device time of every kernel by name (and by op on the "XLA Ops" line when the trace has
one). Prints the top kernels with their share of the traced time and the floor of a token: the bytes it must
read (weights + the KV of the context) at --bandwidth. With --phase=prefill it traces the whole prefill of the
prompt instead (all its chunks; the report's "per token" figures are then per prefill), and with --phase=question
the prefill of a --question-token question after the context, which the prefix cache holds (a question on a
cached document: the chunk's attention over the cached prefix; figures per question).
`--xla_flags` is added to XLA_FLAGS before JAX starts (A/B a compiler option); `--dump_hlo` writes the optimized
HLO of every compiled step under <out>/hlo.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import shutil
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3-8b", "model preset (random weights made on the device)")
flags.DEFINE_integer("layers", 0, "use only this many layers (0: all)")
flags.DEFINE_integer("context", 32768, "tokens prefilled before the traced call")
flags.DEFINE_integer("steps", 16, "decode steps per call")
flags.DEFINE_integer("decode_sync_every", 8, "decode steps between host checks for EOS (random weights: no EOS, so "
                     "no step is wasted; the session-4 profiles ran with 8)")
flags.DEFINE_enum("phase", "decode", ["decode", "prefill", "question"], "what to trace")
flags.DEFINE_integer("question", 1024, "--phase=question: tokens of the question after the cached context",
                     lower_bound=1)
flags.DEFINE_string("cache_dtype", "auto", "KV cache dtype")
flags.DEFINE_string("attention", "auto", "attention backend")
flags.DEFINE_string("attention_dtype", "auto", "auto | float8_e4m3fn | int8_fp8 (RunConfig.attention_dtype)")
flags.DEFINE_string("weight_dtype", "auto", "auto | bfloat16 | float8_e4m3fn (RunConfig.weight_dtype)")
flags.DEFINE_string("linear_kernel", "auto",
                    "auto | xla | mosaic | pallas | pallas-interpret (RunConfig.linear_kernel)")
flags.DEFINE_string("page_write", "auto", "auto | xla | pallas | mosaic | pallas-interpret (RunConfig.page_write)")
flags.DEFINE_string("decode_kernel", "auto", "auto | mosaic | triton (RunConfig.decode_kernel)")
flags.DEFINE_string("prefill_kernel", "auto", "auto | cudnn | mosaic (RunConfig.prefill_kernel)")
flags.DEFINE_integer("draft_tokens", 0, "decode: k > 0 traces prompt-lookup speculation (RunConfig.draft=\"prompt\") "
                     "with k drafts a step; figures are then per model call (a verify step of k + 1 rows)")
flags.DEFINE_integer("draft_ngram", 3, "decode with --draft_tokens: RunConfig.draft_ngram")
flags.DEFINE_integer("prefill_chunk", 32768, "prefill chunk")
flags.DEFINE_integer("page_size", 64, "page size")
flags.DEFINE_integer("top", 25, "kernels printed (the JSON keeps every kernel)")
flags.DEFINE_float("bandwidth", 4.3e12, "bytes/s for the decode floor")
flags.DEFINE_string("xla_flags", "", "extra XLA_FLAGS for this run")
flags.DEFINE_bool("dump_hlo", False, "dump optimized HLO under <out>/hlo")
flags.DEFINE_string("out", os.environ.get("OUT", "/tmp/profile"), "output folder")
flags.DEFINE_string("name", "profile", "output file stem")


def kernel_times(trace_dir: str) -> dict[str, dict[str, list[float]]]:
  """{line name: {event name: [total ns, count]}} over the device planes of the newest trace in trace_dir."""
  from jax.profiler import ProfileData
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  lines: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
  for plane in ProfileData.from_file(paths[-1]).planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      key = "XLA Ops" if "XLA Ops" in line.name else ("streams" if "Stream" in line.name else line.name)
      for ev in line.events:
        acc = lines[key][ev.name]
        acc[0] += ev.duration_ns
        acc[1] += 1
  return lines


def main(argv):
  del argv
  if FLAGS.xla_flags or FLAGS.dump_hlo:
    extra = FLAGS.xla_flags + (f" --xla_dump_to={FLAGS.out}/hlo --xla_dump_hlo_as_text" if FLAGS.dump_hlo else "")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + extra).strip()
  import jax
  import numpy as np
  from lcjax.config import RunConfig, preset
  from lcjax.engine import plan as planlib
  from lcjax.engine.engine import Engine
  from tools import benchlib
  cfg = preset(FLAGS.preset)
  page = FLAGS.page_size
  ctx = -(-(FLAGS.context + 4 * FLAGS.steps + 2 + (FLAGS.question if FLAGS.phase == "question" else 0)) // page) * page
  cfg = dataclasses.replace(cfg, eos_ids=(), n_layers=FLAGS.layers or cfg.n_layers,
                            max_position=max(cfg.max_position, ctx))
  run = RunConfig(page_size=page, max_context=ctx, max_batch=1, decode_steps=FLAGS.steps,
                  decode_sync_every=FLAGS.decode_sync_every,
                  prefill_chunk=min(FLAGS.prefill_chunk, -(-FLAGS.context // page) * page),
                  cache_dtype=FLAGS.cache_dtype, attention=FLAGS.attention, attention_dtype=FLAGS.attention_dtype,
                  weight_dtype=FLAGS.weight_dtype, linear_kernel=FLAGS.linear_kernel, page_write=FLAGS.page_write,
                  decode_kernel=FLAGS.decode_kernel, prefill_kernel=FLAGS.prefill_kernel,
                  draft="prompt" if FLAGS.draft_tokens else "off", draft_tokens=FLAGS.draft_tokens or 4,
                  draft_ngram=FLAGS.draft_ngram,
                  # A traced prefill repeats the warm-up's prompt: with the prefix cache it would prefill nothing.
                  prefix_cache=FLAGS.phase != "prefill")
  eng = Engine.random(cfg, run=run, seed=0)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.vocab_size, FLAGS.context).tolist()
  os.makedirs(FLAGS.out, exist_ok=True)
  trace_dir = tempfile.mkdtemp(prefix="trace-", dir=FLAGS.out)
  if FLAGS.phase == "decode":
    eng.generate(prompt, max_new_tokens=FLAGS.steps + 1)                    # compile + warm
    res = eng.generate(prompt, max_new_tokens=FLAGS.steps + 1)
    wall_ms = res.stats["decode_ms_per_token"]
    # Trace a decode call only: prefill untraced, then the call under the profiler.
    r = eng._make_requests([prompt], 2 * FLAGS.steps + 1, None)[0]
    if not eng.scheduler.admit(r):
      raise RuntimeError(f"the page pool cannot hold {len(prompt)} + {2 * FLAGS.steps + 1} tokens")
    try:
      eng.scheduler.prefill(r)
      eng.scheduler.decode_call([r])                                                  # same shapes: no compile inside
      calls = r.decode_calls
      with jax.profiler.trace(trace_dir):
        t = time.perf_counter()
        eng.scheduler.decode_call([r])
        traced_s = time.perf_counter() - t
    finally:
      eng.scheduler.release(r)
    # Per token; with speculation per model call (what one verify step costs), however many tokens it kept.
    per = r.decode_calls - calls if FLAGS.draft_tokens else FLAGS.steps
    traced_ms = 1e3 * traced_s / per
  else:
    # A prefill traces its warm-up's prompt again (the prefix cache is off). A question is the third of three of one
    # length after the same context: the first prefills and caches the context, the second compiles the question's
    # prefill over the cached pages.
    if FLAGS.phase == "question":
      qa, qb, qc = (rng.integers(0, cfg.vocab_size, FLAGS.question).tolist() for _ in range(3))
      warm, traced = [prompt + qa, prompt + qb], prompt + qc
    else:
      warm, traced = [prompt], prompt
    for tokens in warm:
      eng.generate(tokens, max_new_tokens=1)
    with jax.profiler.trace(trace_dir):
      t = time.perf_counter()
      res = eng.generate(traced, max_new_tokens=1)
      traced_ms = 1e3 * (time.perf_counter() - t)
    wall_ms = 1e3 * res.stats["prefill_s"]
    cached = res.stats["cached_tokens"]
    if FLAGS.phase == "question" and cached < FLAGS.context - page:
      raise RuntimeError(f"the traced question reused {cached} cached tokens of the {FLAGS.context}-token context")
    if FLAGS.phase == "prefill" and cached:
      raise RuntimeError(f"the traced prefill reused {cached} cached tokens: it must prefill all")
    per = 1
  p = planlib.plan(cfg, run)
  kv_bytes = p.kv_cache * FLAGS.context / max(p.tokens_capacity, 1)
  floor_ms = 1e3 * (p.weights + kv_bytes) / FLAGS.bandwidth
  report = dict(preset=FLAGS.preset, layers=cfg.n_layers, context=FLAGS.context, phase=FLAGS.phase,
                steps=FLAGS.steps, draft_tokens=FLAGS.draft_tokens,
                per=FLAGS.phase if FLAGS.phase != "decode" else "model call" if FLAGS.draft_tokens else "token",
                question=FLAGS.question if FLAGS.phase == "question" else None,
                cached_tokens=res.stats.get("cached_tokens"),
                decode_sync_every=FLAGS.decode_sync_every, xla_flags=FLAGS.xla_flags,
                **eng.kernels, weight_dtype=res.stats["weight_dtype"], cache_dtype=res.stats["cache_dtype"],
                source=benchlib.source_revision(),
                wall_ms_per_token=wall_ms, traced_ms_per_token=traced_ms,
                floor_ms_per_token=floor_ms if FLAGS.phase == "decode" else None, lines={})
  for line, evs in kernel_times(trace_dir).items():
    report["lines"][line] = benchlib.line_report(evs, per, cfg.n_layers)
  with open(os.path.join(FLAGS.out, FLAGS.name + ".json"), "w") as f:
    json.dump(report, f, indent=1)
  if FLAGS.dump_hlo:      # keep the optimized HLO of the steps only
    for path in glob.glob(os.path.join(FLAGS.out, "hlo", "*")):
      name = os.path.basename(path)
      if not (("_decode" in name or "_prefill" in name) and name.endswith("after_optimizations.txt")):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  what = f"question of {FLAGS.question:,} after" if FLAGS.phase == "question" else f"{FLAGS.phase} at"
  print(f"{what} {FLAGS.context:,} ({eng.attention.name}, {res.stats['linear']}, "
        f"{res.stats['cache_dtype']} KV written by {res.stats['page_write']}, "
        f"xla_flags={FLAGS.xla_flags!r}): wall {wall_ms:.2f} ms/token, "
        f"traced {traced_ms:.2f} ms per {report['per']}"
        + (f", floor {floor_ms:.2f}" if FLAGS.phase == "decode" else ""))
  for line, rep in report["lines"].items():
    print(f"  [{line}] {rep['total_ms_per_token']:.3f} ms/token of device time in {rep['events']} kinds, "
          f"{rep['calls_per_token']:.1f} kernel calls a token ({rep['calls_per_layer']:.1f} a layer)")
    for e in rep["kernels"][:FLAGS.top]:
      print(f"    {e['ms_per_token']:8.3f} ms {e['share']:6.1%} x{e['calls_per_token']:6.1f}  {e['name'][:110]}")


if __name__ == "__main__":
  app.run(main)
