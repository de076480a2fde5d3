"""Attention backends against an independent float64 numpy oracle.

CPU: the Pallas decode kernel in interpret mode; the cuDNN backend's mask decomposition with cuDNN's two calls
replaced by a jnp model of their documented masks (top-left causal, padding); backend selection; the Mosaic GPU
flash kernel lowering for CUDA. GPU (`-m gpu`, run through the device tool): the real kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.ops import attention as ref
from lcjax.ops import backends
from lcjax.ops import hardware
from lcjax.ops.cudnn import backend as cudnn
from lcjax.ops import pallas_backend
from lcjax.ops.mosaic_gpu import flash as mgpu_flash
from lcjax.ops.triton import paged as triton_paged

ON_GPU = jax.default_backend() == "gpu"


# ---------------------------------------------------------------- oracle
def oracle(q, k, v, visible):
  """float64 softmax attention. q [B,T,N,H], k/v [B,S,K,H], visible [B,T,S] -> (out, lse [B,T,N])."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  G = N // k.shape[2]
  kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(H)
  vis = np.asarray(visible)[:, None]
  s = np.where(vis, s, -np.inf)
  top = s.max(-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  e = np.where(vis, np.exp(s - top), 0.0)
  tot = e.sum(-1, keepdims=True)
  p = e / np.where(tot > 0, tot, 1.0)
  out = np.einsum("bnts,bsnh->btnh", p, vv)
  lse = np.where(tot[..., 0] > 0, np.log(np.where(tot[..., 0] > 0, tot[..., 0], 1.0)) + top[..., 0], -np.inf)
  return out, lse.transpose(0, 2, 1)


def visibility(q_pos, k_start, kv_len, S, causal):
  q_pos, k_start, kv_len = (np.asarray(x) for x in (q_pos, k_start, kv_len))
  j = np.arange(S)
  vis = (j[None, None, :] < kv_len[:, None, None])
  if causal:
    vis = vis & (k_start[:, None, None] + j[None, None, :] <= q_pos[:, :, None])
  return np.broadcast_to(vis, (q_pos.shape[0], q_pos.shape[1], S))


def check(got, want, *, tol_out, tol_lse=2e-3):
  out, lse = (np.asarray(x, np.float64) for x in got)
  w_out, w_lse = want
  assert out.shape == w_out.shape and lse.shape == w_lse.shape
  assert np.isfinite(out).all()
  err = np.linalg.norm(out - w_out) / max(np.linalg.norm(w_out), 1e-30)
  assert err < tol_out, f"out rel err {err:.2e}"
  empty = ~np.isfinite(w_lse)
  np.testing.assert_array_equal(~np.isfinite(lse), empty)              # fully masked rows: lse = -inf ...
  assert np.all(out[empty] == 0.0)                                     # ... and out = 0
  fin = ~empty
  if fin.any():
    lerr = np.max(np.abs(lse[fin] - w_lse[fin]) / np.maximum(1.0, np.abs(w_lse[fin])))
    assert lerr < tol_lse, f"lse rel err {lerr:.2e}"


def rand_qkv(seed, B, T, S, N, K, H, dtype=jnp.bfloat16):
  """Random q [B, T, N, H], k and v [B, S, K, H] of `dtype`: one jitted program per shape and dtype (the seed is
  its argument), not one program per random draw and shape."""
  return _rand_qkv(seed, B, T, S, N, K, H, dtype)


@functools.partial(jax.jit, static_argnums=tuple(range(1, 8)))
def _rand_qkv(seed, B, T, S, N, K, H, dtype):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, T, N, H), dtype), jax.random.normal(ks[1], (B, S, K, H), dtype),
          jax.random.normal(ks[2], (B, S, K, H), dtype))


def rand_pages(seed, B, T, N, K, H, Z, M, P, *, fp8=False, dtype=jnp.bfloat16):
  """Pages of B sequences scattered out of order in a pool of P pages; returns oracle-ready dense K/V too. The
  arrays come from one jitted program per shape and dtype (the seed is its argument)."""
  q, kp, vp, table, k_scale, v_scale = _rand_pages(seed, B, T, N, K, H, Z, M, P, fp8, dtype)
  # The oracle's K/V are the stored bytes read in numpy: inside the jitted program a GPU's XLA may fold the round
  # trip through e4m3 (excess precision), and its K/V would then be the unquantized values.
  if fp8:
    kd, vd = (np.asarray(x).astype(np.float64) * np.asarray(s, np.float64)[:, None, :, None]
              for x, s in ((kp, k_scale), (vp, v_scale)))
  else:
    kd, vd = kp, vp
  dense = lambda x: np.asarray(x, np.float64)[np.asarray(table)].reshape(B, M * Z, K, H)
  return q, kp, vp, table, k_scale, v_scale, dense(kd), dense(vd)


@functools.partial(jax.jit, static_argnums=tuple(range(1, 11)))
def _rand_pages(seed, B, T, N, K, H, Z, M, P, fp8, dtype):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (B, T, N, H), dtype)
  kp = jax.random.normal(ks[1], (P, Z, K, H), jnp.float32)
  vp = jax.random.normal(ks[2], (P, Z, K, H), jnp.float32)
  table = jax.random.permutation(ks[3], P)[:B * M].reshape(B, M).astype(jnp.int32)
  if fp8:
    k_scale = jax.random.uniform(ks[4], (P, K), minval=0.25, maxval=2.0)
    v_scale = jax.random.uniform(ks[5], (P, K), minval=0.25, maxval=2.0)
    kp = (kp / k_scale[:, None, :, None]).astype(jnp.float8_e4m3fn)
    vp = (vp / v_scale[:, None, :, None]).astype(jnp.float8_e4m3fn)
  else:
    k_scale = v_scale = None
    kp, vp = kp.astype(dtype), vp.astype(dtype)
  return q, kp, vp, table, k_scale, v_scale


def behind_junk(x, n, value):
  """The pool x [P, ...] (or its scales [P, K]) behind n pages filled with `value`, made in numpy (None: None)."""
  if x is None:
    return None
  x = np.asarray(x)
  return jnp.asarray(np.concatenate([np.full((n, *x.shape[1:]), value, x.dtype), x]))


def last_rows(kv_len, T, shift=0):
  """q_pos [B, T] int32 of T rows ending at each kv_len - 1, moved by `shift`, made in numpy."""
  return jnp.asarray(np.asarray(kv_len)[:, None] - T + shift + np.arange(T)[None, :], jnp.int32)


# ---------------------------------------------------------------- Pallas decode kernel (interpret mode on CPU)
slow = pytest.mark.slow
PAGED_CASES = [
    # Interpret mode costs seconds per case on CPU: the fast cases together cover GQA 8 and 4, several query
    # rows with causal bounds inside the cache, an empty row, splits with and without multi-page steps, fp8.
    # GQA 8, an empty row, 32-token pages read as two blocks of 16 (a block crosses no page; splits split pages)
    dict(T=3, N=16, K=2, fp8=False, kv_len=(90, 0, 33), Z=32, tuning=dict(num_splits=3, block_tokens=16)),
    # fp8 (per-page scales) with 32-token pages in blocks of 16 and 4 blocks a step: a split's 6 blocks take 2
    # steps, so its last step runs into the next split's blocks, whose keys (sequence 0: 150) it must not count
    dict(T=1, N=8, K=2, fp8=True, kv_len=(150, 50, 9), Z=32,
         tuning=dict(num_splits=2, pages_per_step=4, block_tokens=16)),
    # GQA 3 (rows not a power of two: 6 real of 16) over 5 splits (partials padded to 8, three unused)
    dict(T=2, N=6, K=2, fp8=False, kv_len=(70, 33, 0), tuning=dict(num_splits=5, combine_block=8)),
    pytest.param(dict(T=1, N=8, K=8, fp8=False, kv_len=(96, 17, 1), tuning=dict()), marks=slow),    # GQA 1
    pytest.param(dict(T=2, N=16, K=4, fp8=True, kv_len=(64, 40, 5), tuning=dict(num_splits=4)), marks=slow),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=["T3-G8", "T1-G4-fp8", "T2-G3", "T1-G1", "T2-G4-fp8"])
def test_paged_decode_interpret(case):
  B, H, M, P, off = 3, 32, 6, 23, 3
  T, N, K, Z = case["T"], case["N"], case["K"], case.get("Z", 16)
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(T * 7 + N, B, T, N, K, H, Z, M, P, fp8=case["fp8"])
  # The pools (and fp8 scales) start with `off` junk pages: the table counts from page_offset=off.
  junk = functools.partial(behind_junk, n=off)
  kv_len = jnp.array(case["kv_len"], jnp.int32)
  # Row t sits at kv_len - T + t, one row also earlier in the cache (a causal bound inside the cached keys).
  q_pos = np.array(last_rows(kv_len, T))
  q_pos[0, 0] -= 20
  q_pos = jnp.asarray(q_pos)
  got = triton_paged.paged_decode(q, junk(kp, value=50.0), junk(vp, value=50.0), table, q_pos=q_pos, kv_len=kv_len,
                                  k_scale=junk(ks, value=100.0), v_scale=junk(vs, value=100.0), page_offset=off,
                                  tuning=triton_paged.PagedTuning(**case["tuning"]), interpret=True)
  want = oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True))
  check(got, want, tol_out=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_decode_reads_no_key_past_the_table(fp8):
  """kv_len and q_pos past the table's M * Z keys, with 4 splits of 2 pages over a 6-page table: the last split
  covers slots 6 and 7, which the kernel clamps to slot 5; those keys must not count again."""
  B, T, N, K, H, Z, M, P = 3, 1, 8, 2, 32, 16, 6, 20
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(11, B, T, N, K, H, Z, M, P, fp8=fp8)
  kv_len = jnp.array([M * Z + 40, M * Z + 1, 50], jnp.int32)
  q_pos = last_rows(kv_len, 1)
  got = triton_paged.paged_decode(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len, k_scale=ks, v_scale=vs,
                                  tuning=triton_paged.PagedTuning(num_splits=4), interpret=True)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)


@pytest.mark.parametrize("c", [2.0 ** 20, 2.0 ** -26, 2.0 ** -120])
def test_paged_decode_over_fp8_pages_takes_queries_of_any_bf16_size(c):
  """Queries times c over fp8 pages whose K scales are divided by c: the same scores, within the kernel's usual
  error of the float64 oracle. The kernel reads the queries as float16 (its fp8 K is widened to float16): taken as
  they are, queries past 65504 (c = 2^20) were infinite and the rows came out 0 with lse -inf, and queries under
  float16's normal range (c = 2^-26) lost their bits; they are scaled by a power of two per sequence and kv head,
  one that stays a normal float32 for queries near float32's smallest normal (c = 2^-120)."""
  B, T, N, K, H, Z, M, P = 2, 1, 8, 2, 32, 16, 4, 12
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(21, B, T, N, K, H, Z, M, P, fp8=True)
  kv_len = jnp.array([60, 23], jnp.int32)
  q_pos = last_rows(kv_len, 1)
  got = triton_paged.paged_decode((q.astype(jnp.float32) * c).astype(jnp.bfloat16), kp, vp, table, q_pos=q_pos,
                                  kv_len=kv_len, k_scale=ks / c, v_scale=vs, interpret=True)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)


def test_paged_decode_rejects_a_combine_block_not_dividing_the_head_dim():
  q = jnp.zeros((1, 1, 8, 32), jnp.bfloat16)
  kp = jnp.zeros((4, 16, 2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="combine_block=24 must be a power of two dividing head dim H=32"):
    triton_paged.paged_decode(q, kp, kp, jnp.zeros((1, 4), jnp.int32), q_pos=jnp.zeros((1, 1), jnp.int32),
                              kv_len=jnp.ones((1,), jnp.int32), tuning=triton_paged.PagedTuning(combine_block=24),
                              interpret=True)


def test_paged_decode_rejects_prefill_shapes():
  q = jnp.zeros((1, 64, 8, 32), jnp.bfloat16)
  kp = jnp.zeros((4, 16, 2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="prefill"):
    triton_paged.paged_decode(q, kp, kp, jnp.zeros((1, 4), jnp.int32), q_pos=jnp.zeros((1, 64), jnp.int32),
                              kv_len=jnp.array([4], jnp.int32))


def test_split_heuristic_fills_gpu_but_keeps_pages_per_split():
  t = triton_paged.PagedTuning()
  assert triton_paged.num_splits_for(t, 8, 8, 8192) == 16       # 1056 programs wanted / 64: 17, a power of two
  assert triton_paged.num_splits_for(t, 1, 8, 2048) == 128      # 128K tokens of 64: 132 wanted
  assert triton_paged.num_splits_for(t, 8, 8, 8) == 2          # 8 slots, at least 4 pages per split
  assert triton_paged.num_splits_for(t, 1, 1, 28) == 4         # 7 splits of 4 pages: 4
  assert triton_paged.num_splits_for(triton_paged.PagedTuning(num_splits=99), 1, 1, 5) == 5


# ---------------------------------------------------------------- cuDNN decomposition (emulated cuDNN on CPU)
EMU = cudnn.CudnnBackend(emulate=True)

ATTEND_CASES = [
    # name, T, S, N, K, causal, positions: None (contract default) or (d per batch), kv_len or None
    ("noncausal-ragged", 48, 80, 4, 4, False, None, (80, 0)),
    ("causal-square", 64, 64, 8, 2, True, None, None),
    ("causal-bottom-right", 32, 96, 8, 1, True, None, (70, 96)),
    ("dyn-diagonal", 64, 64, 8, 8, True, (0, 0), (64, 40)),
    ("dyn-past", 32, 48, 4, 1, True, (100, 47), None),
    ("dyn-split", 40, 96, 8, 2, True, (10, 56), (90, 96)),
    ("dyn-split-short-keys", 64, 32, 4, 4, True, (5, 0), (32, 0)),
    ("dyn-before-first-key", 32, 32, 4, 2, True, (-8, 0), None),
]
# Each dynamic case compiles every branch of the switch (seconds on CPU): CI runs one per branch.
_CPU_FAST = {"noncausal-ragged", "causal-bottom-right", "dyn-split", "dyn-before-first-key"}
CPU_ATTEND = [c if c[0] in _CPU_FAST else pytest.param(*c, marks=slow) for c in ATTEND_CASES]


def _attend_inputs(T, S, positions, kv_len, B=2):
  if positions is None:
    q_pos, k_start = None, None
    o_pos, o_start = np.broadcast_to(np.arange(T) + S - T, (B, T)), np.zeros(B, int)
  else:
    o_start = np.array([3, 0])
    o_pos = o_start[:, None] + np.array(positions)[:, None] + np.arange(T)[None, :]
    q_pos, k_start = jnp.asarray(o_pos, jnp.int32), jnp.asarray(o_start, jnp.int32)
  kvl = None if kv_len is None else jnp.array(kv_len, jnp.int32)
  o_len = np.full(B, S) if kv_len is None else np.asarray(kv_len)
  return q_pos, k_start, kvl, (o_pos, o_start, o_len)


@pytest.mark.parametrize("name,T,S,N,K,causal,positions,kv_len", CPU_ATTEND, ids=[c[0] for c in ATTEND_CASES])
def test_cudnn_decomposition_emulated(name, T, S, N, K, causal, positions, kv_len):
  q, k, v = rand_qkv(T + S, 2, T, S, N, K, 16)
  q_pos, k_start, kvl, (o_pos, o_start, o_len) = _attend_inputs(T, S, positions, kv_len)
  got = jax.jit(functools.partial(EMU.attend, causal=causal))(q, k, v, q_pos=q_pos, k_start=k_start, kv_len=kvl)
  want = oracle(q, k, v, visibility(o_pos, o_start, o_len, S, causal))
  check(got, want, tol_out=2e-2)


@slow
def _poison(monkeypatch, *names):
  """Make the jnp reference functions `names` return NaN: a result that is finite never ran them (both branches
  of a lax.cond are traced, so only the values tell which one ran)."""
  for name in names:
    real = getattr(ref, name)

    def nan(*a, _real=real, **kw):
      out, lse = _real(*a, **kw)
      return jnp.full_like(out, jnp.nan), jnp.full_like(lse, jnp.nan)
    monkeypatch.setattr(ref, name, nan)


def test_cudnn_decomposition_noncontiguous_rows_go_to_reference(monkeypatch):
  q, k, v = rand_qkv(3, 2, 8, 24, 4, 2, 16)
  q_pos = jnp.array([[0, 2, 4, 6, 8, 10, 12, 14], [20, 3, 7, 1, 0, 5, 9, 23]], jnp.int32)
  attend = lambda: jax.jit(functools.partial(EMU.attend, causal=True))(q, k, v, q_pos=q_pos,
                                                                        k_start=jnp.zeros(2, jnp.int32))
  got = attend()
  check(got, oracle(q, k, v, visibility(q_pos, np.zeros(2, int), np.full(2, 24), 24, True)), tol_out=2e-2)
  _poison(monkeypatch, "attention_reference")
  routed = attend()                                            # traced again: a new jit of a new partial
  assert np.isnan(np.asarray(routed[0])).all()                 # the reference served them


def test_cudnn_decomposition_contiguous_rows_never_touch_the_reference(monkeypatch):
  q, k, v = rand_qkv(4, 2, 8, 24, 4, 2, 16)
  q_pos = jnp.array([[5, 6, 7, 8, 9, 10, 11, 12], [16, 17, 18, 19, 20, 21, 22, 23]], jnp.int32)
  _poison(monkeypatch, "attention_reference", "paged_attention_reference")
  got = EMU.attend(q, k, v, q_pos=q_pos, k_start=jnp.zeros(2, jnp.int32), causal=True)
  check(got, oracle(q, k, v, visibility(q_pos, np.zeros(2, int), np.full(2, 24), 24, True)), tol_out=2e-2)


@pytest.mark.parametrize("T,P,pos_shift", [pytest.param(1, 12, 0, marks=slow), (1, 12, -9), (5, 12, 0),
                                           (5, 13, 0), pytest.param(6, 12, "past", marks=slow)],
                         ids=["decode", "decode-causal-bound", "chunk-split", "chunk-gather-pool", "chunk-past"])
def test_cudnn_paged_decomposition_emulated(T, P, pos_shift):
  B, N, K, H, Z, M = 2, 8, 2, 16, 8, 6
  q, kp, vp, table, _, _, kd, vd = rand_pages(T + P, B, T, N, K, H, Z, M, P)
  kv_len = jnp.array([41, 12], jnp.int32)
  if pos_shift == "past":
    q_pos = last_rows(kv_len, T, T)                                      # a chunk attending to its cached prefix
  else:
    q_pos = last_rows(kv_len, T, pos_shift)
  got = jax.jit(EMU.paged)(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)


def test_cudnn_paged_case_ignores_row_order_for_a_cached_prefix():
  """A chunk against its cached prefix takes cuDNN's padding-only call in any row order (the sequence-sharded
  prefill gathers its queries in zigzag order); rows seeing part of the pages need contiguity."""
  kvl = jnp.array([64, 40], jnp.int32)
  zigzag = np.array([[64, 65, 70, 71, 66, 67, 68, 69]] * 2, np.int32)
  case = jax.jit(cudnn.paged_case)
  assert int(case(zigzag, kvl)) == cudnn.PAGED_PAST
  assert int(case(zigzag - 4, kvl)) == cudnn.PAGED_REFERENCE                  # rows 60.. see part of the keys
  assert int(case(np.sort(zigzag - 4, axis=1), kvl)) == cudnn.PAGED_SPLIT
  B, T, N, K, H, Z, M, P = 2, 8, 8, 2, 16, 8, 12, 26
  q, kp, vp, table, _, _, kd, vd = rand_pages(3, B, T, N, K, H, Z, M, P)
  got = jax.jit(EMU.paged)(q, kp, vp, table, q_pos=zigzag, kv_len=kvl)
  check(got, oracle(q, kd, vd, visibility(zigzag, np.zeros(B, int), kvl, M * Z, True)), tol_out=2e-2)


@pytest.mark.parametrize("T,past,block", [pytest.param(1, False, None, marks=slow), (5, False, None),
                                          (5, True, None), (5, False, 24), (5, True, 24)],
                         ids=["decode-reference", "chunk-dequantized-split", "chunk-dequantized-past",
                              "chunk-blocks-split", "chunk-blocks-past"])
def test_cudnn_paged_fp8(T, past, block):
  # T == 1 goes to the reference; a chunk runs the bf16 path over its pages dequantized into a compact pool,
  # `block` keys at a time (24: 3 pages of 8, two blocks over the 4-page table, the second one padded and seen
  # by one sequence only).
  B, N, K, H, Z, M, P = 2, 4, 2, 16, 8, 4, 10
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(5 + T, B, T, N, K, H, Z, M, P, fp8=True)
  kv_len = jnp.array([30, 7], jnp.int32)
  q_pos = last_rows(kv_len, T, T if past else 0)
  be = EMU if block is None else cudnn.CudnnBackend(emulate=True, fp8_block_tokens=block)
  got = jax.jit(be.paged)(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len, k_scale=ks, v_scale=vs)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)


@pytest.mark.parametrize("name", ["reference", "dense", "cudnn", "pallas"])
def test_paged_page_offset(name):
  """page_offset=o reads page table[b, m] + o: the pools with o junk pages in front give the oracle's answer."""
  B, T, N, K, H, Z, M, P, off = 2, 1, 8, 2, 32, 16, 4, 10, 7
  q, kp, vp, table, _, _, kd, vd = rand_pages(11, B, T, N, K, H, Z, M, P)
  junk = functools.partial(behind_junk, n=off, value=50.0)
  kv_len = jnp.array([50, 21], jnp.int32)
  q_pos = last_rows(kv_len, 1)
  be = {"reference": backends.ReferenceBackend(), "dense": backends.DenseBackend(), "cudnn": EMU,
        "pallas": pallas_backend.PallasBackend(interpret=True)}[name]
  got = jax.jit(functools.partial(be.paged, page_offset=off))(q, junk(kp), junk(vp), table, q_pos=q_pos,
                                                                kv_len=kv_len)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)


@pytest.mark.parametrize("longest", [0, 15, 16, 17, 64])
def test_paged_reference_reads_up_to_the_longest_kv_len(longest):
  """The reference's block loop stops after the block holding the longest kv_len's last key, cutting none: at and
  around a block boundary (blocks of one page, 16 keys), an empty and a full table; pages in the table past the
  longest kv_len hold NaN, which any read of them would spread into the output."""
  B, T, N, K, H, Z, M, P = 2, 1, 8, 2, 32, 16, 4, 10
  q, kp, vp, table, _, _, kd, vd = rand_pages(13, B, T, N, K, H, Z, M, P, dtype=jnp.float32)
  kv_len = jnp.array([longest, longest // 2], jnp.int32)
  past = np.asarray(table)[:, -(-max(longest, 1) // Z):].reshape(-1) if longest < M * Z else []
  kp, vp = (np.array(x) for x in (kp, vp))
  kp[past], vp[past] = np.nan, np.nan
  kp, vp = jnp.asarray(kp), jnp.asarray(vp)
  q_pos = jnp.maximum(last_rows(kv_len, 1), 0)
  got = backends.ReferenceBackend(pages_per_block=1).paged(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len)
  if longest == 0:
    assert np.all(np.asarray(got[0]) == 0) and np.all(np.isneginf(np.asarray(got[1])))
    return
  kd, vd = np.nan_to_num(kd), np.nan_to_num(vd)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=1e-4)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", ["reference", "dense"])
def test_paged_reads_one_layer_of_the_layer_pools(name, fp8):
  """paged(..., layer=l) over pools of every layer [L, P, Z, K, H] (scales [L, P, K]) reads layer l's pages: the
  other layers, filled with values no key holds, do not change the oracle's answer."""
  B, T, N, K, H, Z, M, P = 2, 3, 8, 2, 32, 16, 4, 10
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(12, B, T, N, K, H, Z, M, P, fp8=fp8)
  kv_len = jnp.array([50, 21], jnp.int32)
  q_pos = last_rows(kv_len, T)
  be = {"reference": backends.ReferenceBackend(), "dense": backends.DenseBackend()}[name]
  assert be.reads_layer_pools

  def layers(x, fill):        # layer 1 holds x, layers 0 and 2 hold `fill`
    x = np.asarray(x)
    junk = np.full(x.shape, fill, x.dtype)
    return jnp.asarray(np.stack([junk, x, junk]))

  scales = {} if ks is None else dict(k_scale=layers(ks, 4.0), v_scale=layers(vs, 4.0))
  got = jax.jit(be.paged)(q, layers(kp, 50.0), layers(vp, -50.0), table, q_pos=q_pos, kv_len=kv_len,
                          layer=jnp.int32(1), **scales)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)


# ---------------------------------------------------------------- selection
def test_backend_registry_and_reasons():
  assert backends.get_backend("reference").name == "reference"
  be = pallas_backend.PallasBackend(interpret=True)
  assert be.why_not(head_dim=128, dtype="bfloat16") is None
  assert "head_dim" in be.why_not(head_dim=96, dtype="bfloat16")
  assert "float32" in be.why_not(head_dim=128, dtype="float32")
  assert "head_dim" in EMU.why_not(head_dim=260, dtype="bfloat16")
  assert "float32" in EMU.why_not(head_dim=128, dtype="float32")
  if not ON_GPU:
    assert backends.get_backend("auto").name == "reference"
    for name in ("cudnn", "pallas"):
      with pytest.raises(ValueError, match="GPU"):
        backends.get_backend(name)
  with pytest.raises(ValueError, match="not available"):
    backends.get_backend("nope")


def test_pallas_backend_routes_prefill_sized_paged_calls_to_cudnn(monkeypatch):
  B, T, N, K, H, Z, M, P = 2, 20, 8, 2, 16, 8, 6, 12          # T * G = 80 rows > max_rows
  q, kp, vp, table, _, _, kd, vd = rand_pages(11, B, T, N, K, H, Z, M, P)
  kv_len = jnp.array([47, 30], jnp.int32)
  q_pos = last_rows(kv_len, T)
  _poison(monkeypatch, "attention_reference", "paged_attention_reference")    # cuDNN (emulated) must serve it
  got = pallas_backend.PallasBackend(interpret=True).paged(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)


@pytest.mark.parametrize("pattern", ["split", "zigzag-past", "zigzag-partial", "unordered-partial", "mixed"])
def test_pallas_backend_prefill_route_mosaic(pattern, monkeypatch):
  """prefill_route="mosaic": a chunk's rows over the pages go to flash_attention_paged (here its jnp model, which
  masks by the kernel's diagonal offset d) with d = each sequence's first row position, which gives the oracle for
  contiguous rows and for rows in any order past every key, also when a batch holds both; rows in another order
  that see part of the keys (also when the first row is past them all) take the jnp reference. The backend
  refuses pages the kernel cannot read."""
  monkeypatch.setattr(hardware, "on_sm90", lambda: None)
  # lax.cond traces both branches: the one that must not run returns NaN, so only the other gives the oracle.
  to_reference = pattern in ("zigzag-partial", "unordered-partial")
  nan = lambda out: jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), out)
  real = ref.paged_attention_reference

  def model(q, kp, vp, table, d, kv_len, off):          # flash_attention_paged's mask: row i sees j <= d + i
    q_pos = d[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return real(q, kp, vp, table + off, q_pos=q_pos, kv_len=kv_len)

  monkeypatch.setattr(mgpu_flash, "flash_attention_paged",
                      lambda *a, **kw: (nan if to_reference else lambda o: o)(model(*a[:7])))
  monkeypatch.setattr(ref, "paged_attention_reference",
                      lambda *a, **kw: (lambda o: o if to_reference else nan(o))(real(*a, **kw)))
  B, T, N, K, H, Z, M, P = 2, 8, 64, 2, 64, 16, 12, 30            # T * G = 256 rows: a chunk, not a decode
  q, kp, vp, table, _, _, kd, vd = rand_pages(5, B, T, N, K, H, Z, M, P)
  zigzag = np.array([[64, 65, 70, 71, 66, 67, 68, 69]] * 2)
  q_pos, kv_len = {"split": (np.array([[40], [100]]) + np.arange(T)[None], [48, 104]),
                   "zigzag-past": (zigzag, [64, 40]),
                   "zigzag-partial": (zigzag - 4, [64, 40]),
                   # the first row (66) is past every key, the second (64) is not: key 65 is after it
                   "unordered-partial": ([[66, 64, 65, 67, 68, 69, 70, 71]] * 2, [66, 40]),
                   "mixed": (np.stack([zigzag[0], 30 + np.arange(T)]), [64, 35])}[pattern]
  q_pos, kv_len = jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_len, jnp.int32)
  be = pallas_backend.PallasBackend(prefill_route="mosaic")
  got = be.paged(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2)
  with pytest.raises(ValueError, match="prefill_kernel='mosaic' cannot read these pages: .*page_size=12"):
    be.paged(q, kp[:, :12], vp[:, :12], table, q_pos=q_pos, kv_len=kv_len)
  with pytest.raises(ValueError, match=r"reads pages in the queries' dtype \(bfloat16\), not float32"):
    be.paged(q, kp.astype(jnp.float32), vp.astype(jnp.float32), table, q_pos=q_pos, kv_len=kv_len)


@pytest.mark.parametrize("H,dtype,causal,save_lse", [(128, jnp.bfloat16, True, True), (64, jnp.float16, False, False)])
def test_flash_kernel_lowers_for_cuda(H, dtype, causal, save_lse):
  """The Mosaic GPU kernel traces and lowers to its CUDA custom call without a GPU (catches API drift)."""
  sd = lambda s: jax.ShapeDtypeStruct(s, dtype)
  f = jax.jit(functools.partial(mgpu_flash.flash_attention, causal=causal, save_lse=save_lse))
  lowered = f.trace(sd((1, 256, 8, H)), sd((1, 384, 2, H)), sd((1, 384, 2, H))).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_key_splits_end_the_grid_in_fewer_waves():
  """kv_splits_for on 132 SMs over a 128K-key prefix (1,024 blocks), Llama-3-8B's 32 query heads: a question of
  5 tiles (640 rows, 160 CTAs: two waves of whole ranges) or 10 tiles (320 CTAs: three) is split; 8 tiles (256
  CTAs, 1.94 waves) and a 16K-row chunk (4,096 CTAs) are not; nor are keys too few to pay for the merge."""
  pick = functools.partial(mgpu_flash.kv_splits_for, sms=132)
  assert pick(32 * 5, 1024) == 4
  assert pick(32 * 10, 1024) > 1
  assert pick(32 * 8, 1024) == 1
  assert pick(32 * 128, 1024) == 1
  assert pick(32 * 5, 1) == 1
  assert pick(32, 1) == pick(8, 1) == 1 and pick(32, 2) <= 2          # no more splits than key blocks
  for ctas, blocks in itertools.product([1, 32, 100, 160, 256, 320, 640], [1, 8, 64, 1024, 8192]):
    s = pick(ctas, blocks)
    assert 1 <= s <= mgpu_flash.MAX_KV_SPLITS
    waves = lambda s: -(-ctas * s // 132) * (blocks / s + 2)
    assert waves(s) <= waves(1)
  with pytest.raises(ValueError, match="kv_splits=9 must be None"):
    mgpu_flash.FlashTuning(kv_splits=9)


def test_flash_schedule_loads_what_its_warpgroups_compute():
  """The flash kernel's schedule (mgpu_flash.cta_blocks, warpgroup_blocks: the functions the kernel calls on its
  scalars), vectorised over tiles, diagonal offsets, kv_len and q_len, causal or not, 1 to 8 key splits, against
  each row's visible keys counted here: a warpgroup computes [lo, full) unmasked and [full, total) masked inside its
  CTA's loads [lo, hi); over the splits it computes each block once, a prefix of blocks that holds every key a real
  row of it sees and no block none of its rows sees (none if all its rows are padding); an unmasked block is seen
  whole by each of its rows; every block a CTA loads is computed by one of its warpgroups (no TMA load left
  unwaited)."""
  bq, NB = 64, 20
  cases = np.array(list(itertools.product((0, 128, 256), (0, 37, 200, 511), (0, 1, 100, 129, 640, 1000),
                                          (0, 30, 64, 100, 128, 150, 200, 10 ** 6))), np.int32)
  tb, d, kvl, ql = cases.T
  blocks = np.arange(NB)[None, :]
  for bkv, causal, splits, padded in itertools.product((64, 128), (True, False), (1, 2, 3, 8), (True, False)):
    q_len = ql if padded else None
    rows = tb[:, None] + np.arange(2 * bq)[None, :]
    sees = np.maximum(np.minimum(kvl[:, None], rows + d[:, None] + 1), 0) if causal else np.repeat(
        kvl[:, None], 2 * bq, axis=1)                                              # keys [0, sees) per row
    real = rows < (ql[:, None] if padded else np.iinfo(np.int32).max)
    computed = np.zeros((2, len(cases), NB), int)
    for s in range(splits):
      lo, hi = (np.broadcast_to(x, tb.shape) for x in mgpu_flash.cta_blocks(tb, d, kvl, q_len, s, bq=bq, bkv=bkv,
                                                                             causal=causal, splits=splits))
      tops = []
      for w in range(2):
        full, total = (np.asarray(x) for x in mgpu_flash.warpgroup_blocks(tb + w * bq, d, kvl, q_len, lo, hi,
                                                                           bq=bq, bkv=bkv, causal=causal))
        assert (lo <= full).all() and (full <= total).all() and (total <= hi).all()
        wg_sees = sees[:, w * bq:(w + 1) * bq]
        assert ((full <= lo) | (full * bkv <= wg_sees.min(axis=1))).all()      # unmasked: whole for every row
        computed[w] += (blocks >= lo[:, None]) & (blocks < total[:, None])
        tops.append(total)
      assert (np.maximum(*tops) == hi).all(), (bkv, causal, splits, padded)       # every loaded block computed
    for w in range(2):
      wr = slice(w * bq, (w + 1) * bq)
      need_real = -(-np.where(real[:, wr], sees[:, wr], 0).max(axis=1) // bkv)
      need_any = -(-sees[:, wr].max(axis=1) // bkv) * real[:, wr].any(axis=1)
      n = computed[w].sum(axis=1)
      assert computed[w].max() <= 1 and (computed[w] == (blocks < n[:, None])).all()
      assert (need_real <= n).all() and (n <= need_any).all(), (bkv, causal, splits, padded, w)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_merge_splits_is_attention_over_every_key(splits):
  """merge_splits of partials over disjoint key ranges (the jnp reference over each range, lse -inf where a row
  saw none of it, one range empty) == the float64 oracle over all keys."""
  B, T, S, N, K, H = 2, 16, 80, 4, 2, 32
  q, k, v = rand_qkv(5, B, T, S, N, K, H, jnp.float32)
  kv_len = np.array([S, 37])
  q_pos = jnp.asarray(np.array([S - T, 30])[:, None] + np.arange(T)[None, :], jnp.int32)
  cuts = np.linspace(0, S, splits + 1).astype(int) if splits < 5 else np.array([0, 10, 10, 40, 41, S])
  outs, lses = [], []
  partial = jax.jit(ref.attention_reference)
  for lo, hi in zip(cuts[:-1], cuts[1:]):
    if lo == hi:                                                  # a split with no keys, as the kernel writes it
      outs.append(np.zeros(q.shape, np.float32))
      lses.append(np.full((B, N, T), -np.inf, np.float32))
      continue
    o, lse = partial(q, k[:, lo:hi], v[:, lo:hi], q_pos=q_pos, k_start=jnp.full((B,), lo, jnp.int32),
                     kv_len=jnp.asarray(np.clip(kv_len - lo, 0, hi - lo), jnp.int32))
    outs.append(np.asarray(o))
    lses.append(np.swapaxes(np.asarray(lse), 1, 2))
  out, lse = jax.jit(mgpu_flash.merge_splits)(jnp.asarray(np.stack(outs)), jnp.asarray(np.stack(lses)))
  check((out, np.swapaxes(np.asarray(lse), 1, 2)), oracle(q, k, v, visibility(q_pos, np.zeros(B, int), kv_len, S,
                                                                                True)),
        tol_out=1e-5, tol_lse=1e-5)


# ---------------------------------------------------------------- GPU: the real kernels
# Every mask case in bf16 at head dim 128; fp16 at head dim 64 on two of them.
GPU_ATTEND = ([(*c, 128, jnp.bfloat16) for c in ATTEND_CASES]
              + [(*c, 64, jnp.float16) for c in ATTEND_CASES if c[0] in ("noncausal-ragged", "dyn-split")])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
@pytest.mark.parametrize("name,T,S,N,K,causal,positions,kv_len,H,dtype", GPU_ATTEND,
                         ids=[f"{c[0]}-H{c[-2]}" for c in GPU_ATTEND])
def test_attend_gpu(backend, name, T, S, N, K, causal, positions, kv_len, H, dtype):
  # Blocks bigger than one kernel tile, with the same shape of masks as the CPU cases.
  f = 8
  T, S = T * f, S * f
  positions = None if positions is None else tuple(p * f for p in positions)
  kv_len = None if kv_len is None else tuple(n * f for n in kv_len)
  q, k, v = rand_qkv(T + S + H, 2, T, S, N, K, H, dtype)
  q_pos, k_start, kvl, (o_pos, o_start, o_len) = _attend_inputs(T, S, positions, kv_len)
  be = backends.get_backend(backend, head_dim=H, dtype=dtype)
  got = jax.jit(functools.partial(be.attend, causal=causal))(q, k, v, q_pos=q_pos, k_start=k_start, kv_len=kvl)
  check(got, oracle(q, k, v, visibility(o_pos, o_start, o_len, S, causal)), tol_out=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
@pytest.mark.parametrize("T,fp8", [(1, False), (2, False), (1, True), (64, False), (64, True)])
@pytest.mark.parametrize("Z", [64, 256])
def test_paged_gpu(backend, T, fp8, Z):
  B, N, K, H, P = 4, 32, 8, 128, 100
  M = 24 * 64 // Z                                                             # 1536 keys per sequence
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(T + 100 * fp8, B, T, N, K, H, Z, M, P, fp8=fp8)
  kv_len = jnp.array([M * Z, 1000, T + 1, 0 if T == 1 else T], jnp.int32)     # T == 1: one empty row
  q_pos = jnp.maximum(kv_len[:, None] - T, 0) + jnp.arange(T, dtype=jnp.int32)[None, :]
  be = backends.get_backend(backend)
  got = jax.jit(be.paged)(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len, k_scale=ks, v_scale=vs)
  # An fp8 chunk runs on its pages dequantized to bf16 (scale * fp8 rounded to 8 bits of mantissa): lse rel err
  # 3.708e-3 on the H200 against the float64 oracle of the exact products, and the same 3.708e-3 from
  # the CPU emulation of cuDNN on the same bf16 pages: the rounding, not the kernel.
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2,
        tol_lse=6e-3 if fp8 and T > 1 else 2e-3)


@pytest.mark.parametrize("block_kv", [128, 256])
def test_paged_flash_block_copies_load_each_blocks_keys(block_kv):
  """The paged flash kernel's TMA copies (mgpu_flash.block_copies, as its load warpgroup issues them, block index
  traced) put key i * block_kv + r of the sequence at row r of the block's slot, for every block over the table's
  M * Z keys; rows past the table hold keys of its last page (kv_len masks them). Page slot m row t is key
  m * Z + t. Pages of 8 to 512 keys, tables of 1, 3, 12 and 13 slots."""
  for Z, M in itertools.product([8, 16, 64, 128, 256, 512], [1, 3, 12, 13]):
    _check_block_copies(block_kv, Z, M)


def _check_block_copies(block_kv, Z, M):
  S = M * Z
  for i in range(-(-S // block_kv)):
    got = np.full(block_kv, -1)
    copies = mgpu_flash.block_copies(jnp.int32(i), block_kv, Z, M)      # as the kernel calls it: i traced
    for m, first, rows, at in copies:
      assert type(rows) is int and type(at) is int                     # the kernel slices the slot with them
      assert rows < block_kv or (len(copies) == 1 and at == 0)          # a whole slot is one copy at row 0
      m, first = int(m), int(first)
      assert 0 <= m < M and 0 <= first and first + rows <= Z and 0 <= at and at + rows <= block_kv
      got[at:at + rows] = m * Z + first + np.arange(rows)
    assert sum(rows for _, _, rows, _ in copies) == block_kv
    want = i * block_kv + np.arange(block_kv)
    inside = want < S
    np.testing.assert_array_equal(got[inside], want[inside])
    assert (got[~inside] >= (M - 1) * Z).all()                  # the last page, repeated


def _check_paged_flash(fn, T, Z, N=32, K=8):
  """fn (flash_attention_paged's signature) == the float64 oracle, pages scattered out of order at an offset into
  the pools, a table of M * Z keys that is not a whole number of 128-key blocks for Z < 128. Sequences: the
  engine's shape (a chunk after its whole cached prefix, d = kv_len) at two lengths, a chunk whose own keys are in
  the pages (causal) after a full table, after a prefix ending inside a block, alone, and with kv_len past the
  table (clipped)."""
  B, H = 6, 128
  M = 2048 // Z + 1
  off = 3
  q, kp, vp, table, _, _, kd, vd = rand_pages(T + Z, B, T, N, K, H, Z, M, B * M + 4)
  junk = functools.partial(behind_junk, n=off, value=30.0)
  kv_len = np.array([M * Z, 1000 + T, T, M * Z + 100, 777, M * Z])
  d = np.minimum(kv_len, M * Z) - T
  d[4], d[5] = 777, M * Z                                  # the engine's shape: rows after every cached key
  got = fn(q, junk(kp), junk(vp), table, jnp.asarray(d, jnp.int32), jnp.asarray(kv_len, jnp.int32), off)
  q_pos = d[:, None] + np.arange(T)[None, :]
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), np.minimum(kv_len, M * Z), M * Z, True)),
        tol_out=2e-2)


def test_paged_flash_reference():
  """flash_attention_paged's jnp oracle (its (d, kv_len) contract over the pages) on the cases of its GPU test: the
  cases say what they mean, so a GPU failure is the kernel's."""
  _check_paged_flash(jax.jit(mgpu_flash.flash_attention_paged_reference, static_argnums=6), 200, 16, N=4, K=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("T,Z", [(128, 16), (128, 64), (128, 256), (1000, 16), (1000, 64), (1000, 128), (1000, 256)])
def test_paged_flash_gpu(T, Z):
  """mgpu_flash.flash_attention_paged (the flash kernel reading K and V from their pages, a block of 128 keys as
  128 / Z TMA copies or a part of one page): `_check_paged_flash`'s cases. 1,000-row chunks at 8 query heads over
  2 kv heads: the float64 oracle at 32 heads takes minutes on the host."""
  _check_paged_flash(mgpu_flash.flash_attention_paged, T, Z, *((8, 2) if T > 128 else ()))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("kv_splits", [1, 3, 8])
@pytest.mark.parametrize("T,Z", [(128, 64), (1000, 128)])
def test_paged_flash_key_splits_gpu(T, Z, kv_splits):
  """The paged flash kernel with each tile's keys cut into kv_splits CTAs (ranges ending inside a page, empty
  ranges where kv_len is short): `_check_paged_flash`'s cases against the float64 oracle."""
  tuning = mgpu_flash.FlashTuning(kv_splits=kv_splits)
  _check_paged_flash(functools.partial(mgpu_flash.flash_attention_paged, tuning=tuning), T, Z,
                     *((8, 2) if T > 128 else ()))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kv_splits", [1, 3])
def test_flash_leaves_out_padding_rows_gpu(fp8, kv_splits):
  """q_len (the real rows of a padded chunk): the 64-row warpgroup tiles wholly past it hold out 0 and lse -inf, the
  real rows are the float64 oracle's (bf16 pages) or the FP8 kernel's jnp model's, and where q_len leaves the CTA's
  blocks and Q's fp8 block scales as they were, bit for bit what the kernel gives without q_len. Sequences: the engine's prefix read (rows after every key) with q_len
  inside a warpgroup's tile, on the boundary of a CTA's two tiles (the first computes, the second only releases
  the blocks), 0 and T; and a chunk whose own keys are in the pages (causal, d < kv_len) whose CTA's second
  warpgroup is padding: it needs more blocks than the first, which the CTA must then not load."""
  B, T, N, K, H, Z, M = 5, 384, 8, 2, 128, 64, 33
  q, kp, vp, table, _, _, kd, vd = rand_pages(31, B, T, N, K, H, Z, M, B * M + 4)
  kv_len = jnp.array([M * Z, 1500, 2000, 700, 1150], jnp.int32)
  d = kv_len.at[4].set(1000)
  q_len = jnp.array([100, 192, 0, T, 150], jnp.int32)
  if fp8:
    tuning = dataclasses.replace(mgpu_flash.FP8_TUNING, kv_splits=kv_splits)
    kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (kd, vd))
    run = lambda n: mgpu_flash.flash_attention_fp8(q, kb, vb, d, kv_len, n, causal=False, tuning=tuning)
  else:
    tuning = mgpu_flash.FlashTuning(kv_splits=kv_splits)
    run = lambda n: mgpu_flash.flash_attention_paged(q, kp, vp, table, d, kv_len, 0, n, tuning=tuning)
  (out, lse), (full_out, full_lse) = (tuple(np.asarray(x, np.float64) for x in run(n)) for n in (q_len, None))
  real = np.arange(T)[None, :] < np.asarray(q_len)[:, None]
  if fp8:
    # Q's fp8 scales are absmaxes over block_q rows, taken with the padding rows zeroed: only blocks without padding
    # keep their scales, and with them their bits. Every real row against the kernel's jnp model on the same q_len.
    bq = tuning.block_q
    same = real & ((np.arange(T)[None, :] // bq) < (np.asarray(q_len)[:, None] // bq))
    m_out, _ = mgpu_flash.flash_attention_fp8(q, kb, vb, d, kv_len, q_len, causal=False, tuning=tuning, interpret=True)
    diff = np.abs(out[real] - np.asarray(m_out, np.float64)[real])
    assert diff.max() < 0.1 and diff.mean() < 2e-3, (diff.max(), diff.mean())
  else:
    same = real & ((np.asarray(d) == np.asarray(kv_len)) | (kv_splits == 1))[:, None]
  np.testing.assert_array_equal(out[same], full_out[same])
  # FP8: the lse is the kernel's plus q . mean(K) of the smoothing, which XLA adds outside the kernel, in a program
  # that differs with q_len: within the last bit of float32 there (32 of 6,144 values, 1.2e-7 relative, H100).
  np.testing.assert_allclose(lse[same], full_lse[same], rtol=3e-7 if fp8 else 0, atol=1e-6 if fp8 else 0)
  skipped = np.arange(T)[None, :] >= -(-np.asarray(q_len)[:, None] // 64) * 64
  assert skipped.sum() == (T - 128) + (T - 192) + T + (T - 192)
  assert (out[skipped] == 0).all() and np.isneginf(lse[skipped]).all()
  if not fp8:
    q_pos = d[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    w_out, w_lse = oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True))
    err = np.linalg.norm(out[real] - w_out[real]) / np.linalg.norm(w_out[real])
    assert err < 2e-2, err
    np.testing.assert_allclose(lse[real], w_lse[real], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("kv_splits", [1, 2, 7])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_key_splits_gpu(kv_splits, causal):
  """The flash kernel on contiguous keys with kv_splits CTAs a tile: rows after a prefix (d > 0), kv_len inside a
  block and a sequence with no key, against the float64 oracle."""
  B, T, S, N, K, H = 3, 256, 2000, 8, 2, 128
  q, k, v = rand_qkv(11, B, T, S, N, K, H)
  d = jnp.array([S - T, 900, 0], jnp.int32)
  kv_len = jnp.array([S, 1000, 0], jnp.int32)
  tuning = mgpu_flash.FlashTuning(kv_splits=kv_splits)
  got = mgpu_flash.flash_attention(q, k, v, d, kv_len, causal=causal, tuning=tuning)
  q_pos = d[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  check(got, oracle(q, k, v, visibility(q_pos, np.zeros(B, int), kv_len, S, causal)), tol_out=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("past", [True, False], ids=["past", "split"])
def test_paged_gpu_fp8_blocks(past):
  """An fp8 chunk's prefix read by the real cuDNN in blocks of 512 keys (3 blocks over 1536, one sequence
  reaching only the first) == the float64 oracle, within the bf16 rounding of the dequantized pages."""
  B, T, N, K, H, Z, M, P = 4, 64, 32, 8, 128, 64, 24, 100
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(7, B, T, N, K, H, Z, M, P, fp8=True)
  kv_len = jnp.array([M * Z, 1000, 300, T], jnp.int32)
  q_pos = kv_len[:, None] - (0 if past else T) + jnp.arange(T, dtype=jnp.int32)[None, :]
  be = cudnn.CudnnBackend(fp8_block_tokens=512)
  got = jax.jit(be.paged)(q, kp, vp, table, q_pos=q_pos, kv_len=kv_len, k_scale=ks, v_scale=vs)
  check(got, oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True)), tol_out=2e-2,
        tol_lse=6e-3)


def test_static_routes_to_the_reference_are_announced_on_a_gpu(monkeypatch, caplog):
  """A route to the jnp reference decided by shapes or dtypes logs one line with its reason when the call is
  traced on a GPU (here: a decode row over fp8 pages through the cuDNN backend); on a CPU it stays quiet."""
  B, T, N, K, H, Z, M, P = 1, 1, 4, 2, 16, 8, 4, 8
  q, kp8, vp8, table, ks, vs, _, _ = rand_pages(5, B, T, N, K, H, Z, M, P, fp8=True)
  # A new partial each call: jit traces it again, under whichever backend jax.default_backend names then.
  call = lambda: jax.jit(functools.partial(EMU.paged))(q, kp8, vp8, table, q_pos=jnp.array([[10]], jnp.int32),
                                                        kv_len=jnp.array([11], jnp.int32), k_scale=ks, v_scale=vs)
  with caplog.at_level("WARNING"):
    call()
  assert "jnp reference" not in caplog.text
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with caplog.at_level("WARNING"):
    call()
  assert "attention backend cudnn runs this call through the jnp reference (slow): a decode row over fp8 pages" \
      in caplog.text


def _flash_in_jnp(q, k, v, d, kv_len=None, *, causal=True, tuning=None, _reference=ref.attention_dense):
  """The Mosaic GPU flash kernel's contract in jnp (no CPU interpreter runs the kernel): its stand-in here, through
  the dense baseline so that a poisoned blockwise reference does not reach it."""
  q_pos = d[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
  return _reference(q, k, v, q_pos=q_pos, kv_len=kv_len, causal=causal)


@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
def test_routes_to_the_reference_decided_at_run_time_are_announced(backend, monkeypatch, caplog):
  """Blocks sent to the reference by a lax.cond on their positions log one line with the reason when that branch
  runs on a GPU (the reference poisoned to NaN tells which branch ran), once per reason per process; blocks the
  kernel serves log nothing, and a CPU adds no callback at all."""
  B, T, S, N, K, H = 2, 8, 24, 4, 2, 16
  q, k, v = rand_qkv(6, B, T, S, N, K, H)
  k_start = jnp.zeros(B, jnp.int32)
  rows = {"contiguous": jnp.array([[5 + t for t in range(T)], [16 + t for t in range(T)]], jnp.int32),
          "noncontiguous": jnp.array([[0, 2, 4, 6, 8, 10, 12, 14], [16 + t for t in range(T)]], jnp.int32),
          "before-first-key": jnp.array([[t - 3 for t in range(T)], [16 + t for t in range(T)]], jnp.int32)}
  monkeypatch.setattr(mgpu_flash, "flash_attention", _flash_in_jnp)
  be = EMU if backend == "cudnn" else pallas_backend.PallasBackend(interpret=True)
  _poison(monkeypatch, "attention_reference")

  def run(name):
    caplog.clear()
    with caplog.at_level("WARNING"):
      out = f(q, k, v, q_pos=rows[name], k_start=k_start)
      jax.block_until_ready(out)
      jax.effects_barrier()
    lines = [r.getMessage() for r in caplog.records if "jnp reference" in r.getMessage()]
    return bool(np.isnan(np.asarray(out[0])).any()), lines

  f = jax.jit(functools.partial(be.attend, causal=True))
  assert run("noncontiguous") == (True, [])                     # CPU: the reference runs, nothing to announce
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(ref, "_announced", set())
  f = jax.jit(functools.partial(be.attend, causal=True))        # traced again, "on a GPU"
  assert run("contiguous") == (False, [])
  head = f"attention backend {backend} ran a call through the jnp reference (slow), decided by the positions at " \
         "run time: "
  assert run("noncontiguous") == (True, [head + ref.NONCONTIGUOUS_ROWS])
  assert run("noncontiguous") == (True, [])                     # once per reason per process
  assert run("before-first-key") == (True, [head + ref.ROWS_BEFORE_FIRST_KEY])
  assert run("contiguous") == (False, [])


def test_paged_routes_to_the_reference_decided_at_run_time_are_announced(monkeypatch, caplog):
  """cuDNN's paged chunk: non-contiguous rows that see part of the pages run the reference and say why."""
  B, T, N, K, H, Z, M, P = 2, 4, 4, 2, 16, 8, 4, 10
  q, kp, vp, table, _, _, _, _ = rand_pages(8, B, T, N, K, H, Z, M, P)
  kv_len = jnp.array([20, 12], jnp.int32)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(ref, "_announced", set())
  f = jax.jit(EMU.paged)

  def lines(q_pos):
    caplog.clear()
    with caplog.at_level("WARNING"):
      jax.block_until_ready(f(q, kp, vp, table, q_pos=jnp.array(q_pos, jnp.int32), kv_len=kv_len))
      jax.effects_barrier()
    return [r.getMessage() for r in caplog.records if "jnp reference" in r.getMessage()]

  assert lines([[16, 17, 18, 19], [8, 9, 10, 11]]) == []
  assert lines([[16, 19, 17, 18], [8, 9, 10, 11]]) == [
      "attention backend cudnn ran a call through the jnp reference (slow), decided by the positions at run time: "
      + ref.NONCONTIGUOUS_ROWS]
