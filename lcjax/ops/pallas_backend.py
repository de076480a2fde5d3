"""The pallas backends: which of lcjax's own kernels serves each attention call.

PallasBackend sends `attend` to the Mosaic GPU flash kernel (lcjax.ops.mosaic_gpu.flash); decode rows over bf16 or
fp8 pages to the Mosaic GPU split-K decode kernels (lcjax.ops.mosaic_gpu.paged, with their Mosaic GPU split combine)
where they can serve them, else to the split-K Triton kernel (lcjax.ops.triton.paged), or by its decode_route to one
of the two; prefill chunks against the paged cache by its prefill_route to the Mosaic GPU flash kernel reading the
pages in place (mgpu_flash.flash_attention_paged) or to cuDNN (lcjax.ops.cudnn.backend). PallasFp8Backend runs the
FP8 flash kernel for `attend` and for prefill chunks over their cached prefix (over fp8 pages read in place where it
can, `prefix_reason`). Each `why_not` / `mosaic_decode_reason` / `prefill_reason` names why a kernel cannot serve a
shape here; lcjax.ops.backends picks a backend by name.

Legend: B batch, T queries, S keys, N query heads, K kv heads, H head dim, P pages, Z page size, M table slots.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from lcjax.ops import attention as ref
from lcjax.ops import fp8 as fp8_ops
from lcjax.ops import hardware
from lcjax.ops.mosaic_gpu import flash as mgpu_flash
from lcjax.ops.mosaic_gpu import paged as mgpu_paged
from lcjax.ops.triton import paged as triton_paged
from lcjax.ops.cudnn.backend import PAGED_PAST, CudnnBackend, paged_case, past_each

# The Mosaic GPU decode kernels with the Mosaic GPU split combine (decode_route "mosaic", and "auto" on Hopper);
# bf16 pages through a 2-slot K/V ring (the fastest of 2, 3 and 4 slots at 32K batch 8 on an H100, within 1% of 3
# slots at 128K: benchmarks/NOTES-attention).
MOSAIC_FP8_DECODE = mgpu_paged.DecodeTuning(combine="mosaic")
MOSAIC_BF16_DECODE = mgpu_paged.DecodeTuning(max_concurrent_steps=2, combine="mosaic")

# Keys of a cached prefix an FP8 chunk reads in one kernel call: gathered at once (K and V in the query dtype), or
# their V bytes transposed where the pages are read in place (lcjax.engine.plan counts this transient).
PREFIX_BLOCK_TOKENS = 131072
PREFIX_ROUTES = ("auto", "in-place", "gather")


def prefix_reason(*, qk_dtype: str, head_dim: int, page_size: int, page_dtype,
                  tuning: mgpu_flash.FlashTuning = mgpu_flash.FP8_TUNING) -> str | None:
  """Why the FP8 kernel multiplying `qk_dtype` queries and keys cannot read a prefill chunk's cached prefix in place
  from pages of this shape (None: it can)."""
  if jnp.dtype(page_dtype) != fp8_ops.E4M3:
    return f"the pages hold {jnp.dtype(page_dtype).name}; the FP8 kernel reads float8_e4m3fn pages in place"
  if qk_dtype != "float8_e4m3fn":
    return f"qk_dtype={qk_dtype!r} multiplies int8 keys, and the pages hold e4m3 keys"
  return mgpu_flash.why_not_fp8_paged(head_dim=head_dim, page_size=page_size, tuning=tuning)


@dataclasses.dataclass(frozen=True)
class PallasBackend:
  """Our kernels: Mosaic GPU flash attention for `attend`; for `paged` decode rows, the Mosaic GPU split-K decode
  kernels (lcjax.ops.mosaic_gpu.paged) and their Mosaic GPU split combine over bf16 or fp8 pages on Hopper, the
  split-K Pallas decode kernel (Triton lowering) where they cannot serve (logged). `decode_route`
  "mosaic" or "triton" sends every decode row to one of them (RunConfig.decode_kernel); "auto" chooses as above.
  `prefill_route` picks what reads a prefill chunk's cached prefix: "mosaic" (the flash kernel reading the pages
  in place) or "cudnn" (RunConfig.prefill_kernel; lcjax.engine.serving resolves "auto").

  `interpret=True` (CPU tests) runs the decode kernel in the Pallas interpreter; the Mosaic GPU flash kernel has
  no working interpreter for its wgmma pipeline, so `attend` needs the GPU.

  `attend` with positions sends blocks whose rows are not contiguous or start before the first key to the jnp
  reference (a lax.cond on the positions), which on a GPU logs why when it runs.
  """
  name: str = "pallas"
  flash: mgpu_flash.FlashTuning = mgpu_flash.FlashTuning()
  decode: object = None                          # a triton_paged.PagedTuning; None: its defaults
  interpret: bool = False
  decode_route: str = "auto"                     # RunConfig.decode_kernel: "auto", "mosaic" or "triton"
  prefill_route: str = "cudnn"                   # RunConfig.prefill_kernel: "cudnn" or "mosaic"

  def _decode_tuning(self):
    return self.decode or triton_paged.PagedTuning()

  @property
  def max_decode_rows(self) -> int:
    """Query rows per kv head up to which `paged` runs a decode kernel (more: a prefill chunk's path)."""
    return self._decode_tuning().max_rows

  def why_not(self, *, head_dim: int, dtype) -> str | None:
    reason = mgpu_flash.why_not(head_dim=head_dim, dtype=dtype)
    if reason or self.interpret:
      return reason
    return hardware.on_sm90()

  def _kernel(self, q, k, v, kvl, q_len=None):
    """kernel(d=None, *, causal): the flash kernel on these operands (the bf16 kernel computes padding rows past
    q_len like any other: no row of it depends on another)."""
    return functools.partial(mgpu_flash.flash_attention, q, k, v, kv_len=kvl, tuning=self.flash)

  def attend(self, q, k, v, *, q_pos=None, k_start=None, kv_len=None, q_len=None, causal=True):
    B, T, N, H = q.shape
    S = k.shape[1]
    kvl = None if kv_len is None else jnp.clip(jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32), 0, S)
    kernel = self._kernel(q, k, v, kvl, q_len)
    if not causal:
      return kernel(causal=False)
    if q_pos is None and k_start is None:
      if S < T:
        # Rows before the first key would need a lower mask bound the kernel does not have.
        ref.routed_to_reference(self.name, f"a causal block of {T} queries over {S} keys (rows before the first key)")
        return ref.attention_reference(q, k, v, kv_len=kvl, causal=True)
      return kernel(causal=True)
    q_pos, k_start = ref.block_positions(q_pos, k_start, B, T, S)
    d = q_pos[:, 0] - k_start
    contiguous = ref.contiguous_rows(q_pos)

    def reference():
      # The kernel masks by one diagonal offset per sequence; other position patterns take the exact jnp path.
      ref.reference_branch_ran(self.name, {ref.NONCONTIGUOUS_ROWS: ~contiguous, ref.ROWS_BEFORE_FIRST_KEY: d < 0})
      return ref.attention_reference(q, k, v, q_pos=q_pos, k_start=k_start, kv_len=kvl, causal=True)

    return lax.cond(contiguous & jnp.all(d >= 0), lambda: kernel(d, causal=True), reference)

  def mosaic_decode_reason(self, *, head_dim: int, page_size: int, rows: int, page_dtype,
                           dtype=None) -> str | None:
    """Why decode rows of `rows` query rows per kv head over pages of `page_dtype` (queries in `dtype`; None: not
    checked) cannot take the Mosaic GPU decode kernels (lcjax.ops.mosaic_gpu.paged: bf16 or fp8 pages, bf16
    queries over bf16 pages); None: they can."""
    if self.interpret:
      return "the Mosaic GPU kernel has no interpreter (interpret=True)"
    reason = mgpu_paged.why_not(head_dim=head_dim, page_size=page_size, rows=rows, page_dtype=page_dtype)
    if not reason and dtype is not None and jnp.dtype(page_dtype) == jnp.bfloat16 and jnp.dtype(dtype) != jnp.bfloat16:
      reason = f"the Mosaic GPU decode over bfloat16 pages takes bfloat16 queries, not {jnp.dtype(dtype).name}"
    return reason or hardware.on_sm90()

  def route_reason(self, route: str, *, head_dim: int, page_size: int, rows: int, page_dtype, dtype) -> str | None:
    """Why decode_route `route` cannot read decode rows of this shape (None: it can)."""
    if route == "mosaic":
      return self.mosaic_decode_reason(head_dim=head_dim, page_size=page_size, rows=rows, page_dtype=page_dtype,
                                       dtype=dtype)
    if route == "triton":
      return triton_paged.unsupported_shape(page_size, head_dim) or hardware.pallas_triton_reason()
    return None

  def prefill_reason(self, *, head_dim: int, page_size: int, page_dtype, dtype) -> str | None:
    """Why prefill_route "mosaic" (the flash kernel reading bf16 / float16 pages in place) cannot read a chunk's
    keys from pages of this shape here (None: it can)."""
    if jnp.dtype(page_dtype) != jnp.dtype(dtype):
      return (f"the paged flash kernel reads pages in the queries' dtype ({jnp.dtype(dtype).name}), not "
              f"{jnp.dtype(page_dtype).name}")
    if self.interpret:
      return "the Mosaic GPU flash kernel has no interpreter (interpret=True)"
    return (mgpu_flash.why_not_paged(head_dim=head_dim, dtype=dtype, page_size=page_size, tuning=self.flash)
            or hardware.on_sm90())

  def decode_kernel(self, *, head_dim: int, page_size: int, rows: int, page_dtype, dtype=None) -> str:
    """The kernel `paged` runs for decode rows over pages of `page_dtype` (queries in `dtype`; None: bfloat16).
    decode_route "auto" takes the Mosaic GPU decode kernels (lcjax.ops.mosaic_gpu.paged) with the Mosaic GPU split
    combine ('mosaic') where they can serve (`mosaic_decode_reason`), over bf16 and fp8 pages alike, so no Hopper
    default lowers through Pallas Triton; else 'triton' (lcjax.ops.triton.paged: GPUs that are not Hopper, page
    shapes the Mosaic GPU kernels do not read). Another route is its own name. With interpret=True the Triton kernel
    runs in the Pallas interpreter: 'triton-interpret'."""
    if self.decode_route != "auto":
      name = self.decode_route
    elif self.mosaic_decode_reason(head_dim=head_dim, page_size=page_size, rows=rows, page_dtype=page_dtype,
                                   dtype=dtype):
      name = "triton"
    else:
      name = "mosaic"
    return "triton-interpret" if name == "triton" and self.interpret else name

  def paged(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None, page_offset=0,
            q_len=None, past=False):
    B, T, N, H = q.shape
    Z, K = k_pages.shape[1:3]
    tuning = self._decode_tuning()
    rows = T * (N // K)
    fp8_pages = k_pages.dtype == fp8_ops.E4M3
    if fp8_pages and (k_scale is None or v_scale is None):
      raise ValueError("attention over float8_e4m3fn pages needs their k_scale and v_scale")
    if rows <= tuning.max_rows:
      shape = dict(head_dim=H, page_size=Z, rows=rows, page_dtype=k_pages.dtype)
      kernel = self.decode_kernel(**shape, dtype=q.dtype)
      if kernel == "mosaic":
        reason = self.mosaic_decode_reason(**shape, dtype=q.dtype)
        if reason:
          raise ValueError(f"decode_kernel='mosaic' cannot read these decode rows: {reason}")
        if fp8_pages:
          return mgpu_paged.paged_decode_fp8(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len,
                                             k_scale=k_scale, v_scale=v_scale, page_offset=page_offset,
                                             tuning=MOSAIC_FP8_DECODE)
        return mgpu_paged.paged_decode_bf16(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len,
                                            page_offset=page_offset, tuning=MOSAIC_BF16_DECODE)
      if self.decode_route == "auto" and not self.interpret:
        slower = " (it widens K and V to float16: about half the fp8 kernel's speed)" if fp8_pages else ""
        ref.warn_once(f"attention backend {self.name}: decode runs the Triton paged kernel{slower}: "
                      f"{self.mosaic_decode_reason(**shape, dtype=q.dtype)}")
      return triton_paged.paged_decode(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len,
                                       k_scale=k_scale, v_scale=v_scale, page_offset=page_offset, tuning=tuning,
                                       interpret=self.interpret)
    if self.prefill_route == "mosaic":
      reason = self.prefill_reason(head_dim=H, page_size=Z, page_dtype=k_pages.dtype, dtype=q.dtype)
      if reason:
        raise ValueError(f"prefill_kernel='mosaic' cannot read these pages: {reason}")
      return self._paged_flash(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len, page_offset=page_offset,
                               q_len=q_len, past=past)
    # Chunked prefill against the cache is tensor-core work, not a decode: cuDNN's paged flash kernel does it
    # (over fp8 pages dequantized to the query dtype, which it reads and fp8 it cannot).
    return CudnnBackend(emulate=self.interpret).paged(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len,
                                                      k_scale=k_scale, v_scale=v_scale, page_offset=page_offset,
                                                      past=past)

  def _paged_flash(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, page_offset, q_len=None, past=False):
    """A chunk's rows over keys in the pages through the flash kernel that reads them in place, masked by the
    diagonal offset d = q_pos[b, 0], sequence by sequence: rows in any order that every valid key precedes (the
    engine's chunk against its cached prefix, a seq mesh's zigzag rows too: kv_len <= min(q_pos) + 1 <= d + 1)
    see every key below kv_len; contiguous rows from position 0 on see j <= q_pos. A batch with a sequence of
    neither kind takes the jnp reference, which logs why; past=True (the caller's promise of the first kind) runs
    the kernel without that check. Rows at or past q_len (padding) are left out where the kernel can skip them."""
    B, T = q.shape[:2]
    M, Z = page_table.shape[1], k_pages.shape[1]
    q_pos = jnp.broadcast_to(q_pos, (B, T)).astype(jnp.int32)
    kvl = jnp.clip(jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32), 0, M * Z)
    d = q_pos[:, 0]

    def kernel():
      return mgpu_flash.flash_attention_paged(q, k_pages, v_pages, page_table, d, kvl, page_offset, q_len,
                                              tuning=self.flash)

    if past:
      return kernel()
    rows_past = past_each(q_pos, kvl)
    contiguous = ref.contiguous_each(q_pos) & (d >= 0)

    def reference():
      other = ~(rows_past | contiguous)                         # the sequences the kernel could not mask
      ref.reference_branch_ran(self.name, {ref.NONCONTIGUOUS_ROWS: other & (d >= 0),
                                           ref.NEGATIVE_POSITIONS: other & (d < 0)})
      return ref.paged_attention_reference(q, k_pages, v_pages, page_table + page_offset, q_pos=q_pos, kv_len=kvl)

    return lax.cond(~jnp.all(rows_past | contiguous), reference, kernel)


@dataclasses.dataclass(frozen=True)
class PallasFp8Backend(PallasBackend):
  """FP8 attention: `attend` runs the FP8 flash kernel (e4m3 or int8 Q and K, e4m3 V and P; float32 softmax,
  accumulators and lse; lcjax.ops.fp8) on operands it quantizes per call; `paged` runs it too for prefill chunks
  over their cached prefix, and PallasBackend's decode kernels for decode rows. `smooth_k` subtracts the keys'
  mean before quantization (lcjax.ops.fp8.smooth_keys), `incoherent` rotates Q and K, `qk_dtype` picks e4m3 or
  int8 for Q and K.

  A chunk's cached prefix over fp8 pages is read in place (mgpu_flash.flash_attention_fp8_paged: the pages' e4m3
  keys as stored, in the basis lcjax.cache.kv rotates them into, with their page scales; neither smoothed nor
  rotated again) where `prefix_reason` allows; else its pages are gathered, dequantized to the query dtype and
  quantized again as fresh operands (logged once). `prefix_route` "in-place" or "gather" asks for one of the two
  (benchmarks time both); "auto" chooses as above.
  interpret=True runs the kernel's jnp model instead of the kernel (CPUs)."""
  name: str = "pallas-fp8"
  flash: mgpu_flash.FlashTuning = mgpu_flash.FP8_TUNING
  incoherent: bool = True
  smooth_k: bool = True
  qk_dtype: str = "float8_e4m3fn"                # or "int8": an int32 Q K^T
  prefix_route: str = "auto"                     # "auto", "in-place" or "gather": how a chunk reads its prefix

  def __post_init__(self):
    if self.prefix_route not in PREFIX_ROUTES:
      raise ValueError(f"prefix_route={self.prefix_route!r} must be one of {', '.join(PREFIX_ROUTES)}")

  def prefix_reason(self, *, head_dim: int, page_size: int, page_dtype) -> str | None:
    """Why a prefill chunk's cached prefix in pages of this shape cannot be read in place (None: it can)."""
    return prefix_reason(qk_dtype=self.qk_dtype, head_dim=head_dim, page_size=page_size, page_dtype=page_dtype,
                         tuning=self.flash)

  def prefix_kernel(self, *, head_dim: int, page_size: int, page_dtype) -> tuple[str, str | None]:
    """How a prefill chunk reads its cached prefix from pages of this shape, and why it gathers them: ("in-place",
    None) or ("gather", the reason). prefix_route "auto" reads in place where `prefix_reason` allows;
    prefix_route "in-place" where it cannot: a ValueError."""
    reason = self.prefix_reason(head_dim=head_dim, page_size=page_size, page_dtype=page_dtype)
    if self.prefix_route == "in-place" and reason:
      raise ValueError(f"prefix_route='in-place' cannot read these pages: {reason}")
    if self.prefix_route == "in-place" or (self.prefix_route == "auto" and not reason):
      return "in-place", None
    return "gather", reason or f"prefix_route={self.prefix_route!r}"

  def why_not(self, *, head_dim: int, dtype) -> str | None:
    reason = mgpu_flash.why_not_fp8(head_dim=head_dim, tuning=self.flash)
    if reason or self.interpret:
      return reason
    # Decode rows and the prefix merge run PallasBackend's kernels in the activation dtype.
    return mgpu_flash.why_not(head_dim=head_dim, dtype=dtype) or hardware.on_sm90()

  def _kernel(self, q, k, v, kvl, q_len=None):
    return functools.partial(mgpu_flash.flash_attention_fp8, q, k, v, kv_len=kvl, q_len=q_len, tuning=self.flash,
                             incoherent=self.incoherent, smooth_k=self.smooth_k, qk_dtype=self.qk_dtype,
                             interpret=self.interpret)

  def paged(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None, page_offset=0,
            q_len=None, past=False):
    B, T, N, H = q.shape
    K = k_pages.shape[2]
    M, Z = page_table.shape[1], k_pages.shape[1]
    q_pos = jnp.broadcast_to(q_pos, (B, T)).astype(jnp.int32)
    if T * (N // K) <= self._decode_tuning().max_rows:
      # Decode rows: the split-K paged kernels, with kv_len as given (as PallasBackend takes it; each kernel
      # bounds a split's keys by the table's M * Z). Clipping it here would put a kernel of its own in every
      # layer of the decode step: XLA does not hoist it out of the layer scan.
      return super().paged(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len, k_scale=k_scale,
                           v_scale=v_scale, page_offset=page_offset)
    kvl = jnp.clip(jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32), 0, M * Z)
    bf16_path = functools.partial(super().paged, q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kvl,
                                  k_scale=k_scale, v_scale=v_scale, page_offset=page_offset, q_len=q_len)
    # A prefill chunk against its cached prefix (every valid key precedes every row, in any row order: a seq mesh
    # gathers its rows in zigzag order) runs the FP8 kernel over the table read in blocks; other paged calls of
    # many rows (rows that see part of the pages causally) take PallasBackend's path.
    prefix = functools.partial(self._prefix, q, k_pages, v_pages, page_table + page_offset, kvl, k_scale, v_scale,
                               q_len)
    if past:
      return prefix()
    return lax.cond(paged_case(q_pos, kvl) == PAGED_PAST, prefix, bf16_path)

  def _prefix(self, q, k_pages, v_pages, table, lengths, k_scale, v_scale, q_len=None):
    """Every row of sequence b over the first lengths[b] keys of its pages: (out, lse), PREFIX_BLOCK_TOKENS keys
    at a time, each block one non-causal FP8 kernel call over the pages read in place or gathered
    (`prefix_kernel`), merged by their LSE in float32; blocks past every sequence's length are skipped. Rows at or
    past q_len (padding) are left out where the kernel can skip them."""
    B, T, N, H = q.shape
    Z, K = k_pages.shape[1], k_pages.shape[2]
    how, why = self.prefix_kernel(head_dim=H, page_size=Z, page_dtype=k_pages.dtype)
    if how == "gather" and self.prefix_route == "auto" and k_pages.dtype == fp8_ops.E4M3:
      ref.warn_once(f"attention backend {self.name}: a chunk's cached prefix is gathered, dequantized and "
                    f"quantized again: {why}")

    def block(ids, n):
      if how == "in-place":
        return mgpu_flash.flash_attention_fp8_paged(q, k_pages, v_pages, k_scale, v_scale, ids, n, q_len=q_len,
                                                    tuning=self.flash, interpret=self.interpret)
      k = ref.gather_pages(k_pages, k_scale, ids, q.dtype).reshape(B, -1, K, H)
      v = ref.gather_pages(v_pages, v_scale, ids, q.dtype).reshape(B, -1, K, H)
      return self._kernel(q, k, v, n, q_len)(causal=False)

    return ref.over_table_blocks(block, table, lengths, Z, PREFIX_BLOCK_TOKENS, q.shape, q.dtype)
