"""Tests that need K and V of chosen sizes (fp8 page scales that differ page by page): the model's K and V at
position p scaled by factors of p, through a patch of the model's rotary angles (which see every call's positions,
once per forward, before the layers) and its QKV projection."""
from __future__ import annotations


def scale_kv_by_position(monkeypatch, k_factor, v_factor) -> None:
  """K and V at positions p [B, T] times k_factor(p) and v_factor(p) ([B, T] arrays) for the rest of the test."""
  from lcjax.model import llama
  real_qkv, real_angles = llama.Attention.qkv, llama.rope_angles
  call = {}

  def angles(positions, inv_freq):
    call["positions"] = positions
    return real_angles(positions, inv_freq)

  def qkv(self, x, rope, *args, **kwargs):
    q, k, v = real_qkv(self, x, rope, *args, **kwargs)
    p = call["positions"]
    return (q, k * k_factor(p)[:, :, None, None].astype(k.dtype), v * v_factor(p)[:, :, None, None].astype(v.dtype))
  monkeypatch.setattr(llama, "rope_angles", angles)
  monkeypatch.setattr(llama.Attention, "qkv", qkv)
