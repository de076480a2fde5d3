"""Context-cache benchmark: time to first token of a question on a cached context against a cold prefill, and
the cost of moving a context to host memory or disk and back, beside the bandwidth floors measured in the same
call.

  python tools/bench_context.py --preset=llama3-8b --contexts=131072                       # H200
  python tools/bench_context.py --contexts=524288 --cache_dtype=float8_e4m3fn              # H200, fp8 KV
  python tools/bench_context.py --checkpoint=bundled --contexts=3072 --dtype=float32       # CPU, SmolLM2

For each context length S, one engine (random weights for a preset; real ones with --checkpoint):
  prefill     the document of S tokens, pinned as a Context (its programs compiled first: Engine.warm_up and a
              short prompt of the same chunk shapes; `prefill_compile_s`, the compilation the timed prefill did,
              is 0 when they covered it). `cold_ttft_s` = prefill + the question's time to first token: what a call
              without a cache pays.
  ttft        a --question-token question on the context (`generate(q, context=ctx)`), and another through the
              automatic prefix cache (`generate(doc + q)`, no context); each timed after a first question of the
              same length compiled its shapes.
  host        ctx.offload() (device -> pinned host memory, or numpy where JAX offers none: `host_memory`) and,
              after the prefix cache is emptied so every page is written, ctx.restore() (host -> device); beside
              them `h2d_floor_gbs`, a plain jax.device_put of the same host blocks to the device.
  disk        ctx.save() (fsync'd, then dropped from the OS page cache), a cold sequential read of the same file
              (`disk_floor_gbs`), dropped again, then Engine.load_context with the prefix cache emptied.
  check       the greedy answer to the question after each restore equals the one on the first prefill
              (`answers_match`); with --check_cold, also a cold generate(doc + q) on an emptied cache.
Rows go to --out/--name.{json,md}.
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3-8b", "model preset (random weights made on the device)")
flags.DEFINE_string("checkpoint", None, "an lcjax checkpoint instead of a preset ('bundled': the bundled SmolLM2)")
flags.DEFINE_list("contexts", ["131072"], "context lengths (document tokens)")
flags.DEFINE_integer("question", 1024, "question tokens")
flags.DEFINE_integer("answer", 8, "greedy answer tokens compared after each restore")
flags.DEFINE_string("dtype", "bfloat16", "parameter / activation dtype")
flags.DEFINE_string("cache_dtype", "auto", "KV cache dtype")
flags.DEFINE_integer("prefill_chunk", 16384, "prefill chunk")
flags.DEFINE_integer("page_size", 64, "page size")
flags.DEFINE_bool("check_cold", True, "also time a cold generate(doc + question) and compare its answer")
flags.DEFINE_string("tmp", None, "folder for the saved context (default: the system's temporary folder)")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "context", "output file stem")

GB = 1e9


def _drop_from_page_cache(path: str) -> None:
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def _disk_read_floor(path: str, block: int = 256 << 20) -> float:
  """Seconds to read a file sequentially into one reused buffer (cold: dropped from the page cache first)."""
  import numpy as np
  buf = np.empty(block, np.uint8)
  t0 = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    while f.readinto(buf):
      pass
  return time.perf_counter() - t0


def _h2d_floor(eng, blocks) -> float:
  """Seconds to copy the offloaded blocks to the device with nothing else (the floor of a restore)."""
  import jax
  from lcjax.engine.context import _mover
  dst = _mover(eng).replicated
  t0 = time.perf_counter()
  out = [jax.device_put(x, dst) for _, _, parts in blocks for x in parts]
  jax.block_until_ready(out)
  return time.perf_counter() - t0


def _engine(S: int):
  from lcjax.config import RunConfig
  from lcjax.engine.engine import Engine
  ctx = -(-(S + 2 * FLAGS.question + 64) // FLAGS.page_size) * FLAGS.page_size
  run = RunConfig(dtype=FLAGS.dtype, cache_dtype=FLAGS.cache_dtype, page_size=FLAGS.page_size, max_context=ctx,
                  max_batch=1, prefill_chunk=min(FLAGS.prefill_chunk, -(-S // FLAGS.page_size) * FLAGS.page_size),
                  decode_steps=FLAGS.answer)
  # The pinned document, a question's pages beside it, and a whole second copy for generate(doc + q).
  run = run.replace(num_pages=2 * (ctx // FLAGS.page_size) + 2)
  if FLAGS.checkpoint:
    from lcjax.checkpoint.bundled import bundled_checkpoint
    path = bundled_checkpoint() if FLAGS.checkpoint == "bundled" else FLAGS.checkpoint
    return Engine.load(path, run=run)
  return Engine.random(benchlib.random_model_cfg(FLAGS.preset, ctx), run=run, seed=0)


STAGE = {"now": "start"}


def _stage(name: str) -> None:
  STAGE["now"] = name
  print(f"[{time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)


def bench(S: int) -> dict:
  import jax
  import numpy as np
  from lcjax.engine.compile_cache import compile_seconds
  eng = _engine(S)
  V = eng.cfg.vocab_size
  rng = np.random.default_rng(S)
  doc = rng.integers(3, V, S).tolist()
  qs = [rng.integers(3, V, FLAGS.question).tolist() for _ in range(4)]
  row = dict(S=S, question=FLAGS.question, **eng.kernels, cache_dtype=eng.run.resolved_cache_dtype,
             dtype=eng.run.dtype)

  def answer(q, **kw):
    t0 = time.perf_counter()
    res = eng.generate(q, max_new_tokens=FLAGS.answer, **kw)
    return res, time.perf_counter() - t0

  def ttft(q, **kw):
    t0 = time.perf_counter()
    res = eng.generate(q, max_new_tokens=1, **kw)
    return time.perf_counter() - t0, res

  _stage("compile")
  # Compile the programs of the document's prefill chunks (Engine.warm_up: its first chunk, its full chunks that
  # read a prefix, its last), then run a short prompt of the first and last chunks' shapes as a context.
  C = eng.run.prefill_chunk
  warm = rng.integers(3, V, min(S, C + (S % C or C))).tolist()
  t0 = time.perf_counter()
  eng.warm_up(None, context_tokens=S)
  with eng.prefill(warm) as w:              # and the moves: gather / scatter compile once per block size
    answer(qs[3], context=w)
    w.offload()
    eng.prefix_cache.clear()
    w.restore()
  eng.prefix_cache.clear()
  row["compile_s"] = time.perf_counter() - t0

  _stage("prefill")
  t0, c0 = time.perf_counter(), compile_seconds()
  ctx = eng.prefill(doc)
  row["prefill_s"] = time.perf_counter() - t0
  row["prefill_compile_s"] = compile_seconds() - c0           # 0: the warm-up made every program it runs
  _stage("questions")
  first, _ = answer(qs[0], context=ctx)                       # compiles the question's shapes at this offset
  row["ttft_s"], timed = ttft(qs[1], context=ctx)
  row["ttft_compile_s"] = timed.stats["compile_s"]
  row["cold_ttft_s"] = row["prefill_s"] + row["ttft_s"]
  ttft(doc + qs[3])                                           # compiles the automatic path's shapes
  row["auto_ttft_s"], auto = ttft(doc + qs[2])
  row["auto_cached_tokens"] = auto.stats["cached_tokens"]
  row["speedup"] = row["cold_ttft_s"] / row["ttft_s"]
  want = first.token_ids
  kv_bytes = 2 * eng.cfg.n_layers * len(ctx.pages()) * eng.run.page_size * eng.cfg.n_kv_heads * eng.cfg.head_dim \
      * np.dtype(eng.cache.k.dtype).itemsize
  row["kv_gb"] = kv_bytes / GB

  _stage("host")
  # Host memory.
  row["offload_s"] = ctx.offload()
  row["offload_gbs"] = kv_bytes / row["offload_s"] / GB
  row["host_memory"] = ctx.stats["host_memory"]
  row["h2d_floor_gbs"] = kv_bytes / _h2d_floor(eng, ctx._host) / GB
  eng.prefix_cache.clear()
  row["restore_host_s"] = ctx.restore()
  row["restore_host_gbs"] = kv_bytes / row["restore_host_s"] / GB
  row["restore_host_vs_floor"] = row["restore_host_gbs"] / row["h2d_floor_gbs"]
  row["restore_host_vs_recompute"] = row["prefill_s"] / row["restore_host_s"]
  host_answer, _ = answer(qs[0], context=ctx)

  _stage("disk")
  # Disk.
  tmp = tempfile.mkdtemp(prefix="lcjax-ctx-", dir=FLAGS.tmp)
  path = os.path.join(tmp, "ctx")
  try:
    row["save_s"] = ctx.save(path)
    row["save_gbs"] = kv_bytes / row["save_s"] / GB
    ctx.close()
    _drop_from_page_cache(path)
    floor = _disk_read_floor(os.path.join(path, "kv.bin"))
    row["disk_floor_gbs"] = kv_bytes / floor / GB
    _drop_from_page_cache(path)
    eng.prefix_cache.clear()
    t0 = time.perf_counter()
    ctx = eng.load_context(path)
    row["restore_disk_s"] = time.perf_counter() - t0
    row["restore_disk_gbs"] = kv_bytes / row["restore_disk_s"] / GB
    row["restore_disk_vs_floor"] = row["restore_disk_gbs"] / row["disk_floor_gbs"]
    row["restore_disk_vs_recompute"] = row["prefill_s"] / row["restore_disk_s"]
    disk_answer, _ = answer(qs[0], context=ctx)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  row["answers_match"] = host_answer.token_ids == want and disk_answer.token_ids == want
  ctx.close()
  if FLAGS.check_cold:
    eng.prefix_cache.clear()
    cold, row["cold_generate_s"] = answer(doc + qs[0])
    row["answers_match"] = row["answers_match"] and cold.token_ids == want
  peak = benchlib.memory_stat(jax.local_devices()[0], "peak_bytes_in_use")
  row["peak_gib"] = peak / 2**30 if peak else None
  eng.close()
  gc.collect()
  return row


def markdown(rows) -> str:
  def f(r, k, fmt):
    return fmt.format(r[k]) if r.get(k) is not None else "-"
  lines = ["| S | KV | host | prefill s | TTFT cached s | TTFT auto s | cold / cached | offload GB/s | restore host s "
           "(GB/s, of floor) | restore disk s (GB/s, of floor) | recompute / restore (host, disk) | answers |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['S']:,} | | | error: {r['error'][:80]} | | | | | | | | |")
      continue
    note = benchlib.compilation_note(r.get("prefill_compile_s") or 0.0)      # the timed prefill's, if any
    lines.append(
        f"| {r['S']:,} | {r['cache_dtype']} {f(r, 'kv_gb', '{:.1f}')} GB | {r.get('host_memory', '-')} | "
        f"{f(r, 'prefill_s', '{:.2f}')}{f' ({note})' if note else ''} | "
        f"{f(r, 'ttft_s', '{:.3f}')} | {f(r, 'auto_ttft_s', '{:.3f}')} | {f(r, 'speedup', '{:.0f}')}x | "
        f"{f(r, 'offload_gbs', '{:.1f}')} | {f(r, 'restore_host_s', '{:.2f}')} ({f(r, 'restore_host_gbs', '{:.1f}')}, "
        f"{f(r, 'restore_host_vs_floor', '{:.0%}')} of {f(r, 'h2d_floor_gbs', '{:.1f}')}) | "
        f"{f(r, 'restore_disk_s', '{:.2f}')} ({f(r, 'restore_disk_gbs', '{:.2f}')}, "
        f"{f(r, 'restore_disk_vs_floor', '{:.0%}')} of {f(r, 'disk_floor_gbs', '{:.2f}')}) | "
        f"{f(r, 'restore_host_vs_recompute', '{:.0f}')}x, {f(r, 'restore_disk_vs_recompute', '{:.1f}')}x | "
        f"{'same' if r.get('answers_match') else 'DIFFER'} |")
  return "\n".join(lines)


def main(argv):
  del argv
  rows = []
  for S in map(int, FLAGS.contexts):
    try:
      row = bench(S)
    except Exception as e:  # noqa: BLE001 - a benchmark records every failure as a row
      row = dict(S=S, error=repr(e)[:400], oom=benchlib.is_oom(e), stage=STAGE["now"])
    rows.append(row)
    print(row, flush=True)
    benchlib.write_result(FLAGS.out, FLAGS.name, rows, markdown(rows),
                          model=dict(preset=None if FLAGS.checkpoint else FLAGS.preset, checkpoint=FLAGS.checkpoint,
                                     dtype=FLAGS.dtype, cache_dtype=FLAGS.cache_dtype, page_size=FLAGS.page_size,
                                     prefill_chunk=FLAGS.prefill_chunk, question=FLAGS.question))
  print(markdown(rows))


if __name__ == "__main__":
  app.run(main)
