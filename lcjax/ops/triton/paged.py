"""Paged split-K decode attention: a Pallas kernel (Triton lowering) over the page table.

Decode reads the whole cache once per step, so it is bound by HBM bandwidth: the kernel's job is to keep enough
page loads in flight on every SM. One program handles (sequence b, kv head h, split s): the G query heads of kv
head h and the T query tokens of b form R = T * G rows that share every K/V page load (GQA without repeating K/V),
and the split walks pages [s * pps, (s + 1) * pps) of b's page table with an online base-2 softmax. Each split
writes a partial (out, lse) of its R0 = T * G real rows and a second kernel (`_combine_kernel`) joins the splits
exactly with log-sum-exp weights, straight into the [B, T, N, H] output.

Masking follows the contract: token j of the sequence is visible to row (t, g) iff j < kv_len[b] and
j <= q_pos[b, t]. fp8 (e4m3) pages carry float32 scales per page and kv head ([P, K]); a page's K scale multiplies
its scores and its V scale its P @ V term, so the dequantized page is never written out.

Decode over fp8 pages on a GPU runs lcjax.ops.mosaic_gpu.paged instead (Mosaic GPU, K read by an fp8 wgmma straight
from the pages): this kernel widens every fp8 K and V element to float16 in registers and reads fp8 bytes at about
half its bf16 rate (attention-fp8-decode-h200-b: 2.0-2.7 TB/s against 3.4-4.3 for bf16 pages). Its fp8 path
stays for the Pallas interpreter (CPU tests) and page sizes the Mosaic kernel cannot read.

On Hopper, decode over bf16 pages runs lcjax.ops.mosaic_gpu.paged too (its bf16 path and Mosaic GPU split combine:
as fast or faster at 128K and 512K on the H200, benchmarks/results/attention.md, parts
attention-decode-routing-*); JAX 0.11.2 warns that the Pallas Triton backend is deprecated. This kernel serves GPUs
that are not Hopper (Ampere, Ada), page shapes the Mosaic GPU kernel cannot read, and the Pallas interpreter on
CPUs, so CI covers its indexing and masking; its split combine joins the Mosaic GPU decode kernels' splits only
where DecodeTuning(combine="triton") asks for it (tools/bench_attention.py).
Chunked prefill (R > max_rows) is not decode-shaped: the backend routes it elsewhere.

Legend: B batch, T queries, N query heads, K kv heads, G = N // K, H head dim, P pages, Z page size, M slots.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lcjax.ops import attention as ref
from lcjax.ops import precision
from lcjax.ops.splits import next_pow2, rows_per_kv_head, split_count

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Running maxima start here, not at -inf, so exp2(m_old - m_new) is never exp2(-inf + inf) for a row whose keys
# were all masked so far; masked scores are -inf and contribute exp2(-inf) = 0.
_M_FLOOR = -1e30


@dataclasses.dataclass(frozen=True)
class PagedTuning:
  """Static knobs of the decode kernel (part of the jit cache key)."""
  num_splits: int | None = None      # splits of the page table per (b, h); None: enough programs to fill the GPU
  target_programs: int = 132 * 8     # B * K * splits aimed at by the heuristic (132 SMs on an H200)
  min_pages_per_split: int = 4
  pages_per_step: int = 2            # K/V blocks handled per loop iteration (independent loads in flight)
  block_tokens: int = 128            # keys per K/V block: a larger page is read in blocks of this many, so a
                                     # step's K and V (pages_per_step x block x H each) stay within shared
                                     # memory: 2 whole 256-token pages asked for 268 KiB of 227 (2x H200, page
                                     # 256 on the H200). 128 keeps the footprint of 128-token pages, the
                                     # largest measured on the GPU (64- and 128-token pages run as before).
  num_warps: int = 4
  num_stages: int = 3
  min_rows: int = 16                 # tl.dot needs M >= 16: query rows are padded up to this
  combine_block: int = 32            # head-dim lanes per program of the split combine (B * K * T * G * H / this)
  combine_warps: int = 1
  max_rows: int = 64                 # above this many rows per kv head the call is prefill, not decode


def unsupported_shape(page_size: int, head_dim: int) -> str | None:
  """Why the decode kernel cannot read pages of this shape (None: it can): Triton tensors take power-of-two sides."""
  for name, n in (("page size Z", page_size), ("head dim H", head_dim)):
    if n & (n - 1) or n < 16:
      return f"{name}={n} must be a power of two >= 16 for the Triton kernel"
  return None


def num_splits_for(tuning: PagedTuning, B, K, M):
  """The Triton kernel's splits: `split_count` with at least target_programs programs wanted over the B * K
  tables."""
  return split_count(requested=tuning.num_splits, wanted=-(-tuning.target_programs // (B * K)), M=M,
                     min_pages_per_split=tuning.min_pages_per_split)


def _kernel(kvlen_ref, off_ref, table_ref, qpos_ref, q_ref, k_ref, v_ref, *rest, Z, Zb, H, pps, upp, quantized,
            scale_log2, T, G):
  if quantized:
    ks_ref, vs_ref, qs_ref, o_ref, lse_ref = rest
  else:
    ks_ref = vs_ref = None
    o_ref, lse_ref = rest
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
  b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  M = table_ref.shape[1]
  q = q_ref[...]                                                       # [R, H]
  k_factor = qs_ref[b, h] if quantized else None                       # the rows' scale (fp8: `_scale_queries`)
  R, R0 = q.shape[0], T * G
  # Row r = t * G + g sees up to position q_pos[b, t]; padded rows (r >= R0) see nothing. Built here from the
  # T scalars: a padded [B, R] array passed in would cost one more XLA kernel per layer.
  row = jax.lax.broadcasted_iota(jnp.int32, (R,), 0)
  qpos = jnp.full((R,), -1, jnp.int32)
  last = jnp.int32(-1)
  for t in range(T):
    pt = qpos_ref[b, t]
    qpos = jnp.where((row >= t * G) & (row < (t + 1) * G), pt, qpos)
    last = jnp.maximum(last, pt)
  kvl = kvlen_ref[b]
  page0 = off_ref[0]                                                    # page_offset
  # Keys past the last query position are invisible to every row.
  lim_tok = jnp.minimum(kvl, last + 1)
  # This program reads pages [s * pps, (s + 1) * pps) of the table, as blocks j of Zb keys (bpp per page).
  bpp = Z // Zb
  lim_tok = jnp.minimum(lim_tok, jnp.minimum((s + 1) * pps, M) * Z)     # nor into the next split, nor past the table
  first = s * pps * bpp
  stop = jnp.minimum((first // bpp + pps) * bpp, (lim_tok + Zb - 1) // Zb)
  n_steps = jnp.maximum(stop - first + upp - 1, 0) // upp

  def block(j, carry):
    m, l, acc = carry
    slot = j // bpp if bpp > 1 else j
    pid = table_ref[b, jnp.minimum(slot, M - 1)] + page0
    off = (j % bpp) * Zb if bpp > 1 else 0
    k = k_ref[pid, pl.ds(off, Zb), h, pl.ds(0, H)]                     # [Zb, H]
    v = v_ref[pid, pl.ds(off, Zb), h, pl.ds(0, H)]
    if quantized:
      # e4m3 -> f16 is one hardware convert per pair on Hopper; e4m3 -> bf16 went through f32 and made the
      # fp8 kernel convert-bound (call 1: fp8 tokens/s no better than bf16). q and p are f16 for these dots.
      k = k.astype(jnp.float16)
      v = v.astype(jnp.float16)
    sc = pltriton.dot(q, k, trans_b=True) * scale_log2                        # [R, Zb] f32, base-2 logits
    if quantized:
      sc = sc * (ks_ref[pid, h] * k_factor)
    tok = j * Zb + jax.lax.broadcasted_iota(jnp.int32, (R, Zb), 1)
    vis = (tok < lim_tok) & (tok <= qpos[:, None])
    sc = jnp.where(vis, sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    pv = pltriton.dot(p.astype(v.dtype), v)                                  # [R, H] f32
    if quantized:
      pv = pv * vs_ref[pid, h]
    return m_new, l, acc * alpha[:, None] + pv

  def step(i, carry):
    for u in range(upp):
      carry = block(first + i * upp + u, carry)
    return carry

  init = (jnp.full((R,), _M_FLOOR, jnp.float32), jnp.zeros((R,), jnp.float32), jnp.zeros((R, H), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, n_steps, step, init)
  empty = l == 0                              # not l > 0: a NaN l (a NaN or inf score) stays NaN in out and lse
  l_safe = jnp.where(empty, 1.0, l)
  # Only the R0 real rows are written (and read by _combine_kernel): padding rows would be 3/4 of the partials'
  # traffic for Llama-3's 4 query heads per kv head at one token.
  real = row < R0
  pltriton.store(o_ref, jnp.where(empty[:, None], 0.0, acc / l_safe[:, None]),
                 mask=jnp.broadcast_to(real[:, None], (R, H)))
  pltriton.store(lse_ref, jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * _LN2), mask=real)


def _combine_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, S, G, HB, transposed):
  """Join split partials exactly, one program per (b, kv head h, real row r, block of H): the splits' LSE
  weights, their weighted sum, written straight into out [B, T, N, H] (query head h * G + g at token t)."""
  from jax.experimental import pallas as pl
  b, h, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  lse = lse_ref[b, h, :, r]                                            # [S2]; splits >= S were never written
  S2 = lse.shape[0]
  used = jax.lax.broadcasted_iota(jnp.int32, (S2,), 0) < S
  lse = jnp.where(used, lse, -jnp.inf)
  top = jnp.max(lse)
  top = jnp.where(top > -jnp.inf, top, 0.0)
  w = jnp.exp(lse - top)                                               # 0 for empty or unused splits
  tot = jnp.sum(w)
  o = o_ref[b, h, :, pl.ds(c * HB, HB), r] if transposed else o_ref[b, h, :, r, pl.ds(c * HB, HB)]
  o = jnp.where(used[:, None], o, 0.0)                                # [S2, HB]
  # tot == 0 (no split saw a key), not tot > 0 failing: a NaN split makes tot NaN, which stays NaN in out and lse.
  out = jnp.sum(o * w[:, None], axis=0) / jnp.where(tot == 0, 1.0, tot)
  t, n = r // G, h * G + r % G
  out_ref[b, t, n, pl.ds(c * HB, HB)] = out.astype(out_ref.dtype)
  lse_out_ref[b, t, n] = jnp.where(tot == 0, -jnp.inf, jnp.log(jnp.where(tot == 0, 1.0, tot)) + top)


def _scale_queries(qr):
  """Query rows qr [B, K, R, H] -> (float16 rows, scale [B, K] float32): qr = rows * scale, the scale a power of
  two that brings each (sequence, kv head)'s absmax into [2^13, 2^14), so float16 holds bf16 queries of any size
  (as they are, past 65504 they are infinite, and under 2^-14 they lose bits) but for values 2^-27 of that absmax
  and below (`precision.float16_scale`: at least 2^-126; an all-zero or non-finite absmax's rows stay zero, inf or
  NaN)."""
  qf = precision.widen(qr)
  scale = precision.float16_scale(jnp.max(jnp.abs(qf), axis=(2, 3)))
  return (qf / scale[:, :, None, None]).astype(jnp.float16), scale


def paged_decode(q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None, page_offset=0,
                 tuning: PagedTuning = PagedTuning(), interpret: bool = False):
  """Attention of a few query tokens per sequence over a paged cache. Returns (out [B, T, N, H], lse [B, T, N]).

  q [B, T, N, H]; k_pages, v_pages [P, Z, K, H] (bf16/fp16, or fp8 with k_scale, v_scale [P, K] f32);
  page_table [B, M] int32, pages counted from page `page_offset` of the pools (an offset added in the kernel, not
  a [B, M] add before it); q_pos [B, T]; kv_len [B].
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
  B, T, N, H = q.shape
  P, Z, K, _ = k_pages.shape
  M = page_table.shape[1]
  G = N // K
  if N % K:
    raise ValueError(f"query heads {N=} are not divisible by kv heads {K=}")
  quantized = k_scale is not None
  if quantized != (v_scale is not None):
    raise ValueError(f"k_scale and v_scale come together, got {k_scale is None=} {v_scale is None=}")
  R0 = T * G
  R = max(tuning.min_rows, next_pow2(R0))
  if R > tuning.max_rows:
    raise ValueError(f"{T=} * {G=} query rows per kv head exceed {tuning.max_rows=}; this is prefill, not decode")
  reason = unsupported_shape(Z, H)
  if reason:
    raise ValueError(reason)
  S_ = num_splits_for(tuning, B, K, M)
  pps = -(-M // S_)
  if tuning.combine_block & (tuning.combine_block - 1) or H % min(H, tuning.combine_block):
    raise ValueError(f"combine_block={tuning.combine_block} must be a power of two dividing head dim H={H}")
  Zb = min(Z, tuning.block_tokens)
  if Zb & (Zb - 1) or Zb < 16:
    raise ValueError(f"block_tokens={tuning.block_tokens} must be a power of two >= 16 for the Triton kernel")
  upp = max(1, min(tuning.pages_per_step, pps * (Z // Zb)))

  qr = jnp.pad(rows_per_kv_head(q, K), ((0, 0), (0, 0), (0, R - R0), (0, 0)))
  if quantized:
    qr, qs = _scale_queries(qr)                                        # see the fp8 note in _kernel
  qpos = jnp.broadcast_to(q_pos, (B, T)).astype(jnp.int32)
  kvl = jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32)

  kernel = lambda *refs: _kernel(*refs, Z=Z, Zb=Zb, H=H, pps=pps, upp=upp, quantized=quantized,
                                 scale_log2=_LOG2E / math.sqrt(H), T=T, G=G)
  whole = pl.no_block_spec                                              # whole-array refs, indexed in the kernel
  in_specs = [whole, whole, whole, whole,
              pl.BlockSpec((None, None, R, H), lambda b, h, s: (b, h, 0, 0)),
              whole, whole]
  args = [kvl, jnp.reshape(page_offset, (1,)).astype(jnp.int32), page_table.astype(jnp.int32), qpos, qr,
          k_pages, v_pages]
  if quantized:
    in_specs += [whole, whole, whole]
    args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), qs]
  # Partials of S2 >= S_ splits (a power of two: the combine loads a row's splits as one block); the kernel
  # writes the S_ that run, and only their R0 real rows.
  S2 = next_pow2(S_)
  o, lse = pl.pallas_call(
      kernel,
      grid=(B, K, S_),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, None, R, H), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
      out_shape=[jax.ShapeDtypeStruct((B, K, S2, R, H), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, S2, R), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
      interpret=interpret,
      name="lcjax_paged_decode",
  )(*args)
  return combine_splits(o, lse, S=S_, G=G, out_shape=(B, T, N, H), out_dtype=q.dtype, tuning=tuning,
                        interpret=interpret)


def combine_splits(o, lse, *, S: int, G: int, out_shape, out_dtype, tuning: PagedTuning = PagedTuning(),
                   transposed: bool = False, interpret: bool = False):
  """Join split partials o [B, K, S2, R, H] f32 ([B, K, S2, H, R] if transposed), lse [B, K, S2, R] f32 (S2 a
  power of two >= S; the first S written; row r = t * G + g of kv head h, rows r < T * G read) into
  (out [B, T, N, H] out_dtype, lse [B, T, N]).
  One kernel for every real row, where XLA takes four a layer for the same join (max, exp-sum, weighted sum,
  normalise + convert), ~0.2 ms a token at 128K on the H200."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
  B, T, N, H = out_shape
  K = o.shape[1]
  HB = min(H, tuning.combine_block)
  whole = pl.no_block_spec
  return pl.pallas_call(
      lambda *refs: _combine_kernel(*refs, S=S, G=G, HB=HB, transposed=transposed),
      grid=(B, K, T * G, H // HB),
      in_specs=[whole, whole],
      out_specs=[whole, whole],
      out_shape=[jax.ShapeDtypeStruct((B, T, N, H), out_dtype), jax.ShapeDtypeStruct((B, T, N), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=tuning.combine_warps, num_stages=1),
      interpret=interpret,
      name="lcjax_paged_combine",
  )(o, lse)


def paged_decode_reference(q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None):
  """The oracle of `paged_decode`: the contract's jnp reference."""
  return ref.paged_attention_reference(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len,
                                       k_scale=k_scale, v_scale=v_scale)
