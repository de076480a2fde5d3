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
