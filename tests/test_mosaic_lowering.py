"""The Mosaic GPU kernels lower for CUDA on a CPU-only machine (jax.export with platforms=("cuda",)).

Their lowering is Python: Pallas' Mosaic GPU lowering builds each kernel's MLIR, register layouts and relayouts
included, before anything reaches a GPU. Cross-lowering every kernel at its model shapes catches a layout the
lowering cannot convert, a shape it refuses or a primitive it lacks, in CI, before a GPU session is spent on it (a
layout cast to WGMMA_TRANSPOSED instead of WGMMA in mosaic_gpu.gemv fails here). Under JAX 0.11 (the GPU image's)
it also builds the TMA descriptors, so a copy of more strided dimensions than TMA has fails here too; JAX 0.10
defers that to the GPU. What it does not check: the numbers (the gpu tests of test_mgpu_gemv, test_kernels and
test_fp8_decode, and from JAX 0.11 the interpreted kernels of test_mosaic_interpret), PTX and its assembler,
shared memory limits at launch.
"""
from __future__ import annotations

import dataclasses

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from lcjax.config import preset
from lcjax.model.llama import LINEAR, linear_shapes
from lcjax.ops import linear
from lcjax.ops.hardware import jax_at_least
from lcjax.ops.mosaic_gpu import combine as mgpu_combine
from lcjax.ops.mosaic_gpu import flash as mgpu_flash
from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
from lcjax.ops.mosaic_gpu import page_write as mgpu_page_write
from lcjax.ops.mosaic_gpu import paged as mgpu_paged
from tests.test_fp8_gemv import x_shape

S = jax.ShapeDtypeStruct
MOSAIC_CALL = "mosaic_gpu_v2"          # the custom call a lowered Mosaic GPU kernel becomes
# JAX 0.11 lowers a Pallas Triton kernel only where a GPU is present (it asks the device for its compute
# capability): the cases with the Triton split combine cross-lower under JAX 0.10 (CI's) and on the GPU.
TRITON_CROSS_LOWERS = pytest.mark.skipif(
    jax_at_least(0, 11) and jax.default_backend() != "gpu",
    reason=f"JAX {jax.__version__} lowers Pallas Triton kernels only with a GPU present")


def _trivial_kernel(x):
  """A Mosaic GPU kernel that only copies: what any jaxlib able to cross-lower Mosaic GPU lowers."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  return plgpu.kernel(body, out_type=S(x.shape, x.dtype))(x)


@pytest.fixture(scope="module", autouse=True)
def _cross_lowering_available():
  """Skip the module, saying why, where this jaxlib cannot lower Mosaic GPU kernels for CUDA at all (then no test
  here could say anything about the kernels); a kernel that fails where the trivial one lowers fails its test."""
  try:
    _lowered_calls(_trivial_kernel, S((128,), jnp.float32))
  except Exception as e:  # noqa: BLE001 - any failure of the trivial kernel is the environment's
    pytest.skip(f"this jaxlib cannot lower Mosaic GPU kernels for CUDA: {type(e).__name__}: {str(e)[:200]}")


def _lowered_calls(fn, *args) -> list[str]:
  """The custom-call targets of fn lowered for CUDA (under DecodeTuning(combine="triton") the paged decode's split
  combine is a Triton call, which has no export compatibility guarantee: allowed here, as nothing is serialized)."""
  exp = export.export(jax.jit(fn), platforms=("cuda",),
                      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
  return re.findall(r"custom_call @([\w$.]+)", exp.mlir_module())


@pytest.mark.parametrize("preset_name,rows,dtype,tuning", [
    ("llama3-8b", 1, jnp.bfloat16, mgpu_gemv.MgpuGemvTuning()),
    ("llama3.1-70b", 8, jnp.bfloat16, mgpu_gemv.MgpuGemvTuning()),
    ("llama3-8b", 64, jnp.float32, mgpu_gemv.MgpuGemvTuning()),
    ("llama3.1-70b", 8, jnp.bfloat16, mgpu_gemv.MgpuGemvTuning(scale_in_kernel=True)),
    ("llama3-8b", 40, jnp.bfloat16, mgpu_gemv.MgpuGemvTuning(scale_in_kernel=True)),
    ("llama3-8b", 64, jnp.bfloat16, mgpu_gemv.MgpuGemvTuning(scale_in_kernel=True)),
    ("llama3-8b", 8, jnp.bfloat16, mgpu_gemv.MgpuGemvTuning(fixed_split=False)),
    ("llama3-8b", 1, jnp.bfloat16, mgpu_gemv.MgpuGemvTuning(a_in_smem=True))])
def test_gemv_lowers(preset_name, rows, dtype, tuning, monkeypatch):
  """The fp8 GEMV at the four products of a model, bf16 rows (two parts by magnitude, or row-scaled) and float32
  rows (hi and lo: at 64 rows RN 128, a shorter ring), with x scaled in the kernel (x^T tiles, a float16 tile
  written for the wgmma), and in the form the interpreter runs (the weight tile through shared memory), over 132
  SMs."""
  monkeypatch.setattr(mgpu_gemv, "sm_count", lambda: 132)
  for name, shape in linear_shapes(preset(preset_name)).items():
    spec = LINEAR[name]
    w8, scale = jax.eval_shape(jax.vmap(lambda a: linear.quantize_weight(a, spec)), S((2, *shape), jnp.bfloat16))
    x = S(x_shape(spec, shape, rows), dtype)
    calls = _lowered_calls(lambda x, w, s, i: mgpu_gemv.gemv_stacked(x, w, s, i, spec, tuning=tuning), x, w8, scale,
                           S((), jnp.int32))
    assert calls == [MOSAIC_CALL], (name, calls)


@pytest.mark.parametrize("preset_name,rows", [("llama3-8b", 1), ("llama3-8b", 8), ("llama3.1-70b", 3)])
def test_gemv_with_the_norm_inside_lowers(preset_name, rows, monkeypatch):
  """The fp8 GEMV with the RMS norm inside (gemv_stacked(norm=...)) at the two products that read a norm's output
  (the QKV and gate/up projections), bf16 rows as the residual holds them, over 132 SMs: one Mosaic GPU call."""
  monkeypatch.setattr(mgpu_gemv, "sm_count", lambda: 132)
  cfg = preset(preset_name)
  normed = {name: shape for name, shape in linear_shapes(cfg).items() if LINEAR[name].startswith("btd,")}
  assert len(normed) == 2, normed
  for name, shape in normed.items():
    spec = LINEAR[name]
    w8, scale = jax.eval_shape(jax.vmap(lambda a: linear.quantize_weight(a, spec)), S((2, *shape), jnp.bfloat16))
    x, s = S(x_shape(spec, shape, rows), jnp.bfloat16), S((2, cfg.dim), jnp.bfloat16)
    calls = _lowered_calls(lambda x, w, sc, s, i: mgpu_gemv.gemv_stacked(x, w, sc, i, spec, norm=(s, 1e-5)),
                           x, w8, scale, s, S((), jnp.int32))
    assert calls == [MOSAIC_CALL], (name, calls)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kv_splits", [1, 3])
def test_flash_prefill_lowers(fp8, kv_splits):
  """The prefill flash kernel, bf16 and 8-bit, Llama-3-8B heads (32 query, 8 KV, head_dim 128), 1K tokens, its keys
  in one range or cut into 3 splits."""
  q, kv = S((1, 1024, 32, 128), jnp.bfloat16), S((1, 1024, 8, 128), jnp.bfloat16)
  fn = mgpu_flash.flash_attention_fp8 if fp8 else mgpu_flash.flash_attention
  tuning = dataclasses.replace(mgpu_flash.FP8_TUNING if fp8 else mgpu_flash.FlashTuning(), kv_splits=kv_splits)
  assert MOSAIC_CALL in _lowered_calls(lambda q, k, v: fn(q, k, v, tuning=tuning), q, kv, kv)
  if fp8:                                        # a prefix read with the chunk's real rows (q_len)
    n = S((1,), jnp.int32)
    assert MOSAIC_CALL in _lowered_calls(lambda q, k, v, n: fn(q, k, v, None, None, n, causal=False, tuning=tuning),
                                         q, kv, kv, n)


@pytest.mark.parametrize("T,Z", [(1024, 64), (1000, 128), (256, 256), (128, 16)])
def test_paged_flash_prefill_lowers(T, Z):
  """The flash kernel over pages read in place (flash_attention_paged): Llama-3-8B heads, a chunk of T rows over
  a 128-slot table, pages of Z tokens (block_kv / Z TMA copies a block, or a block of a page)."""
  B, N, K, H, M = 2, 32, 8, 128, 128
  pages = S((B * M + 3, Z, K, H), jnp.bfloat16)
  args = (S((B, T, N, H), jnp.bfloat16), pages, pages, S((B, M), jnp.int32), S((B,), jnp.int32), S((B,), jnp.int32))
  calls = _lowered_calls(lambda q, kp, vp, t, d, kl: mgpu_flash.flash_attention_paged(q, kp, vp, t, d, kl, 3), *args)
  assert calls == [MOSAIC_CALL], calls
  if T == 1000:                                  # with the chunk's real rows (q_len), as the engine calls it
    calls = _lowered_calls(lambda *a: mgpu_flash.flash_attention_paged(*a[:6], 3, a[6]), *args, S((B,), jnp.int32))
    assert calls == [MOSAIC_CALL], calls


@pytest.mark.parametrize("T,Z,H", [(1024, 64, 128), (100, 128, 128), (256, 256, 128), (256, 64, 64)])
def test_fp8_paged_prefix_lowers(T, Z, H):
  """The FP8 kernel over fp8 pages read in place (flash_attention_fp8_paged): Llama-3-8B heads (and head dim 64),
  a chunk of T rows over a 128-slot table, pages of Z tokens (two key groups a block at 64, one at 128 and 256),
  with q_len."""
  B, N, K, M = 2, 32, 8, 128
  pages, scales = S((B * M + 3, Z, K, H), jnp.float8_e4m3fn), S((B * M + 3, K), jnp.float32)
  args = (S((B, T, N, H), jnp.bfloat16), pages, pages, scales, scales, S((B, M), jnp.int32), S((B,), jnp.int32),
          S((B,), jnp.int32))
  calls = _lowered_calls(lambda q, kp, vp, ks, vs, t, kl, ql: mgpu_flash.flash_attention_fp8_paged(
      q, kp, vp, ks, vs, t, kl, 3, ql), *args)
  assert calls == [MOSAIC_CALL], calls


@pytest.mark.parametrize("T,combine", [pytest.param(1, "triton", marks=TRITON_CROSS_LOWERS),
                                       pytest.param(4, "triton", marks=TRITON_CROSS_LOWERS), (1, "mosaic"),
                                       (5, "mosaic"), (1, "mosaic-flat"), (5, "mosaic-flat")])
def test_fp8_paged_decode_lowers(T, combine):
  """The fp8 paged decode kernel: Llama-3-8B heads over 64-token pages, one to five query tokens; with
  DecodeTuning(combine="mosaic") it is two Mosaic GPU kernels and no Triton call."""
  B, N, K, H, P, Z, M = 2, 32, 8, 128, 64, 64, 16
  pages, scales = S((P, Z, K, H), jnp.float8_e4m3fn), S((P, K), jnp.float32)
  args = (S((B, T, N, H), jnp.bfloat16), pages, pages, scales, scales, S((B, M), jnp.int32), S((B, T), jnp.int32),
          S((B,), jnp.int32))
  tuning = mgpu_paged.DecodeTuning(combine=combine)
  calls = _lowered_calls(lambda q, kp, vp, ks, vs, t, qp, kl: mgpu_paged.paged_decode_fp8(
      q, kp, vp, t, q_pos=qp, kv_len=kl, k_scale=ks, v_scale=vs, tuning=tuning), *args)
  assert calls[0] == MOSAIC_CALL and (calls == [MOSAIC_CALL] * 2 or combine == "triton"), calls


@pytest.mark.parametrize("B,splits,RN,T,G", [(1, 32, 8, 1, 4), (16, 2, 8, 1, 4), (1, 8, 24, 5, 4), (2, 64, 40, 10, 4),
                                        (1, 256, 64, 8, 8), (4, 1, 64, 16, 4)])
def test_split_combine_lowers(B, splits, RN, T, G):
  """The Mosaic GPU split combine: narrow rows (unswizzled, several splits a pipeline step), rows of 64
  (swizzled, a split a step), one split and 256, lse padded to a multiple of the warpgroup's bytes."""
  o = S((B, 8, splits, 128, RN), jnp.float32)
  lse = S((B, 8, mgpu_combine.lse_rows(splits, RN), RN), jnp.float32)
  assert _lowered_calls(lambda o, l: mgpu_combine.combine_splits(o, l, T=T, G=G, out_dtype=jnp.bfloat16), o, lse) \
      == [MOSAIC_CALL]
  assert _lowered_calls(lambda o, l: mgpu_combine.combine_splits_flat(o, l, T=T, G=G, out_dtype=jnp.bfloat16), o, o) \
      == [MOSAIC_CALL]


@pytest.mark.parametrize("T,G,Z,combine", [(1, 4, 64, "mosaic"), (5, 4, 128, "mosaic"), (16, 4, 64, "mosaic"),
                                           (1, 4, 64, "mosaic-flat"),
                                           pytest.param(1, 8, 256, "triton", marks=TRITON_CROSS_LOWERS)])
def test_bf16_paged_decode_lowers(T, G, Z, combine):
  """The Mosaic GPU decode over bfloat16 pages (one bf16 wgmma for Q K^T, V read as TMA brought it): 1 to 64 rows
  per kv head, 64- to 256-token pages, with the Mosaic GPU combine (two Mosaic GPU kernels, no Triton call)."""
  B, K, H, P, M = 2, 8, 128, 64, 16
  pages = S((P, Z, K, H), jnp.bfloat16)
  args = (S((B, T, K * G, H), jnp.bfloat16), pages, pages, S((B, M), jnp.int32), S((B, T), jnp.int32),
          S((B,), jnp.int32))
  tuning = mgpu_paged.DecodeTuning(combine=combine)
  calls = _lowered_calls(lambda q, kp, vp, t, qp, kl: mgpu_paged.paged_decode_bf16(
      q, kp, vp, t, q_pos=qp, kv_len=kl, tuning=tuning), *args)
  assert calls[0] == MOSAIC_CALL and (calls == [MOSAIC_CALL] * 2 or combine == "triton"), calls


@pytest.mark.skipif(not mgpu_page_write.refs_into_kernels(),
                    reason=f"Mosaic GPU kernels take mutable refs from JAX 0.11 (this is {jax.__version__})")
@pytest.mark.parametrize("Z", [64, 128])
def test_fp8_page_write_lowers_in_place(Z):
  """The Mosaic GPU fp8 page writer at Llama-3-8B's kv heads: one Mosaic GPU call whose four pool and scale
  operands are aliased to its outputs (written in place, no copy of a pool)."""
  L, P, K, H, B = 32, 130, 8, 128, 8
  args = (S((L, P, Z, K, H), jnp.float8_e4m3fn),) * 2 + (S((L, P, K), jnp.float32),) * 2 + (
      S((B, K, H), jnp.bfloat16),) * 2 + (S((B,), jnp.int32),) * 2 + (S((), jnp.int32),)
  text = jax.jit(mgpu_page_write.write_token).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @([\w$.]+)", text) == [MOSAIC_CALL]
  assert len(re.findall(r"#stablehlo\.output_operand_alias<", text)) == 4


def test_fp8_page_write_refuses_what_it_cannot_write():
  assert mgpu_page_write.unsupported_shape(64, 128) is None and mgpu_page_write.unsupported_shape(128, 128) is None
  assert "head_dim 128, got 64" in mgpu_page_write.unsupported_shape(64, 64)
  assert "multiple of 64 and at most 128, got 16" in mgpu_page_write.unsupported_shape(16, 128)
  assert "at most 128, got 256" in mgpu_page_write.unsupported_shape(256, 128)
  assert mgpu_page_write.unsupported(64, 128)                  # this CPU machine: no Hopper GPU
  with pytest.raises(ValueError, match="head_dim 128, got 96"):
    mgpu_page_write.write_token(*(jnp.zeros((1, 2, 64, 1, 96), jnp.float8_e4m3fn),) * 2,
                                *(jnp.zeros((1, 2, 1), jnp.float32),) * 2, *(jnp.zeros((1, 1, 96)),) * 2,
                                *(jnp.zeros((1,), jnp.int32),) * 2, 0)
