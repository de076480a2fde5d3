"""lcjax.ops.precision.widen: the values of x's own dtype, pinned by a reduce_precision that XLA keeps."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.ops import precision
from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv


def test_widen_gives_the_values_of_x():
  """Every bfloat16 value (finite, subnormal, infinite, NaN), widened: its float32 value, bit for bit; the compiled
  program holds the reduce_precision that pins it."""
  x = jnp.asarray(np.arange(2 ** 16, dtype=np.uint16).view(jnp.bfloat16))
  got = np.asarray(jax.jit(precision.widen)(x))
  want = np.asarray(x).astype(np.float32)
  nan = np.isnan(want)
  np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
  assert np.isnan(got[nan]).all()
  assert "reduce-precision" in jax.jit(precision.widen).lower(x).compile().as_text()


def test_widen_of_other_dtypes_is_a_cast():
  for x in (jnp.arange(5, dtype=jnp.float32) / 3, jnp.arange(5, dtype=jnp.float16) / 3, jnp.arange(5)):
    y = precision.widen(x)
    assert y.dtype == jnp.float32 and "reduce_precision" not in jax.jit(precision.widen).lower(x).as_text()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x, np.float32))


@pytest.mark.parametrize("fn", [mgpu_gemv.split_fixed, lambda x: x])
def test_split_fixed_widens_its_x_exactly(fn):
  """split_fixed's band split reads x through widen (a float32 value just below 1/4 that XLA kept unrounded would
  overflow the lo part): its lowered program holds the reduce_precision to bf16."""
  x = jnp.ones((4, 64), jnp.bfloat16)
  text = jax.jit(fn).lower(x).as_text()
  assert ("reduce_precision" in text) == (fn is mgpu_gemv.split_fixed)
