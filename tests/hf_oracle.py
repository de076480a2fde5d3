"""Build small random HF transformers LLaMA models and copy their weights into lcjax (a test oracle).

The copy is written independently of the checkpoint converters so that a bug in one is caught by the other.
"""
from __future__ import annotations

import numpy as np


def make_hf_llama(cfg, seed=0, std=0.5):
  import torch
  import transformers
  hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
  rng = np.random.default_rng(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(torch.from_numpy(1.0 + 0.1 * rng.standard_normal(p.shape).astype(np.float32)))
      else:
        fan_in = p.shape[-1] if "embed" not in name else 1
        p.copy_(torch.from_numpy((std * rng.standard_normal(p.shape) / np.sqrt(fan_in) * 4).astype(np.float32)))
  return model


def hf_to_lcjax_state(hf_model, cfg):
  """A dict path -> np.ndarray in lcjax's model parameter layout (fused wqkv and w_gate_up)."""
  sd = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
  D, N, K, H, L = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers

  def stack(fmt, fn):
    return np.stack([fn(sd[fmt.format(i)]) for i in range(L)])

  out = {
      ("embed", "embedding"): sd["model.embed_tokens.weight"],
      ("final_norm", "scale"): sd["model.norm.weight"],
      ("layers", "attn_norm", "scale"): stack("model.layers.{}.input_layernorm.weight", lambda w: w),
      ("layers", "mlp_norm", "scale"): stack("model.layers.{}.post_attention_layernorm.weight", lambda w: w),
      # per KV head k: its query heads k*G .. k*G+G-1, then its key, then its value
      ("layers", "attn", "wqkv"): np.stack([np.concatenate([
          sd[f"model.layers.{i}.self_attn.q_proj.weight"].T.reshape(D, K, N // K, H),
          sd[f"model.layers.{i}.self_attn.k_proj.weight"].T.reshape(D, K, 1, H),
          sd[f"model.layers.{i}.self_attn.v_proj.weight"].T.reshape(D, K, 1, H)], axis=2) for i in range(L)]),
      ("layers", "attn", "wo"): stack("model.layers.{}.self_attn.o_proj.weight", lambda w: w.T.reshape(N, H, D)),
      ("layers", "mlp", "w_gate_up"): np.stack([np.stack([sd[f"model.layers.{i}.mlp.gate_proj.weight"].T,
                                                           sd[f"model.layers.{i}.mlp.up_proj.weight"].T], axis=1)
                                                 for i in range(L)]),
      ("layers", "mlp", "w_down"): stack("model.layers.{}.mlp.down_proj.weight", lambda w: w.T),
  }
  if not cfg.tie_embeddings:
    out[("lm_head", "kernel")] = sd["lm_head.weight"].T
  return out


def load_into(model, flat):
  """Copy a path -> array dict into an nnx model's parameters (shapes must match exactly)."""
  from flax import nnx
  import jax.numpy as jnp
  state = nnx.state(model, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    arr = flat[tuple(str(p) for p in path)]
    assert var.shape == arr.shape, (path, var.shape, arr.shape)
    var.set_value(jnp.asarray(arr, var.dtype)) if hasattr(var, "set_value") else setattr(var, "value",
                                                                                        jnp.asarray(arr, var.dtype))
  nnx.update(model, state)
  return model


def hf_logits(hf_model, tokens):
  import torch
  with torch.no_grad():
    return hf_model(torch.as_tensor(np.asarray(tokens))).logits.float().numpy()
