"""Where the prefill flash kernel's cycles go: Mosaic GPU's on-device profile of one step's phases.

  python tools/profile_prefill.py --keys=2048 --kernels=float8_e4m3fn,int8_fp8,bfloat16

Runs lcjax's Mosaic GPU prefill kernel once per kernel with FlashTuning.profile_dir set (causal, batch 1, 32 query
heads over 8 KV heads, head dim 128, as many queries as keys) and reads the Chrome trace the profiler writes: every
compute warpgroup's begin/end clock (SM cycles) of each named phase of a step (lcjax/ops/mosaic_gpu/flash.py):
  qk       the Q K^T wgmma and the wait for its result ('turn', nested, is the part spent waiting for the other
           warpgroup to pass the tensor cores on),
  softmax  mask, row max, exponentials (and on the bf16 path the accumulator's rescale, P's cast and row sums),
  p_cast   fp8: P's cast to e4m3, its row sums and its relabelling as the P V product's register operand,
  wait_v   waiting for V's block and for the other warpgroup,
  pv       the P V wgmma (fp8: into a fresh accumulator, then the rescale-and-add) and the wait for the next K.
The profiler's buffer lives in shared memory, so it serves short sequences (up to PROFILE_MAX_KEYS keys); every
step of a longer sequence is the same program. Needs a Hopper GPU.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import sys
import tempfile

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("keys", 2048, "keys (= queries) per head")
flags.DEFINE_list("kernels", ["float8_e4m3fn", "int8_fp8", "bfloat16"], "kernels: float8_e4m3fn, int8_fp8, bfloat16")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "prefill-profile-h200", "output file stem")

N, K, H = 32, 8, 128
# RunConfig.attention_dtype's 8-bit names (their Q K^T dtype: lcjax.config.ATTENTION_DTYPES), and the bf16 kernel.
KERNELS = ("float8_e4m3fn", "int8_fp8", "bfloat16")
STEP_PHASES = ("qk", "softmax", "p_cast", "wait_v", "pv")     # a step's top-level phases, in program order


def summarize(events: list[dict]) -> dict:
  """Chrome trace events (B/E pairs per tid, 'ts' in thousands of cycles) -> phase -> {count, mean, median,
  per_step} in cycles, plus 'steps' (the number of 'qk' ranges: every step has exactly one) and 'step_cycles' (the
  sum of the top-level phases' per-step cycles). A phase may have several ranges per step ('softmax' on the bf16
  path has two); per_step adds them up."""
  by_tid = collections.defaultdict(list)
  for e in events:
    by_tid[e["tid"]].append(e)
  dur = collections.defaultdict(list)
  for tid, es in by_tid.items():
    stack = []
    for e in es:
      if e["ph"] == "B":
        stack.append(e)
        continue
      if not stack or stack[-1]["name"] != e["name"]:
        raise ValueError(f"trace of tid {tid}: end of {e['name']!r} does not close the open phase "
                         f"{stack[-1]['name'] if stack else None!r}")
      b = stack.pop()
      dur[e["name"]].append((e["ts"] - b["ts"]) * 1e3)
    if stack:
      raise ValueError(f"trace of tid {tid}: phase {stack[-1]['name']!r} never ends")
  steps = len(dur.get("qk", ()))
  if not steps:
    raise ValueError(f"no 'qk' phase in the trace (phases: {sorted(dur)})")
  phases = {name: dict(count=len(d), mean=statistics.mean(d), median=statistics.median(d), per_step=sum(d) / steps)
            for name, d in dur.items()}
  step = sum(phases[p]["per_step"] for p in STEP_PHASES if p in phases)
  return dict(steps=steps, step_cycles=step, phases=phases)


def profile_one(kernel: str, keys: int, trace_dir: str) -> dict:
  import dataclasses
  import functools

  import jax
  import jax.numpy as jnp

  from lcjax.config import ATTENTION_DTYPES
  from lcjax.ops.mosaic_gpu import flash as mgpu_flash

  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (1, keys, N, H), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, keys, K, H), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, keys, K, H), jnp.bfloat16)
  if kernel == "bfloat16":
    f = functools.partial(mgpu_flash.flash_attention, tuning=mgpu_flash.FlashTuning(profile_dir=trace_dir))
  else:
    f = functools.partial(mgpu_flash.flash_attention_fp8, qk_dtype=ATTENTION_DTYPES[kernel],
                          tuning=dataclasses.replace(mgpu_flash.FP8_TUNING, profile_dir=trace_dir))
  jax.block_until_ready(jax.jit(functools.partial(f, causal=True))(q, k, v))
  jax.effects_barrier()                      # the trace is written by a debug callback after the kernel
  traces = glob.glob(os.path.join(trace_dir, "*.json"))
  if len(traces) != 1:
    raise RuntimeError(f"{kernel}: expected one profiler trace in {trace_dir}, found {len(traces)}")
  with open(traces[0]) as fh:
    return summarize(json.load(fh)["traceEvents"])


def table(rows: list[dict]) -> str:
  names = list(STEP_PHASES[:1]) + ["turn"] + list(STEP_PHASES[1:])
  lines = ["| kernel | keys | steps | " + " | ".join(names) + " | step |", "|---" * (len(names) + 4) + "|"]
  for r in rows:
    cells = [f"{r['phases'][n]['per_step']:.0f}" if n in r["phases"] else "-" for n in names]
    lines.append(f"| {r['kernel']} | {r['keys']} | {r['steps']} | " + " | ".join(cells)
                 + f" | {r['step_cycles']:.0f} |")
  return "\n".join(lines)


NOTE = ("Mean SM cycles per step of one compute warpgroup (64 query rows x 128 keys), from Mosaic GPU's on-device "
        "profiler. 'turn' is part of 'qk'. Per step, a warpgroup's two 64x128x128 MMAs need 512 tensor-core cycles "
        "each in bf16 (256 in 8-bit) at the SM's peak, and its 8192 exponentials 512 cycles of the SM's "
        "16 exp2/cycle; the two compute warpgroups take turns, so the kernel's rate is set by the step.")


def main(argv):
  del argv
  bad = [k for k in FLAGS.kernels if k not in KERNELS]
  if bad:
    raise app.UsageError(f"--kernels: unknown {bad}; known: {', '.join(KERNELS)}")
  from lcjax.ops.mosaic_gpu import flash as mgpu_flash
  if not 0 < FLAGS.keys <= mgpu_flash.PROFILE_MAX_KEYS or FLAGS.keys % 128:
    raise app.UsageError(f"--keys={FLAGS.keys}: a multiple of 128 up to {mgpu_flash.PROFILE_MAX_KEYS}")
  rows = []
  for kernel in FLAGS.kernels:
    with tempfile.TemporaryDirectory() as d:
      r = dict(kernel=kernel, keys=FLAGS.keys, **profile_one(kernel, FLAGS.keys, d))
    print(json.dumps(r), flush=True)
    rows.append(r)
  md = table(rows)
  print(md)
  benchlib.write_result(FLAGS.out, FLAGS.name, rows, md, note=NOTE)


if __name__ == "__main__":
  app.run(main)
