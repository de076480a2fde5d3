"""The fp8 page write's scale rule in float32 bit operations, and its operands' contract: what the Triton
(lcjax.ops.triton.page_write) and Mosaic GPU (lcjax.ops.mosaic_gpu.page_write) page writers share.

A page's scale is lcjax.cache.kv.scale_for's power of two; both kernels compute it from the absmax's bits and
divide by it as a multiplication by its exact reciprocal, so that they write lcjax.cache.kv._write_one_token's
bytes bit for bit. Plain jnp: traced inside either kernel, and by the tests.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_FLOOR_EXP = 127 - 32    # biased float32 exponent of lcjax.cache.kv.SCALE_FLOOR, 2^-32
MANTISSA = (1 << 23) - 1
MANTISSA_1_75 = 3 << 21        # mantissa bits of 1.75


def token_scale(absmax):
  """lcjax.cache.kv.scale_for(absmax) for float32 absmax >= 0, from its bits: absmax = m 2^E with 448 = 1.75 2^8,
  so the smallest power of two s with absmax <= 448 s is 2^(E-8) for m <= 1.75 and 2^(E-7) above, at least 2^-32.
  No division: scale_for's absmax / 448 rounds to nearest, and never onto a power of two from above (the
  smallest excess, (1.75 + 2^-23) 2^E / 448 = 2^(E-8) (1 + 2^-23 / 1.75), is 0.57 ulp), so both rules give the
  same scale. An infinite or NaN absmax gets 1, as from scale_for."""
  bits = jax.lax.bitcast_convert_type(absmax, jnp.int32)
  e = jnp.where((bits & MANTISSA) <= MANTISSA_1_75, (bits >> 23) - 8, (bits >> 23) - 7)
  e = jnp.where((bits >> 23) == 255, 127, jnp.maximum(e, SCALE_FLOOR_EXP))
  return jax.lax.bitcast_convert_type(e << 23, jnp.float32)


def reciprocal(s):
  """1 / s for a float32 power of two s in [2^-126, 2^126], exact."""
  return jax.lax.bitcast_convert_type((254 - (jax.lax.bitcast_convert_type(s, jnp.int32) >> 23)) << 23, jnp.float32)


def check_operands(k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, shape_reason) -> None:
  """ValueError (one line naming them) unless the pools are float8_e4m3fn [L, Pl, Z, K, H], the scales float32
  [L, Pl, K], the tokens [B, K, H] and the pages and offsets [B], and shape_reason(Z, H) (a writer's
  `unsupported_shape`) is None."""
  L, Pl, Z, K, H = k_pool.shape
  B = k_new.shape[0]
  why = shape_reason(Z, H)
  if why:
    raise ValueError(why)
  e4m3, f32 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)
  if ((k_pool.dtype, v_pool.dtype, k_scale.dtype, v_scale.dtype) != (e4m3, e4m3, f32, f32)
      or not (v_pool.shape == k_pool.shape and k_scale.shape == v_scale.shape == (L, Pl, K)
              and k_new.shape == v_new.shape == (B, K, H) and page.shape == offset.shape == (B,))):
    raise ValueError(f"pools {k_pool.dtype}{tuple(k_pool.shape)} / {v_pool.dtype}{tuple(v_pool.shape)}, scales "
                     f"{k_scale.dtype}{tuple(k_scale.shape)} / {v_scale.dtype}{tuple(v_scale.shape)}, tokens "
                     f"{tuple(k_new.shape)} / {tuple(v_new.shape)}, pages {tuple(page.shape)}, offsets "
                     f"{tuple(offset.shape)}: need float8_e4m3fn pools [L, Pl, Z, K, H], float32 scales [L, Pl, K], "
                     "tokens [B, K, H], pages and offsets [B]")
