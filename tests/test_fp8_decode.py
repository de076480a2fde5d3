"""The fp8 paged decode kernel (lcjax.ops.mgpu_paged): e4m3 Q K^T straight from fp8 pages, float16 P @ V.

CPU: its jnp model against the float64 oracle, the query quantization, the split heuristic, the routing of the
pallas backend, and the kernel's lowering to its CUDA custom call (catches API drift without a GPU). GPU (`-m gpu`):
the kernel against its model (same quantization: tight) and against the float64 oracle of unquantized queries.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.ops import mgpu_paged
from lcjax.ops import pallas_flash
from lcjax.ops import pallas_paged
from tests.test_kernels import check, oracle, rand_pages, visibility

ON_GPU = jax.default_backend() == "gpu"

# (B, T, N, K, H, Z, M, kv_len, q_pos shift of row (0, 0), num_splits)
CASES = {
    # Llama-3's GQA 4, one query, 64-token pages: a full sequence, ragged ones, one empty row
    "T1-G4-Z64": (4, 1, 32, 8, 128, 64, 24, (1536, 1000, 2, 0), 0, None),
    # two queries (speculative decode), one of them 70 keys inside the cache; 128-token pages in two blocks
    "T2-G4-Z128": (3, 2, 16, 4, 128, 128, 9, (1152, 300, 65), -70, None),
    # GQA 8 at head dim 64, 256-token pages, many splits (some halves of a split without a block)
    "T1-G8-H64-Z256": (2, 1, 8, 1, 64, 256, 6, (1536, 200), 0, 8),
    # 16 rows per kv head (four queries of GQA 4): two 8-column groups of the score tile
    "T4-G4-Z64": (2, 4, 16, 4, 128, 64, 12, (700, 64), -30, 2),
}


def _inputs(case, seed=0):
  B, T, N, K, H, Z, M, kv_len, shift, splits = case
  off, P = 3, B * M + 5
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(seed, B, T, N, K, H, Z, M, P, fp8=True)
  junk = lambda x, v: jnp.concatenate([jnp.full((off, *x.shape[1:]), v, x.dtype), x])
  kv_len = jnp.array(kv_len, jnp.int32)
  q_pos = jnp.maximum(kv_len[:, None] - T, 0) + jnp.arange(T, dtype=jnp.int32)[None, :]
  q_pos = q_pos.at[0, 0].add(shift)
  args = (q, junk(kp, 50.0), junk(vp, 50.0), table)
  kw = dict(q_pos=q_pos, kv_len=kv_len, k_scale=junk(ks, 100.0), v_scale=junk(vs, 100.0), page_offset=off)
  want = oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True))
  return args, kw, want, splits


def test_quantize_rows_carries_the_queries_to_2e_8():
  q = jax.random.normal(jax.random.key(0), (2, 2, 8, 64), jnp.float32) * jnp.arange(1, 9)[None, None, :, None]
  q8, qs = mgpu_paged.quantize_rows(q, K=2)
  assert q8.shape == (2, 2, 2, 8, 64) and q8.dtype == jnp.float8_e4m3fn and qs.shape == (2, 2)
    # Row t * G + g of kv head h is query head h * G + g at token t; the rows' largest value maps to 448.
  hi = np.asarray(q8[:, :, 0, :8].astype(jnp.float32)) * np.asarray(qs)[:, :, None, None]
  want = np.asarray(q).reshape(2, 2, 2, 4, 64).transpose(0, 2, 1, 3, 4).reshape(2, 2, 8, 64)
  np.testing.assert_allclose(np.abs(hi).max(axis=(2, 3)), np.abs(want).max(axis=(2, 3)), rtol=1e-6)
  err = lambda x: np.abs(x - np.asarray(q)) / np.abs(np.asarray(q)).max()
  one = np.asarray(q8[:, :, 0, :8]).astype(np.float32) * np.asarray(qs)[:, :, None, None]
  one = one.reshape(2, 2, 2, 4, 64).transpose(0, 2, 1, 3, 4).reshape(2, 2, 8, 64)
  both = np.asarray(mgpu_paged.dequantize_rows(q8, qs, 2, 4))
  assert err(one).max() > 2 ** -9                                          # one e4m3 term: ~2^-5 of the absmax
  assert err(both).max() < 2 ** -9                                         # both: within 2^-9 of it
  q8, _ = mgpu_paged.quantize_rows(q[:, :1, :6], K=2)                     # 3 rows per kv head, padded to 8
  assert q8.shape == (2, 2, 2, 8, 64) and not np.asarray(q8[:, :, :, 3:].astype(jnp.float32)).any()


@pytest.mark.parametrize("name", list(CASES))
def test_model_against_the_oracle(name):
  """The model (and so the kernel's arithmetic) is attention within e4m3's rounding of the queries."""
  args, kw, want, _ = _inputs(CASES[name])
  q, rest = args[0], args[1:]
  B, T, N, H = q.shape
  K = rest[0].shape[2]
  model = mgpu_paged.paged_decode_quantized_model(*mgpu_paged.quantize_rows(q, K), *rest, **kw, T=T, G=N // K)
  check(model, want, tol_out=3e-3, tol_lse=2e-3)


def test_split_heuristic_is_a_power_of_two_near_two_ctas_per_sm():
  T = mgpu_paged.Fp8DecodeTuning
  assert mgpu_paged.num_splits_for(T(), 1, 8, 2048) == 32                 # 256 CTAs, two per SM
  assert mgpu_paged.num_splits_for(T(), 8, 8, 8192) == 4
  assert mgpu_paged.num_splits_for(T(), 64, 8, 8192) == 1
  assert mgpu_paged.num_splits_for(T(), 1, 8, 20) == 4                    # at least 4 pages a split
  assert mgpu_paged.num_splits_for(T(num_splits=6), 1, 8, 100) == 4


def test_why_not_names_the_values():
  assert mgpu_paged.why_not(head_dim=128, page_size=128, rows=4) is None
  assert "page_size=32" in mgpu_paged.why_not(head_dim=128, page_size=32, rows=4)
  assert "head_dim=96" in mgpu_paged.why_not(head_dim=96, page_size=64, rows=4)
  assert "128 query rows" in mgpu_paged.why_not(head_dim=128, page_size=64, rows=128)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    z = jnp.zeros((4, 64, 1, 64), jnp.bfloat16)
    mgpu_paged.paged_decode_fp8(jnp.zeros((1, 1, 4, 64)), z, z, jnp.zeros((1, 2), jnp.int32), q_pos=jnp.zeros((1, 1)),
                                kv_len=jnp.ones((1,)), k_scale=jnp.ones((4, 1)), v_scale=jnp.ones((4, 1)))


def test_pallas_backend_routes_fp8_decode_rows_to_the_fp8_kernel(monkeypatch, caplog):
  """Decode rows over fp8 pages take the Mosaic GPU kernel; pages it cannot read (32 tokens) take the Triton
  kernel with one warning naming the reason; bf16 pages and interpret mode never reach it."""
  calls = []
  monkeypatch.setattr(mgpu_paged, "paged_decode_fp8", lambda *a, **k: calls.append("mgpu") or "mgpu")
  monkeypatch.setattr(pallas_paged, "paged_decode", lambda *a, **k: calls.append("triton") or "triton")
  be = pallas_flash.PallasBackend()
  q = jnp.zeros((2, 1, 8, 64), jnp.bfloat16)
  table, qp, kl = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
  sc = jnp.ones((9, 2), jnp.float32)
  for Z, dt, scale in ((64, jnp.float8_e4m3fn, sc), (32, jnp.float8_e4m3fn, sc), (64, jnp.bfloat16, None)):
    pages = jnp.zeros((9, Z, 2, 64), dt)
    with caplog.at_level("WARNING"):
      be.paged(q, pages, pages, table, q_pos=qp, kv_len=kl, k_scale=scale, v_scale=scale)
  assert calls == ["mgpu", "triton", "triton"]
  assert sum("page_size=32" in r.getMessage() for r in caplog.records) <= 1
  pallas_flash.PallasBackend(interpret=True).paged(q, pages.astype(jnp.float8_e4m3fn), pages.astype(
      jnp.float8_e4m3fn), table, q_pos=qp, kv_len=kl, k_scale=sc, v_scale=sc)
  assert calls[-1] == "triton"


@pytest.mark.parametrize("T,H,Z", [(1, 128, 64), (2, 64, 256)])
def test_kernel_lowers_for_cuda(T, H, Z):
  sd = jax.ShapeDtypeStruct
  e4 = jnp.float8_e4m3fn
  B, N, K, M, P = 2, 16, 4, 8, 40
  f = jax.jit(mgpu_paged.paged_decode_fp8)
  lowered = f.trace(sd((B, T, N, H), jnp.bfloat16), sd((P, Z, K, H), e4), sd((P, Z, K, H), e4), sd((B, M), jnp.int32),
                    q_pos=sd((B, T), jnp.int32), kv_len=sd((B,), jnp.int32), k_scale=sd((P, K), jnp.float32),
                    v_scale=sd((P, K), jnp.float32)).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_gpu(name):
  args, kw, want, splits = _inputs(CASES[name], seed=1)
  q, rest = args[0], args[1:]
  B, T, N, H = q.shape
  K = rest[0].shape[2]
  tuning = mgpu_paged.Fp8DecodeTuning(num_splits=splits)
  q8, qs = mgpu_paged.quantize_rows(q, K)
  got = mgpu_paged.paged_decode_quantized(q8, qs, *rest, **kw, T=T, G=N // K, out_dtype=jnp.float32, tuning=tuning)
  with jax.default_matmul_precision("highest"):                          # the GPU's default would be TF32
    model = mgpu_paged.paged_decode_quantized_model(q8, qs, *rest, **kw, T=T, G=N // K)
  # The same quantized queries: the fp8 wgmma accumulates with less than float32 precision (2.5e-4 measured on
  # the H200 against this model), P is float16 in P @ V, and float32 sums run in another order.
  check(got, tuple(np.asarray(x, np.float64) for x in model), tol_out=2e-3, tol_lse=5e-4)
  # The whole call (the queries quantized inside) against the float64 oracle.
  check(mgpu_paged.paged_decode_fp8(*args, **kw, tuning=tuning), want, tol_out=3e-3, tol_lse=3e-3)
