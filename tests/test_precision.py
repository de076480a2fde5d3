"""lcjax.ops.precision.widen: bf16 values, pinned by a reduce_precision that XLA keeps. (XLA's CPU compiler keeps a
bf16 round trip anyway; the GPU test of the drop is test_mgpu_gemv's
test_gpu_kernel_on_bf16_x_computed_in_the_same_program.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lcjax.ops import precision
from lcjax.ops.linear import scale_rows
from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv


def _round_to_bf16(x):
  """float32 x rounded to bf16's values, as float32, bit for bit what a bf16 round trip gives (numpy, jnp.bfloat16)."""
  return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def test_widen_of_bf16_is_its_value():
  """Every bfloat16 value (finite, subnormal, infinite, NaN), widened: its float32 value, bit for bit."""
  x = jnp.asarray(np.arange(2 ** 16, dtype=np.uint16).view(jnp.bfloat16))
  got = np.asarray(jax.jit(precision.widen)(x))
  want = np.asarray(x).astype(np.float32)
  nan = np.isnan(want)
  np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
  assert np.isnan(got[nan]).all()


def test_the_pin_rounds_float32_as_a_bf16_round_trip():
  """What widen pins a value that XLA kept in float32 to: the bf16 round trip of it, bit for bit, over random bit
  patterns and the edges (ties, the largest bf16 and the overflow past it, subnormals, -0, infinities, NaN
  payloads, just below split_fixed's band edge of 1/4)."""
  rng = np.random.default_rng(0)
  bits = rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
  edges = np.array([0x3F808000, 0x3F818000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x00000001, 0x007FFFFF, 0x80000000,
                    0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00001], np.uint32)
  x = np.concatenate([bits, edges]).view(np.float32)
  x = np.concatenate([x, np.float32(0.25) * (1 - np.float32(2.0) ** -np.arange(9, 24, dtype=np.float32))])
  got = np.asarray(jax.jit(_round_to_bf16)(jnp.asarray(x)))
  with np.errstate(invalid="ignore"):
    want = x.astype(jnp.bfloat16).astype(np.float32)
  nan = np.isnan(want)
  assert (np.isnan(got) == nan).all()
  np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
  # the compiled program keeps the pin
  hlo = jax.jit(lambda a: precision.widen(a.astype(jnp.bfloat16))).lower(jnp.asarray(x)).compile().as_text()
  assert "reduce-precision" in hlo


def test_widen_of_other_dtypes_is_a_cast():
  for x in (jnp.arange(5, dtype=jnp.float32) / 3, jnp.arange(5, dtype=jnp.float16) / 3, jnp.arange(5)):
    y = precision.widen(x)
    assert y.dtype == jnp.float32 and "reduce-precision" not in jax.jit(precision.widen).lower(x).compile().as_text()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x, np.float32))


def test_gemv_splits_read_bf16_x_through_widen():
  """split_fixed (the Mosaic GEMV) and scale_rows (the Triton GEMV) keep the pin in their compiled programs for
  bf16 x made in the same program, and split values just below the band edge 1/4 as their bf16 values (0.25, in
  hi): no lo part near float16's limit."""
  a = jnp.asarray(np.float32(0.25) * (1 - np.float32(2.0) ** -np.arange(9, 24, dtype=np.float32)))
  for split in (mgpu_gemv.split_fixed, scale_rows):
    fn = jax.jit(lambda a: split(jnp.sqrt(a * a).astype(jnp.bfloat16)[None]))
    assert "reduce-precision" in fn.lower(a).compile().as_text(), split.__name__
  parts, weights = jax.jit(lambda a: mgpu_gemv.split_fixed(jnp.sqrt(a * a).astype(jnp.bfloat16)[None]))(a)
  x = sum(np.asarray(p, np.float64) * w for p, w in zip(parts, np.asarray(weights, np.float64)))
  np.testing.assert_array_equal(x[0], np.asarray(a.astype(jnp.bfloat16), np.float64))
  assert np.abs(np.asarray(parts[1])).max() <= 65280


def test_fp8_page_writes_read_bf16_k_through_widen():
  """XLA's fp8 page writes (lcjax.cache.kv: a decode step's token, a chunk's tokens, and write_tokens' kept
  drafts) quantize K's bf16 values as the page-writer kernels do: their compiled programs keep the pin for bf16 K
  made in the same program."""
  from lcjax.cache import kv
  L, P, Z, K, H, B = 1, 4, 16, 2, 8, 2
  pool = jnp.zeros((L, P, Z, K, H), jnp.float8_e4m3fn)
  scale = jnp.zeros((L, P, K), jnp.float32)
  a = jnp.full((B, 1, K, H), 0.3, jnp.float32)

  def decode_write(a, slots):
    k = jnp.sqrt(a * a).astype(jnp.bfloat16)
    return kv.write_kv(pool, pool, scale, scale, k, k, slots, slots, 0)

  def kept_drafts(a, slots):
    k = jnp.sqrt(a * a).astype(jnp.bfloat16)[None]                              # [L, B, T, K, H]
    return kv.write_tokens(kv.PagedKV(pool, pool, scale, scale), k, k, slots)

  slots = jnp.asarray([[17], [33]], jnp.int32)
  for fn in (decode_write, kept_drafts):
    assert "reduce-precision" in jax.jit(fn).lower(a, slots).compile().as_text(), fn.__name__
