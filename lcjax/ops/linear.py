"""Linear layers over fp8 (float8_e4m3fn) weights: per-output-channel quantization and the products that read them.

A quantized weight is `w8` (e4m3) with a float32 `scale` of the weight's shape with its contracted axes set to 1
(wo [N, H, D] has scale [1, 1, D]): the weight is w8 * scale, one scale per output channel, absmax / 448. A fused
projection (QKV, gate/up) so keeps each part's scale, and a per-tensor scale is the same value broadcast.

`dense(x, w8, scale, spec)` computes einsum(spec, x, w) in one of two ways, chosen by the number of rows (tokens)
of x, a static shape:
  fp8 x fp8   x quantized to e4m3 with one scale per row (absmax / 448 over the contracted axes, "dynamic"),
              or with the checkpoint's static per-tensor `in_scale`; one e4m3 x e4m3 product accumulating in
              float32 (Hopper's fp8 tensor cores through cuBLASLt), then times both scales. Prefill chunks.
  widened     w8 widened to x's dtype inside the product (exact: every e4m3 value is a bfloat16), float32
              accumulation, times the scale. Decode: a handful of rows reads each weight byte once; quantizing
              them costs more than it saves (lcjax benchmarks/NOTES-fp8w.md).
`dense_reference` is the float32 model of both: the same quantization of x, dequantized operands, a float32
einsum. Only the summation order differs from the products above.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lcjax.ops.fp8 import E4M3, E4M3_MAX, scale_for

# Rows (batch x tokens) up to which `dense` widens the weights instead of quantizing the activations.
WIDEN_MAX_ROWS = 64


def contracted(spec: str) -> tuple[str, str, str]:
  """(x's labels, w's labels, output labels) of a two-operand einsum spec "btd,dkh->btkh"."""
  ins, out = spec.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  return xs, ws, out


def quantize_axes(spec: str) -> tuple[int, ...]:
  """The weight's contracted axes (labels it shares with x, absent from the output)."""
  xs, ws, out = contracted(spec)
  return tuple(i for i, c in enumerate(ws) if c in xs and c not in out)


def quantize_weight(w, spec: str):
  """w (the weight operand of `spec`) -> (w8 e4m3, scale float32 of w's shape with the contracted axes 1): one
  scale per output channel, the channel's absmax mapped to 448."""
  axes = quantize_axes(spec)
  wf = w.astype(jnp.float32)
  scale = scale_for(jnp.max(jnp.abs(wf), axis=axes, keepdims=True))
  return (wf / scale).astype(E4M3), scale


def dequantize_weight(w8, scale, dtype):
  return (w8.astype(jnp.float32) * scale).astype(dtype)


def _out_scale(scale, spec: str):
  """The weight scale laid out along the output's weight labels (the contracted axes dropped)."""
  axes = quantize_axes(spec)
  return jnp.squeeze(scale, axis=axes)


def quantize_rows(x, spec: str, in_scale=None):
  """x (the first operand of `spec`) -> (x8 e4m3, scale [rows..., 1...]): per row (absmax over the contracted
  axes) or the static per-tensor `in_scale` (values past +-448 x in_scale saturate)."""
  xs, ws, out = contracted(spec)
  axes = tuple(i for i, c in enumerate(xs) if c in ws and c not in out)
  xf = x.astype(jnp.float32)
  if in_scale is None:
    s = scale_for(jnp.max(jnp.abs(xf), axis=axes, keepdims=True))
  else:
    s = jnp.reshape(in_scale.astype(jnp.float32), (1,) * x.ndim)
  return jnp.clip(xf / s, -E4M3_MAX, E4M3_MAX).astype(E4M3), s


def _row_scale(s, spec: str):
  """A per-row activation scale (x's shape with its contracted axes 1) laid out along the output, whose leading
  labels are x's uncontracted ones, in order (true of every spec the model uses)."""
  xs, ws, out = contracted(spec)
  keep = "".join(c for c in xs if c in out)
  if not out.startswith(keep):
    raise ValueError(f"einsum {spec!r}: the output must start with x's uncontracted labels {keep!r}")
  s = jnp.squeeze(s, axis=tuple(i for i, c in enumerate(xs) if c not in out))
  return s.reshape(s.shape + (1,) * (len(out) - len(keep)))


def rows_of(x, spec: str) -> int:
  xs, ws, out = contracted(spec)
  return math.prod(n for n, c in zip(x.shape, xs) if c in out)


def path_for(x, spec: str) -> str:
  """Which product `dense` runs for x: "widened" or "fp8"."""
  return "widened" if rows_of(x, spec) <= WIDEN_MAX_ROWS else "fp8"


def dense(x, w8, scale, spec: str, *, in_scale=None, path: str | None = None):
  """einsum(spec, x, w8 * scale) in x's dtype; `path` forces "fp8" or "widened" (default: `path_for`)."""
  path = path or path_for(x, spec)
  if path == "widened":
    y = jnp.einsum(spec, x, w8.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * _out_scale(scale, spec)).astype(x.dtype)
  if path != "fp8":
    raise ValueError(f"{path=} must be 'fp8' or 'widened'")
  x8, xs = quantize_rows(x, spec, in_scale)
  y = jnp.einsum(spec, x8, w8, preferred_element_type=jnp.float32)
  return (y * _row_scale(xs, spec) * _out_scale(scale, spec)).astype(x.dtype)


def dense_reference(x, w8, scale, spec: str, *, in_scale=None, path: str | None = None):
  """The float32 model of `dense`: the same quantization of x (fp8 path), dequantized operands, float32 sums."""
  path = path or path_for(x, spec)
  w = w8.astype(jnp.float32) * scale
  if path == "widened":
    xf = x.astype(jnp.float32)
  else:
    x8, xs = quantize_rows(x, spec, in_scale)
    xf = x8.astype(jnp.float32) * xs
  return jnp.einsum(spec, xf, w, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
