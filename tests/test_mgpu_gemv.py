"""The Mosaic GPU fp8 GEMV kernel (lcjax.ops.mosaic_gpu.gemv).

Oracles: numpy float64 products of the dequantized weights (written here, not lcjax's reference) and, on the GPU,
lcjax's float32 widened product. Mosaic GPU kernels do not run on CPUs (Pallas' Mosaic GPU interpreter has no
register operands or transposed shared-memory views), so the CPU tests check the plan and the wrapper around the
kernel, with the kernel replaced by a numpy model of its contract, and tests/test_mosaic_lowering.py lowers the
kernel itself for CUDA; the gpu tests compile and run it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.model.llama import LINEAR
from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
from lcjax.ops import linear
from lcjax.ops.triton import gemv as triton_gemv

from tests.test_fp8_gemv import _numpy_product, _random_e4m3, _stacked, _x, model_products

NAMES = ["layers/attn/wqkv", "layers/mlp/w_down"]   # test_fp8_gemv's shapes whose N and Kd are multiples of 64


def _ranges(T, G):
  """Each CTA's tiles: G near-equal contiguous ranges of T tiles, as the module docstring defines them."""
  return [range(g * T // G, (g + 1) * T // G) for g in range(G)]


@pytest.mark.parametrize("N,Kd,bk,G", [(57344, 8192, 256, 264), (6144, 4096, 256, 264), (4096, 14336, 256, 264),
                                       (128, 64, 64, 5), (640, 1024, 128, 7), (64, 256, 64, 4)])
def test_plan_ranges_owners_and_slots(N, Kd, bk, G):
  """Every tile in exactly one CTA's range; owner() names that CTA; slots() marks, for each row block, as many
  slots as CTAs touch it."""
  p = mgpu_gemv.plan(1, 1, N, Kd, mgpu_gemv.MgpuGemvTuning(block_k=bk, num_ctas=G))
  Ks, T = Kd // bk, N // 64 * (Kd // bk)
  assert (p.Ks, p.T, p.G) == (Ks, T, min(G, T))
  ranges = _ranges(T, p.G)
  assert [p.first(g) for g in range(p.G + 1)] == [r.start for r in ranges] + [T]
  owner = np.empty(T, int)
  for g, r in enumerate(ranges):
    owner[list(r)] = g
  assert (p.owner(np.arange(T)) == owner).all()
  touching = [len(set(owner[n * Ks:(n + 1) * Ks])) for n in range(N // 64)]
  assert (p.slots().sum(axis=0) == touching).all() and p.slots().shape[0] == max(touching)
  assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1


def test_plan_refusals_and_tile_width():
  with pytest.raises(ValueError, match="65 rows exceed"):
    mgpu_gemv.plan(65, 1, 128, 256)
  with pytest.raises(ValueError, match="N=96 is not a multiple of 64$"):
    mgpu_gemv.plan(1, 1, 96, 256)
  with pytest.raises(ValueError, match="Kd=600 is not a multiple of 64$") as e:
    mgpu_gemv.plan(1, 1, 128, 600)
  assert str(e.value) == mgpu_gemv.unsupported_shape(128, 600)
  with pytest.raises(ValueError, match="block_k=96 must be 64, 128 or 256"):
    mgpu_gemv.plan(1, 1, 128, 384, mgpu_gemv.MgpuGemvTuning(block_k=96))
  assert [mgpu_gemv.plan(1, 1, 64, kd).bk for kd in (64, 192, 384, 512, 576)] == [64, 64, 128, 256, 64]
  for bad in (dict(num_ctas=0), dict(ctas_per_sm=0), dict(max_concurrent_steps=1)):
    with pytest.raises(ValueError, match="max_concurrent_steps=.* must be >= 2, ctas_per_sm=.* >= 1"):
      mgpu_gemv.plan(1, 1, 128, 256, mgpu_gemv.MgpuGemvTuning(**bad))
  with pytest.raises(ValueError, match="overflow the kernel's int32"):
    mgpu_gemv.plan(1, 1, 106496, 16384, mgpu_gemv.MgpuGemvTuning(block_k=64, num_ctas=100000))


@pytest.mark.parametrize("R,P,M,bk", [(8, 1, 4, 256), (64, 1, 4, 256), (32, 2, 4, 256), (36, 2, 3, 256),
                                      (64, 2, 2, 256)])
def test_plan_fits_shared_memory(R, P, M, bk):
  """Many rows (float32 x: two parts a row) take a shallower ring, so that a CTA's tiles fit its shared memory."""
  p = mgpu_gemv.plan(R, P, 8192, 4096)
  assert (p.M, p.bk) == (M, bk)
  assert mgpu_gemv.smem_bytes(p.RN, p.bk, p.M) <= mgpu_gemv.SMEM_BYTES


SEEN = []      # the plans _kernel_model was called with


def _kernel_model(layer, x16, w, p):
  """The kernel's contract in numpy: CTA g sums tile products W[n-block, k-tile] x16^T over its range, one partial
  per row block it touches, in slot (its rank among the CTAs that touch that row block); slots no CTA writes hold
  NaN (the kernel leaves them unwritten)."""
  wl = np.asarray(w[int(layer[0])].astype(jnp.float32), np.float64)
  SEEN.append(p)
  if p.scale_in_kernel:                                             # x^T as the layer made it, padded
    assert x16.shape == (p.Kd, p.RN) and x16.dtype == jnp.bfloat16 and p.RN in (16, 32, 64), (x16.shape, x16.dtype)
  else:                                                             # float16 parts as rows
    assert x16.shape == (p.RN, p.Kd) and x16.dtype == jnp.float16, (x16.shape, x16.dtype)
  xt = np.asarray(x16.astype(jnp.float32), np.float64)
  xt = xt if p.scale_in_kernel else xt.T                            # x^T [Kd, RN] (the kernel scales it exactly)
  Ks, bk = p.Kd // p.bk, p.bk
  out = np.full((p.T, p.N, p.RN), np.nan)
  seen = {}
  for g, r in enumerate(_ranges(p.T, p.G)):
    for f in r:
      n, k = divmod(f, Ks)
      if seen.get(n, (None,))[0] != g:
        seen[n] = (g, seen.get(n, (None, -1))[1] + 1)
        out[seen[n][1], n * 64:(n + 1) * 64] = 0
      out[seen[n][1], n * 64:(n + 1) * 64] += wl[n * 64:(n + 1) * 64, k * bk:(k + 1) * bk] @ xt[k * bk:(k + 1) * bk]
  J = max(j for _, j in seen.values()) + 1
  return jnp.asarray(out[:J], jnp.float32)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows,dtype,G,fixed,in_kernel", [
    (1, jnp.bfloat16, 3, False, False), (3, jnp.float32, 5, False, False), (9, jnp.float32, 1, False, False),
    (5, jnp.bfloat16, 4, True, False), (3, jnp.float32, 2, True, False), (5, jnp.bfloat16, 4, False, True),
    (17, jnp.bfloat16, 3, True, True), (3, jnp.float32, 2, False, True)])
def test_wrapper_around_the_kernel_contract(name, rows, dtype, G, fixed, in_kernel, monkeypatch):
  """Rows scaled and stacked as float16 parts (hi, lo for float32; bf16 rows split into magnitude bands with
  fixed_split, or handed over transposed and padded to 16 for scale_in_kernel, both of which float32 rows
  ignore), padded to 8, the slots summed, parts added and scales applied: against numpy's float64 product, with
  rows at 1e6 and 1e-6."""
  monkeypatch.setattr(mgpu_gemv, "_call", _kernel_model)
  rng = np.random.default_rng(rows)
  w8, scale = _stacked(name, rng)
  x = _x(name, rows, rng, dtype)
  spec = LINEAR[name]
  got = mgpu_gemv.gemv_stacked(x, w8, scale, jnp.int32(2), spec,
                               tuning=mgpu_gemv.MgpuGemvTuning(block_k=64, num_ctas=G, fixed_split=fixed,
                                                               scale_in_kernel=in_kernel))
  want = _numpy_product(x, w8, scale, 2, spec)
  assert got.shape == want.shape and got.dtype == x.dtype
  p = SEEN[-1]                                                      # the path the wrapper took
  sixteen = dtype == jnp.bfloat16
  assert p.scale_in_kernel == (in_kernel and sixteen)
  assert p.P == (1 if p.scale_in_kernel else 2 if (fixed and sixteen) or not sixteen else 1)
  got = np.asarray(got.astype(jnp.float32), np.float64).reshape(rows, -1)
  want = want.reshape(rows, -1)
  tol = 2 ** -8 if dtype == jnp.bfloat16 else 1e-6
  err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
  assert (err < tol).all(), err


@pytest.mark.parametrize("G", [3, 7])
def test_float16_rows_go_as_they_are(G, monkeypatch):
  """float16 x is the kernel's operand unchanged (one part, no scale, no split): the float32 product against
  numpy's float64 to 1e-6, with values across float16's range (a split of them would lose bits: x 2^-15 of values
  below 2 is subnormal)."""
  monkeypatch.setattr(mgpu_gemv, "_call", _kernel_model)
  name = "layers/mlp/w_down"
  rng = np.random.default_rng(G)
  w8, scale = _stacked(name, rng)
  x = np.asarray(_x(name, 4, rng, jnp.float32), np.float64)
  x = x / np.abs(x).max() * 6e4 * 2.0 ** rng.integers(-20, 1, x.shape)     # magnitudes 6e4 down to ~1e-7
  x = jnp.asarray(x, jnp.float16)
  got = mgpu_gemv.gemv_stacked_f32(x, w8, scale, jnp.int32(2), LINEAR[name],
                                   tuning=mgpu_gemv.MgpuGemvTuning(block_k=64, num_ctas=G))
  p = SEEN[-1]
  assert (p.P, p.RN, p.scale_in_kernel) == (1, 8, False)
  want = _numpy_product(x, w8, scale, 2, LINEAR[name]).reshape(4, -1)
  got = np.asarray(got, np.float64).reshape(4, -1)
  assert (np.abs(got - want).max(axis=1) < 1e-6 * np.abs(want).max(axis=1)).all()


def test_plan_keeps_its_ctas_resident():
  """G is at most the CTAs that fit an SM's shared memory times the SMs: two an SM up to RN 16, one from RN 24
  (bf16 x of 9 rows in two parts) on; num_ctas overrides."""
  for R, P, G in [(1, 2, 264), (8, 2, 264), (9, 2, 132), (16, 1, 264), (17, 1, 132), (64, 2, 132)]:
    p = mgpu_gemv.plan(R, P, 8192, 28672, mgpu_gemv.MgpuGemvTuning(num_ctas=None))
    per_sm = 228 * 1024 // (mgpu_gemv.smem_bytes(p.RN, p.bk, p.M) + 1024)           # a Hopper SM; 1 KiB a CTA kept
    assert p.G == G == min(2, per_sm) * mgpu_gemv.sm_count(), (R, P, p)
  assert mgpu_gemv.plan(64, 2, 8192, 28672, mgpu_gemv.MgpuGemvTuning(num_ctas=500)).G == 500


def test_split_fixed_is_exact_over_its_range():
  """Every finite bf16 value, both signs: x16[0] w[0] + x16[1] w[1] == x in float64 for 2^-35 <= |x| < 2^31, each
  value in one part only; below 2^-35 the error is at most 2^-43; from 2^31 on, infinite; NaN stays NaN."""
  bits = np.arange(0, 0x7F80, dtype=np.uint16)                      # every finite non-negative bf16
  x = np.concatenate([bits, bits | 0x8000, [0x7FC0]]).astype(np.uint16).view(jnp.bfloat16)
  x16, w = mgpu_gemv.split_fixed(jnp.asarray(x)[None])
  hi, lo = np.asarray(x16[0, 0], np.float64), np.asarray(x16[1, 0], np.float64)
  back = hi * float(w[0]) + lo * float(w[1])
  xf = np.asarray(x, np.float64)
  mag = np.abs(xf)
  inside = (mag >= 2.0 ** -35) & (mag < 2.0 ** 31)
  assert (back[inside] == xf[inside]).all()
  assert ((hi == 0) | (lo == 0))[:-1].all()
  assert (np.abs(back - xf)[mag < 2.0 ** -35] <= 2.0 ** -43).all()
  assert np.isinf(back[mag >= 2.0 ** 31]).all() and (mag >= 2.0 ** 31).sum() == 2 * 97 * 128
  assert np.isnan(back[-1])
  assert inside.sum() == 2 * 66 * 128                                  # 66 binades of 128 bf16 values, both signs


def test_tile_scale_is_exact_above_its_threshold():
  """The in-kernel scaling as plain jnp: columns of bf16 tiles at magnitudes 2^-120 .. 2^120 and one all zero.
  Each column's float16 absmax lies in [2^13, 2^14) (columns under 2^-113 take the largest scale, 2^126),
  x16 / s == x exactly for |x| >= 2^-27 of the column's absmax, and below that the error is at most 2^-38 of it
  (float16's subnormal grid)."""
  rng = np.random.default_rng(0)
  exps = np.array([-120, -60, -27, -1, 0, 7, 15, 16, 40, 120, 0, 3, -5, 60, 90, 0])
  x = rng.standard_normal((256, 16)) * 2.0 ** exps
  x[:, 10] = 0
  x[::7, 11] *= 2.0 ** -40                                          # values far below their column's absmax
  x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
  x16, inv = mgpu_gemv.tile_scale(jnp.asarray(x, jnp.bfloat16))
  assert x16.dtype == jnp.float16 and inv.shape == (16,)
  back = np.asarray(x16, np.float64) * np.asarray(inv, np.float64)
  m = np.abs(x).max(axis=0)
  top = np.abs(np.asarray(x16, np.float64)).max(axis=0)
  scalable = m >= 2.0 ** -113
  assert ((top[scalable] >= 2.0 ** 13) & (top[scalable] < 2.0 ** 14)).all()
  assert (top[~scalable] == m[~scalable] * 2.0 ** 126).all() and list(np.flatnonzero(~scalable)) == [0, 10]
  big = (np.abs(x) >= m * 2.0 ** -27) & scalable
  assert (back[big] == x[big]).all()
  assert (np.abs(back - x)[:, scalable] <= m[scalable] * 2.0 ** -38).all()
  assert (~big[:, 11]).sum() > 10                                   # the small values were there


@pytest.mark.parametrize("G", [7, 10])
def test_wrapper_adds_only_the_slots_written(G, monkeypatch):
  """Row blocks touched by different numbers of CTAs (3 row blocks of 4 tiles over G CTAs): the slots the kernel
  leaves unwritten (NaN in the model) are not added."""
  monkeypatch.setattr(mgpu_gemv, "_call", _kernel_model)
  rng = np.random.default_rng(G)
  w8 = jnp.asarray(np.clip(rng.standard_normal((2, 192, 256)) * 100, -448, 448), jnp.float8_e4m3fn)
  scale = jnp.asarray(rng.uniform(1e-3, 2e-3, (2, 192, 1)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
  tuning = mgpu_gemv.MgpuGemvTuning(block_k=64, num_ctas=G)
  assert not mgpu_gemv.plan(2, 2, 192, 256, tuning).slots().all()
  got = np.asarray(mgpu_gemv.gemv_stacked(x, w8, scale, jnp.int32(1), "bk,nk->bn", tuning=tuning), np.float64)
  want = _numpy_product(x, w8, scale, 1, "bk,nk->bn")
  assert np.abs(got - want).max() < 1e-6 * np.abs(want).max()


TUNINGS = [mgpu_gemv.MgpuGemvTuning(), mgpu_gemv.MgpuGemvTuning(block_k=128, max_concurrent_steps=6, ctas_per_sm=1),
           mgpu_gemv.MgpuGemvTuning(fixed_split=False), mgpu_gemv.MgpuGemvTuning(scale_in_kernel=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("preset_name", ["llama3-8b", "llama3.1-70b"])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_kernel_at_model_shapes(preset_name, rows):
  """Compiled on the GPU at real shapes, each tuning: against the float32 reference, bf16 activations."""
  for name, spec, w8, scale, x in model_products(preset_name, rows):
    want = linear.gemv_stacked_reference(x.astype(jnp.float32), w8, scale, jnp.int32(1), spec)
    for tuning in TUNINGS:
      got = jax.jit(lambda x, w, s, i: mgpu_gemv.gemv_stacked(x, w, s, i, spec, tuning=tuning))(
          x, w8, scale, jnp.int32(1)).astype(jnp.float32)
      err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
      assert err < 2 ** -8, (name, tuning, err)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_gpu_kernels_float32_rows(rows):
  """float32 activations (hi and lo float16 parts: rows of one wgmma here, two dots in the Triton kernel), rows at
  1e6 and 1e-6, both kernels compiled: against numpy to float32's precision, which hi alone (2^-11) misses."""
  name = "layers/mlp/w_down"
  rng = np.random.default_rng(rows)
  w8, scale = _stacked(name, rng)
  x = _x(name, rows, rng, jnp.float32)
  want = _numpy_product(x, w8, scale, 2, LINEAR[name]).reshape(rows, -1)
  kernels = {"mosaic": (mgpu_gemv.gemv_stacked, mgpu_gemv.MgpuGemvTuning(block_k=64, num_ctas=3)),
             "triton": (triton_gemv.gemv_stacked, triton_gemv.GemvTuning(block_n=32, block_k=32, min_steps=1))}
  for label, (kernel, tuning) in kernels.items():
    got = jax.jit(lambda x, w, s: kernel(x, w, s, jnp.int32(2), LINEAR[name], tuning=tuning))(x, w8, scale)
    got = np.asarray(got, np.float64).reshape(rows, -1)
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert (err < 1e-5).all(), (label, err)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16, 64])     # 16 and 64: one CTA an SM (plan's cap), 64 a shorter ring
@pytest.mark.parametrize("tuning", [mgpu_gemv.MgpuGemvTuning(fixed_split=False), mgpu_gemv.MgpuGemvTuning(),
                                    mgpu_gemv.MgpuGemvTuning(scale_in_kernel=True)],
                         ids=["row_scale", "fixed_split", "scale_in_kernel"])
def test_gpu_bf16_rows_below_the_output_rounding(tuning, rows):
  """bf16 rows at 1e6 and 1e-6, each way of bringing them to float16: the float32 product before the cast
  against numpy to 1e-5, well below bf16's output rounding (2^-8), so a part or scale lost on the way (a lo
  part folded away, a tile scale misapplied) fails here though the bf16 result would hide it."""
  name = "layers/mlp/w_down"
  rng = np.random.default_rng(rows + 10)
  w8, scale = _stacked(name, rng)
  x = _x(name, rows, rng, jnp.bfloat16)
  want = _numpy_product(x, w8, scale, 2, LINEAR[name]).reshape(rows, -1)
  got = jax.jit(lambda x, w, s: mgpu_gemv.gemv_stacked_f32(x, w, s, jnp.int32(2), LINEAR[name], tuning=tuning))(
      x, w8, scale)
  assert got.dtype == jnp.float32
  got = np.asarray(got, np.float64).reshape(rows, -1)
  err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
  assert (err < 1e-5).all(), err


@pytest.mark.gpu
def test_gpu_kernel_reads_the_top_of_a_large_stack():
  """The last layer of the 70B's w_gate_up over 10 layers (4.4 GiB, bytes past 2^32), every byte drawn."""
  D, F, L_ = 8192, 28672, 10
  spec = LINEAR["layers/mlp/w_gate_up"]
  kw, ks, kx = jax.random.split(jax.random.PRNGKey(0), 3)
  w8 = _random_e4m3(kw, (L_, 2, F, D))
  scale = jax.random.uniform(ks, (L_, 2, F, 1), jnp.float32, 1e-3, 2e-3)
  x = jax.random.normal(kx, (1, 1, D), jnp.bfloat16)
  got = jax.jit(lambda x, w, s, i: mgpu_gemv.gemv_stacked(x, w, s, i, spec))(x, w8, scale, jnp.int32(L_ - 1))
  want = linear.gemv_stacked_reference(x.astype(jnp.float32), w8, scale, jnp.int32(L_ - 1), spec)
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
  assert err < 2 ** -8, err


@pytest.mark.gpu
@pytest.mark.parametrize("N,Kd,bk,G", [(4096, 1024, 256, None), (2048, 4096, 256, None), (192, 256, 64, 12),
                                       (192, 256, 64, 7)])
def test_gpu_kernel_with_fewer_tiles_a_cta_than_ring_slots(N, Kd, bk, G):
  """CTAs whose range holds fewer tiles (1 or 2) than the TMA ring's 4 slots: the products of a Llama-3-8B layer
  with a 1,024-wide MLP (w_down N 4096 x Kd 1024: 256 tiles over 256 CTAs; w_gate_up 2048 x 4096: about 2 a CTA),
  where the engine's fp8 decode gave NaN logits on an H100, and small stacks over 12 and 7 CTAs. The real presets'
  products give every CTA 3 tiles or more (Llama-3-8B's wo: 1,024 tiles over 264 CTAs). Against the float32
  reference, finite."""
  rng = np.random.default_rng(N + Kd)
  w8 = jnp.asarray(np.clip(rng.standard_normal((2, N, Kd)) * 100, -448, 448), jnp.float8_e4m3fn)   # past 464: NaN
  scale = jnp.asarray(rng.uniform(1e-3, 2e-3, (2, N, 1)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((1, Kd)), jnp.bfloat16)
  tuning = mgpu_gemv.MgpuGemvTuning(block_k=bk, num_ctas=G)
  p = mgpu_gemv.plan(1, 2, N, Kd, tuning)
  assert p.T / p.G < p.M, (p.T, p.G, p.M)
  got = jax.jit(lambda x, w, s: mgpu_gemv.gemv_stacked_f32(x, w, s, jnp.int32(1), "bk,nk->bn", tuning=tuning))(
      x, w8, scale)
  want = _numpy_product(x, w8, scale, 1, "bk,nk->bn")
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all(), np.argwhere(~np.isfinite(got))[:8]
  assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("R", [5, 16])
@pytest.mark.parametrize("N,Kd", [(6144, 4096), (4096, 4096), (2048, 4096), (4096, 1024)])
def test_gpu_kernel_on_the_rows_of_a_chunk(N, Kd, R):
  """The products of a Llama-3-8B layer with a 1,024-wide MLP (wqkv, wo, w_gate_up, w_down) on the rows of a
  verify step (5) and of a 16-token prefill chunk, where the engine's fp8 logits came out NaN on an H100: rows of
  every magnitude, one all zero and one of a single value, against the float64 product; finite."""
  rng = np.random.default_rng(N + Kd + R)
  w8 = jnp.asarray(np.clip(rng.standard_normal((2, N, Kd)) * 100, -448, 448), jnp.float8_e4m3fn)
  scale = jnp.asarray(rng.uniform(1e-3, 2e-3, (2, N, 1)), jnp.float32)
  x = rng.standard_normal((R, Kd)) * np.logspace(-3, 3, R)[:, None]
  x[1] = 0.0
  x[2] = 0.0
  x[2, 7] = 1.5
  x = jnp.asarray(x, jnp.bfloat16)
  got = jax.jit(lambda x, w, s: mgpu_gemv.gemv_stacked_f32(x, w, s, jnp.int32(1), "bk,nk->bn"))(x, w8, scale)
  want = _numpy_product(x, w8, scale, 1, "bk,nk->bn")
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all(), np.argwhere(~np.isfinite(got))[:8]
  err = np.abs(got - want).max(axis=1) / np.maximum(np.abs(want).max(axis=1), 1e-30)
  assert (err < 1e-5).all(), err


@pytest.mark.gpu
def test_gpu_kernel_on_bf16_x_computed_in_the_same_program():
  """x made in the product's own jit as a float32 value cast to bf16, whose values sit just below split_fixed's band
  edge (1/4) before the cast and on it after (XLA's GPU compiler may drop the cast's rounding: excess precision):
  the product of the bf16 values, finite and within 1e-5 of the float64 product, as when x arrives materialized."""
  rng = np.random.default_rng(3)
  w8 = jnp.asarray(np.clip(rng.standard_normal((1, 4096, 4096)) * 100, -448, 448), jnp.float8_e4m3fn)
  scale = jnp.asarray(rng.uniform(1e-3, 2e-3, (1, 4096, 1)), jnp.float32)
  a = np.full((16, 4096), 0.25 * (1 - 2 ** -12), np.float32) * rng.choice([-1.0, 1.0], (16, 4096))
  a[:, ::3] = rng.standard_normal((16, 1366))

  def product(a, w, s):
    x = (jnp.sqrt(a * a) * jnp.sign(a)).astype(jnp.bfloat16)           # a float32 computation ending in the cast
    return x, mgpu_gemv.gemv_stacked_f32(x, w, s, jnp.int32(0), "bk,nk->bn")

  x, got = jax.jit(product)(jnp.asarray(a), w8, scale)
  want = _numpy_product(x, w8, scale, 0, "bk,nk->bn")
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all(), int((~np.isfinite(got)).sum())
  err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
  assert (err < 1e-5).all(), err
