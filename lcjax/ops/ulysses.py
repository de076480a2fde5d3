"""Ulysses sequence parallelism: trade the sequence split for a head split with two all-to-alls.

Each `seq` device enters with a slice of the sequence and all (tensor-local) heads; one all-to-all gives it the
whole sequence for 1/seq of the heads, the backend attends over the full sequence in one call, and a second
all-to-all returns the sequence split. Communication is 4 all-to-alls of activations per layer instead of a K/V
ring, and the head counts must divide by seq (GQA models with few kv heads cannot use it at large seq).

Legend: B batch, T queries (local inside shard_map), N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from lcjax.ops.ring import LSE_SPEC, QKV_SPEC, check_sharded_shapes, from_zigzag, per_row, to_zigzag
from lcjax.sharding import SEQ, TENSOR


def check_ulysses(n_heads: int, n_kv_heads: int, seq: int) -> None:
  """Raise unless both head counts (per tensor shard) split evenly over seq."""
  if n_heads % seq or n_kv_heads % seq:
    raise ValueError(f"Ulysses needs the heads per tensor shard divisible by seq: {n_heads=} {n_kv_heads=} "
                     f"{seq=}; use ring attention (sp_mode='ring') instead")


def ulysses_attention_shard(q, k, v, *, backend, axis_name: str = SEQ, zigzag: bool = False,
                            causal: bool = True, offset=None, kv_len=None):
  """Ulysses body, called inside shard_map over `axis_name`.

  q [B, T, N, H], k, v [B, T, K, H]: this device's share of the chunk in the chosen layout (zigzag or plain,
  as produced for ring attention, so the model's layout does not depend on the sequence-parallel mode).
  offset, kv_len [B]: as in `lcjax.ops.ring.ring_attention_shard`. Returns (out [B, T, N, H], lse [B, T, N]).
  """
  n = lax.axis_size(axis_name)
  B, T, N, H = q.shape
  check_ulysses(N, k.shape[2], n)
  offset = per_row(offset, B, 0)
  kv_len = per_row(kv_len, B, n * T)

  def gather_seq(x):
    # [B, T, heads, H] -> [B, n*T, heads/n, H]: device order along the sequence is the layout order.
    x = lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
    return from_zigzag(x, n) if zigzag else x

  def scatter_seq(x):
    x = to_zigzag(x, n) if zigzag else x
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)

  qf, kf, vf = gather_seq(q), gather_seq(k), gather_seq(v)
  q_pos = offset[:, None] + jnp.arange(n * T, dtype=jnp.int32)
  out, lse = backend.attend(qf, kf, vf, q_pos=q_pos, k_start=offset, kv_len=kv_len, q_len=kv_len, causal=causal)
  return scatter_seq(out), scatter_seq(lse)


def ulysses_attention(q, k, v, *, mesh, backend, zigzag: bool = False, causal: bool = True, offset=None,
                      kv_len=None):
  """Ulysses attention of globally shaped q [B, T, N, H], k, v [B, T, K, H] on `mesh` ("seq", "tensor").

  Same layout, arguments and result as `lcjax.ops.ring.ring_attention`.
  """
  check_sharded_shapes(q, k, mesh, zigzag)
  tensor = mesh.shape[TENSOR]
  check_ulysses(q.shape[2] // tensor, k.shape[2] // tensor, mesh.shape[SEQ])
  B, T = q.shape[:2]
  body = functools.partial(ulysses_attention_shard, backend=backend, axis_name=SEQ, zigzag=zigzag,
                           causal=causal)
  fn = jax.shard_map(lambda q, k, v, o, n: body(q, k, v, offset=o, kv_len=n), mesh=mesh,
                     in_specs=(QKV_SPEC, QKV_SPEC, QKV_SPEC, P(), P()), out_specs=(QKV_SPEC, LSE_SPEC),
                     check_vma=False)
  return fn(q, k, v, per_row(offset, B, 0), per_row(kv_len, B, T))
