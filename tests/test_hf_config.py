"""Reading an HF folder's config.json (lcjax.checkpoint.hf.hf_model_config) against transformers' own reading of it.

Oracle: transformers.AutoConfig on the same config.json (a key the file leaves out takes its config class's
default). Fields whose effect lcjax does not implement must be refused with one line naming the field.
"""
from __future__ import annotations

import json
import os

import pytest

from lcjax.checkpoint import CheckpointError
from lcjax.checkpoint.hf import hf_model_config

MINIMAL = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=16, intermediate_size=96)


def _folder(tmp_path, **config) -> str:
  src = str(tmp_path / "hf")
  os.makedirs(src)
  with open(os.path.join(src, "config.json"), "w") as f:
    json.dump(config, f)
  return src


def _auto_config(src):
  transformers = pytest.importorskip("transformers", reason="the oracle is HF transformers: pip install -e '.[test]'")
  return transformers.AutoConfig.from_pretrained(src)


def _one_line_error(src, *match):
  with pytest.raises(CheckpointError) as e:
    hf_model_config(src)
  msg = str(e.value)
  assert "\n" not in msg, msg
  for m in match:
    assert m in msg, msg


@pytest.mark.parametrize("arch", [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_missing_keys_take_the_config_class_defaults(tmp_path, arch):
  """A config.json with only the keys every LLaMA config needs: each field lcjax reads is what transformers builds
  the model with (rms_norm_eps defaults to 1e-6 in LlamaConfig and MistralConfig, not 1e-5; MistralConfig's
  num_key_value_heads to 8)."""
  model_type, cls = arch
  extra = {"sliding_window": None} if model_type == "mistral" else {}
  src = _folder(tmp_path, model_type=model_type, architectures=[cls], **MINIMAL, **extra)
  hf = _auto_config(src)
  cfg = hf_model_config(src)
  theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", None))
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
  assert cfg.norm_eps == hf.rms_norm_eps
  assert cfg.max_position == hf.max_position_embeddings
  assert cfg.rope_theta == theta
  assert cfg.tie_embeddings == hf.tie_word_embeddings
  assert (cfg.n_kv_heads, cfg.head_dim) == (hf.num_key_value_heads, head_dim)
  assert cfg.eos_ids == (hf.eos_token_id,)


LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], **MINIMAL)
MISTRAL = dict(model_type="mistral", architectures=["MistralForCausalLM"], **MINIMAL)


@pytest.mark.parametrize("config, field", [
    (dict(LLAMA, hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(MISTRAL, sliding_window=64, max_position_embeddings=512), "sliding_window=64"),
    (dict(MISTRAL, max_position_embeddings=32768), "sliding_window=4096"),     # MistralConfig's default window
    (dict(LLAMA, partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
], ids=["gelu", "mistral-window", "mistral-default-window", "partial-rotary", "partial-rotary-v5"])
def test_refuses_what_lcjax_does_not_compute(tmp_path, config, field):
  """Each of these makes transformers compute something else than lcjax's model (another activation, attention
  limited to a window of keys, rotary on part of each head): refused with one line naming the field."""
  _one_line_error(_folder(tmp_path, **config), "config.json", field)


@pytest.mark.parametrize("config", [
    dict(LLAMA, hidden_act="silu"), dict(LLAMA, hidden_act="swish"), dict(MISTRAL, sliding_window=None),
    dict(MISTRAL, sliding_window=4096, max_position_embeddings=4096), dict(LLAMA, partial_rotary_factor=1.0)],
    ids=["silu", "swish", "mistral-no-window", "window-covers-the-context", "full-rotary"])
def test_accepts_what_lcjax_computes(tmp_path, config):
  hf_model_config(_folder(tmp_path, **config))


L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("config, values", [
    (dict(LLAMA, rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}), ("10000.0", "500000.0")),
    (dict(LLAMA, rope_scaling=L3, rope_parameters=dict(L3, factor=32.0, rope_theta=5e5)), ("factor", "8.0", "32.0")),
], ids=["theta", "llama3-factor"])
def test_refuses_rope_settings_given_twice_with_different_values(tmp_path, config, values):
  """transformers 4 reads the top-level rope_theta / rope_scaling, 5 the rope_parameters: where a config.json
  holds both and they differ, it is refused with one line naming both values; where they agree it loads."""
  _one_line_error(_folder(tmp_path / "differ", **config), "config.json", *values)
  same = dict(config, rope_parameters=dict(config.get("rope_scaling") or {"rope_type": "default"},
                                           rope_theta=config.get("rope_theta", 5e5)))
  cfg = hf_model_config(_folder(tmp_path / "same", **same))
  assert cfg.rope_theta == same["rope_parameters"]["rope_theta"]


@pytest.mark.parametrize("config_bos", [None, 1], ids=["config-bos-null", "config-bos-another-token"])
def test_prompts_start_with_the_tokenizers_bos(tmp_path, config_bos):
  """HF's tokenizer prepends the BOS its own post-processor names (<s>, id 0), whatever config.json's
  bos_token_id says (null, or here </s>): the converted checkpoint's prompts start with the same id."""
  transformers = pytest.importorskip("transformers", reason="the oracle is HF transformers: pip install -e '.[test]'")
  pytest.importorskip("torch", reason="the HF folder is saved by transformers on torch: pip install -e '.[test]'")
  import dataclasses
  from lcjax.checkpoint import convert_hf
  from lcjax.tokenizer import Tokenizer
  from tests import fixtures_ckpt as fx
  from tests.test_convert_hf import CFG
  src, dst = str(tmp_path / "hf"), str(tmp_path / "ckpt")
  fx.make_hf_folder(src, dataclasses.replace(CFG, n_layers=1, bos_id=config_bos))
  assert json.load(open(os.path.join(src, "config.json")))["bos_token_id"] == config_bos
  convert_hf(src, dst, progress=False)
  hf_tok, tok = transformers.AutoTokenizer.from_pretrained(src), Tokenizer(dst)
  for text in fx.TEXTS:
    assert tok.encode(text) == hf_tok(text)["input_ids"], text
