"""A decode step's K and V into fp8 pages in one kernel (Pallas, Triton lowering), pages and scales in place.

`lcjax.cache.kv` stores fp8 pages as x / scale, one power-of-two float32 scale per (layer, page, kv head), and a
decode step writes one token per row: the row's page scale becomes the max of the one it had (none when the token
opens the page) and the token's own, the values already in the page are multiplied by old / new scale (a power of
two, exact; 1 where the scale did not grow), and the token is quantized with the new scale. In XLA that is nine
small kernels a layer (0.42 ms of a Llama-3-8B token at 128K in one trace; replacing them saved 0.2 ms a token on
the 8B and 0.5 ms on the 70B: benchmarks/NOTES-fp8w.md, calls 9, 15 and 16). Here one launch does all of it, one
program per (row b, kv head h, K or V): it reads the token and the old scale, computes the new scale by
`scale_for`'s rule from the absmax's bits (lcjax.ops.page_scale), stores it and the token's row, and reads and
rewrites the head's [Z, H] page slice only when the scale grew (or the token opens the page). Pools and scales
are the call's outputs aliased to its inputs, so nothing is copied.

The result is bit for bit `lcjax.cache.kv._write_one_token`'s: every scale and ratio is a power of two, divisions
are multiplications by an exact reciprocal (2^-e built from the exponent bits), and the float32 -> e4m3 convert
rounds to nearest even, as XLA's does (values are clipped to +-448 first, and non-finite ones made NaN:
lcjax.ops.fp8.clip_finite).

Pools of 2 to 4 GiB are read and written as uint16 pairs of e4m3 bytes (`lcjax.ops.triton.gemv.pack_for`): the
Triton lowering addresses arrays of at most 4 GiB with 32-bit signed element offsets, which wrap past 2^31
elements; two-byte elements keep every offset below 2^31. The pair's low byte is head-dim column 2c, so the token
is read as its even and odd columns (strided loads). Larger pools get 64-bit offsets and are read byte by byte.

Rows whose page is `Pl` (the pool's page count: a token of another shard's page, or a padding row's) write
nothing (lcjax.cache.kv maps padding rows' null page to `Pl`). Two rows must not write the same page, as for
`_write_one_token`.

Legend: L layers, Pl pages (of this shard), Z page size, K kv heads, H head dim, B rows, `pack` e4m3 values per
loaded element.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lcjax.ops import page_scale
from lcjax.ops.fp8 import clip_finite
from lcjax.ops.triton.gemv import as_pairs, pack_for, pair_value
from lcjax.ops import hardware


def unsupported_shape(page_size: int, head_dim: int) -> str | None:
  """Why the kernel cannot write pages of this shape (None: it can): Triton tensors need power-of-two sides."""
  for name, n in (("page_size", page_size), ("head_dim", head_dim)):
    if n < 2 or n & (n - 1):
      return f"the fp8 page-write kernel needs a power-of-two {name} of at least 2, got {n}"
  return None


def unsupported(page_size: int, head_dim: int) -> str | None:
  """Why the kernel cannot be compiled here for pages of this shape (None: it can): a CUDA GPU that converts e4m3
  in hardware (sm_89+; measured on sm_90), JAX's Pallas Triton lowering and `unsupported_shape`."""
  return (hardware.fp8_convert_reason("fp8 page-write kernel") or hardware.pallas_triton_reason()
          or unsupported_shape(page_size, head_dim))


def _write_one(b, h, layer, page, offset, x_ref, c, pool_ref, scale_ref, *, pages: int, pack: int, interpret: bool):
  """Row b's token of kv head h into its page of one pool (pool ref [L, Pl, Z, K, H / pack], scale ref [L, Pl, K];
  x_ref [B, 2, K, pack, H / pack] holds the K (c = 0) and V (c = 1) tokens' columns j mod pack at j). The page's
  other rows are read and rewritten only when its scale grows (or the token opens it: they are zeroed); otherwise
  the scale and the token's row are the only stores, so a step costs one round trip to memory."""
  from jax.experimental.pallas import triton as pltriton
  keep = (page >= 0) & (page < pages)                # False for rows that write nothing here
  pc = jnp.clip(page, 0, pages - 1)
  old = jnp.where(offset == 0, 0.0, scale_ref[layer, pc, h])                # 0: the token opens the page
  if not interpret:     # every thread loads the scale, one stores the new one below: all loads come first
    pltriton.debug_barrier()
  xs = [x_ref[b, c, h, j, :].astype(jnp.float32) for j in range(pack)]       # pack x [H / pack]
  absmax = jnp.abs(xs[0]).max()
  for xj in xs[1:]:
    absmax = jnp.maximum(absmax, jnp.abs(xj).max())
  new = jnp.maximum(old, page_scale.token_scale(absmax))
  inv = page_scale.reciprocal(new)
  ratio = old * inv                                  # 1: the page keeps its values
  slot = pool_ref.at[layer, pc, :, h, :]             # [Z, H / pack]
  shape = slot.shape
  grew = jnp.broadcast_to(keep & (ratio != 1.0), shape)
  stored = pltriton.load(slot, mask=grew, other=jnp.zeros((), pool_ref.dtype))
  here = jax.lax.broadcasted_iota(jnp.int32, shape, 0) == offset
  out = None
  for j in range(pack):
    sj = stored if pack == 1 else pair_value(stored, j)
    y = clip_finite(xs[j], xs[j] * inv)                        # [H / pack]
    vj = jnp.where(here, jnp.broadcast_to(y[None, :], shape), sj.astype(jnp.float32) * ratio)
    vj = vj.astype(jnp.float8_e4m3fn)
    if pack == 1:
      out = vj
    else:
      part = jax.lax.bitcast_convert_type(vj, jnp.uint8).astype(jnp.uint16) << jnp.uint16(8 * j)
      out = part if out is None else out | part
  pltriton.store(slot, out, mask=grew | (here & keep))
  pltriton.store(scale_ref.at[layer, pc, h], new, mask=keep)


def _kernel(layer_ref, page_ref, offset_ref, x_ref, k_in, v_in, ks_in, vs_in, k_ref, v_ref, ks_ref, vs_ref, *,
            pages: int, pack: int, interpret: bool):
  """Program (b, h, c): row b's token of kv head h into its K page (c = 0) or its V page (c = 1)."""
  from jax.experimental import pallas as pl
  del k_in, v_in, ks_in, vs_in                       # aliased to the outputs
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  args = (b, h, layer_ref[0], page_ref[b], offset_ref[b])
  for i, refs in enumerate(((k_ref, ks_ref), (v_ref, vs_ref))):
    pl.when(c == i)(lambda i=i, refs=refs: _write_one(*args, x_ref, i, *refs, pages=pages, pack=pack,
                                                      interpret=interpret))


def write_token(k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, layer, *, num_warps: int = 4,
                pack: int | None = None, interpret: bool = False):
  """Row b's token k_new[b], v_new[b] [K, H] into page page[b] (local; Pl: written nowhere) at offset[b] of layer
  `layer` of fp8 pools [L, Pl, Z, K, H] with scales [L, Pl, K]. Returns (k_pool, v_pool, k_scale, v_scale), the
  pools updated in place (donate them). pack: e4m3 values per loaded element, 1 or 2 (None: `pack_for` the
  pool's size)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
  L, Pl, Z, K, H = k_pool.shape
  B = k_new.shape[0]
  page_scale.check_operands(k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, unsupported_shape)
  pack = pack or pack_for(k_pool.size)
  if pack not in (1, 2) or (pack == 1 and pack_for(k_pool.size) == 2 and not interpret):
    raise ValueError(f"pack={pack} for pools of {k_pool.size} bytes: 1 or 2, and 2 for pools of 2 to 4 GiB")
  pools = (k_pool, v_pool)
  if pack == 2:
    pools = tuple(as_pairs(p) for p in pools)
  # K and V in one operand [B, 2, K, pack, H / pack]: XLA makes it in one fusion with what produces them.
  x = jnp.moveaxis(jnp.stack([k_new, v_new], axis=1).reshape(B, 2, K, H // pack, pack), 4, 3)
  whole = pl.no_block_spec
  out = pl.pallas_call(
      lambda *refs: _kernel(*refs, pages=Pl, pack=pack, interpret=interpret),
      grid=(B, K, 2),
      in_specs=[whole] * 8,
      out_specs=[whole] * 4,
      out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*pools, k_scale, v_scale)],
      input_output_aliases={4: 0, 5: 1, 6: 2, 7: 3},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="lcjax_fp8_page_write",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), page.astype(jnp.int32), offset.astype(jnp.int32), x, *pools,
    k_scale, v_scale)
  k_out, v_out, ks, vs = out
  if pack == 2:
    k_out, v_out = (jax.lax.bitcast_convert_type(p, jnp.float8_e4m3fn).reshape(L, Pl, Z, K, H) for p in (k_out, v_out))
  return k_out, v_out, ks, vs
