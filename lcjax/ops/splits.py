"""Split-K decode attention's pieces that no kernel owns: how many splits a (sequence, kv head)'s page table is
cut into, the order of the query rows that share a kv head's pages (lcjax.ops.triton.paged and
lcjax.ops.mosaic_gpu.paged both use them), and the jnp model of the split combine, the oracle of both combine
kernels."""
from __future__ import annotations

import jax.numpy as jnp


def next_pow2(n):
  return 1 << max(0, (n - 1).bit_length())


def split_count(*, requested: int | None, wanted: int, M: int, min_pages_per_split: int) -> int:
  """Splits of a (b, h)'s table of M pages: `requested` (at most M), or `wanted` splits with at least
  min_pages_per_split pages each, rounded down to a power of two (the combine reads a row's partials as one
  block of the next power of two, so 132 splits would read 256 rows)."""
  if requested is not None:
    return max(1, min(requested, M))
  n = max(1, min(wanted, M // min_pages_per_split or 1, M))
  return 1 << (n.bit_length() - 1)


def rows_per_kv_head(q, K):
  """q [B, T, N, H] -> [B, K, T * G, H]: row r = t * G + g of kv head h is query head h * G + g at token t (the
  rows that share kv head h's pages; the split combine maps them back)."""
  B, T, N, H = q.shape
  return q.reshape(B, T, K, N // K, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * (N // K), H)


def heads_from_rows(x, T: int, G: int):
  """`rows_per_kv_head`'s inverse over the real rows: x [B, K, R, ...] with R >= T * G -> [B, T, K * G, ...]."""
  B, K = x.shape[:2]
  x = x[:, :, :T * G].reshape(B, K, T, G, *x.shape[3:])
  return jnp.moveaxis(x, 2, 1).reshape(B, T, K * G, *x.shape[4:])


def heads_from_transposed(out_t, lse, T: int, G: int, out_dtype):
  """A Mosaic GPU combine's joined rows -> the attention contract: out_t [B, K, H, R] float32 (out^T of each kv
  head) and lse [B, K, R] (R >= T * G) -> (out [B, T, K * G, H] out_dtype, lse [B, T, K * G] float32)."""
  return heads_from_rows(jnp.swapaxes(out_t, 2, 3), T, G).astype(out_dtype), heads_from_rows(lse, T, G)


def combine_splits_reference(o, lse, *, S: int, T: int, G: int, out_dtype, transposed: bool = False):
  """The split combine's jnp model: partials o [B, K, S2, R, H] f32 ([B, K, S2, H, RN] if transposed) and lse
  [B, K, S2, RN] f32 (natural log; the first S splits written, row r = t * G + g of kv head h, r < T * G read)
  -> (out [B, T, K * G, H] out_dtype, lse [B, T, K * G] f32), each row's splits weighted by exp(lse): the exact
  log-sum-exp merge. A row no split saw (every lse -inf) gets out 0 and lse -inf; a NaN split makes its row NaN."""
  R = T * G
  lse = lse[:, :, :S, :R]
  o = (jnp.swapaxes(o, 3, 4) if transposed else o)[:, :, :S, :R]                # [B, K, S, R, H]
  top = jnp.max(lse, axis=2, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.exp(lse - top)                                                          # [B, K, S, R]
  tot = jnp.sum(w, axis=2)                                                        # [B, K, R]
  empty = tot == 0                                  # not tot > 0 failing: a NaN split's NaN stays in out and lse
  out = jnp.sum(o * w[..., None], axis=2) / jnp.where(empty, 1.0, tot)[..., None]
  lse_out = jnp.where(empty, -jnp.inf, jnp.log(jnp.where(empty, 1.0, tot)) + top[:, :, 0])
  return heads_from_rows(out, T, G).astype(out_dtype), heads_from_rows(lse_out, T, G)
