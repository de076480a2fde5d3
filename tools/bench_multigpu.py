"""Multi-device benchmark: prefill time, decode time and peak memory per device for (tensor, seq) meshes, next to
the memory planner, plus ring-prefill scaling and a labelled extrapolation from a one-device, few-layer run.

  # the issue-7 table on 8 GPUs (random bf16 weights made on the devices)
  python tools/bench_multigpu.py --preset=llama3.1-70b --meshes=8x1,4x2,2x4 \
      --contexts=131072,524288,1048576 --decode_batches=1,8 --scaling_tokens_per_gpu=65536 --scaling_gpus=1,2,4,8
  # the same code on 8 CPU devices with a tiny model (a smoke test of every mode)
  python tools/bench_multigpu.py --preset=tiny --layers=2 --cpu_devices=8 --meshes=2x4,4x2,1x8 \
      --contexts=2048,4096 --decode_batches=1,4 --scaling_tokens_per_gpu=256 --scaling_gpus=1,2,4,8 \
      --prefill_chunk=1024 --page_size=64 --decode_steps=8
  # one GPU: 8 of the 70B's 80 layers at the per-GPU share of the context, extrapolated to 8 GPUs
  python tools/bench_multigpu.py --preset=llama3.1-70b --layers=8 --meshes=1x1 --contexts=65536,131072 \
      --predict_meshes=8x1,4x2,2x4 --predict_contexts=524288,1048576

Each (mesh, context) runs in its own process, so a peak memory is its own and an OOM ends one row. Rows carry the
long-context benchmark's keys (impl, S, prefill_s, prefill_tok_s, prefill_tflops, decode_ms_per_token, peak_gib,
planned_gib, weights_gib, kv_gib, oom) plus tensor, seq, gpus, batch and `predicted` (true for extrapolations,
never measured). Scaling rows (tensor=1, seq = each of --scaling_gpus, the same tokens per device) run in each
of --scaling_orders: zigzag (sp_mode=ring) and plain (sp_mode=ring-plain, contiguous blocks, where the last
device does most of the causal work); `efficiency` is per-device FLOP/s against one device, `zigzag_gain` the
plain / zigzag prefill time at the same device count. Decode batches > 1 share the prompt as a prefix (prefilled
once, pages shared), so the decode step reads batch x the context while the prefill stays one prompt's.

Extrapolation (--predict_meshes): from each measured one-device row, prefill scales by matmul + attention FLOPs
(full layers over the mesh's devices at the measured FLOP/s, plus any ring transfer the planner says is not
hidden), decode by the bytes a device reads per token (its weights and its share of the KV cache) at the
measured bytes/s. Both assume perfect parallel efficiency; the scaling rows measure how far from it the ring is.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lcjax.engine.plan import prefill_flops  # noqa: E402
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3.1-70b", "model preset (random weights made on the devices)")
flags.DEFINE_integer("layers", 0, "use only this many layers (0: all)")
flags.DEFINE_list("meshes", ["8x1", "4x2", "2x4"], "meshes as TENSORxSEQ")
flags.DEFINE_list("contexts", ["131072", "524288", "1048576"], "prompt lengths")
flags.DEFINE_list("decode_batches", ["1", "8"], "decode batch sizes; batches > 1 run at the smallest context only")
flags.DEFINE_integer("decode_steps", 32, "decode steps timed after each prefill")
flags.DEFINE_integer("prefill_chunk", 16384, "prefill chunk (tokens)")
flags.DEFINE_integer("page_size", 256, "KV page size")
flags.DEFINE_string("attention", "auto", "attention backend")
flags.DEFINE_string("dtype", "bfloat16", "parameter / activation dtype")
flags.DEFINE_string("cache_dtype", "auto", "KV cache dtype")
flags.DEFINE_string("weight_dtype", "auto", "linear weights: auto (the dtype), float8_e4m3fn (fp8, per-channel "
                    "scales; decode runs the fp8 GEMV kernel on each device's shards)")
flags.DEFINE_string("attention_dtype", "auto", "auto | float8_e4m3fn | int8_fp8 (8-bit prefill attention)")
flags.DEFINE_string("sp_mode", "ring", "ring | ring-plain | ulysses (the table's rows; scaling rows use their "
                    "--scaling_orders)")
flags.DEFINE_integer("scaling_tokens_per_gpu", 0, "ring scaling rows: this many prompt tokens per seq device "
                     "(0: none)")
flags.DEFINE_list("scaling_gpus", ["1", "2", "4", "8"], "seq sizes of the scaling rows (tensor=1)")
flags.DEFINE_list("scaling_orders", ["zigzag", "plain"], "ring layouts of the scaling rows: zigzag (sp_mode ring) "
                  "and plain (ring-plain, contiguous blocks); plain / zigzag prefill time is the balancing gain")
flags.DEFINE_list("predict_meshes", [], "extrapolate the measured rows to these meshes (TENSORxSEQ)")
flags.DEFINE_list("predict_contexts", [], "contexts of the extrapolated rows (default: --contexts)")
flags.DEFINE_string("measured", None, "extrapolate from the one-device rows of this results JSON (of this tool or "
                    "tools/bench_longctx.py, same preset and --layers) instead of running anything")
flags.DEFINE_integer("cpu_devices", 0, "fake this many CPU devices (CPU smoke runs)")
flags.DEFINE_float("time_budget_s", 540.0, "start no new row once this much wall time is spent")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "multigpu", "output file stem")
flags.DEFINE_string("worker", None, "internal: TENSOR,SEQ,CONTEXT,BATCH[,kind] of one row")

GiB = 1024 ** 3


def _mesh(s: str) -> tuple[int, int]:
  t, q = s.lower().split("x")
  return int(t), int(q)


def _model_cfg():
  longest = max(map(int, FLAGS.contexts + FLAGS.predict_contexts)) + FLAGS.decode_steps + 1
  return benchlib.random_model_cfg(FLAGS.preset, longest, FLAGS.layers)


def _run_cfg(tensor, seq, context, batch, sp_mode=None):
  from lcjax.config import RunConfig
  page = FLAGS.page_size
  ctx = -(-(context + FLAGS.decode_steps + 2) // page) * page
  chunk = -(-min(FLAGS.prefill_chunk, context) // page) * page
  num_pages = 0                  # batch 1: the planner's default, one max_context sequence
  if batch > 1:
    # The batch shares one prompt: its pages once, plus each request's copy of the prompt's last page and its
    # own decode pages; round-robin placement leaves a shard at most a page per sequence over its share.
    pages = -(-context // page) + batch * (-(-(FLAGS.decode_steps + 3) // page) + 1)
    num_pages = seq * (-(-pages // seq) + batch + 1)
  return RunConfig(dtype=FLAGS.dtype, cache_dtype=FLAGS.cache_dtype, weight_dtype=FLAGS.weight_dtype,
                   attention_dtype=FLAGS.attention_dtype, page_size=page, max_context=ctx,
                   max_batch=batch, prefill_chunk=chunk, decode_steps=FLAGS.decode_steps,
                   attention=FLAGS.attention, tensor=tensor, seq=seq, sp_mode=sp_mode or FLAGS.sp_mode,
                   num_pages=num_pages)


def worker(spec: str):
  if FLAGS.cpu_devices:
    import jax
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  import jax
  import numpy as np
  from lcjax.engine import plan as planlib
  from lcjax.engine.engine import Engine
  parts = spec.split(",")
  tensor, seq, S, batch = map(int, parts[:4])
  kind = parts[4] if len(parts) > 4 else "table"
  cfg = _model_cfg()
  sp_mode = {"scaling": "ring", "scaling-plain": "ring-plain"}.get(kind)     # the layouts the gain compares
  run = _run_cfg(tensor, seq, S, batch, sp_mode=sp_mode)
  from lcjax.config import WeightFormat
  p = planlib.plan(cfg, run, weights=WeightFormat().for_run(run.weight_dtype))
  base = dict(impl="lcjax", kind=kind, sp_mode=run.sp_mode, S=S, tensor=tensor, seq=seq, gpus=tensor * seq,
              batch=batch,
              predicted=False, planned_gib=p.total / GiB, weights_gib=p.weights / GiB, kv_gib=p.kv_cache / GiB,
              ring_hidden=p.comm.overlaps if seq > 1 else None)
  try:
    rng = np.random.default_rng(0)
    t0 = time.time()
    eng = Engine.random(cfg, run=run, seed=0)
    eng.warm_up(S)    # the programs of an S-token prompt: its chunks, the first token, the decode loop
    eng.generate(rng.integers(0, cfg.vocab_size, run.prefill_chunk).tolist(), max_new_tokens=2)
    warm = time.time() - t0
    prompt = rng.integers(0, cfg.vocab_size, S).tolist()
    if batch == 1:
      res = eng.generate(prompt, max_new_tokens=FLAGS.decode_steps + 1)
      prefill_s, decode_ms, compiled = res.stats["prefill_s"], res.stats["decode_ms_per_token"], res.stats["compile_s"]
    else:
      suffixes = [[int(t)] for t in rng.integers(0, cfg.vocab_size, batch)]
      res = eng.generate(suffixes, max_new_tokens=FLAGS.decode_steps + 1, prefix=prompt)
      prefill_s = None   # the shared prefix's prefill is not a request's; batch-1 rows time prefill
      decode_ms, compiled = res[0].stats["decode_ms_per_token"], res[0].stats["compile_s"]
    peaks = [benchlib.memory_stat(d, "peak_bytes_in_use") for d in jax.local_devices()[:tensor * seq]]
    peak = max(peaks) / GiB if all(peaks) else None
    flops = prefill_flops(cfg, S)
    benchlib.emit_row(**base, prefill_s=prefill_s, prefill_tok_s=S / prefill_s if prefill_s else None,
                      prefill_tflops=flops / prefill_s / 1e12 if prefill_s else None, decode_ms_per_token=decode_ms,
                      peak_gib=peak, warmup_s=warm, timed_compile_s=compiled, **eng.kernels,
                      cache_dtype=eng.run.resolved_cache_dtype,
                      weight_dtype=eng.weights.name or eng.run.dtype, oom=False)
  except Exception as e:  # noqa: BLE001 - every failure is a row
    oom = benchlib.is_oom(e)
    benchlib.emit_row(**base, oom=oom, error=repr(e)[:400])


# -- extrapolation ------------------------------------------------------------------------------------------

def predict(rows) -> list[dict]:
  """Rows for --predict_meshes x --predict_contexts from the measured one-device batch-1 rows (see module doc)."""
  from lcjax.config import preset
  from lcjax.engine import plan as planlib
  full = dataclasses.replace(_model_cfg(), n_layers=preset(FLAGS.preset).n_layers)
  measured = [r for r in rows if r.get("gpus") == 1 and r.get("batch") == 1 and r.get("prefill_s")
              and not r.get("predicted")]
  if not measured:
    return []
  ref = max(measured, key=lambda r: r["S"])            # the longest context: attention-dominated like the target
  part = _model_cfg()
  flops_per_s = prefill_flops(part, ref["S"]) / ref["prefill_s"]
  # Decode reads a device's weights and its KV share once per token.
  ref_run = _run_cfg(1, 1, ref["S"], 1)
  kv_item = planlib._ITEMSIZE[ref_run.resolved_cache_dtype]
  bytes_per_s = (planlib.plan(part, ref_run).weights + ref["S"] * part.kv_bytes_per_token(kv_item)) / (
      ref["decode_ms_per_token"] / 1e3)
  out = []
  for m in FLAGS.predict_meshes:
    tensor, seq = _mesh(m)
    for S in map(int, FLAGS.predict_contexts or FLAGS.contexts):
      run = _run_cfg(tensor, seq, S, 1)
      p = planlib.plan(full, run)
      c = p.comm
      exposed = 0.0 if c.overlaps else (c.ring_step_comm_s - c.ring_step_compute_s) * c.ring_steps
      n_chunks = -(-S // run.prefill_chunk)
      prefill_s = prefill_flops(full, S) / (tensor * seq * flops_per_s) + exposed * full.n_layers * n_chunks
      kv_read = S * full.kv_bytes_per_token(kv_item) * p.kv_replication / (tensor * seq)
      decode_ms = 1e3 * (p.weights + kv_read) / bytes_per_s
      out.append(dict(impl="lcjax", kind="predicted", S=S, tensor=tensor, seq=seq, gpus=tensor * seq, batch=1,
                      predicted=True, prefill_s=prefill_s, prefill_tok_s=S / prefill_s,
                      prefill_tflops=prefill_flops(full, S) / prefill_s / 1e12, decode_ms_per_token=decode_ms,
                      peak_gib=None, planned_gib=p.total / GiB, weights_gib=p.weights / GiB,
                      kv_gib=p.kv_cache / GiB, ring_hidden=c.overlaps if seq > 1 else None, oom=False,
                      basis=f"{FLAGS.preset} {part.n_layers} layers, S={ref['S']} on 1 device: "
                            f"{flops_per_s / 1e12:.0f} TFLOP/s prefill, {bytes_per_s / 1e9:.0f} GB/s decode"))
  return out


def scaling_efficiency(rows) -> None:
  """Per-device prefill throughput of each scaling row relative to one device (weak scaling, same tokens per
  device; causal attention work per device grows with the devices, so throughput in FLOP/s is compared), for
  each ring layout; and on the zigzag rows, the gain of load balancing: plain / zigzag prefill time."""
  by_kind = {kind: {r["seq"]: r for r in rows if r.get("kind") == kind and r.get("prefill_tflops")}
             for kind in ("scaling", "scaling-plain")}
  one = by_kind["scaling"].get(1)            # one device: the baseline of both layouts
  if one is not None:
    for sc in by_kind.values():
      for r in sc.values():
        r["efficiency"] = r["prefill_tflops"] / r["gpus"] / one["prefill_tflops"]
  for g, r in by_kind["scaling"].items():
    plain = by_kind["scaling-plain"].get(g)
    if plain is not None and g > 1:
      r["zigzag_gain"] = plain["prefill_s"] / r["prefill_s"]


# -- orchestration ------------------------------------------------------------------------------------------

def _specs() -> list[str]:
  specs = []
  contexts = sorted(map(int, FLAGS.contexts))
  for m in FLAGS.meshes:
    tensor, seq = _mesh(m)
    for S in contexts:
      specs.append(f"{tensor},{seq},{S},1")
    for b in map(int, FLAGS.decode_batches):
      if b > 1:
        specs.append(f"{tensor},{seq},{contexts[0]},{b}")
  if FLAGS.scaling_tokens_per_gpu:
    for order in FLAGS.scaling_orders:
      if order not in ("zigzag", "plain"):
        raise app.UsageError(f"--scaling_orders takes zigzag and/or plain, not {order!r}")
      for g in map(int, FLAGS.scaling_gpus):
        if order == "plain" and g == 1:
          continue                   # one device has no layout: the zigzag row is its baseline too
        kind = "scaling" if order == "zigzag" else "scaling-plain"
        specs.append(f"1,{g},{FLAGS.scaling_tokens_per_gpu * g},1,{kind}")
  return specs


def markdown(rows) -> str:
  lines = ["| mesh (T x S) | S | batch | prefill s | TFLOP/s | decode ms/tok | peak GiB | planned GiB | note |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    note = ("PREDICTED" if r.get("predicted") else "OOM" if r.get("oom") else
            f"{r['kind']}, efficiency {r['efficiency']:.0%}"
            + (f", plain/zigzag time {r['zigzag_gain']:.2f}x" if r.get("zigzag_gain") else "")
            if r.get("efficiency") is not None else
            (r.get("error") or "")[:60])
    cell = benchlib.cell
    lines.append(f"| {r['tensor']} x {r['seq']} | {r['S']:,} | {r['batch']} | {cell(r, 'prefill_s', '{:.2f}')} | "
                 f"{cell(r, 'prefill_tflops', '{:.0f}')} | {cell(r, 'decode_ms_per_token', '{:.2f}')} | "
                 f"{cell(r, 'peak_gib', '{:.1f}')} | {cell(r, 'planned_gib', '{:.1f}')} | {note} |")
  return "\n".join(lines)


def write_results(rows) -> str:
  rows = sorted(rows, key=lambda r: (r.get("predicted", False), r.get("kind", ""), r["gpus"], r["tensor"],
                                     r["S"], r["batch"]))
  versions = benchlib.versions(("jax", "jaxlib", "flax"))
  device = benchlib.device_name(FLAGS.cpu_devices or 1)
  if FLAGS.measured:
    with open(FLAGS.measured) as f:
      src = json.load(f)
    device = f"measured on {src['device']} ({os.path.basename(FLAGS.measured)}); extrapolated on {device}"
    versions = dict(measured=src.get("versions"), extrapolated=versions)
  table = markdown(rows)
  benchlib.write_result(FLAGS.out, FLAGS.name, rows, table, device=device, versions_=versions,
                        note="Rows marked PREDICTED are extrapolations, not measurements.",
                        model=dict(preset=FLAGS.preset, layers=FLAGS.layers or None, dtype=FLAGS.dtype,
                                   cache_dtype=FLAGS.cache_dtype, prefill_chunk=FLAGS.prefill_chunk,
                                   page_size=FLAGS.page_size, attention=FLAGS.attention, sp_mode=FLAGS.sp_mode,
                                   decode_steps=FLAGS.decode_steps))
  return table


def from_measured(path: str) -> list[dict]:
  """The measured one-device batch-1 rows of a results file, in this tool's row keys."""
  with open(path) as f:
    d = json.load(f)
  model = d.get("model", {})
  if model.get("preset", FLAGS.preset) != FLAGS.preset or (model.get("layers") or 0) != FLAGS.layers:
    raise app.UsageError(f"{path} measured preset={model.get('preset')} layers={model.get('layers')}, not "
                         f"--preset={FLAGS.preset} --layers={FLAGS.layers}")
  rows = []
  for r in d["rows"]:
    if r.get("prefill_s") and r.get("gpus", 1) == 1 and r.get("batch", 1) == 1 and not r.get("predicted"):
      rows.append(dict(r, impl="lcjax", kind="measured", tensor=1, seq=1, gpus=1, batch=1, predicted=False,
                       source=os.path.basename(path)))
  if not rows:
    raise app.UsageError(f"{path} has no measured one-device rows to extrapolate from")
  return rows


def orchestrate():
  start = time.time()
  if FLAGS.measured:
    rows = from_measured(FLAGS.measured)
    rows += predict(rows)
    print(write_results(rows))
    return
  specs = _specs()
  need = max((math.prod(map(int, spec.split(",")[:2])) for spec in specs), default=0)
  have = FLAGS.cpu_devices or len(benchlib.gpu_names())
  if need > have:
    raise app.UsageError(f"the meshes {','.join(FLAGS.meshes)} need {need} devices and this machine has {have} "
                         f"{'CPU devices (--cpu_devices)' if FLAGS.cpu_devices else 'GPUs'}")
  rows = []
  for spec in specs:
    tensor, seq, S, batch = map(int, spec.split(",")[:4])
    if time.time() - start > FLAGS.time_budget_s:
      rows.append(dict(impl="lcjax", S=S, tensor=tensor, seq=seq, gpus=tensor * seq, batch=batch, predicted=False,
                       oom=None, error="skipped: time budget"))
      continue
    argv = [sys.executable, os.path.abspath(__file__), f"--worker={spec}"] + [
        a for a in sys.argv[1:] if not a.startswith("--worker")]
    print(f"== {spec}", flush=True)
    got, status = benchlib.run_worker(argv, spec)
    rows += got
    if not got:   # the worker died outside Python (e.g. killed for memory)
      rows.append(dict(impl="lcjax", S=S, tensor=tensor, seq=seq, gpus=tensor * seq, batch=batch, predicted=False,
                       oom=None, error=f"worker exited with {status}"))
    scaling_efficiency(rows)
    write_results(rows)          # after every row, so a run stopped later still leaves results
  rows += predict(rows)
  print(write_results(rows))


def main(argv):
  del argv
  if FLAGS.worker:
    worker(FLAGS.worker)
  else:
    orchestrate()


if __name__ == "__main__":
  app.run(main)
