"""FP8 attention quality on FlashAttention-3's outlier test: RMSE against float32 attention.

  python tools/check_fp8.py --contexts=8192,32768

Q, K, V ~ N(0, 1) + N(0, 100) * Bernoulli(0.001) (an outlier of std 10 in one element of a thousand), head dim
128, causal, GQA 16:4, batch 1, rounded to bf16 once; every implementation gets the same bf16 inputs and the oracle
is float32 blockwise attention (lcjax.ops.attention.attention_reference) of those inputs. Rows: lcjax's FP8 kernel
with and without the incoherence rotation, its int8 Q K^T form (attention_dtype=int8_fp8), lcjax's bf16 kernel,
cuDNN's fp8 attention (JAX's private entry, per-tensor unit scales: these inputs fit e4m3 unscaled; with P scaled
by 2^8 as lcjax does, and without).

--model runs lcjax's 8-bit rows as the kernel's jnp model (`interpret=True`: its arithmetic, checked against the
kernel on the GPU by tests/test_fp8.py) on any backend, and only those rows: a CPU can measure their error.
"""
from __future__ import annotations

import math
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["8192", "32768"], "sequence lengths (with --model: 1024 unless given)")
flags.DEFINE_integer("seed", 0, "input seed")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "fp8-quality", "output file stem (with --model: fp8-quality-model unless given)")
flags.DEFINE_bool("model", False, "only lcjax's 8-bit rows, through the kernel's jnp model (runs on a CPU)")

N, K, H = 16, 4, 128


def outlier_inputs(key, S):
  import jax
  import jax.numpy as jnp
  def one(key, heads):
    kn, ko, kb = jax.random.split(key, 3)
    shape = (1, S, heads, H)
    x = jax.random.normal(kn, shape) + 10.0 * jax.random.normal(ko, shape) * jax.random.bernoulli(kb, 0.001, shape)
    return x.astype(jnp.bfloat16)

  kq, kk, kv = jax.random.split(key, 3)
  return one(kq, N), one(kk, K), one(kv, K)


def implementations(model: bool = False):
  import functools

  import jax.numpy as jnp
  from lcjax.ops.mosaic_gpu import flash as mgpu_flash

  def lcjax_8bit(**kw):
    fn = functools.partial(mgpu_flash.flash_attention_fp8, interpret=model, **kw)
    return lambda q, k, v: fn(q, k, v)[0]

  eight_bit = {
      "lcjax-pallas-fp8 (rotation)": lcjax_8bit(incoherent=True),
      "lcjax-pallas-fp8 (no rotation)": lcjax_8bit(incoherent=False),
      "lcjax-pallas-int8-fp8 (rotation)": lcjax_8bit(incoherent=True, qk_dtype="int8"),
  }
  if model:
    return {name + " [jnp model]": fn for name, fn in eight_bit.items()}

  def cudnn_fp8(p_scale):
    def run(q, k, v):
      from jax._src.cudnn import fused_attention_stablehlo as fas
      params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in fas.fp8_params_keys}
      params["scale_s"] = jnp.full((1, 1, 1, 1), p_scale, jnp.float32)
      params["descale_s"] = jnp.full((1, 1, 1, 1), 1.0 / p_scale, jnp.float32)
      q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
      out, _, _ = fas.dot_product_attention(q8, k8, v8, fp8_params=params, scale=1.0 / math.sqrt(H),
                                            mask_type=fas.MaskType.CAUSAL, use_fp8=True)
      return out
    return run

  return {
      **eight_bit,
      "lcjax-pallas bf16": lambda q, k, v: mgpu_flash.flash_attention(q, k, v)[0],
      "cudnn-fp8 (unit scales)": cudnn_fp8(1.0),
      "cudnn-fp8 (P scaled 2^8)": cudnn_fp8(256.0),
  }


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  from lcjax.ops import attention as ref
  t0 = time.time()
  rows = []
  contexts, stem = FLAGS.contexts, FLAGS.name
  if FLAGS.model:          # the jnp model is slow, and its rows must not replace the kernel's committed table
    contexts = contexts if FLAGS["contexts"].present else ["1024"]
    stem = stem if FLAGS["name"].present else "fp8-quality-model"
  for S in sorted(map(int, contexts)):
    q, k, v = outlier_inputs(jax.random.key(FLAGS.seed + S), S)
    want, _ = jax.jit(lambda q, k, v: ref.attention_reference(q, k, v, causal=True))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    rms = float(jnp.sqrt(jnp.mean(want ** 2)))
    for name, fn in implementations(FLAGS.model).items():
      try:
        out = jax.jit(fn)(q, k, v).astype(jnp.float32)
        err = out - want
        rows.append(dict(S=S, impl=name, rmse=float(jnp.sqrt(jnp.mean(err ** 2))), rms_out=rms,
                         max_abs=float(jnp.max(jnp.abs(err)))))
      except Exception as e:  # noqa: BLE001 - one implementation failing must not end the run
        rows.append(dict(S=S, impl=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
      print(rows[-1], flush=True)
  lines = ["| S | implementation | RMSE vs float32 | max abs error | RMS of the output |", "|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['S']:,} | {r['impl']} | error: {r['error'][:80]} | | |")
    else:
      lines.append(f"| {r['S']:,} | {r['impl']} | {r['rmse']:.2e} | {r['max_abs']:.2e} | {r['rms_out']:.2e} |")
  benchlib.write_result(FLAGS.out, stem, rows, "\n".join(lines), seconds=time.time() - t0,
                        inputs="N(0,1) + N(0,100) * Bernoulli(0.001), bf16, causal, GQA 16:4, head dim 128, batch 1",
                        oracle="float32 blockwise attention of the same bf16 inputs")


if __name__ == "__main__":
  app.run(main)
