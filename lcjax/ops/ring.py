"""Ring attention over the `seq` mesh axis, its zigzag layout, and the exact combine of sequence-sharded partials.

Prefill: each device holds a slice of the sequence's queries and keys. K/V blocks travel the ring with
`lax.ppermute` (the transfer for step s+1 is issued before step s computes, so XLA can overlap them) while every
device attends its queries to the block it holds through the backend's `attend` and folds the partial into a
float32 accumulator with `merge`. Positions make each block self-describing (see lcjax.ops.attention), so causal
masking of off-diagonal blocks needs nothing else, and blocks wholly in the future are skipped by `lax.cond`.

Layouts, with n = seq devices and a sequence of T tokens:
  plain   device d holds tokens [d*T/n, (d+1)*T/n). Causal work is unbalanced: device n-1 does n blocks, device 0 one.
  zigzag  the sequence is cut into 2n chunks; device d holds chunk d then chunk 2n-1-d, so every device does the
          same causal work (two half-blocks per ring step). `to_zigzag` / `from_zigzag` permute [B, T, ...] arrays
          (tokens, positions, activations) into this order and back; the model keeps activations in it throughout.

Sequence-sharded decode: each `seq` shard attends the (replicated) query to the pages it holds, then
`combine_seq_partials` merges the (out, lse) partials across `seq`: the query moves, the cache never does.

Legend: B batch, T queries (local to a shard inside shard_map), N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from lcjax.ops.attention import merge
from lcjax.sharding import SEQ, TENSOR

# q, k, v and out [B, T, heads, H] inside the model's shard_map: T over seq, heads over tensor.
QKV_SPEC = P(None, SEQ, TENSOR, None)
LSE_SPEC = P(None, SEQ, TENSOR)


def zigzag_length(length: int, n: int) -> int:
  """The length the model pads a call of `length` tokens to when it splits the call over n seq devices (the zigzag
  layout, and ring-plain's contiguous blocks): a multiple of 2 * n. n = 1: the model does not split the call, and
  the length is its own."""
  return length if n == 1 else -(-length // (2 * n)) * 2 * n


def zigzag_order(length: int, n: int) -> np.ndarray:
  """Token index at each slot of the zigzag layout: slot k holds token zigzag_order(length, n)[k]."""
  if n < 1 or length % (2 * n):
    raise ValueError(f"zigzag layout needs the length divisible by 2 * seq: {length=} seq={n}")
  c = length // (2 * n)
  chunks = np.array([g for d in range(n) for g in (d, 2 * n - 1 - d)])
  return (chunks[:, None] * c + np.arange(c)).reshape(-1)


def _take(x, idx, axis):
  if isinstance(x, np.ndarray):
    return np.take(x, idx, axis=axis)
  return jnp.take(x, jnp.asarray(idx), axis=axis)


def to_zigzag(x, n: int, axis: int = 1):
  """Permute the sequence axis of x (numpy or jax) from natural order into the zigzag layout for seq=n."""
  return _take(x, zigzag_order(x.shape[axis], n), axis)


def from_zigzag(x, n: int, axis: int = 1):
  """Inverse of `to_zigzag`."""
  return _take(x, np.argsort(zigzag_order(x.shape[axis], n)), axis)


def per_row(x, B, default):
  """A per-sequence int32 [B] vector from None (default), a scalar or a [B] array."""
  if x is None:
    return jnp.full((B,), default, jnp.int32)
  return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B,))


def _chunk_ids(d, n, zigzag):
  """Which of the sequence's chunks device d holds, in its local order (chunks are T/n, or T/2n when zigzag)."""
  return (d, 2 * n - 1 - d) if zigzag else (d,)


def ring_attention_shard(q, k, v, *, backend, axis_name: str = SEQ, zigzag: bool = True, causal: bool = True,
                         offset=None, kv_len=None):
  """Ring attention body, called inside shard_map over `axis_name` (other mesh axes may be manual too).

  q [B, T, N, H], k, v [B, T, K, H]: this device's share of the chunk, T = global length / seq, in the chosen layout.
  offset [B] (or scalar): absolute position of the chunk's first token, i.e. the length of the cached prefix it
  follows. kv_len [B] (or scalar): valid tokens of the chunk (default all); later ones are padding, never attended to,
  and their rows are the caller's to drop (the backend is told each block's real rows). Returns (out [B, T, N, H] in
  q.dtype, lse [B, T, N] float32) over the chunk's own keys only, so a caller with a cached prefix merges them with
  its prefix partial (lcjax.ops.attention.merge).
  """
  n = lax.axis_size(axis_name)
  B, T, N, H = q.shape
  u = 2 if zigzag else 1
  if T % u:
    raise ValueError(f"zigzag needs an even local length, got T={T} (global length must divide by 2 * seq={n})")
  c = T // u
  offset = per_row(offset, B, 0)
  kv_len = per_row(kv_len, B, n * T)
  me = lax.axis_index(axis_name)
  q_ids = _chunk_ids(me, n, zigzag)
  qs = [q[:, m * c:(m + 1) * c] for m in range(u)]
  q_pos = [offset[:, None] + g * c + jnp.arange(c, dtype=jnp.int32) for g in q_ids]

  def attend(m, kb, vb, g_k, block_causal):
    """Attention of local query sub-chunk m to key chunk g_k (kb, vb [B, c, K, H]), as a float32 partial."""
    start = g_k * c
    o, lse = backend.attend(qs[m], kb, vb, q_pos=q_pos[m], k_start=offset + start,
                            kv_len=jnp.clip(kv_len - start, 0, c), q_len=jnp.clip(kv_len - q_ids[m] * c, 0, c),
                            causal=block_causal)
    return o.astype(jnp.float32), lse

  def fold(acc, m, kb, vb, g_k):
    """Merge one off-diagonal block into acc, skipping it when no query row can see any of its keys."""
    dead = jnp.all(kv_len <= g_k * c)
    if causal:
      dead = dead | (g_k > q_ids[m])

    def live(acc, kb, vb):
      # Off the diagonal a visible chunk lies wholly in the past: no causal mask, kv_len still cuts padding.
      return merge(*acc, *attend(m, kb, vb, g_k, False))

    return lax.cond(dead, lambda acc, kb, vb: acc, live, acc, kb, vb)

  def split(kv):
    return [tuple(x[:, i * c:(i + 1) * c] for x in kv) for i in range(u)]

  kv = (k, v)
  perm = [(d, (d + 1) % n) for d in range(n)]
  nxt = lax.ppermute(kv, axis_name, perm) if n > 1 else None

  # Step 0, the device's own keys: the diagonal blocks start the accumulators; of the zigzag cross pairs
  # (chunk 2n-1-d is later than chunk d) one is wholly visible and the other, when causal, wholly future.
  own = split(kv)
  accs = [attend(m, *own[m], q_ids[m], causal) for m in range(u)]
  for m in range(u):
    for i in range(u):
      if i != m and (not causal or i < m):
        accs[m] = merge(*accs[m], *attend(m, *own[i], q_ids[i], False))

  def step(s, kv, accs):
    k_ids = _chunk_ids((me - s) % n, n, zigzag)                  # chunks of the device these keys came from
    accs = list(accs)
    for i, (kb, vb) in enumerate(split(kv)):
      for m in range(u):
        accs[m] = fold(accs[m], m, kb, vb, k_ids[i])
    return accs

  if n > 1:
    def body(s, carry):
      kv, accs = carry
      return lax.ppermute(kv, axis_name, perm), step(s, kv, accs)

    kv, accs = lax.fori_loop(1, n - 1, body, (nxt, accs))
    accs = step(n - 1, kv, accs)

  out = jnp.concatenate([o for o, _ in accs], axis=1).astype(q.dtype)
  lse = jnp.concatenate([l for _, l in accs], axis=1)
  return out, lse


def check_sharded_shapes(q, k, mesh, zigzag: bool) -> None:
  """Raise unless q [B, T, N, H] / k [B, T, K, H] split evenly over the mesh in the given layout."""
  T, N, K = q.shape[1], q.shape[2], k.shape[2]
  u = 2 if zigzag else 1
  seq, tensor = mesh.shape[SEQ], mesh.shape[TENSOR]
  if T % (u * seq):
    raise ValueError(f"length T={T} is not divisible by {u * seq} ({'2 * ' if u == 2 else ''}{seq=})")
  if N % tensor or K % tensor:
    raise ValueError(f"heads N={N} and kv heads K={K} must both be divisible by {tensor=}")


def ring_attention(q, k, v, *, mesh, backend, zigzag: bool = True, causal: bool = True, offset=None,
                   kv_len=None):
  """Ring attention of globally shaped q [B, T, N, H], k, v [B, T, K, H] on `mesh` ("seq", "tensor").

  T is in the layout order (apply `to_zigzag` first when zigzag) and is split over seq; heads over tensor.
  offset, kv_len: as in `ring_attention_shard`. Returns (out [B, T, N, H], lse [B, T, N]) in the same order.
  """
  check_sharded_shapes(q, k, mesh, zigzag)
  B = q.shape[0]
  body = functools.partial(ring_attention_shard, backend=backend, axis_name=SEQ, zigzag=zigzag, causal=causal)
  fn = jax.shard_map(lambda q, k, v, o, n: body(q, k, v, offset=o, kv_len=n), mesh=mesh,
                     in_specs=(QKV_SPEC, QKV_SPEC, QKV_SPEC, P(), P()), out_specs=(QKV_SPEC, LSE_SPEC),
                     check_vma=False)
  return fn(q, k, v, per_row(offset, B, 0), per_row(kv_len, B, q.shape[1]))


def combine_seq_partials(out, lse, axis_name: str = SEQ, *, scatter_axis: int | None = None):
  """Exact merge of attention partials held by the shards of `axis_name` (call inside shard_map).

  out [..., H], lse [...] float32: this shard's attention over its own keys (lse = -inf where it saw none).
  The small lse tensors are all-gathered so every shard weighs its own partial; one psum of the rescaled outputs
  then finishes the softmax. Returns (out in out.dtype, lse), identical on every shard; with `scatter_axis`
  (e.g. the query axis of a prefill chunk whose queries were gathered from the shards) the sum is a
  reduce-scatter instead and each shard keeps its own block of that axis.
  """
  lse_all = lax.all_gather(lse, axis_name)                        # [n, ...]
  total = jax.nn.logsumexp(lse_all, axis=0)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)              # rows no shard saw: weight 0, not nan
  part = out.astype(jnp.float32) * jnp.exp(lse - safe)[..., None]
  if scatter_axis is None:
    return lax.psum(part, axis_name).astype(out.dtype), total
  combined = lax.psum_scatter(part, axis_name, scatter_dimension=scatter_axis, tiled=True)
  size = combined.shape[scatter_axis]
  mine = lax.dynamic_slice_in_dim(total, lax.axis_index(axis_name) * size, size, axis=scatter_axis)
  return combined.astype(out.dtype), mine
