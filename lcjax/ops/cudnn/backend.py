"""cuDNN flash attention behind the `(out, lse)` contract.

cuDNN offers only four masks: none, padding (`j < kv_seqlen[b]`), top-left causal (`j <= i`) and both; a dense
mask would drop it off the flash path (15.8% tensor-core use measured in JAX PR #35114). Every position pattern of
the contract is therefore cut into pieces cuDNN can do and joined with `merge`:

  key j visible to row i  iff  j < kv_len  and  j <= i + d,   d = q_pos[b, 0] - k_start[b]  (rows contiguous)

  * d == 0 (diagonal ring block): one top-left causal call on the first min(T, S) keys;
  * d >= S - 1 (block entirely in the past): one padding-only call;
  * otherwise: keys [0, d) are seen by every row (padding-only call with kv_seqlen = min(kv_len, d)) and the
    T-key window starting at d is a top-left causal block (kv_seqlen = kv_len - d), merged by LSE.

Rows whose positions are not contiguous, or d < 0 (rows before the first key), go to the jnp reference: cuDNN
cannot express them; on a GPU that branch logs why when it runs (`attention.reference_branch_ran`). Rows that see
no key get out = 0, lse = -inf here, whatever cuDNN wrote for them.

The calls themselves, with float32 LSE, and their jnp model live in lcjax.ops.cudnn.calls.

Paged: the primitive under the private `fused_attention_stablehlo.paged_attention` reads K/V through the page
table. Its Python wrapper wants a pool of exactly B * M pages; lcjax calls the primitive with that check skipped
(the kernel only needs table entries < P; checked on the H200), one path for every pool. JAX's cuDNN paged path
has no fp8: a chunk of many rows over fp8 pages reads them dequantized into a compact bf16 pool
(`dequantize_pages`; 128K prefill 10.9 s vs bf16's 11.1 s on the H200); a single decode row over fp8 pages goes
to the backend's `fp8_decode` kernel (the Triton fp8 decode kernel, which lcjax.engine.serving gives it where that
serves: sm_89+), else to the reference.

`emulate=True` swaps the two cuDNN calls for the jnp model of their documented masks, so the decomposition above
is tested on CPU against the reference.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from lcjax.ops import attention as ref
from lcjax.ops import fp8 as fp8_ops
from lcjax.ops.cudnn import calls

def _sanitize(out, lse, empty):
  """Rows with no visible key: out = 0, lse = -inf. empty [B] or [B, T]."""
  e = empty if empty.ndim == 2 else empty[:, None]
  e = jnp.broadcast_to(e, lse.shape[:2])
  out = jnp.where(e[:, :, None, None], jnp.zeros((), out.dtype), out)
  lse = jnp.where(e[:, :, None], ref.NEG_INF, lse)
  return out, lse


def _window(x, start, W):
  """x [B, S, K, H] -> x[b, start[b] + t] for t < W (indices clamped; callers mask the overhang)."""
  S = x.shape[1]
  idx = jnp.clip(start[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :], 0, S - 1)    # [B, W]
  return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)


def _paged_window(pages, page_table, start, W, scale=None, dtype=None):
  """Tokens start[b] .. start[b] + W - 1 of each sequence from the paged pool -> [B, W, K, H] (clamped); fp8
  pages with their scales [P, K] come back dequantized to `dtype`."""
  Z = pages.shape[1]
  M = page_table.shape[1]
  tok = start[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]                          # [B, W]
  slot = jnp.clip(tok // Z, 0, M - 1)
  page = jnp.take_along_axis(page_table, slot, axis=1)
  x = fp8_ops.take(pages, (page, jnp.clip(tok - slot * Z, 0, Z - 1)))
  return x if scale is None else ref.dequantize(x, scale[page], dtype)


def dequantize_pages(k_pages, v_pages, page_table, k_scale, v_scale, dtype):
  """The pages a table reads, dequantized: fp8 pools [P, Z, K, H] with scales [P, K] (or None) -> compact
  pools [B * M, Z, K, H] in `dtype` and the table [B, M] that reads them (sequence b's slot m is page b*M + m).
  Transient memory: B * M * Z * K * H * itemsize per pool (one layer's share at long context)."""
  B, M = page_table.shape

  def one(pages, scale):
    return ref.gather_pages(pages, scale, page_table, dtype).reshape(B * M, *pages.shape[1:])

  table = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
  return one(k_pages, k_scale), one(v_pages, v_scale), table


PAGED_REFERENCE, PAGED_PAST, PAGED_SPLIT = 0, 1, 2
# Keys of an fp8 prefix dequantized at once for a chunk's read (lcjax.engine.plan counts this transient): 512 MiB
# of K and V per layer for Llama-3-8B, against 4 GiB for a whole 1M-token prefix.
FP8_BLOCK_TOKENS = 131072


def past_each(q_pos, kvl):
  """[B]: whether every valid key of sequence b (below kvl[b]) precedes all its rows (q_pos [B, T]), in any row
  order, at positions >= 0."""
  qmin = q_pos.min(axis=1)
  return (kvl <= qmin + 1) & (qmin >= 0)


def paged_case(q_pos, kvl):
  """Which decomposition a paged call of many rows takes. PAST: every valid key precedes every row (a chunk
  against its cached prefix), in any row order: the sequence-sharded prefill gathers its queries in zigzag order,
  and a padding mask does not care. SPLIT: contiguous rows that see part of the pages causally. Else REFERENCE."""
  past = jnp.all(past_each(q_pos, kvl))
  split = ref.contiguous_rows(q_pos) & jnp.all(q_pos[:, 0] >= 0)
  return jnp.where(past, PAGED_PAST, jnp.where(split, PAGED_SPLIT, PAGED_REFERENCE))


@dataclasses.dataclass(frozen=True)
class CudnnBackend:
  """cuDNN flash attention (prefill blocks) and cuDNN paged attention (decode)."""
  name: str = "cudnn"
  emulate: bool = False            # CPU tests: jnp model of cuDNN's masks instead of the library
  fp8_block_tokens: int = FP8_BLOCK_TOKENS   # an fp8 prefix is dequantized and read this many keys at a time
  # The kernel of decode rows over fp8 pages, which cuDNN cannot read (lcjax.ops.kernels.TritonFp8Decode; None:
  # the jnp reference). lcjax.engine.serving sets it where it can serve.
  fp8_decode: object = None

  def why_not(self, *, head_dim: int, dtype) -> str | None:
    if jnp.dtype(dtype).name not in calls.DTYPES:
      return f"cuDNN flash attention takes {calls.DTYPES}, not dtype={jnp.dtype(dtype).name}"
    if head_dim > 256 or head_dim % 8:
      return f"cuDNN flash attention needs head_dim <= 256 and a multiple of 8, got {head_dim=}"
    if self.emulate:
      return None
    if jax.default_backend() != "gpu":
      return f"needs a CUDA GPU; jax.default_backend()={jax.default_backend()!r}"
    try:
      from jax._src.lib import cuda_versions
    except ImportError:
      cuda_versions = None
    if cuda_versions is None:
      return "cuDNN is not available in this jaxlib"
    return None

  def decode_reason(self, *, page_dtype, T: int = 1) -> str | None:
    """Why `paged` sends T query positions of a sequence (1: a decode row) over pages of `page_dtype` to the jnp
    reference instead of cuDNN's paged kernel; None: it does not."""
    name = jnp.dtype(page_dtype).name
    fp8 = name == "float8_e4m3fn"
    if fp8 and T == 1:
      return None if self.fp8_decode else "a decode row over fp8 pages"
    if not (fp8 or name in calls.DTYPES):
      return f"cuDNN reads no {name} pages"
    if not self.emulate and not calls.has_private_paged():
      return "this jax has no cuDNN paged attention entry"
    return None

  def decode_kernel(self, *, head_dim: int, page_size: int, rows: int, page_dtype, dtype=None) -> str:
    """The kernel `paged` runs for decode rows over pages of `page_dtype` (whatever the query dtype): 'cudnn';
    fp8_decode's name over fp8 pages; or 'reference' (the jnp reference: fp8 pages without fp8_decode, float32
    pages, or a jax without cuDNN's paged entry; the trace logs why)."""
    if self.fp8_decode and jnp.dtype(page_dtype) == jnp.float8_e4m3fn:
      return self.fp8_decode.name
    return "reference" if self.decode_reason(page_dtype=page_dtype) else self.name

  # -- the two library calls, swappable for the CPU emulation
  def _dense(self, q, k, v, kv_seqlen, causal, scale):
    f = calls.dense_emulated if self.emulate else calls.dense
    return f(q, k, v, None if kv_seqlen is None else kv_seqlen.astype(jnp.int32), causal, scale)

  def _paged_call(self, q, k_pages, v_pages, page_table, kv_seqlen, scale):
    if self.emulate:
      return calls.paged_emulated(q, k_pages, v_pages, page_table, kv_seqlen.astype(jnp.int32), scale)
    return calls.paged(q, k_pages, v_pages, page_table, kv_seqlen.astype(jnp.int32), scale)

  def _prefix(self, q, k_pages, v_pages, page_table, lengths, scale, k_scale=None, v_scale=None):
    """Every row of sequence b over the first lengths[b] keys of its pages (a padding mask, no causal part):
    (out, lse), rows with no key sanitized.

    JAX's cuDNN paged attention has no fp8. A chunk of many rows is tensor-core work over the pages it reads, so
    fp8 pages are dequantized to the query dtype (one fused gather-scale-convert into a compact pool) and read in
    blocks of fp8_block_tokens keys, merged by their LSE in float32: the transient is one block's K and V, not
    the prefix's. Blocks wholly past every sequence's length are skipped."""
    if k_scale is None:
      return _sanitize(*self._paged_call(q, k_pages, v_pages, page_table, lengths, scale), lengths <= 0)
    def block(ids, n):
      kb, vb, tb = dequantize_pages(k_pages, v_pages, ids, k_scale, v_scale, q.dtype)
      return _sanitize(*self._paged_call(q, kb, vb, tb, n, scale), n <= 0)

    return ref.over_table_blocks(block, page_table, lengths, k_pages.shape[1], self.fp8_block_tokens, q.shape,
                                 q.dtype)

  def _split(self, q, prefix_kv, prefix_len, diag_kv, diag_len, scale):
    """Merge a padding-only part (every row sees prefix_len keys) with a top-left causal diagonal part.

    Lengths None: every key of that part is valid (no padding mask, no empty rows).
    """
    o_a, l_a = self._dense(q, *prefix_kv, prefix_len, False, scale)
    o_b, l_b = self._dense(q, *diag_kv, diag_len, True, scale)
    if prefix_len is not None:
      o_a, l_a = _sanitize(o_a, l_a, prefix_len <= 0)
      o_b, l_b = _sanitize(o_b, l_b, diag_len <= 0)
    return ref.merge(o_a, l_a, o_b, l_b)

  def attend(self, q, k, v, *, q_pos=None, k_start=None, kv_len=None, q_len=None, causal=True):
    B, T, N, H = q.shape
    S = k.shape[1]
    scale = 1.0 / math.sqrt(H)
    full = kv_len is None                              # every key valid: cuDNN's faster non-padding masks
    kvl = calls.full_lengths(B, S) if full else jnp.clip(jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32), 0, S)
    if not causal:
      return _sanitize(*self._dense(q, k, v, None if full else kvl, False, scale), kvl <= 0)
    W = min(T, S)
    if q_pos is None and k_start is None:
      d = S - T                                       # the contract's default: the last T keys are the queries
      if d < 0:
        # Rows before the first key: cuDNN's top-left mask cannot express them.
        ref.routed_to_reference("cudnn", f"a causal block of {T} queries over {S} keys (rows before the first key)")
        return ref.attention_reference(q, k, v, kv_len=kvl, causal=True)
      if d == 0:
        return _sanitize(*self._dense(q, k, v, None if full else kvl, True, scale), kvl <= 0)
      if full:
        return self._split(q, (k[:, :d], v[:, :d]), None, (k[:, d:], v[:, d:]), None, scale)
      return self._split(q, (k[:, :d], v[:, :d]), jnp.minimum(kvl, d), (k[:, d:], v[:, d:]),
                         jnp.clip(kvl - d, 0, T), scale)

    q_pos, k_start = ref.block_positions(q_pos, k_start, B, T, S)
    d = q_pos[:, 0] - k_start

    def diagonal():
      kw = jnp.minimum(kvl, W)
      return _sanitize(*self._dense(q, k[:, :W], v[:, :W], None if full else kw, True, scale), kw <= 0)

    def past():
      return _sanitize(*self._dense(q, k, v, None if full else kvl, False, scale), kvl <= 0)

    def split():
      prefix_len = jnp.clip(jnp.minimum(kvl, d), 0, S)
      return self._split(q, (k, v), prefix_len, (_window(k, d, W), _window(v, d, W)),
                         jnp.clip(kvl - d, 0, W), scale)

    contiguous = ref.contiguous_rows(q_pos)

    def reference():
      # Non-contiguous rows or rows before the first key: not expressible with cuDNN's masks.
      ref.reference_branch_ran("cudnn", {ref.NONCONTIGUOUS_ROWS: ~contiguous, ref.ROWS_BEFORE_FIRST_KEY: d < 0})
      return ref.attention_reference(q, k, v, q_pos=q_pos, k_start=k_start, kv_len=kvl, causal=True)

    ok = contiguous & jnp.all(d >= 0)
    case = jnp.where(~ok, 0, jnp.where(jnp.all(d == 0), 1, jnp.where(jnp.all(d >= S - 1), 2, 3)))
    return lax.switch(case, (reference, diagonal, past, split))

  def paged(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None, page_offset=0,
            q_len=None, past=False):
    B, T, N, H = q.shape
    Z = k_pages.shape[1]
    M = page_table.shape[1]
    scale = 1.0 / math.sqrt(H)
    page_table = page_table + page_offset
    q_pos = jnp.broadcast_to(q_pos, (B, T)).astype(jnp.int32)
    kvl = jnp.clip(jnp.broadcast_to(kv_len, (B,)).astype(jnp.int32), 0, M * Z)
    if T == 1 and self.fp8_decode and k_pages.dtype == jnp.float8_e4m3fn:
      return self.fp8_decode(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kvl, k_scale=k_scale,
                             v_scale=v_scale)
    reason = self.decode_reason(page_dtype=k_pages.dtype, T=T)
    if reason:
      # The exact jnp path: older jax has no cuDNN paged entry; cuDNN reads no float32 pages; and a decode row
      # over fp8 pages reads each page once, so dequantizing a copy of them first would double its bytes.
      ref.routed_to_reference("cudnn", reason)
      return ref.paged_attention_reference(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kvl,
                                           k_scale=k_scale, v_scale=v_scale)
    if T == 1:
      # One row: causality is one more bound on the key count.
      n = jnp.clip(jnp.minimum(kvl, q_pos[:, 0] + 1), 0, M * Z)
      return self._prefix(q, k_pages, v_pages, page_table, n, scale)

    p0 = q_pos[:, 0]

    def prefix():
      # Every valid key precedes every row (chunk against its cached prefix): no causal part.
      return self._prefix(q, k_pages, v_pages, page_table, kvl, scale, k_scale, v_scale)

    def split():
      prefix_len = jnp.clip(jnp.minimum(kvl, p0), 0, M * Z)
      o_a, l_a = self._prefix(q, k_pages, v_pages, page_table, prefix_len, scale, k_scale, v_scale)
      diag_len = jnp.clip(kvl - p0, 0, T)
      kw = _paged_window(k_pages, page_table, p0, T, k_scale, q.dtype)
      vw = _paged_window(v_pages, page_table, p0, T, v_scale, q.dtype)
      o_b, l_b = _sanitize(*self._dense(q, kw, vw, diag_len, True, scale), diag_len <= 0)
      return ref.merge(o_a, l_a, o_b, l_b)

    def reference():
      # Non-contiguous rows that see part of the pages, or negative positions: not expressible with cuDNN's masks.
      ref.reference_branch_ran("cudnn", {ref.NONCONTIGUOUS_ROWS: ~ref.contiguous_rows(q_pos),
                                         ref.NEGATIVE_POSITIONS: q_pos[:, 0] < 0})
      return ref.paged_attention_reference(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kvl,
                                           k_scale=k_scale, v_scale=v_scale)

    if past:
      return prefix()
    return lax.switch(paged_case(q_pos, kvl), (reference, prefix, split))
