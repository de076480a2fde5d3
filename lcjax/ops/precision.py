"""Widening bfloat16 to float32 without excess precision.

XLA's GPU compiler drops a narrowing convert that a widening one follows (`xla_allow_excess_precision`, on by
default): `x.astype(float32)` of a bfloat16 x that a fusion computed in float32 can read the unrounded float32
value. Code whose correctness rests on x holding only its dtype's values (a band split by magnitude, a bit-exact
quantization shared with a kernel) widens with `widen` instead: `lax.reduce_precision` is never dropped.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def widen(x):
  """x as float32, holding bf16 values for bfloat16 x (what the producer computed, rounded to bf16 here if XLA kept
  it unrounded); any other dtype: a plain cast. (float16 is not pinned: reduce_precision to its 5 exponent bits
  flushes its subnormals to zero.)"""
  y = x.astype(jnp.float32)
  return lax.reduce_precision(y, exponent_bits=8, mantissa_bits=7) if x.dtype == jnp.bfloat16 else y


FLOAT16_ABSMAX_LOG2 = 14      # `float16_scale` brings an absmax to at most 2^14 (float16's largest value is 65504)


def float16_scale(absmax):
  """The power of two s with absmax / s in [2^13, 2^14) (an exact exponent: dividing by s moves no bits), at least
  float32's smallest normal 2^-126, since a subnormal s is 0 where subnormals flush and x / 0 infinite: an absmax
  under 2^-112 comes out under 2^14. An all-zero or non-finite absmax gets 2^-14."""
  return jnp.ldexp(jnp.ones_like(absmax), jnp.maximum(jnp.frexp(absmax)[1] - FLOAT16_ABSMAX_LOG2, -126))
