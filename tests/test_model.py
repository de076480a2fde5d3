"""The model against HF transformers on the same weights, plus structural checks of the presets."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lcjax.config import ModelConfig, RopeScaling, preset
from lcjax.model.llama import Llama
from tests import hf_oracle

# Published parameter counts (model cards / HF safetensors index totals).
PUBLISHED = {"smollm2-135m": 134.5e6, "llama2-7b": 6.74e9, "llama3-8b": 8.03e9, "llama3.1-8b": 8.03e9,
             "llama3.1-70b": 70.55e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
  cfg = preset(name)
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert n == cfg.param_count()
  assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.005, (name, n)


def _cfg(**kw):
  base = ModelConfig("t", vocab_size=97, dim=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16,
                     ffn_dim=80, rope_theta=500000.0, max_position=256,
                     rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position=32))
  return dataclasses.replace(base, **kw)


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True, "rope_scaling": None},
                                {"n_kv_heads": 6}, {"n_kv_heads": 1, "head_dim": 8}])
def test_logits_match_hf_transformers(kw):
  cfg = _cfg(**kw)
  hf = hf_oracle.make_hf_llama(cfg, seed=1)
  model = Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  hf_oracle.load_into(model, hf_oracle.hf_to_lcjax_state(hf, cfg))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 70))
  ref = hf_oracle.hf_logits(hf, tokens)
  got, _ = model(jnp.asarray(tokens, jnp.int32))
  scale = np.abs(ref).max()
  assert scale > 1.0, "oracle logits too small to be a meaningful check"
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4 * scale, rtol=0)


def test_bf16_close_to_f32():
  cfg = _cfg()
  hf = hf_oracle.make_hf_llama(cfg, seed=2)
  flat = hf_oracle.hf_to_lcjax_state(hf, cfg)
  m32 = hf_oracle.load_into(Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), flat)
  m16 = hf_oracle.load_into(Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), flat)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 40)), jnp.int32)
  a, _ = m32(tokens)
  b, _ = m16(tokens)
  assert b.dtype == jnp.float32  # logits are accumulated and returned in float32
  rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
  assert rel < 0.05, rel
