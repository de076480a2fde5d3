"""The split combine of lcjax.ops.mosaic_gpu.paged in Pallas Mosaic GPU: each row's split partials joined by
their log-sum-exp weights, the exact merge of `lcjax.ops.splits.combine_splits_reference`.

The fp8 decode kernel writes, per (sequence b, kv head h, split s), a float32 partial out^T [H, RN] (normalised
within the split) and its lse [RN] (natural log). One CTA here takes (b, h, a block of HB = 64 head-dim rows): it
issues the TMA copy of the lse rows (`lse_rows` of them, as many as the decode kernel allocates) and streams the
partials [SC, HB, RN] (SC splits a step) through a two-slot TMA pipeline whose first loads fly with it, and
accumulates online, in the WGMMA register layout the decode kernel stores them from (a value per (head-dim row,
query row)): per step the running maximum m moves to m' = max(m, the step's lse), acc and l are scaled by
exp(m - m'), and each split adds o_s exp(lse_s - m') to acc and exp(lse_s - m') to l. A batch-1 decode gives
the combine few CTAs (16 on the Llama-3.1-70B shape), so its time is the chain of memory round trips: the lse
copy flies with the first partials' copies.
It writes acc / l as out^T [B, K, H, RN] float32 and, from the first head-dim block, the lse m + log l [B, K, RN]:
XLA's transpose of the R real rows into [B, T, N, H] and the cast fuse into whatever reads the attention output.

Legend: B batch, K kv heads, S splits (a power of two), H head dim, RN query rows per kv head (padded to a multiple
of 8), HB head-dim rows per CTA, SC splits per pipeline step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lcjax.ops.mosaic_gpu.common import load, smem_transforms
from lcjax.ops.splits import heads_from_transposed

HB = 64                      # head-dim rows per CTA: the WGMMA register layout's tile height
_M_FLOOR = -1e30             # running maxima start here (a row no split saw keeps exp(-inf - m) = 0)
STEP_BYTES = 32 * 1024       # partial bytes a pipeline step loads (two steps in flight)


def swizzled(RN: int) -> bool:
  """Whether the partials' shared-memory rows of RN float32 take the 128-byte swizzle: rows of 32 and 64 values do
  (at 64, unswizzled loads fail the lowering's bank-conflict check); rows of 8-24 and 40-56 values cannot (their
  bytes are no swizzle's width) and are read unswizzled."""
  return RN % 32 == 0


def splits_per_step(S: int, RN: int) -> int:
  """SC: the most splits (a power of two dividing S) whose partials [SC, HB, RN] float32 fit STEP_BYTES, for rows
  of 8, 16 or 32 values; one for other widths, where a block of several splits would need a TMA copy of more than 5
  strided dimensions (RN 24, 40, 48, 56: rows that are no power of two; RN 64: rows past the 128-byte swizzle)."""
  sc = max(1, STEP_BYTES // (HB * RN * 4)) if RN in (8, 16, 32) else 1
  return min(S, 1 << (sc.bit_length() - 1))


def lse_rows(S: int, RN: int) -> int:
  """Rows of the lse partials [B, K, lse_rows, RN] the combine reads by one TMA copy (the first S written): S,
  doubled until the copy's bytes divide over the warpgroup's 128 threads."""
  n = S
  while n * RN % 32:
    n *= 2
  return n


def combine_splits(o, lse, *, T: int, G: int, out_dtype):
  """o [B, K, S, H, RN] float32 (out^T of each split), lse [B, K, lse_rows(S, RN), RN] float32 (the first S rows
  written) -> (out [B, T, K * G, H] out_dtype, lse [B, T, K * G] float32): row r = t * G + g of kv head h is query
  head h * G + g at token t; rows r >= T * G are padding and are dropped."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  B, K, S, H, RN = o.shape
  S2 = lse_rows(S, RN)
  if S & (S - 1) or H % HB or RN % 8 or lse.shape != (B, K, S2, RN) or T * G > RN:
    raise ValueError(f"partials {tuple(o.shape)} and lse {tuple(lse.shape)} for {T=} {G=}: the combine takes a "
                     f"power-of-two split count, a head dim that is a multiple of {HB}, RN a multiple of 8 >= T * G, "
                     f"and lse [B, K, {S2}, RN]")
  SC = splits_per_step(S, RN)
  transforms = smem_transforms(jnp.float32, RN) if swizzled(RN) else ()
  steps = S // SC
  WGMMA = plgpu.Layout.WGMMA
  COLS = WGMMA.reduce(0)                                   # a [RN] vector: one value per query row

  def body(o_ref, lse_ref, out_ref, lse_out_ref, lse_smem, acc_smem, lse_out_smem, bar):
    b, h, c = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("hblock")
    plgpu.copy_gmem_to_smem(lse_ref.at[b, h], lse_smem, bar.at[0])      # waited for in the first step

    def step(idx, o_smem, carry):
      acc, l, m = carry
      pl.when(idx[0] == 0)(lambda: plgpu.barrier_wait(bar.at[0]))
      lse = [load(lse_smem.at[idx[0] * SC + j], COLS) for j in range(SC)]
      m_new = functools.reduce(jnp.maximum, lse, m)
      alpha = jnp.exp(m - m_new)
      acc = acc * lax.broadcast_in_dim(alpha, (HB, RN), [1])
      l = l * alpha
      for j in range(SC):
        w = jnp.exp(lse[j] - m_new)
        acc = acc + load(o_smem.at[j] if SC > 1 else o_smem, WGMMA) * lax.broadcast_in_dim(w, (HB, RN), [1])
        l = l + w
      # The pipeline refills this slot by TMA as soon as the step returns: every warp's reads must be done first
      # (a warpgroup barrier; without it a lagging warp reads the next fill).
      plgpu.commit_smem()
      return acc, l, m_new

    acc, l, m = plgpu.emit_pipeline(
        step, grid=(steps,),
        in_specs=[plgpu.BlockSpec((SC, HB, RN) if SC > 1 else (None, HB, RN), lambda i: (i, c, 0),
                                  transforms=transforms)],
        max_concurrent_steps=min(2, steps),
        init_carry=(plgpu.layout_cast(jnp.zeros((HB, RN), jnp.float32), WGMMA),
                    plgpu.layout_cast(jnp.zeros((RN,), jnp.float32), COLS),
                    plgpu.layout_cast(jnp.full((RN,), _M_FLOOR, jnp.float32), COLS)),
    )(o_ref.at[b, h])
    empty = l == 0                # not l > 0 failing: a NaN split's NaN stays in out and lse
    l_safe = jnp.where(empty, 1.0, l)
    acc_smem[...] = acc * lax.broadcast_in_dim(1.0 / l_safe, (HB, RN), [1])
    lse_out_smem[...] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem, out_ref.at[b, h, pl.ds(c * HB, HB)])
    pl.when(c == 0)(lambda: plgpu.copy_smem_to_gmem(lse_out_smem, lse_out_ref.at[b, h]))
    plgpu.wait_smem_to_gmem(0)

  out_t, lse_t = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, K, H, RN), jnp.float32), jax.ShapeDtypeStruct((B, K, RN), jnp.float32)),
      grid=(H // HB, K, B),
      grid_names=("hblock", "heads", "batch"),
      scratch_types=[plgpu.SMEM((S2, RN), jnp.float32), plgpu.SMEM((HB, RN), jnp.float32),
                     plgpu.SMEM((RN,), jnp.float32), plgpu.Barrier(num_barriers=1)],
  )(o, lse)
  return heads_from_transposed(out_t, lse_t, T, G, out_dtype)


FLAT_VALUES = 2              # partial values per thread of a `combine_splits_flat` CTA
_FLAT_UNROLL = 64            # splits up to which its loops over the splits are unrolled (their loads in flight)


def combine_splits_flat(o, lse_full, *, T: int, G: int, out_dtype):
  """`combine_splits` on partials whose lse the decode kernel stores broadcast over the head dim:
  o, lse_full [B, K, S, H, RN] float32 (every written split; lse_full[b, h, s, :, r] = split s's lse of row r) ->
  (out [B, T, K * G, H] out_dtype, lse [B, T, K * G] float32).

  The join is then elementwise over each (b, h)'s flat H * RN values: one CTA takes (b, h, a chunk of 128 *
  FLAT_VALUES of them), reads the maximum m over the splits' lse, then adds o_s exp(lse_s - m) and exp(lse_s - m),
  all by plain loads (each thread its own values; no shared memory, TMA or register layout to match), and stores
  acc / l; the first chunk (head-dim row 0 of every query row) also stores m + log l. It reads three times the
  partials' bytes (o once, the lse twice) in no shared-memory round trips."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  B, K, S, H, RN = o.shape
  F, C = H * RN, 128 * FLAT_VALUES
  if lse_full.shape != o.shape or F % C or T * G > RN:
    raise ValueError(f"partials {tuple(o.shape)} and lse {tuple(lse_full.shape)} for {T=} {G=}: the flat combine "
                     f"takes lse of the partials' shape, H * RN a multiple of {C}, and RN >= T * G")

  def body(o_ref, l_ref, out_ref, lse_out_ref):
    b, h, c = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("chunk")
    cols = pl.ds(c * C, C)
    lse = lambda s: l_ref[b, h, s, cols]

    def over_splits(fn, carry, start=0):
      if S <= _FLAT_UNROLL:
        for s in range(start, S):
          carry = fn(s, carry)
        return carry
      return lax.fori_loop(start, S, fn, carry)

    m = over_splits(lambda s, m: jnp.maximum(m, lse(s)), jnp.maximum(lse(0), _M_FLOOR), start=1)

    def add(s, carry):
      acc, l = carry
      w = jnp.exp(lse(s) - m)
      return acc + o_ref[b, h, s, cols] * w, l + w

    zero = m * 0.0                       # m is finite: zeros in the loads' register layout (a loop carries it)
    acc, l = over_splits(add, (zero, zero))
    empty = l == 0                       # not l > 0 failing: a NaN split's NaN stays in out and lse
    l_safe = jnp.where(empty, 1.0, l)
    out_ref[b, h, cols] = acc / l_safe

    @pl.when(c == 0)
    def _():
      lse_out_ref[b, h] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))

  out_t, lse_t = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, K, F), jnp.float32), jax.ShapeDtypeStruct((B, K, C), jnp.float32)),
      grid=(F // C, K, B),
      grid_names=("chunk", "heads", "batch"),
  )(o.reshape(B, K, S, F), lse_full.reshape(B, K, S, F))
  return heads_from_transposed(out_t.reshape(B, K, H, RN), lse_t[:, :, :RN], T, G, out_dtype)
