"""The calls into cuDNN's fused attention (one dense call, one paged call) and a jnp model of each on the CPU.

cuDNN offers four masks: none, padding (`j < kv_seqlen[b]`), top-left causal (`j <= i`) and both. `dense` and
`paged` return `(out, lse)` with float32 LSE [B, T, N] from the private
`jax._src.cudnn.fused_attention_stablehlo` entries (the public `jax.nn.dot_product_attention` casts the stats to
the output dtype, so it is used only when the private entry is missing, with a warning). `dense_emulated` and
`paged_emulated` model the documented masks in jnp, so lcjax.ops.cudnn.backend's decomposition is tested on CPU.
GPU-only modules are imported lazily so this file imports on CPU.
"""
from __future__ import annotations

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp

from lcjax.ops import attention as ref
from lcjax.ops import fp8 as fp8_ops

DTYPES = ("bfloat16", "float16")


@functools.cache
def private_module():
  """The private cuDNN module if it has float32-LSE entries, else None (warned once)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fsa
  except ImportError as e:  # pragma: no cover - depends on the jax build
    warnings.warn(f"jax._src.cudnn.fused_attention_stablehlo is missing ({e}); cuDNN LSE falls back to the "
                  "public API, which returns it in the output dtype")
    return None
  params = inspect.signature(fsa.dot_product_attention).parameters
  if "return_residual" not in params or "mask_type" not in params:
    warnings.warn("fused_attention_stablehlo.dot_product_attention lacks return_residual/mask_type; cuDNN LSE "
                  "falls back to the public API, which returns it in the output dtype")
    return None
  return fsa


def has_private_paged() -> bool:
  fsa = private_module()
  return fsa is not None and hasattr(fsa, "paged_attention") and hasattr(fsa, "_dot_product_attention")


def full_lengths(B, n):
  return jnp.full((B,), n, jnp.int32)


def dense(q, k, v, kv_seqlen, causal, scale):
  """One cuDNN call. q [B, T, N, H], k/v [B, S, K, H], kv_seqlen [B] or None (all keys valid).

  Returns (out, lse [B, T, N] f32). Without lengths the call uses the plain masks: cuDNN's padding variant ran
  8-15% slower on the same causal blocks (benchmarks/NOTES-attention.md).
  """
  B, T = q.shape[:2]
  fsa = private_module()
  if fsa is not None:
    if kv_seqlen is None:
      mt = fsa.MaskType.CAUSAL if causal else fsa.MaskType.NO_MASK
      lens = dict()
    else:
      mt = fsa.MaskType.PADDING_CAUSAL if causal else fsa.MaskType.PADDING
      lens = dict(q_seqlen=full_lengths(B, T), kv_seqlen=kv_seqlen)
    out, stats = fsa.dot_product_attention(q, k, v, scale=scale, mask_type=mt, qkv_layout="BTNH",
                                           return_residual=True, **lens)
    return out, jnp.transpose(stats, (0, 2, 1)).astype(jnp.float32)   # stats [B, N, T]
  out, lse = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, key_value_seq_lengths=kv_seqlen,
                                          implementation="cudnn", return_residual=True)
  return out, lse.astype(jnp.float32)


def paged(q, k_pages, v_pages, page_table, kv_seqlen, scale):
  """Padding-masked cuDNN paged call. q [B, T, N, H], pages [P, Z, K, H], page_table [B, M].

  Calls the primitive under `fused_attention_stablehlo.paged_attention` directly: its Python wrapper wants a pool
  of exactly B * M pages, and the kernel only needs every table entry < P. Checked against the reference on the
  H200 with P = 29, B * M = 24 (rel err 2e-3 in bf16) and by tests/test_kernels.py::test_paged_gpu
  (P = 100, B * M = 96); the engine's pools are always larger than one table.
  """
  fsa = private_module()
  B, T = q.shape[:2]
  table = page_table[:, None, :, None].astype(jnp.int32)             # [B, 1, M, 1]
  unused = jnp.zeros(0, q.dtype)
  out, stats = fsa._dot_product_attention(
      q, k_pages, v_pages, unused, full_lengths(B, T), kv_seqlen, unused, unused, table, table, scale, 42, 0.0,
      (False, False), fsa.MaskType.PADDING, fsa.AttentionLayout.BTNH.value, None, fsa.check_cudnn_version(), True)
  return out, jnp.transpose(stats, (0, 2, 1)).astype(jnp.float32)


def dense_emulated(q, k, v, kv_seqlen, causal, scale):
  """jnp model of cuDNN's masks: padding j < kv_seqlen, causal top-left j <= i. Garbage-free but unsanitized."""
  T, S = q.shape[1], k.shape[1]
  B = q.shape[0]
  if kv_seqlen is None:
    kv_seqlen = full_lengths(B, S)
  if causal:
    # Top-left alignment is q_pos = i, key positions 0..S-1.
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return ref.attention_dense(q, k, v, q_pos=q_pos, kv_len=kv_seqlen, causal=True, scale=scale)
  return ref.attention_dense(q, k, v, kv_len=kv_seqlen, causal=False, scale=scale)


def paged_emulated(q, k_pages, v_pages, page_table, kv_seqlen, scale):
  B = q.shape[0]
  Z = k_pages.shape[1]
  M = page_table.shape[1]
  k = fp8_ops.take(k_pages, page_table).reshape(B, M * Z, *k_pages.shape[2:])
  v = fp8_ops.take(v_pages, page_table).reshape(B, M * Z, *v_pages.shape[2:])
  return dense_emulated(q, k, v, kv_seqlen, False, scale)
