"""Flash-attention forward for Hopper in Pallas Mosaic GPU, returning (out, lse), with position-aware masks.

Warp-specialised like FlashAttention-3: one CTA takes 2 * block_q query rows of one head; two compute
warpgroups own block_q rows each and a third warpgroup only issues TMA loads of K/V blocks into a ring of
`max_concurrent_steps` shared-memory slots. The compute warpgroups take turns on the tensor cores (a shared
"schedule" barrier), so one's softmax overlaps the other's QK^T / PV wgmma.

Masking: key j is visible to row i iff j < kv_len[b] and (not causal or j <= i + d[b]), d = q_pos[b, 0] - k_start[b]
(rows contiguous, d >= 0: the caller checks). Per warpgroup the key blocks split into three runs: blocks every row
sees fully (no mask arithmetic), blocks that need the mask, and blocks past the last visible key, which the
memory warpgroup still loads for the other warpgroup and this one just releases. Running maxima start at a finite
floor and masked scores are -inf, so a row that sees no key ends with l = 0: out = 0 and lse = -inf.

Key splits: a grid of few tiles (a question's rows over a long cached prefix) leaves SMs idle in its last wave, so
each tile's key range can be cut into `FlashTuning.kv_splits` parts, each a CTA writing its own (out, lse) partial,
merged by their lse after the kernel (`merge_splits`); the count is chosen per call by the grid's waves on this
GPU (`kv_splits_for`) unless given.

Softmax runs in base 2 with the 1/sqrt(H) * log2(e) factor folded into the exponent (one FMA per score); the
kernel's lse is converted to natural log outside. Causal tiles run heaviest first (reversed q-tile order) so the
short tiles fill the tail of the grid.

Legend: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lcjax.ops import attention as ref
from lcjax.ops import fp8 as fp8_ops
from lcjax.ops.hardware import sm_count
from lcjax.ops.mosaic_gpu.common import fill_ring, smem_transforms

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_FLOOR = -1e30
_COMPUTE_WGS = 2
MAX_KV_SPLITS = 8
# A CTA's cost beside its key blocks, in block-times (the Q load, the ring's first fill, the output's store): what
# makes many short splits dearer than a few long ones in `kv_splits_for`.
_CTA_OVERHEAD_BLOCKS = 2
# The FP8 kernel's P @ V takes P's e4m3 registers as they come out of the float32 accumulator layout, read as the
# 8-bit A-operand layout: within every 16-key group, A position 4t + u holds key KEY_PERM[4t + u] (a quad's
# thread t owns keys 2t, 2t+1, 8+2t, 9+2t of the group in the first layout and positions 4t..4t+3 in the second).
# V's keys are put in the same order before the kernel, so the product is unchanged.
KEY_PERM = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


@dataclasses.dataclass(frozen=True)
class FlashTuning:
  """Static knobs (part of the jit cache key)."""
  block_q: int = 64                  # rows per compute warpgroup (a wgmma M tile)
  block_kv: int = 128
  max_concurrent_steps: int = 2      # K/V shared-memory ring depth
  reverse_q: bool = True             # heaviest causal tiles first
  # setmaxnreg for the compute / memory warpgroups (2 * 240 + 24 <= 512 per thread slot). 240/24 against JAX's
  # example's 232/40: 466 vs 344 TF/s at 8K, 656 vs 645 at 32K, 607 vs 608 at 128K (call 2; spread ~5-10%).
  compute_regs: int = 240
  memory_regs: int = 24
  # Splits of each tile's key range, each a CTA of its own, merged by their lse (`merge_splits`): None picks the
  # count that ends the grid in the fewest block-times on this GPU's SMs if that saves 5% (`kv_splits_for`). A
  # question of 5 tiles a head over a 128K prefix is 160 CTAs on 132 SMs, two waves of one CTA's work; 4 splits
  # make it 5 waves of a quarter.
  kv_splits: int | None = None
  # Non-empty: Mosaic GPU's on-device profiler writes a Chrome trace of the step's named phases here
  # (tools/profile_prefill.py). Its buffer lives in shared memory, so it serves up to PROFILE_MAX_KEYS keys.
  profile_dir: str = ""

  def __post_init__(self):
    if self.block_q % 64 or self.block_kv % 64:
      raise ValueError(f"block_q={self.block_q} and block_kv={self.block_kv} must be multiples of 64")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2")
    if self.kv_splits is not None and not 1 <= self.kv_splits <= MAX_KV_SPLITS:
      raise ValueError(f"kv_splits={self.kv_splits} must be None (chosen per call) or 1 to {MAX_KV_SPLITS}")


def why_not(*, head_dim: int, dtype) -> str | None:
  if jnp.dtype(dtype).name not in ("bfloat16", "float16"):
    return f"the Mosaic GPU flash kernel takes bfloat16/float16, not {jnp.dtype(dtype).name}"
  if head_dim not in (64, 128):
    return f"the Mosaic GPU flash kernel is built for head_dim 64 or 128, got {head_dim=}"
  return None


def _steps(q_base, block_q, block_kv, d, kvl, causal):
  """(full, total) key-block counts for rows q_base .. q_base + block_q - 1."""
  if causal:
    hi = jnp.minimum(kvl, q_base + block_q + d)          # one past the last key the last row sees
    lo = jnp.minimum(kvl, q_base + d + 1)                # keys below this are seen by every row
  else:
    hi = lo = kvl
  hi = jnp.maximum(hi, 0)
  total = (hi + block_kv - 1) // block_kv
  full = jnp.clip(jnp.maximum(lo, 0) // block_kv, 0, total)
  return full, total


def cta_blocks(tile_base, d, kvl, q_len, split, *, bq: int, bkv: int, causal: bool, splits: int):
  """[lo, hi): the key blocks a CTA's memory warpgroup loads for the rows tile_base .. tile_base + 2 * bq - 1 (two
  compute warpgroups of bq rows), in split `split` of `splits`: its share, within a block of the others', of the
  blocks of the last warpgroup with real rows (rows at or past q_len are padding; q_len None: none is). The later
  rows of a causal tile need the most blocks; a CTA of padding loads none. Works on Python ints and traced int32
  alike (the kernel's scalars; tests/test_kernels.py checks the schedule's invariants on the CPU)."""
  _, need = _steps(tile_base + bq, bq, bkv, d, kvl, causal)
  if q_len is not None:
    _, first = _steps(tile_base, bq, bkv, d, kvl, causal)
    need = jnp.where(tile_base + bq < q_len, need, jnp.where(tile_base < q_len, first, 0))
  if splits == 1:
    return 0, need
  return split * need // splits, (split + 1) * need // splits


def warpgroup_blocks(q_base, d, kvl, q_len, lo, hi, *, bq: int, bkv: int, causal: bool):
  """(full, total) of the compute warpgroup of rows q_base .. q_base + bq - 1 in a CTA loading blocks [lo, hi):
  it computes blocks [lo, full) unmasked and [full, total) masked, and releases [total, hi) unread. A warpgroup of
  padding (q_base >= q_len) computes none."""
  full, total = _steps(q_base, bq, bkv, d, kvl, causal)
  if q_len is not None:
    full, total = jnp.where(q_base < q_len, full, 0), jnp.where(q_base < q_len, total, 0)
  return jnp.clip(full, lo, hi), jnp.clip(total, lo, hi)


def kv_splits_for(ctas: int, key_blocks: int, sms: int, most: int = MAX_KV_SPLITS) -> int:
  """Splits of every CTA's key range that end a grid of `ctas` CTAs of `key_blocks` key blocks each soonest on
  `sms` SMs (one CTA an SM): the grid takes ceil(ctas * s / sms) waves of ceil(key_blocks / s) +
  _CTA_OVERHEAD_BLOCKS block-times; at most one split a block. A split count must save 5% over one to be taken
  (its partials cost a merge). The counts are the call's static shapes: the keys of a paged call are its table's
  (M * Z), so a question over a short context in a long table is split as over the whole table."""
  cost = lambda s: -(-ctas * s // sms) * (-(-key_blocks // s) + _CTA_OVERHEAD_BLOCKS)
  best = min(range(1, min(most, key_blocks) + 1), key=cost)
  return best if cost(best) < 0.95 * cost(1) else 1


def merge_splits(out, lse):
  """The flash kernel's split partials -> one result: out [s, B, T, N, H] (each normalised over its keys), lse
  [s, B, N, T] float32 (natural log; -inf where a split saw no key) -> (out [B, T, N, H] in out's dtype, lse
  [B, N, T]): the exact log-sum-exp merge (`attention.merge_stack`). A row no split saw gets out 0 and lse -inf."""
  out, lse = ref.merge_stack(out, jnp.swapaxes(lse, 2, 3))
  return out, jnp.swapaxes(lse, 1, 2)


def block_copies(i, block_kv: int, Z: int, M: int):
  """The TMA copies that load key block i (keys i * block_kv ..) from pages of Z keys through a table of M slots:
  [(table slot m, first row in its page, rows, row in the block)]. Z a multiple of block_kv: one copy, a part of a
  page; block_kv a multiple of Z: block_kv / Z whole pages, the slots past the table repeating its last (kv_len
  masks their keys). i may be traced; the rows and positions in the block are Python ints."""
  if Z % block_kv and block_kv % Z:
    raise ValueError(f"page size Z={Z} and block_kv={block_kv}: one must divide the other")
  if Z >= block_kv:
    return [(i * block_kv // Z, i * block_kv % Z, block_kv, 0)]
  n = block_kv // Z
  return [(jnp.minimum(i * n + j, M - 1), 0, Z, j * Z) for j in range(n)]


def _flash_call(q, k, v, d, kvl, *, causal: bool, tuning: FlashTuning, save_lse: bool = True, scales=None,
                out_dtype=None, pages=None, q_len=None):
  """q [B, T, N, H] (T % (2 * block_q) == 0), k/v [B, S, K, H] (S % block_kv == 0), d/kvl [B] int32.

  FP8 (`scales` given, see lcjax.ops.fp8): q/k float8_e4m3fn, v float8_e4m3fn transposed [B, K, H, S] with the keys
  of every 16-key group in KEY_PERM order (v_operand),
  scales = (qs [B, N, T / block_q], ks [B, K, S / block_kv], vs [B, K]) float32; the output is `out_dtype`.
  FP8 and paged: k is the fp8 K pool read in place, v the pages' V bytes transposed as above [B, K, H, M * Z
  rounded up to block_kv], scales = (qs, the PageScales packed by `pack_page_scales` [B, K, NB, 3 n + 1]); each key
  block is n groups of block_kv / n keys (one page's): one QK^T over the block, a P and a P V product a group.
  q_len [B] int32 (None: every row is real): rows at or past q_len[b] are padding the caller drops. A compute
  warpgroup whose block_q rows are all padding skips its key blocks (out 0, lse -inf there); a CTA loads the
  blocks of its last warpgroup with real rows, none if it has none.
  save_lse=False drops the LSE output (only to measure what returning it costs; with key splits the kernel still
  stores it for their merge). With key splits (`FlashTuning.kv_splits`, or chosen by `kv_splits_for`) the
  kernel writes [splits * B, ...] partials, merged here.

  Paged (`pages` = (table [B, M] int32, offset [1] int32)): k/v are pools [P, Z, K, H] (FP8: k only) and key j of
  sequence b is row j % Z of pool page table[b, j // Z] + offset; S = M * Z. Z a multiple of block_kv, or block_kv
  a multiple of Z (a block then loads block_kv / Z pages, each its own TMA copy into the slot, all counted by the
  slot's barrier).
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  fp8 = scales is not None
  B, T, N, H = q.shape
  if pages is None:
    S, K = k.shape[1], k.shape[2]
  else:
    Z, K = k.shape[1], k.shape[2]
    M = pages[0].shape[1]
    S = M * Z
  paged_fp8 = fp8 and pages is not None
  # Key groups of a block (one page each) that paged FP8 computes apart, of gk keys
  n_groups = fp8_ops.page_groups(Z, tuning.block_kv) if paged_fp8 else 1
  gk = tuning.block_kv // n_groups
  # TMA copies a block of keys takes (the slot's load barriers count each); block_copies refuses page sizes that
  # neither divide nor are divided by block_kv (flash_attention_paged checks the rest with why_not_paged)
  copies = 1 if pages is None else len(block_copies(0, tuning.block_kv, k.shape[1], M))
  G = N // K
  dtype = q.dtype
  int_qk = jnp.issubdtype(dtype, jnp.integer)       # int8 Q and K: an int32 Q K^T
  v_dtype = v.dtype
  out_dtype = out_dtype or dtype
  bq, bkv = tuning.block_q, tuning.block_kv
  mcs = min(tuning.max_concurrent_steps, max(1, -(-S // bkv)))
  n_tiles = T // (_COMPUTE_WGS * bq)
  splits = tuning.kv_splits or kv_splits_for(N * n_tiles * B, -(-S // bkv), sm_count())
  keep_lse = save_lse
  save_lse = save_lse or splits > 1                   # the splits' merge weighs them by their lse
  c = _LOG2E / math.sqrt(H)
  if tuning.profile_dir and S > PROFILE_MAX_KEYS:
    raise ValueError(f"profiling keeps its trace in shared memory: {S} keys > PROFILE_MAX_KEYS={PROFILE_MAX_KEYS}")
  p_shift = float(fp8_ops.P_SHIFT) if fp8 else 0.0

  def body(q_ref, k_ref, v_ref, d_ref, kvl_ref, scale_refs, page_refs, q_len_ref, out_ref, lse_ref, scratch):
    (q_smem2, k_smem, v_smem, lse_smem2, o_smem2), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scratch
    cta = lax.axis_index("batch")                   # split * B + b
    b = lax.rem(cta, jnp.array(B, cta.dtype)) if splits > 1 else cta
    head = lax.axis_index("heads")
    kv_head = lax.div(head, jnp.array(G, head.dtype))
    tile = lax.axis_index("q_seq")
    if tuning.reverse_q:
      tile = n_tiles - 1 - tile
    wg = lax.axis_index("wg")
    db = d_ref[b]
    kb = kvl_ref[b]
    tile_base = tile * (_COMPUTE_WGS * bq)
    ql = None if q_len_ref is None else q_len_ref[b]
    split = lax.div(cta, jnp.array(B, cta.dtype)) if splits > 1 else 0
    # This CTA's key blocks [lo, hi), which the memory warpgroup loads into ring slots counted from lo.
    lo, hi = cta_blocks(tile_base, db, kb, ql, split, bq=bq, bkv=bkv, causal=causal, splits=splits)
    ring = lambda i: lax.rem(i - lo, jnp.array(mcs, i.dtype))

    def sched_sync():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(tuning.compute_regs, action="increase")
      q_smem = q_smem2.at[wg]
      o_smem = o_smem2.at[wg] if fp8 else q_smem
      lse_smem = None if lse_smem2 is None else lse_smem2.at[wg]
      q_base = tile_base + wg * bq
      full, total = warpgroup_blocks(q_base, db, kb, ql, lo, hi, bq=bq, bkv=bkv, causal=causal)
      if paged_fp8:
        qs_ref, bsc_ref = scale_refs
        # Block i's packed PageScales (3 n + 1 scalars); past the last block, the last block's (never used)
        block_scales = lambda i: tuple(bsc_ref[b, kv_head, jnp.minimum(i, bsc_ref.shape[2] - 1), j]
                                       for j in range(bsc_ref.shape[3]))
      elif fp8:
        qs_ref, ks_ref, vs_ref = scale_refs
      if fp8:
        c_q = c * qs_ref[b, head, lax.div(q_base, jnp.array(bq, q_base.dtype))]

      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, bq), head], q_smem, q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])

      m = plgpu.layout_cast(jnp.full((bq,), _M_FLOOR, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((bq, H), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      @pl.when(total > lo)
      def _():
        plgpu.barrier_wait(k_bar.at[0])

      pl.when(wg == 1)(sched_sync)

      def qk_scope(acc_ref, *, slot):
        # Q K^T of the block in ring slot `slot`, then the tensor cores' turn passes to the other warpgroup.
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        with jax.named_scope("turn"):
          sched_sync()
        return acc_ref[...]

      def step(i, carry, masked: bool):
        # The named scopes are the step's phases in Mosaic GPU's on-device profiler (FlashTuning.profile_dir,
        # tools/profile_prefill.py); without the profiler they emit nothing.
        acc, m, l = carry
        slot = ring(i)
        c_i = c_q * ks_ref[b, kv_head, i] if fp8 else c

        with jax.named_scope("qk"):
          s = pl.run_scoped(functools.partial(qk_scope, slot=slot),
                            plgpu.ACC((bq, bkv), jnp.int32 if int_qk else jnp.float32))
          if int_qk:
            s = s.astype(jnp.float32)
        plgpu.barrier_arrive(k_free.at[slot])
        with jax.named_scope("softmax"):
          m_new, alpha, p, l, acc = softmax(s, m, l, acc, c_i, i, masked)

        def release_tensor_cores(arrive: bool = True):
          with jax.named_scope("wait_v"):
            if arrive:
              plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(sched)

        if fp8:
          # The turn passes to the other warpgroup after the exponentials: P's cast and row sums overlap its softmax
          # instead of lengthening this warpgroup's turn. P stays in registers as the P V product's A operand.
          plgpu.barrier_arrive(sched)
          with jax.named_scope("p_cast"):
            p8 = p.astype(fp8_ops.E4M3)
            l = l + p.sum(axis=1)
            p_mma = _p_as_a_operand(p8)
          release_tensor_cores(arrive=False)
        elif H <= 128:
          # Row sums before the barrier keep the tensor cores' turn short (the layout JAX's FA3 example found).
          with jax.named_scope("softmax"):
            p_mma = p.astype(dtype)
            l = l + p.sum(axis=1)
          acc, l, m_new, p_mma = lax.optimization_barrier((acc, l, m_new, p_mma))
          release_tensor_cores()
        else:
          with jax.named_scope("softmax"):
            p_mma = p.astype(dtype)
          release_tensor_cores()
          with jax.named_scope("softmax"):
            l = l + p.sum(axis=1)

        v_op = v_smem.at[slot].transpose((1, 0)) if fp8 else v_smem.at[slot]

        def pv_scope(acc_ref):
          plgpu.wgmma(acc_ref, p_mma, v_op)
          nxt = i + 1

          @pl.when(nxt < total)
          def _():
            plgpu.barrier_wait(k_bar.at[ring(nxt)])

        with jax.named_scope("pv"):
          if fp8:
            # Each block's fp8 product starts from zero and is promoted into the float32 accumulator.
            def pv_fresh(acc_ref):
              pv_scope(acc_ref)
              return acc_ref[...]

            pv = pl.run_scoped(pv_fresh, plgpu.ACC((bq, H), jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
          else:
            acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      def step_paged(i, carry, masked: bool):
        # FP8 over pages read in place: the block's n key groups (one page each) have their own K scale and V
        # scale (lcjax.ops.fp8.PageScales): one QK^T over the block, whose scores are cut into the groups, then a
        # P and a P V product a group, the V scales folded into P's exponent and the accumulator kept in units of
        # the block's largest V scale (ref_v: the last block's). The block's scales come in the carry, loaded
        # during the step before.
        acc, m, l, ref_v, sc = carry
        sc_next = block_scales(i + 1)
        slot = ring(i)
        c_g = [c_q * sc[g] for g in range(n_groups)]
        v_max = sc[3 * n_groups]

        with jax.named_scope("qk"):
          s = pl.run_scoped(functools.partial(qk_scope, slot=slot), plgpu.ACC((bq, bkv), jnp.float32))
          ss = [s[:, g * gk:(g + 1) * gk] for g in range(n_groups)]
        plgpu.barrier_arrive(k_free.at[slot])
        with jax.named_scope("softmax"):
          if masked:
            ss = [visible(s, i * bkv + g * gk, gk) for g, s in enumerate(ss)]
          m_new = m
          for g, s in enumerate(ss):
            m_new = jnp.maximum(m_new, s.max(axis=1) * c_g[g])
          alpha = jnp.exp2(m - m_new)
          ps = [jnp.exp2(s * c_g[g] - lax.broadcast_in_dim(m_new - (p_shift + sc[n_groups + g]), s.shape, [0]))
                for g, s in enumerate(ss)]
        plgpu.barrier_arrive(sched)
        with jax.named_scope("p_cast"):
          p_mma = [_p_as_a_operand(p.astype(fp8_ops.E4M3)) for p in ps]
          l = l * alpha
          for g, p in enumerate(ps):
            l = l + p.sum(axis=1) * sc[2 * n_groups + g]
        with jax.named_scope("wait_v"):
          plgpu.barrier_wait(v_bar.at[slot])
          plgpu.barrier_wait(sched)

        def pv_fresh(acc_ref):
          for g in range(n_groups):
            plgpu.wgmma(acc_ref, p_mma[g], v_smem.at[slot, g].transpose((1, 0)))
          nxt = i + 1

          @pl.when(nxt < total)
          def _():
            plgpu.barrier_wait(k_bar.at[ring(nxt)])
          return acc_ref[...]

        with jax.named_scope("pv"):
          pv = pl.run_scoped(pv_fresh, plgpu.ACC((bq, H), jnp.float32))
          acc = acc * lax.broadcast_in_dim(alpha * (ref_v / v_max), acc.shape, [0]) + pv
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l, v_max, sc_next

      def visible(s, col0, cols: int):
        """s [bq, cols] (keys col0 ..) with the keys row r does not see at -inf."""
        rows = plgpu.broadcasted_iota(jnp.int32, (bq, cols), 0, layout=plgpu.Layout.WGMMA) + q_base
        cols = plgpu.broadcasted_iota(jnp.int32, (bq, cols), 1, layout=plgpu.Layout.WGMMA) + col0
        vis = cols < kb
        if causal:
          vis = vis & (cols <= rows + db)
        return jnp.where(vis, s, -jnp.inf)

      def softmax(s, m, l, acc, c_i, i, masked: bool):
        """A block's scores -> (the new row max, its correction alpha, P in float32, l rescaled, acc rescaled (bf16
        path; the fp8 path rescales when it adds the block's product))."""
        if masked:
          s = visible(s, i * bkv, bkv)
        m_new = jnp.maximum(m, s.max(axis=1) * c_i)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * c_i - lax.broadcast_in_dim(m_new - p_shift, s.shape, [0]))
        l = l * alpha
        if not fp8:
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return m_new, alpha, p, l, acc

      def drain(i, _):
        # Blocks this warpgroup does not need: release them and keep the schedule barrier in step.
        slot = ring(i)
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        sched_sync()
        sched_sync()

      if paged_fp8:
        carry = (acc, m, l, jnp.float32(1.0), block_scales(lo))
        carry = lax.fori_loop(lo, full, functools.partial(step_paged, masked=False), carry)
        acc, m, l, ref_v, _ = lax.fori_loop(full, total, functools.partial(step_paged, masked=True), carry)
      else:
        carry = lax.fori_loop(lo, full, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(full, total, functools.partial(step, masked=True), carry)
      lax.fori_loop(total, hi, drain, None)
      pl.when(wg == 0)(sched_sync)

      empty = l == 0                     # not l > 0 failing: a NaN or inf score's NaN stays in out and lse
      l_safe = jnp.where(empty, 1.0, l)
      norm = 1.0 / l_safe
      if paged_fp8:
        norm = norm * ref_v
      elif fp8:
        norm = norm * vs_ref[b, kv_head]
      acc = acc * lax.broadcast_in_dim(norm, (bq, H), [0])
      o_smem[...] = acc.astype(out_dtype)
      if lse_smem is not None:
        lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe) - p_shift) * _LN2)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, out_ref.at[cta, pl.ds(q_base, bq), head])
      if lse_smem is not None:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[cta, head, pl.ds(q_base, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(tuning.memory_regs, action="decrease")

      def issue(i, slot):
        keys = pl.ds(i * bkv, bkv)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv_head], k_smem.at[slot], k_bar.at[slot])
        v_src = v_ref.at[b, kv_head, pl.ds(0, H), keys] if fp8 else v_ref.at[b, keys, kv_head]
        plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot], v_bar.at[slot])

      def issue_paged(i, slot):
        # K of the block from its pages, a TMA copy a page into rows `at` .. of the slot, bf16 V alike; FP8: V^T
        # group g (one page's keys) from the transposed operand
        table_ref, off_ref = page_refs
        i = jnp.asarray(i, jnp.int32)                    # prime_ring passes Python ints
        into = lambda smem, rows, at: smem.at[slot] if rows == bkv else smem.at[slot, pl.ds(at, rows)]
        for m, first, rows, at in block_copies(i, bkv, k_ref.shape[1], M):
          page = table_ref[b, m] + off_ref[0]
          src = pl.ds(first, rows)
          plgpu.copy_gmem_to_smem(k_ref.at[page, src, kv_head], into(k_smem, rows, at), k_bar.at[slot])
          if not paged_fp8:
            plgpu.copy_gmem_to_smem(v_ref.at[page, src, kv_head], into(v_smem, rows, at), v_bar.at[slot])
        if paged_fp8:
          for g in range(n_groups):
            plgpu.copy_gmem_to_smem(v_ref.at[b, kv_head, pl.ds(0, H), pl.ds(i * bkv + g * gk, gk)],
                                    v_smem.at[slot, g], v_bar.at[slot])

      load = issue if page_refs is None else issue_paged
      fill_ring(lambda j, slot: load(lo + j, slot), hi - lo, mcs, k_free, v_free)

  n_scales = len(scales) if fp8 else 0
  n_pages = 0 if pages is None else 2
  n_in = n_scales + n_pages + (q_len is not None)

  def entry(q_ref, k_ref, v_ref, d_ref, kvl_ref, *refs):
    scale_refs, page_refs = refs[:n_scales], refs[n_scales:n_scales + n_pages] or None
    q_len_ref = refs[n_in - 1] if q_len is not None else None
    out_ref, *lse = refs[n_in:]
    lse_ref = lse[0] if lse else None
    v_tile = (mcs, n_groups, H, gk) if paged_fp8 else (mcs, H, bkv) if fp8 else (mcs, bkv, H)
    tiled = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=smem_transforms(dt, shape[-1]))
    smem = (tiled((_COMPUTE_WGS, bq, H), dtype),
            tiled((mcs, bkv, H), dtype),
            tiled(v_tile, v_dtype),
            plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32) if save_lse else None,
            tiled((_COMPUTE_WGS, bq, H), out_dtype) if fp8 else None)
    loaded = (plgpu.Barrier(num_arrivals=copies, num_barriers=mcs),
              plgpu.Barrier(num_arrivals=copies, num_barriers=mcs), plgpu.Barrier(num_barriers=_COMPUTE_WGS))
    freed = (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=mcs),) * 2
    run = lambda *scratch: body(q_ref, k_ref, v_ref, d_ref, kvl_ref, scale_refs, page_refs, q_len_ref, out_ref,
                                lse_ref, scratch)
    pl.run_scoped(run,
                  smem, loaded, freed, plgpu.Barrier(num_arrivals=_COMPUTE_WGS), collective_axes="wg")

  out_type = [jax.ShapeDtypeStruct((splits * B, T, N, H), out_dtype)]
  if save_lse:
    out_type.append(jax.ShapeDtypeStruct((splits * B, N, T), jnp.float32))
  res = plgpu.kernel(
      entry,
      out_type=tuple(out_type),
      grid=(N, n_tiles, splits * B),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, **_profile_params(tuning, S)),
  )(q, k, v, d, kvl, *(scales or ()), *(pages or ()), *(() if q_len is None else (q_len,)))
  if splits > 1:
    out, lse = merge_splits(res[0].reshape(splits, B, T, N, H), res[1].reshape(splits, B, N, T))
    return (out, lse) if keep_lse else (out, None)
  return tuple(res) if save_lse else (res[0], None)


def a_operand_sources(acc_regs: tuple[int, ...]) -> dict:
  """{WGMMA_8BIT register index: (the WGMMA register index of its low two bytes, that of its high two)} for P's
  register arrays (`acc_regs`: the WGMMA layout's register-array shape, (.., key group, .., row half, ..)): the
  8-bit register of 16-key group g is the accumulator-layout registers of 8-key groups 2g and 2g + 1, same row half."""
  if len(acc_regs) != 9 or acc_regs[2:] != (1, 1, 2, 1, 1, 1, 1) or acc_regs[1] % 2:
    raise NotImplementedError(f"unexpected WGMMA register array {acc_regs} for P")
  at = lambda r, g, h: (r, g, 0, 0, h, 0, 0, 0, 0)
  return {at(r, g, h): (at(r, 2 * g, h), at(r, 2 * g + 1, h))
          for r in range(acc_regs[0]) for g in range(acc_regs[1] // 2) for h in range(2)}


def _p_as_a_operand(p8):
  """P [block_q, block_kv] e4m3 in the float32 accumulator's register layout (WGMMA: a thread holds 2 keys of
  every 8-key group) -> the same bytes as a register A operand of an 8-bit wgmma (WGMMA_8BIT: 4 positions of every
  16-key group), the keys of each group in KEY_PERM order (a_operand_sources). No data moves between threads.
  Written against Mosaic GPU's register arrays (jax 0.11.2: FragmentedArray's private constructor, MLIR dialects)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(p8.shape, p8.dtype, layout=plgpu.Layout.WGMMA_8BIT))
  def relabel(_ctx, p):
    src = p.registers
    shape = fa.WGMMA_LAYOUT_8BIT.registers_shape(p8.shape)
    i8, i16, i32 = (ir.IntegerType.get_signless(w) for w in (8, 16, 32))
    elt = ir.VectorType(src.flat[0].type).element_type

    def widened(reg):                   # two e4m3 bytes -> the low half of an i32
      return arith.extui(i32, mgpu_utils.bitcast(mgpu_utils.bitcast(reg, ir.VectorType.get((2,), i8)), i16))

    dst = np.empty(shape, dtype=object)
    sources = a_operand_sources(src.shape)
    if set(sources) != set(np.ndindex(shape)):
      raise NotImplementedError(f"WGMMA registers {src.shape} do not pair up into WGMMA_8BIT registers {shape}")
    for idx, (lo, hi) in sources.items():   # little-endian: the low register's bytes come first
      word = arith.ori(widened(src[lo]), arith.shli(widened(src[hi]), arith.constant(i32, 16)))
      dst[idx] = mgpu_utils.bitcast(mgpu_utils.bitcast(word, ir.VectorType.get((4,), i8)), ir.VectorType.get((4,), elt))
    return mgpu.FragmentedArray(_registers=dst, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)

  return relabel(p8)


def v_operand(v8):
  """The FP8 kernel's V: v8 [B, S, K, H] (S % 16 == 0) -> [B, K, H, S] with the keys of every 16-key group in
  KEY_PERM order (each group read as [half 2, t 4, pair 2] and written as [t, half, pair]).

  v8's bytes (as uint8) are materialized behind an optimization barrier, transposed as a [S, K * H] matrix, and
  the keys reordered after: fused with the quantization into one XLA loop, the same bytes took 2.6x as long on an
  H100 (NOTES-attention has the layouts measured)."""
  B, S, K, H = v8.shape
  rows = lax.optimization_barrier(lax.bitcast_convert_type(v8, jnp.uint8).reshape(B, S, K * H))
  vt = jnp.swapaxes(rows, 1, 2).reshape(B, K, H, S // 16, 2, 4, 2)
  return lax.bitcast_convert_type(jnp.swapaxes(vt, -3, -2).reshape(B, K, H, S), v8.dtype)


def v_operand_paged(v_pages, page_table, S: int):
  """v_operand of the keys held in pages: v_pages [P, Z, K, H] float8_e4m3fn (Z % 16 == 0, H % 4 == 0) through
  page_table [B, M] (sequence b's key j is row j % Z of page page_table[b, j // Z]) -> [B, K, H, S] (S >= M * Z;
  keys past M * Z are zero bytes), bit for bit v_operand of the gathered keys padded to S.

  The bytes move as 32-bit words: the gather reads each (key, kv head)'s head dim as H / 4 words, four elementwise
  byte selections build each output word (4 keys of one head-dim row, in KEY_PERM order), and one transpose of
  32-bit elements puts the head dim before the keys."""
  P, Z, K, H = v_pages.shape
  B, M = page_table.shape
  words = lax.bitcast_convert_type(lax.bitcast_convert_type(v_pages, jnp.uint8).reshape(P, Z, K, H // 4, 4),
                                   jnp.uint32)
  x = words[page_table].reshape(B, M, Z // 16, 2, 4, 2, K, H // 4)     # key = 16 g + 8 half + 2 t + pair

  def row(hr):
    """[B, M, G, 4 (t), K, H / 4]: the word of head-dim row 4 hw + hr over keys (t, half, pair) of each group."""
    byte = lambda half, pair: (x[:, :, :, half, :, pair] >> jnp.uint32(8 * hr)) & jnp.uint32(0xFF)
    return (byte(0, 0) | (byte(0, 1) << jnp.uint32(8)) | (byte(1, 0) << jnp.uint32(16))
            | (byte(1, 1) << jnp.uint32(24)))

  out = jnp.stack([row(hr) for hr in range(4)], axis=-1)               # [B, M, G, t, K, H / 4, hr]
  out = jnp.transpose(out, (0, 4, 5, 6, 1, 2, 3)).reshape(B, K, H, M * Z // 4)
  out = lax.bitcast_convert_type(out, jnp.uint8).reshape(B, K, H, M * Z)
  return lax.bitcast_convert_type(jnp.pad(out, ((0, 0), (0, 0), (0, 0), (0, S - M * Z))), v_pages.dtype)


PROFILE_MAX_KEYS = 8192


def _profile_params(tuning: FlashTuning, S: int) -> dict:
  """CompilerParams fields for the on-device profiler, whose space counts ranges: room for every named range of
  every step of a warpgroup (6 per step on each path), plus the kernel's own."""
  if not tuning.profile_dir:
    return {}
  return dict(profile_space=8 * (S // tuning.block_kv) + 16, profile_dir=tuning.profile_dir)


def _rows(q_len, B):
  """q_len (a caller's real rows: None, a scalar or [B]) as the kernel takes it: None or [B] int32."""
  return None if q_len is None else jnp.broadcast_to(q_len, (B,)).astype(jnp.int32)


def _pad_to_tiles(q, tuning: FlashTuning):
  """q [B, T, N, H] with T padded by zero rows to a multiple of a CTA's 2 * block_q rows."""
  rows = _COMPUTE_WGS * tuning.block_q
  T = q.shape[1]
  Tp = -(-T // rows) * rows
  return q if Tp == T else jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))


def _real_rows(q, q_len):
  """q [B, T, N, H] with its rows at or past q_len[b] (padding the caller drops; q_len None: none) zeroed: Q's block
  scales are absmaxes over block_q rows, which padding must not set for the real rows of its block."""
  if q_len is None:
    return q
  rows = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :] < _rows(q_len, q.shape[0])[:, None]
  return jnp.where(rows[:, :, None, None], q, 0)


def _padded(q, k, v, d, kv_len, tuning: FlashTuning):
  """(q, k, v padded to the tile sizes, d [B], kv_len [B]) with the defaults d = S - T, kv_len = S."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if N % K:
    raise ValueError(f"query heads {N=} are not divisible by kv heads {K=}")
  d = jnp.full((B,), S - T, jnp.int32) if d is None else jnp.broadcast_to(d, (B,)).astype(jnp.int32)
  kvl = jnp.full((B,), S, jnp.int32) if kv_len is None else jnp.clip(jnp.broadcast_to(kv_len, (B,)), 0, S)
  q = _pad_to_tiles(q, tuning)
  Sp = -(-max(S, 1) // tuning.block_kv) * tuning.block_kv
  if Sp != S:
    k = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
  return q, k, v, d, kvl.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("causal", "tuning", "save_lse"))
def flash_attention(q, k, v, d=None, kv_len=None, *, causal: bool = True, tuning: FlashTuning = FlashTuning(),
                    save_lse: bool = True):
  """(out [B, T, N, H], lse [B, T, N] f32) with key j visible to row i iff j < kv_len and (j <= i + d if causal).

  d, kv_len: [B] int32 (d defaults to S - T, kv_len to S); requires d >= 0. Ragged T and S are padded to the
  tile sizes (a copy; prefill blocks of 8K+ tokens need none). save_lse=False returns lse None (benchmarks).
  """
  T, H = q.shape[1], q.shape[3]
  reason = why_not(head_dim=H, dtype=q.dtype)
  if reason:
    raise ValueError(reason)
  q, k, v, d, kvl = _padded(q, k, v, d, kv_len, tuning)
  out, lse = _flash_call(q, k, v, d, kvl, causal=causal, tuning=tuning, save_lse=save_lse)
  return out[:, :T], (None if lse is None else jnp.transpose(lse, (0, 2, 1))[:, :T])


def why_not_paged(*, head_dim: int, dtype, page_size: int, tuning: FlashTuning = FlashTuning()) -> str | None:
  """Why `flash_attention_paged` cannot read pages of this shape (None: it can)."""
  reason = why_not(head_dim=head_dim, dtype=dtype)
  if reason:
    return reason
  if page_size % tuning.block_kv and (tuning.block_kv % page_size or page_size % 8):
    return (f"the paged flash kernel loads blocks of {tuning.block_kv} keys: page_size={page_size} must be a multiple "
            f"of it, or divide it and be a multiple of 8")
  return None


@functools.partial(jax.jit, static_argnames=("tuning", "save_lse"))
def flash_attention_paged(q, k_pages, v_pages, page_table, d, kv_len, page_offset=0, q_len=None, *,
                          tuning: FlashTuning = FlashTuning(), save_lse: bool = True):
  """`flash_attention` (causal) over keys held in pages, read where they lie: key j of sequence b is row j % Z of
  pool page page_table[b, j // Z] + page_offset, visible to row i iff j < kv_len[b] and j <= i + d[b].

  q [B, T, N, H]; k_pages, v_pages [P, Z, K, H] in q's dtype; page_table [B, M] int32; d, kv_len [B] int32
  (d >= 0: rows before the first key are the caller's; kv_len is clipped to M * Z). A prefill chunk at position
  p0 whose own keys are already written to its pages passes d = p0, kv_len = p0 + T: one call covers the cached
  prefix and the chunk's causal part. q_len [B] int32 (None: T): rows at or past it are padding whose out and
  lse are unspecified (`_flash_call` skips whole warpgroup tiles of them). Returns (out [B, T, N, H], lse [B, T, N]
  float32)."""
  B, T, N, H = q.shape
  Z = k_pages.shape[1]
  M = page_table.shape[1]
  reason = why_not_paged(head_dim=H, dtype=q.dtype, page_size=Z, tuning=tuning)
  if reason:
    raise ValueError(reason)
  if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
    raise ValueError(f"pages {k_pages.dtype} / {v_pages.dtype} must be in the queries' dtype {q.dtype}")
  q = _pad_to_tiles(q, tuning)
  d = jnp.broadcast_to(d, (B,)).astype(jnp.int32)
  kvl = jnp.clip(jnp.broadcast_to(kv_len, (B,)), 0, M * Z).astype(jnp.int32)
  pages = (page_table.astype(jnp.int32), jnp.reshape(page_offset, (1,)).astype(jnp.int32))
  out, lse = _flash_call(q, k_pages, v_pages, d, kvl, causal=True, tuning=tuning, save_lse=save_lse, pages=pages,
                         q_len=_rows(q_len, B))
  return out[:, :T], (None if lse is None else jnp.transpose(lse, (0, 2, 1))[:, :T])


def flash_attention_paged_reference(q, k_pages, v_pages, page_table, d, kv_len, page_offset=0):
  """The oracle of `flash_attention_paged`: the contract's jnp paged reference."""
  B, T = q.shape[:2]
  q_pos = jnp.broadcast_to(d, (B,)).astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  M, Z = page_table.shape[1], k_pages.shape[1]
  kvl = jnp.clip(jnp.broadcast_to(kv_len, (B,)), 0, M * Z).astype(jnp.int32)
  return ref.paged_attention_reference(q, k_pages, v_pages, page_table + page_offset, q_pos=q_pos, kv_len=kvl)


# A 4-deep K/V ring for the FP8 kernel: 732 -> 754 TFLOP/s at 128K, measured when P still went through shared memory.
FP8_TUNING = FlashTuning(max_concurrent_steps=4)


def why_not_fp8(*, head_dim: int, tuning: FlashTuning) -> str | None:
  if head_dim not in (64, 128):
    return f"the FP8 flash kernel is built for head_dim 64 or 128, got {head_dim=}"
  if tuning.block_kv % 128:
    return f"the FP8 flash kernel needs block_kv a multiple of 128, got {tuning.block_kv}"
  return None


@functools.partial(jax.jit, static_argnames=("causal", "tuning", "incoherent", "smooth_k", "qk_dtype", "save_lse",
                                             "interpret"))
def flash_attention_fp8(q, k, v, d=None, kv_len=None, q_len=None, *, causal: bool = True,
                        tuning: FlashTuning = FP8_TUNING, incoherent: bool = True, smooth_k: bool = True,
                        qk_dtype: str = "float8_e4m3fn", save_lse: bool = True, interpret: bool = False):
  """FP8 flash attention with `flash_attention`'s contract: q, k, v (bf16 or float32) are quantized to e4m3 with
  block scales (lcjax.ops.fp8), optionally after smoothing K (`fp8.smooth_keys`) and the incoherence rotation of q
  and k; the output has q's dtype and the lse is float32. qk_dtype="int8" quantizes Q and K to int8 instead (an
  int32 Q K^T; V and P stay e4m3). q_len: as `flash_attention_paged` takes it (interpret=True's
  `fp8.attention_fp8_model` ignores it and computes every row).
  interpret=True computes `fp8.attention_fp8_model` (the kernel's arithmetic in jnp) instead of running the
  kernel."""
  T, H = q.shape[1], q.shape[3]
  reason = why_not_fp8(head_dim=H, tuning=tuning)
  if reason:
    raise ValueError(reason)
  out_dtype = q.dtype
  q, k, v, d, kvl = _padded(q, k, v, d, kv_len, tuning)
  q = _real_rows(q, q_len)
  # Keys from kv_len on are zeros before any scale is taken: K's block scales and V's per-head scale are absmaxes
  # over every key, and a key no row sees (a reused page's stale value, a chunk's own keys past its prefix) would
  # otherwise set the step of every visible one.
  valid = (jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] < kvl[:, None])[:, :, None, None]
  k, v = jnp.where(valid, k, 0), jnp.where(valid, v, 0)
  lse_shift = None
  if smooth_k:
    k, lse_shift = fp8_ops.smooth_keys(q, k, kvl)
    k = jnp.where(valid, k, 0)
  (q8, qs), (k8, ks), (v8, vs) = fp8_ops.quantize_operands(q, k, v, block_q=tuning.block_q,
                                                            block_kv=tuning.block_kv, incoherent=incoherent,
                                                            qk_dtype=qk_dtype)
  if interpret:
    out, lse = fp8_ops.attention_fp8_model(q8, qs, k8, ks, v8, vs, d, kvl, causal=causal, block_q=tuning.block_q,
                                           block_kv=tuning.block_kv)
    out = out.astype(out_dtype)
  else:
    out, lse = flash_fp8_kernel(q8, qs, k8, ks, v_operand(v8), vs, d, kvl, _rows(q_len, q.shape[0]), causal=causal,
                                tuning=tuning, save_lse=save_lse, out_dtype=out_dtype)
  if lse is not None and lse_shift is not None:
    lse = lse + lse_shift
  return out[:, :T], (None if lse is None else lse[:, :T])


@functools.partial(jax.jit, static_argnames=("causal", "tuning", "save_lse", "out_dtype"))
def flash_fp8_kernel(q8, qs, k8, ks, vt, vs, d, kv_len, q_len=None, *, causal: bool = True,
                     tuning: FlashTuning = FP8_TUNING, save_lse: bool = True, out_dtype=jnp.bfloat16):
  """The FP8 kernel on operands already quantized by `fp8.quantize_operands` (tile-aligned T and S; V as v_operand
  lays it out): (out [B, T, N, H] out_dtype, lse [B, T, N] float32)."""
  out, lse = _flash_call(q8, k8, vt, d, kv_len, causal=causal, tuning=tuning, save_lse=save_lse,
                         scales=(qs, ks, vs), out_dtype=out_dtype, q_len=q_len)
  return out, (None if lse is None else jnp.transpose(lse, (0, 2, 1)))


# Pages smaller than this are not read in place by the FP8 kernel: a block of 128 keys would be more than two groups.
FP8_PAGED_MIN_PAGE = 64


def why_not_fp8_paged(*, head_dim: int, page_size: int, tuning: FlashTuning = FP8_TUNING) -> str | None:
  """Why `flash_attention_fp8_paged` cannot read fp8 pages of this shape (None: it can)."""
  reason = why_not_fp8(head_dim=head_dim, tuning=tuning)
  if reason:
    return reason
  if page_size % tuning.block_kv and (tuning.block_kv % page_size or page_size < FP8_PAGED_MIN_PAGE):
    return (f"the FP8 kernel reads pages in place in blocks of {tuning.block_kv} keys: page_size={page_size} must be "
            f"a multiple of it, or divide it and be at least {FP8_PAGED_MIN_PAGE}")
  return None


def pack_page_scales(sc: fp8_ops.PageScales):
  """A PageScales as the kernel reads it: [B, K, NB, 3 n + 1] float32, (k, v_log2, v_inv) of each group, v_max."""
  return jnp.concatenate([sc.k, sc.v_log2, sc.v_inv, sc.v_max[..., None]], axis=-1).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("tuning", "save_lse", "interpret"))
def flash_attention_fp8_paged(q, k_pages, v_pages, k_scale, v_scale, page_table, kv_len, page_offset=0, q_len=None,
                              *, tuning: FlashTuning = FP8_TUNING, save_lse: bool = True, interpret: bool = False):
  """Every row of q over the first kv_len[b] keys held in fp8 pages, all of them visible to all rows (a prefill
  chunk against its cached prefix): the FP8 kernel with K read where it lies, page by page, and no key
  dequantized or requantized. Key j of sequence b is row j % Z of pool page page_table[b, j // Z] + page_offset.

  q [B, T, N, H] (bf16 / float32) in the basis the pages hold the keys in (lcjax.cache.kv rotates both); k_pages,
  v_pages [P, Z, K, H] float8_e4m3fn with k_scale, v_scale [P, K] float32 (x = stored * scale); page_table [B, M]
  int32; kv_len [B] (clipped to M * Z). The queries are quantized per block_q rows (fp8.quantize_rows); each key
  group of a block (one page) keeps its page's scales (fp8.page_scales). V is the one operand copied: its pages'
  bytes are gathered into the transposed layout fp8 P @ V reads (v_operand_paged), without a change of value. q_len:
  as `flash_attention_paged` takes it. interpret=True computes `fp8.attention_fp8_model` on the gathered bytes
  instead of running the kernel. Returns (out [B, T, N, H] in q's dtype, lse [B, T, N] float32)."""
  B, T, N, H = q.shape
  Z, K = k_pages.shape[1], k_pages.shape[2]
  M = page_table.shape[1]
  reason = why_not_fp8_paged(head_dim=H, page_size=Z, tuning=tuning)
  if reason:
    raise ValueError(reason)
  if k_pages.dtype != fp8_ops.E4M3 or v_pages.dtype != fp8_ops.E4M3:
    raise ValueError(f"pages {k_pages.dtype} / {v_pages.dtype} must be float8_e4m3fn")
  q = _real_rows(_pad_to_tiles(q, tuning), q_len)
  table = page_table.astype(jnp.int32)
  offset = jnp.reshape(page_offset, (1,)).astype(jnp.int32)
  kvl = jnp.clip(jnp.broadcast_to(kv_len, (B,)), 0, M * Z).astype(jnp.int32)
  q8, qs = fp8_ops.quantize_rows(q, tuning.block_q)
  sc = fp8_ops.page_scales(k_scale, v_scale, table + offset, kvl, page_size=Z, block_kv=tuning.block_kv)
  S = sc.v_max.shape[2] * tuning.block_kv
  keys = lambda pages: jnp.pad(fp8_ops.take(pages, table + offset).reshape(B, M * Z, K, H),
                               ((0, 0), (0, S - M * Z), (0, 0), (0, 0)))
  d = jnp.zeros((B,), jnp.int32)
  if interpret:
    out, lse = fp8_ops.attention_fp8_model(q8, qs, keys(k_pages), sc, keys(v_pages), None, d, kvl, causal=False,
                                           block_q=tuning.block_q, block_kv=tuning.block_kv)
    return out[:, :T].astype(q.dtype), lse[:, :T]
  v_t = v_operand_paged(v_pages, table + offset, S)
  out, lse = _flash_call(q8, k_pages, v_t, d, kvl, causal=False, tuning=tuning, save_lse=save_lse,
                         scales=(qs, pack_page_scales(sc)), out_dtype=q.dtype, pages=(table, offset),
                         q_len=_rows(q_len, B))
  return out[:, :T], (None if lse is None else jnp.transpose(lse, (0, 2, 1))[:, :T])


def flash_attention_reference(q, k, v, d=None, kv_len=None, *, causal: bool = True):
  """The oracle of `flash_attention`: the contract's jnp reference with the same (d, kv_len) parametrisation."""
  B, T = q.shape[:2]
  S = k.shape[1]
  d = jnp.full((B,), S - T, jnp.int32) if d is None else jnp.broadcast_to(d, (B,)).astype(jnp.int32)
  q_pos = d[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  return ref.attention_reference(q, k, v, q_pos=q_pos, kv_len=kv_len, causal=causal)
