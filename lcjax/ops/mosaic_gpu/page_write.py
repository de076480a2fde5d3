"""A decode step's K and V into fp8 pages in Pallas Mosaic GPU: lcjax.ops.triton.page_write's contract and bytes.

`lcjax.cache.kv` stores fp8 pages as x / scale, one power-of-two float32 scale per (layer, page, kv head). A decode
step writes one token per row: the row's page scale becomes the max of the one it had (none when the token opens
the page) and the token's own (`lcjax.ops.page_scale.token_scale` of its absmax), the values already in the page
are multiplied by old / new scale (a power of two, exact; 0 when the token opens the page), and the token is
quantized with the new scale. The result is lcjax.cache.kv._write_one_token's, bit for bit.

One CTA (one warpgroup) per (row b, kv head h) does K, then V: it reads the old scale, brings the token's [H]
values by TMA, reduces their absmax across the warpgroup, stores the quantized token row by TMA and the new scale
as a scalar, and reads and rewrites the head's [Z, H] page slice by TMA only when the scale changed. K and V have
shared-memory buffers of their own for the token, so V's never overwrite K's while a TMA store still reads them.
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
from lcjax.ops.fp8 import E4M3_MAX
from lcjax.ops.hardware import jax_at_least, sm90_fp8_reason
from lcjax.ops.mosaic_gpu.common import smem_transforms


MAX_SLICE_BYTES = 192 * 1024    # a page's [Z, H] e4m3 slice in shared memory, with the token buffers beside it


def unsupported_shape(page_size: int, head_dim: int) -> str | None:
  """Why the kernel cannot write pages of this shape (None: it can): a token row of 128 values is a vector of one
  value per thread of the warpgroup, and a page slice [page_size, 128] is a register tile of whole 64-row blocks
  (at head_dim 64 or 16-row pages the lowering's layout inference finds no layout), held in shared memory whole
  (at most MAX_SLICE_BYTES: 2,048-token pages exceed a CTA's shared memory)."""
  if head_dim != 128:
    return f"the Mosaic GPU fp8 page writer is built for head_dim 128, got {head_dim}"
  if page_size % 64 or page_size * head_dim > MAX_SLICE_BYTES:
    return (f"the Mosaic GPU fp8 page writer needs a page_size that is a multiple of 64 and at most "
            f"{MAX_SLICE_BYTES // head_dim}, got {page_size}")
  return None


def refs_into_kernels() -> bool:
  """Whether Mosaic GPU kernels take mutable refs (`jax.new_ref`) as operands, aliased in place: JAX 0.11+."""
  return jax_at_least(0, 11)


def unsupported(page_size: int, head_dim: int) -> str | None:
  """Why the kernel cannot be compiled here for pages of this shape (None: it can): a Hopper GPU (TMA; e4m3
  converted in hardware), JAX 0.11 or later (mutable refs into Mosaic GPU kernels), and `unsupported_shape`."""
  reason = sm90_fp8_reason("Mosaic GPU fp8 page writer", "TMA")
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

  def body(layer_ref, page_ref, offset_ref, x_ref, k_ref, v_ref, ks_ref, vs_ref, x_smem, y_smem, ratio_smem,
           slice_smem, bars):
    b, h = lax.axis_index("rows"), lax.axis_index("heads")
    p = page_ref[b]

    @pl.when((p >= 0) & (p < Pl))
    def _():
      off, l = offset_ref[b], layer_ref[0]
      for c, (pool, scale) in enumerate(((k_ref, ks_ref), (v_ref, vs_ref))):
        old = jnp.where(off == 0, 0.0, scale[l, p, h])                   # 0: the token opens the page
        plgpu.copy_gmem_to_smem(x_ref.at[b, c, h], x_smem.at[c], bars.at[2 * c])
        plgpu.barrier_wait(bars.at[2 * c])
        x = x_smem[c]
        # The scale rule's bit operations run on [H] vectors (the lowering bitcasts no scalars): every lane
        # holds the same absmax, new scale and ratio; the reductions back to one value are exact.
        lanes = lambda v: lax.broadcast_in_dim(v, x.shape, ())
        new = jnp.maximum(lanes(old), page_scale.token_scale(lanes(jnp.max(jnp.abs(x)))))
        inv = page_scale.reciprocal(new)
        y_smem[c] = jnp.clip(x * inv, -E4M3_MAX, E4M3_MAX).astype(e4m3)
        ratio_smem[c] = jnp.max(lanes(old) * inv)                         # 1: the page keeps its values
        plgpu.commit_smem()
        ratio = ratio_smem[c]
        slot = pool.at[l, p, :, h]                                        # [Z, H]

        @pl.when(ratio != 1.0)
        def _requantize():
          plgpu.copy_gmem_to_smem(slot, slice_smem, bars.at[2 * c + 1])
          plgpu.barrier_wait(bars.at[2 * c + 1])
          slice_smem[...] = (slice_smem[...].astype(jnp.float32) * ratio).astype(e4m3)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(slice_smem, slot)
          plgpu.wait_smem_to_gmem(0)                                      # the slice lands before the token row

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem.at[c], pool.at[l, p, off, h])
        plgpu.wait_smem_to_gmem(0)
        scale[l, p, h] = jnp.max(new)

  x = precision.widen(jnp.stack([k_new, v_new], axis=1))                  # [B, 2, K, H], k_new's values exactly
  refs = [jax.new_ref(a) for a in (k_pool, v_pool, k_scale, v_scale)]
  plgpu.kernel(
      body,
      out_type=(),
      grid=(B, K),
      grid_names=("rows", "heads"),
      scratch_types=[plgpu.SMEM((2, H), jnp.float32), plgpu.SMEM((2, H), e4m3), plgpu.SMEM((2,), jnp.float32),
                     plgpu.SMEM((Z, H), e4m3, transforms=smem_transforms(e4m3, H)),
                     plgpu.Barrier(num_barriers=4)],
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), page.astype(jnp.int32), offset.astype(jnp.int32), x, *refs)
  return tuple(r[...] for r in refs)
