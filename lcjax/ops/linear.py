"""Linear layers over fp8 (float8_e4m3fn) weights: per-output-channel quantization and the products that read them.

A weight of einsum `spec` (the model's layout, e.g. w_down [F, D] of "btf,fd->btd") is held quantized as `w8`
(e4m3) in K-major order, its output axes first and its contracted axes last (w_down as [D, F], wqkv [D, K, G, H]
as [K, G, H, D]): Hopper's fp8 tensor-core GEMMs (cuBLASLt) take both operands contiguous along the contracted
axis, and a weight stored otherwise is transposed by XLA on every call. `scale` (float32) has w8's shape with the
contracted axes 1: the weight is w8 * scale, one scale per output channel, absmax / 448. A fused projection (QKV,
gate/up) so keeps each part's scale, and a per-tensor scale is the same value broadcast. Checkpoints store fp8
weights and scales in the model's layout (`from_stored` turns them K-major).

`dense(x, w8, scale, spec)` computes einsum(spec, x, w) in one of two ways, chosen by the number of rows (tokens)
of x, a static shape:
  fp8 x fp8   x quantized to e4m3 with one scale per row (absmax / 448 over the contracted axes, "dynamic"),
              or with the checkpoint's static per-tensor `in_scale`; one e4m3 x e4m3 product accumulating in
              float32 (cuBLASLt on Hopper), then times both scales. Prefill chunks.
  widened     w8 widened to x's dtype (exact: every e4m3 value is a bfloat16), float32 accumulation, times the
              scale. Decode: a handful of rows reads each weight byte once, and quantizing them buys nothing.
`dense_reference` is the float32 model of both: the same quantization of x, dequantized operands, a float32
einsum. Only the summation order differs from the products above.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lcjax.ops import precision
from lcjax.ops.fp8 import E4M3, clip_finite, scale_for

# Rows (batch x tokens) up to which `dense` widens the weights instead of quantizing the activations.
WIDEN_MAX_ROWS = 64


def contracted(spec: str) -> tuple[str, str, str]:
  """(x's labels, w's labels, output labels) of a two-operand einsum spec "btd,dkh->btkh"."""
  ins, out = spec.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  return xs, ws, out


def x_shape(spec: str, w_shape, *, batch: int, tokens: int) -> tuple[int, ...]:
  """The shape of the x that einsum `spec` ("btd,dkh->btkh") multiplies by a weight of model-layout `w_shape`,
  with `batch` and `tokens` as its b and t."""
  xs, ws, _ = contracted(spec)
  sizes = {"b": batch, "t": tokens, **dict(zip(ws, w_shape))}
  return tuple(sizes[c] for c in xs)


def quantize_axes(spec: str) -> tuple[int, ...]:
  """The weight's contracted axes in the model's layout (labels it shares with x, absent from the output)."""
  xs, ws, out = contracted(spec)
  return tuple(i for i, c in enumerate(ws) if c in xs and c not in out)


def kmajor_order(spec: str) -> tuple[int, ...]:
  """The model-layout axes of a weight in K-major order: output axes, then contracted axes."""
  k = quantize_axes(spec)
  n = len(contracted(spec)[1])
  return tuple(i for i in range(n) if i not in k) + k


def kmajor_spec(spec: str) -> str:
  """`spec` with the weight's labels in K-major order."""
  xs, ws, out = contracted(spec)
  return f"{xs},{''.join(ws[i] for i in kmajor_order(spec))}->{out}"


def kmajor_axes(spec: str, axes: tuple) -> tuple[tuple, tuple]:
  """(w8's, scale's) logical axis names from the model-layout weight's `axes` (a leading "layers" axis kept):
  K-major order; the scale's contracted axes unsharded (they have length 1)."""
  lead, axes = tuple(axes[:len(axes) - len(contracted(spec)[1])]), tuple(axes[-len(contracted(spec)[1]):])
  order, k = kmajor_order(spec), quantize_axes(spec)
  return lead + tuple(axes[i] for i in order), lead + tuple(None if i in k else axes[i] for i in order)


def _to_kmajor(a, spec: str):
  return jnp.transpose(a, kmajor_order(spec))


def _from_kmajor(a, spec: str):
  order = kmajor_order(spec)
  return jnp.transpose(a, [order.index(i) for i in range(len(order))])


def quantize_weight(w, spec: str):
  """w (the weight operand of `spec`, model layout) -> (w8 e4m3, scale float32), both K-major: one scale per
  output channel, the channel's absmax mapped to 448."""
  wf = w.astype(jnp.float32)
  scale = scale_for(jnp.max(jnp.abs(wf), axis=quantize_axes(spec), keepdims=True))
  return _to_kmajor((wf / scale).astype(E4M3), spec), _to_kmajor(scale, spec)


def from_stored(w8, scale, spec: str):
  """An fp8 weight and its scale as checkpoints store them (model layout, the scale's contracted axes 1) ->
  K-major, the bytes unchanged."""
  return _to_kmajor(w8, spec), _to_kmajor(scale.astype(jnp.float32), spec)


def dequantize_stored(w8, scale, dtype):
  """A stored (model-layout) fp8 weight times its scale, in `dtype`."""
  return (w8.astype(jnp.float32) * scale).astype(dtype)


def dequantize_weight(w8, scale, spec: str, dtype):
  """K-major (w8, scale) -> the weight in the model's layout, in `dtype`."""
  return _from_kmajor(dequantize_stored(w8, scale, dtype), spec)


def _out_scale(scale, spec: str):
  """The K-major weight scale laid out along the output's weight labels (its trailing contracted axes dropped)."""
  k = len(quantize_axes(spec))
  return jnp.reshape(scale, scale.shape[:scale.ndim - k])


def quantize_rows(x, spec: str, in_scale=None):
  """x (the first operand of `spec`) -> (x8 e4m3, scale [rows..., 1...]): per row (absmax over the contracted
  axes) or the static per-tensor `in_scale` (finite values past +-448 x in_scale saturate; values that are not
  finite become NaN, as with a per-row scale)."""
  xs, ws, out = contracted(spec)
  axes = tuple(i for i, c in enumerate(xs) if c in ws and c not in out)
  xf = x.astype(jnp.float32)
  if in_scale is None:
    s = scale_for(jnp.max(jnp.abs(xf), axis=axes, keepdims=True))
  else:
    s = jnp.reshape(in_scale.astype(jnp.float32), (1,) * x.ndim)
  return clip_finite(xf, xf / s).astype(E4M3), s


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


def path_for_rows(rows: int) -> str:
  """Which product `dense` runs for a call of `rows` rows: "widened" or "fp8"."""
  return "widened" if rows <= WIDEN_MAX_ROWS else "fp8"


def path_for(x, spec: str) -> str:
  """Which product `dense` runs for x: "widened" or "fp8"."""
  return path_for_rows(rows_of(x, spec))


def dense(x, w8, scale, spec: str, *, in_scale=None, path: str | None = None):
  """einsum(spec, x, w8 * scale) in x's dtype; `path` forces "fp8" or "widened" (default: `path_for`)."""
  path = path or path_for(x, spec)
  kspec = kmajor_spec(spec)
  if path == "widened":
    y = jnp.einsum(kspec, x, w8.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * _out_scale(scale, spec)).astype(x.dtype)
  if path != "fp8":
    raise ValueError(f"{path=} must be 'fp8' or 'widened'")
  x8, xs = quantize_rows(x, spec, in_scale)
  y = jnp.einsum(kspec, x8, w8, preferred_element_type=jnp.float32)
  return (y * _row_scale(xs, spec) * _out_scale(scale, spec)).astype(x.dtype)


def dense_reference(x, w8, scale, spec: str, *, in_scale=None, path: str | None = None):
  """The float32 model of `dense`: the same quantization of x (fp8 path), dequantized operands, float32 sums."""
  path = path or path_for(x, spec)
  w = dequantize_weight(w8, scale, spec, jnp.float32)
  if path == "widened":
    xf = x.astype(jnp.float32)
  else:
    x8, xs = quantize_rows(x, spec, in_scale)
    xf = x8.astype(jnp.float32) * xs
  return jnp.einsum(spec, xf, w, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


# The GEMV kernels' shared contract (lcjax.ops.triton.gemv, lcjax.ops.mosaic_gpu.gemv): the stacked weight's
# product as a [R, Kd] x [N, Kd]^T GEMM, x as float16 rows, and the float32 model the kernels are tested against.

def product_layout(x_shape, w_shape, spec: str):
  """(R, N, Kd, output shape) of einsum(spec) for x and a stacked K-major weight [L, outs..., ins...]. The
  product is a [R, Kd] x [N, Kd]^T GEMM when x's contracted labels trail in the weight's order and the output is
  x's other labels then the weight's outputs (true of every spec the model uses)."""
  xs, ws, out = contracted(spec)
  kw = "".join(ws[i] for i in kmajor_order(spec))
  nk = len(quantize_axes(spec))
  outs, ins = kw[:len(kw) - nk], kw[len(kw) - nk:]
  keep = xs[:len(xs) - nk]
  if xs != keep + ins or out != keep + outs or len(w_shape) != len(kw) + 1:
    raise ValueError(f"einsum {spec!r} over a stacked weight {tuple(w_shape)} is not a row-major [R, Kd] x "
                     f"[N, Kd]^T product")
  R = math.prod(x_shape[:len(keep)])
  N = math.prod(w_shape[1:1 + len(outs)])
  Kd = math.prod(w_shape[1 + len(outs):])
  return R, N, Kd, tuple(x_shape[:len(keep)]) + tuple(w_shape[1:1 + len(outs)])


def scale_rows(x2):
  """x [R, Kd] -> (x16 [P, R, Kd] float16, row scale [R, 1] float32): x = sum(x16, 0) * scale (the docstring of
  lcjax.ops.triton.gemv), the scale a power of two; P = 1 for 16-bit x (exact: bf16 x is widened by
  precision.widen, so its float16 part holds x's bf16 values however XLA computed them), 2 for float32 x (hi and lo
  parts)."""
  xf = precision.widen(x2)
  s = precision.float16_scale(jnp.max(jnp.abs(xf), axis=1, keepdims=True))
  xf = xf / s
  hi = xf.astype(jnp.float16)
  if jnp.finfo(x2.dtype).nmant <= jnp.finfo(jnp.float16).nmant:
    return hi[None], s
  # The barrier keeps XLA from folding xf -> float16 -> float32 back into xf (it drops round trips through a
  # narrower float when excess precision is allowed, its GPU default), which would zero lo.
  return jnp.stack([hi, (xf - jax.lax.optimization_barrier(hi).astype(jnp.float32)).astype(jnp.float16)]), s


def gemv_stacked_reference(x, w8, scale, layer, spec: str):
  """The float32 model of the GEMV kernels' gemv_stacked: `dense_reference`'s widened product of layer `layer`."""
  w, s = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (w8, scale))
  return dense_reference(x, w, s, spec, path="widened")
