"""The attention contract shared by every backend, and its plain-jnp reference.

Every kernel computes exact softmax attention of a block of queries against a block of keys and returns
`(out, lse)`: `out [B, T, N, H]` in the query dtype and `lse [B, T, N]`, the float32 natural-log sum of
exp(scores) of each query row. Ring prefill, chunked prefill against a cached prefix and sequence-sharded decode
combine partial results with `merge`, which is exact and treats `lse = -inf` (a fully masked row) as "no
contribution".

Positions make blocks self-describing: a query row knows its absolute position (`q_pos`), a key block knows the
position of its first key (`k_start`) and how many of its keys are valid (`kv_len`). Key j of the block is
visible to query i iff `j < kv_len` and, when causal, `k_start + j <= q_pos[i]`.

Legend: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim, P pages, Z page size,
M page-table slots per sequence.
"""
from __future__ import annotations

import logging
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from lcjax.ops import fp8

NEG_INF = float("-inf")
# Masked scores use a large finite value so that exp(masked - max) is exactly 0 without inf - inf = nan.
_MASKED = -1e30


def block_positions(q_pos, k_start, B: int, T: int, S: int):
  """The contract's position defaults made explicit: q_pos [B, T] int32 (default: the last T of the S key
  positions) and k_start [B] int32 (default 0)."""
  q_pos = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + (S - T), (B, T)) if q_pos is None
           else jnp.broadcast_to(q_pos, (B, T)).astype(jnp.int32))
  k_start = jnp.zeros((B,), jnp.int32) if k_start is None else jnp.broadcast_to(k_start, (B,)).astype(jnp.int32)
  return q_pos, k_start


def contiguous_each(q_pos):
  """[B]: whether sequence b's rows (q_pos [B, T]) are consecutive positions."""
  T = q_pos.shape[1]
  return jnp.all(q_pos == q_pos[:, :1] + jnp.arange(T, dtype=q_pos.dtype)[None, :], axis=1)


def contiguous_rows(q_pos):
  """Whether every sequence's rows [B, T] are consecutive positions: what a kernel masking by one diagonal offset
  per sequence can express."""
  return jnp.all(contiguous_each(q_pos))


def dequantize(x, scale, dtype):
  """Values read from a KV pool, in `dtype`: x [..., K, H] times its per-(page, KV head) scale [..., K] for fp8
  pools (value = stored * scale; lcjax.cache.kv.quantize is the inverse); x itself when scale is None."""
  if scale is None:
    return x.astype(dtype)
  return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


def gather_pages(pages, scale, ids, dtype, layer=None):
  """Pages ids [B, M] of a pool [P, Z, K, H] -> [B, M, Z, K, H] in `dtype`, dequantized by scale [P, K] (fp8 pools)
  or None. With `layer` (a scalar), pages [L, P, Z, K, H] and scale [L, P, K] hold every layer's pool and layer
  `layer`'s pages ids are read (one gather: no layer's pool is sliced out)."""
  at = ids if layer is None else (layer, ids)
  return dequantize(fp8.take(pages, at), None if scale is None else scale[at][:, :, None, :], dtype)


def over_table_blocks(block, table, lengths, page_size: int, block_tokens: int, out_shape, out_dtype):
  """Attention of rows over the first lengths[b] keys of their page table [B, M], read `block_tokens` keys at a
  time: block(ids [B, Mb], n [B]) -> (out, lse) of the rows over the first n[b] keys of the pages ids; blocks
  wholly past every length are skipped, the rest merged by their LSE in float32. out_shape: [B, T, N, H]."""
  M, Z = table.shape[1], page_size
  Mb = max(1, min(M, block_tokens // Z))                            # pages per block
  nb = -(-M // Mb)
  table = jnp.pad(table, ((0, 0), (0, nb * Mb - M)))               # page 0 past the end: masked by the lengths

  def one(i):
    return block(jax.lax.dynamic_slice_in_dim(table, i * Mb, Mb, axis=1), jnp.clip(lengths - i * Mb * Z, 0, Mb * Z))

  if nb == 1:
    return one(0)

  def body(i, acc):
    return jax.lax.cond(jnp.any(lengths > i * Mb * Z), lambda: merge(*acc, *one(i)), lambda: acc)

  init = (jnp.zeros(out_shape, jnp.float32), jnp.full(out_shape[:3], NEG_INF, jnp.float32))
  out, lse = jax.lax.fori_loop(0, nb, body, init)
  return out.astype(out_dtype), lse


def merge(o_a, lse_a, o_b, lse_b):
  """Combine two attention partials over disjoint key sets. o [..., H], lse [...] float32."""
  lse = jnp.logaddexp(lse_a, lse_b)
  # A row masked in both parts has lse = -inf: give it weight 0 instead of exp(nan).
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.exp(lse_a - safe)[..., None]
  w_b = jnp.exp(lse_b - safe)[..., None]
  out = o_a.astype(jnp.float32) * w_a + o_b.astype(jnp.float32) * w_b
  return out.astype(o_a.dtype), lse


def merge_stack(out, lse):
  """`merge` of a stack of partials over disjoint key sets: out [n, ..., H], lse [n, ...] float32 -> (out [..., H]
  in out's dtype, lse [...]), each weighted in float32. A row no partial saw gets out 0 and lse -inf."""
  total = jax.nn.logsumexp(lse, axis=0)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  merged = jnp.sum(out.astype(jnp.float32) * jnp.exp(lse - safe)[..., None], axis=0)
  return merged.astype(out.dtype), total


def _online_softmax(q, n_blocks, block_fn, scale):
  """Flash-style online softmax over key blocks. q [B, T, N, H]; block_fn(i) -> (k, v, visible).

  k, v: [B, C, K, H]; visible: [B, T, C] bool. Memory is O(B*T*N*C), never O(T*S). n_blocks: a Python int, the
  blocks 0 .. n_blocks - 1, each skipped (a lax.cond) when no query sees any of its keys; or a traced int32
  scalar: a loop over the blocks 0 .. n_blocks - 1, each attended (masked by `visible`), where the caller bounds
  n_blocks by the last block that holds a visible key.
  """
  B, T, N, H = q.shape
  qf = q.astype(jnp.float32) * scale

  def step(carry, i):
    k, v, visible = block_fn(i)
    # Blocks no query can see (past a sequence's end, or in every query's future) cost nothing.
    return jax.lax.cond(jnp.any(visible), update, lambda c, *_: c, carry, k, v, visible), None

  def update(carry, k, v, visible):
    m, l, acc = carry                                              # [B,T,N], [B,T,N], [B,T,N,H]
    K = k.shape[2]
    qg = qf.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bckh->btkgc", qg, k.astype(jnp.float32))
    s = s.reshape(B, T, N, -1)
    s = jnp.where(visible[:, :, None, :], s, _MASKED)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    p = jnp.where(visible[:, :, None, :], p, 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    pv = jnp.einsum("btkgc,bckh->btkgh", p.reshape(B, T, K, N // K, -1), v.astype(jnp.float32))
    acc = acc * corr[..., None] + pv.reshape(B, T, N, H)
    return m_new, l, acc

  init = (jnp.full((B, T, N), _MASKED, jnp.float32), jnp.zeros((B, T, N), jnp.float32),
          jnp.zeros((B, T, N, H), jnp.float32))
  if isinstance(n_blocks, int):
    (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(n_blocks))
  else:
    m, l, acc = jax.lax.fori_loop(0, n_blocks, lambda i, carry: update(carry, *block_fn(i)), init)
  # A row saw no key where l == 0, not where l > 0 fails: a NaN or inf score makes l NaN, and the NaN must reach
  # the output (and through it the logits, which stop the request) rather than read as a row with nothing to see.
  empty = l == 0
  out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, l)[..., None])
  lse = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, l)))
  return out.astype(q.dtype), lse


def _visible(q_pos, key_pos, key_valid, causal):
  """q_pos [B, T], key_pos [B, C], key_valid [B, C] -> [B, T, C]."""
  vis = key_valid[:, None, :]
  if causal:
    vis = vis & (key_pos[:, None, :] <= q_pos[:, :, None])
  return vis


def _default_scale(H):
  return 1.0 / math.sqrt(H)


def attention_reference(q, k, v, *, q_pos=None, k_start=None, kv_len=None, causal=True, block_k=512,
                        scale=None):
  """Exact attention of q [B, T, N, H] over contiguous k, v [B, S, K, H]. Returns (out, lse [B, T, N])."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if N % K:
    raise ValueError(f"query heads N={N} are not divisible by kv heads K={K}")
  q_pos, k_start = block_positions(q_pos, k_start, B, T, S)
  kv_len = jnp.full((B,), S, jnp.int32) if kv_len is None else jnp.broadcast_to(kv_len, (B,))
  C = min(block_k, S)
  n_blocks = -(-S // C)
  pad = n_blocks * C - S
  if pad:
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))

  def block(i):
    kb = jax.lax.dynamic_slice_in_dim(k, i * C, C, axis=1)
    vb = jax.lax.dynamic_slice_in_dim(v, i * C, C, axis=1)
    j = i * C + jnp.arange(C, dtype=jnp.int32)
    valid = j[None, :] < kv_len[:, None]
    return kb, vb, _visible(q_pos, k_start[:, None] + j[None, :], valid, causal)

  return _online_softmax(q, n_blocks, block, scale or _default_scale(H))


def paged_attention_reference(q, k_pages, v_pages, page_table, *, q_pos, kv_len, causal=True,
                              pages_per_block=8, scale=None, k_scale=None, v_scale=None, layer=None):
  """Exact attention of q [B, T, N, H] over a paged cache.

  k_pages, v_pages: [P, Z, K, H]; page_table [B, M] int32 (slot m holds tokens m*Z .. m*Z+Z-1 of a sequence);
  kv_len [B]: valid tokens per sequence; q_pos [B, T] absolute query positions. Optional per-page scales
  k_scale, v_scale [P, K] dequantize fp8 pages (value = page * scale). With `layer` (a scalar), k_pages and
  v_pages are the pools of every layer [L, P, Z, K, H] (scales [L, P, K]) and the table names pages of layer
  `layer`.

  The table is read `pages_per_block` slots at a time, up to the block that holds the longest kv_len's last key:
  the loop's trip count follows the tokens cached, not the table's width M (shapes do not depend on kv_len).
  """
  B, T, N, H = q.shape
  Z, K = k_pages.shape[-3:-1]
  M = page_table.shape[1]
  pb = max(1, min(pages_per_block, M))
  n_blocks = -(-M // pb)
  pad = n_blocks * pb - M
  if pad:
    page_table = jnp.pad(page_table, ((0, 0), (0, pad)))    # pad with the null page; masked by kv_len
  kv_len = jnp.broadcast_to(kv_len, (B,))

  def load(pages, scales, ids):
    return gather_pages(pages, scales, ids, jnp.float32, layer).reshape(B, pb * Z, K, H)

  def block(i):
    ids = jax.lax.dynamic_slice_in_dim(page_table, i * pb, pb, axis=1)  # [B, pb]
    j = i * pb * Z + jnp.arange(pb * Z, dtype=jnp.int32)
    valid = j[None, :] < kv_len[:, None]
    kb, vb = load(k_pages, k_scale, ids), load(v_pages, v_scale, ids)
    return kb, vb, _visible(q_pos, jnp.broadcast_to(j, (B, pb * Z)), valid, causal)

  # Blocks from the one after the longest kv_len's last key on hold no valid key: the loop stops before them.
  used = jnp.clip((jnp.max(kv_len) + pb * Z - 1) // (pb * Z), 0, n_blocks).astype(jnp.int32)
  return _online_softmax(q, used, block, scale or _default_scale(H))


def attention_dense(q, k, v, *, q_pos=None, kv_len=None, causal=True, scale=None):
  """The unoptimised baseline: materialises the [B, N, T, S] score matrix. For benchmarks and tests only."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  q_pos, _ = block_positions(q_pos, None, B, T, S)
  kv_len = jnp.full((B,), S, jnp.int32) if kv_len is None else jnp.broadcast_to(kv_len, (B,))
  qg = q.astype(jnp.float32).reshape(B, T, K, N // K, H) * (scale or _default_scale(H))
  s = jnp.einsum("btkgh,bskh->btkgs", qg, k.astype(jnp.float32)).reshape(B, T, N, S)
  j = jnp.arange(S, dtype=jnp.int32)
  vis = _visible(q_pos, jnp.broadcast_to(j, (B, S)), j[None, :] < kv_len[:, None], causal)
  s = jnp.where(vis[:, :, None, :], s, NEG_INF)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.where(vis[:, :, None, :], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  out = jnp.einsum("btkgs,bskh->btkgh", p.reshape(B, T, K, N // K, S), v.astype(jnp.float32))
  return out.reshape(B, T, N, H).astype(q.dtype), lse


def routed_to_reference(backend: str, reason: str) -> None:
  """Say, when a call is traced (once per compiled step), that a fast backend sends it to the jnp reference on a
  GPU, and why. Routes decided by values inside the graph say so when they run: `reference_branch_ran`."""
  if jax.default_backend() == "gpu":
    logging.warning("attention backend %s runs this call through the jnp reference (slow): %s", backend, reason)


# Reasons a kernel masking by one diagonal offset per sequence cannot serve a block, known only from the positions'
# values: the backends' lax.cond / lax.switch send such blocks to the reference.
NONCONTIGUOUS_ROWS = "query rows at non-contiguous positions"
ROWS_BEFORE_FIRST_KEY = "query rows before the block's first key (negative q_pos - k_start)"
NEGATIVE_POSITIONS = "negative query positions"

_announced: set[str] = set()
_announced_lock = threading.Lock()


def warn_once(line: str) -> None:
  """Log `line` as a warning once per process."""
  with _announced_lock:
    if line in _announced:
      return
    _announced.add(line)
  logging.warning("%s", line)


def reference_branch_ran(backend: str, reasons: dict[str, jax.Array]) -> None:
  """Call inside the branch of a lax.cond / lax.switch that runs the jnp reference: on a GPU, when the branch
  runs, log one line naming the backend and the reasons whose flag (a bool array, any element) holds; each
  distinct line once per process. Nothing is added to the graph elsewhere (a CPU runs the reference anyway)."""
  if jax.default_backend() != "gpu":
    return
  texts = tuple(reasons)

  def report(*flags):
    why = [t for t, f in zip(texts, flags) if np.any(f)] or ["positions the kernel cannot mask"]
    warn_once(f"attention backend {backend} ran a call through the jnp reference (slow), decided by the "
               f"positions at run time: {'; '.join(why)}")

  jax.debug.callback(report, *(jnp.asarray(f) for f in reasons.values()))
