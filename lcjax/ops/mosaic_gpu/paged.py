"""Paged split-K decode over fp8 (e4m3) pages in Pallas Mosaic GPU: Q K^T as an fp8 wgmma straight from the pages.

Decode reads every cached K and V byte once per token, so its floor is HBM bandwidth: with e4m3 pages half of the
bf16 bytes. This kernel keeps K in e4m3 from HBM to the tensor cores. The query rows are quantized to two e4m3
terms (one scale per sequence and kv head, `quantize_rows`), and the scores are computed transposed, S^T = K Q^T,
so the 64 keys of a block are the wgmma's M and the few query rows its N (a multiple of 8): a decode row costs the
tensor cores 8 columns, not a 64-row tile of mostly padding, and the softmax works on 64 x 8 values per block.
Hopper's fp8 wgmma takes only K-major operands, and in P @ V the contraction runs over keys while a page stores
each key's head_dim values contiguously: V is widened to float16 (exact: every e4m3 value is a float16)
and O^T = V^T P^T is a float16 wgmma (V^T read transposed from shared memory, P^T stored there by the
softmax). The page scales fold in per block: K's into the logits' factor, V's into that block's P @ V term, which
is added to the float32 accumulator.

One CTA takes (split s, kv head h, sequence b): the R = T * G query rows of kv head h over pages
[s * pps, (s + 1) * pps) of b's page table, read as blocks of BLOCK keys. One warpgroup computes; a second fills a
ring of `max_concurrent_steps` K/V slots by TMA and widens each V block into a ring of V16_SLOTS float16 blocks,
so the widening overlaps the compute warpgroup's chain of dependent steps rather than lengthening it. Each split
writes a float32 partial (out^T, lse); a split combine joins them exactly (DecodeTuning.combine:
lcjax.ops.mosaic_gpu.combine's, the default; its flat join, for which the kernel stores the lse broadcast over the
head dim; or Triton's of lcjax.ops.triton.paged, which the deprecated Pallas Triton lowering runs).

Over bfloat16 pages (`paged_decode_bf16`) the same kernel reads the queries as bf16 rows (one term, no scale),
computes S^T = K Q^T with one bf16 wgmma and O^T = V^T P^T with P in bf16 and V as TMA brought it; the TMA
warpgroup only fills the K/V ring. It is the Mosaic GPU counterpart of lcjax.ops.triton.paged's bf16 path, which
JAX's deprecated Triton lowering runs; the attention backend routes decode rows over bf16 pages to it on Hopper
(tools/bench_attention.py times both, `lcjax-mgpu-bf16-mcs2-mcombine` beside `lcjax-pallas`).

Masking is the paged contract's: token j is visible to row (t, g) iff j < kv_len[b] and j <= q_pos[b, t]. Blocks
whose keys every real row sees skip the mask arithmetic. Padded rows (r >= R) are computed and written in the
partials; the combine reads only the R real ones.

Legend: B batch, T queries, N query heads, K kv heads, G = N // K, H head dim, P pages, Z page size, M slots,
R = T * G rows per kv head, RN = R rounded up to a multiple of 8.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lcjax.ops import attention as ref
from lcjax.ops import fp8 as fp8_ops
from lcjax.ops.splits import heads_from_rows, rows_per_kv_head, split_count
from lcjax.ops.triton import paged as triton_paged
from lcjax.ops.mosaic_gpu import combine as mgpu_combine
from lcjax.ops.mosaic_gpu.common import CTA_RESERVED_BYTES, fill_ring, prime_ring, resident_ctas, smem_transforms

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_FLOOR = -1e30
MAX_ROWS = 64                # query rows per kv head: a wgmma's N (rows are padded to a multiple of 8)
BLOCK = 64                   # keys per K/V block: the M of S^T = K Q^T and the K of O^T = V^T P^T
LO = 16.0                    # the second e4m3 term of the queries carries their rounding error times this
V16_SLOTS = 2                # float16 V blocks the TMA warpgroup widens ahead of the P @ V products
COMBINES = ("triton", "mosaic", "mosaic-flat")
SMEM_ALIGN = 1024            # Pallas Mosaic GPU aligns each scoped shared-memory buffer to this
SMEM_LOWERING = 2 * 1024     # shared memory the lowering adds to a kernel's scoped buffers (jax 0.10.2 and 0.11.2)
SMEM_RESERVED = CTA_RESERVED_BYTES + 1024   # per CTA besides `smem_bytes`: what the hardware keeps, the barriers


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
  """Static knobs (part of the jit cache key)."""
  num_splits: int | None = None      # splits of each (b, h)'s page table (rounded down to a power of two);
                                     # None: about two CTAs per SM
  target_ctas: int = 264             # CTAs aimed at by the heuristic: an H200 has 132 SMs, and two CTAs share
                                     # an SM where the ring depth lets them (`ring_depth`)
  min_pages_per_split: int = 4
  max_concurrent_steps: int | None = None   # K/V ring depth; None: `ring_depth` per call
  combine: str = "mosaic"            # the split combine: "mosaic" (lcjax.ops.mosaic_gpu.combine), "mosaic-flat"
                                     # (its combine_splits_flat, on partials whose lse the kernel stores broadcast
                                     # over the head dim), "triton" (lcjax.ops.triton.paged: 0.5-1.4 us a call
                                     # faster in the engine on an H100, through the deprecated Pallas Triton
                                     # lowering)

  @property
  def lse_broadcast(self) -> bool:
    """Whether the kernel holds each split's lse broadcast over the head dim (no lse row in shared memory): for the
    flat combine."""
    return self.combine == "mosaic-flat"

  def __post_init__(self):
    if self.max_concurrent_steps is not None and self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2")
    if self.combine not in COMBINES:
      raise ValueError(f"combine={self.combine!r} is not one of {COMBINES}")


def why_not(*, head_dim: int, page_size: int, rows: int, page_dtype=fp8_ops.E4M3) -> str | None:
  """Why the decode kernel cannot serve this shape (None: it can): e4m3 pages (`paged_decode_fp8`) or bfloat16
  pages (`paged_decode_bf16`)."""
  if jnp.dtype(page_dtype) not in (fp8_ops.E4M3, jnp.dtype(jnp.bfloat16)):
    return f"the Mosaic GPU decode kernel reads float8_e4m3fn or bfloat16 pages, not {jnp.dtype(page_dtype).name}"
  if head_dim not in (64, 128):
    return f"the Mosaic GPU decode kernel is built for head_dim 64 or 128, got {head_dim=}"
  if page_size % BLOCK:
    return (f"the Mosaic GPU decode kernel reads pages in blocks of {BLOCK} tokens; page_size={page_size} is not a "
            "multiple")
  if rows > MAX_ROWS:
    return f"{rows} query rows per kv head exceed the Mosaic GPU decode kernel's {MAX_ROWS}"
  return None


def smem_bytes(*, RN: int, H: int, mcs: int, page_dtype, flat: bool = False) -> int:
  """Shared memory Pallas asks for one CTA of `_decode_call`: the query terms, the K/V ring of mcs slots, the
  widened V ring (e4m3 pages), P^T, the out^T tile and the lse row, each rounded up to SMEM_ALIGN bytes, and the
  lowering's own SMEM_LOWERING bytes (barriers not counted: tests/test_fp8_decode.py checks this against the
  lowering's request)."""
  quantized = jnp.dtype(page_dtype) == fp8_ops.E4M3
  page = jnp.dtype(page_dtype).itemsize
  buffers = [2 * RN * H if quantized else RN * H * 2,          # two e4m3 terms, or the bf16 rows
             mcs * BLOCK * H * page, mcs * BLOCK * H * page,   # the K and V rings
             V16_SLOTS * BLOCK * H * 2 if quantized else 0,    # V widened to float16
             RN * BLOCK * 2, H * RN * 4, 0 if flat else RN * 4]
  return sum(-(-b // SMEM_ALIGN) * SMEM_ALIGN for b in buffers) + SMEM_LOWERING


RINGS = (4, 3, 2)            # ring depths `ring_depth` tries, deepest first


def ring_depth(tuning: DecodeTuning, *, RN: int, H: int, page_dtype) -> int:
  """The K/V ring depth of a call: tuning.max_concurrent_steps, else the deepest of RINGS with which two CTAs share
  an SM (a verify step's 9-48 rows a kv head: two CTAs of a shallower ring beat one of 4 slots: 0.170 against
  0.195 ms at 128K and 0.452 against 0.608 at 512K, 20 rows, H100), else the deepest (one CTA an SM anyway)."""
  if tuning.max_concurrent_steps is not None:
    return tuning.max_concurrent_steps
  for mcs in RINGS:
    if resident_ctas(smem_bytes(RN=RN, H=H, mcs=mcs, page_dtype=page_dtype, flat=tuning.lse_broadcast),
                     SMEM_RESERVED) >= 2:
      return mcs
  return RINGS[0]


def num_splits_for(tuning: DecodeTuning, B, K, M):
  """Splits of each (b, h)'s page table: `split_count` with at most target_ctas CTAs wanted, a
  requested count rounded down to a power of two as well (this kernel's combine takes whole powers of two)."""
  n = split_count(requested=tuning.num_splits, wanted=max(1, tuning.target_ctas // (B * K)), M=M,
                               min_pages_per_split=tuning.min_pages_per_split)
  return 1 << (n.bit_length() - 1)


def quantize_rows(q, K):
  """q [B, T, N, H] -> (q8 [B, K, 2, RN, H] e4m3, qs [B, K] float32): Q = (q8[:, :, 0] + q8[:, :, 1] / LO) * qs.

  Row r = t * G + g of kv head h is query head h * G + g at token t, padded with zero rows to RN, the next
  multiple of 8; one scale per (b, h), the rows' absmax times 1/448 (`fp8_ops.absmax_scale`). q8[:, :, 0] is
  Q / qs rounded to e4m3 (relative error up to 2^-4: 0.05 in a logit of 1, a 5% error of its attention weight),
  q8[:, :, 1] the rounding error times LO rounded again, so the two together carry Q to ~2^-8, near bf16's 2^-9.
  The kernel runs both against each K block: a second wgmma of BLOCK x RN x H, cheap beside the block's bytes."""
  qr = rows_per_kv_head(q, K).astype(jnp.float32)
  qs = fp8_ops.absmax_scale(qr, axes=(2, 3))
  x = qr / qs[:, :, None, None]
  # hi is rounded in float32 (fp8_ops.round_to_e4m3), not by a round trip through e4m3, which XLA may fold away;
  # with no barrier between the terms, XLA makes both (and the padding) in one fusion.
  hi = fp8_ops.round_to_e4m3(jnp.clip(x, -fp8_ops.E4M3_MAX, fp8_ops.E4M3_MAX))
  lo = (x - hi) * LO                                                          # |x - hi| <= 16: within e4m3
  return _pad_rows(jnp.stack([hi, lo], axis=2).astype(fp8_ops.E4M3)), qs


def _pad_rows(rows):
  """rows [B, K, terms, R, H] -> the same with R padded by zero rows to RN, the next multiple of 8 (wgmma's N)."""
  R = rows.shape[3]
  return jnp.pad(rows, ((0, 0), (0, 0), (0, 0), (0, -(-R // 8) * 8 - R), (0, 0)))


def dequantize_rows(q8, qs, T, G):
  """The queries `quantize_rows` encodes, [B, T, N, H] float32."""
  x = q8[:, :, 0, :T * G].astype(jnp.float32) + q8[:, :, 1, :T * G].astype(jnp.float32) / LO
  return heads_from_rows(x * qs[:, :, None, None], T, G)


def _decode_call(q8, qs, k_pages, v_pages, k_scale, v_scale, table, qpos, kvl, page_offset, *, T, G, splits,
                 tuning: DecodeTuning):
  """The kernel: partials (o [B, K, splits, H, RN] f32, transposed; lse [B, K, S2, RN] f32, natural log, the first
  `splits` of S2 rows written: S2 = mgpu_combine.lse_rows(splits, RN) for the Mosaic GPU combine, else splits;
  with combine "mosaic-flat" the lse broadcast over the head dim instead, [B, K, splits, H, RN]).

  Over e4m3 pages q8 [B, K, 2, RN, H] holds the queries' two e4m3 terms and qs [B, K] their scale. Over bfloat16
  pages (`quantized` False) q8 [B, K, 1, RN, H] is the bfloat16 rows themselves, qs, k_scale and v_scale are
  not read, Q K^T is one bf16 wgmma, P is bfloat16 and V is read as TMA brought it: the TMA warpgroup only fills
  the ring (`fill_ring`)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  B, K, n_terms, RN, H = q8.shape
  quantized = k_pages.dtype == fp8_ops.E4M3
  p_dtype = jnp.float16 if quantized else k_pages.dtype      # P's dtype in P @ V: V's as the wgmma reads it
  Z = k_pages.shape[1]
  M = table.shape[1]
  Zb = BLOCK
  bpp = Z // Zb                                   # blocks per page
  pps = -(-M // splits)                           # pages per split
  mcs = ring_depth(tuning, RN=RN, H=H, page_dtype=k_pages.dtype)
  S2 = mgpu_combine.lse_rows(splits, RN) if tuning.combine == "mosaic" else splits
  flat = tuning.lse_broadcast                     # the lse held broadcast over the head dim
  c = _LOG2E / math.sqrt(H)
  COLS = plgpu.Layout.WGMMA.reduce(0)             # a [RN] vector: one value per query row (a tile column)

  def body(q_ref, qs_ref, k_ref, v_ref, ks_ref, vs_ref, table_ref, qpos_ref, kvl_ref, off_ref, o_ref, lse_ref,
           scratch):
    # fp8: `v_free` is the widened V ring's (V16_SLOTS); bf16: the K/V ring's, as `k_free`
    ((q_smem, k_smem, v_smem, v16_smem, p_smem, o_smem, lse_smem), (k_bar, v_bar, q_bar, v16_bar),
     (k_free, v_free)) = scratch
    s = lax.axis_index("splits")
    h = lax.axis_index("heads")
    b = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    offset = off_ref[0]
    qpos_t = [qpos_ref[b, t] for t in range(T)]
    last, lowest = qpos_t[0], qpos_t[0]
    for p in qpos_t[1:]:
      last, lowest = jnp.maximum(last, p), jnp.minimum(lowest, p)
    # Keys this split reads: below kv_len, up to the last query position, within the split's pages and the table
    # (the last splits' pages can run past its M slots).
    lim = jnp.minimum(jnp.minimum(kvl_ref[b], last + 1), jnp.minimum((s + 1) * pps, M) * Z)
    first = s * pps * bpp
    n = jnp.maximum(jnp.minimum(first + pps * bpp, (lim + Zb - 1) // Zb) - first, 0)
    # Blocks wholly below min(lim, lowest + 1) are visible to every real row: they skip the mask.
    n_full = jnp.clip(lax.div(jnp.minimum(lim, lowest + 1), jnp.array(Zb, lim.dtype)) - first, 0, n)

    def page_of(j):
      # The one-step-ahead loads read slots past a split's last block too: the slot is kept in the table, whose
      # every entry names a page (the contract). Clipping the page id as well measured 18% slower (batch 8, 128K
      # and 512K, 64-token pages).
      slot = jnp.minimum(lax.div(j, jnp.array(bpp, j.dtype)), M - 1)
      return table_ref[b, slot] + offset

    @pl.when(wg == 0)
    def _compute():
      c_q = c * qs_ref[b, h] if quantized else c
      plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])
      plgpu.barrier_wait(q_bar.at[0])
      if T > 1:
        cols = plgpu.broadcasted_iota(jnp.int32, (Zb, RN), 1, layout=plgpu.Layout.WGMMA)
        thr = jnp.full((Zb, RN), -1, jnp.int32)
        for t in range(T):
          thr = jnp.where((cols >= t * G) & (cols < (t + 1) * G), qpos_t[t], thr)
      else:
        thr = None

      def step(i, carry, masked: bool):
        acc, m, l, ks_i, vs_i, pid_next = carry
        if quantized:
          # The next block's scales and the page after it: loaded a step ahead, so their latency hides here.
          ks_n, vs_n = ks_ref[pid_next, h], vs_ref[pid_next, h]
          pid_nn = page_of(first + i + 2)
        else:
          ks_n, vs_n, pid_nn = ks_i, vs_i, pid_next
        slot = lax.rem(i, jnp.array(mcs, i.dtype))
        plgpu.barrier_wait(k_bar.at[slot])

        # S^T [keys, rows] = K Q^T: the K tile as TMA brought it (M = 64 keys) against the two e4m3 terms of Q.
        def qk(hi_ref, lo_ref=None):
          plgpu.wgmma(hi_ref, k_smem.at[slot], q_smem.at[0].transpose((1, 0)))
          if lo_ref is None:
            return hi_ref[...]
          plgpu.wgmma(lo_ref, k_smem.at[slot], q_smem.at[1].transpose((1, 0)))
          return hi_ref[...] + lo_ref[...] * (1.0 / LO)

        sc = pl.run_scoped(qk, *[plgpu.ACC((Zb, RN), jnp.float32)] * n_terms)
        plgpu.barrier_arrive(k_free.at[slot])
        sc = sc * (c_q * ks_i if quantized else c_q)              # base-2 logits
        if masked:
          keys = plgpu.broadcasted_iota(jnp.int32, (Zb, RN), 0, layout=plgpu.Layout.WGMMA) + (first + i) * Zb
          vis = keys < lim                                        # with one token, lim <= q_pos + 1 already
          sc = jnp.where(vis if thr is None else vis & (keys <= thr), sc, -jnp.inf)
        m_new = jnp.maximum(m, sc.max(axis=0))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [1]))
        # Row sums stay per key until the end: one cross-warp reduction per block (the max) instead of two.
        l = l * lax.broadcast_in_dim(alpha, sc.shape, [1]) + p
        p_smem.transpose((1, 0))[...] = plgpu.layout_cast(p.astype(p_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        if quantized:
          w = lax.rem(i, jnp.array(V16_SLOTS, i.dtype))
          plgpu.barrier_wait(v16_bar.at[w])
          v_block = v16_smem.at[w]
        else:
          w = slot
          plgpu.barrier_wait(v_bar.at[slot])
          v_block = v_smem.at[slot]

        # O^T [H, rows] = V^T P^T, in float16 over fp8 pages (V widened exactly by the TMA warpgroup; Hopper's fp8
        # wgmma cannot read V^T from a page), in bf16 over bf16 pages.
        def pv(acc_ref):
          plgpu.wgmma(acc_ref, v_block.transpose((1, 0)), p_smem.transpose((1, 0)))
          return acc_ref[...]

        pvb = pl.run_scoped(pv, plgpu.ACC((H, RN), jnp.float32))
        plgpu.barrier_arrive(v_free.at[w])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1]) + (pvb * vs_i if quantized else pvb)
        return acc, m_new, l, ks_n, vs_n, pid_nn

      pid0 = page_of(first)
      carry = (plgpu.layout_cast(jnp.full((H, RN), 0.0, jnp.float32), plgpu.Layout.WGMMA),
               plgpu.layout_cast(jnp.full((RN,), _M_FLOOR, jnp.float32), COLS),
               plgpu.layout_cast(jnp.full((Zb, RN), 0.0, jnp.float32), plgpu.Layout.WGMMA),
               *((ks_ref[pid0, h], vs_ref[pid0, h]) if quantized else (jnp.float32(1.0),) * 2), page_of(first + 1))
      carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
      acc, m, l, *_ = lax.fori_loop(n_full, n, functools.partial(step, masked=True), carry)

      l = l.sum(axis=0)
      empty = l == 0                     # not l > 0 failing: a NaN or inf score's NaN stays in out and lse
      l_safe = jnp.where(empty, 1.0, l)
      o_smem[...] = acc * lax.broadcast_in_dim(1.0 / l_safe, (H, RN), [1])
      lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * _LN2)
      if not flat:
        lse_smem[...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, s])
      if flat:
        # The broadcast lse goes out through o's buffer once its copy has read it (no shared memory of its own:
        # at 9-16 rows another [H, RN] buffer would leave one fp8 CTA an SM instead of two).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_smem[...] = lax.broadcast_in_dim(lse, (H, RN), [1])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, lse_ref.at[b, h, s])
      else:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, s])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
      # Fills the K/V ring by TMA and widens each V block to float16 into a ring of V16_SLOTS, off the compute
      # warpgroup's chain. A ring slot is refilled once its V is widened and its K consumed.
      def issue(i, slot):
        j = first + i
        pid = page_of(j)
        keys = pl.ds(lax.rem(j, jnp.array(bpp, j.dtype)) * Zb, Zb)
        plgpu.copy_gmem_to_smem(k_ref.at[pid, keys, h], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[pid, keys, h], v_smem.at[slot], v_bar.at[slot])

      if not quantized:
        fill_ring(issue, n, mcs, k_free, v_free)
        return
      prime_ring(issue, n, mcs)

      @pl.loop(0, n)
      def _(i):
        slot = lax.rem(i, jnp.array(mcs, i.dtype))
        w = lax.rem(i, jnp.array(V16_SLOTS, i.dtype))
        plgpu.barrier_wait(v_bar.at[slot])
        pl.when(i >= V16_SLOTS)(lambda: plgpu.barrier_wait(v_free.at[w]))
        v16_smem.at[w][...] = v_smem.at[slot][...].astype(jnp.float16)
        plgpu.commit_smem()
        plgpu.barrier_arrive(v16_bar.at[w])

        @pl.when(i + mcs < n)
        def _():
          plgpu.barrier_wait(k_free.at[slot])
          issue(i + mcs, slot)

  page = k_pages.dtype

  def entry(*refs):
    ins, (o_ref, lse_ref) = refs[:10], refs[10:]
    tiled = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=smem_transforms(dt, shape[-1]))
    smem = (tiled((n_terms, RN, H), q8.dtype),
            tiled((mcs, Zb, H), page),
            tiled((mcs, Zb, H), page),
            tiled((V16_SLOTS, Zb, H), jnp.float16) if quantized else None,
            tiled((RN, Zb), p_dtype),
            plgpu.SMEM((H, RN), jnp.float32),
            None if flat else plgpu.SMEM((RN,), jnp.float32))
    v_slots = V16_SLOTS if quantized else mcs
    loaded = (plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=1),
              plgpu.Barrier(num_arrivals=1, num_barriers=V16_SLOTS) if quantized else None)
    freed = (plgpu.Barrier(num_arrivals=1, num_barriers=mcs), plgpu.Barrier(num_arrivals=1, num_barriers=v_slots))
    pl.run_scoped(lambda *scratch: body(*ins, o_ref, lse_ref, scratch), smem, loaded, freed,
                  collective_axes="wg")

  return plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((B, K, splits, H, RN), jnp.float32),
                jax.ShapeDtypeStruct((B, K, splits, H, RN) if flat else (B, K, S2, RN), jnp.float32)),
      grid=(splits, K, B),
      grid_names=("splits", "heads", "batch"),
      num_threads=2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(q8, qs, k_pages, v_pages, k_scale, v_scale, table, qpos, kvl, page_offset)


def paged_decode_fp8(q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale, v_scale, page_offset=0,
                     tuning: DecodeTuning = DecodeTuning()):
  """`triton_paged.paged_decode`'s contract over fp8 pages: (out [B, T, N, H] q.dtype, lse [B, T, N] f32).

  q [B, T, N, H] (quantized here by `quantize_rows`); k_pages, v_pages [P, Z, K, H] float8_e4m3fn with k_scale,
  v_scale [P, K] float32 (value = page * scale); page_table [B, M] int32 read from page `page_offset` of the
  pools, every entry a page of them, the slots past a sequence's pages included (the page pool pads with the
  null page 0); q_pos [B, T]; kv_len [B].
  """
  B, T, N, H = q.shape
  K = k_pages.shape[2]
  if N % K:
    raise ValueError(f"query heads {N=} are not divisible by kv heads {K=}")
  q8, qs = quantize_rows(q, K)
  return paged_decode_quantized(q8, qs, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len, k_scale=k_scale,
                                v_scale=v_scale, page_offset=page_offset, tuning=tuning, T=T, G=N // K,
                                out_dtype=q.dtype)


@functools.partial(jax.jit, static_argnames=("tuning", "T", "G", "out_dtype"))
def paged_decode_quantized(q8, qs, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale, v_scale, T: int, G: int,
                           out_dtype, page_offset=0, tuning: DecodeTuning = DecodeTuning()):
  """The kernel and its split combine on queries already quantized by `quantize_rows` (q8 [B, K, 2, RN, H], qs
  [B, K]) for T tokens of G query heads per kv head: (out [B, T, K * G, H] out_dtype, lse [B, T, K * G] f32)."""
  H = q8.shape[-1]
  reason = why_not(head_dim=H, page_size=k_pages.shape[1], rows=T * G, page_dtype=k_pages.dtype)
  if reason or not v_pages.dtype == k_pages.dtype == fp8_ops.E4M3:
    raise ValueError(reason or f"the fp8 decode takes float8_e4m3fn pages, got k_pages {k_pages.dtype} and "
                     f"v_pages {v_pages.dtype}")
  if k_scale is None or v_scale is None:
    raise ValueError(f"fp8 pages need k_scale and v_scale, got {k_scale is None=} {v_scale is None=}")
  return _decode_and_combine(q8, qs, k_pages, v_pages, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32),
                             page_table, q_pos=q_pos, kv_len=kv_len, page_offset=page_offset, T=T, G=G,
                             out_dtype=out_dtype, tuning=tuning)


def _decode_and_combine(q_rows, qs, k_pages, v_pages, k_scale, v_scale, page_table, *, q_pos, kv_len, page_offset,
                        T, G, out_dtype, tuning: DecodeTuning):
  """The kernel over the padded query rows of each kv head (`_decode_call`'s q8: e4m3 terms or bf16 rows), then the
  split combine `tuning.combine` names: (out [B, T, K * G, H] out_dtype, lse [B, T, K * G] f32)."""
  B, K, _, _, H = q_rows.shape
  splits = num_splits_for(tuning, B, K, page_table.shape[1])
  out = _decode_call(q_rows, qs, k_pages, v_pages, k_scale, v_scale, page_table.astype(jnp.int32),
                    jnp.broadcast_to(q_pos, (B, T)).astype(jnp.int32),
                    jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32),
                    jnp.reshape(page_offset, (1,)).astype(jnp.int32), T=T, G=G, splits=splits, tuning=tuning)
  o, lse = out
  if tuning.combine == "mosaic-flat":
    return mgpu_combine.combine_splits_flat(o, lse, T=T, G=G, out_dtype=out_dtype)
  if tuning.combine == "mosaic":
    return mgpu_combine.combine_splits(o, lse, T=T, G=G, out_dtype=out_dtype)
  return triton_paged.combine_splits(o, lse, S=splits, G=G, out_shape=(B, T, K * G, H), out_dtype=out_dtype,
                                     transposed=True)


@functools.partial(jax.jit, static_argnames=("tuning",))
def paged_decode_bf16(q, k_pages, v_pages, page_table, *, q_pos, kv_len, page_offset=0,
                      tuning: DecodeTuning = DecodeTuning()):
  """`triton_paged.paged_decode`'s contract over bfloat16 pages: (out [B, T, N, H] q.dtype, lse [B, T, N] f32).
  q [B, T, N, H] bfloat16; k_pages, v_pages [P, Z, K, H] bfloat16; page_table [B, M] int32 read from page
  `page_offset` of the pools (every entry a page of them); q_pos [B, T]; kv_len [B]."""
  B, T, N, H = q.shape
  Z, K = k_pages.shape[1:3]
  reason = why_not(head_dim=H, page_size=Z, rows=T * (N // K), page_dtype=k_pages.dtype)
  if reason or N % K or not q.dtype == v_pages.dtype == k_pages.dtype == jnp.bfloat16:
    raise ValueError(reason or f"the Mosaic GPU bf16 decode takes bfloat16 queries and pages and N % K == 0, got "
                     f"q {q.dtype} {N=}, k_pages {k_pages.dtype} {K=}, v_pages {v_pages.dtype}")
  unread = jnp.ones((1, 1), jnp.float32)                   # qs and the page scales: bf16 pages have none
  q_rows = _pad_rows(rows_per_kv_head(q, K)[:, :, None])   # [B, K, 1, RN, H]: one bf16 term, no scale
  return _decode_and_combine(q_rows, unread, k_pages, v_pages, unread, unread, page_table, q_pos=q_pos,
                             kv_len=kv_len, page_offset=page_offset, T=T, G=N // K, out_dtype=q.dtype, tuning=tuning)


def paged_decode_quantized_model(q8, qs, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale, v_scale, T: int,
                                 G: int, page_offset=0):
  """`paged_decode_quantized`'s oracle on the same quantized queries: the jnp reference (float32; on a GPU under
  jax.default_matmul_precision("highest"), or its products are TF32) over the queries q8 and qs encode and the
  dequantized pages. Not the kernel's arithmetic step by step: the kernel rounds P to float16 for P @ V, its fp8
  wgmma accumulates with fewer bits than float32, and its sums run in another order. Returns (out f32, lse)."""
  return ref.paged_attention_reference(dequantize_rows(q8, qs, T, G), k_pages, v_pages, page_table + page_offset,
                                       q_pos=q_pos, kv_len=kv_len, k_scale=k_scale, v_scale=v_scale)
