"""Rotary position embeddings in HF's rotate-half layout, with Llama 3.1 ("llama3") frequency scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from lcjax.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
  """[H/2] float32 inverse frequencies, scaled as transformers' `_compute_llama3_parameters` does."""
  H = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
  r = cfg.rope_scaling
  if r is None:
    return inv.astype(np.float32)
  low_wavelen = r.original_max_position / r.low_freq_factor
  high_wavelen = r.original_max_position / r.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / r.factor, inv)
  smooth = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
  smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions, inv_freq):
  """positions [B, T] int32 -> (cos, sin), each [B, T, 1, H/2] float32: the rotation of every position, computed
  once per call and shared by every layer's queries and keys."""
  ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)   # [B, T, H/2]
  return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def apply_rope(x, cos, sin):
  """x [B, T, heads, H] rotated by `rope_angles`' (cos, sin), in float32; the result in x's dtype."""
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
