"""The device side of the paged KV cache: page pools and jit-safe writes.

K and V live in one array each, `[L, P, Z, K, H]` (layers, pages, page size, kv heads, head dim). Page 0 is the
null page: unused page-table slots and padded tokens point at it; it is never read unmasked, and writes to it
are dropped (`drop_null`). A token's cache slot is `page * Z + offset`; the host allocator (`lcjax.cache.pages`)
computes slots and page tables, the device only scatters into them. Pools are donated through every jitted step,
so writes happen in place.

FP8 pools (`float8_e4m3fn`) carry one float32 scale per (layer, page, kv head), `[L, P, K]`: values are stored as
x / scale. A page's scale is set by the tokens written into it: the smallest power of two that keeps every one of
them within e4m3's range (|x| / scale <= 448), so nothing is clipped; a value that is not finite is stored as NaN
(lcjax.ops.fp8.clip_finite), so that it reaches the logits as it does from bf16 pages. A write that brings a
larger token into a partly filled page raises its scale and requantizes the values already there. Scales are
powers of two, so that requantization only shifts exponents: a page written token by token holds the same e4m3
values as one written in one call (a value that drops into e4m3's subnormal range is rounded again). A write that
starts a page (a token at offset 0) drops the scale of the page's previous owner. FP8 pools hold the keys rotated
(`fp8_basis`): every write rotates them here, and every read of fp8 pages takes the queries rotated alike
(lcjax.model.llama).

On a mesh the pools shard pages on `seq` and kv heads on `tensor` (`POOL_AXES`, scales `SCALE_AXES`). Shard d of
S holds the global pages [d * P/S, (d+1) * P/S) as its local pages 0 .. P/S - 1, local page 0 being its null page,
and by the host allocator's placement policy (lcjax.cache.pages) page-table slot m of every sequence lives on
shard m % S. Inside shard_map, `shard_table`, `shard_lengths` and `write_kv(shard=...)` turn the global page table,
lengths and slots into this shard's view, so the attention kernels see an ordinary (smaller) paged cache.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lcjax.ops import fp8 as fp8_ops
from lcjax.ops import precision
from lcjax.sharding import named_sharding

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 2.0 ** -32    # the smallest page scale (an all-zero page's)
POOL_AXES = ("layers", "pages", None, "kv_heads", "head_dim")    # [L, P, Z, K, H]
SCALE_AXES = ("layers", "pages", "kv_heads")                     # [L, P, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
  k: jax.Array                        # [L, P, Z, K, H]
  v: jax.Array                        # [L, P, Z, K, H]
  k_scale: jax.Array | None = None    # [L, P, K] float32, fp8 pools only
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

  def parts(self) -> tuple:
    """The arrays that hold a page, each [L, P, ...]: (k, v), then (k_scale, v_scale) for fp8 pools."""
    return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())

  def nbytes(self) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self))


def cache_shape(n_layers, num_pages, page_size, n_kv_heads, head_dim):
  return (n_layers, num_pages, page_size, n_kv_heads, head_dim)


def cache_shardings(mesh, quantized: bool) -> PagedKV:
  """The NamedSharding of each pool array on `mesh` (a PagedKV of shardings: a jit out_shardings tree)."""
  pool = named_sharding(mesh, POOL_AXES)
  scale = named_sharding(mesh, SCALE_AXES) if quantized else None
  return PagedKV(pool, pool, scale, scale)


def init_cache(n_layers, num_pages, page_size, n_kv_heads, head_dim, dtype, *, mesh=None) -> PagedKV:
  """A zeroed pool (scales too: no page holds anything yet), sharded on `mesh` when one is given (made in place
  on each device, never gathered)."""
  shape = cache_shape(n_layers, num_pages, page_size, n_kv_heads, head_dim)
  dtype = jnp.dtype(dtype)
  fp8 = dtype == jnp.float8_e4m3fn

  def make():
    # Distinct buffers: the cache is donated, and one buffer cannot be donated twice.
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if not fp8:
      return PagedKV(k, v)
    scale = (n_layers, num_pages, n_kv_heads)
    return PagedKV(k, v, jnp.zeros(scale, jnp.float32), jnp.zeros(scale, jnp.float32))

  out = cache_shardings(mesh, fp8) if mesh is not None else None
  return jax.jit(make, out_shardings=out)()


def scale_for(absmax):
  """The page scale that holds values up to `absmax` (any shape): the smallest power of two >= absmax / 448, at
  least SCALE_FLOOR. A power of two, so x / scale and a change of scale only shift exponents."""
  a = jnp.maximum(jnp.asarray(absmax, jnp.float32) / FP8_MAX, SCALE_FLOOR)
  m, e = jnp.frexp(a)                                   # a = m * 2^e, m in [0.5, 1)
  return jnp.ldexp(jnp.ones_like(a), jnp.where(m == 0.5, e - 1, e))


def written_pages(slots, page_size: int):
  """The global pages a call's tokens land in: slots [B, T] -> [B, J], J = (T - 2) // Z + 2 (the most pages T
  consecutive tokens can span). A row's tokens fill consecutive positions, so its j-th page starts at token
  j * Z - (offset of its first token); indices clipped into the row repeat a page (harmless: the writes are
  identical), and padded tokens (slot 0) give the null page. Computed in the call's token order, before any
  layout permutation."""
  B, T = slots.shape
  Z = page_size
  J = (T - 2) // Z + 2
  idx = jnp.clip(jnp.arange(J, dtype=jnp.int32)[None, :] * Z - slots[:, :1] % Z, 0, T - 1)
  return jnp.take_along_axis(slots, idx, axis=1) // Z


def _local_pages(global_pages, first, pages: int):
  """Global page ids (any shape) -> ids in a pool holding the global pages first .. first + pages - 1; pages
  outside it, and the null page 0, -> `pages` (out of bounds: dropped by the writes).

  Padded tokens and finished decode rows have slot 0. Their writes are dropped rather than sent to the null page:
  a scatter of many rows into one page's slots serialises on the GPU (every padded row of a prefill chunk hits the
  same K * H elements), which cost more than the chunk's real rows."""
  page = global_pages - first
  return jnp.where((page >= 0) & (page < pages) & (global_pages != 0), page, pages)


def drop_null(pages, num_pages: int):
  """Page ids of a whole pool of `num_pages` pages, with the null page 0 mapped to `num_pages`: a write with
  mode="drop" then skips those rows (the rule `_local_pages` applies within a shard)."""
  return _local_pages(pages, 0, num_pages)


def _write(pool, scale, new, slots, pages, layer, first: int | jax.Array = 0):
  """Write new [B, T, K, H] at global slots [B, T] into layer `layer` of a pool [L, Pl, Z, K, H] holding the
  global pages first .. first + Pl - 1 (tokens of other pages are dropped). Returns (pool, scale).

  The scatter indexes (layer, page, offset) of the 5-d pool, in place: a scatter into a reshaped view
  ([L*P*Z, K, H]) makes XLA copy the whole pool on every call when K is 1 (it relayouts the unit dimension),
  and K is 1 per device for Llama-3-70B on 8 tensor devices.

  fp8 (scale [L, Pl, K], pages [B, J] = written_pages(slots)):
    1. a page written at offset 0 is new to its sequence: its scale (a previous owner's) is dropped; every page's
       scale becomes the max of what it had and scale_for(max_H |x|) of each of its new tokens (a scatter-max);
    2. the written pages whose scale grew are requantized: stored values times old / new scale, a power of two
       (0 for a new page: a previous owner's values are never read);
    3. the new tokens are quantized with their page's new scale and scattered."""
  Pl, Z = pool.shape[1:3]
  s = slots.reshape(-1)
  page = _local_pages(s // Z, first, Pl)
  x = new.reshape(-1, *pool.shape[3:])                              # [N, K, H]
  if scale is None:
    return pool.at[layer, page, s % Z].set(x.astype(pool.dtype), mode="drop"), None
  x = precision.widen(x)                                            # the model dtype's values, no excess precision
  if slots.shape[1] == 1:
    return _write_one_token(pool, scale, x, page, s % Z, layer)
  starts = jnp.where(s % Z == 0, page, Pl)
  scale = scale.at[layer, starts].set(0.0, mode="drop")
  wp = _local_pages(pages.reshape(-1), first, Pl)                   # [M] written pages, local
  wpc = jnp.minimum(wp, Pl - 1)
  old = scale[layer, wpc]                                           # [M, K]
  scale = scale.at[layer, page].max(scale_for(jnp.abs(x).max(axis=-1)), mode="drop")
  ratio = old / scale[layer, wpc]
  grew = jnp.any(ratio != 1.0, axis=-1)
  stored = (fp8_ops.take(pool, (layer, wpc)).astype(jnp.float32) * ratio[:, None, :, None]).astype(pool.dtype)
  pool = fp8_ops.set_at(pool, (layer, jnp.where(grew, wp, Pl)), stored, mode="drop")
  y = fp8_ops.clip_finite(x, x / scale[layer, jnp.minimum(page, Pl - 1)][:, :, None]).astype(pool.dtype)
  return fp8_ops.set_at(pool, (layer, page, s % Z), y, mode="drop"), scale


def _write_one_token(pool, scale, x, page, offset, layer):
  """fp8 `_write` of one token per row (decode): x [B, K, H] float32 at local pages [B] (Pl: dropped), offsets
  [B]. The same three steps as `_write` with each row's one page known, done as one page-sized update: the page's
  scale (0 when the token opens the page), the max with the token's, and the page written back whole, its stored
  values times old / new scale (exact: a power of two, 1 where the scale did not grow, or 0 for a new page) with
  the token at its offset; then the scale. Every row rewrites its whole page on every step, so rows must write
  distinct pages (a page shared by two sequences is copied before either writes it); padding rows (the null page,
  mapped to Pl by `_local_pages`) write nothing. layer=slice(None) writes every layer at once, x [L, B, K, H]
  holding each layer's token."""
  Pl, Z = pool.shape[1:3]
  pc = jnp.minimum(page, Pl - 1)
  old = jnp.where((offset == 0)[:, None], 0.0, scale[layer, pc])                       # [(L,) B, K]
  new_scale = jnp.maximum(old, scale_for(jnp.abs(x).max(axis=-1)))
  # stored: [(L,) B, Z, K, H], read at the pages written (a padding row's page Pl reads clamped, as pc does, and
  # its write is dropped): at the same index as the write, XLA updates the pool in place, not a copy of it.
  stored = fp8_ops.take(pool, (layer, page)).astype(jnp.float32) * (old / new_scale)[..., None, :, None]
  y = fp8_ops.clip_finite(x, x / new_scale[..., None])                             # [(L,) B, K, H]
  here = (jnp.arange(Z)[None, :] == offset[:, None])[:, :, None, None]                 # [B, Z, 1, 1]
  contents = jnp.where(here, y[..., None, :, :], stored).astype(pool.dtype)           # [(L,) B, Z, K, H]
  return fp8_ops.set_at(pool, (layer, page), contents, mode="drop"), scale.at[layer, page].set(new_scale, mode="drop")


def rotates_keys(head_dim: int) -> bool:
  """Whether fp8 pools hold keys of this head dim rotated (`fp8_basis`): where lcjax.ops.fp8's rotation exists
  (powers of two); other head dims are held as computed."""
  return fp8_ops.has_rotation(head_dim)


def fp8_basis(x):
  """Keys x [..., H] as fp8 pools hold them, or queries as they read those keys: rotated by
  lcjax.ops.fp8.rotate where `rotates_keys(H)`, which spreads an outlier channel over every channel before a
  page's e4m3 rounding (on SmolLM2's keys it cuts the pages' attention error by about a third); x itself for other
  head dims. The rotation is orthogonal, so queries rotated alike keep every score: (q R)(k R)^T = q k^T."""
  return fp8_ops.rotate(x) if rotates_keys(x.shape[-1]) else x


def write_tokens(cache: PagedKV, k, v, slots) -> PagedKV:
  """Every layer's K and V [L, B, T, K, H] of T tokens per row into the pools at slots [B, T] (0: not written),
  token t after token t - 1, each as a decode step writes its token (`_write_one_token` in every layer at once
  for fp8 pools): the pages, values and scales, are those T decode steps leave given these K and V. Speculative
  decoding writes the tokens a verify step kept with it."""
  k_all, v_all, k_scale, v_scale = cache.k, cache.v, cache.k_scale, cache.v_scale
  Pl, Z = k_all.shape[1:3]
  if cache.quantized:
    k = fp8_basis(k)
  for t in range(slots.shape[1]):
    page, offset = token_page_offset(slots[:, t:t + 1], Z, Pl)
    if cache.quantized:
      k_all, k_scale = _write_one_token(k_all, k_scale, precision.widen(k[:, :, t]), page, offset, slice(None))
      v_all, v_scale = _write_one_token(v_all, v_scale, precision.widen(v[:, :, t]), page, offset, slice(None))
    else:
      k_all = k_all.at[:, page, offset].set(k[:, :, t].astype(k_all.dtype), mode="drop")
      v_all = v_all.at[:, page, offset].set(v[:, :, t].astype(v_all.dtype), mode="drop")
  return PagedKV(k_all, v_all, k_scale, v_scale)


def token_page_offset(slots, page_size: int, pool_pages: int, first: int | jax.Array = 0):
  """A decode step's flat slots [B, 1] -> (page [B] in a pool of `pool_pages` pages holding global pages first ..,
  out of its range: `pool_pages`; offset [B] in the page): where write_kv's page writer writes each row's token. The
  model computes it once a call, before its layer scan, so the scan does not recompute it for every layer."""
  s = slots[:, 0]
  return _local_pages(s // page_size, first, pool_pages), s % page_size


def writes_token_by_kernel(page_writer, k_scale, slots) -> bool:
  """Whether write_kv hands this call to `page_writer`: one token a row (slots [B, 1]) into fp8 pools (k_scale
  given), a page writer given (not None)."""
  return page_writer is not None and k_scale is not None and slots.shape[1] == 1


def write_kv(k_all, v_all, k_scale, v_scale, k, v, slots, pages, layer, *, shard=None, page_writer=None,
             token_at=None):
  """K and V [B, T, K, H] (activation dtype) into layer `layer` of their pools [L, P, Z, K, H] at flat slots
  [B, T] (page * Z + offset); fp8 pools with their scales [L, P, K] and the call's written_pages [B, J] (None
  otherwise). With `shard` (inside shard_map over `seq`), the pools are that shard's local [L, P/S, Z, K, H] (and
  scales [L, P/S, K]) while slots and pages stay global: the tokens and written pages of other shards are dropped
  here (they write them). page_writer: what writes a decode step (one token a row, T = 1) into fp8 pools: None
  (`_write_one_token`, once for K and once for V: nine small XLA kernels) or a page writer (lcjax.ops.kernels,
  called as page_writer(k_all, v_all, k_scale, v_scale, k [B, K, H], v [B, K, H], page [B], offset [B], layer):
  K, V and both scales in one kernel, bit for bit the same). Other writes take `_write` whatever `page_writer`
  says. token_at: `token_page_offset` of the call, made before the layer scan (None: computed here). Returns
  (k_all, v_all, k_scale, v_scale)."""
  if shard is not None and token_at is not None:
    raise ValueError(f"token_at holds pages of the unsharded pools; write_kv(shard={shard}) computes its own")
  if k_scale is not None:
    k = fp8_basis(k)
  first = 0 if shard is None else shard * k_all.shape[1]
  if writes_token_by_kernel(page_writer, k_scale, slots):
    Pl, Z = k_all.shape[1:3]
    page, offset = token_page_offset(slots, Z, Pl, first) if token_at is None else token_at
    return page_writer(k_all, v_all, k_scale, v_scale, k[:, 0], v[:, 0], page, offset, layer)
  k_all, k_scale = _write(k_all, k_scale, k, slots, pages, layer, first)
  v_all, v_scale = _write(v_all, v_scale, v, slots, pages, layer, first)
  return k_all, v_all, k_scale, v_scale


def as_carry(cache: PagedKV) -> PagedKV:
  """The cache as a loop carries it: its pools through `fp8_ops.as_carry` (on the CPU, fp8 pools as their uint8
  views, which XLA's CPU backend updates in place; a float8 carry it copies whole around every layer's write).
  `from_carry` undoes it."""
  return dataclasses.replace(cache, k=fp8_ops.as_carry(cache.k), v=fp8_ops.as_carry(cache.v))


def from_carry(cache: PagedKV, dtype) -> PagedKV:
  """A cache `as_carry` made from pools of `dtype`, with pools of `dtype` again (the same bytes)."""
  return dataclasses.replace(cache, k=fp8_ops.from_carry(cache.k, dtype), v=fp8_ops.from_carry(cache.v, dtype))


def copy_pages(cache: PagedKV, src, dst) -> PagedKV:
  """Copy-on-write: pages src [C] -> dst [C] in every layer (for a shared, partly filled last page), scales too."""
  return PagedKV(*(fp8_ops.set_at(x, (slice(None), dst), fp8_ops.take(x, (slice(None), src))) for x in cache.parts()))


def gather_pages(cache: PagedKV, pages) -> tuple:
  """`cache.parts()` of `pages` [n] in every layer (pages evicted to the host tier): K, V [L, n, Z, K, H] and, for
  fp8 pools, their scales [L, n, K]."""
  return tuple(fp8_ops.take(x, (slice(None), pages)) for x in cache.parts())


def scatter_pages(cache: PagedKV, pages, *parts) -> PagedKV:
  """Write what gather_pages returned (K, V [L, n, Z, K, H], then the scales [L, n, K] of fp8 pools) into `pages`
  [n] of every layer (pages back from the host tier); entries naming the null page (padding) write nothing."""
  if len(parts) != len(cache.parts()):
    raise ValueError(f"{len(parts)} arrays for a cache of {len(cache.parts())} (K, V and, for fp8, their scales)")
  pages = drop_null(pages, cache.num_pages)
  return PagedKV(*(fp8_ops.set_at(x, (slice(None), pages), y, mode="drop") for x, y in zip(cache.parts(), parts)))


def zero_pages(cache: PagedKV, pages) -> PagedKV:
  """`pages` [n] of every layer set to zeros, fp8 scales too (what a new pool holds); entries naming the null page
  (padding) write nothing."""
  pages = drop_null(pages, cache.num_pages)
  return PagedKV(*(fp8_ops.set_at(x, (slice(None), pages), 0, mode="drop") for x in cache.parts()))


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
