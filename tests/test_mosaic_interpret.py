"""The Mosaic GPU decode and split-combine kernels run on CPUs in Pallas' Mosaic GPU interpreter (JAX >= 0.11).

The interpreter simulates a CTA's warpgroups as threads, its shared memory, TMA copies, barriers and wgmma on
shared-memory operands, and records data races between the warpgroups' reads and writes of shared memory. These
tests run the fp8 and bfloat16 paged decode kernels (lcjax.ops.mosaic_gpu.paged, with the Mosaic GPU combine) on
every case of test_fp8_decode's GPU tests and the split combine (lcjax.ops.mosaic_gpu.combine) at every row width
the engine gives it, against the same oracles as the GPU tests, and fail on any race the interpreter saw. The GEMV
kernel (lcjax.ops.mosaic_gpu.gemv) is not among them: its wgmma takes the weight tile from registers, which the
interpreter does not model.

The interpreter counts a barrier phase that no thread waited for as an error when the kernel ends. The decode
kernel's compute warpgroup frees ring slots the memory warpgroup never refills (the last `max_concurrent_steps`),
which on a GPU is harmless; the `interpreter` fixture drops that end-of-kernel check and keeps every other.
JAX 0.10 has no interpreter for these kernels (no layout_cast on CPU): the module is skipped there.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.ops.mosaic_gpu import combine as mgpu_combine
from lcjax.ops.mosaic_gpu import paged as mgpu_paged
from tests.test_fp8_decode import CASES, TOL_MODEL_LSE, TOL_MODEL_ROW, _inputs, _numpy_join, _partials, check, \
    check_rows

pytestmark = pytest.mark.skipif(tuple(map(int, jax.__version__.split(".")[:2])) < (0, 11),
                                reason=f"the Mosaic GPU interpreter runs these kernels from JAX 0.11 (this is "
                                       f"{jax.__version__})")


@pytest.fixture
def interpreter(monkeypatch):
  """Mosaic GPU kernels traced inside run in the interpreter with race detection; the test fails on a race."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, shared_memory
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode

  def deallocate(self):                     # Barrier.deallocate without the check of phases no thread waited for
    with self.cv:
      self.ref_count -= 1

  monkeypatch.setattr(shared_memory.Barrier, "deallocate", deallocate)
  interpret_pallas_call.reset_gpu_interpret_mode_state()
  with force_gpu_interpret_mode(InterpretGPUParams(detect_races=True)):
    yield
  assert not interpret_pallas_call.get_races().races_found, "the interpreter saw a data race in shared memory"


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_decode_interpreted(name, interpreter):
  """The fp8 decode kernel and the Mosaic GPU combine on the quantized queries == their float32 model, and the whole
  call == the float64 oracle, at test_kernel_gpu's tolerances."""
  args, kw, want, tuning = _inputs(CASES[name], seed=1)
  tuning = dataclasses.replace(tuning, combine="mosaic")
  q, rest = args[0], args[1:]
  B, T, N, H = q.shape
  K = rest[0].shape[2]
  q8, qs = mgpu_paged.quantize_rows(q, K)
  got = mgpu_paged.paged_decode_quantized(q8, qs, *rest, **kw, T=T, G=N // K, out_dtype=jnp.float32, tuning=tuning)
  model = mgpu_paged.paged_decode_quantized_model(q8, qs, *rest, **kw, T=T, G=N // K)
  check(got, tuple(np.asarray(x, np.float64) for x in model), tol_out=2e-3, tol_lse=5e-4)
  check_rows(got, tuple(np.asarray(x, np.float64) for x in model), tol_row=5e-3, tol_lse=5e-3)
  got = mgpu_paged.paged_decode_fp8(*args, **kw, tuning=tuning)
  check(got, want, tol_out=3e-3, tol_lse=3e-3)
  check_rows(got, want, tol_row=TOL_MODEL_ROW + 3e-3, tol_lse=TOL_MODEL_LSE + 3e-3)


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_decode_interpreted(name, interpreter):
  """The bfloat16 decode kernel and the Mosaic GPU combine == the float64 oracle (test_bf16_kernel_gpu's
  tolerances: P is rounded to bfloat16 for P @ V)."""
  args, kw, want, tuning = _inputs(CASES[name], seed=1, fp8=False)
  got = mgpu_paged.paged_decode_bf16(*args, **kw, tuning=dataclasses.replace(tuning, combine="mosaic"))
  assert got[0].dtype == jnp.bfloat16
  check(got, want, tol_out=1e-2, tol_lse=1e-3)
  check_rows(got, want, tol_row=1e-2, tol_lse=2e-3)


@pytest.mark.parametrize("B,K,S,H,RN,T,G", [
    (1, 8, 32, 128, 8, 1, 4), (2, 2, 16, 64, 16, 4, 4), (1, 4, 8, 128, 24, 5, 4), (1, 2, 16, 64, 32, 8, 4),
    (2, 4, 64, 128, 40, 5, 8), (1, 2, 4, 64, 56, 7, 8), (1, 8, 64, 128, 64, 16, 4)])
def test_combine_interpreted(B, K, S, H, RN, T, G, interpreter):
  """The split combine at every row width (several splits a pipeline step for rows of 8, 16 and 32, one for the
  others), with an empty split, a row no split saw and unused lse rows holding NaN == the float64 join."""
  S2 = mgpu_combine.lse_rows(S, RN)
  o, lse = _partials(B + S, B, K, S, H, RN, S=S, spread=5.0)
  lse = jnp.concatenate([lse, jnp.full((B, K, S2 - S, RN), jnp.nan, jnp.float32)], axis=2)
  want, want_lse = _numpy_join(o, lse, S, T, G)
  out, lse_out = mgpu_combine.combine_splits(o, lse, T=T, G=G, out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse_out), want_lse, rtol=2e-5, atol=2e-5)
