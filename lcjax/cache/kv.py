"""The device side of the paged KV cache: page pools and jit-safe writes.

K and V live in one array each, `[L, P, Z, K, H]` (layers, pages, page size, kv heads, head dim). Page 0 is the
null page: unused page-table slots and padded tokens point at it, and it is never read unmasked. A token's
cache slot is `page * Z + offset`; the host allocator (`lcjax.cache.pages`) computes slots and page tables, the
device only scatters into them. Pools are donated through every jitted step, so writes happen in place.

FP8 pools (`float8_e4m3fn`) carry one float32 scale per (layer, kv head): values are stored as x / scale. The
scales are fixed when the cache is made (from the model's expected K/V range), so a page written token by token
never needs re-quantizing.

On a mesh the pools shard pages on `seq` and kv heads on `tensor` (`POOL_AXES`). Shard d of S holds the global
pages [d * P/S, (d+1) * P/S) as its local pages 0 .. P/S - 1, local page 0 being its null page, and by the host
allocator's placement policy (lcjax.cache.pages) page-table slot m of every sequence lives on shard m % S. Inside
shard_map, `shard_table`, `shard_lengths` and `write_shard` turn the global page table, lengths and slots into
this shard's view, so the attention kernels see an ordinary (smaller) paged cache.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lcjax.sharding import named_sharding

FP8_MAX = 448.0  # largest finite float8_e4m3fn
POOL_AXES = ("layers", "pages", None, "kv_heads", "head_dim")    # [L, P, Z, K, H]
SCALE_AXES = ("layers", "kv_heads")                              # [L, K]


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


def cache_shardings(mesh, quantized: bool) -> PagedKV:
  """The NamedSharding of each pool array on `mesh` (a PagedKV of shardings: a jit out_shardings tree)."""
  pool = named_sharding(mesh, POOL_AXES)
  scale = named_sharding(mesh, SCALE_AXES) if quantized else None
  return PagedKV(pool, pool, scale, scale)


def init_cache(n_layers, num_pages, page_size, n_kv_heads, head_dim, dtype, *, fp8_scale=None,
               mesh=None) -> PagedKV:
  """A zeroed pool, sharded on `mesh` when one is given (made in place on each device, never gathered).

  For fp8, `fp8_scale` [L, 2, K] (or a scalar) is the largest |k| and |v| per layer and kv head that the pool
  must represent; scale = absmax / 448."""
  shape = cache_shape(n_layers, num_pages, page_size, n_kv_heads, head_dim)
  dtype = jnp.dtype(dtype)
  fp8 = dtype == jnp.float8_e4m3fn
  absmax = jnp.broadcast_to(jnp.asarray(16.0 if fp8_scale is None else fp8_scale, jnp.float32),
                            (n_layers, 2, n_kv_heads))

  def make(absmax):
    # Two distinct buffers: the cache is donated, and one buffer cannot be donated twice.
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if not fp8:
      return PagedKV(k, v)
    return PagedKV(k, v, absmax[:, 0] / FP8_MAX, absmax[:, 1] / FP8_MAX)

  out = cache_shardings(mesh, fp8) if mesh is not None else None
  return jax.jit(make, out_shardings=out)(absmax)


def quantize(x, scale):
  """x [..., K, H] -> pool dtype; scale [K] float32 (fp8 pools) or None."""
  if scale is None:
    return x
  y = x.astype(jnp.float32) / scale[:, None]
  return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def write_layer(pool, new, slots, layer):
  """Scatter new [B, T, K, H] (already in pool dtype) into layer `layer` of the whole pool [L, P, Z, K, H] at
  flat slots [B, T] (page * Z + offset).

  The scatter indexes (layer, page, offset) of the 5-d pool, in place: a scatter into a reshaped view
  ([L*P*Z, K, H]) makes XLA copy the whole pool on every call when K is 1 (it relayouts the unit dimension),
  and K is 1 per device for Llama-3-70B on 8 tensor devices."""
  Z = pool.shape[2]
  s = slots.reshape(-1)
  return pool.at[layer, s // Z, s % Z].set(new.reshape(-1, *pool.shape[3:]).astype(pool.dtype))


def copy_pages(cache: PagedKV, src, dst) -> PagedKV:
  """Copy-on-write: pages src [C] -> dst [C] in every layer (for a shared, partly filled last page)."""
  return dataclasses.replace(cache, k=cache.k.at[:, dst].set(cache.k[:, src]),
                             v=cache.v.at[:, dst].set(cache.v[:, src]))


def gather_pages(cache: PagedKV, pages):
  """K, V of `pages` [n] in every layer: [L, n, Z, K, H] each (pages evicted to the host tier)."""
  return cache.k[:, pages], cache.v[:, pages]


def scatter_pages(cache: PagedKV, pages, k, v) -> PagedKV:
  """Write K, V [L, n, Z, K, H] into `pages` [n] of every layer (pages back from the host tier)."""
  return dataclasses.replace(cache, k=cache.k.at[:, pages].set(k.astype(cache.k.dtype)),
                             v=cache.v.at[:, pages].set(v.astype(cache.v.dtype)))


# -- one seq shard's view (inside shard_map over `seq`) -----------------------------------------------------------

def shard_table(page_table, shard, n_shards: int, pages_per_shard: int):
  """Global page table [B, M] -> shard `shard`'s local table [B, M / n_shards]: its slots shard, shard + S, ...
  as local page ids (a layer's pages in a pool viewed as [L * P/S, Z, K, H] are read through the backends'
  `page_offset`). M must be a multiple of n_shards; unused slots (global null page 0) become the local null
  page."""
  B, M = page_table.shape
  if M % n_shards:
    raise ValueError(f"page-table width M={M} is not divisible by {n_shards=}")
  cols = jax.lax.dynamic_index_in_dim(page_table.reshape(B, M // n_shards, n_shards), shard, axis=2,
                                      keepdims=False)                                   # [B, M/S]
  local = cols - shard * pages_per_shard
  return jnp.where((local >= 0) & (local < pages_per_shard), local, 0).astype(jnp.int32)


def shard_lengths(kv_len, shard, n_shards: int, width: int, page_size: int):
  """Valid tokens [B] of a local table of `width` slots: local slot j is the sequence's slot shard + j * S,
  holding tokens from (shard + j * S) * Z. Tokens fill slots in order, so they are a prefix of the local slots."""
  m = shard + n_shards * jnp.arange(width, dtype=jnp.int32)
  return jnp.clip(kv_len[:, None] - m[None, :] * page_size, 0, page_size).sum(axis=1).astype(jnp.int32)


def write_shard(pool, new, slots, shard, layer):
  """Scatter the tokens whose global slot lies on this shard into layer `layer` of its local pool
  [L, P/S, Z, K, H] (in place, as `write_layer`); new [B, T, K, H] (pool dtype), slots [B, T] global. Other
  shards' tokens are dropped here (they write them)."""
  Pl, Z = pool.shape[1:3]
  s = slots.reshape(-1)
  page = s // Z - shard * Pl
  page = jnp.where((page >= 0) & (page < Pl), page, Pl)            # out of bounds: dropped
  return pool.at[layer, page, s % Z].set(new.reshape(-1, *pool.shape[3:]).astype(pool.dtype), mode="drop")
