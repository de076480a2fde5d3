"""The fp8 page-write kernel (lcjax.ops.triton.page_write) and the engine's decode steps through it.

Oracles: XLA's write of the same tokens (lcjax.cache.kv._write_one_token, bit for bit), whose scales and values
tests/test_kv.py checks against numpy for both paths; the engine with page_write="xla" for the same model. On
CPUs the kernel runs in the Pallas interpreter; the gpu tests compile it.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcjax
from lcjax.cache import kv as kvc
from lcjax.config import ConfigError, RunConfig, preset
from lcjax.engine import placement
from lcjax.ops import page_scale
from lcjax.ops.triton import page_write as triton_page_write


def _case(L, P, Z, K, H, B, seed=0):
  """fp8 pools with scales, and B decode tokens: row 0 opens page 1, row 1 brings a 1000x token into page 4 (its
  scale grows), row 2 writes nowhere (page P), the others small tokens (scales kept) into pages P-1, P-2, ...
  (skipping 1 and 4: rows write distinct pages); row 3 is all zeros, and row 4's absmax is exactly 448 x 2^-3 (the
  edge of its scale rule) in every head, and row 5's head 0 holds inf, -inf and NaN (stored as NaN). The last row
  writes the last offset of its page, and with pages of more than 64 tokens and 6 rows or more the one before it
  writes past the first 64."""
  rng = np.random.default_rng(seed)
  pools = [jnp.asarray(rng.normal(size=(L, P, Z, K, H)) * 60, jnp.float32).astype(jnp.float8_e4m3fn)
           for _ in range(2)]
  scales = [jnp.asarray(2.0 ** rng.integers(-6, 2, size=(L, P, K)), jnp.float32) for _ in range(2)]
  toks = rng.normal(size=(2, B, K, H))
  toks[:, 1] *= 1000.0
  toks[:, 3:] *= 0.01
  if B > 3:
    toks[:, 3] = 0.0
  if B > 4:
    toks[:, 4, :, 0] = 448.0 * 2.0 ** -3
  if B > 5:
    toks[:, 5, 0, :3] = [np.inf, -np.inf, np.nan]
  page = np.array([1, 4, P] + [p for p in range(P - 1, 0, -1) if p not in (1, 4)][:B - 3], np.int32)
  offset = np.array([0] + [(3 * i + 1) % Z for i in range(1, B)], np.int32)
  if B > 3:
    offset[-1] = Z - 1
  if Z > 64 and B > 5:
    offset[-2] = 64 + 7
  k, v = (jnp.asarray(t, jnp.bfloat16) for t in toks)
  return (*pools, *scales, k, v, jnp.asarray(page), jnp.asarray(offset))


def _reference(k_pool, v_pool, ks, vs, k, v, page, offset, layer):
  kp, ks = kvc._write_one_token(k_pool, ks, k.astype(jnp.float32), page, offset, layer)
  vp, vs = kvc._write_one_token(v_pool, vs, v.astype(jnp.float32), page, offset, layer)
  return kp, vp, ks, vs


def _bits(x):
  """The bytes of x (bits compare -0 with 0 and NaN payloads, which float comparisons do not)."""
  return np.asarray(x).view(np.uint8)


def _assert_same(got, want):
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(_bits(g), _bits(w))


def test_token_scale_is_scale_for_bit_for_bit():
  """The kernel's scale rule from the absmax's bits against lcjax.cache.kv.scale_for: every exponent at the 1.75
  mantissa (absmax = 448 x 2^k) and one ulp either side, 0, subnormals, the floor's edge, inf and NaN."""
  assert 2.0 ** (page_scale.SCALE_FLOOR_EXP - 127) == kvc.SCALE_FLOOR
  edge = np.arange(1, 255, dtype=np.int32) << 23 | page_scale.MANTISSA_1_75         # 1.75 x 2^E
  bits = np.concatenate([edge, edge - 1, edge + 1, np.arange(0, 1 << 12, dtype=np.int32) * 2047,
                         np.array([0x7F800000, 0x7FC00000], np.int32)])
  a = jnp.asarray(bits.view(np.float32))
  a = a.at[-4:-2].set(jnp.asarray([448 * 2.0 ** -32, np.nextafter(np.float32(448 * 2.0 ** -32), np.float32(1))]))
  np.testing.assert_array_equal(_bits(page_scale.token_scale(a)), _bits(kvc.scale_for(a)))


@pytest.mark.parametrize("pack", [1, 2])
def test_kernel_writes_what_xla_writes(pack):
  """Both element widths (bytes; uint16 pairs for 2-4 GiB pools) against XLA's write, bit for bit: a page opened,
  a scale grown (the page requantized), one kept, a row dropped."""
  case = _case(L=3, P=9, Z=8, K=2, H=16, B=5)
  want = jax.jit(_reference)(*case, jnp.int32(2))
  got = triton_page_write.write_token(*case, jnp.int32(2), pack=pack, interpret=True)
  _assert_same(got, want)
  ks_before, ks_after = np.asarray(case[2]), np.asarray(want[2])
  assert np.all(ks_after[2, 4] > ks_before[2, 4])                       # row 1's page: its scale grew
  assert np.array_equal(ks_after[:2], ks_before[:2])                    # other layers untouched


def test_kernel_stores_values_that_are_not_finite_as_nan():
  """A token holding inf, -inf and NaN (row 5 of `_case`): the kernel == XLA's write bit for bit, and both store
  NaN for each of the three (an inf clipped to 448 would be a finite value the model never produced), the token's
  finite values as finite e4m3."""
  case = _case(L=2, P=12, Z=8, K=2, H=16, B=7)
  want = jax.jit(_reference)(*case, jnp.int32(1))
  _assert_same(triton_page_write.write_token(*case, jnp.int32(1), interpret=True), want)
  page, offset = int(case[6][5]), int(case[7][5])
  for pool in want[:2]:
    row = np.asarray(pool[1, page, offset, 0]).astype(np.float32)
    assert np.isnan(row[:3]).all() and np.isfinite(row[3:]).all(), row


def test_kernel_refuses_what_it_cannot_write():
  case = _case(L=1, P=4, Z=6, K=1, H=16, B=3)
  with pytest.raises(ValueError, match="needs a power-of-two page_size of at least 2, got 6"):
    triton_page_write.write_token(*case, jnp.int32(0), interpret=True)
  k_pool, v_pool, ks, vs, k, v, page, offset = _case(L=1, P=4, Z=8, K=1, H=16, B=3)
  with pytest.raises(ValueError, match=r"pools bfloat16\(1, 4, 8, 1, 16\) / float8_e4m3fn.*: need float8_e4m3fn pools "
                     r"\[L, Pl, Z, K, H\], float32 scales \[L, Pl, K\], tokens \[B, K, H\], pages and offsets \[B\]"):
    triton_page_write.write_token(k_pool.astype(jnp.bfloat16), v_pool, ks, vs, k, v, page, offset, jnp.int32(0),
                               interpret=True)
  with pytest.raises(ValueError, match=r"tokens \(3, 1, 16\) / \(2, 1, 16\)"):
    triton_page_write.write_token(k_pool, v_pool, ks, vs, k, v[:2], page, offset, jnp.int32(0), interpret=True)
  with pytest.raises(ValueError, match="pack=3 for pools of 512 bytes: 1 or 2"):
    triton_page_write.write_token(k_pool, v_pool, ks, vs, k, v, page, offset, jnp.int32(0), pack=3, interpret=True)


def test_page_write_choice_and_refusals():
  """placement.page_write: auto takes the first kernel that compiles here (Mosaic GPU, then Triton) and says why it
  passed over each; a named kernel that cannot serve is refused with the reason; pages that are not fp8 need no
  kernel."""
  fp8 = RunConfig(dtype="float32", cache_dtype="float8_e4m3fn")
  cpu = "the fp8 page-write kernel needs a CUDA GPU, not 'cpu'"
  assert triton_page_write.unsupported(64, 128) == cpu                    # this test runs on CPUs
  mosaic = "the Mosaic GPU fp8 page writer needs a CUDA GPU, not 'cpu'"
  assert placement.page_write(fp8, 128) == ("xla", f"page_write='auto'; not mosaic: {mosaic}; not pallas: {cpu}")
  assert placement.page_write(fp8.replace(page_write="pallas-interpret"), 128)[0] == "pallas-interpret"
  assert placement.page_write(fp8.replace(page_write="xla"), 128)[0] == "xla"
  with pytest.raises(ConfigError, match=f"page_write='pallas': {cpu} \\('pallas-interpret' runs it"):
    placement.page_write(fp8.replace(page_write="pallas"), 128)
  with pytest.raises(ConfigError, match="page_write='pallas-interpret': .* power-of-two head_dim of at least 2, "
                                        "got 96"):
    placement.page_write(fp8.replace(page_write="pallas-interpret"), 96)
  with pytest.raises(ConfigError, match="page_write='pallas' writes fp8 pages, and the cache holds float32"):
    placement.page_write(RunConfig(dtype="float32", page_write="pallas"), 128)
  assert placement.page_write(RunConfig(dtype="float32"), 128)[0] == "xla"
  with pytest.raises(ConfigError, match="page_write='mosaic': .*Mosaic GPU fp8 page writer"):
    placement.page_write(fp8.replace(page_write="mosaic"), 128)
  with pytest.raises(ConfigError, match="page_write='fast' must be one of auto, xla, pallas, mosaic, pallas-interpret"):
    RunConfig(page_write="fast")


def test_engine_refuses_the_kernel_before_making_weights(monkeypatch):
  from lcjax.engine import engine
  monkeypatch.setattr(engine, "Llama", None)      # drawing weights would call it
  with pytest.raises(ConfigError, match="page_write='pallas': the fp8 page-write kernel needs a CUDA GPU"):
    lcjax.Engine.random(preset("tiny"), run=RunConfig(cache_dtype="float8_e4m3fn", page_write="pallas"))


def _count_kernel_calls(monkeypatch):
  calls, write = [], triton_page_write.write_token

  def counted(*a, **kw):
    calls.append(kw.get("interpret", False))
    return write(*a, **kw)

  monkeypatch.setattr(triton_page_write, "write_token", counted)
  return calls


def _engines(run, xla, kernel):
  """Two engines of the same random model, page_write `xla` and `kernel`."""
  return (lcjax.Engine.random(preset("tiny"), run=run.replace(page_write=xla), seed=0),
          lcjax.Engine.random(preset("tiny"), run=run.replace(page_write=kernel), seed=0))


def _decode_both(xla, kern, calls, prompts, steps):
  a = xla.generate(prompts, max_new_tokens=steps)
  assert not calls
  b = kern.generate(prompts, max_new_tokens=steps)
  assert calls, "the decode step did not trace the kernel"
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  # The sequences' pages (freed, their bytes left in the pool) hold the same bytes and scales after both runs.
  for x, y in zip(xla.cache.parts(), kern.cache.parts()):
    np.testing.assert_array_equal(_bits(np.asarray(x)[:, 1:]), _bits(np.asarray(y)[:, 1:]))
  return a, b


def test_engine_decodes_through_the_kernel(caplog, monkeypatch):
  """Two prompts decoded together through the kernel (interpreted): the greedy tokens and every page XLA's write
  gives; the stats and the log name the write."""
  run = RunConfig(cache_dtype="float8_e4m3fn", max_context=256, max_batch=2, dtype="float32", page_size=16)
  with caplog.at_level(logging.INFO, logger="lcjax.engine.serving"):
    xla, kern = _engines(run, "auto", "pallas-interpret")
  assert ("decode steps write fp8 pages in XLA (nine small kernels a layer): page_write='auto'; not mosaic: the "
          "Mosaic GPU fp8 page writer needs a CUDA GPU, not 'cpu'; not pallas: the fp8 page-write kernel needs a "
          "CUDA GPU, not 'cpu'") in caplog.text
  calls = _count_kernel_calls(monkeypatch)
  a, b = _decode_both(xla, kern, calls, [[5, 6, 7, 8, 9] * 5, [3, 4, 5]], 20)
  assert all(calls)
  assert (a[0].stats["page_write"], b[0].stats["page_write"]) == ("xla", "pallas-interpret")


@pytest.mark.gpu
@pytest.mark.parametrize("L,P,min_bytes,pack", [
    (32, 130, 0, 1),                    # Llama-3-8B's heads and pages, a small pool
    (32, 1280, 2 ** 31, 2),             # 2.5 GiB (Llama-3-8B at 80K tokens): uint16 pairs
    (80, 900, 2 ** 32 + 1, 1),          # 4.4 GiB over 80 layers: 64-bit offsets, bytes
])
def test_gpu_kernel_writes_what_xla_writes(L, P, min_bytes, pack):
  """Compiled on the GPU at the models' page shape (Z 64, K 8, H 128), rows writing the last layer's top pages:
  bit for bit XLA's write."""
  assert triton_page_write.pack_for(L * P * 64 * 8 * 128) == pack and L * P * 64 * 8 * 128 >= min_bytes
  _check_on_gpu(triton_page_write.write_token, "lcjax_fp8_page_write", L, P)


@pytest.mark.gpu
@pytest.mark.parametrize("L,P", [(32, 130), (80, 900)])
def test_gpu_mosaic_writer_writes_what_xla_writes(L, P):
  """The Mosaic GPU page writer (lcjax.ops.mosaic_gpu.page_write), compiled, as the Triton one is tested: bit for
  bit XLA's write, in place, a small pool and a 4.4 GiB one."""
  from lcjax.ops.mosaic_gpu import page_write as mgpu_page_write
  if mgpu_page_write.unsupported(64, 128):
    pytest.skip(mgpu_page_write.unsupported(64, 128))
  _check_on_gpu(mgpu_page_write.write_token, "mosaic_gpu", L, P)


def _check_on_gpu(write_token, marker: str, L: int, P: int):
  """write_token compiled (its compiled text holds `marker`) on pools [L, P, 64, 8, 128], rows writing the last
  layer's top pages: no pool-sized buffer besides the donated pools, and XLA's bytes."""
  pool_bytes, limit = L * P * 64 * 8 * 128, jax.devices()[0].memory_stats().get("bytes_limit", 0)
  if limit < 5 * pool_bytes:        # K and V pools, written and expected, and the comparison's buffer
    pytest.skip(f"needs 5 x {pool_bytes / 2 ** 30:.1f} GiB; this process may take {limit / 2 ** 30:.1f} GiB")
  k_pool, v_pool, ks, vs, k, v, page, offset = _case(L=1, P=8, Z=64, K=8, H=128, B=8)
  big = [jnp.zeros((L, P, 64, 8, 128), jnp.float8_e4m3fn).at[L - 1, P - 8:].set(p[0]) for p in (k_pool, v_pool)]
  scales = [jnp.zeros((L, P, 8), jnp.float32).at[L - 1, P - 8:].set(s[0]) for s in (ks, vs)]
  page = jnp.where(page < 8, page + P - 8, P)
  layer = jnp.int32(L - 1)
  want = jax.jit(_reference)(*big, *scales, k, v, page, offset, layer)
  fn = jax.jit(write_token, donate_argnums=(0, 1, 2, 3))
  compiled = fn.lower(*big, *scales, k, v, page, offset, layer).compile()
  assert marker in compiled.as_text()
  # In place: no pool-sized buffer besides the donated pools (the uint16 view of 2-4 GiB pools included).
  assert compiled.memory_analysis().temp_size_in_bytes < big[0].size // 8, compiled.memory_analysis()
  got = fn(*big, *scales, k, v, page, offset, layer)
  # Bits, compared in one program on the device: no uint8 copy of a pool (the GPU suite's workers share the GPU).
  same = jax.jit(lambda g, w: jnp.array_equal(*(jax.lax.bitcast_convert_type(a, jnp.uint8) for a in (g, w))))
  for name, g, w in zip(("k pool", "v pool", "k scales", "v scales"), got, want):
    assert bool(same(g, w)), (name, g.shape)


@pytest.mark.gpu
def test_gpu_engine_decodes_through_the_kernel(monkeypatch):
  """On a GPU, page_write="auto" over 16-token pages (which the Mosaic GPU writer does not write) decodes through the
  compiled Triton kernel: the greedy tokens and pages of XLA's."""
  run = RunConfig(cache_dtype="float8_e4m3fn", max_context=256, max_batch=2, dtype="float32", page_size=16)
  xla, kern = _engines(run, "xla", "auto")
  assert kern.page_write == "pallas"
  calls = _count_kernel_calls(monkeypatch)
  _decode_both(xla, kern, calls, [[5, 6, 7, 8, 9] * 5, [3, 4, 5]], 20)
  assert not any(calls)
