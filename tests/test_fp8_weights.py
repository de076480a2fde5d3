"""FP8 (e4m3) weights: the linear products, quantization at load, FP8 checkpoints, sharding.

Oracles: a float32 jnp model of the products that applies the same quantization (`dense_reference`, tight) and
plain float32 einsums (loose, the quantization error itself); HF transformers running compressed-tensors FP8
checkpoints (its own dequantization and activation fake-quantization, written independently of lcjax) on the same
files; the unsharded engine for the sharded one.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcjax
from lcjax.checkpoint import CheckpointError
from lcjax.checkpoint.hf import convert_hf
from lcjax.config import ModelConfig, RunConfig, WeightFormat
from lcjax.model.llama import weight_format
from lcjax.ops import linear

torch = transformers = None      # the oracle's packages, imported by _oracle() in the tests that compare with it


def _oracle() -> None:
  """Import torch and transformers for a test that compares with HF transformers; skip it where they are missing
  (the tests of lcjax's own products need neither)."""
  global torch, transformers
  torch = pytest.importorskip("torch", reason="the oracle, HF transformers, runs on torch: pip install -e '.[test]'")
  transformers = pytest.importorskip("transformers", reason="the oracle is HF transformers: pip install -e '.[test]'")

CFG = ModelConfig("fp8-test", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=128, rope_theta=10000.0, max_position=512, bos_id=0, eos_ids=(1,))
SPECS = {"qkv": ("btd,dkgh->btkgh", (64, 2, 4, 16)), "out": ("btnh,nhd->btd", (4, 16, 64)),
         "gate_up": ("btd,dcf->btcf", (64, 2, 128)), "down": ("btf,fd->btd", (128, 64))}


def _x(spec, shape, rows, rng):
  xs = spec.split(",")[0]
  sizes = {"b": 1, "t": rows, **{c: n for c, n in zip(spec.split(",")[1].split("-")[0], shape)}}
  return jnp.asarray(rng.standard_normal([sizes[c] for c in xs]), jnp.float32)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("rows", [3, 200])
def test_dense_against_reference_and_float32(name, rows):
  """Both products equal their float32 model with the same quantization (tight), and the float32 product within
  the e4m3 error (loose); rows pick the path (widened for decode-sized calls, fp8 x fp8 above)."""
  spec, shape = SPECS[name]
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32)
  x = _x(spec, shape, rows, rng)
  w8, scale = linear.quantize_weight(w, spec)
  order = linear.kmajor_order(spec)        # K-major: output axes, then the contracted ones (length 1 in scale)
  assert w8.dtype == jnp.float8_e4m3fn and w8.shape == tuple(shape[i] for i in order)
  assert scale.shape == tuple(1 if i in linear.quantize_axes(spec) else shape[i] for i in order)
  inv = np.argsort(order)                  # back to the model's layout, where the stored scale broadcasts
  np.testing.assert_array_equal(linear.dequantize_weight(w8, scale, spec, jnp.float32),
                                linear.dequantize_stored(jnp.transpose(w8, inv), jnp.transpose(scale, inv),
                                                         jnp.float32))
  assert linear.path_for(x, spec) == ("widened" if rows <= linear.WIDEN_MAX_ROWS else "fp8")
  got = linear.dense(x, w8, scale, spec)
  np.testing.assert_allclose(got, linear.dense_reference(x, w8, scale, spec), rtol=2e-5, atol=2e-5)
  exact = jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)
  rel = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
  assert rel < (0.04 if rows <= linear.WIDEN_MAX_ROWS else 0.06), rel


def test_weight_scales_are_per_output_channel():
  """Every output channel's largest |value| maps to e4m3's 448, and dequantizing is within half an e4m3 step."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((4, 16, 64)) * np.linspace(0.01, 3, 64), jnp.float32)   # wo [N, H, D]
  w8, scale = linear.quantize_weight(w, "btnh,nhd->btd")
  assert w8.shape == (64, 4, 16) and scale.shape == (64, 1, 1)
  np.testing.assert_array_equal(jnp.max(jnp.abs(w8.astype(jnp.float32)), axis=(1, 2)), 448.0)
  back = linear.dequantize_weight(w8, scale, "btnh,nhd->btd", jnp.float32)
  scale = jnp.transpose(scale, (1, 2, 0))
  assert float(jnp.max(jnp.abs(back - w) / (jnp.abs(w) + scale))) <= 1 / 16 + 1e-6


def test_static_input_scale_saturates_finite_values_only():
  """A static input scale saturates large finite activations; an inf or NaN one becomes NaN (as with a per-row
  scale), so the product and then the logits show it instead of a finite 448 x in_scale."""
  x = jnp.asarray([[[1.0, -3.0, 1000.0, np.inf, -np.inf, np.nan]]])
  x8, s = linear.quantize_rows(x, "btd,df->btf", in_scale=jnp.asarray([0.5]))
  np.testing.assert_array_equal(x8.astype(jnp.float32) * s, [[[1.0, -3.0, 224.0, np.nan, np.nan, np.nan]]])


# -- FP8 checkpoints (compressed-tensors and quant_method "fp8"), against transformers -------------------------

def _hf_model(seed=0, std=0.3):
  _oracle()
  torch.manual_seed(seed)
  hf_cfg = transformers.LlamaConfig(**{k: v for k, v in CFG.to_hf().items() if k != "architectures"})
  model = transformers.LlamaForCausalLM(hf_cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0, std)
  return model


def write_fp8_folder(dst, model, *, method="compressed-tensors", weights="channel", activations="token",
                     ignore=("lm_head",), extra=None):
  """An FP8 HF folder written to the formats' specs: e4m3 weights [out, in] with `weight_scale` ([out, 1] per
  channel, [1] per tensor) and, for static activations, a per-tensor `input_scale` (the largest |x| seen on a
  calibration batch / 448, as llm-compressor computes it)."""
  _oracle()
  from safetensors.torch import save_file
  sd, calib = {}, {}
  if activations == "tensor":
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: calib.__setitem__(n, i[0].abs().max().item()))
             for n, m in model.named_modules() if n.endswith("proj")]
    with torch.no_grad():
      model(torch.arange(2, 66)[None])
    for h in hooks:
      h.remove()
  for k, v in model.state_dict().items():
    if k.endswith("proj.weight"):
      v = v.float()
      s = (v.abs().amax(dim=1, keepdim=True) if weights == "channel" else v.abs().max().reshape(1)) / 448
      sd[k] = (v / s).to(torch.float8_e4m3fn)
      sd[k[:-len("weight")] + "weight_scale"] = s.to(torch.bfloat16 if method == "compressed-tensors" else
                                                      torch.float32).reshape(-1, 1) if weights == "channel" else \
          s.reshape(()) if method == "fp8" else s
      if activations == "tensor":
        sd[k[:-len("weight")] + "input_scale"] = torch.tensor([calib[k[:-len(".weight")]] / 448]).reshape(
            () if method == "fp8" else (1,))
    else:
      sd[k] = v.to(torch.bfloat16)
  os.makedirs(dst, exist_ok=True)
  save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(dst, "model.safetensors"),
            metadata={"format": "pt"})
  d = model.config.to_dict()
  if method == "compressed-tensors":
    d["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": activations,
                                  "dynamic": activations == "token", "symmetric": True}}},
        "ignore": list(ignore)}
  else:
    d["quantization_config"] = {"quant_method": "fp8", "activation_scheme":
                                "static" if activations == "tensor" else "dynamic"}
  d["quantization_config"].update(extra or {})
  d["torch_dtype"] = "bfloat16"
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(d, f)
  return dst


@pytest.fixture(scope="module")
def hf_model():
  return _hf_model()


def _transformers_logits(folder, ids):
  _oracle()
  pytest.importorskip("compressed_tensors", reason="transformers loads FP8 checkpoints through compressed-tensors "
                      "(the test extra installs it)")
  m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  with torch.no_grad():
    return m(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("weights,activations", [("channel", "token"), ("tensor", "tensor")])
def test_compressed_tensors_against_transformers(tmp_path, hf_model, weights, activations):
  """FP8-Dynamic (per-channel weights, per-token activations) and static FP8 (per-tensor weights and inputs):
  lcjax's logits over a prefill-sized call equal transformers' on the same files, whose own fake-quantization of
  the activations is the oracle."""
  folder = write_fp8_folder(str(tmp_path / "ct"), hf_model, weights=weights, activations=activations)
  ids = np.random.default_rng(0).integers(2, 256, 96).tolist()
  want = _transformers_logits(folder, ids)
  eng = lcjax.Engine.load(folder, dtype="float32", max_context=256)
  assert eng.weights == WeightFormat(fp8=True, static_inputs=activations == "tensor")
  got = eng.logits([ids])[0]
  scale = np.abs(want).max()
  err = np.abs(got - want).max() / scale
  assert err < 2e-3, err
  np.testing.assert_array_equal(got[-16:].argmax(-1), want[-16:].argmax(-1))


def test_fp8_method_equals_compressed_tensors(tmp_path, hf_model):
  """quant_method "fp8" (per-tensor weight and input scales) converts to the same lcjax tensors as the same
  weights in compressed-tensors' static per-tensor form, which the test above checks against transformers."""
  a = write_fp8_folder(str(tmp_path / "a"), hf_model, method="fp8", weights="tensor", activations="tensor")
  b = write_fp8_folder(str(tmp_path / "b"), hf_model, weights="tensor", activations="tensor")
  ea = lcjax.Engine.load(a, dtype="float32", max_context=256)
  eb = lcjax.Engine.load(b, dtype="float32", max_context=256)
  fa, fb = (dict(jax.tree_util.tree_leaves_with_path(e.params)) for e in (ea, eb))
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_array_equal(np.asarray(fa[k], np.float32), np.asarray(fb[k], np.float32), err_msg=str(k))


def test_fused_projections_keep_each_parts_scale(tmp_path, hf_model):
  """Per-tensor scales of q, k and v (different values) become per-channel scales of the fused wqkv, and the
  e4m3 bytes are copied, not requantized."""
  folder = write_fp8_folder(str(tmp_path / "ct"), hf_model, weights="tensor", activations="token")
  eng = lcjax.Engine.load(folder, dtype="float32", max_context=256)
  from safetensors.torch import load_file
  sd = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v.float()).numpy()
        for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
  attn = eng.params["layers"]["attn"]
  w8, scale = np.asarray(attn["wqkv"][...])[1], np.asarray(attn["wqkv_scale"][...])[1]   # layer 1, [K, G + 2, H, D]
  G = CFG.n_heads // CFG.n_kv_heads
  q = sd["model.layers.1.self_attn.q_proj.weight"].reshape(2, G, 16, 64)      # HF [N * H, D] is K-major already
  k = sd["model.layers.1.self_attn.k_proj.weight"].reshape(2, 16, 64)
  np.testing.assert_array_equal(w8[:, :G].view(np.uint8), q)
  np.testing.assert_array_equal(w8[:, G].view(np.uint8), k)
  qs = float(sd["model.layers.1.self_attn.q_proj.weight_scale"].ravel()[0])
  ks = float(sd["model.layers.1.self_attn.k_proj.weight_scale"].ravel()[0])
  assert qs != ks
  np.testing.assert_array_equal(scale[:, :G], qs)
  np.testing.assert_array_equal(scale[:, G], ks)


def test_per_channel_scales_stay_on_their_channels(tmp_path, hf_model):
  """Per-channel weight scales (HF's [out, 1], one per row of an [out, in] weight) land on their own output
  channels: every projection lcjax dequantizes at load, written back in HF's layout, is HF's e4m3 weight times
  its scale row by row (q, k and v's rows are (head, dim) pairs in lcjax, a single axis in HF)."""
  from safetensors.torch import load_file
  from lcjax.checkpoint.hf import export_hf
  folder = write_fp8_folder(str(tmp_path / "ct"), hf_model, weights="channel", activations="token")
  eng = lcjax.Engine.load(folder, dtype="float32", max_context=256, weight_dtype="bfloat16")
  sd = load_file(os.path.join(folder, "model.safetensors"))
  checked = 0
  for name, got in export_hf(eng.params, CFG):
    if name.endswith("proj.weight"):
      scale = sd[name[:-len("weight")] + "weight_scale"].float()
      assert scale.shape == (got.shape[0], 1) and len(set(scale.ravel().tolist())) > 1, name
      np.testing.assert_array_equal(got, (sd[name].float() * scale).numpy(), err_msg=name)
      checked += 1
  assert checked == 7 * CFG.n_layers


def test_dequantize_at_load(tmp_path, hf_model):
  """weight_dtype=bfloat16 (the run's dtype) serves an FP8 checkpoint with its weights dequantized at load."""
  folder = write_fp8_folder(str(tmp_path / "ct"), hf_model)
  e8 = lcjax.Engine.load(folder, dtype="float32", max_context=256)
  ef = lcjax.Engine.load(folder, dtype="float32", max_context=256, weight_dtype="bfloat16")
  assert not ef.weights.fp8 and ef.params["layers"]["mlp"]["w_down"][...].dtype == jnp.float32
  w8, scale = e8.params["layers"]["mlp"]["w_down"][...], e8.params["layers"]["mlp"]["w_down_scale"][...]
  want = np.asarray(w8, np.float32) * np.asarray(scale)            # [L, D, F]: K-major
  np.testing.assert_array_equal(np.asarray(ef.params["layers"]["mlp"]["w_down"][...]), want.transpose(0, 2, 1))


@pytest.mark.parametrize("change,needle", [
    (dict(weights="channel", extra={"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}, "input_activations": None}}}), "quant_method"),
    (dict(extra={"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block"}, "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}), "block"),
    (dict(extra={"quant_method": "awq", "bits": 4}), "'awq'"),
    (dict(method="fp8", extra={"weight_block_size": [128, 128]}), "weight_block_size"),
    (dict(ignore=("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj")), "unquantized"),
])
def test_other_schemes_are_refused(tmp_path, hf_model, change, needle):
  folder = write_fp8_folder(str(tmp_path / "q"), hf_model, **change)
  with pytest.raises(CheckpointError, match=needle) as e:
    convert_hf(folder, str(tmp_path / "out"))
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "out")


# -- quantization at load, random fp8 weights, meshes ---------------------------------------------------------

def test_quantize_at_load_streams_the_same_model(tmp_path):
  """A bf16/float32 checkpoint served with weight_dtype=float8_e4m3fn: the layer-at-a-time conversion in restore
  gives the same parameters as quantizing the whole loaded state, and the logits stay near HF's float32 (weights
  of a trained model's scale: a random model with large weights amplifies any error layer by layer)."""
  folder = str(tmp_path / "hf")
  hf_model = _hf_model(seed=1, std=0.08)
  hf_model.save_pretrained(folder, safe_serialization=True)
  e32 = lcjax.Engine.load(folder, dtype="float32", max_context=256)
  e8 = lcjax.Engine.load(folder, dtype="float32", max_context=256, weight_dtype="float8_e4m3fn")
  whole = lcjax.Engine(e32.cfg, e32.params, run=e32.run.replace(weight_dtype="float8_e4m3fn"))
  assert weight_format(e8.params).fp8
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(e8.params),  # noqa: B905
                               jax.tree_util.tree_leaves_with_path(whole.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))
  ids = np.random.default_rng(1).integers(2, 256, 80).tolist()
  with torch.no_grad():
    ref = hf_model(torch.tensor([ids])).logits[0].numpy()
  got = e8.logits([ids])[0]
  err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  print(f"fp8 weights vs float32: relative error {err:.3g}")
  assert 1e-4 < err < 0.05, err         # quantized (not the float32 model), within e4m3's error of it
  assert (got[-32:].argmax(-1) == ref[-32:].argmax(-1)).mean() >= 0.75


def test_generate_with_fp8_weights_reports_them():
  eng = lcjax.Engine.random(CFG, run=RunConfig(dtype="float32", max_context=256, weight_dtype="float8_e4m3fn"))
  res = eng.generate(list(range(2, 100)), max_new_tokens=4)
  assert res.stats["weight_dtype"] == "float8_e4m3fn" and "fp8 x fp8" in res.stats["linear"]
  assert "float8_e4m3fn" in eng.plan.table()
  # The plan counts the parameters the engine holds.
  held = sum(x.nbytes for x in jax.tree.leaves(eng.params))
  assert eng.plan.weights == held


@pytest.mark.parametrize("tensor,seq", [(2, 2), (4, 1), (1, 4)])
def test_sharded_equals_unsharded(tensor, seq):
  """fp8 weights on a mesh (scales split with their channels; tensor=4 repeats the 2 KV heads and their scales):
  the same logits and prompt logits as on one device."""
  run = RunConfig(dtype="float32", max_context=256, weight_dtype="float8_e4m3fn", prefill_chunk=128)
  one = lcjax.Engine.random(CFG, run=run, seed=3)
  many = lcjax.Engine.random(CFG, run=run.replace(tensor=tensor, seq=seq), seed=3)
  ids = np.random.default_rng(2).integers(2, 256, 100).tolist()
  np.testing.assert_allclose(many.logits([ids]), one.logits([ids]), rtol=2e-5, atol=2e-5)
  a, b = one.generate(ids, max_new_tokens=6), many.generate(ids, max_new_tokens=6)
  assert a.token_ids == b.token_ids


@pytest.mark.skipif(len(jax.devices()) < 3, reason="needs 3 devices (fake CPU devices via conftest)")
def test_a_seq_mesh_that_pads_the_call_multiplies_its_real_rows_as_one_device():
  """seq=3 pads a call's tokens to whole zigzag chunks (64 -> 66, 2 x 32 -> 2 x 36): the products take the path of
  the call's real rows, 64 (widened, as on one device), not that of the padded rows (fp8 x fp8, quantized
  activations: logits about 5% off). The uncached forward of 64 tokens and of 2 x 32, and a prefill chunk of 64."""
  run = RunConfig(dtype="float32", max_context=256, weight_dtype="float8_e4m3fn", prefill_chunk=64,
                  linear_kernel="xla")
  one = lcjax.Engine.random(CFG, run=run, seed=3)
  mesh = lcjax.Engine(CFG, one.params, run=run.replace(seq=3))
  ids = np.random.default_rng(4).integers(2, 256, 64).tolist()
  for rows in ([ids], [ids[:32], ids[32:]]):
    np.testing.assert_allclose(mesh.logits(rows), one.logits(rows), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(mesh.prompt_logits(ids), one.prompt_logits(ids), rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,fp8_gemm", [(256, True), (8, False)])
def test_gpu_linear_runs_fp8_gemms(rows, fp8_gemm):
  """On a GPU a prefill-sized call's product is an fp8 x fp8 cuBLASLt GEMM (a silent bf16 product fails this);
  a decode-sized call's reads the fp8 weight widened."""
  rng = np.random.default_rng(0)
  w8, scale = linear.quantize_weight(jnp.asarray(rng.standard_normal((4096, 2, 1024)), jnp.bfloat16),
                                     "btd,dcf->btcf")
  x = jnp.asarray(rng.standard_normal((1, rows, 4096)), jnp.bfloat16)
  txt = jax.jit(lambda x, w, s: linear.dense(x, w, s, "btd,dcf->btcf")).lower(x, w8, scale).compile().as_text()
  gemm = [l for l in txt.splitlines() if "custom_call_target=\"__cublas$lt$matmul$f8\"" in l]
  assert bool(gemm) == fp8_gemm, txt[-3000:]


def test_cli_names_fp8_weights(tmp_path, hf_model):
  """--checkpoint=<an FP8 HF folder> just works, and the stats table and the memory plan name the weight format."""
  from tests import cli_inprocess
  from tests import fixtures_ckpt as fx
  folder = write_fp8_folder(str(tmp_path / "ct"), hf_model)
  fx.byte_level_tokenizer_json(os.path.join(folder, "tokenizer.json"), vocab_size=256)
  p = cli_inprocess.run([f"--checkpoint={folder}", "--prompt=hello there", "--max_new_tokens=3", "--nochat",
                         "--nowarmup", "--config.dtype=float32", "--config.max_context=256"])
  assert p.returncode == 0, p.stderr[-3000:]
  assert "float8_e4m3fn (per-token activations) weights" in p.stdout
  assert "weights" in p.stdout and "(float8_e4m3fn (per-token activations))" in p.stdout + p.stderr


def test_killed_fp8_conversion_leaves_nothing_that_loads(tmp_path, hf_model):
  from lcjax.checkpoint import load_config
  from tests.test_convert_hf import _tool, kill_mid_conversion
  folder = write_fp8_folder(str(tmp_path / "ct"), hf_model)
  dst = str(tmp_path / "out")
  tmp = kill_mid_conversion(folder, dst)
  assert os.path.isdir(tmp) and not os.path.exists(dst)
  with pytest.raises(CheckpointError, match="incomplete"):
    load_config(tmp)
  p = _tool([f"--src={folder}", f"--dst={dst}"])
  p.wait(timeout=120)
  assert p.returncode == 0, p.stderr
  assert lcjax.Engine.load(dst, dtype="float32", max_context=256).weights.fp8
