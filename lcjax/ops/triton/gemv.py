"""Decode-sized products over stacked fp8 weights: a Pallas kernel (Triton lowering) that reads one byte a weight.

A decode step multiplies a few rows of activations by every weight of every layer once, so it is bound by the
bytes of the weights. XLA cannot give fp8 weights that speed inside the model's layer scan: it slices the layer
out of the stacked [L, ...] weight and widens the slice to bf16 in a buffer of its own before cuBLAS reads it
(5 bytes moved a weight, 155 ms a token for the 70B shape; benchmarks/NOTES-fp8w.md). This kernel takes the whole
stacked weight and the layer index instead: nothing is sliced, copied or widened outside registers.

`gemv_stacked(x, w8, scale, layer, spec)` computes einsum(spec, x, w8[layer] * scale[layer]) for x of at most
`GemvTuning.max_rows` rows, the weights K-major as lcjax.ops.linear holds them ([L, outs..., ins...], one float32
scale per output channel). With N the output channels and Kd the contracted length (each axis group flattened, a
free reshape), the kernel's program (n, s) multiplies the row block x [Rp, Kd] by the weight rows
[n * bn, (n + 1) * bn) over its share s of Kd (split-K, so that a short N still fills the GPU), bk columns a step:
each [bn, bk] e4m3 tile is widened to float16 in registers (one hardware convert per pair on Hopper; e4m3 -> bf16
goes through float32) and multiplied on the tensor cores with float32 accumulation. XLA then sums the splits,
applies the row and channel scales and casts: one small fusion.

The widening is exact: every e4m3 value is a float16. The activations become float16 exactly too: each row is
first divided by a power of two that brings its absmax to at most 2^14 (bf16's 8 significant bits fit float16's
11; only values below 2^-28 of the row's absmax, too small to change any sum, lose bits), and the kernel's sums
are multiplied back. float32 activations (runs in float32, the CPU tests) are split into two float16 parts,
x = hi + lo, each multiplied by the tile: 22 significant bits for values down to 2^-17 of the row's absmax, an
absolute error under 2^-39 of it below (lo is then a float16 subnormal). So the kernel computes the widened
product of lcjax.ops.linear.dense (x times the dequantized weight, float32 sums) and differs from
`gemv_stacked_reference` by summation order (and for float32 activations the last bits of x) only.

Weights of 2 to 4 GiB are read as uint16 pairs of e4m3 bytes (`pack` 2): the Triton lowering addresses an array
of at most 4 GiB with 32-bit signed element offsets, which wrap past 2^31 elements (a Llama-3-8B w_gate_up stack
is 3.5 GiB: CUDA_ERROR_ILLEGAL_ADDRESS on its upper layers); two-byte elements keep every offset below 2^31. Each
pair is split into its two bytes in registers (little-endian: column 2c is the low byte), and x arrives with its
even and odd columns apart. Larger arrays get 64-bit offsets from the lowering and are read byte by byte. The
uint16 operand is XLA's bitcast_convert of the e4m3 stack, which the GPU compiler makes a bitcast of the same
buffer, not a copy (the optimized HLO of a Llama-3-8B decode step: benchmarks/NOTES-fp8w.md, call 9).

x is padded to Rp rows for the tensor-core dot (in the XLA fusion that scales it), and the kernel loads only its R
real rows (masked loads): every program re-reads its share of x from L2, and at R <= 16 the 16 padded float16 rows
would be half the bytes of the 64-row e4m3 tile they multiply. That saved 1.2% on the Llama-3.1-70B shape's
products and nothing measurable on Llama-3-8B's (benchmarks/NOTES-fp8w.md, call 24).

Legend: L layers, R rows (batch x tokens), Rp rows padded (a power of two >= 16: the tensor-core dot's minimum),
N output channels, Kd contracted length, bn / bk the tile, S splits of Kd, `pack` e4m3 values per loaded element.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lcjax.ops.linear import WIDEN_MAX_ROWS, product_layout, scale_rows
from lcjax.ops import hardware
from lcjax.ops.splits import next_pow2


@dataclasses.dataclass(frozen=True)
class GemvTuning:
  """Static knobs of the kernel (part of the jit cache key)."""
  block_n: int = 64              # bn: weight rows (output channels) per program
  block_k: int = 256             # bk: columns per step; a [bn, bk] e4m3 tile is bn * bk bytes
  target_programs: int = 132 * 4 # programs aimed at by the split-K heuristic (132 SMs on an H200)
  min_steps: int = 4             # the fewest bk steps a split keeps (its loop has loads to pipeline)
  num_splits: int | None = None  # S; None: the heuristic
  num_warps: int = 4
  num_stages: int = 3
  max_rows: int = WIDEN_MAX_ROWS # more rows than this is not decode-shaped: the fp8 x fp8 GEMM serves it
  pack: int | None = None        # e4m3 values per loaded element, 1 or 2; None: `pack_for` the weight's size


def unsupported() -> str | None:
  """Why the kernel cannot be compiled here (None: it can): it needs a CUDA GPU that converts e4m3 in hardware
  (sm_89+; measured on sm_90) and JAX's Pallas Triton lowering."""
  return hardware.fp8_convert_reason("fp8 GEMV kernel") or hardware.pallas_triton_reason()


def pack_for(nbytes: int) -> int:
  """e4m3 values per element a Triton kernel loads from an e4m3 array of `nbytes` bytes (module docstring)."""
  return 2 if 2 ** 31 <= nbytes <= 2 ** 32 else 1


def as_pairs(x8):
  """An e4m3 array [..., 2n] viewed as uint16 [..., n], each element a pair of adjacent values (a bitcast)."""
  return jax.lax.bitcast_convert_type(x8.reshape(*x8.shape[:-1], x8.shape[-1] // 2, 2), jnp.uint16)


def pair_value(pairs, j: int):
  """Value j (0: the low byte, the even column) of each uint16 pair of e4m3 values, as e4m3."""
  byte = jax.lax.shift_right_logical(pairs, jnp.uint16(8 * j)) & jnp.uint16(0xFF)
  return jax.lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e4m3fn)


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n."""
  return math.gcd(n, 1 << (max(1, cap).bit_length() - 1))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The kernel's shapes for one call."""
  R: int
  Rp: int
  N: int
  Kd: int
  bn: int
  bk: int
  S: int

  @property
  def steps(self) -> int:
    """bk steps per split."""
    return self.Kd // (self.bk * self.S)


def plan(R: int, N: int, Kd: int, tuning: GemvTuning = GemvTuning()) -> Plan:
  """Tiles and splits for x [R, Kd] times a weight of N rows of Kd."""
  if R > tuning.max_rows:
    raise ValueError(f"{R} rows exceed GemvTuning.max_rows={tuning.max_rows}: not a decode-sized product")
  bn, bk = _pow2_divisor(N, tuning.block_n), _pow2_divisor(Kd, tuning.block_k)
  if tuning.num_splits is not None:
    S = tuning.num_splits
    if (Kd // bk) % S:
      raise ValueError(f"num_splits={S} does not divide the {Kd // bk} steps of {bk} columns of Kd={Kd}")
  else:
    S, steps = 1, Kd // bk
    while (N // bn) * S < tuning.target_programs and steps % 2 == 0 and steps // 2 >= tuning.min_steps:
      S, steps = S * 2, steps // 2
  return Plan(R=R, Rp=max(16, next_pow2(R)), N=N, Kd=Kd, bn=bn, bk=bk, S=S)


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, rows, bn, bk, steps, pack):
  """Program (n, s): o [Rp, bn] = sum over its steps of x [Rp, bk] times the weight tile [bn, bk]^T, columns counted
  in loaded elements (`pack` e4m3 values each); x_ref [P, pack, Rp, Kd / pack] holds x's columns j mod pack at j,
  of which only the first `rows` rows are loaded (the rest are zeros)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
  n, s = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]
  k0 = s * (steps * bk)
  Rp = x_ref.shape[2]
  real = jnp.broadcast_to(jax.lax.broadcasted_iota(jnp.int32, (Rp, 1), 0) < rows, (Rp, bk))

  def step(i, acc):
    k = k0 + i * bk
    wk = w_ref[layer, pl.ds(n * bn, bn), pl.ds(k, bk)]                 # [bn, bk] e4m3, or uint16 pairs
    for j in range(pack):
      wj = (wk if pack == 1 else pair_value(wk, j)).astype(jnp.float16)   # widened exactly
      for part in range(x_ref.shape[0]):
        xk = pltriton.load(x_ref.at[jnp.int32(part), jnp.int32(j), :, pl.ds(k, bk)], mask=real,
                           other=jnp.zeros((), x_ref.dtype))                # [Rp, bk] f16
        acc = acc + pltriton.dot(xk, wj, trans_b=True)                 # [Rp, bn] f32
    return acc

  o_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros((Rp, bn), jnp.float32))


def gemv_stacked(x, w8, scale, layer, spec: str, *, tuning: GemvTuning = GemvTuning(), interpret: bool = False,
                 dtype=None):
  """einsum(spec, x, w8[layer] * scale[layer]) in `dtype` (None: x's dtype): x of at most tuning.max_rows rows,
  w8 [L, ...] e4m3 and scale [L, ...] float32 stacked K-major weights (lcjax.ops.linear), layer a traced int
  scalar."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
  L = w8.shape[0]
  R, N, Kd, out_shape = product_layout(x.shape, w8.shape, spec)
  pack = tuning.pack or pack_for(w8.size * w8.dtype.itemsize)
  if pack not in (1, 2) or Kd % pack:
    raise ValueError(f"pack={pack} must be 1 or 2 and divide the contracted length Kd={Kd}")
  p = plan(R, N, Kd // pack, dataclasses.replace(tuning, block_k=max(1, tuning.block_k // pack)))
  if not interpret and min(p.bn, p.bk) < 16:
    raise ValueError(f"tiles bn={p.bn} x bk={p.bk} of N={N}, Kd={Kd} (pack {pack}) are under the tensor-core dot's "
                     "16: N and Kd / pack need a power-of-two factor of 16")
  x16, xs = scale_rows(x.reshape(R, Kd))
  x16 = jnp.pad(x16, ((0, 0), (0, p.Rp - R), (0, 0)))                 # [P, Rp, Kd]
  x16 = jnp.moveaxis(x16.reshape(x16.shape[0], p.Rp, Kd // pack, pack), 3, 1)   # [P, pack, Rp, Kd / pack]
  w = w8.reshape(L, N, Kd)
  if pack == 2:
    w = as_pairs(w)                                                    # a view: the same bytes
  whole = pl.no_block_spec
  parts = pl.pallas_call(
      lambda *refs: _kernel(*refs, rows=R, bn=p.bn, bk=p.bk, steps=p.steps, pack=pack),
      grid=(N // p.bn, p.S),
      in_specs=[whole, whole, whole],
      out_specs=pl.BlockSpec((None, p.Rp, p.bn), lambda n, s: (s, 0, n)),
      out_shape=jax.ShapeDtypeStruct((p.S, p.Rp, N), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
      interpret=interpret,
      name="lcjax_fp8_gemv",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), x16, w)
  w_scale = jax.lax.dynamic_index_in_dim(scale.reshape(L, N), layer, keepdims=False)     # [N]
  y = jnp.sum(parts[:, :R], axis=0) * xs * w_scale
  return y.reshape(out_shape).astype(dtype or x.dtype)
