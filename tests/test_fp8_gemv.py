"""The fp8 GEMV kernel (lcjax.ops.triton.gemv) and the model's decode-sized products through it.

Oracles: numpy float64 products of the dequantized weights (written here, not lcjax's reference); the model and the
engine with linear_kernel="xla" (XLA's widened product on each layer's slice) for the same weights. On CPUs the
kernel runs in the Pallas interpreter; the gpu tests compile it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lcjax
from lcjax.config import ConfigError, ModelConfig, RunConfig, WeightFormat, preset
from lcjax.engine import placement
from lcjax.engine.serving import resolve
from lcjax.model.llama import LINEAR, Llama, linear_shapes
from lcjax.ops import kernels, linear
from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
from lcjax.ops.triton import gemv as triton_gemv

L = 3
# Model-layout weight shapes of a small model: D 64, 2 KV heads of 2 query heads, head dim 16, F 128.
# A small layer's four linear weights (D 64, 4 query heads over 2 kv heads of 16, F 128), in the model's layout.
SHAPES = linear_shapes(ModelConfig("gemv-test", vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                                   head_dim=16, ffn_dim=128))
SMALL_TILES = triton_gemv.GemvTuning(block_n=32, block_k=16, min_steps=1)   # several programs and splits
# The library calls the tests make, each one program per shape (eager, every operation is one); layer is traced.
_gemv = jax.jit(triton_gemv.gemv_stacked, static_argnums=4, static_argnames=("tuning", "interpret"))
_quantize_stack = jax.jit(lambda w, spec: jax.vmap(lambda a: linear.quantize_weight(a, spec))(w), static_argnums=1)


def _stacked(name, rng):
  w = (rng.standard_normal((L, *SHAPES[name])) * 0.1).astype(np.float32)
  return _quantize_stack(w, LINEAR[name])


def _x(name, rows, rng, dtype):
  """x of `rows` rows (as [2, rows / 2] or [1, rows]), one row at 1e6 (past float16's range) and one at 1e-6."""
  x = rng.standard_normal(x_shape(LINEAR[name], SHAPES[name], rows))
  flat = x.reshape(rows, -1)
  flat[0] *= 1e6
  if rows > 1:
    flat[-1] *= 1e-6
  return jnp.asarray(x.astype(np.dtype(dtype)))


@pytest.mark.parametrize("name", ["tiny", "llama3-8b", "llama3.1-70b"])
def test_linear_shapes_are_the_models(name):
  """llama.linear_shapes is what the model makes (its fp8 weights, the layer axis dropped), and product_dims is
  product_layout's (N, Kd) of the K-major stacked weight the GEMV kernels read."""
  from lcjax.model.llama import product_dims
  cfg = dataclasses.replace(preset(name), n_layers=2)
  state = nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, weights=WeightFormat(fp8=True), rngs=nnx.Rngs(0)))
  layers = nnx.state(state)["layers"]
  for ckpt, shape in linear_shapes(cfg).items():
    _, block, w = ckpt.split("/")
    w8 = layers[block][w]
    spec = LINEAR[ckpt]
    R, N, Kd, _ = linear.product_layout(x_shape(spec, shape, 1), w8.shape, spec)
    assert (w8.shape[0], product_dims(ckpt, shape)) == (2, (N, Kd)), ckpt
    assert sorted(w8.shape[1:]) == sorted(shape), (ckpt, w8.shape, shape)
  # With `tensor`, the shapes are those of one device's shard of the weights the model shards by their axes.
  from lcjax import sharding
  for tensor in (2, 8):
    if cfg.n_kv_heads % tensor:
      continue
    shardings = sharding.param_shardings(nnx.state(state, nnx.Param), sharding.make_mesh(tensor=tensor))
    for ckpt, shape in linear_shapes(cfg, tensor).items():
      _, block, w = ckpt.split("/")
      local = shardings["layers"][block][w].shard_shape(layers[block][w].shape)
      assert local[1:] == tuple(shape[i] for i in linear.kmajor_order(LINEAR[ckpt])), (ckpt, tensor, local, shape)


def test_x_shape_is_what_einsum_multiplies():
  """linear.x_shape against einsum itself: the x it names contracts with the model's weight, batch and tokens
  first in the product."""
  for ckpt, shape in linear_shapes(preset("llama3-8b")).items():
    spec = LINEAR[ckpt]
    xs = linear.x_shape(spec, shape, batch=3, tokens=5)
    y = jax.eval_shape(lambda x, w, spec=spec: jnp.einsum(spec, x, w), jax.ShapeDtypeStruct(xs, jnp.float32),
                       jax.ShapeDtypeStruct(shape, jnp.float32))
    assert y.shape[:2] == (3, 5), (ckpt, xs, y.shape)


def x_shape(spec: str, shape, rows: int) -> tuple[int, ...]:
  """The shape of x ([1, rows, ...]) that einsum `spec` multiplies by a weight of model-layout `shape`."""
  return linear.x_shape(spec, shape, batch=1, tokens=rows)


def model_products(preset_name: str, rows: int):
  """(name, spec, w8, scale, x) of each linear weight of a preset's layer: 2 stacked layers quantized from normal
  draws, x of `rows` rows in bf16."""
  key = jax.random.PRNGKey(0)
  for name, shape in linear_shapes(preset(preset_name)).items():
    spec = LINEAR[name]
    w8, scale = jax.jit(jax.vmap(lambda a: linear.quantize_weight(a, spec)))(
        jax.random.normal(key, (2, *shape), jnp.bfloat16) * 0.02)
    yield name, spec, w8, scale, jax.random.normal(key, x_shape(spec, shape, rows), jnp.bfloat16)


def _normed64(x, s, eps):
  """x * rsqrt(mean(x^2) + eps) * s over x's last axis, in float64: the RMS norm a GEMV with the norm inside
  computes."""
  xf = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  return xf / np.sqrt((xf ** 2).mean(axis=-1, keepdims=True) + eps) * np.asarray(
      jnp.asarray(s).astype(jnp.float32), np.float64)


def _numpy_product(x, w8, scale, layer, spec):
  """einsum(spec, x, dequantized weight of `layer`) in float64, from the K-major bytes and scales."""
  xs, ws, out = linear.contracted(spec)
  kw = "".join(ws[i] for i in linear.kmajor_order(spec))
  w = np.asarray(w8)[layer].astype(np.float64) * np.asarray(scale)[layer].astype(np.float64)
  return np.einsum(f"{xs},{kw}->{out}", np.asarray(x).astype(np.float64), w)


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("rows,pack", [(1, 1), (64, 1), (5, 2)])
def test_kernel_against_numpy(name, rows, pack):
  """Every layer of the stack, rows up to the decode limit, rows past float16's range and far below it: bf16 x
  exactly as float64 up to float32 sums (the output rounded to bf16); float32 x within its hi + lo split. pack 2
  reads the weight as uint16 pairs (what weights of 2 to 4 GiB take)."""
  rng = np.random.default_rng(rows)
  w8, scale = _stacked(name, rng)
  spec = LINEAR[name]
  tuning = dataclasses.replace(SMALL_TILES, pack=pack)
  for dtype, rtol in ((jnp.bfloat16, 2 ** -8), (jnp.float32, 2e-6)):
    x = _x(name, rows, rng, dtype)
    for layer in range(L):
      got = _gemv(x, w8, scale, jnp.int32(layer), spec, tuning=tuning, interpret=True)
      assert got.dtype == x.dtype
      err = _row_errors(got, _numpy_product(x, w8, scale, layer, spec), rows)
      assert np.all(err <= rtol), (dtype, layer, err)


def _row_errors(got, want, rows):
  """max |got - want| / max |want| per row (the test rows differ by 12 orders of magnitude)."""
  got, want = np.asarray(got, np.float64).reshape(rows, -1), np.asarray(want, np.float64).reshape(rows, -1)
  return np.max(np.abs(got - want), axis=1) / np.max(np.abs(want), axis=1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_near_float32s_smallest_normal_keep_their_values(dtype):
  """scale_rows (the Triton GEMV's x, and the Mosaic GEMV's without the fixed split) on rows whose absmax is 2^-100
  down to float32's smallest normal: x == sum(x16) * scale, exactly for bf16 x, within the hi + lo split for
  float32 x, and the Triton kernel's product within its usual error of float64. A row scale of 2^(e - 14) for
  an absmax of 2^e under 2^-112 is no normal float32: on a machine that flushes subnormals it was 0, x / 0 was
  infinite and the product NaN."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((4, 256)) * np.array([2.0 ** -100, 2.0 ** -115, 2.0 ** -120, 1.0])[:, None]
  tiny = float(np.finfo(np.float32).tiny)
  x[3] = tiny * np.sign(x[3])                                                 # every value the smallest normal
  x[np.abs(x) < tiny] = 0.0                                                   # subnormals flush on many machines
  x = jnp.asarray(x.astype(np.dtype(dtype)))
  x16, s = jax.jit(linear.scale_rows)(x)
  back = np.asarray(x16).astype(np.float64).sum(0) * np.asarray(s).astype(np.float64)
  want = np.asarray(x).astype(np.float64)
  np.testing.assert_allclose(back, want, rtol=0 if dtype == jnp.bfloat16 else 2.0 ** -21, atol=0)
  name = "layers/mlp/w_down"
  w8, scale = _stacked(name, rng)
  xw = jnp.asarray((rng.standard_normal(x_shape(LINEAR[name], SHAPES[name], 2)) * 2.0 ** -118).astype(np.dtype(dtype)))
  got = _gemv(xw, w8, scale, jnp.int32(1), LINEAR[name], tuning=SMALL_TILES, interpret=True)
  err = _row_errors(np.asarray(got).astype(np.float32), _numpy_product(xw, w8, scale, 1, LINEAR[name]), 2)
  assert np.all(err <= 2.0 ** -8), err


def test_reference_is_the_widened_product():
  rng = np.random.default_rng(0)
  name = "layers/mlp/w_down"
  w8, scale = _stacked(name, rng)
  x = _x(name, 5, rng, jnp.float32)
  got = jax.jit(linear.gemv_stacked_reference, static_argnums=4)(x, w8, scale, jnp.int32(2), LINEAR[name])
  assert np.all(_row_errors(got, _numpy_product(x, w8, scale, 2, LINEAR[name]), 5) < 1e-6)


@pytest.mark.parametrize("R,N,Kd,want", [
    (1, 6144, 4096, (16, 64, 256, 4)),      # Llama-3-8B wqkv: 96 column blocks; 16 steps split to 4 of 4 steps
    (8, 28672, 4096, (16, 64, 256, 2)),     # w_gate_up: 448 blocks < 528, so 2 splits (896 programs)
    (1, 4096, 14336, (16, 64, 256, 8)),     # w_down: 64 blocks; 56 steps halve to 28, 14, 7 (odd: stop)
    (64, 10240, 8192, (64, 64, 256, 4)),    # 70B wqkv at 64 rows: 160 blocks x 4 splits = 640 >= 528
    (3, 128, 64, (16, 64, 64, 1)),          # the tiny model: Kd is one step, nothing to split
])
def test_plan_tiles_and_splits(R, N, Kd, want):
  """The default tiles, and splits doubled while the programs are short of the target and each split keeps
  min_steps: worked out by hand for the model shapes."""
  p = triton_gemv.plan(R, N, Kd)
  assert (p.Rp, p.bn, p.bk, p.S) == want


def test_pack_for_sizes():
  """uint16 pairs exactly where the lowering's 32-bit offsets would pass 2^31 one-byte elements."""
  assert [triton_gemv.pack_for(n) for n in (2 ** 31 - 1, 2 ** 31, 32 * 28672 * 4096, 2 ** 32, 2 ** 32 + 1)] == \
      [1, 2, 2, 2, 1]


def test_plan_refusals():
  with pytest.raises(ValueError, match="65 rows exceed GemvTuning.max_rows=64"):
    triton_gemv.plan(65, 128, 64)
  with pytest.raises(ValueError, match="num_splits=3 does not divide the 16 steps"):
    triton_gemv.plan(1, 128, 4096, triton_gemv.GemvTuning(num_splits=3))
  w8 = jnp.zeros((2, 8, 16), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="not a row-major"):
    triton_gemv.gemv_stacked(jnp.zeros((1, 16, 1)), w8, jnp.ones((2, 8, 1)), 0, "bdt,fd->btf", interpret=True)


def test_model_holds_weights_for_decode_sized_calls():
  """The model with the interpreted kernel (gemv_kernel "pallas-interpret"): a call of <= 64 rows runs the kernel on
  the stacked weights (its logits equal XLA's widened product's), a larger one does not hold them."""
  cfg = preset("tiny")
  state = nnx.state(Llama(cfg, dtype=jnp.float32, weights=WeightFormat(fp8=True), rngs=nnx.Rngs(0)))
  models = {k: Llama(cfg, dtype=jnp.float32, weights=WeightFormat(fp8=True), gemv_kernel=kernels.gemv_kernel(k),
                     rngs=nnx.Rngs(0))
            for k in ("xla", "pallas-interpret")}
  assert models["pallas-interpret"].holds_weights(64) and not models["pallas-interpret"].holds_weights(65)
  assert not models["xla"].holds_weights(1)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 7)), jnp.int32)
  logits = {}
  for k, m in models.items():
    nnx.update(m, state)
    logits[k], _ = nnx.jit(lambda m, t: m(t))(m, tokens)
  np.testing.assert_allclose(logits["pallas-interpret"], logits["xla"], rtol=2e-5, atol=2e-5)


def _count_kernel_calls(monkeypatch):
  """Count the model's traced calls of the kernels (the kernel modules' functions, which lcjax.ops.kernels' objects
  call), by weight einsum, kernel ("mosaic", "pallas" or "pallas-interpret") and the call's rows."""
  calls = []
  triton, mosaic = triton_gemv.gemv_stacked, mgpu_gemv.gemv_stacked

  def counted(x, w8, scale, layer, spec, **kw):
    calls.append((spec, "pallas-interpret" if kw.get("interpret") else "pallas", linear.rows_of(x, spec)))
    return triton(x, w8, scale, layer, spec, **kw)

  def counted_mosaic(x, w8, scale, layer, spec, **kw):
    calls.append((spec, "mosaic", linear.rows_of(x, spec)))
    return mosaic(x, w8, scale, layer, spec, **kw)

  monkeypatch.setattr(triton_gemv, "gemv_stacked", counted)
  monkeypatch.setattr(mgpu_gemv, "gemv_stacked", counted_mosaic)
  return calls


def test_engine_decodes_through_the_kernel(caplog, monkeypatch):
  """Greedy tokens through the kernel (interpreted) equal those of XLA's product, prompts of two lengths in one
  batch; the decode step traces the kernel for all four weights, and the stats name the product."""
  cfg = preset("tiny")
  run = RunConfig(weight_dtype="float8_e4m3fn", max_context=256, max_batch=2, dtype="float32")
  prompts = [[5, 6, 7, 8, 9] * 5, [3, 4, 5]]
  with caplog.at_level(logging.INFO, logger="lcjax.engine.serving"):
    xla = lcjax.Engine.random(cfg, run=run, seed=0)
  assert "the fp8 GEMV kernel needs a CUDA GPU" in caplog.text            # auto on a CPU, and the log says why
  kern = lcjax.Engine.random(cfg, run=run.replace(linear_kernel="pallas-interpret"), seed=0)
  calls = _count_kernel_calls(monkeypatch)
  a = xla.generate(prompts, max_new_tokens=6)
  assert not calls
  b = kern.generate(prompts, max_new_tokens=6)
  assert {spec for spec, kernel, _ in calls if kernel == "pallas-interpret"} == set(LINEAR.values())
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  assert a[0].stats["linear"].endswith("else fp8 widened to float32 by XLA")
  assert b[0].stats["linear"].endswith("else the fp8 GEMV kernel in the Pallas interpreter")


def test_linear_kernel_refusals():
  run = RunConfig(dtype="float32", linear_kernel="pallas")
  fp8 = WeightFormat(fp8=True)
  cpu = "the fp8 GEMV kernel needs a CUDA GPU, not 'cpu'"
  mcpu = "the Mosaic GPU fp8 GEMV kernel needs a CUDA GPU, not 'cpu'"
  on_cpu = {"mosaic": mcpu, "pallas": cpu}
  on_hopper = {"mosaic": None, "pallas": None}
  on_ada = {"mosaic": "needs a Hopper GPU", "pallas": None}
  assert placement.gemv_kernels_unsupported(preset("tiny")) == on_cpu      # this test runs on CPUs
  with pytest.raises(ConfigError, match="linear_kernel='pallas': the fp8 GEMV kernel needs a CUDA GPU, not 'cpu'"):
    placement.decode_linear(run, fp8, on_cpu)
  with pytest.raises(ConfigError, match="linear_kernel='mosaic': needs a Hopper GPU$"):
    placement.decode_linear(run.replace(linear_kernel="mosaic"), fp8, on_ada)
  with pytest.raises(ConfigError, match="linear_kernel='pallas' multiplies fp8 weights, and these are float32"):
    placement.decode_linear(run, WeightFormat(), on_hopper)
  assert placement.decode_linear(run, fp8, on_hopper)[0] == "pallas"
  auto = run.replace(linear_kernel="auto")
  assert placement.decode_linear(auto, fp8, on_hopper)[0] == "mosaic"
  assert placement.decode_linear(auto, fp8, on_ada) == ("pallas", "linear_kernel='auto'; needs a Hopper GPU")
  assert placement.decode_linear(auto, fp8, on_cpu) == ("xla", f"linear_kernel='auto': {mcpu}; {cpu}")
  with pytest.raises(ConfigError, match="linear_kernel='fast' must be one of auto, xla, mosaic, pallas, "
                                        "pallas-interpret"):
    RunConfig(linear_kernel="fast")
  with pytest.raises(ValueError, match="multiplies fp8 weights; these are in the parameter dtype"):
    Llama(preset("tiny"), gemv_kernel=kernels.gemv_kernel("pallas-interpret"), rngs=nnx.Rngs(0))


def test_mosaic_kernel_refuses_shapes_that_do_not_tile(monkeypatch):
  """On a Hopper GPU (both kernels' device checks pass), a model whose products do not tile by 64 names the first
  such weight: a refusal for linear_kernel='mosaic', the Triton kernel with that reason for 'auto'; on a mesh, the
  first such shard."""
  monkeypatch.setattr(mgpu_gemv, "unsupported", lambda: None)
  monkeypatch.setattr(triton_gemv, "unsupported", lambda: None)
  tiny = preset("tiny")
  assert placement.gemv_kernels_unsupported(tiny) == {"mosaic": None, "pallas": None}
  why = "w_down: the Mosaic GPU GEMV kernel tiles weights by 64 rows and 64 columns: Kd=96 is not a multiple of 64"
  odd_ffn = dataclasses.replace(tiny, ffn_dim=96)                    # w_gate_up N = 192 tiles, w_down's Kd = 96
  assert placement.gemv_kernels_unsupported(odd_ffn)["mosaic"] == why
  odd_dim = dataclasses.replace(tiny, dim=96)
  assert placement.gemv_kernels_unsupported(odd_dim)["mosaic"].startswith("wqkv: ") and "Kd=96 is" in \
      placement.gemv_kernels_unsupported(odd_dim)["mosaic"]
  fp8 = WeightFormat(fp8=True)
  run = RunConfig(dtype="float32", linear_kernel="mosaic")
  with pytest.raises(ConfigError, match=f"^linear_kernel='mosaic': {why}$"):
    placement.decode_linear(run, fp8, placement.gemv_kernels_unsupported(odd_ffn))
  auto = placement.decode_linear(run.replace(linear_kernel="auto"), fp8,
                                 placement.gemv_kernels_unsupported(odd_ffn))
  assert auto == ("pallas", f"linear_kernel='auto'; {why}")
  # On a mesh each device multiplies its own shards: at tensor=2, wo's contracted length is 2 heads x 16.
  shard_why = "wo: the Mosaic GPU GEMV kernel tiles weights by 64 rows and 64 columns: Kd=32 is not a multiple of 64"
  assert placement.gemv_kernels_unsupported(tiny, tensor=2)["mosaic"] == shard_why
  with pytest.raises(ConfigError, match=f"^linear_kernel='mosaic': {shard_why}$"):
    resolve(tiny, run.replace(tensor=2), weights=fp8, check_fit=False)


def test_engine_refuses_a_kernel_that_cannot_serve_before_making_weights(monkeypatch):
  """Engine.random refuses linear_kernel='pallas' on a CPU before it draws any weight."""
  from lcjax.engine import engine
  monkeypatch.setattr(engine, "Llama", None)      # drawing weights would call it
  with pytest.raises(ConfigError, match="linear_kernel='pallas': the fp8 GEMV kernel needs a CUDA GPU"):
    lcjax.Engine.random(preset("tiny"), run=RunConfig(weight_dtype="float8_e4m3fn", linear_kernel="pallas"))


@pytest.mark.gpu
@pytest.mark.parametrize("preset_name", ["llama3-8b", "llama3.1-70b"])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_kernel_at_model_shapes(preset_name, rows):
  """Compiled on the GPU at real shapes: against the float32 reference, bf16 activations."""
  for name, spec, w8, scale, x in model_products(preset_name, rows):
    fn = jax.jit(lambda x, w, s, i: triton_gemv.gemv_stacked(x, w, s, i, spec))
    assert "lcjax_fp8_gemv" in fn.lower(x, w8, scale, jnp.int32(1)).as_text()
    got = fn(x, w8, scale, jnp.int32(1)).astype(jnp.float32)
    want = linear.gemv_stacked_reference(x.astype(jnp.float32), w8, scale, jnp.int32(1), spec)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 2 ** -8, (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("preset_name", ["llama3-8b", "llama3.1-70b"])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_mosaic_kernel_with_the_norm_inside(preset_name, rows):
  """The Mosaic GPU kernel with the RMS norm inside (gemv_stacked(norm=...)), compiled at the two products that
  read a norm (QKV, gate/up), rows of different scales, against the float64 product of the float64 norm: within
  the float16 rounding of x * s (tests/test_mosaic_interpret.py has the same check on the interpreted kernel)."""
  if mgpu_gemv.unsupported():
    pytest.skip(mgpu_gemv.unsupported())
  eps = 1e-5
  for name, spec, w8, scale, x in model_products(preset_name, rows):
    if not spec.startswith("btd,"):
      continue
    x = (x.reshape(rows, -1) * (10.0 ** jnp.arange(rows) % 7 + 1)[:, None]).astype(x.dtype).reshape(x.shape)
    s = jax.random.uniform(jax.random.PRNGKey(1), (2, x.shape[-1]), jnp.float32, 0.2, 3.0).astype(jnp.bfloat16)
    got = jax.jit(lambda x, w, sc, s: mgpu_gemv.gemv_stacked(x, w, sc, jnp.int32(1), spec, dtype=jnp.float32,
                                                             norm=(s, eps)))(x, w8, scale, s)
    xn = _normed64(x, s[1], eps)
    want = _numpy_product(xn, w8, scale, 1, spec)
    bound = 2.0 ** -11 * _numpy_product(np.abs(xn), jnp.abs(w8.astype(jnp.float32)), scale, 1, spec)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert (err <= bound + 1e-6 * np.abs(want).max()).all(), (name, float(err.max()))


@functools.partial(jax.jit, static_argnums=1)
def _random_e4m3(key, shape):
  """e4m3 values of uniformly drawn bytes (a misread byte anywhere changes a sum), NaN codes moved to +-448."""
  b = jax.random.bits(key, shape, jnp.uint8)
  return jax.lax.bitcast_convert_type(jnp.where((b & 0x7F) == 0x7F, b - 1, b), jnp.float8_e4m3fn)


@pytest.mark.gpu
@pytest.mark.parametrize("D,F,L_,min_bytes,pack", [
    (8192, 28672, 10, 2 ** 32 + 1, 1),   # the 70B's w_gate_up over 10 layers, 4.4 GiB: 64-bit offsets, bytes
    (4096, 14336, 26, 2 ** 31, 2),       # Llama-3-8B's over 26 layers, 3.05 GiB: uint16 pairs (one-byte offsets
])                                       # wrapped past 2^31 there)
def test_gpu_kernel_reads_the_top_of_a_large_stack(D, F, L_, min_bytes, pack):
  """The last layer of a stack over 2 GiB, whose bytes lie past 2^31, against the reference."""
  spec = LINEAR["layers/mlp/w_gate_up"]
  kw, ks, kx = jax.random.split(jax.random.PRNGKey(0), 3)
  w8 = _random_e4m3(kw, (L_, 2, F, D))                                   # K-major [L, 2, F, D]: every byte drawn
  scale = jax.random.uniform(ks, (L_, 2, F, 1), jnp.float32, 1e-3, 2e-3)
  assert w8.size >= min_bytes and triton_gemv.pack_for(w8.size) == pack
  x = jax.random.normal(kx, (1, 1, D), jnp.bfloat16)
  got = jax.jit(lambda x, w, s, i: triton_gemv.gemv_stacked(x, w, s, i, spec))(x, w8, scale, jnp.int32(L_ - 1))
  want = linear.gemv_stacked_reference(x.astype(jnp.float32), w8, scale, jnp.int32(L_ - 1), spec)
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
  assert err < 2 ** -8, err


@pytest.mark.gpu
@pytest.mark.parametrize("ask,kernel", [("auto", "mosaic"), ("pallas", "pallas")])
def test_gpu_engine_decode_runs_the_kernel(ask, kernel, monkeypatch):
  """On a Hopper GPU, linear_kernel="auto" runs fp8 weights through the compiled Mosaic GPU kernel and "pallas"
  through the Triton one, in decode steps (2 rows) and prefill chunks (32 and 16 rows) alike (float32
  activations: their hi + lo split), with the greedy tokens of "xla"."""
  cfg = preset("tiny")
  run = RunConfig(weight_dtype="float8_e4m3fn", max_context=256, max_batch=2, dtype="float32")
  kern = lcjax.Engine.random(cfg, run=run.replace(linear_kernel=ask), seed=0)
  assert kern.decode_linear == kernel
  xla = lcjax.Engine.random(cfg, run=run.replace(linear_kernel="xla"), seed=0)
  prompts = [[5, 6, 7, 8, 9] * 5, [3, 4, 5]]
  calls = _count_kernel_calls(monkeypatch)
  a, b = xla.generate(prompts, max_new_tokens=8), kern.generate(prompts, max_new_tokens=8)
  assert {(s, k) for s, k, rows in calls} == {(s, kernel) for s in LINEAR.values()}
  assert {2, 16, 32} <= {rows for _, _, rows in calls}
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  assert b[0].stats["linear"].endswith(f"else {kernels.gemv_kernel(kernel).description}")
