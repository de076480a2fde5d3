"""Checkpoint values that a header cannot show, refused in one line before they give silent wrong answers: fp8
weight and input scales outside [float32 tiny, float32 max / 448] (NaN, inf, zero, negative, subnormal), NaN
bytes of e4m3 weights, e4m3 tensors outside an fp8 quantization_config or without a scale, safetensors spans
that overlap or leave gaps; and a quantization_config whose `ignore` patterns would hang the loader (or do not
parse) or whose structure is malformed.

The HF folders here are written byte by byte (tests.test_checkpoint_values.write_safetensors: the format's 8-byte
header length, JSON header, data), so a test can plant any value or offset; a well-formed folder converts (the
first test), so each refusal is the planted value's.
"""
from __future__ import annotations

import json
import os
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.checkpoint import CheckpointError
from lcjax.checkpoint.hf import HF_NAMES, SafetensorsFile, convert_hf, hf_shape
from lcjax.checkpoint.layout import QUANTIZED, param_shapes
from lcjax.checkpoint.restore import load_checkpoint
from lcjax.checkpoint.writer import CheckpointWriter
from lcjax.config import ModelConfig, WeightFormat
from tests.alarm import alarm

CFG = ModelConfig("values-test", vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                  ffn_dim=64, max_position=128, bos_id=0, eos_ids=(1,))
E4M3 = np.dtype(jnp.float8_e4m3fn)
_CODES = {np.dtype(np.float32): "F32", np.dtype(jnp.bfloat16): "BF16", E4M3: "F8_E4M3"}


def write_safetensors(path: str, tensors: dict[str, np.ndarray], offsets: dict[str, list[int]] | None = None,
                      tail: bytes = b"") -> None:
  """A safetensors file of `tensors` in order, their data_offsets as laid out unless `offsets` names others, and
  `tail` appended after the data."""
  header, data = {}, b""
  for name, a in tensors.items():
    header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape), "data_offsets": [len(data), len(data) + a.nbytes]}
    data += a.tobytes()
  for name, o in (offsets or {}).items():
    header[name]["data_offsets"] = o
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + data + tail)


def fp8_tensors(static: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
  """HF tensors of CFG in fp8: e4m3 projections with a float32 weight_scale per output channel (and a per-tensor
  input_scale when `static`), everything else float32."""
  rng = np.random.default_rng(seed)
  shapes = param_shapes(CFG)
  out = {}
  for hf_name, (name, in_dims) in HF_NAMES.items():
    if name not in shapes:
      continue
    full, stacked = shapes[name]
    for layer in (range(full[0]) if stacked else [None]):
      key = hf_name.replace("{i}", str(layer))
      shape = hf_shape(full[1:] if stacked else full, in_dims)
      if name in QUANTIZED:
        out[key] = rng.uniform(-400, 400, shape).astype(E4M3)
        out[key + "_scale"] = rng.uniform(1e-4, 1e-3, (shape[0], 1)).astype(np.float32)
        if static:
          out[key[:-len("weight")] + "input_scale"] = np.array([0.02], np.float32)
      else:
        out[key] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
  return out


def fp8_config(static: bool = False) -> dict:
  d = CFG.to_hf()
  d["quantization_config"] = {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {
          "targets": ["Linear"],
          "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token",
                                "dynamic": not static, "symmetric": True}}},
      "ignore": ["lm_head"]}
  return d


def write_folder(dst: str, tensors: dict[str, np.ndarray], config: dict) -> str:
  os.makedirs(dst)
  write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config, f)
  return dst


def refused(src: str, dst: str, *names: str) -> str:
  """convert_hf(src, dst)'s CheckpointError: one line naming `names`, and nothing at dst."""
  with pytest.raises(CheckpointError) as e:
    convert_hf(src, dst, progress=False)
  msg = str(e.value)
  assert "\n" not in msg, msg
  for n in names:
    assert n in msg, msg
  assert not os.path.exists(dst)
  return msg


WQ0 = "model.layers.0.self_attn.q_proj"


def test_a_well_formed_fp8_folder_converts(tmp_path):
  src = write_folder(str(tmp_path / "src"), fp8_tensors(static=True), fp8_config(static=True))
  assert convert_hf(src, str(tmp_path / "out"), progress=False)["tensors"] > 0


@pytest.mark.parametrize("value", [np.inf, np.nan, 0.0, -1e-3, 1e-45, 3e38],
                         ids=["inf", "nan", "zero", "negative", "subnormal", "overflows-448"])
@pytest.mark.parametrize("which", ["weight_scale", "input_scale"])
def test_a_scale_that_is_not_finite_and_positive_is_refused(tmp_path, which, value):
  """One bad channel of layer 0's down_proj scale (an inf scale gives NaN logits and token 0 forever, a NaN
  channel finite wrong logits; 3e38 times a weight of 448 overflows float32, 1e-45 is a subnormal that flushes
  to zero) refuses the conversion before anything is written."""
  t = fp8_tensors(static=True)
  name = f"model.layers.0.mlp.down_proj.{which}"
  t[name] = t[name].copy()
  t[name].reshape(-1)[-1] = value
  src = write_folder(str(tmp_path / "src"), t, fp8_config(static=True))
  refused(src, str(tmp_path / "out"), name, f"scale {float(np.float32(value))} at index {t[name].size - 1}",
          "is outside [1.18e-38, 7.6e+35]")


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_a_nan_e4m3_weight_is_refused(tmp_path, byte):
  t = fp8_tensors()
  w = t[WQ0 + ".weight"].copy()
  w.view(np.uint8)[3, 5] = byte
  t[WQ0 + ".weight"] = w
  src = write_folder(str(tmp_path / "src"), t, fp8_config())
  refused(src, str(tmp_path / "out"), WQ0 + ".weight", "element (3, 5)", f"0x{byte:02X}", "NaN")


def test_e4m3_weights_without_an_fp8_config_are_refused(tmp_path):
  """Without quantization_config the e4m3 projections would convert as a bf16 model of raw e4m3 values."""
  t = {k: v for k, v in fp8_tensors().items() if not k.endswith("_scale")}
  src = write_folder(str(tmp_path / "src"), t, CFG.to_hf())
  refused(src, str(tmp_path / "out"), "model.layers.0.", "float8_e4m3fn", "no fp8 quantization_config")


def test_e4m3_embeddings_without_a_scale_are_refused(tmp_path):
  """An e4m3 tensor that lcjax keeps in dtype needs a weight_scale to dequantize it with (a KeyError before)."""
  t = fp8_tensors()
  t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].astype(E4M3)
  src = write_folder(str(tmp_path / "src"), t, fp8_config())
  refused(src, str(tmp_path / "out"), "model.embed_tokens.weight", "without a weight_scale", "embed/embedding")


# -- safetensors spans: as the safetensors library, every byte of the data section belongs to one tensor ----------

_A, _B = np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)


@pytest.mark.parametrize("offsets,tail,names", [
    ({"b": [8, 24]}, b"", ["tensor b", "[8, 24]", "overlapping tensor a"]),     # b reads a's last 8 bytes
    ({"b": [0, 16]}, b"", ["overlapping tensor"]),                             # b is a's bytes
    ({"a": [16, 32], "b": [0, 16]}, b"", None),                                # out of order in the JSON: fine
    ({}, b"\0" * 8, ["end at byte 32 of a data section of 40"]),               # bytes no tensor owns
], ids=["overlap", "same-bytes", "json-order", "trailing"])
def test_safetensors_spans_tile_the_data_section(tmp_path, offsets, tail, names):
  path = str(tmp_path / "x.safetensors")
  write_safetensors(path, {"a": _A, "b": _B}, offsets, tail)
  if names is None:
    f = SafetensorsFile(path)
    np.testing.assert_array_equal(f.read("a"), _B)        # a's span is where b's bytes were written
    return
  with pytest.raises(CheckpointError) as e:
    SafetensorsFile(path)
  for n in names:
    assert n in str(e.value), str(e.value)


def test_a_gap_between_spans_is_refused(tmp_path):
  path = str(tmp_path / "x.safetensors")
  write_safetensors(path, {"a": _A, "b": _B}, {"b": [24, 40]}, b"\0" * 8)
  with pytest.raises(CheckpointError, match=r"leaving bytes \[16, 24\) after tensor a unused"):
    SafetensorsFile(path)


# -- quantization_config: its regular expressions and its structure ----------------------------------------------

def _config_refused(tmp_path, change, *names) -> str:
  """convert_hf of a folder whose fp8 config has `change` applied and no safetensors: the config's refusal, one
  line naming `names`, within seconds (a pattern that backtracks would take minutes)."""
  src = tmp_path / "src"
  src.mkdir()
  d = fp8_config()
  change(d["quantization_config"])
  (src / "config.json").write_text(json.dumps(d))
  t0 = time.perf_counter()
  with pytest.raises(CheckpointError) as e:
    with alarm(10.0):
      convert_hf(str(src), str(tmp_path / "out"), progress=False)
  assert time.perf_counter() - t0 < 5.0
  msg = str(e.value)
  assert "\n" not in msg, msg
  for n in names:
    assert n in msg, msg
  return msg


def test_an_ignore_pattern_that_backtracks_is_matched_in_linear_time(tmp_path):
  """re:(.|.)*X backtracks 2^len(name) times under `re` (minutes per name); it matches no projection, so the
  conversion goes on to the safetensors files (absent here)."""
  _config_refused(tmp_path, lambda q: q.update(ignore=["lm_head", "re:(.|.)*X"]), "no model.safetensors")


@pytest.mark.parametrize("ignore,names", [
    (["re:("], ["ignore entry 're:('", "not a valid regular expression", "missing )"]),
    (["re:(a)\\1"], ["ignore entry 're:(a)\\\\1'", "groupref", "does not support"]),
    (["re:x{70000}"], ["more than 4000 automaton states"]),
    (["re:.*mlp\\.down"], ["ignore entry 're:.*mlp\\\\.down' leaves model.layers.0.mlp.down_proj", "unquantized"]),
    ("lm_head", ["ignore=\"lm_head\" is not a list"]),
], ids=["invalid", "backreference", "too-large", "anchored-at-start", "not-a-list"])
def test_ignore_entries_are_refused_in_one_line(tmp_path, ignore, names):
  _config_refused(tmp_path, lambda q: q.update(ignore=ignore), *names)


@pytest.mark.parametrize("change,names", [
    (lambda q: q.update(config_groups=[{"weights": {}}]), ["config_groups is a list, not an object"]),
    (lambda q: q.update(config_groups={"g": "fp8"}), ["config_groups['g'] = \"fp8\" is not an object"]),
    (lambda q: q["config_groups"]["group_0"].update(weights=[8]), ["config_groups['group_0']", "not an object"]),
    (lambda q: q["config_groups"]["group_0"].update(input_activations="dynamic"), ["config_groups['group_0']"]),
], ids=["groups-a-list", "group-a-string", "weights-a-list", "activations-a-string"])
def test_a_malformed_quantization_config_is_refused_in_one_line(tmp_path, change, names):
  """Each was an AttributeError."""
  _config_refused(tmp_path, change, "config.json: quantization_config", *names)


# -- lcjax checkpoints: the stored fp8 values are checked as they are restored ------------------------------------

def write_fp8_checkpoint(dst: str, plant) -> str:
  """An fp8 lcjax checkpoint of CFG (static input scales) with `plant(name, array)` applied to each array."""
  weights = WeightFormat(fp8=True, static_inputs=True)
  rng = np.random.default_rng(0)
  with CheckpointWriter(dst, CFG, weights=weights) as w:
    for name, (full, stacked) in param_shapes(CFG, weights).items():
      for layer in (range(full[0]) if stacked else [None]):
        shape = full[1:] if stacked else full
        if name in QUANTIZED:
          a = rng.uniform(-400, 400, shape).astype(E4M3)
        elif name.endswith("_scale"):
          a = rng.uniform(1e-4, 1e-3, shape).astype(np.float32)
        else:
          a = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        w.write(name, plant(name, a), layer)
  return dst


def test_fp8_weights_stored_in_another_fp8_format_are_refused(tmp_path):
  """layers/attn/wo stored as float8_e5m2 in an fp8 checkpoint: refused in one line naming it and its dtype (read
  as e4m3, its bytes would be converted by value: 1024 to NaN, 2^-14 to 0)."""
  e5m2 = np.dtype(jnp.float8_e5m2)
  ckpt = write_fp8_checkpoint(str(tmp_path / "ckpt"),
                              lambda name, a: a.astype(np.float32).astype(e5m2) if name == "layers/attn/wo" else a)
  with pytest.raises(CheckpointError, match=r"ckpt: fp8 weights must be stored as float8_e4m3fn; layers/attn/wo "
                                            r"is float8_e5m2$"):
    load_checkpoint(ckpt, dtype="float32")


def _plant_last(target: str, value):
  """A `plant` that sets the last element of `target` to `value` (a byte of an e4m3 tensor)."""
  def plant(name, a):
    if name != target:
      return a
    a = a.copy()
    (a.reshape(-1).view(np.uint8) if a.dtype == E4M3 else a.reshape(-1))[-1] = value
    return a
  return plant


@pytest.mark.parametrize("target,value,names", [
    ("layers/mlp/w_down_scale", np.inf, ["layer 0 of layers/mlp/w_down", "a scale outside [1.18e-38, 7.6e+35]"]),
    ("layers/attn/wk_scale", np.nan, ["layer 0 of layers/attn/wqkv", "a scale outside"]),
    ("layers/mlp/w_down_scale", 3e38, ["layer 0 of layers/mlp/w_down", "a scale outside"]),
    ("layers/attn/wo", 0xFF, ["layer 0 of layers/attn/wo", "a NaN float8_e4m3fn weight"]),
    ("layers/mlp/w_gate_up_in_scale", 0.0, ["layer 0 of layers/mlp/w_gate_up_in_scale", "input scale outside"]),
], ids=["inf-weight-scale", "nan-weight-scale", "huge-weight-scale", "nan-weight", "zero-input-scale"])
def test_an_lcjax_checkpoints_fp8_values_are_checked_on_restore(tmp_path, target, value, names):
  ckpt = write_fp8_checkpoint(str(tmp_path / "ckpt"), _plant_last(target, value))
  with pytest.raises(CheckpointError) as e:
    load_checkpoint(ckpt, dtype="float32")
  msg = str(e.value)
  assert "\n" not in msg and all(n in msg for n in names), msg
