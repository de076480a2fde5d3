"""Split-K decode attention's pieces that no kernel owns: how many splits a (sequence, kv head)'s page table is
cut into, and the order of the query rows that share a kv head's pages. lcjax.ops.triton.paged and
lcjax.ops.mosaic_gpu.paged both use them."""
from __future__ import annotations


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
