"""The fp8 paged decode kernel (lcjax.ops.mosaic_gpu.paged): e4m3 Q K^T straight from fp8 pages, float16 P @ V.

CPU: its jnp model against the float64 oracle, the query quantization, the split heuristic, the routing of the
pallas backend, and the kernel's lowering to its CUDA custom call (catches API drift without a GPU). GPU (`-m gpu`):
the kernel against its model (same quantization: tight) and against the float64 oracle of unquantized queries,
with either split combine, and the Mosaic GPU combine against a float64 join.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.ops import attention as ref
from lcjax.ops import hardware
from lcjax.ops.mosaic_gpu import paged as mgpu_paged
from lcjax.ops import pallas_backend, splits
from lcjax.ops.mosaic_gpu import combine as mgpu_combine
from lcjax.ops.triton import paged as triton_paged
from tests.test_kernels import behind_junk, check, oracle, rand_pages, visibility
from tests.test_mosaic_lowering import TRITON_CROSS_LOWERS

ON_GPU = jax.default_backend() == "gpu"

# (B, T, N, K, H, Z, M, kv_len, q_pos shift of row (0, 0), DecodeTuning fields)
CASES = {
    # Llama-3's GQA 4, one query, 64-token pages: a full sequence, ragged ones, one empty row
    "T1-G4-Z64": (4, 1, 32, 8, 128, 64, 24, (1536, 1000, 2, 0), 0, {}),
    # two queries (speculative decode), one of them 70 keys inside the cache; 128-token pages in two blocks
    "T2-G4-Z128": (3, 2, 16, 4, 128, 128, 9, (1152, 300, 65), -70, {}),
    # GQA 8 at head dim 64, 256-token pages; num_splits 8 -> 4 splits of 2 pages: the last lies wholly past the
    # 6-page table, and sequence 1's 200 tokens leave three splits without a block
    "T1-G8-H64-Z256": (2, 1, 8, 1, 64, 256, 6, (1536, 200), 0, {"num_splits": 8}),
    # 16 rows per kv head (four queries of GQA 4): two 8-column groups of the score tile
    "T4-G4-Z64": (2, 4, 16, 4, 128, 64, 12, (700, 64), -30, {"num_splits": 2}),
    # one query 100 keys before the end of its cache (the keys past it are masked by q_pos, not kv_len); a ring
    # of two slots
    "T1-G4-early-mcs2": (2, 1, 16, 4, 128, 64, 10, (640, 300), -100, {"max_concurrent_steps": 2}),
    # a verify step of four drafts (5 queries of GQA 4 = 20 rows): the default ring is 3 slots (`ring_depth`)
    "T5-G4-Z64-ring3": (2, 5, 16, 4, 128, 64, 10, (640, 300), -20, {}),
    # the most rows the kernel takes (16 queries of GQA 4 = 64), 192-token pages read as three blocks each
    "T16-G4-Z192": (2, 16, 8, 2, 128, 192, 4, (768, 400), -40, {}),
    # kv_len and the query past the 6-page table; 8 splits of one page: the last two cover slots 6 and 7, clamped
    # to slot 5, whose keys must not count again
    "T1-G8-H64-Z256-past": (2, 1, 8, 1, 64, 256, 6, (1600, 1537), 0, {"num_splits": 8}),
}


# The model (attention over the queries' two e4m3 terms) against the float64 oracle, every case and seeds 0 and 1
# on CPU: worst row relative error 1.64e-3, worst |lse| error 1.34e-3.
TOL_MODEL_ROW, TOL_MODEL_LSE = 2.5e-3, 2e-3


def _inputs(case, seed=0, *, fp8=True):
  B, T, N, K, H, Z, M, kv_len, shift, tuning = case
  off, P = 3, B * M + 5
  q, kp, vp, table, ks, vs, kd, vd = rand_pages(seed, B, T, N, K, H, Z, M, P, fp8=fp8)
  junk = functools.partial(behind_junk, n=off)
  q_pos = np.maximum(np.array(kv_len)[:, None] - T, 0) + np.arange(T)[None, :]
  q_pos[0, 0] += shift
  kv_len, q_pos = jnp.array(kv_len, jnp.int32), jnp.asarray(q_pos, jnp.int32)
  args = (q, junk(kp, value=50.0), junk(vp, value=50.0), table)
  kw = dict(q_pos=q_pos, kv_len=kv_len, page_offset=off)
  if fp8:
    kw |= dict(k_scale=junk(ks, value=100.0), v_scale=junk(vs, value=100.0))
  want = oracle(q, kd, vd, visibility(q_pos, np.zeros(B, int), kv_len, M * Z, True))
  return args, kw, want, mgpu_paged.DecodeTuning(**tuning)


def check_rows(got, want, *, tol_row, tol_lse):
  """`check`'s masked-row rules, then the worst row: max over query rows of ||out - want|| / ||want|| (a norm over
  the whole output lets short rows, whose outputs are largest, hide the long ones) and max |lse - want|."""
  check(got, want, tol_out=tol_row, tol_lse=1.0)
  out, lse = (np.asarray(x, np.float64) for x in got)
  w_out, w_lse = want
  fin = np.isfinite(w_lse)
  row = np.linalg.norm(out - w_out, axis=-1)[fin] / np.linalg.norm(w_out, axis=-1)[fin]
  assert row.max() < tol_row, f"worst row rel err {row.max():.2e}"
  lerr = np.abs(lse[fin] - w_lse[fin]).max()
  assert lerr < tol_lse, f"lse abs err {lerr:.2e}"


def test_quantize_rows_orders_rows_and_carries_the_queries_within_2_pow_minus_9():
  B, T, N, K, H = 2, 2, 8, 2, 64
  G = N // K
  q = jax.random.normal(jax.random.key(0), (B, T, N, H), jnp.float32) * jnp.arange(1, 9)[None, None, :, None]
  q8, qs = mgpu_paged.quantize_rows(q, K)
  assert q8.shape == (B, K, 2, 8, H) and q8.dtype == jnp.float8_e4m3fn and qs.shape == (B, K)
  qn, q8n, qsn = np.asarray(q), np.asarray(q8.astype(jnp.float32)), np.asarray(qs)
  deq = np.asarray(mgpu_paged.dequantize_rows(q8, qs, T, G))
  top = np.abs(qn).reshape(B, T, K, G, H).max(axis=(1, 3, 4))                 # [B, K]
  np.testing.assert_allclose(qsn, top / 448, rtol=1e-6)                        # the rows' absmax maps to 448
  for t in range(T):
    for h in range(K):
      for g in range(G):                                                       # row t * G + g: head h * G + g
        hi = q8n[:, h, 0, t * G + g] * qsn[:, h, None]
        both = hi + q8n[:, h, 1, t * G + g] / mgpu_paged.LO * qsn[:, h, None]
        want = qn[:, t, h * G + g]
        assert np.abs(hi - want).max() <= 2 ** -4 * top.max()                  # one e4m3 term
        assert np.abs(both - want).max() < 2 ** -9 * top[:, h].min()           # both terms
        np.testing.assert_allclose(deq[:, t, h * G + g], both, rtol=1e-6, atol=1e-6)
  q8, _ = mgpu_paged.quantize_rows(q[:, :1, :6], K)                           # 3 rows per kv head, padded to 8
  assert q8.shape == (B, K, 2, 8, H) and not np.asarray(q8[:, :, :, 3:].astype(jnp.float32)).any()
  q8, qs = mgpu_paged.quantize_rows(q.at[1, :, G:2 * G].set(0.0), K)          # kv head 1 of sequence 1: all zero
  assert float(qs[1, 1]) == np.float32(1e-12) * np.float32(1 / 448)           # the floor, not 0 (0 / 0: NaN)
  assert not np.asarray(q8[1, 1].astype(jnp.float32)).any() and np.isfinite(np.asarray(q8.astype(jnp.float32))).all()


@pytest.mark.parametrize("name", ["T1-G4-Z64", "T16-G4-Z192", "T1-G8-H64-Z256-past"])  # the GPU test: every case
def test_model_against_the_oracle(name):
  """The queries' two e4m3 terms cost little: attention over them is within ~1e-3 of the exact queries'."""
  args, kw, want, _ = _inputs(CASES[name])
  q, rest = args[0], args[1:]
  B, T, N, H = q.shape
  K = rest[0].shape[2]
  model = mgpu_paged.paged_decode_quantized_model(*mgpu_paged.quantize_rows(q, K), *rest, **kw, T=T, G=N // K)
  check_rows(model, want, tol_row=TOL_MODEL_ROW, tol_lse=TOL_MODEL_LSE)


def test_split_heuristic_is_a_power_of_two_near_two_ctas_per_sm():
  T = mgpu_paged.DecodeTuning
  assert mgpu_paged.num_splits_for(T(), 1, 8, 2048) == 32                 # 256 CTAs, two per SM
  assert mgpu_paged.num_splits_for(T(), 8, 8, 8192) == 4
  assert mgpu_paged.num_splits_for(T(), 64, 8, 8192) == 1
  assert mgpu_paged.num_splits_for(T(), 1, 8, 20) == 4                    # at least 4 pages a split
  assert mgpu_paged.num_splits_for(T(num_splits=6), 1, 8, 100) == 4
  assert mgpu_paged.num_splits_for(T(), 9, 8, 8192) == 2                 # 264 // 72 = 3 wanted: at most the target
  assert mgpu_paged.num_splits_for(T(), 32, 8, 8192) == 1


def _requested_smem(monkeypatch, T, G, mcs, page_dtype):
  """The scoped shared memory Pallas's Mosaic GPU lowering asks for one CTA of the decode kernel (cross-lowered for
  CUDA; read where the lowering hands it to Mosaic GPU)."""
  from jax._src.pallas.mosaic_gpu import lowering
  if not hasattr(lowering.mgpu_core, "_lower_as_gpu_kernel"):
    pytest.skip("this JAX's Pallas Mosaic GPU lowering has no _lower_as_gpu_kernel to read the request from")
  asked = []
  real = lowering.mgpu_core._lower_as_gpu_kernel
  monkeypatch.setattr(lowering.mgpu_core, "_lower_as_gpu_kernel",
                      lambda *a, **kw: (asked.append(kw["smem_scratch_shape"][0].shape[0]), real(*a, **kw))[1])
  sd = jax.ShapeDtypeStruct
  B, K, M, P, H, Z = 1, 2, 8, 40, 128, 64
  tuning = mgpu_paged.DecodeTuning(max_concurrent_steps=mcs, combine="mosaic")
  q, pages, rows = sd((B, T, K * G, H), jnp.bfloat16), sd((P, Z, K, H), page_dtype), dict(
      q_pos=sd((B, T), jnp.int32), kv_len=sd((B,), jnp.int32))
  if page_dtype == jnp.float8_e4m3fn:
    f, rows = mgpu_paged.paged_decode_fp8, rows | dict(k_scale=sd((P, K), jnp.float32), v_scale=sd((P, K), jnp.float32))
  else:
    f = mgpu_paged.paged_decode_bf16
  jax.jit(functools.partial(f, tuning=tuning)).trace(q, pages, pages, sd((B, M), jnp.int32), **rows).lower(
      lowering_platforms=("cuda",))
  return asked[0]


@pytest.mark.parametrize("T,G,mcs,page_dtype", [(1, 4, 4, jnp.float8_e4m3fn), (5, 4, 3, jnp.float8_e4m3fn),
                                                (5, 8, 2, jnp.float8_e4m3fn), (16, 4, 4, jnp.float8_e4m3fn),
                                                (1, 4, 2, jnp.bfloat16)])
def test_smem_bytes_is_what_the_lowering_asks_for(T, G, mcs, page_dtype, monkeypatch):
  RN = -(-T * G // 8) * 8
  want = _requested_smem(monkeypatch, T, G, mcs, page_dtype)
  assert mgpu_paged.smem_bytes(RN=RN, H=128, mcs=mcs, page_dtype=page_dtype) == want


def test_ring_depth_is_the_deepest_that_two_ctas_an_sm_hold():
  e4, bf = jnp.float8_e4m3fn, jnp.bfloat16
  depth = lambda RN, page=e4, **kw: mgpu_paged.ring_depth(mgpu_paged.DecodeTuning(**kw), RN=RN, H=128, page_dtype=page)
  assert [depth(RN) for RN in (8, 16, 24, 32, 40, 48, 56, 64)] == [4, 3, 3, 3, 2, 2, 4, 4]
  assert depth(24, max_concurrent_steps=4) == 4 and depth(8, max_concurrent_steps=2) == 2   # asked for: taken
  assert depth(8, bf) == 3                             # bf16 pages: 16 KiB a slot, no widened V
  fits = lambda RN, mcs: 2 * (mgpu_paged.smem_bytes(RN=RN, H=128, mcs=mcs, page_dtype=e4)
                              + mgpu_paged.SMEM_RESERVED) <= 228 * 1024
  for RN in (8, 16, 24, 32, 40, 48):
    mcs = depth(RN)
    assert fits(RN, mcs) and (mcs == 4 or not fits(RN, mcs + 1))   # one slot more and the second CTA would not fit


def test_why_not_names_the_values():
  assert mgpu_paged.why_not(head_dim=128, page_size=128, rows=4) is None
  assert "page_size=32" in mgpu_paged.why_not(head_dim=128, page_size=32, rows=4)
  assert "head_dim=96" in mgpu_paged.why_not(head_dim=96, page_size=64, rows=4)
  assert "128 query rows" in mgpu_paged.why_not(head_dim=128, page_size=64, rows=128)
  assert "float8_e5m2" in mgpu_paged.why_not(head_dim=128, page_size=64, rows=4, page_dtype=jnp.float8_e5m2)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    z = jnp.zeros((4, 64, 1, 64), jnp.bfloat16)
    mgpu_paged.paged_decode_fp8(jnp.zeros((1, 1, 4, 64)), z, z, jnp.zeros((1, 2), jnp.int32), q_pos=jnp.zeros((1, 1)),
                                kv_len=jnp.ones((1,)), k_scale=jnp.ones((4, 1)), v_scale=jnp.ones((4, 1)))


def test_pallas_backend_routes_fp8_decode_rows_to_the_fp8_kernel(monkeypatch, caplog):
  """Decode rows over fp8 pages take the Mosaic GPU fp8 kernel on a Hopper GPU (bf16 pages the bf16 one); pages it
  cannot read (32 tokens) or another GPU take the Triton kernel with one warning naming the reason; interpret mode
  never reaches it."""
  calls = []
  monkeypatch.setattr(hardware, "on_sm90", lambda: None)                       # as on a Hopper GPU
  monkeypatch.setattr(ref, "_announced", set())
  monkeypatch.setattr(mgpu_paged, "paged_decode_fp8", lambda *a, **k: calls.append("mgpu") or "mgpu")
  monkeypatch.setattr(mgpu_paged, "paged_decode_bf16", lambda *a, **k: calls.append("mgpu-bf16") or "mgpu-bf16")
  monkeypatch.setattr(triton_paged, "paged_decode", lambda *a, **k: calls.append("triton") or "triton")
  be = pallas_backend.PallasBackend()
  q = jnp.zeros((2, 1, 8, 64), jnp.bfloat16)
  table, qp, kl = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
  sc = jnp.ones((9, 2), jnp.float32)
  cases = ((64, jnp.float8_e4m3fn, sc), (32, jnp.float8_e4m3fn, sc), (32, jnp.float8_e4m3fn, sc),
           (64, jnp.bfloat16, None))
  for Z, dt, scale in cases:
    pages = jnp.zeros((9, Z, 2, 64), dt)
    with caplog.at_level("WARNING"):
      be.paged(q, pages, pages, table, q_pos=qp, kv_len=kl, k_scale=scale, v_scale=scale)
  assert calls == ["mgpu", "triton", "triton", "mgpu-bf16"]
  assert sum("page_size=32" in r.getMessage() for r in caplog.records) == 1    # once per process
  monkeypatch.setattr(hardware, "on_sm90", lambda: "not Hopper")
  be.paged(q, pages.astype(jnp.float8_e4m3fn), pages.astype(jnp.float8_e4m3fn), table, q_pos=qp, kv_len=kl,
           k_scale=sc, v_scale=sc)
  assert calls[-1] == "triton"
  pallas_backend.PallasBackend(interpret=True).paged(q, pages.astype(jnp.float8_e4m3fn), pages.astype(
      jnp.float8_e4m3fn), table, q_pos=qp, kv_len=kl, k_scale=sc, v_scale=sc)
  assert calls[-1] == "triton"
  monkeypatch.setattr(hardware, "on_sm90", lambda: None)
  fp8 = jnp.zeros((9, 64, 2, 64), jnp.float8_e4m3fn)
  for backend in (be, pallas_backend.PallasBackend(interpret=True)):         # the page dtype routes, not the scale
    with pytest.raises(ValueError, match="needs their k_scale and v_scale"):
      backend.paged(q, fp8, fp8, table, q_pos=qp, kv_len=kl)


def _numpy_join(o, lse, S, T, G):
  """The first S splits of partials o [B, K, S2, H, RN], lse [B, K, S2, RN] joined by their LSE in float64 ->
  (out [B, T, N, H], lse [B, T, N]), rows r = t * G + g < T * G."""
  B, K, _, H, _ = o.shape
  on, ln = np.asarray(o, np.float64)[:, :, :S], np.asarray(lse, np.float64)[:, :, :S]
  top = ln.max(axis=2, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  w = np.exp(ln - top)                                                       # [B, K, S, RN]
  tot = w.sum(axis=2)
  join = np.einsum("bksr,bkshr->bkrh", w, on) / np.where(tot > 0, tot, 1.0)[..., None]       # [B, K, RN, H]
  out = join[:, :, :T * G].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, K * G, H)
  with np.errstate(divide="ignore"):
    lse_out = np.log(tot) + top[:, :, 0]
  return out, lse_out[:, :, :T * G].reshape(B, K, T, G).transpose(0, 2, 1, 3).reshape(B, T, K * G)


def _partials(seed, B, K, S2, H, RN, *, S, spread=1.0):
  """Random split partials [B, K, S2, H, RN] and lse [B, K, S2, RN] (spread: the lse's scale): kv head 1 of
  sequence 0 has an empty split (lse -inf) and row 0 of its kv head 0 no split at all; splits >= S hold NaN."""
  ks = jax.random.split(jax.random.key(seed), 2)
  o = jax.random.normal(ks[0], (B, K, S2, H, RN), jnp.float32)
  lse = jax.random.normal(ks[1], (B, K, S2, RN), jnp.float32) * spread
  lse = lse.at[0, min(1, K - 1), min(1, S - 1)].set(-jnp.inf).at[0, 0, :, 0].set(-jnp.inf)
  return o, lse.at[:, :, S:].set(jnp.nan)                                    # never written: never read


def test_combine_reads_transposed_partials():
  """The split combine (Pallas interpreter) on the kernel's partial layout o [B, K, S2, H, RN], and the combine's
  jnp model (lcjax.ops.splits, the Mosaic GPU combine's oracle), == a numpy join of the first S splits by their
  LSE, rows r = t * G + g < T * G into out [B, T, N, H]; unused and empty splits count nothing, and a row no split
  saw gets 0 and lse -inf."""
  B, K, S, S2, H, RN, T, G = 2, 2, 3, 4, 32, 8, 2, 3
  o, lse = _partials(3, B, K, S2, H, RN, S=S)
  want, want_lse = _numpy_join(o, lse, S, T, G)
  assert want_lse[0, 0, 0] == -np.inf and not want[0, 0, 0].any()
  for out, lse_out in [
      triton_paged.combine_splits(o, lse, S=S, G=G, out_shape=(B, T, K * G, H), out_dtype=jnp.float32,
                                  transposed=True, interpret=True),
      splits.combine_splits_reference(o, lse, S=S, T=T, G=G, out_dtype=jnp.float32, transposed=True)]:
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse_out), want_lse, rtol=1e-5, atol=1e-5)


def test_combine_keeps_a_nan_split_nan():
  """A split whose row saw a NaN or inf score (its partial's out and lse NaN) makes that row NaN in the combine's
  out and lse, in the Triton combine and the jnp model; the other rows are joined as ever. A NaN total read as 'no
  split saw a key' gave lse -inf, which a later merge drops."""
  B, K, S, S2, H, RN, T, G = 1, 1, 3, 4, 32, 8, 2, 3
  o, lse = _partials(4, B, K, S2, H, RN, S=S)
  o, lse = o.at[0, 0, 1, :, 2].set(jnp.nan), lse.at[0, 0, 1, 2].set(jnp.nan)          # row 2: token 0, head 2
  want, want_lse = _numpy_join(o, lse, S, T, G)
  for out, lse_out in [
      triton_paged.combine_splits(o, lse, S=S, G=G, out_shape=(B, T, K * G, H), out_dtype=jnp.float32,
                                  transposed=True, interpret=True),
      splits.combine_splits_reference(o, lse, S=S, T=T, G=G, out_dtype=jnp.float32, transposed=True)]:
    out, lse_out = np.asarray(out), np.asarray(lse_out)
    assert np.isnan(out[0, 0, 2]).all() and np.isnan(lse_out[0, 0, 2])
    keep = np.ones(lse_out.shape, bool)
    keep[0, 0, 2] = False
    np.testing.assert_allclose(out[keep], want[keep], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse_out[keep], want_lse[keep], rtol=1e-5, atol=1e-5)


def test_mosaic_combine_lse_rows_divide_over_a_warpgroup():
  """The lse rows the Mosaic GPU combine copies in one TMA copy: S, doubled until S * RN * 4 bytes is a multiple
  of 128."""
  assert [mgpu_combine.lse_rows(S, RN) for S, RN in [(1, 8), (2, 8), (4, 8), (1, 24), (2, 24), (1, 32), (32, 64)]] \
      == [4, 4, 4, 4, 4, 1, 32]
  with pytest.raises(ValueError, match="power-of-two split count"):
    mgpu_combine.combine_splits(jnp.zeros((1, 1, 3, 64, 8)), jnp.zeros((1, 1, 4, 8)), T=1, G=4, out_dtype=jnp.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("B,K,S,H,RN,T,G,spread", [
    (1, 8, 32, 128, 8, 1, 4, 1.0),       # batch 1 of Llama-3-8B: 32 splits, one query of GQA 4
    (3, 2, 4, 128, 8, 1, 4, 30.0),       # lse 30x apart: the weights span e^-100 .. 1
    (16, 2, 2, 64, 8, 2, 4, 1.0),        # two splits: lse padded to 4 rows
    (1, 8, 1, 128, 24, 5, 4, 1.0),       # one split, 20 rows (a verify step of 4 drafts)
    (2, 4, 64, 128, 40, 10, 4, 5.0),     # 40 rows, unswizzled: 64 splits, one a step
    (2, 2, 16, 64, 16, 4, 4, 1.0),       # 16 rows: 8 splits a step
    (1, 2, 64, 64, 8, 1, 4, 1.0),        # 8 rows over 4 steps of 16 splits: slots refilled
    (1, 2, 32, 64, 16, 4, 4, 1.0),       # 16 rows over 4 steps of 8 splits: slots refilled
    (1, 2, 8, 64, 48, 6, 8, 5.0),        # 48 rows: a split a step
    (1, 4, 8, 128, 24, 5, 4, 5.0),       # 24 rows (5 tokens of GQA 4: a verify step): a split a step
    (1, 2, 16, 64, 32, 8, 4, 1.0),       # 32 rows, swizzled: 4 splits a step
    (1, 2, 4, 64, 56, 7, 8, 5.0),        # 56 rows: a split a step
    (1, 8, 256, 128, 64, 8, 8, 1.0)])    # 64 rows (swizzled, a split a step), 256 splits
def test_mosaic_combine_gpu(B, K, S, H, RN, T, G, spread):
  check_mosaic_combine(B, K, S, H, RN, T, G, spread)
  check_flat_combine(B, K, S, H, RN, T, G, spread)


def check_mosaic_combine(B, K, S, H, RN, T, G, spread):
  """The Mosaic GPU split combine == the float64 numpy join, including an empty split, a row no split saw, unused
  lse rows holding NaN and lse values far apart. On the GPU and in the Mosaic GPU interpreter."""
  S2 = mgpu_combine.lse_rows(S, RN)
  o, lse = _partials(B + S, B, K, S, H, RN, S=S, spread=spread)
  lse = jnp.concatenate([lse, jnp.full((B, K, S2 - S, RN), jnp.nan, jnp.float32)], axis=2)
  want, want_lse = _numpy_join(o, lse, S, T, G)
  out, lse_out = mgpu_combine.combine_splits(o, lse, T=T, G=G, out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse_out), want_lse, rtol=2e-5, atol=2e-5)


def check_flat_combine(B, K, S, H, RN, T, G, spread):
  """The flat split combine (combine_splits_flat: the lse broadcast over the head dim) == the float64 numpy join,
  including an empty split and a row no split saw. On the GPU and in the Mosaic GPU interpreter."""
  o, lse = _partials(B + S, B, K, S, H, RN, S=S, spread=spread)
  want, want_lse = _numpy_join(o, lse, S, T, G)
  out, lse_out = mgpu_combine.combine_splits_flat(o, jnp.broadcast_to(lse[:, :, :, None, :], o.shape), T=T, G=G,
                                                  out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse_out), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("route", ["auto", "mosaic", "triton"])
@pytest.mark.parametrize("page_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_decode_route_sends_decode_rows_to_its_kernel(route, page_dtype, monkeypatch):
  """PallasBackend.paged's decode rows by decode_route (RunConfig.decode_kernel), on an emulated sm_90: "mosaic"
  calls the Mosaic GPU decode entry of the page dtype with the Mosaic GPU combine (bf16 pages through a 2-slot
  ring), "triton" the Triton kernel for both page dtypes, "auto" as "mosaic" (no Triton lowering: the combine is
  Mosaic GPU's over either page dtype); decode_kernel() names what ran. Pages the
  Mosaic GPU kernel cannot read are refused under "mosaic" (no other kernel runs) and go to the Triton kernel under
  "auto"."""
  monkeypatch.setattr(hardware, "on_sm90", lambda: None)
  ran = []
  for module, fn in ((mgpu_paged, "paged_decode_fp8"), (mgpu_paged, "paged_decode_bf16"),
                     (triton_paged, "paged_decode")):
    monkeypatch.setattr(module, fn, lambda *a, _fn=fn, **kw: ran.append((_fn, kw.get("tuning"))))
  be = pallas_backend.PallasBackend(decode_route=route)
  B, T, N, K, H, Z, M = 2, 1, 8, 2, 128, 64, 3
  q = jnp.zeros((B, T, N, H), jnp.bfloat16)
  pages = jnp.zeros((8, Z, K, H), page_dtype)
  scales = jnp.ones((8, K), jnp.float32) if page_dtype == jnp.float8_e4m3fn else None
  table, q_pos, kv_len = jnp.zeros((B, M), jnp.int32), jnp.full((B, T), 100), jnp.full((B,), 101)
  be.paged(q, pages, pages, table, q_pos=q_pos, kv_len=kv_len, k_scale=scales, v_scale=scales)
  fp8 = page_dtype == jnp.float8_e4m3fn
  mosaic = "paged_decode_fp8" if fp8 else "paged_decode_bf16"
  want = {"mosaic": mosaic, "triton": "paged_decode", "auto": mosaic}[route]
  assert [name for name, _ in ran] == [want]
  named = {"mosaic": "mosaic", "triton": "triton", "auto": "mosaic"}[route]
  assert be.decode_kernel(head_dim=H, page_size=Z, rows=T * N // K, page_dtype=page_dtype) == named
  if route in ("mosaic", "auto"):
    tuning = ran[0][1]
    assert tuning.combine == "mosaic" and tuning.max_concurrent_steps == (None if fp8 else 2)
    small = jnp.zeros((8, 32, K, H), page_dtype)
    if route == "mosaic":
      with pytest.raises(ValueError, match="decode_kernel='mosaic' cannot read these decode rows: .*page_size=32"):
        be.paged(q, small, small, table, q_pos=q_pos, kv_len=kv_len, k_scale=scales, v_scale=scales)
      assert len(ran) == 1                            # refused: no other kernel ran
    else:
      be.paged(q, small, small, table, q_pos=q_pos, kv_len=kv_len, k_scale=scales, v_scale=scales)
      assert [name for name, _ in ran] == [mosaic, "paged_decode"]
  # A prefill chunk (rows past the decode kernels' 64 a kv head) takes the chunk path whatever the route.
  monkeypatch.setattr(pallas_backend.CudnnBackend, "paged", lambda self, *a, **kw: ran.append(("cudnn", None)))
  ran.clear()
  chunk = jnp.zeros((B, 32, N, H), jnp.bfloat16)
  be.paged(chunk, pages, pages, table, q_pos=jnp.tile(jnp.arange(32), (B, 1)), kv_len=kv_len, k_scale=scales,
           v_scale=scales)
  assert ran == [("cudnn", None)]


def test_decode_kernel_names_the_kernel_decode_rows_take(monkeypatch):
  """What an engine reports as stats["decode_kernel"] is what `paged` routes to."""
  monkeypatch.setattr(hardware, "on_sm90", lambda: None)
  be, e4 = pallas_backend.PallasBackend(), jnp.float8_e4m3fn
  assert be.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype=e4) == "mosaic"
  assert be.decode_kernel(head_dim=128, page_size=32, rows=4, page_dtype=e4) == "triton"
  assert be.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype="bfloat16") == "mosaic"
  assert be.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype="bfloat16", dtype="float16") == "triton"
  interp = pallas_backend.PallasBackend(interpret=True)
  assert interp.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype=e4) == "triton-interpret"
  assert pallas_backend.PallasBackend(interpret=True, decode_route="triton").decode_kernel(
      head_dim=128, page_size=64, rows=4, page_dtype=e4) == "triton-interpret"
  monkeypatch.setattr(hardware, "on_sm90", lambda: "not Hopper")
  assert be.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype=e4) == "triton"
  # cuDNN's paged kernel reads bf16 / fp16 pages; decode rows over fp8 or float32 pages take the jnp reference
  from lcjax.ops.cudnn import calls as cudnn_calls
  from lcjax.ops.cudnn.backend import CudnnBackend
  monkeypatch.setattr(cudnn_calls, "has_private_paged", lambda: True)
  cudnn = CudnnBackend()
  assert cudnn.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype="bfloat16") == "cudnn"
  assert cudnn.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype=e4) == "reference"
  assert cudnn.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype="float32") == "reference"
  assert cudnn.decode_reason(page_dtype=e4, T=64) is None                # a chunk reads fp8 pages dequantized
  monkeypatch.setattr(cudnn_calls, "has_private_paged", lambda: False)
  assert cudnn.decode_kernel(head_dim=128, page_size=64, rows=4, page_dtype="bfloat16") == "reference"


@pytest.mark.parametrize("with_kernel", [True, False])
def test_cudnn_backend_decodes_fp8_pages_with_its_fp8_decode_kernel(with_kernel, monkeypatch):
  """CudnnBackend's decode rows over fp8 pages (which cuDNN cannot read) run its fp8_decode kernel, the Triton fp8
  decode kernel (in the interpreter here), or without one the jnp reference; either gives the float64 oracle, and
  decode_kernel() names what ran. Pages at an offset into the pools, one sequence empty, one full."""
  from lcjax.ops import kernels
  from lcjax.ops.cudnn.backend import CudnnBackend
  ran = []
  real = triton_paged.paged_decode
  monkeypatch.setattr(triton_paged, "paged_decode", lambda *a, **kw: ran.append("triton") or real(*a, **kw))
  be = CudnnBackend(emulate=True, fp8_decode=kernels.TritonFp8Decode(interpret=True) if with_kernel else None)
  args, kw, want, _ = _inputs(CASES["T1-G4-Z64"])
  got = be.paged(*args, **kw)
  assert ran == (["triton"] if with_kernel else [])
  check(got, want, tol_out=2e-2)
  B, T, N, K, H, Z, M = CASES["T1-G4-Z64"][:7]
  name = be.decode_kernel(head_dim=H, page_size=Z, rows=N // K, page_dtype=jnp.float8_e4m3fn)
  assert name == ("triton" if with_kernel else "reference")
  assert be.decode_kernel(head_dim=H, page_size=Z, rows=N // K, page_dtype=jnp.bfloat16) == "cudnn"


def test_triton_fp8_decode_kernel_says_where_it_cannot_serve(monkeypatch):
  from lcjax.ops import kernels
  monkeypatch.setattr(hardware, "pallas_triton_reason", lambda: None)      # a JAX with the Pallas Triton lowering
  assert "needs a CUDA GPU" in kernels.TritonFp8Decode().why_not(64, 128)
  assert kernels.TritonFp8Decode(interpret=True).why_not(64, 128) is None
  assert "page size Z=192 must be a power of two" in kernels.TritonFp8Decode(interpret=True).why_not(192, 128)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 6))
  assert "compute capability 8.9 or later, got (8, 6)" in kernels.TritonFp8Decode().why_not(64, 128)
  monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 9))
  assert kernels.TritonFp8Decode().why_not(64, 128) is None


@pytest.mark.parametrize("combine", [pytest.param("triton", marks=TRITON_CROSS_LOWERS),
                                     *(c for c in mgpu_paged.COMBINES if c != "triton")])
@pytest.mark.parametrize("T,H,Z", [(1, 128, 64), (2, 64, 256), (5, 128, 64)])
def test_kernel_lowers_for_cuda(T, H, Z, combine):
  sd = jax.ShapeDtypeStruct
  e4 = jnp.float8_e4m3fn
  B, N, K, M, P = 2, 16, 4, 8, 40
  f = jax.jit(functools.partial(mgpu_paged.paged_decode_fp8, tuning=mgpu_paged.DecodeTuning(combine=combine)))
  lowered = f.trace(sd((B, T, N, H), jnp.bfloat16), sd((P, Z, K, H), e4), sd((P, Z, K, H), e4), sd((B, M), jnp.int32),
                    q_pos=sd((B, T), jnp.int32), kv_len=sd((B,), jnp.int32), k_scale=sd((P, K), jnp.float32),
                    v_scale=sd((P, K), jnp.float32)).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def check_fp8_kernel(name: str, combine: str) -> None:
  """The fp8 decode kernel (and split combine `combine`) on case `name`: on the quantized queries == its float32
  model, and the whole call == the float64 oracle. On the GPU (test_kernel_gpu) and in the Mosaic GPU interpreter
  (test_mosaic_interpret)."""
  args, kw, want, tuning = _inputs(CASES[name], seed=1)
  tuning = dataclasses.replace(tuning, combine=combine)
  q, rest = args[0], args[1:]
  B, T, N, H = q.shape
  K = rest[0].shape[2]
  q8, qs = mgpu_paged.quantize_rows(q, K)
  got = mgpu_paged.paged_decode_quantized(q8, qs, *rest, **kw, T=T, G=N // K, out_dtype=jnp.float32, tuning=tuning)
  with jax.default_matmul_precision("highest"):                          # the GPU's default would be TF32
    model = mgpu_paged.paged_decode_quantized_model(q8, qs, *rest, **kw, T=T, G=N // K)
  # The same quantized queries: the fp8 wgmma accumulates with less than float32 precision (2.5e-4 measured on
  # the H200 against this model), P is float16 in P @ V, and float32 sums run in another order.
  check(got, tuple(np.asarray(x, np.float64) for x in model), tol_out=2e-3, tol_lse=5e-4)
  check_rows(got, tuple(np.asarray(x, np.float64) for x in model), tol_row=5e-3, tol_lse=5e-3)
  # The whole call (queries quantized inside, output in bf16: ~2.2e-3 a row with the model) against the oracle.
  got = mgpu_paged.paged_decode_fp8(*args, **kw, tuning=tuning)
  check(got, want, tol_out=3e-3, tol_lse=3e-3)
  check_rows(got, want, tol_row=TOL_MODEL_ROW + 3e-3, tol_lse=TOL_MODEL_LSE + 3e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("combine", mgpu_paged.COMBINES)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_gpu(name, combine):
  check_fp8_kernel(name, combine)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("combine", mgpu_paged.COMBINES)
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_kernel_gpu(name, combine):
  check_bf16_kernel(name, combine)


def check_nonfinite_key(fp8: bool, combine: str) -> None:
  """A NaN key in the pages (what fp8 pages store for an overflowed K, lcjax.ops.fp8.clip_finite) at a position
  sequence 0's rows of kv head 0 see: those rows' out and lse are NaN through the decode and its split combine,
  not a row read as having seen nothing (out 0, lse -inf, which a merge drops); every other row is the clean
  call's, bit for bit. On the GPU and in the Mosaic GPU interpreter."""
  args, kw, _, tuning = _inputs(CASES["T1-G4-Z64"], seed=1, fp8=fp8)
  tuning = dataclasses.replace(tuning, combine=combine)
  q, kp, vp, table = args
  call = mgpu_paged.paged_decode_fp8 if fp8 else mgpu_paged.paged_decode_bf16
  clean = [np.asarray(x, np.float32) for x in call(*args, **kw, tuning=tuning)]
  page = kw["page_offset"] + int(table[0, 3])                  # sequence 0's positions 192-255 (1,536 keys)
  kp = kp.at[page, 5, 0].set(jnp.nan)
  out, lse = (np.asarray(x, np.float32) for x in call(q, kp, vp, table, **kw, tuning=tuning))
  N, K = q.shape[2], kp.shape[2]
  hit = np.zeros(lse.shape, bool)
  hit[0, :, :N // K] = True                                    # sequence 0, query heads of kv head 0
  assert np.isnan(lse[hit]).all() and np.isnan(out[hit]).all(), (lse[0], out[0, :, :, 0])
  np.testing.assert_array_equal(lse[~hit], clean[1][~hit])
  np.testing.assert_array_equal(out[~hit], clean[0][~hit])


def check_combine_nan_split(flat: bool) -> None:
  """A split whose row saw a NaN or inf score (out and lse NaN) makes that row NaN in the Mosaic GPU split
  combine's out and lse (the flat one's too); the other rows are the float64 join's. On the GPU and in the Mosaic
  GPU interpreter."""
  B, K, S, H, RN, T, G = 1, 2, 4, 64, 8, 2, 3
  o, lse = _partials(7, B, K, S, H, RN, S=S)
  o, lse = o.at[0, 1, 2, :, 4].set(jnp.nan), lse.at[0, 1, 2, 4].set(jnp.nan)       # kv head 1, row 4: t 1, g 1
  want, want_lse = _numpy_join(o, lse, S, T, G)
  if flat:
    out, lse_out = mgpu_combine.combine_splits_flat(o, jnp.broadcast_to(lse[:, :, :, None, :], o.shape), T=T, G=G,
                                                    out_dtype=jnp.float32)
  else:
    S2 = mgpu_combine.lse_rows(S, RN)
    lse = jnp.concatenate([lse, jnp.full((B, K, S2 - S, RN), jnp.nan, jnp.float32)], axis=2)
    out, lse_out = mgpu_combine.combine_splits(o, lse, T=T, G=G, out_dtype=jnp.float32)
  out, lse_out = np.asarray(out), np.asarray(lse_out)
  hit = np.zeros(lse_out.shape, bool)
  hit[0, 1, 1 * G + 1] = True                                  # token 1, query head 1 * G + 1
  assert np.isnan(lse_out[hit]).all() and np.isnan(out[hit]).all(), lse_out
  np.testing.assert_allclose(out[~hit], want[~hit], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(lse_out[~hit], want_lse[~hit], rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("combine", mgpu_paged.COMBINES)
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_nonfinite_key_gpu(fp8, combine):
  check_nonfinite_key(fp8, combine)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("flat", [False, True], ids=["mosaic", "mosaic-flat"])
def test_combine_nan_split_gpu(flat):
  check_combine_nan_split(flat)


def check_bf16_kernel(name: str, combine: str) -> None:
  """The Mosaic GPU decode over bfloat16 pages (paged_decode_bf16, split combine `combine`) against the float64
  oracle on case `name`: bf16 queries and pages exactly, P rounded to bfloat16 for P @ V (a row within 1e-2 of its
  norm, as the Triton kernel's float16 P is held to 2e-2). On the GPU and in the Mosaic GPU interpreter."""
  args, kw, want, tuning = _inputs(CASES[name], seed=1, fp8=False)
  got = mgpu_paged.paged_decode_bf16(*args, **kw, tuning=dataclasses.replace(tuning, combine=combine))
  assert got[0].dtype == jnp.bfloat16
  check(got, want, tol_out=1e-2, tol_lse=1e-3)
  check_rows(got, want, tol_row=1e-2, tol_lse=2e-3)
