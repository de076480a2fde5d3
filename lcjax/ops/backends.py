"""Attention backends behind one interface, chosen once by name.

A backend is a frozen (hashable) dataclass so it can sit in a jitted model as static structure. The model calls
`backend.attend(...)` (contiguous keys) and `backend.paged(...)` (keys in the paged cache); both follow the
`(out, lse)` contract of `lcjax.ops.attention`; `paged(..., page_offset=o)` reads page `page_table[b, m] + o` of the
pools (the model passes one layer's pages as an offset into the pools of every layer); `attend(..., q_len=n)` and
`paged(..., q_len=n)` ([B] int32) say that rows at or past n[b] are padding whose output the caller drops (a backend
may leave them uncomputed, and must not let them change a real row: the FP8 kernels zero them before Q's block scales
are taken; these compute them). `paged(..., past=True)` is the caller's promise that every key below kv_len[b]
precedes all of sequence b's rows (a prefill chunk over its cached prefix): a backend that would otherwise choose its
path from the positions on the device (a lax.cond, whose predicate a GPU copies to the host, waiting for every kernel
before it) takes its prefix path directly; these two are exact for any rows and need no promise. Backends whose
`reads_layer_pools` is true also take `paged(..., layer=l)`: k_pages and v_pages are then the pools of every layer
[L, P, Z, K, H] (scales [L, P, K]) and page `page_table[b, m]` of layer l is read (Llama's `pool_reads`). `why_not(...)`
returns the reason a backend cannot serve a shape (or None), so `auto` can fall back to one that can and say why.
ReferenceBackend and DenseBackend live here, CudnnBackend in lcjax.ops.cudnn.backend, PallasBackend and
PallasFp8Backend in lcjax.ops.pallas_backend (apart from the kernels they choose between).
"""
from __future__ import annotations

import dataclasses
import logging

import jax

from lcjax.config import ATTENTION_DTYPES
from lcjax.ops import attention as ref


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
  """Plain jnp blockwise online softmax: runs everywhere, O(T * block) memory."""
  name: str = "reference"
  block_k: int = 512
  pages_per_block: int = 8
  reads_layer_pools = True

  def why_not(self, *, head_dim: int, dtype) -> str | None:
    return None

  def attend(self, q, k, v, *, q_pos=None, k_start=None, kv_len=None, q_len=None, causal=True):
    return ref.attention_reference(q, k, v, q_pos=q_pos, k_start=k_start, kv_len=kv_len, causal=causal,
                                   block_k=self.block_k)

  def paged(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None, page_offset=0,
            layer=None, q_len=None, past=False):
    return ref.paged_attention_reference(q, k_pages, v_pages, page_table + page_offset, q_pos=q_pos, kv_len=kv_len,
                                         pages_per_block=self.pages_per_block, k_scale=k_scale,
                                         v_scale=v_scale, layer=layer)


@dataclasses.dataclass(frozen=True)
class DenseBackend:
  """The unoptimised baseline: XLA attention that materialises every [T, S] score matrix (O(S^2) memory).
  Benchmarks use it to show where a model without flash attention runs out of memory."""
  name: str = "dense"
  reads_layer_pools = True

  def why_not(self, *, head_dim: int, dtype) -> str | None:
    return None

  def attend(self, q, k, v, *, q_pos=None, k_start=None, kv_len=None, q_len=None, causal=True):
    B, T = q.shape[:2]
    if k_start is not None:        # attention_dense counts keys from position 0
      q_pos, k_start = ref.block_positions(q_pos, k_start, B, T, k.shape[1])
      q_pos = q_pos - k_start[:, None]
    return ref.attention_dense(q, k, v, q_pos=q_pos, kv_len=kv_len, causal=causal)

  def paged(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale=None, v_scale=None, page_offset=0,
            layer=None, q_len=None, past=False):
    B, M = page_table.shape
    Z = k_pages.shape[-3]
    page_table = page_table + page_offset

    def gather(pages, scale):
      return ref.gather_pages(pages, scale, page_table, q.dtype, layer).reshape(B, M * Z, *pages.shape[-2:])

    return ref.attention_dense(q, gather(k_pages, k_scale), gather(v_pages, v_scale), q_pos=q_pos,
                               kv_len=kv_len, causal=True)


def _cudnn():
  from lcjax.ops.cudnn.backend import CudnnBackend
  return CudnnBackend()


def _pallas():
  from lcjax.ops.pallas_backend import PallasBackend
  return PallasBackend()


# Kernel modules are imported only when their backend is asked for (they import GPU-only parts lazily too).
_FACTORIES = {"reference": ReferenceBackend, "dense": DenseBackend, "cudnn": _cudnn, "pallas": _pallas}


def _fp8_backend(name: str, head_dim: int, dtype, attention_dtype: str):
  """attention_dtype float8_e4m3fn or int8_fp8: the FP8 flash kernel (Q K^T in e4m3 or int8); with
  attention='auto' on a machine without a GPU, its jnp model (announced)."""
  from lcjax.ops.pallas_backend import PallasFp8Backend
  if name not in ("auto", "pallas"):
    raise ValueError(f"attention_dtype={attention_dtype} runs on the pallas backend, not attention={name!r}")
  qk = ATTENTION_DTYPES[attention_dtype]
  kernel = "pallas-fp8" if qk == "float8_e4m3fn" else "pallas-int8-fp8"
  if name == "auto" and jax.default_backend() != "gpu":
    be = PallasFp8Backend(name=kernel + "-model", interpret=True, qk_dtype=qk)
    logging.warning("attention_dtype=%s on %s runs the FP8 kernel's jnp model for prefill and the Triton decode "
                    "kernel in the Pallas interpreter (their arithmetic, none of their speed)",
                    attention_dtype, jax.default_backend())
  else:
    be = PallasFp8Backend(name=kernel, qk_dtype=qk)
  reason = be.why_not(head_dim=head_dim, dtype=dtype)
  if reason:
    raise ValueError(f"attention_dtype={attention_dtype} cannot run here (attention={name!r}): {reason}")
  return be


def get_backend(name: str = "auto", *, head_dim: int = 128, dtype="bfloat16", attention_dtype: str = "auto"):
  """Return the backend called `name`; `auto` takes the fastest one that can serve this shape here.
  attention_dtype float8_e4m3fn / int8_fp8 asks for low-precision attention (the pallas backend's FP8 kernel)."""
  if attention_dtype not in ATTENTION_DTYPES:
    raise ValueError(f"attention_dtype={attention_dtype!r} must be one of {', '.join(ATTENTION_DTYPES)}")
  if attention_dtype != "auto":
    return _fp8_backend(name, head_dim, dtype, attention_dtype)
  if name == "auto":
    if jax.default_backend() != "gpu":
      return ReferenceBackend()
    reasons = []
    for cand in ("pallas", "cudnn"):
      be = _FACTORIES[cand]()
      reason = be.why_not(head_dim=head_dim, dtype=dtype)
      if reason is None:
        return be
      reasons.append(f"{cand}: {reason}")
    logging.warning("attention 'auto' runs the jnp reference on this GPU (slow) because %s", "; ".join(reasons))
    return ReferenceBackend()
  if name not in _FACTORIES:
    raise ValueError(f"attention backend {name!r} is not available here; available: {sorted(_FACTORIES)}")
  be = _FACTORIES[name]()
  reason = be.why_not(head_dim=head_dim, dtype=dtype)
  if reason:
    raise ValueError(f"attention backend {name!r} cannot serve head_dim={head_dim} dtype={dtype}: {reason}")
  return be
