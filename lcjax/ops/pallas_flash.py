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
from jax import lax

from lcjax.ops import attention as ref

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_FLOOR = -1e30
_COMPUTE_WGS = 2


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

  def __post_init__(self):
    if self.block_q % 64 or self.block_kv % 64:
      raise ValueError(f"block_q={self.block_q} and block_kv={self.block_kv} must be multiples of 64")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2")


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


def _flash_call(q, k, v, d, kvl, *, causal: bool, tuning: FlashTuning, save_lse: bool = True):
  """q [B, T, N, H] (T % (2 * block_q) == 0), k/v [B, S, K, H] (S % block_kv == 0), d/kvl [B] int32.

  save_lse=False drops the LSE output (only to measure what returning it costs).
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  dtype = q.dtype
  bq, bkv = tuning.block_q, tuning.block_kv
  mcs = min(tuning.max_concurrent_steps, S // bkv)
  n_tiles = T // (_COMPUTE_WGS * bq)
  c = _LOG2E / math.sqrt(H)

  def body(q_ref, k_ref, v_ref, d_ref, kvl_ref, out_ref, lse_ref, scratch):
    (qo_smem2, k_smem, v_smem, lse_smem2), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scratch
    b = lax.axis_index("batch")
    head = lax.axis_index("heads")
    tile = lax.axis_index("q_seq")
    if tuning.reverse_q:
      tile = n_tiles - 1 - tile
    wg = lax.axis_index("wg")
    db = d_ref[b]
    kb = kvl_ref[b]
    tile_base = tile * (_COMPUTE_WGS * bq)
    # The memory warpgroup feeds the union of both compute warpgroups' blocks; the later rows need the most.
    _, max_steps = _steps(tile_base + (_COMPUTE_WGS - 1) * bq, bq, bkv, db, kb, causal)

    def sched_sync():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(tuning.compute_regs, action="increase")
      qo_smem = qo_smem2.at[wg]
      lse_smem = None if lse_smem2 is None else lse_smem2.at[wg]
      q_base = tile_base + wg * bq
      full, total = _steps(q_base, bq, bkv, db, kb, causal)

      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, bq), head], qo_smem, q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])

      m = plgpu.layout_cast(jnp.full((bq,), _M_FLOOR, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((bq, H), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      @pl.when(total > 0)
      def _():
        plgpu.barrier_wait(k_bar.at[0])

      pl.when(wg == 1)(sched_sync)

      def step(i, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(i, jnp.array(mcs, i.dtype))

        def qk_scope(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
          sched_sync()
          return acc_ref[...]

        s = pl.run_scoped(qk_scope, plgpu.ACC((bq, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
          rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA) + q_base
          cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA) + i * bkv
          vis = cols < kb
          if causal:
            vis = vis & (cols <= rows + db)
          s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1) * c)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l = l * alpha
        p16 = p.astype(dtype)

        def release_tensor_cores():
          plgpu.barrier_arrive(sched)
          plgpu.barrier_wait(v_bar.at[slot])
          plgpu.barrier_wait(sched)

        if H <= 128:
          # Row sums before the barrier keep the tensor cores' turn short (the layout JAX's FA3 example found).
          l = l + p.sum(axis=1)
          acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
          release_tensor_cores()
        else:
          release_tensor_cores()
          l = l + p.sum(axis=1)

        def pv_scope(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
          nxt = i + 1

          @pl.when(nxt < total)
          def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(nxt, jnp.array(mcs, nxt.dtype))])

        acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      def drain(i, _):
        # Blocks this warpgroup does not need: release them and keep the schedule barrier in step.
        slot = lax.rem(i, jnp.array(mcs, i.dtype))
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        sched_sync()
        sched_sync()

      carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (acc, m, l))
      acc, m, l = lax.fori_loop(full, total, functools.partial(step, masked=True), carry)
      lax.fori_loop(total, max_steps, drain, None)
      pl.when(wg == 0)(sched_sync)

      seen = l > 0
      l_safe = jnp.where(seen, l, 1.0)
      acc = acc / lax.broadcast_in_dim(l_safe, (bq, H), [0])
      qo_smem[...] = acc.astype(dtype)
      if lse_smem is not None:
        lse_smem[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * _LN2, -jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q_base, bq), head])
      if lse_smem is not None:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, head, pl.ds(q_base, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(tuning.memory_regs, action="decrease")
      kv_head = lax.div(head, jnp.array(G, head.dtype))

      def issue(i, slot):
        src = (b, pl.ds(i * bkv, bkv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

      for i in range(mcs):
        pl.when(i < max_steps)(functools.partial(issue, i, i))

      @pl.loop(mcs, jnp.maximum(max_steps, mcs))
      def _(i):
        slot = lax.rem(i, jnp.array(mcs, i.dtype))
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        issue(i, slot)

  def entry(q_ref, k_ref, v_ref, d_ref, kvl_ref, out_ref, lse_ref=None):
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (plgpu.SMEM((_COMPUTE_WGS, bq, H), dtype, transforms=tiled),
            plgpu.SMEM((mcs, bkv, H), dtype, transforms=tiled),
            plgpu.SMEM((mcs, bkv, H), dtype, transforms=tiled),
            plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32) if save_lse else None)
    loaded = (plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=mcs),
              plgpu.Barrier(num_barriers=_COMPUTE_WGS))
    freed = (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=mcs),) * 2
    pl.run_scoped(lambda *scratch: body(q_ref, k_ref, v_ref, d_ref, kvl_ref, out_ref, lse_ref, scratch),
                  smem, loaded, freed, plgpu.Barrier(num_arrivals=_COMPUTE_WGS), collective_axes="wg")

  out_type = [jax.ShapeDtypeStruct((B, T, N, H), dtype)]
  if save_lse:
    out_type.append(jax.ShapeDtypeStruct((B, N, T), jnp.float32))
  res = plgpu.kernel(
      entry,
      out_type=tuple(out_type),
      grid=(N, n_tiles, B),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(q, k, v, d, kvl)
  return tuple(res) if save_lse else (res[0], None)


@functools.partial(jax.jit, static_argnames=("causal", "tuning", "save_lse"))
def flash_attention(q, k, v, d=None, kv_len=None, *, causal: bool = True, tuning: FlashTuning = FlashTuning(),
                    save_lse: bool = True):
  """(out [B, T, N, H], lse [B, T, N] f32) with key j visible to row i iff j < kv_len and (j <= i + d if causal).

  d, kv_len: [B] int32 (d defaults to S - T, kv_len to S); requires d >= 0. Ragged T and S are padded to the
  tile sizes (a copy; prefill blocks of 8K+ tokens need none). save_lse=False returns lse None (benchmarks).
  """
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if N % K:
    raise ValueError(f"query heads {N=} are not divisible by kv heads {K=}")
  reason = why_not(head_dim=H, dtype=q.dtype)
  if reason:
    raise ValueError(reason)
  d = jnp.full((B,), S - T, jnp.int32) if d is None else jnp.broadcast_to(d, (B,)).astype(jnp.int32)
  kvl = jnp.full((B,), S, jnp.int32) if kv_len is None else jnp.clip(jnp.broadcast_to(kv_len, (B,)), 0, S)
  kvl = kvl.astype(jnp.int32)
  rows = _COMPUTE_WGS * tuning.block_q
  Tp = -(-T // rows) * rows
  Sp = -(-max(S, 1) // tuning.block_kv) * tuning.block_kv
  if Tp != T:
    q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
  if Sp != S:
    k = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
  out, lse = _flash_call(q, k, v, d, kvl, causal=causal, tuning=tuning, save_lse=save_lse)
  return out[:, :T], (None if lse is None else jnp.transpose(lse, (0, 2, 1))[:, :T])


def flash_attention_reference(q, k, v, d=None, kv_len=None, *, causal: bool = True):
  """The oracle of `flash_attention`: the contract's jnp reference with the same (d, kv_len) parametrisation."""
  B, T = q.shape[:2]
  S = k.shape[1]
  d = jnp.full((B,), S - T, jnp.int32) if d is None else jnp.broadcast_to(d, (B,)).astype(jnp.int32)
  q_pos = d[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  return ref.attention_reference(q, k, v, q_pos=q_pos, kv_len=kv_len, causal=causal)


def _on_hopper() -> str | None:
  if jax.default_backend() != "gpu":
    return f"needs a CUDA GPU; jax.default_backend()={jax.default_backend()!r}"
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None or tuple(int(x) for x in str(cc).split(".")[:2]) < (9, 0):
    return f"the Mosaic GPU kernels need Hopper (sm_90+), got compute_capability={cc}"
  return None


@dataclasses.dataclass(frozen=True)
class PallasBackend:
  """Our kernels: Mosaic GPU flash attention for `attend`, the split-K Pallas decode kernel for `paged`.

  `interpret=True` (CPU tests) runs the decode kernel in the Pallas interpreter; the Mosaic GPU flash kernel has
  no working interpreter for its wgmma pipeline, so `attend` needs the GPU.

  `attend` with positions sends blocks whose rows are not contiguous or start before the first key to the jnp
  reference (a lax.cond on the positions), which on a GPU logs why when it runs.
  """
  name: str = "pallas"
  flash: FlashTuning = FlashTuning()
  decode: object = None                          # a pallas_paged.PagedTuning; None: its defaults
  interpret: bool = False

  def _decode_tuning(self):
    from lcjax.ops import pallas_paged
    return self.decode or pallas_paged.PagedTuning()

  def why_not(self, *, head_dim: int, dtype) -> str | None:
    reason = why_not(head_dim=head_dim, dtype=dtype)
    if reason or self.interpret:
      return reason
    return _on_hopper()

  def attend(self, q, k, v, *, q_pos=None, k_start=None, kv_len=None, causal=True):
    B, T, N, H = q.shape
    S = k.shape[1]
    kvl = None if kv_len is None else jnp.clip(jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32), 0, S)
    kernel = functools.partial(flash_attention, q, k, v, kv_len=kvl, tuning=self.flash)
    if not causal:
      return kernel(causal=False)
    if q_pos is None and k_start is None:
      if S < T:
        # Rows before the first key would need a lower mask bound the kernel does not have.
        ref.routed_to_reference("pallas", f"a causal block of {T} queries over {S} keys (rows before the first key)")
        return ref.attention_reference(q, k, v, kv_len=kvl, causal=True)
      return kernel(causal=True)
    q_pos, k_start = ref.block_positions(q_pos, k_start, B, T, S)
    d = q_pos[:, 0] - k_start
    contiguous = ref.contiguous_rows(q_pos)

    def reference():
      # The kernel masks by one diagonal offset per sequence; other position patterns take the exact jnp path.
      ref.reference_branch_ran("pallas", {ref.NONCONTIGUOUS_ROWS: ~contiguous, ref.ROWS_BEFORE_FIRST_KEY: d < 0})
      return ref.attention_reference(q, k, v, q_pos=q_pos, k_start=k_start, kv_len=kvl, causal=True)

    return lax.cond(contiguous & jnp.all(d >= 0), lambda: kernel(d, causal=True), reference)

  def paged(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None, page_offset=0):
    from lcjax.ops import pallas_paged
    B, T, N, H = q.shape
    K = k_pages.shape[2]
    tuning = self._decode_tuning()
    if T * (N // K) <= tuning.max_rows:
      return pallas_paged.paged_decode(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len,
                                       k_scale=k_scale, v_scale=v_scale, page_offset=page_offset, tuning=tuning,
                                       interpret=self.interpret)
    # Chunked prefill against the cache is tensor-core work, not a decode: cuDNN's paged flash kernel does it
    # (over fp8 pages dequantized to the query dtype, which it reads and fp8 it cannot).
    from lcjax.ops.cudnn import CudnnBackend
    return CudnnBackend(emulate=self.interpret).paged(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len,
                                                      k_scale=k_scale, v_scale=v_scale, page_offset=page_offset)
