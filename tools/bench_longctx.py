"""Long-context benchmark: prefill time, decode time and peak memory against context length, lcjax beside its
baselines, each implementation in its own process (so peak memory is its own), all in one call.

  python tools/bench_longctx.py --preset=llama3-8b --contexts=8192,32768,131072 --impls=lcjax,dense,hf

Rows (one per implementation and context): prefill seconds and effective TFLOP/s, decode ms/token (with
--repeats=N > 1: the median of N runs in the worker's process, every run kept beside it), peak device memory
(lcjax: `memory_stats()["peak_bytes_in_use"]`; hf: `torch.cuda.max_memory_allocated`), the memory planner's
estimate (lcjax rows), and `oom` where the implementation ran out of memory. Contexts run in
increasing order in one process per implementation, so the process-wide peak of a context is its own (each
context needs more than the one before). Writes JSON, a markdown table and PNG plots
(lcjax.plot: memory and prefill time against context).

Implementations:
  lcjax        chunked paged prefill + on-device decode, the `auto` attention backend
  lcjax-fp8kv  the same with a float8_e4m3fn KV cache
  lcjax-fp8attn  FP8 attention (attention_dtype=float8_e4m3fn), bf16 KV cache
  lcjax-fp8    FP8 attention and an fp8 KV cache
  lcjax-int8attn  FP8 attention with int8 Q K^T (attention_dtype=int8_fp8), bf16 KV cache
  lcjax-int8   int8_fp8 attention and an fp8 KV cache
  lcjax-fp8w   fp8 weights (weight_dtype=float8_e4m3fn; random weights drawn in bf16 and quantized), bf16 KV
  lcjax-fp8w-fp8kv  fp8 weights and an fp8 KV cache
  lcjax-fp8w-fp8    fp8 weights, FP8 attention and an fp8 KV cache
  dense        the unoptimised path: one-shot prefill with XLA attention that materialises the scores
  hf           HF transformers LlamaForCausalLM (sdpa), prefill with logits_to_keep=1, DynamicCache decode timed
               after as many untimed warm-up steps
"""
from __future__ import annotations

import gc
import importlib
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lcjax.engine import plan as planlib  # noqa: E402
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3-8b", "model preset (random weights made on the device)")
flags.DEFINE_integer("layers", 0, "use only this many layers (0: all): per-layer validation of big presets")
flags.DEFINE_list("contexts", ["8192", "32768", "131072"], "context lengths (prompt tokens)")
# lcjax's implementations (and dense, its baseline) -> (cache_dtype, attention_dtype[, weight_dtype])
F8 = "float8_e4m3fn"
LCJAX_DTYPES = {"lcjax": ("auto", "auto"), "lcjax-fp8kv": (F8, "auto"),
                "lcjax-fp8attn": ("auto", F8), "lcjax-fp8": (F8, F8),
                "lcjax-int8attn": ("auto", "int8_fp8"), "lcjax-int8": (F8, "int8_fp8"),
                "lcjax-fp8w": ("auto", "auto", F8), "lcjax-fp8w-fp8kv": (F8, "auto", F8),
                "lcjax-fp8w-fp8": (F8, F8, F8),
                "dense": ("auto", "auto")}
IMPLS = (*LCJAX_DTYPES, "hf")
flags.DEFINE_list("impls", ["lcjax", "dense", "hf"], "implementations: " + ", ".join(IMPLS))
flags.DEFINE_integer("decode_steps", 32, "decode steps timed after each prefill")
flags.DEFINE_integer("repeats", 1, "timed runs of each context in one worker, each on a fresh random prompt: the row "
                     "gives their median and keeps every run (prefill_s_runs, decode_ms_runs)")
flags.DEFINE_integer("decode_sync_every", 8, "lcjax decode steps between host checks for EOS (RunConfig field; "
                     "random weights have no EOS, so no step is wasted; the session-4 calls ran with 8)")
flags.DEFINE_integer("prefill_chunk", 16384, "lcjax prefill chunk (16K: peak within weights + KV + 4 GiB on "
                     "the 8B shape at 1.7% of 128K prefill time against 32K chunks on the H200)")
flags.DEFINE_integer("page_size", 64, "lcjax page size")
flags.DEFINE_string("attention", "auto", "lcjax attention backend")
flags.DEFINE_string("dtype", "bfloat16", "parameter / activation dtype")
flags.DEFINE_list("limits", [], "per-implementation longest context, e.g. hf:262144,dense:32768 (longer ones are "
                  "recorded as skipped)")
flags.DEFINE_float("time_budget_s", 540.0, "stop starting new contexts once this much wall time is spent")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "longctx", "output file stem")
flags.DEFINE_string("worker", None, "internal: run one implementation and print ROW lines")
flags.DEFINE_float("deadline", 0.0, "internal: unix time after which a worker starts no new context")

GiB = 1024 ** 3


def _model_cfg():
  # Every run decodes exactly decode_steps tokens; the longest (prompt, decode steps, a page of rounding) sets
  # max_position.
  longest = max(map(int, FLAGS.contexts)) + FLAGS.decode_steps + 1 + FLAGS.page_size
  return benchlib.random_model_cfg(FLAGS.preset, longest, FLAGS.layers)


def run_config(impl: str, S: int, *, page_size: int, decode_steps: int, prefill_chunk: int,
               dtype: str = "bfloat16", attention: str = "auto", sync_every: int = 1):
  """The RunConfig an implementation's row of context S runs with: room for S + decode_steps tokens, one
  sequence, chunks of prefill_chunk (dense: the whole prompt at once), the cache and attention dtypes of
  LCJAX_DTYPES."""
  from lcjax.config import RunConfig
  chunk = S if impl == "dense" else min(prefill_chunk, S)
  ctx = -(-(S + decode_steps + 1) // page_size) * page_size
  cache_dtype, attention_dtype, weight_dtype = (*LCJAX_DTYPES[impl], "auto")[:3]
  return RunConfig(dtype=dtype, cache_dtype=cache_dtype, attention_dtype=attention_dtype, weight_dtype=weight_dtype,
                   page_size=page_size, max_context=ctx, max_batch=1,
                   prefill_chunk=-(-chunk // page_size) * page_size, decode_steps=decode_steps,
                   decode_sync_every=sync_every, attention="dense" if impl == "dense" else attention)


def _limit(impl: str) -> int:
  for item in FLAGS.limits:
    name, _, value = item.partition(":")
    if name == impl:
      return int(value)
  return 1 << 62


def _skip(impl: str, S: int, failed: bool, last) -> bool:
  """Whether context S of `impl` is not run (after an OOM, by --limits or the time budget); if so its row says why
  (after an OOM the row is an implied OOM: a longer context needs more memory)."""
  if not (failed or _too_late(S, last) or S > _limit(impl)):
    return False
  benchlib.emit_row(impl=impl, S=S, oom=failed,
                    skipped=benchlib.IMPLIED_OOM if failed else "limit" if S > _limit(impl) else "time budget")
  return True


def _too_late(S, last):
  """Skip a context whose predicted time (quadratic from the last one) would pass the deadline."""
  if not last:
    return False
  S0, t0 = last
  return time.time() + t0 * (S / S0) ** 2 * 1.2 > FLAGS.deadline


# -- workers ------------------------------------------------------------------------------------------------

def worker_jax(impl: str):
  import jax
  import numpy as np
  from lcjax.engine.engine import Engine
  cfg = _model_cfg()
  dev = jax.local_devices()[0]
  rng = np.random.default_rng(0)
  last = None
  failed = False
  for S in sorted(map(int, FLAGS.contexts)):
    if _skip(impl, S, failed, last):
      continue
    run = run_config(impl, S, page_size=FLAGS.page_size, decode_steps=FLAGS.decode_steps,
                     prefill_chunk=FLAGS.prefill_chunk, dtype=FLAGS.dtype, attention=FLAGS.attention,
                     sync_every=FLAGS.decode_sync_every)
    plan = planlib.plan(cfg, run)
    # The planner models lcjax's paged, chunked engine, not the dense baseline's O(S^2) scores.
    planned = None if impl == "dense" else plan.total / GiB
    eng = None
    try:
      t0 = time.time()
      eng = Engine.random(cfg, run=run, seed=0)
      resident = benchlib.memory_stat(dev, "bytes_in_use")    # weights + cache pools, as allocated
      # Warm-up: the programs of an S-token prompt compiled (its first chunk, the chunks that read a prefix, the
      # first token, the decode loop), then one chunk run.
      eng.warm_up(S)
      eng.generate(rng.integers(0, cfg.vocab_size, run.prefill_chunk).tolist(), max_new_tokens=2)
      compile_s = time.time() - t0
      # Compilation (autotuning) and one chunk's activations. Process-wide and never reset: in a sweep it holds
      # at least the previous (shorter) context's peak, so it tells apart warm-up and run only for a first context.
      warmup_peak = benchlib.memory_stat(dev, "peak_bytes_in_use")
      runs, compiled = [], 0.0
      for _ in range(FLAGS.repeats):
        st = eng.generate(rng.integers(0, cfg.vocab_size, S).tolist(), max_new_tokens=FLAGS.decode_steps + 1).stats
        runs.append((st["prefill_s"], st["decode_ms_per_token"]))
        compiled = max(compiled, st["compile_s"])
      peak = benchlib.memory_stat(dev, "peak_bytes_in_use")
      note = benchlib.compilation_note(compiled)
      benchlib.emit_row(impl=impl, S=S, **_timings(cfg, S, runs), peak_gib=peak / GiB if peak else None,
                        planned_gib=planned, weights_gib=plan.weights / GiB, kv_gib=plan.kv_cache / GiB,
                        **eng.kernels, weight_dtype=st["weight_dtype"],
                        prefill_chunk=run.prefill_chunk, warmup_s=compile_s,
                        resident_gib=resident and resident / GiB, warmup_peak_gib=warmup_peak and warmup_peak / GiB,
                        timed_compile_s=compiled, **({"note": note} if note else {}), oom=False)
      last = (S, sum(t for t, _ in runs))
    except Exception as e:  # noqa: BLE001 - a benchmark records every failure as a row
      failed = benchlib.is_oom(e)
      benchlib.emit_row(impl=impl, S=S, oom=failed, error=repr(e)[:400],
                        planned_gib=planned)
    finally:
      del eng
      gc.collect()


def worker_hf():
  import torch
  import transformers
  cfg = _model_cfg()
  hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"},
                                    attn_implementation="sdpa")
  with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
  torch.cuda.synchronize()
  last = None
  failed = False
  for S in sorted(map(int, FLAGS.contexts)):
    if _skip("hf", S, failed, last):
      continue
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
      runs = []
      for _ in range(FLAGS.repeats):
        runs.append(_hf_run(model, cfg, S))
        gc.collect()
      benchlib.emit_row(impl="hf", S=S, **_timings(cfg, S, runs), peak_gib=torch.cuda.max_memory_allocated() / GiB,
                        oom=False)
      last = (S, sum(t for t, _ in runs))
    except Exception as e:  # noqa: BLE001
      failed = benchlib.is_oom(e)
      benchlib.emit_row(impl="hf", S=S, oom=failed, error=repr(e)[:400])


def _hf_run(model, cfg, S: int) -> tuple[float, float]:
  """One prefill of a fresh random S-token prompt (logits of the last token only), FLAGS.decode_steps untimed
  greedy steps on its DynamicCache, then FLAGS.decode_steps timed ones: (prefill seconds, decode ms/token). The
  untimed steps do not make a process's first run at a context as fast as its later ones (131,072 tokens, one
  H200: 108.4 ms/token, then 37.4 and 27.1; benchmarks/NOTES-longctx.md): --repeats shows the spread."""
  import torch
  ids = torch.randint(0, cfg.vocab_size, (1, S), device="cuda")
  with torch.inference_mode():
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    tp = time.perf_counter() - t
    pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    del out
    for _ in range(2):                    # warm-up, then timed
      torch.cuda.synchronize()
      t = time.perf_counter()
      for _ in range(FLAGS.decode_steps):
        o = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
        pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
      torch.cuda.synchronize()
    return tp, 1e3 * (time.perf_counter() - t) / FLAGS.decode_steps


def _timings(cfg, S: int, runs: list[tuple[float, float]]) -> dict:
  """A row's time fields from (prefill s, decode ms/token) runs: their medians, and every run when there are
  several."""
  tp = statistics.median(t for t, _ in runs)
  row = dict(prefill_s=tp, prefill_tok_s=S / tp, prefill_tflops=planlib.prefill_flops(cfg, S) / tp / 1e12,
             decode_ms_per_token=statistics.median(d for _, d in runs))
  if len(runs) > 1:
    row.update(prefill_s_runs=[t for t, _ in runs], decode_ms_runs=[d for _, d in runs])
  return row


# -- orchestration ------------------------------------------------------------------------------------------

def orchestrate():
  importlib.import_module("lcjax.plot")   # needs matplotlib: refuse before any worker runs, not after
  start = time.time()
  os.makedirs(FLAGS.out, exist_ok=True)
  rows = []
  for impl in FLAGS.impls:
    if impl not in IMPLS:
      raise app.UsageError(f"unknown impl {impl!r}; choose from {', '.join(IMPLS)}")
    remaining = FLAGS.time_budget_s - (time.time() - start)
    argv = [sys.executable, os.path.abspath(__file__), f"--worker={impl}", f"--deadline={time.time() + remaining}"]
    argv += [f"--{k}={getattr(FLAGS, k)}" for k in ("preset", "layers", "decode_steps", "repeats", "decode_sync_every",
                                                      "prefill_chunk", "page_size", "attention", "dtype")]
    argv += ["--contexts=" + ",".join(FLAGS.contexts), "--limits=" + ",".join(FLAGS.limits)]
    print(f"== {impl}: {' '.join(argv[2:])}", flush=True)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    got, status = benchlib.run_worker(argv, impl, env=env)
    rows += got
    seen = {r["S"] for r in got}
    for S in map(int, FLAGS.contexts):
      if S not in seen:   # the worker died (e.g. killed by an OOM outside Python)
        rows.append(dict(impl=impl, S=S, oom=None, error=f"worker exited with {status}"))
    table = write_results(rows)   # after every implementation, so a run stopped later still leaves results
  print(table)


def write_results(rows):
  rows = sorted(rows, key=lambda r: (r["impl"], r["S"]))
  table = benchlib.longctx_markdown(rows)
  result = benchlib.write_result(
      FLAGS.out, FLAGS.name, rows, table,
      model=dict(preset=FLAGS.preset, layers=FLAGS.layers or None, dtype=FLAGS.dtype, decode_steps=FLAGS.decode_steps,
                 repeats=FLAGS.repeats,
                 decode_sync_every=FLAGS.decode_sync_every, prefill_chunk=FLAGS.prefill_chunk,
                 page_size=FLAGS.page_size, attention=FLAGS.attention))
  from lcjax import plot
  plot.save_figures(result, os.path.join(FLAGS.out, FLAGS.name))
  return table


def main(argv):
  del argv
  if FLAGS.repeats < 1:
    raise app.UsageError(f"--repeats={FLAGS.repeats}: needs at least one timed run")
  if FLAGS.worker == "hf":
    worker_hf()
  elif FLAGS.worker:
    worker_jax(FLAGS.worker)
  else:
    orchestrate()


if __name__ == "__main__":
  app.run(main)
