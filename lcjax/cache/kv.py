"""The device side of the paged KV cache: page pools and jit-safe writes.

K and V live in one array each, `[L, P, Z, K, H]` (layers, pages, page size, kv heads, head dim). Page 0 is the
null page: unused page-table slots and padded tokens point at it, and it is never read unmasked. A token's
cache slot is `page * Z + offset`; the host allocator (`lcjax.cache.pages`) computes slots and page tables, the
device only scatters into them. Pools are donated through every jitted step, so writes happen in place.

FP8 pools (`float8_e4m3fn`) carry one float32 scale per (layer, kv head): values are stored as x / scale. The
scales are fixed when the cache is made (from the model's expected K/V range), so a page written token by token
never needs re-quantizing.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
  k: jax.Array                        # [L, P, Z, K, H]
  v: jax.Array                        # [L, P, Z, K, H]
  k_scale: jax.Array | None = None    # [L, K] float32, fp8 pools only
  v_scale: jax.Array | None = None

  @property
  def page_size(self) -> int:
    return self.k.shape[2]

  @property
  def num_pages(self) -> int:
    return self.k.shape[1]

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None

  def nbytes(self) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self))


def cache_shape(n_layers, num_pages, page_size, n_kv_heads, head_dim):
  return (n_layers, num_pages, page_size, n_kv_heads, head_dim)


def init_cache(n_layers, num_pages, page_size, n_kv_heads, head_dim, dtype, *, fp8_scale=None,
               sharding=None) -> PagedKV:
  """A zeroed pool. For fp8, `fp8_scale` [L, 2, K] (or a scalar) is the largest |k| and |v| per layer and kv
  head that the pool must represent; scale = absmax / 448."""
  shape = cache_shape(n_layers, num_pages, page_size, n_kv_heads, head_dim)
  dtype = jnp.dtype(dtype)

  def zeros():
    return jnp.zeros(shape, dtype)

  make = jax.jit(zeros, out_shardings=sharding) if sharding is not None else zeros
  k, v = make(), make()
  if dtype != jnp.float8_e4m3fn:
    return PagedKV(k, v)
  absmax = jnp.broadcast_to(jnp.asarray(16.0 if fp8_scale is None else fp8_scale, jnp.float32),
                            (n_layers, 2, n_kv_heads))
  # Two distinct buffers: the cache is donated, and one buffer cannot be donated twice.
  return PagedKV(k, v, absmax[:, 0] / FP8_MAX, absmax[:, 1] / FP8_MAX)


def quantize(x, scale):
  """x [..., K, H] -> pool dtype; scale [K] float32 (fp8 pools) or None."""
  if scale is None:
    return x
  y = x.astype(jnp.float32) / scale[:, None]
  return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def write_layer(pool_l, new, slots):
  """Scatter new [B, T, K, H] (already in pool dtype) into pool_l [P, Z, K, H] at flat slots [B, T]."""
  P, Z, K, H = pool_l.shape
  flat = pool_l.reshape(P * Z, K, H)
  flat = flat.at[slots.reshape(-1)].set(new.reshape(-1, K, H).astype(pool_l.dtype))
  return flat.reshape(P, Z, K, H)


def copy_pages(cache: PagedKV, src, dst) -> PagedKV:
  """Copy-on-write: pages src [C] -> dst [C] in every layer (for a shared, partly filled last page)."""
  return dataclasses.replace(cache, k=cache.k.at[:, dst].set(cache.k[:, src]),
                             v=cache.v.at[:, dst].set(cache.v[:, src]))
