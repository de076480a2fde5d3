"""Probe (session 5): how fast can a batch-1 decode GEMV read Llama-3-8B's layer weights on this GPU?

The 128K decode profile (call R) has the small projections well below the bandwidth the large ones reach: qkv
[4096 -> 6144] at 3.2 TB/s and wo [4096 -> 4096] at ~2.8 TB/s against gate_up [4096 -> 28672] at 4.1. A GEMV
with too few output tiles leaves SMs idle; splitting the contraction gives every SM loads to keep in flight.
Each variant reads the 32 stacked weights of one projection in a lax.scan, as the model does:
  xla     jnp.dot as the model writes it (cuBLAS / nvjet picks its tile);
  splitS  the contraction split S ways as a batched dot with float32 partials, summed after (split-K by hand);
  pallas  a Pallas (Triton) GEMV that reads the stacked array in place at the scan's layer index, SPLIT x N/BN
          programs, float32 partials summed after.
Prints TB/s of weights read per variant and checks every variant against the float32 product.

  python3 benchmarks/runs/gemv_probe.py [--interpret]   (--interpret: tiny shapes on the CPU, correctness only)

Outcome (call S, benchmarks/results/decode-profile/gemv-probe-s.json): only the pallas rows compare with the
model. The xla and split rows here run at 1.2-1.3 TB/s on every shape, gate_up included (4.1 TB/s in the model's
profile): this scan materialises each layer's weight slice before the dot, which the model's scan does not (its
GEMMs read the stack in place through dynamic-slice fusions). The Pallas GEMV reached 2.4 (qkv), 2.3 (wo), 3.4
(gate_up) and 3.1 TB/s (down) at 8 splits, below cuBLAS in the model (3.2, ~2.8, 4.1, ~4.0): not pursued. Split-K
by hand inside the model (float32 partials of a batched dot) made XLA convert the weights to float32 and call
cuBLAS's legacy gemv: 128K decode 9.18 -> 15.35 (split 2) / 14.32 ms (split 4). Dropped.
"""
from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SHAPES = {"qkv": (4096, 6144), "wo": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
L = 32


def _gemv_kernel(l_ref, x_ref, w_ref, o_ref, *, BK, BN, steps):
  from jax.experimental.pallas import triton as pltriton
  j, s = pl.program_id(0), pl.program_id(1)
  layer = l_ref[0]

  def body(i, acc):
    k0 = (s * steps + i) * BK
    xk = x_ref[pl.ds(k0, BK)].astype(jnp.float32)                       # [BK]
    w = w_ref[layer, pl.ds(k0, BK), pl.ds(j * BN, BN)].astype(jnp.float32)  # [BK, BN]
    return acc + jnp.sum(xk[:, None] * w, axis=0)

  acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((BN,), jnp.float32))
  pltriton.store(o_ref, acc)


def pallas_gemv(x, w_all, layer, *, split, BK=128, BN=64, num_warps=4, num_stages=4, interpret=False):
  """x [Din], w_all [L, Din, N] -> [N] f32, reading w_all[layer] in place."""
  from jax.experimental.pallas import triton as pltriton
  _, Din, N = w_all.shape
  assert Din % (split * BK) == 0 and N % BN == 0, (Din, N, split, BK, BN)
  steps = Din // (split * BK)
  part = pl.pallas_call(
      functools.partial(_gemv_kernel, BK=BK, BN=BN, steps=steps),
      grid=(N // BN, split),
      in_specs=[pl.no_block_spec, pl.no_block_spec, pl.no_block_spec],
      out_specs=pl.BlockSpec((None, BN), lambda j, s: (s, j)),
      out_shape=jax.ShapeDtypeStruct((split, N), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="probe_gemv",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), x, w_all)
  return part.sum(0)


def variants(interpret):
  def xla(x, w_all):
    return jax.lax.scan(lambda c, w: (c, jnp.dot(c, w)), x, w_all)[1]

  def split(S):
    def f(x, w_all):
      def one(c, w):
        d = w.shape[0]
        y = jnp.einsum("sd,sdn->sn", c.reshape(S, d // S), w.reshape(S, d // S, -1),
                       preferred_element_type=jnp.float32)
        return c, y.sum(0).astype(c.dtype)
      return jax.lax.scan(one, x, w_all)[1]
    return f

  def pallas(S, BN=64, BK=128, stages=4):
    def f(x, w_all):
      def one(c, i):
        return c, pallas_gemv(c, w_all, i, split=S, BN=BN, BK=BK, num_stages=stages,
                              interpret=interpret).astype(c.dtype)
      return jax.lax.scan(one, x, jnp.arange(w_all.shape[0]))[1]
    return f

  out = {"xla": xla, "split2": split(2), "split4": split(4)}
  for S in (1, 2, 4, 8):
    out[f"pallas-s{S}"] = pallas(S)
  out["pallas-s4-bn128"] = pallas(4, BN=128, BK=64)
  out["pallas-s8-bk64"] = pallas(8, BK=64, stages=6)
  return out


def main():
  interpret = "--interpret" in sys.argv
  shapes = {"tiny": (1024, 512)} if interpret else SHAPES
  layers = 2 if interpret else L
  rows = []
  for name, (Din, N) in shapes.items():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (Din,), jnp.float32).astype(jnp.bfloat16)
    w_all = (jax.random.normal(kw, (layers, Din, N), jnp.float32) * Din ** -0.5).astype(jnp.bfloat16)
    want = jnp.einsum("d,ldn->ln", x.astype(jnp.float32), w_all.astype(jnp.float32))
    for vname, fn in variants(interpret).items():
      f = jax.jit(fn)
      try:
        got = f(x, w_all).block_until_ready()
      except Exception as e:            # a variant that does not compile is reported, not fatal
        rows.append({"shape": name, "variant": vname, "error": str(e).splitlines()[0][:200]})
        print(name, vname, "error:", rows[-1]["error"], flush=True)
        continue
      err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
      reps = 3 if interpret else 50
      t0 = time.perf_counter()
      for _ in range(reps):
        got = f(x, w_all)
      got.block_until_ready()
      ms = (time.perf_counter() - t0) / reps * 1e3
      tbs = layers * Din * N * 2 / (ms * 1e-3) / 1e12
      rows.append({"shape": name, "variant": vname, "Din": Din, "N": N, "ms_per_32_layers": ms,
                   "tb_per_s": tbs, "rel_err": err})
      print(f"{name:8s} {vname:16s} {ms:7.3f} ms / {layers} layers  {tbs:5.2f} TB/s  rel_err {err:.1e}",
            flush=True)
      assert err < 2e-2, (name, vname, err)
  if not interpret:
    import os
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gemv-probe.json"), "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
