"""The linear layers' products over bf16 and fp8 weights, at decode and prefill shapes, as the model runs them.

  python tools/bench_linear.py --presets=llama3-8b,llama3.1-70b --batches=1,8 --prefill_rows=16384

Decode rows: x [B, D] times each of a layer's four weights, inside a lax.scan over the stacked [L, ...] weights
(the model's layer scan: each step reads its layer's slice), compiled with the decode step's XLA options
(lcjax.engine.steps.decode_compiler_options) and with XLA's defaults. Reported as microseconds per layer and the
weight bytes read per second (the floor is the HBM bandwidth, ~4.1-4.8 TB/s on an H200). Products:
  bf16        the bf16 weights
  widened     fp8 weights widened to bf16 inside the product (lcjax.ops.linear.dense, path "widened")
  fp8         x quantized per row, an fp8 x fp8 product (path "fp8")
  gemv        lcjax.ops.triton.gemv's kernel (Triton lowering), given the whole stacked weight and the layer index
              (the scan runs over layer indices); once per tuning of --gemv_tunings, each row with its largest
              difference from "widened" relative to widened's absmax (the kernel's check at real shapes)
  mgpu        lcjax.ops.mosaic_gpu.gemv's kernel (Mosaic GPU), as gemv, once per tuning of --mgpu_tunings
Prefill rows: [rows, D] x each weight, one layer, TFLOP/s (activation quantization included for fp8).
"""
from __future__ import annotations

import functools
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("presets", ["llama3-8b", "llama3.1-70b"], "model presets whose layer shapes are measured")
flags.DEFINE_list("batches", ["1", "8"], "decode batch sizes")
flags.DEFINE_integer("prefill_rows", 16384, "rows of the prefill products (0: none)")
flags.DEFINE_integer("layers", 8, "stacked layers scanned over in the decode rows")
flags.DEFINE_integer("reps", 20, "timed repetitions")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "linear-fp8-h200", "output file stem")
PRODUCTS = ("bf16", "widened", "fp8", "gemv", "mgpu")    # the decode rows' products (module docstring)
OPTIONS = ("decode", "xla-defaults")               # their XLA options: the decode step's, XLA's defaults
flags.DEFINE_list("products", list(PRODUCTS), "decode products measured (module docstring)")
flags.DEFINE_list("options", list(OPTIONS), "XLA options of the decode rows: the decode step's, XLA's defaults (gemv "
                  "rows: the decode step's only)")
flags.DEFINE_list("gemv_tunings", ["default"], "triton_gemv.GemvTuning overrides per gemv row: 'default' or "
                  "FIELD=VALUE pairs joined by '+' (block_n=128+block_k=512)")
flags.DEFINE_list("mgpu_tunings", ["default"], "mgpu_gemv.MgpuGemvTuning overrides per mgpu row, as --gemv_tunings")


def kernel_tuning(cls, text: str, flag: str):
  """A `cls` (a frozen dataclass of int and bool knobs; a bool is 0 or 1) from an entry of --`flag`."""
  import dataclasses
  if text == "default":
    return cls()
  fields = {f.name for f in dataclasses.fields(cls)}
  kw = {}
  for item in text.split("+"):
    k, _, v = item.partition("=")
    if k not in fields or not v:
      raise ValueError(f"--{flag} entry {text!r}: {item!r} is not FIELD=VALUE of {sorted(fields)}")
    if isinstance(getattr(cls(), k), bool) and v not in ("0", "1"):
      raise ValueError(f"--{flag} entry {text!r}: {k} is 0 or 1, not {v!r}")
    kw[k] = bool(int(v)) if isinstance(getattr(cls(), k), bool) else int(v)
  return cls(**kw)


def _time(fn, *args, reps):
  import jax
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(3):
    t = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t) / reps)
  return best


def main(argv):
  del argv
  for name, values, allowed in (("products", FLAGS.products, PRODUCTS), ("options", FLAGS.options, OPTIONS)):
    if not set(values) <= set(allowed):
      raise app.UsageError(f"--{name}={','.join(values)}: each must be one of {', '.join(allowed)}")
  import jax
  import jax.numpy as jnp
  from lcjax.config import preset
  from lcjax.engine.steps import decode_compiler_options
  from lcjax.model.llama import LINEAR, linear_shapes
  from lcjax.ops import linear
  from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
  from lcjax.ops.triton import gemv as triton_gemv
  kernels = {"gemv": (triton_gemv.gemv_stacked, {t: kernel_tuning(triton_gemv.GemvTuning, t, "gemv_tunings")
                                              for t in FLAGS.gemv_tunings}),
             "mgpu": (mgpu_gemv.gemv_stacked, {t: kernel_tuning(mgpu_gemv.MgpuGemvTuning, t, "mgpu_tunings")
                                               for t in FLAGS.mgpu_tunings})}
  rows = []
  key = jax.random.PRNGKey(0)
  for name in FLAGS.presets:
    cfg = preset(name)
    shapes = linear_shapes(cfg)
    L = FLAGS.layers
    ws = {n: (jax.random.normal(key, (L, *s), jnp.float32) * 0.02).astype(jnp.bfloat16) for n, s in shapes.items()}
    q = {n: jax.jit(jax.vmap(lambda w, n=n: linear.quantize_weight(w, LINEAR[n])))(w) for n, w in ws.items()}
    n_weights = sum(w[0].size for w in ws.values())

    def inputs(n, B, T):
      shape = linear.x_shape(LINEAR[n], shapes[n], batch=B, tokens=T)
      return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)

    def layer_fn(product):
      def body(carry, w):
        outs = []
        for n in LINEAR:
          x = carry[n]
          if product == "bf16":
            y = jnp.einsum(LINEAR[n], x, w[n])
          else:
            y = linear.dense(x, *w[n], LINEAR[n], path=product)
          outs.append(jnp.sum(y.astype(jnp.float32)))
        return carry, sum(outs)
      return body

    def gemv_fn(kernel, tuning):
      def run(xs, w):
        def body(carry, i):
          return carry, sum(jnp.sum(kernel(carry[n], *w[n], i, LINEAR[n], tuning=tuning).astype(jnp.float32))
                            for n in LINEAR)
        return jax.lax.scan(body, xs, jnp.arange(L))[1]
      return run

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def gemv_error(kernel, tuning, xs, w):
      """max over the weights of |kernel - widened| / absmax(widened), layer L - 1."""
      errs = []
      for n in LINEAR:
        ref = linear.dense(xs[n], w[n][0][L - 1], w[n][1][L - 1], LINEAR[n], path="widened").astype(jnp.float32)
        got = kernel(xs[n], *w[n], jnp.int32(L - 1), LINEAR[n], tuning=tuning).astype(jnp.float32)
        errs.append(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
      return jnp.max(jnp.stack(errs))

    for B in map(int, FLAGS.batches):
      xs = {n: inputs(n, B, 1) for n in LINEAR}
      for options in FLAGS.options:
        opts = decode_compiler_options() if options == "decode" else None
        runs = [(p, p, None) for p in PRODUCTS if p not in kernels and p in FLAGS.products]
        for k, (_, tunings) in kernels.items():
          runs += [(k, t, tunings[t]) for t in tunings] if options == "decode" and k in FLAGS.products else []
        for product, label, tuning in runs:
          weights = ws if product == "bf16" else q
          if product in kernels:
            fn = jax.jit(gemv_fn(kernels[product][0], tuning), compiler_options=opts)
          else:
            fn = jax.jit(lambda xs, w, product=product: jax.lax.scan(layer_fn(product), xs, w)[1],
                         compiler_options=opts)
          try:
            t = _time(fn, xs, weights, reps=FLAGS.reps) / L
          except Exception as e:  # noqa: BLE001 - a tuning the kernel cannot compile is a row, not the end
            rows.append(dict(kind="decode", preset=name, batch=B, options=options, product=product, tuning=label,
                             error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            print(rows[-1], flush=True)
            continue
          nbytes = n_weights * (2 if product == "bf16" else 1)
          rows.append(dict(kind="decode", preset=name, batch=B, options=options, product=product, tuning=label,
                           us_per_layer=t * 1e6, weight_tb_s=nbytes / t / 1e12))
          if product in kernels:
            rows[-1]["max_rel_diff_vs_widened"] = float(gemv_error(kernels[product][0], tuning, xs, q))
          print(rows[-1], flush=True)
    if FLAGS.prefill_rows:
      T = FLAGS.prefill_rows
      for n in LINEAR:
        x = inputs(n, 1, T)
        flops = 2 * T * ws[n][0].size
        for product in ("bf16", "fp8"):
          if product == "bf16":
            fn = jax.jit(lambda x, w, n=n: jnp.einsum(LINEAR[n], x, w))
            args = (x, ws[n][0])
          else:
            fn = jax.jit(lambda x, w, s, n=n: linear.dense(x, w, s, LINEAR[n], path="fp8"))
            args = (x, q[n][0][0], q[n][1][0])
          t = _time(fn, *args, reps=FLAGS.reps)
          rows.append(dict(kind="prefill", preset=name, weight=n.split("/")[-1], rows=T, product=product,
                           us=t * 1e6, tflops=flops / t / 1e12))
          print(rows[-1], flush=True)
    # The file is rewritten after each preset, so a call cut short by its time limit keeps the presets it measured.
    benchlib.write_result(FLAGS.out, FLAGS.name, rows, markdown(rows),
                          model=dict(presets=FLAGS.presets, layers=FLAGS.layers, prefill_rows=FLAGS.prefill_rows))
  print(markdown(rows))


def markdown(rows) -> str:
  lines = ["Decode: us per layer (weight TB/s; for the kernels, their best tuning)", "",
           "| preset | batch | XLA options | bf16 | fp8 widened | fp8 x fp8 | fp8 GEMV (Triton) "
           "| fp8 GEMV (Mosaic GPU) |",
           "|---|---|---|---|---|---|---|---|"]
  dec = [r for r in rows if r["kind"] == "decode" and "us_per_layer" in r]
  for key in sorted({(r["preset"], r["batch"], r["options"]) for r in dec}):
    mine = [r for r in dec if (r["preset"], r["batch"], r["options"]) == key]
    cell = {r["product"]: f"{r['us_per_layer']:.1f} ({r['weight_tb_s']:.2f})" for r in mine
            if r["product"] not in ("gemv", "mgpu")}
    for k in ("gemv", "mgpu"):
      best = min((r for r in mine if r["product"] == k), key=lambda r: r["us_per_layer"], default=None)
      if best is not None:
        cell[k] = f"{best['us_per_layer']:.1f} ({best['weight_tb_s']:.2f}, {best['tuning']})"
    lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell.get('bf16', '-')} | {cell.get('widened', '-')} | "
                 f"{cell.get('fp8', '-')} | {cell.get('gemv', '-')} | {cell.get('mgpu', '-')} |")
  errs = [r for r in rows if "max_rel_diff_vs_widened" in r]
  if errs:
    lines += ["", "GEMV kernels against the widened product (largest |diff| / absmax over the four weights): " +
              ", ".join(f"{r['product']} {r['tuning']} {r['preset']} batch {r['batch']}: "
                        f"{r['max_rel_diff_vs_widened']:.1e}" for r in errs)]
  failed = [r for r in rows if "error" in r]
  if failed:
    lines += ["", "Tunings that failed: " + "; ".join(f"{r['preset']} batch {r['batch']} {r['tuning']}: "
                                                       f"{r['error']}" for r in failed)]
  pre = [r for r in rows if r["kind"] == "prefill"]
  if pre:
    lines += ["", "Prefill: TFLOP/s (fp8: activation quantization included)", "",
              "| preset | weight | rows | bf16 | fp8 x fp8 |", "|---|---|---|---|---|"]
    for key in sorted({(r["preset"], r["weight"], r["rows"]) for r in pre}):
      cell = {r["product"]: f"{r['tflops']:.0f}" for r in pre if (r["preset"], r["weight"], r["rows"]) == key}
      lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell.get('bf16', '-')} | {cell.get('fp8', '-')} |")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
