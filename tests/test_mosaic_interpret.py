"""The Mosaic GPU decode, split-combine and page-write kernels run on CPUs in Pallas' Mosaic GPU interpreter (JAX >=
0.11).

The interpreter simulates a CTA's warpgroups as threads, its shared memory, TMA copies, barriers and wgmma on
shared-memory operands, and records data races between the warpgroups' reads and writes of shared memory. These
tests run the fp8 and bfloat16 paged decode kernels (lcjax.ops.mosaic_gpu.paged, with the Mosaic GPU combine) on
every case of test_fp8_decode's GPU tests, the split combine (lcjax.ops.mosaic_gpu.combine) at every row width
the engine gives it and the fp8 page writer (lcjax.ops.mosaic_gpu.page_write) against the same oracles as the
GPU tests, and fail on any race the interpreter saw. The GEMV kernel (lcjax.ops.mosaic_gpu.gemv) runs in its
`a_in_smem` form: on a GPU its wgmma takes the weight tile from registers, which the interpreter does not model,
and this form stores the same widened tile to shared memory first (the rest of the kernel is the same code).

The interpreter counts a barrier phase that no thread waited for as an error when the kernel ends. The decode
kernel's compute warpgroup frees ring slots the memory warpgroup never refills (the last `max_concurrent_steps`),
which on a GPU is harmless: the decode tests take the `decode_interpreter` fixture, which drops that end-of-kernel
check and keeps every other; the others take `interpreter`, which keeps them all.
JAX 0.10 has no interpreter for these kernels (no layout_cast on CPU): the module is skipped there.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from lcjax.ops.hardware import jax_at_least
from tests.test_fp8_decode import (CASES, check_bf16_kernel, check_combine_nan_split, check_flat_combine,
                                   check_fp8_kernel, check_mosaic_combine, check_nonfinite_key)

pytestmark = pytest.mark.skipif(not jax_at_least(0, 11),
                                reason=f"the Mosaic GPU interpreter runs these kernels from JAX 0.11 (this is "
                                       f"{jax.__version__})")


@pytest.fixture
def decode_interpreter(monkeypatch):
  """`interpreter`, without the end-of-kernel check of barrier phases no thread waited for."""
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory

  def deallocate(self):                     # Barrier.deallocate without that check
    with self.cv:
      self.ref_count -= 1

  monkeypatch.setattr(shared_memory.Barrier, "deallocate", deallocate)
  yield from _interpreted()


@pytest.fixture
def interpreter():
  """Mosaic GPU kernels traced inside run in the interpreter with race detection; the test fails on a race."""
  yield from _interpreted()


def _interpreted():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
  interpret_pallas_call.reset_gpu_interpret_mode_state()
  with force_gpu_interpret_mode(InterpretGPUParams(detect_races=True)):
    yield
  assert not interpret_pallas_call.get_races().races_found, "the interpreter saw a data race in shared memory"


@pytest.mark.parametrize("combine", ["mosaic", "mosaic-flat"])
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_decode_interpreted(name, combine, decode_interpreter):
  """test_kernel_gpu's checks with each Mosaic GPU combine: on the quantized queries == the float32 model, the
  whole call == the float64 oracle."""
  check_fp8_kernel(name, combine)


@pytest.mark.parametrize("combine", ["mosaic", "mosaic-flat"])
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_decode_interpreted(name, combine, decode_interpreter):
  """test_bf16_kernel_gpu's checks with each Mosaic GPU combine: == the float64 oracle."""
  check_bf16_kernel(name, combine)


@pytest.mark.parametrize("B,K,S,H,RN,T,G", [
    (1, 8, 32, 128, 8, 1, 4), (1, 2, 64, 64, 8, 1, 4), (2, 2, 16, 64, 16, 4, 4), (1, 2, 32, 64, 16, 4, 4),
    (1, 4, 8, 128, 24, 5, 4), (1, 2, 16, 64, 32, 8, 4), (2, 4, 64, 128, 40, 5, 8), (1, 2, 8, 64, 48, 6, 8),
    (1, 2, 4, 64, 56, 7, 8), (1, 8, 64, 128, 64, 16, 4), (1, 2, 128, 64, 8, 1, 4)])
def test_combine_interpreted(B, K, S, H, RN, T, G, interpreter):
  """The split combine at every row width (several splits a pipeline step for rows of 8, 16 and 32, one for the
  others; at 8 and 16 also over more steps than the ring's two slots, so slots are refilled), with an empty split,
  a row no split saw and unused lse rows holding NaN == the float64 join; the flat combine on the same partials."""
  check_mosaic_combine(B, K, S, H, RN, T, G, 5.0)
  check_flat_combine(B, K, S, H, RN, T, G, 5.0)


@pytest.mark.parametrize("combine", ["mosaic", "mosaic-flat"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_nonfinite_key_interpreted(fp8, combine, decode_interpreter):
  """A NaN key makes the rows that see it NaN (out and lse) through the decode and each Mosaic GPU combine."""
  check_nonfinite_key(fp8, combine)


@pytest.mark.parametrize("flat", [False, True], ids=["mosaic", "mosaic-flat"])
def test_combine_nan_split_interpreted(flat, interpreter):
  check_combine_nan_split(flat)


@pytest.mark.parametrize("L,P,Z,K,H,B,layer", [(3, 9, 64, 2, 128, 5, 2), (2, 12, 128, 4, 128, 8, 0)])
def test_fp8_page_write_interpreted(L, P, Z, K, H, B, layer, interpreter):
  """The Mosaic GPU fp8 page writer == XLA's write (lcjax.cache.kv._write_one_token), bit for bit: a page opened,
  a scale grown (the page requantized), scales kept, a row dropped, an all-zero token, an absmax at its scale
  rule's edge; 64- and 128-token pages."""
  from lcjax.ops.mosaic_gpu import page_write as mgpu_page_write
  from tests.test_fp8_page_write import _assert_same, _case, _reference
  case = _case(L=L, P=P, Z=Z, K=K, H=H, B=B)
  want = jax.jit(_reference)(*case, jnp.int32(layer))
  _assert_same(jax.jit(mgpu_page_write.write_token)(*case, jnp.int32(layer)), want)


def _gemv_weights(rng, L, N, Kd):
  """Stacked e4m3 weights [L, N, Kd] drawn at e4m3's scale and their per-channel scales [L, N, 1]."""
  w8 = jnp.asarray(rng.normal(size=(L, N, Kd)) * 30, jnp.float32).astype(jnp.float8_e4m3fn)
  return w8, jnp.asarray(rng.uniform(0.5, 2.0, size=(L, N, 1)), jnp.float32)


def _gemv_interpreted(x, w8, scale, norm=None, **tuning):
  """The interpreted GEMV kernel (its a_in_smem form) on layer 1, float32 out, as float64; norm = (s, eps) with eps
  static."""
  import numpy as np
  from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
  t = mgpu_gemv.MgpuGemvTuning(a_in_smem=True, **tuning)
  s, eps = norm or (None, None)
  fn = jax.jit(lambda x, w, sc, s: mgpu_gemv.gemv_stacked(x, w, sc, jnp.int32(1), GEMV_SPEC, tuning=t,
                                                           dtype=jnp.float32, norm=None if s is None else (s, eps)))
  return np.asarray(fn(x, w8, scale, s), np.float64)


GEMV_SPEC = "rd,nd->rn"


@pytest.mark.parametrize("R,dtype,tuning", [
    (1, jnp.bfloat16, dict()),                              # split_fixed's two parts
    (3, jnp.bfloat16, dict(num_ctas=5, block_k=128)),      # CTAs that share row blocks: several partial slots
    (8, jnp.bfloat16, dict(num_ctas=7, block_k=64)),
    (5, jnp.float32, dict(num_ctas=4)),                     # scale_rows' hi and lo parts, a row scale
    (2, jnp.float16, dict(num_ctas=3)),                     # float16 x as the wgmma's operand
    (6, jnp.bfloat16, dict(fixed_split=False, num_ctas=5)),
    (3, jnp.bfloat16, dict(scale_in_kernel=True, num_ctas=5)),
])
def test_gemv_interpreted(R, dtype, tuning, interpreter):
  """The fp8 GEMV kernel (its a_in_smem form) on layer 1 of 2 stacked weights [192, 512] with per-channel scales,
  against the float64 product of the widened weights: rows of 1 to 8, bf16 x in two parts by magnitude (values
  in both bands), row-scaled or scaled in the kernel, float32 and float16 x, over CTAs whose ranges split row
  blocks (partial slots summed after the kernel)."""
  import numpy as np
  from tests.test_fp8_gemv import _numpy_product
  rng = np.random.default_rng(R)
  w8, scale = _gemv_weights(rng, 2, 192, 512)
  x = rng.normal(size=(R, 512)) * np.where(rng.random((R, 512)) < 0.5, 1.0, 1e-3)   # |x| on both sides of 1/4
  x = jnp.asarray(x, dtype)
  got = _gemv_interpreted(x, w8, scale, **tuning)
  want = _numpy_product(x.astype(jnp.float32), w8, scale, 1, GEMV_SPEC)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("R,Kd,tuning", [(1, 512, dict()), (3, 512, dict(num_ctas=5, block_k=128)),
                                         (8, 2048, dict(num_ctas=7))])       # 2048: the row read 1024 at a time
def test_gemv_with_the_norm_inside_interpreted(R, Kd, tuning, interpreter):
  """gemv_stacked(norm=(s, eps)): the product of rms_norm(x) * s[layer] from bf16 x as it is, against the float64
  product of the float64 norm: within the float16 rounding of x * s (2^-11 of each term's magnitude), rows of very
  different scales (the factor is per row), values on both sides of NORM_BAND."""
  import numpy as np
  from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
  from tests.test_fp8_gemv import _normed64, _numpy_product
  rng = np.random.default_rng(10 + R)
  eps = 1e-5
  w8, scale = _gemv_weights(rng, 2, 192, Kd)
  s = jnp.asarray(rng.uniform(0.2, 3.0, size=(2, Kd)), jnp.bfloat16)
  x = rng.normal(size=(R, Kd)) * np.where(rng.random((R, Kd)) < 0.5, 1.0, 1e-3) * (10.0 ** np.arange(R) % 7)[:, None]
  x = jnp.asarray(x, jnp.bfloat16)
  got = _gemv_interpreted(x, w8, scale, norm=(s, eps), **tuning)
  xn = _normed64(x, s[1], eps)
  want = _numpy_product(xn, w8, scale, 1, GEMV_SPEC)
  bound = 2.0 ** -11 * _numpy_product(np.abs(xn), jnp.abs(w8.astype(jnp.float32)), scale, 1, GEMV_SPEC)
  assert (np.abs(got - want) <= bound + 1e-6 * np.abs(want).max()).all(), np.abs(got - want).max()
  for args, why in (((x.astype(jnp.float32), w8, scale, s), f"got float32 x and a scale (2, {Kd})"),
                    ((x[:, :64], w8[:, :, :64], scale, s[:, :64]), "got bfloat16 x and a scale (2, 64)")):
    with pytest.raises(ValueError, match=r"norm inside takes bfloat16 x, .* multiple of 128 .*, " + re.escape(why)):
      mgpu_gemv.gemv_stacked(*args[:3], jnp.int32(1), GEMV_SPEC, norm=(args[3], eps))


def test_gemv_with_the_norm_inside_at_the_split_edges(interpreter):
  """Rows that each hold one value at an edge of the norm's float16 parts, so that every output is checked against
  one rounding (no sum to average errors out): x * s = 32767 2^-17 (just below 1/4: a bf16 x times a bf16 s, which
  a band edge at 1/4 overflowed), 0.30078125 (a subnormal hi under that band), 2 - 2^-7 and 2 (either side of
  NORM_BAND), 3e4, 2^-20; a row of ~1e-3 values (eps weighs in its factor) and a row of normal draws."""
  import numpy as np
  from tests.test_fp8_gemv import _normed64, _numpy_product
  rng = np.random.default_rng(7)
  L, Kd, eps = 2, 256, 1e-5
  w8, scale = _gemv_weights(rng, L, 128, Kd)
  s = np.ones((L, Kd))
  s[1, 5] = 217 / 2 ** 8
  x = np.zeros((8, Kd))
  for r, (col, v) in enumerate([(5, 151 / 2 ** 9), (77, 0.30078125), (100, 2 - 2 ** -7), (130, 2.0), (200, 3e4),
                                (250, 2.0 ** -20)]):
    x[r, col] = v
  x[6] = rng.normal(size=Kd) * 1e-3
  x[7] = rng.normal(size=Kd)
  x, s = jnp.asarray(x, jnp.bfloat16), jnp.asarray(s, jnp.bfloat16)
  got = _gemv_interpreted(x, w8, scale, norm=(s, eps), num_ctas=3)
  xn = _normed64(x, s[1], eps)
  want = _numpy_product(xn, w8, scale, 1, GEMV_SPEC)
  assert np.isfinite(got).all()
  bound = (2.0 ** -11 * _numpy_product(np.abs(xn), jnp.abs(w8.astype(jnp.float32)), scale, 1, GEMV_SPEC)
           * (1 + 2.0 ** -10))                                            # the factor's own float32 rounding
  assert (np.abs(got - want) <= bound).all(), np.max(np.abs(got - want) / bound)
