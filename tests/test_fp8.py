"""FP8 attention: quantization, the kernel's jnp model against independent oracles, backend selection, the engine
with attention_dtype=float8_e4m3fn and int8_fp8 (int8 Q K^T) against the bf16-path engine. GPU (`-m gpu`): the
kernel against its model (tight) and against float64 (loose)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from lcjax.config import ConfigError, ModelConfig, RunConfig
from lcjax.engine.engine import Engine
from lcjax.ops import attention as ref
from lcjax.ops import backends
from lcjax.ops import fp8
from lcjax.ops import pallas_backend
from lcjax.ops.mosaic_gpu import flash as mgpu_flash

ON_GPU = jax.default_backend() == "gpu"
E4M3_EPS = 2.0 ** -4        # half the spacing of e4m3's 3-bit mantissa, relative


def _normal(seed, *shape):
  """jax.random.normal(key(seed), shape, float32), read as the first prod(shape) of _NORMALS draws: the draws of a
  flat shape are a prefix of a longer one's (threefry counts them), so one program serves every shape."""
  n = math.prod(shape)
  assert n <= _NORMALS, (shape, _NORMALS)
  return jnp.asarray(np.asarray(_normals(seed))[:n].reshape(shape))


_NORMALS = 1 << 19                                              # B * S * K * H of the largest CPU case
_normals = jax.jit(lambda seed: jax.random.normal(jax.random.key(seed), (_NORMALS,), jnp.float32))
# The float32 jnp reference as one program per shape (eager, every operation is one).
_reference = jax.jit(ref.attention_reference, static_argnames=("causal",))
# The FP8 kernel's jnp model and its operands, jitted the same way.
_quantize_operands = jax.jit(fp8.quantize_operands, static_argnames=("block_q", "block_kv", "incoherent", "qk_dtype"))
_fp8_model = jax.jit(fp8.attention_fp8_model, static_argnames=("causal", "block_q", "block_kv"))


def test_round_to_e4m3_is_the_cast_on_every_value_tie_and_neighbour():
  """fp8.round_to_e4m3 against ml_dtypes' cast (numpy, not XLA): every e4m3 value up to 448, the midpoints between
  neighbours (ties go to the even one) and the float32 values just either side of each, plus random values."""
  import ml_dtypes
  e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  grid = np.unique(np.abs(e4m3[np.isfinite(e4m3)]))                         # 0 .. 448
  mids = (grid[:-1] + grid[1:]) / 2
  near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
  rand = np.exp(np.random.default_rng(0).uniform(np.log(1e-4), np.log(448), 20000)).astype(np.float32)
  x = np.concatenate([grid, mids, near, rand, [2.0 ** -10, 2.0 ** -11, 1e-30]]).astype(np.float32)
  x = np.concatenate([x, -x])
  want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(jax.jit(fp8.round_to_e4m3)(jnp.asarray(x)))
  bad = np.flatnonzero(got != want)
  assert bad.size == 0, f"{bad.size} values differ, e.g. x={x[bad[:4]]} got={got[bad[:4]]} want={want[bad[:4]]}"


def test_absmax_scale_is_the_floored_absmax_times_the_reciprocal_of_top():
  x = np.asarray(_normal(1, 3, 5, 7, 64)) * np.float32(1e3)
  x[1, :, 2, :] = 0.0                                                           # an all-zero block gets the floor
  for top in (fp8.E4M3_MAX, fp8.INT8_MAX, 41.0):
    got = np.asarray(fp8.absmax_scale(jnp.asarray(x), axes=(1, 3), top=top))
    want = np.maximum(np.abs(x).max(axis=(1, 3)), np.float32(1e-12)) * np.float32(1.0 / top)
    np.testing.assert_array_equal(got, want)
    assert got[1, 2] == np.float32(1e-12) * np.float32(1.0 / top)
    np.testing.assert_allclose(got, np.asarray(fp8.scale_for(np.abs(x).max(axis=(1, 3)), top)), rtol=2e-7)


def test_quantize_rows_scales_each_block_to_e4m3_range():
  x = _normal(0, 2, 256, 3, 128) * jnp.arange(1, 3 * 128 + 1, dtype=jnp.float32).reshape(3, 128)
  x = x.at[1, 70, 2, 5].set(1e4)                                     # an outlier: only its block's scale grows
  x8, s = fp8.quantize_rows(x, 64)
  assert x8.dtype == jnp.float8_e4m3fn and s.shape == (2, 3, 4)
  back = x8.astype(jnp.float32).reshape(2, 4, 64, 3, 128) * jnp.transpose(s, (0, 2, 1))[:, :, None, :, None]
  back = back.reshape(x.shape)
  amax = np.abs(np.asarray(x)).reshape(2, 4, 64, 3, 128).max(axis=(2, 4))
  np.testing.assert_allclose(np.asarray(s), np.transpose(amax, (0, 2, 1)) / 448.0, rtol=1e-6)
  assert float(jnp.max(jnp.abs(x8.astype(jnp.float32)))) == 448.0
  # Relative error of a normal e4m3 value, plus the subnormal floor (2^-9 of a scale) for tiny ones.
  floor = np.repeat(np.asarray(s), 64, axis=2).transpose(0, 2, 1)[..., None] * 2.0 ** -9
  assert np.all(np.abs(np.asarray(back - x)) <= E4M3_EPS * np.abs(np.asarray(x)) + floor)
  assert float(s[1, 2, 1]) > 5 * float(s[1, 2, 0])


def test_quantize_v():
  v = _normal(1, 2, 300, 2, 64)
  v8, s = fp8.quantize_v(v)
  assert v8.shape == (2, 300, 2, 64) and s.shape == (2, 2)
  back = v8.astype(jnp.float32) * s[:, None, :, None]
  assert float(jnp.max(jnp.abs(back - v) / (jnp.abs(v) + s[:, None, :, None] * 2.0 ** -6))) <= E4M3_EPS


def test_rotation_is_orthogonal_and_keeps_scores():
  r = np.asarray(fp8.rotation(128))
  np.testing.assert_allclose(r @ r.T, np.eye(128), atol=1e-6)
  q, k = _normal(2, 5, 128), _normal(3, 7, 128)
  np.testing.assert_allclose(fp8.rotate(q) @ fp8.rotate(k).T, q @ k.T, rtol=1e-4, atol=1e-4)
  qb = q.astype(jnp.bfloat16)
  got = fp8.rotate(qb)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), qb.astype(jnp.float32) @ fp8.rotation(128), rtol=2 ** -7,
                             atol=2 ** -7)
  with pytest.raises(ValueError, match="power-of-two"):
    fp8.rotation(96)


@pytest.mark.parametrize("qk_dtype", fp8.QK_DTYPES)
def test_model_single_block_equals_direct_formula(qk_dtype):
  """With one key block the running max is the row max: the model must equal the closed form of its arithmetic
  (e4m3(p * 2^8) @ v8 / l * vs), computed here without any blockwise loop; Q and K in e4m3 or int8."""
  B, T, S, N, K, H = 1, 64, 128, 4, 2, 128
  q, k, v = _normal(4, B, T, N, H), _normal(5, B, S, K, H), _normal(6, B, S, K, H)
  (q8, qs), (k8, ks), (v8, vs) = _quantize_operands(q, k, v, block_q=64, block_kv=128, incoherent=False,
                                                     qk_dtype=qk_dtype)
  assert q8.dtype == jnp.dtype(qk_dtype) and k8.dtype == jnp.dtype(qk_dtype)
  if qk_dtype == "int8":
    assert int(np.max(np.abs(np.asarray(q8).astype(np.int32)))) == 127
  d, kvl = jnp.array([S - T]), jnp.array([S])
  out, lse = _fp8_model(q8, qs, k8, ks, v8, vs, d, kvl, causal=True, block_q=64, block_kv=128)

  qf = np.asarray(q8).astype(np.float64) * np.asarray(qs)[0, None, :, 0, None]   # [B, T, N, H]
  kf = np.asarray(k8).astype(np.float64) * np.asarray(ks)[0, None, :, 0, None]
  x = np.einsum("btnh,bsnh->bnts", qf, np.repeat(kf, N // K, axis=2)) * math.log2(math.e) / math.sqrt(H)
  vis = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
  x = np.where(vis, x, -np.inf)
  m = x.max(-1, keepdims=True)
  p = np.exp2(x - m + fp8.P_SHIFT)
  p8 = p.astype(np.float32).astype(fp8.E4M3).astype(np.float64)                 # ml_dtypes' e4m3 (round to even)
  v8 = np.repeat(np.asarray(v8).astype(np.float64), N // K, axis=2)
  want = np.einsum("bnts,bsnh->btnh", p8, v8) / p.sum(-1).transpose(0, 2, 1)[..., None]
  want = want * np.repeat(np.asarray(vs), N // K, axis=1)[:, None, :, None]
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)
  want_lse = (m[..., 0] + np.log2(p.sum(-1)) - fp8.P_SHIFT) * math.log(2)
  np.testing.assert_allclose(np.asarray(lse), want_lse.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("incoherent", [False, True])
def test_fp8_attention_close_to_float32(incoherent):
  """Blockwise with masks: offsets, a short kv_len, GQA, ragged T and S (padded), against the float32 reference;
  a row that sees no key gives out 0 and lse -inf as the bf16 kernel does."""
  B, T, S, N, K, H = 2, 200, 330, 4, 2, 128
  q, k, v = _normal(7, B, T, N, H), _normal(8, B, S, K, H), _normal(9, B, S, K, H)
  d, kvl = jnp.array([S - T, -3]), jnp.array([S, 250])
  out, lse = mgpu_flash.flash_attention_fp8(q, k, v, d, kvl, incoherent=incoherent, interpret=True)
  rows = np.arange(T)
  q_pos = jnp.asarray(np.stack([rows + S - T, rows - 3]), jnp.int32)
  want_o, want_l = _reference(q, k, v, q_pos=q_pos, kv_len=kvl, causal=True)
  seen = np.isfinite(np.asarray(want_l))
  assert not seen[1, :3].any() and seen[1, 3:].all()
  np.testing.assert_array_equal(np.asarray(out)[1, :3], 0.0)
  assert np.all(np.asarray(lse)[~seen] == -np.inf)
  out, want_o = np.asarray(out), np.asarray(want_o)
  rmse = float(np.sqrt(np.mean((out - want_o) ** 2)))
  rms = float(np.sqrt(np.mean(want_o ** 2)))
  assert rmse < 0.06 * rms, (rmse, rms)
  assert float(np.max(np.abs(np.asarray(lse)[seen] - np.asarray(want_l)[seen]))) < 0.08


def test_smoothing_keys_keeps_attention_and_lowers_error():
  """Keys with a shared bias (trained models' keys have one): subtracting the keys' mean leaves the softmax as it
  is, the lse is shifted back exactly, and the quantization error falls because e4m3's error is relative to each
  key's magnitude. The mean covers the first kv_len keys only: the keys past it here are stale values far off the
  bias (as reused pages hold), which would move the mean."""
  B, T, S, N, K, H = 2, 256, 1024, 4, 2, 64
  q = 2.0 * _normal(15, B, T, N, H)
  k = _normal(16, B, S, K, H) + 3.0 * _normal(17, 1, 1, K, H)
  v = _normal(18, B, S, K, H)
  kvl = jnp.array([S, 700])
  k = jnp.where(jnp.arange(S)[None, :, None, None] < kvl[:, None, None, None], k, 8.0)
  want, want_lse = _reference(q, k, v, causal=False, kv_len=kvl)
  err = {}
  for smooth in (False, True):
    out, lse = mgpu_flash.flash_attention_fp8(q, k, v, None, kvl, causal=False, smooth_k=smooth, interpret=True)
    out, lse, want, want_lse = map(np.asarray, (out, lse, want, want_lse))
    err[smooth] = (float(np.sqrt(np.mean((out - want) ** 2) / np.mean(want ** 2))),
                   float(np.mean(np.abs(lse - want_lse))))
  assert err[True][0] < 0.6 * err[False][0] and err[True][1] < 0.3 * err[False][1], err
  assert err[True][0] < 0.1 and err[True][1] < 0.05, err


@pytest.mark.parametrize("qk_dtype", fp8.QK_DTYPES)
def test_keys_past_kv_len_change_nothing(qk_dtype):
  """Keys and values from kv_len on are seen by no row, so what they hold must not change the output: stale values
  1e5 times the visible ones (a reused page's previous owner) give the bits that zeros give, and the output stays
  within FP8's error of the float32 reference. K's block scales and V's per-head scale are absmaxes over the keys:
  taken over the stale ones too, they rounded every visible value of the head to a step 1e5 times too coarse."""
  B, T, S, N, K, H = 2, 64, 330, 4, 2, 64
  q, k, v = _normal(30, B, T, N, H), _normal(31, B, S, K, H), _normal(32, B, S, K, H)
  kvl = jnp.array([S, 200])
  past = jnp.arange(S)[None, :, None, None] >= kvl[:, None, None, None]
  run = lambda k, v: mgpu_flash.flash_attention_fp8(q, k, v, None, kvl, causal=False, qk_dtype=qk_dtype,
                                                    interpret=True)
  clean = run(jnp.where(past, 0.0, k), jnp.where(past, 0.0, v))
  stale = run(jnp.where(past, 1e5 * _normal(33, B, S, K, H), k), jnp.where(past, 1e5 * _normal(34, B, S, K, H), v))
  for got, want in zip(stale, clean):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  want, _ = _reference(q, k, v, causal=False, kv_len=kvl)
  got, want = np.asarray(stale[0]), np.asarray(want)
  rmse = float(np.sqrt(np.mean((got - want) ** 2)))
  assert rmse < 0.06 * float(np.sqrt(np.mean(want ** 2))), rmse


def test_a_nonfinite_key_reaches_every_row_that_sees_it():
  """One key holds NaN (fp8 pages hold an overflowed K so): the FP8 model and the jnp reference give NaN out and
  lse in every row that sees it, and the reference's rows causally before it stay finite. A NaN softmax sum read
  as 'no key seen' gave out 0 and lse -inf, which `merge` then drops: finite, wrong outputs."""
  B, T, S, N, K, H = 1, 256, 256, 2, 1, 64
  q, v = _normal(40, B, T, N, H), _normal(41, B, S, K, H)
  k = _normal(42, B, S, K, H).at[0, 200, 0, 3].set(jnp.nan)
  # Unsmoothed: the keys' mean would carry the NaN into every key before the softmax sees it.
  fp8_out = mgpu_flash.flash_attention_fp8(q, k, v, causal=False, smooth_k=False, interpret=True)
  ref_out = _reference(q, k, v, causal=False)
  for out, lse in (fp8_out, ref_out):
    assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all()
  out, lse = _reference(q, k, v, causal=True)
  assert np.isfinite(np.asarray(out[0, :200])).all() and np.isnan(np.asarray(out[0, 200:])).all()
  assert np.isnan(np.asarray(ref.merge(out, lse, jnp.zeros_like(out), jnp.zeros_like(lse))[0][0, 200:])).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("kernel", ["bf16", "fp8"])
def test_a_nonfinite_key_reaches_every_row_that_sees_it_gpu(kernel):
  """The Mosaic GPU flash kernels with one NaN key at position 200 (causal): rows 200 on are NaN in out and lse,
  the rows before its key block finite (FP8: the block's scale is NaN; without smoothing and rotation, which would
  spread the NaN over every key)."""
  B, T, S, N, K, H = 1, 256, 256, 2, 1, 64
  q, v = _normal(40, B, T, N, H).astype(jnp.bfloat16), _normal(41, B, S, K, H).astype(jnp.bfloat16)
  k = _normal(42, B, S, K, H).at[0, 200, 0, 3].set(jnp.nan).astype(jnp.bfloat16)
  if kernel == "fp8":
    out, lse = mgpu_flash.flash_attention_fp8(q, k, v, causal=True, smooth_k=False, incoherent=False)
  else:
    out, lse = mgpu_flash.flash_attention(q, k, v, causal=True)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  first = 200 - 200 % mgpu_flash.FP8_TUNING.block_kv if kernel == "fp8" else 200
  assert np.isfinite(out[0, :first]).all() and np.isfinite(lse[0, :first]).all()
  assert np.isnan(out[0, 200:]).all() and np.isnan(lse[0, 200:]).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smoothed_scores_plus_shift_are_the_scores(dtype):
  """smooth_keys in the engine's dtypes: q . (k - kbar) / sqrt(H) + shift == q . k / sqrt(H) for every row and key,
  within the residual's rounding in k's dtype (the mean subtracted and the one in the shift must be the same
  vector, or rows move by different amounts); kbar is the mean of the first kv_len keys only. The bias is large, so
  a shift from a kbar rounded differently than the subtracted one (bf16: ~0.06 a channel) would show."""
  B, T, S, N, K, H = 2, 8, 96, 4, 2, 64
  q = (2.0 * _normal(31, B, T, N, H)).astype(dtype)
  k = (_normal(32, B, S, K, H) + 30.0 * _normal(33, 1, 1, K, H)).astype(dtype)
  kvl = jnp.array([S, 40])
  res, shift = fp8.smooth_keys(q, k, kvl)
  assert res.dtype == k.dtype and shift.dtype == jnp.float32
  G = N // K
  scores = lambda kk: jnp.einsum("btkgh,bskh->btkgs", q.astype(jnp.float32).reshape(B, T, K, G, H),
                                 kk.astype(jnp.float32), precision="highest").reshape(B, T, N, S) / math.sqrt(H)
  got = scores(res) + shift[..., None]
  want = scores(k)
  tol = 0.03 if dtype == "bfloat16" else 1e-3          # bf16 residuals of |k - kbar| ~ 1: 2^-9 relative
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol)
  kbar = k[1, :40].astype(jnp.float32).mean(axis=0)
  np.testing.assert_allclose(np.asarray(k[1].astype(jnp.float32) - res[1].astype(jnp.float32))[:40],
                             np.broadcast_to(np.asarray(kbar), (40, K, H)), atol=0.3 if dtype == "bfloat16" else 1e-4)


def test_int8_qk_beats_e4m3_on_biased_keys():
  """qk_dtype="int8" (Q and K rounded to integers of absmax / 127 per block, exact integer products; P and V e4m3)
  on keys with a shared bias, the case trained models give (SmolLM2 in benchmarks/NOTES-fp8.md), both smoothed:
  closer to float32 attention than e4m3."""
  N, K, H = 4, 2, 128
  B, T, S = 1, 256, 1024
  q = 2.0 * _normal(22, B, T, N, H)
  k = _normal(23, B, S, K, H) + 3.0 * _normal(24, 1, 1, K, H)
  v = _normal(25, B, S, K, H)
  want, want_lse = _reference(q, k, v, causal=True)
  err = {}
  for qk in fp8.QK_DTYPES:
    got, lse = mgpu_flash.flash_attention_fp8(q, k, v, qk_dtype=qk, interpret=True)
    got, lse, want, want_lse = map(np.asarray, (got, lse, want, want_lse))
    err[qk] = (float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))),
               float(np.mean(np.abs(lse - want_lse))))
  # P's and V's e4m3 rounding, the same in both, is most of the output error; the lse carries Q K^T's alone.
  assert err["int8"][0] < 0.85 * err["float8_e4m3fn"][0] and err["int8"][1] < 0.5 * err["float8_e4m3fn"][1], err
  with pytest.raises(ValueError, match="qk_dtype='int4'"):
    fp8.quantize_operands(q, k, v, block_q=64, block_kv=128, incoherent=False, qk_dtype="int4")


def test_incoherence_rotation_lowers_error_on_outliers():
  """FA3's outlier inputs (N(0,1) + N(0,100) * Bernoulli(0.001)): rotating Q and K spreads each outlier over the
  head dim, which shrinks the quantization step of the other values in its block."""
  B, T, N, K, H = 1, 512, 2, 1, 128
  keys = jax.random.split(jax.random.key(10), 3)

  def outliers(key, shape):
    kn, ko, kb = jax.random.split(key, 3)
    return (jax.random.normal(kn, shape) + 10.0 * jax.random.normal(ko, shape)
            * jax.random.bernoulli(kb, 0.001, shape))

  q = outliers(keys[0], (B, T, N, H))
  k = outliers(keys[1], (B, T, K, H))
  v = outliers(keys[2], (B, T, K, H))
  want, _ = _reference(q, k, v, causal=True)
  err = {}
  for inc in (False, True):
    out, _ = mgpu_flash.flash_attention_fp8(q, k, v, incoherent=inc, interpret=True)
    err[inc] = float(np.sqrt(np.mean((np.asarray(out) - np.asarray(want)) ** 2)))
  assert err[True] < err[False], err


# ---------------------------------------------------------------- selection
def test_fp8_backend_selection(caplog):
  with caplog.at_level(logging.WARNING):
    be = backends.get_backend("auto", head_dim=128, attention_dtype="float8_e4m3fn")
  if not ON_GPU:
    assert be.name == "pallas-fp8-model" and be.interpret
    assert "jnp model" in caplog.text
  assert isinstance(be, pallas_backend.PallasFp8Backend)
  with pytest.raises(ValueError, match="runs on the pallas backend, not attention='cudnn'"):
    backends.get_backend("cudnn", attention_dtype="float8_e4m3fn")
  with pytest.raises(ValueError, match="head_dim=96"):
    backends.get_backend("pallas", head_dim=96, attention_dtype="float8_e4m3fn")
  if not ON_GPU:
    with pytest.raises(ValueError, match="cannot run here \\(attention='pallas'\\): needs a CUDA GPU"):
      backends.get_backend("pallas", attention_dtype="float8_e4m3fn")
  be = backends.get_backend("auto", head_dim=128, attention_dtype="int8_fp8")
  assert be.qk_dtype == "int8" and be.name == ("pallas-int8-fp8" if ON_GPU else "pallas-int8-fp8-model")
  with pytest.raises(ValueError, match="attention_dtype=int8_fp8 runs on the pallas backend, not attention='cudnn'"):
    backends.get_backend("cudnn", attention_dtype="int8_fp8")
  with pytest.raises(ValueError, match="attention_dtype='int8'"):
    backends.get_backend("auto", attention_dtype="int8")
  with pytest.raises(ConfigError, match="attention_dtype='bf8'"):
    RunConfig(attention_dtype="bf8")
  with pytest.raises(ConfigError, match="not attention='reference'"):
    RunConfig(attention="reference", attention_dtype="float8_e4m3fn")


def test_fp8_backend_runs_the_fp8_path_not_the_reference(monkeypatch):
  """attend() of an unmasked-position causal block must reach the FP8 model (kernel path), never the jnp reference."""
  calls = []
  model = fp8.attention_fp8_model
  monkeypatch.setattr(fp8, "attention_fp8_model", lambda *a, **kw: calls.append(1) or model(*a, **kw))

  def boom(*a, **kw):
    raise AssertionError("the FP8 backend fell back to the reference")

  monkeypatch.setattr(ref, "attention_reference", boom)
  be = pallas_backend.PallasFp8Backend(interpret=True)
  q, k, v = _normal(11, 1, 128, 2, 128), _normal(12, 1, 128, 1, 128), _normal(13, 1, 128, 1, 128)
  out, lse = be.attend(q, k, v, causal=True)
  assert calls and out.shape == q.shape and lse.shape == (1, 128, 2)


def _poison_references(monkeypatch):
  """The jnp references return NaN: a run that reaches them at run time (a lax.cond traces both branches, so a
  raising patch cannot tell) ends with NaN logits."""
  nan = lambda q, *a, **kw: (jnp.full(q.shape, jnp.nan, q.dtype), jnp.full(q.shape[:3], jnp.nan, jnp.float32))
  monkeypatch.setattr(ref, "attention_reference", nan)
  monkeypatch.setattr(ref, "paged_attention_reference", nan)


def test_fp8_paged_read_refuses_what_it_cannot_read():
  """The in-place FP8 prefix read refuses, in one line naming the values, pages it cannot read (too small, not
  fp8) and a route it was asked for that cannot serve; an unknown route is refused when the backend is made."""
  q = jnp.zeros((1, 64, 4, 128), jnp.bfloat16)
  table, n, sc = jnp.zeros((1, 4), jnp.int32), jnp.array([10], jnp.int32), jnp.ones((4, 2), jnp.float32)
  small = jnp.zeros((4, 32, 2, 128), fp8.E4M3)
  with pytest.raises(ValueError, match="page_size=32 must be a multiple of it, or divide it and be at least 64"):
    mgpu_flash.flash_attention_fp8_paged(q, small, small, sc, sc, table, n, interpret=True)
  bf16 = jnp.zeros((4, 64, 2, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="pages bfloat16 / bfloat16 must be float8_e4m3fn"):
    mgpu_flash.flash_attention_fp8_paged(q, bf16, bf16, sc, sc, table, n, interpret=True)
  be = pallas_backend.PallasFp8Backend(interpret=True, prefix_route="in-place", qk_dtype="int8")
  with pytest.raises(ValueError, match="prefix_route='in-place' cannot read these pages: qk_dtype='int8'"):
    be.prefix_kernel(head_dim=128, page_size=64, page_dtype=fp8.E4M3)
  with pytest.raises(ValueError, match="prefix_route='fast' must be one of auto, in-place, gather"):
    pallas_backend.PallasFp8Backend(prefix_route="fast")


@pytest.mark.parametrize("order,Z,how", [("contiguous", 16, "gather"), ("zigzag", 16, "gather"),
                                         ("contiguous", 64, "in-place"), ("zigzag", 64, "in-place")])
def test_fp8_paged_prefix_reads_pages_in_blocks(monkeypatch, order, Z, how):
  """A chunk against its cached prefix through the FP8 backend's paged path, its pages gathered (pages of 16
  tokens) or read in place (64): fp8 pages with per-page scales, a layer offset into the pool, lengths shorter
  than the table, table blocks past every length (skipped), rows in zigzag order as a seq mesh gathers them;
  against the float64 oracle of the dequantized pages, never through a jnp reference."""
  from tests.test_kernels import oracle, rand_pages, visibility
  B, T, N, K, H, M, P = 2, 96, 4, 2, 128, 384 // Z, 60
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(30, B, T, N, K, H, Z, M, P, fp8=True, dtype=jnp.float32)
  kv_len = jnp.array([200, 77], jnp.int32)
  rows = np.arange(T) if order == "contiguous" else np.concatenate([np.arange(T // 2), np.arange(T // 2)[::-1]])
  q_pos = jnp.asarray(np.stack([300 + rows, 90 + rows]), jnp.int32)
  off = 7                                                  # the pool holds other pages below this layer's
  pad = lambda x: jnp.concatenate([jnp.zeros((off, *x.shape[1:]), x.dtype), x])
  _poison_references(monkeypatch)
  monkeypatch.setattr(pallas_backend, "PREFIX_BLOCK_TOKENS", 128)               # 3 blocks
  in_place = spy_in_place_reads(monkeypatch)
  be = pallas_backend.PallasFp8Backend(interpret=True)
  assert be.prefix_kernel(head_dim=H, page_size=Z, page_dtype=kp.dtype)[0] == how
  got = be.paged(q, pad(kp), pad(vp), table, q_pos=q_pos, kv_len=kv_len, k_scale=pad(ks), v_scale=pad(vs),
                 page_offset=off)
  want_o, want_l = oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True))
  out, lse = (np.asarray(x, np.float64) for x in got)
  assert np.isfinite(out).all()
  assert np.linalg.norm(out - want_o) / np.linalg.norm(want_o) < 0.06
  assert np.abs(lse - want_l).max() < 0.1
  assert bool(in_place) == (how == "in-place")


def spy_in_place_reads(monkeypatch) -> list:
  """A list that gets an entry each time mgpu_flash.flash_attention_fp8_paged (the in-place prefix read) is
  called (traced, under jit), which still runs."""
  calls = []
  paged_fp8 = mgpu_flash.flash_attention_fp8_paged
  monkeypatch.setattr(mgpu_flash, "flash_attention_fp8_paged", lambda *a, **kw: calls.append(1) or
                      paged_fp8(*a, **kw))
  return calls


def spy_promises(monkeypatch, cls) -> list:
  """A list that gets the `past` promise (lcjax.ops.backends) of each call of cls.paged, as traced; the call runs."""
  promised = []
  paged = cls.paged

  def told(self, *args, past=False, **kw):
    promised.append(past)
    return paged(self, *args, past=past, **kw)

  monkeypatch.setattr(cls, "paged", told)
  return promised


def dequantized_rows(q8, qs, T):
  """fp8.quantize_rows' output (block 64) back in float32, its first T rows: the queries the FP8 kernel multiplies."""
  q8, qs = np.asarray(q8).astype(np.float32), np.asarray(qs)
  return (q8 * np.repeat(np.swapaxes(qs, 1, 2), 64, axis=1)[..., None])[:, :T]


def fp8_pages(seed, B, T, N, K, H, Z, M, P, kv_len, offset=0):
  """q [B, T, N, H] float32 and fp8 pools [offset + P, Z, K, H] as lcjax's pages hold them: power-of-two scales
  [offset + P, K] spread over 2^5 (K) and 2^9 (V), and in the slots past each sequence's kv_len pages of
  another owner (scales 2^20: they must weigh nothing). Returns (q, kp, vp, ks, vs, table,
  kd, vd): kd, vd [B, M * Z, K, H] float32 the keys the table reads, dequantized."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  table = rng.permutation(P)[:B * M].reshape(B, M) + offset
  ks = 2.0 ** rng.integers(-8, -2, size=(offset + P, K))
  vs = 2.0 ** rng.integers(-10, 0, size=(offset + P, K))
  stored = lambda: np.clip(rng.normal(size=(offset + P, Z, K, H)) * 60, -448, 448)
  kp, vp = stored(), stored()
  for b in range(B):
    dead = table[b, -(-int(kv_len[b]) // Z):]
    ks[dead], vs[dead] = 2.0 ** 20, 2.0 ** 20
  kp, vp = (x.astype(np.float32).astype(fp8.E4M3) for x in (kp, vp))          # ml_dtypes' e4m3 (round to even)
  ks, vs = ks.astype(np.float32), vs.astype(np.float32)
  deq = lambda x, sc: (x.astype(np.float32) * sc[:, None, :, None])[table].reshape(B, M * Z, K, H)
  return (q, *map(jnp.asarray, (kp, vp, ks, vs)), jnp.asarray(table - offset, jnp.int32), jnp.asarray(deq(kp, ks)),
          jnp.asarray(deq(vp, vs)))


@pytest.mark.parametrize("Z", [64, 128])
def test_paged_scales_model_is_attention_over_the_dequantized_pages(Z):
  """fp8.attention_fp8_model over pages read in place (PageScales: per-group K scales, V scales folded into P and
  the accumulator's units) == float64 attention of the e4m3 queries over the dequantized pages, but for P's e4m3
  rounding; the lse, which P's rounding does not touch, to float32 rounding. Pages of another owner past kv_len
  (scales 2^20) weigh nothing, a sequence with no prefix gets out 0 and lse -inf."""
  from tests.test_kernels import oracle, visibility
  B, T, N, K, H, M, P = 4, 64, 4, 2, 128, 1280 // Z, 96
  kv_len = np.array([191, 700, 1024, 0])
  q, kp, vp, ks, vs, table, kd, vd = fp8_pages(40, B, T, N, K, H, Z, M, P, kv_len, offset=5)
  q8, qs = jax.jit(fp8.quantize_rows, static_argnums=1)(q, 64)
  sc = jax.jit(fp8.page_scales, static_argnames=("page_size", "block_kv"))(
      ks, vs, table + 5, jnp.asarray(kv_len, jnp.int32), page_size=Z, block_kv=128)
  assert sc.k.shape == (B, K, 10, 128 // min(Z, 128)) and sc.v_max.shape == (B, K, 10)
  keys = lambda x: jnp.asarray(np.asarray(x)[np.asarray(table) + 5].reshape(B, M * Z, K, H))
  out, lse = _fp8_model(q8, qs, keys(kp), sc, keys(vp), None, jnp.zeros(B, jnp.int32),
                        jnp.asarray(kv_len, jnp.int32), causal=False, block_q=64, block_kv=128)
  qd = dequantized_rows(q8, qs, T)
  want_o, want_l = oracle(qd, kd, vd, visibility(np.zeros((B, T), int), np.zeros(B, int), kv_len, M * Z, False))
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  assert np.all(out[3] == 0) and np.all(np.isneginf(lse[3]))
  np.testing.assert_allclose(lse[:3], want_l[:3], rtol=1e-5, atol=1e-5)
  err = [np.linalg.norm(out[b] - want_o[b]) / np.linalg.norm(want_o[b]) for b in range(3)]
  assert max(err) < 0.03, err


def test_padding_rows_past_q_len_change_no_real_row():
  """Rows at or past q_len are padding the caller drops; what they hold (here 1e5 times the real rows) must not
  change a real row's bits, in the FP8 kernel's model over contiguous keys and over fp8 pages read in place. Q's
  scale is an absmax over block_q rows, and taken over padding it set the quantization step of the real rows of
  its block."""
  B, T, N, K, H, Z, M, P = 2, 128, 4, 2, 64, 64, 4, 12
  kv_len = np.array([200, 90])
  q, kp, vp, ks, vs, table, kd, vd = fp8_pages(50, B, T, N, K, H, Z, M, P, kv_len)
  q_len = jnp.array([100, 37])
  pad = jnp.arange(T)[None, :, None, None] >= q_len[:, None, None, None]
  calls = [lambda q: mgpu_flash.flash_attention_fp8(q, kd, vd, None, jnp.asarray(kv_len), q_len, causal=False,
                                                    interpret=True),
           lambda q: mgpu_flash.flash_attention_fp8_paged(q, kp, vp, ks, vs, table, jnp.asarray(kv_len), 0, q_len,
                                                          interpret=True)]
  real = ~np.asarray(pad[:, :, 0, 0])
  for call in calls:
    clean, loud = call(jnp.where(pad, 0.0, q)), call(jnp.where(pad, 1e5 * q, q))
    for got, want in zip(loud, clean):
      np.testing.assert_array_equal(np.asarray(got)[real], np.asarray(want)[real])


def test_a_chunks_padding_rows_change_no_real_row_of_its_self_attention():
  """The FP8 backend's `attend` (a prefill chunk against its own keys, causal) told q_len: what the padding rows
  hold (1e5 times the real rows) changes no real row's bits; without q_len it does (Q's block scale is taken over
  them)."""
  B, T, N, K, H = 2, 128, 4, 2, 64
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (N, K, K))
  lengths = jnp.array([100, 37], jnp.int32)
  pad = jnp.arange(T)[None, :, None, None] >= lengths[:, None, None, None]
  real = ~np.asarray(pad[:, :, 0, 0])
  be = pallas_backend.PallasFp8Backend(interpret=True)
  loud = jnp.where(pad, 1e5 * q, q)
  for q_len, same in ((lengths, True), (None, False)):
    got, want = (be.attend(x, k, v, kv_len=lengths, q_len=q_len)[0] for x in (loud, jnp.where(pad, 0.0, q)))
    assert np.array_equal(np.asarray(got)[real], np.asarray(want)[real]) == same, q_len


# ---------------------------------------------------------------- engine
TINY128 = ModelConfig("tiny128", vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128,
                      ffn_dim=256, rope_theta=10000.0, max_position=512, eos_ids=())


@pytest.mark.parametrize("attention_dtype,name,qk", [("float8_e4m3fn", "pallas-fp8-model", "float8_e4m3fn"),
                                                     ("int8_fp8", "pallas-int8-fp8-model", "int8")])
def test_engine_fp8_attention_matches_bf16_path_greedy(monkeypatch, attention_dtype, name, qk):
  """40 greedy tokens after a 300-token prompt prefilled in chunks (the chunk's self-attention is FP8; the cached
  prefix goes through the paged path): the same tokens as the engine without FP8 attention. The stats name the
  kernel that ran, and int8_fp8 quantizes Q and K to int8."""
  run = RunConfig(dtype="float32", page_size=16, prefill_chunk=128, max_context=512, max_batch=1, decode_steps=8)
  prompt = [int(t) for t in np.random.default_rng(1).integers(3, 256, 300)]
  base = Engine.random(TINY128, run=run, seed=5)
  eng = Engine.random(TINY128, run=run.replace(attention_dtype=attention_dtype), seed=5)
  assert eng.attention.name == name and eng.attention.qk_dtype == qk
  want = base.generate([prompt], max_new_tokens=40)[0]
  _poison_references(monkeypatch)                        # the FP8 engine must not reach a jnp reference
  got = eng.generate([prompt], max_new_tokens=40)[0]
  assert got.stats["attention"] == name and got.stats["attention_dtype"] == attention_dtype
  assert got.stats["decode_kernel"] == "triton-interpret" and want.stats["decode_kernel"] == "reference"
  assert got.token_ids == want.token_ids
  assert eng.fingerprint != base.fingerprint
  # Each 8-bit mode caches different K/V: a context saved under one must not be served to the other.
  other = "int8_fp8" if attention_dtype == "float8_e4m3fn" else "float8_e4m3fn"
  assert eng.fingerprint != Engine.random(TINY128, run=run.replace(attention_dtype=other), seed=5).fingerprint


def test_engine_fp8_prefix_read_ignores_what_earlier_requests_left_in_the_pages():
  """int8_fp8 over a bf16 cache gathers a chunk's cached prefix from pages that also hold keys past it: the
  chunk's own, then slots a previous request wrote into the pages this one reuses. The prompt's logits are the
  same bit for bit on a fresh engine and after that request (before, its stale values in the slots past the
  prompt set V's quantization scale of the prefix read)."""
  run = RunConfig(dtype="float32", page_size=16, prefill_chunk=128, max_context=512, max_batch=1, decode_steps=8,
                  attention_dtype="int8_fp8", prefix_cache=False)
  earlier = [int(t) for t in np.random.default_rng(105).integers(3, 256, 256)]
  prompt = [int(t) for t in np.random.default_rng(1).integers(3, 256, 168)]
  want = Engine.random(TINY128, run=run, seed=5).prompt_logits(prompt)
  eng = Engine.random(TINY128, run=run, seed=5)
  assert eng.kernels["prefill_kernel"] == "pallas-int8-fp8-model-gather"
  eng.prompt_logits(earlier)
  np.testing.assert_array_equal(eng.prompt_logits(prompt), want)


@pytest.mark.parametrize("page_size,prefix", [(16, "pallas-fp8-model-gather"), (64, "pallas-fp8-model-in-place")])
def test_engine_fp8_attention_over_an_fp8_cache(monkeypatch, page_size, prefix):
  """FP8 attention reading a prefix from fp8 pages, gathered (pages of 16 tokens: per-page scales, dequantized per
  block) or in place (64): logits of a chunked prefill within FP8's error of float32 attention over a float32
  cache, the same top-1; the stats name the path, and the in-place read is traced exactly where they say so."""
  run = RunConfig(dtype="float32", page_size=page_size, prefill_chunk=128, max_context=512, max_batch=1,
                  decode_steps=8)
  prompt = [int(t) for t in np.random.default_rng(4).integers(3, 256, 300)]
  exact = Engine.random(TINY128, run=run, seed=6).prompt_logits(prompt)
  eng = Engine.random(TINY128, run=run.replace(attention_dtype="float8_e4m3fn", cache_dtype="float8_e4m3fn"), seed=6)
  assert eng.kernels["prefill_kernel"] == prefix
  calls = spy_in_place_reads(monkeypatch)
  got = eng.prompt_logits(prompt)
  assert bool(calls) == prefix.endswith("in-place")
  assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.04
  assert int(np.argmax(got)) == int(np.argmax(exact))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (fake CPU devices via conftest)")
def test_fp8_attention_on_a_seq_mesh_matches_one_device(monkeypatch, seq=2):
  """Ring attention over `seq` shards calls the FP8 backend per block pair, and each shard's cached prefix (rows
  gathered in zigzag order) goes through its paged path: the logits of a chunked prefill must match one device
  with FP8 attention to within FP8's own error (the shards quantize other blocks), both close to float32
  attention, and no jnp reference may run."""
  run = RunConfig(dtype="float32", page_size=16, prefill_chunk=128, max_context=512, max_batch=1, decode_steps=8)
  prompt = [int(t) for t in np.random.default_rng(3).integers(3, 256, 300)]
  exact = Engine.random(TINY128, run=run, seed=5).prompt_logits(prompt)
  _poison_references(monkeypatch)           # from here on, a route to a jnp reference shows as NaN logits
  one = Engine.random(TINY128, run=run.replace(attention_dtype="float8_e4m3fn"), seed=5).prompt_logits(prompt)
  mesh = Engine.random(TINY128, run=run.replace(attention_dtype="float8_e4m3fn", seq=seq), seed=5)
  assert mesh.attention.name == "pallas-fp8-model"
  got = mesh.prompt_logits(prompt)
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
  assert rel(one, exact) < 0.03 and rel(got, exact) < 0.03, (rel(one, exact), rel(got, exact))
  assert np.isfinite(got).all() and np.isfinite(one).all()
  assert rel(got, one) < 0.03
  assert int(np.argmax(got)) == int(np.argmax(exact))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (fake CPU devices via conftest)")
@pytest.mark.parametrize("mesh", ["seq", "tensor"])
def test_a_meshs_fp8_attention_never_takes_a_chunks_padding_rows_for_real(monkeypatch, mesh):
  """A 300-token prompt in 128-token chunks on a mesh of 2: its last chunk's padding rows (positions past the
  prompt) reach the FP8 backend's prefix read as zeros on a seq mesh (gathered in zigzag order, which a q_len
  cannot describe), and the chunk's self-attention is told its real rows on a tensor mesh (the chunk is not
  split): either way no padding row sets the scale of a Q block."""
  run = RunConfig(dtype="float32", page_size=16, prefill_chunk=128, max_context=512, max_batch=1,
                  attention_dtype="float8_e4m3fn", **{mesh: 2})
  prompt = [int(t) for t in np.random.default_rng(3).integers(3, 256, 300)]
  padding_absmax, told = [], []
  cls = pallas_backend.PallasFp8Backend
  paged, attend = cls.paged, cls.attend

  def spy_paged(self, q, *args, q_pos, **kw):
    pad = q_pos >= len(prompt)
    jax.debug.callback(lambda n, m: padding_absmax.append((int(n), float(m))), pad.sum(),
                       jnp.max(jnp.where(pad[:, :, None, None], jnp.abs(q), 0)))
    return paged(self, q, *args, q_pos=q_pos, **kw)

  def spy_attend(self, q, k, v, *, q_len=None, **kw):
    told.append(q_len is not None)
    return attend(self, q, k, v, q_len=q_len, **kw)

  monkeypatch.setattr(cls, "paged", spy_paged)
  monkeypatch.setattr(cls, "attend", spy_attend)
  assert np.isfinite(Engine.random(TINY128, run=run, seed=5).prompt_logits(prompt)).all()
  assert told and all(told), told
  assert any(n for n, _ in padding_absmax), padding_absmax            # the last chunk has padding rows
  if mesh == "seq":
    assert all(m == 0 for _, m in padding_absmax), padding_absmax


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (fake CPU devices via conftest)")
def test_fp8_pages_read_in_place_on_a_seq_mesh_match_one_device(monkeypatch, seq=2):
  """Over fp8 pages of 64 tokens each `seq` shard reads its own pages of a chunk's cached prefix in place (the
  chunk's rows gathered in zigzag order): a chunked prefill's logits match one device reading the same pages in
  place, both close to float32 attention over a bf16 cache, and no jnp reference runs. Every prefix read on the
  mesh is promised that the prefix precedes its rows (past=True: the backend then calls the in-place read
  directly, without a device-side choice), and the in-place read is called."""
  run = RunConfig(dtype="float32", page_size=64, prefill_chunk=128, max_context=512, max_batch=1, decode_steps=8)
  prompt = [int(t) for t in np.random.default_rng(4).integers(3, 256, 300)]
  exact = Engine.random(TINY128, run=run, seed=5).prompt_logits(prompt)
  fp8 = run.replace(attention_dtype="float8_e4m3fn", cache_dtype="float8_e4m3fn")
  _poison_references(monkeypatch)
  one = Engine.random(TINY128, run=fp8, seed=5).prompt_logits(prompt)
  calls = spy_in_place_reads(monkeypatch)
  promised = spy_promises(monkeypatch, pallas_backend.PallasFp8Backend)
  got = Engine.random(TINY128, run=fp8.replace(seq=seq), seed=5).prompt_logits(prompt)
  assert calls and promised and all(promised), promised
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
  assert np.isfinite(got).all() and np.isfinite(one).all()
  assert rel(one, exact) < 0.02 and rel(got, exact) < 0.02, (rel(one, exact), rel(got, exact))
  assert rel(got, one) < 0.015
  assert int(np.argmax(got)) == int(np.argmax(exact))


def _thread_coords(layout, shape):
  """{(warp, lane): (row, col) of each element, indexed like the layout's register arrays (a register index
  without its last, vector placeholder) then by the element within the register}, computed
  from the layout's own tiling, warp, lane and vector dimensions (a TiledLayout with one warp dimension and no
  replicated ones, as WGMMA and WGMMA_8BIT are)."""
  coords = np.stack(np.meshgrid(*map(np.arange, shape), indexing="ij"), -1)            # [*shape, 2]
  for tile in layout.tiling.tiles:
    lead, tail = coords.shape[:-1 - len(tile)], coords.shape[-1 - len(tile):-1]
    split = [x for n, t in zip(tail, tile) for x in (n // t, t)]
    coords = coords.reshape(*lead, *split, 2)
    k = len(lead)
    coords = coords.transpose(*range(k), *(k + 2 * i for i in range(len(tile))),
                              *(k + 2 * i + 1 for i in range(len(tile))), coords.ndim - 1)
  nd = coords.ndim - 1
  warp, lanes = layout.warp_dims[0] % nd, [d % nd for d in layout.lane_dims]
  out = {}
  for w in range(coords.shape[warp]):
    for lane in range(32):
      idx = [slice(None)] * nd
      idx[warp] = slice(w, w + 1)
      for d, i in zip(lanes, np.unravel_index(lane, [coords.shape[d] for d in lanes])):
        idx[d] = slice(i, i + 1)
      out[w, lane] = coords[tuple(idx)]
  return out


def test_p_register_relabel_is_key_perm():
  """The FP8 kernel hands P's e4m3 registers from the accumulator layout to the P V wgmma as its 8-bit A operand,
  pairing registers as mgpu_flash.a_operand_sources says (the low one's two bytes first). Derived from Mosaic
  GPU's own layout definitions, A position c of every row is then P's key 16 (c // 16) + KEY_PERM[c % 16], the
  order v_operand gives V, transposed to [B, K, H, S]. (The MLIR that moves the bytes runs only on a GPU: tests
  marked gpu.)"""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  acc = _thread_coords(fa.WGMMA_LAYOUT, (64, 128))
  a8 = _thread_coords(fa.WGMMA_LAYOUT_8BIT, (64, 128))
  acc_regs = fa.WGMMA_LAYOUT.registers_shape((64, 128))
  sources = mgpu_flash.a_operand_sources(acc_regs)
  assert sorted(sources) == sorted(np.ndindex(fa.WGMMA_LAYOUT_8BIT.registers_shape((64, 128))))
  perm = np.array(mgpu_flash.KEY_PERM)
  for thread in acc:
    for dst, (lo, hi) in sources.items():
      got = np.concatenate([acc[thread][lo[:-1]], acc[thread][hi[:-1]]])   # [4 bytes, (row, col)], wgmma's order
      want = a8[thread][dst[:-1]]                                           # [4 positions, (row, col)]
      assert (got[:, 0] == want[:, 0]).all(), thread                   # the same rows
      assert (got[:, 1] == 16 * (want[:, 1] // 16) + perm[want[:, 1] % 16]).all(), thread
  v = np.arange(2 * 32 * 2 * 2, dtype=np.uint8).reshape(2, 32, 2, 2)                # [B, S, K, H], distinct bytes
  vt = np.transpose(v, (0, 2, 3, 1))
  want = np.stack([vt[..., 16 * (c // 16) + perm[c % 16]] for c in range(32)], -1)
  np.testing.assert_array_equal(np.asarray(mgpu_flash.v_operand(jnp.asarray(v))), want)


@pytest.mark.parametrize("Z", [16, 64])
def test_v_operand_of_pages_is_v_operand_of_the_gathered_keys(Z):
  """v_operand_paged (the in-place FP8 read's V: 32-bit words gathered from the pages, bytes picked into words,
  one word transpose) gives bit for bit v_operand of the keys gathered from a scrambled table and padded with zero
  bytes, every byte value included."""
  rng = np.random.default_rng(Z)
  P, K, H, B, M, S = 12, 2, 64, 2, 4, 4 * Z + 32
  pages = lax.bitcast_convert_type(jnp.asarray(rng.integers(0, 256, (P, Z, K, H), dtype=np.uint8)), jnp.float8_e4m3fn)
  table = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
  keys = jnp.pad(pages[table].reshape(B, M * Z, K, H), ((0, 0), (0, S - M * Z), (0, 0), (0, 0)))
  bits = lambda x: np.asarray(lax.bitcast_convert_type(x, jnp.uint8))
  np.testing.assert_array_equal(bits(mgpu_flash.v_operand_paged(pages, table, S)), bits(mgpu_flash.v_operand(keys)))


@pytest.mark.parametrize("H,qk_dtype", [(128, "float8_e4m3fn"), (64, "float8_e4m3fn"), (128, "int8")])
def test_fp8_kernel_lowers_for_cuda(H, qk_dtype):
  """The FP8 Mosaic GPU kernel traces and lowers to its CUDA custom call without a GPU (wgmma operand checks,
  layouts and shared-memory transfers are all decided here)."""
  sd = lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  f = jax.jit(functools.partial(mgpu_flash.flash_attention_fp8, causal=True, qk_dtype=qk_dtype))
  lowered = f.trace(sd((1, 256, 8, H)), sd((1, 384, 2, H)), sd((1, 384, 2, H))).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_fp8_kernel_profiles_only_short_sequences():
  """The on-device profiler's trace lives in shared memory: a profiled kernel over more keys is refused."""
  sd = lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  S = mgpu_flash.PROFILE_MAX_KEYS + 128
  tuning = dataclasses.replace(mgpu_flash.FP8_TUNING, profile_dir="/tmp/unused")
  f = jax.jit(functools.partial(mgpu_flash.flash_attention_fp8, causal=True, tuning=tuning))
  with pytest.raises(ValueError, match=f"{S} keys > PROFILE_MAX_KEYS"):
    f.trace(sd((1, 128, 8, 128)), sd((1, S, 2, 128)), sd((1, S, 2, 128)))


# ---------------------------------------------------------------- GPU
GPU_CASES = [  # T, S, N, K, H, causal, d, kv_len
    (1024, 1024, 4, 2, 128, True, None, None),
    (384, 1920, 8, 2, 128, True, (1536, 700), (1920, 1700)),
    (512, 700, 4, 4, 128, False, None, (700, 300)),
    (1024, 1024, 4, 1, 64, True, None, None),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("T,S,N,K,H,causal,d,kv_len,qk_dtype,kv_splits",
                         [c + ("float8_e4m3fn", None) for c in GPU_CASES] + [c + ("int8", None) for c in GPU_CASES[:2]]
                         + [c + ("float8_e4m3fn", s) for c in GPU_CASES[1:3] for s in (1, 5)])
def test_fp8_kernel_gpu(T, S, N, K, H, causal, d, kv_len, qk_dtype, kv_splits):
  """The FP8 kernel against its jnp model and float32 attention; kv_splits None: chosen per call (these small
  grids take 2 or 4), else each tile's keys in that many CTAs. The model has no splits: a split's running maximum
  scales P before its e4m3 rounding differently from the model's, so split runs meet the model's bounds with
  roundings of their own (they passed on an H100)."""
  B = 2
  q, k, v = (x.astype(jnp.bfloat16) for x in (_normal(20, B, T, N, H), _normal(21, B, S, K, H),
                                               _normal(22, B, S, K, H)))
  d = None if d is None else jnp.array(d, jnp.int32)
  kvl = None if kv_len is None else jnp.array(kv_len, jnp.int32)
  tuning = dataclasses.replace(mgpu_flash.FP8_TUNING, kv_splits=kv_splits)
  run = functools.partial(mgpu_flash.flash_attention_fp8, q, k, v, d, kvl, causal=causal, qk_dtype=qk_dtype,
                          tuning=tuning)
  out, lse = run()
  m_out, m_lse = run(interpret=True)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  seen = np.isfinite(np.asarray(m_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
  # Against its model: bf16 output rounding plus rare one-step e4m3 flips of P (exp2 approximations differ). A
  # flip moves p by up to 1/8 of itself, so on a row of few keys (small l) one output moves by up to |v| / 8 / l.
  diff = np.abs(np.asarray(out, np.float32) - np.asarray(m_out, np.float32))
  flipped = float((diff > 0.01).mean())
  assert diff.max() < 0.1 and diff.mean() < 2e-3 and flipped < 1e-3, (diff.max(), diff.mean(), flipped)
  np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(m_lse)[seen], atol=2e-3)
  # Against float32 attention: the quantization error (reported by tools/bench_attention.py).
  dd = jnp.full((B,), S - T, jnp.int32) if d is None else d
  q_pos = dd[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  want, _ = ref.attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                    q_pos=q_pos, kv_len=kvl, causal=causal)
  rel = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
  assert rel < 0.06, rel


PAGED_GPU_CASES = [  # T, N, K, H, Z, kv_len, kv_splits
    (100, 8, 2, 128, 64, (191, 1300, 1024, 0), None),
    (256, 4, 1, 128, 128, (1500, 128), 3),
    (128, 8, 2, 64, 256, (2000, 513), None),
    (1024, 32, 8, 128, 64, (4096, 3001), None),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("T,N,K,H,Z,kv_len,kv_splits", PAGED_GPU_CASES)
def test_fp8_paged_kernel_gpu(T, N, K, H, Z, kv_len, kv_splits):
  """The FP8 kernel reading fp8 pages in place (scrambled tables, a layer offset, power-of-two page scales spread
  over 2^9, another owner's pages past kv_len, prefixes ending inside a page, on a page or block boundary, and
  none; unaligned chunks) against its jnp model and float64 attention of its e4m3 queries over the dequantized
  pages (P's e4m3 error). The values reach |v| ~ 200, so the bounds are relative: against the model, bf16 output
  rounding plus rare one-step e4m3 flips of P (exp2 approximations differ), each moving an output by up to 1/8 of
  a key's |v| over the row's sum."""
  from tests.test_kernels import oracle, visibility
  B, off = len(kv_len), 3
  M = -(-max(kv_len) // Z) + 2
  P = B * M + 4
  q, kp, vp, ks, vs, table, kd, vd = fp8_pages(50 + Z, B, T, N, K, H, Z, M, P, np.array(kv_len), offset=off)
  q = q.astype(jnp.bfloat16)
  kvl = jnp.asarray(kv_len, jnp.int32)
  tuning = dataclasses.replace(mgpu_flash.FP8_TUNING, kv_splits=kv_splits)
  run = functools.partial(mgpu_flash.flash_attention_fp8_paged, q, kp, vp, ks, vs, table, kvl, off, tuning=tuning)
  out, lse = run()
  m_out, m_lse = run(interpret=True)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  seen = np.isfinite(np.asarray(m_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
  assert np.all(np.asarray(out, np.float32)[~seen] == 0)
  out32, m32 = np.asarray(out, np.float32), np.asarray(m_out, np.float32)
  for b in np.flatnonzero(np.array(kv_len) > 0):
    rel = np.linalg.norm(out32[b] - m32[b]) / np.linalg.norm(m32[b])
    assert rel < 2e-2 and np.abs(out32[b] - m32[b]).max() < 0.05 * np.abs(m32[b]).max(), (b, rel)
  # Scores of ~30 carry the tensor cores' fp8 sums (fewer bits than float32) into the lse: relative bound
  np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(m_lse)[seen], rtol=1e-3, atol=2e-3)
  # The oracle gets the kernel's e4m3 queries: the queries' own rounding costs ~7% on these scores of ~30 (the
  # model's error against bf16 queries, measured on the CPU), which would hide an error in reading the pages.
  qd = dequantized_rows(*fp8.quantize_rows(jnp.pad(q.astype(jnp.float32), ((0, 0), (0, -T % 128), (0, 0), (0, 0))),
                                           64), T)
  want_o, _ = oracle(qd, kd, vd, visibility(np.zeros((B, T), int), np.zeros(B, int), np.array(kv_len), M * Z, False))
  for b in np.flatnonzero(np.array(kv_len) > 0):
    rel = np.linalg.norm(np.asarray(out[b], np.float64) - want_o[b]) / np.linalg.norm(want_o[b])
    assert rel < 0.05, (b, rel)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
def test_fp8_engine_reads_fp8_pages_in_place_gpu(monkeypatch):
  """The GPU engine with FP8 attention over an fp8 cache of 64-token pages reads each chunk's prefix in place (the
  stats say so and the in-place kernel is traced) and its prompt logits are within FP8's error of bf16 attention
  over a bf16 cache, the same top-1."""
  run = RunConfig(page_size=64, prefill_chunk=1024, max_context=4096, max_batch=1, decode_steps=8)
  prompt = [int(t) for t in np.random.default_rng(3).integers(3, 256, 3000)]
  cfg = dataclasses.replace(TINY128, max_position=4096)
  exact = Engine.random(cfg, run=run, seed=5).prompt_logits(prompt)
  calls = spy_in_place_reads(monkeypatch)
  eng = Engine.random(cfg, run=run.replace(attention_dtype="float8_e4m3fn", cache_dtype="float8_e4m3fn"), seed=5)
  assert eng.kernels["prefill_kernel"] == "pallas-fp8-in-place"
  got = eng.prompt_logits(prompt)
  assert calls
  assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.06
  assert int(np.argmax(got)) == int(np.argmax(exact))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("attention_dtype,name", [("float8_e4m3fn", "pallas-fp8"), ("int8_fp8", "pallas-int8-fp8")])
def test_fp8_engine_gpu(attention_dtype, name):
  """The GPU engine with FP8 attention picks the kernel, not the model, and agrees with bf16 attention: the
  prompt's logits within FP8's error, and each of the 20 generated tokens a greedy choice of the bf16 engine's
  uncached forward over the prompt and the tokens before it (its logit within 5e-2 of the logits' largest
  magnitude of the best one: FP8 attention's error, about 3e-2 of the logits' norm, makes near-ties go either
  way). Decode reads bf16 pages with the Mosaic GPU decode kernel (FP8 attention is prefill's)."""
  run = RunConfig(page_size=64, prefill_chunk=1024, max_context=4096, max_batch=1, decode_steps=8)
  prompt = [int(t) for t in np.random.default_rng(2).integers(3, 256, 2500)]
  cfg = dataclasses.replace(TINY128, max_position=4096)
  base = Engine.random(cfg, run=run, seed=5)
  eng = Engine.random(cfg, run=run.replace(attention_dtype=attention_dtype), seed=5)
  assert eng.attention.name == name and not eng.attention.interpret
  exact = base.prompt_logits(prompt)
  assert np.linalg.norm(eng.prompt_logits(prompt) - exact) / np.linalg.norm(exact) < 0.06
  got = eng.generate([prompt], max_new_tokens=20)[0]
  assert got.stats["attention"] == name and got.stats["decode_kernel"] == "mosaic", got.stats
  assert len(got.token_ids) == 20
  forced = np.asarray(base.logits([prompt + got.token_ids[:-1]])[0, len(prompt) - 1:], np.float64)   # [20, V]
  for i, (t, row) in enumerate(zip(got.token_ids, forced)):
    assert row.max() - row[t] <= 5e-2 * np.abs(row).max(), (i, got.token_ids, int(np.argmax(row)))
