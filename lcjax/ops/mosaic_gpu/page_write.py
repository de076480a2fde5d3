"""A decode step's K and V into fp8 pages in Pallas Mosaic GPU: lcjax.ops.triton.page_write's contract and bytes.

`lcjax.cache.kv` stores fp8 pages as x / scale, one power-of-two float32 scale per (layer, page, kv head). A decode
step writes one token per row: the row's page scale becomes the max of the one it had (none when the token opens
the page) and the token's own (`lcjax.ops.page_scale.token_scale` of its absmax), the values already in the page
are multiplied by old / new scale (a power of two, exact; 0 when the token opens the page), and the token is
quantized with the new scale. The result is lcjax.cache.kv._write_one_token's, bit for bit.

One CTA (one warpgroup) per (row b, kv head h, K or V): it reads the old scale and the token's [H] values (one a
thread) by plain loads, reduces their absmax across the warpgroup, stores the quantized token row and the new
scale, and reads and rewrites the head's [Z, H] page slice (in registers) only when the scale changed. A call's
time is this chain of memory round trips, so nothing goes through shared memory or TMA, and K and V do not wait
for each other (1.9 us a call on an H100, the Triton writer 2.1: benchmarks/NOTES-attention). The scale is
stored after the ratio's cross-thread reduction, which every thread reaches with the old scale read.
Rows whose page is out of the pool (`Pl`: a padding row's, or a page of another shard) write nothing.

The pools and scales are written in place: they enter the kernel as mutable refs (`jax.new_ref`), which the
lowering turns into operands aliased to the custom call's outputs (no copy of a pool; tests/test_mosaic_lowering.py
checks the alias). Two rows must not write the same page, as for `_write_one_token`.

Legend: L layers, Pl pages (of this shard), Z page size, K kv heads, H head dim, B rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lcjax.ops import page_scale, precision
from lcjax.ops.fp8 import clip_finite
from lcjax.ops.hardware import jax_at_least, sm90_fp8_reason


MAX_PAGE_SIZE = 128    # a requantized page slice [Z, 128] is Z float32 values a thread of the warpgroup


def unsupported_shape(page_size: int, head_dim: int) -> str | None:
  """Why the kernel cannot write pages of this shape (None: it can): a token row of 128 values is a vector of one
  value per thread of the warpgroup, and a page slice [page_size, 128] is requantized as a register array of whole
  64-row blocks (at head_dim 64 or 16-row pages the lowering's layout inference finds no layout) of at most
  MAX_PAGE_SIZE rows."""
  if head_dim != 128:
    return f"the Mosaic GPU fp8 page writer is built for head_dim 128, got {head_dim}"
  if page_size % 64 or page_size > MAX_PAGE_SIZE:
    return (f"the Mosaic GPU fp8 page writer needs a page_size that is a multiple of 64 and at most "
            f"{MAX_PAGE_SIZE}, got {page_size}")
  return None


def refs_into_kernels() -> bool:
  """Whether Mosaic GPU kernels take mutable refs (`jax.new_ref`) as operands, aliased in place: JAX 0.11+."""
  return jax_at_least(0, 11)


def unsupported(page_size: int, head_dim: int) -> str | None:
  """Why the kernel cannot be compiled here for pages of this shape (None: it can): a Hopper GPU (e4m3 converted
  in hardware; the Mosaic GPU lowering as tested), JAX 0.11 or later (mutable refs into Mosaic GPU kernels), and
  `unsupported_shape`."""
  reason = sm90_fp8_reason("Mosaic GPU fp8 page writer", "its Mosaic GPU lowering")
  if not reason and not refs_into_kernels():
    reason = (f"the Mosaic GPU fp8 page writer writes the pools in place through mutable refs, which Mosaic GPU "
              f"kernels take from JAX 0.11 (this is {jax.__version__})")
  return reason or unsupported_shape(page_size, head_dim)


def write_token(k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, layer):
  """Row b's token k_new[b], v_new[b] [K, H] into page page[b] (local; Pl: written nowhere) at offset[b] of layer
  `layer` of fp8 pools [L, Pl, Z, K, H] with scales [L, Pl, K]. Returns (k_pool, v_pool, k_scale, v_scale), the
  pools updated in place under jit when donated (called eagerly, each pool is copied into its ref). Inside a
  shard_map, the map must be built with check_vma=False (Mosaic GPU kernels take no refs of varying manual axes),
  as lcjax.model.llama's are."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  _, Pl, Z, K, H = k_pool.shape
  B = k_new.shape[0]
  page_scale.check_operands(k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, unsupported_shape)
  e4m3 = jnp.float8_e4m3fn

  def body(layer_ref, page_ref, offset_ref, x_ref, k_ref, v_ref, ks_ref, vs_ref):
    b, h, c = lax.axis_index("rows"), lax.axis_index("heads"), lax.axis_index("kv")
    p = page_ref[b]

    def write(pool, scale):
      off, l = offset_ref[b], layer_ref[0]
      old = jnp.where(off == 0, 0.0, scale[l, p, h])                     # 0: the token opens the page
      x = x_ref[b, c, h]                                                  # [H] float32, one value a thread
      # The scale rule's bit operations run on [H] vectors (the lowering bitcasts no scalars): every lane holds
      # the same absmax, new scale and ratio; the reductions back to one value are exact.
      lanes = lambda v: lax.broadcast_in_dim(v, x.shape, ())
      new = jnp.maximum(lanes(old), page_scale.token_scale(lanes(jnp.max(jnp.abs(x)))))
      inv = page_scale.reciprocal(new)
      ratio = jnp.max(lanes(old) * inv)                                   # 1: the page keeps its values

      @pl.when(ratio != 1.0)
      def _requantize():
        slot = pool.at[l, p, :, h]                                        # [Z, H]
        slot[...] = (slot[...].astype(jnp.float32) * ratio).astype(e4m3)
        _warpgroup_barrier()                    # row `off` of the slice lands before the token's row

      pool[l, p, off, h] = clip_finite(x, x * inv).astype(e4m3)
      scale[l, p, h] = jnp.max(new)

    inside = (p >= 0) & (p < Pl)
    pl.when(inside & (c == 0))(lambda: write(k_ref, ks_ref))
    pl.when(inside & (c == 1))(lambda: write(v_ref, vs_ref))

  def _warpgroup_barrier():
    """bar.sync over the warpgroup's 128 threads: each thread's global stores before it are ordered before every
    thread's after it (PTX's memory model for bar.sync participants), so a row that two threads write holds the
    later store."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu()
    def _(_ctx):
      mgpu_utils.warpgroup_barrier()

  x = precision.widen(jnp.stack([k_new, v_new], axis=1))                  # [B, 2, K, H], k_new's values exactly
  refs = [jax.new_ref(a) for a in (k_pool, v_pool, k_scale, v_scale)]
  plgpu.kernel(
      body,
      out_type=(),
      grid=(B, K, 2),
      grid_names=("rows", "heads", "kv"),
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), page.astype(jnp.int32), offset.astype(jnp.int32), x, *refs)
  return tuple(r[...] for r in refs)
