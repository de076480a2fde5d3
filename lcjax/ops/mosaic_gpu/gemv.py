"""Decode-sized products over stacked fp8 weights in Pallas Mosaic GPU: the weight tile as wgmma's 64-row operand.

The same contract as lcjax.ops.triton.gemv.gemv_stacked (einsum(spec, x, w8[layer] * scale[layer]) for x of at most
WIDEN_MAX_ROWS rows, the weights K-major and stacked [L, outs..., ins...], the layer a traced index) on another
lowering. A decode product is bound by the bytes of its weights. This kernel streams them by TMA into a ring of
M shared-memory slots (max_concurrent_steps, fewer where x's many rows need the room) and computes the product
transposed, y^T = W x^T, so that the 64 output channels of a weight tile are the wgmma's M and x's few rows its N
(padded to a multiple of 8, wgmma's smallest N): a decode row costs the tensor cores 8 columns.

The work is split evenly, stream-K fashion. The weight's tiles [64, bk] are numbered row block by row block (tile
f is row block f // Ks, columns (f % Ks) * bk of it, Ks = Kd / bk tiles a row block), and the G persistent CTAs
take equal contiguous ranges of the T = (N / 64) Ks tiles: CTA g takes [floor(g T / G), floor((g + 1) T / G)).
One pipeline runs over a CTA's whole range, so its TMA ring stays full across row blocks, and the ranges differ
by at most a tile: there is no last wave of CTAs. A grid with a CTA per (row block, split) was as fast as the
Triton kernel (about 3.3 TB/s over the Llama-3.1-70B's four products); this split was 5-7% faster
(benchmarks/NOTES-fp8w.md, calls 26-28). A CTA writes one float32 partial [64, RN] per row block it touches, into slot
j = g - g0(n) of that row block (g0(n) the CTA that holds its first tile). XLA adds the slots each row block has
(a static mask: the rest are never written), the parts of x, and the row and channel scales.

Each tile is read from shared memory into registers in the layout whose float16 widening is wgmma's register A
operand (one hardware convert per pair on Hopper; exact: every e4m3 value is a float16) and multiplied with x^T
[bk, RN] float16 from shared memory, float32 accumulation.

bf16 x (the model's activations) arrives split into two float16 parts at fixed exponents (`split_fixed`: |x| >=
1/4 and the rest, each scaled by its own power of two), exact for 2^-35 <= |x| < 2^31, infinite from 2^31, within
2^-43 below 2^-35. No row absmax is needed, so only elementwise work precedes the kernel, and XLA fuses it into
whatever makes x: the decode step then has no reduction before its products (benchmarks/NOTES-fp8w.md, call 33:
the Llama-3-8B's step at 32K took 4.57 ms/token against 4.97 row-scaled). float16 x is wgmma's operand as it is.
float32 x, and bf16 x with MgpuGemvTuning(fixed_split=False), arrives as lcjax.ops.linear.scale_rows makes it: float16
rows with a power-of-two row scale (bf16 x exactly, but for values below 2^-28 of their row's absmax, and no range
limit), for float32 x two float16 parts, hi and lo. The parts are stacked as rows (x's R rows of the first part,
then its R rows of the second), so both ride one wgmma of 2R columns and are added after the kernel: no second
product. With MgpuGemvTuning.scale_in_kernel, 16-bit x is handed over as it is, transposed and padded to 16, 32
or 64 rows ([Kd, RN]: Mosaic GPU swizzles shared-memory rows of exactly 32, 64 or 128 bytes), and the kernel
scales each x^T tile [bk, RN] itself (`tile_scale`: a power of two per row of x and tile, from that row's absmax
within the tile), writes the float16 tile to shared memory for the wgmma and multiplies the tile's product by the
inverse: nothing but a transpose and a pad before the kernel, and no range limit, but the per-step cross-warp max
slows the stream (call 32: the GEMVs took 2.84 against 2.07 ms a token, +37%): it is not the default.

With `norm` (gemv_stacked's), the product is of RMS-normed x and the kernel does the norm: x arrives as the
residual holds it (bf16 [R, Kd], R <= NORM_ROWS), each CTA first computes every row's rsqrt(mean(x^2) + eps) from
the whole row by plain loads, then its pipeline brings x's rows and the norm's scale tile by tile (TMA boxes of R
rows and of one), and each step builds the x^T tile in registers: row r times the scale, split into two float16
parts at NORM_BAND as columns r and NORM_ROWS + r (RN = 16), stored where `scale_in_kernel` stores its tile. The
partials' columns are multiplied by their row's factor before they are written. In a decode layer this replaces
the two XLA kernels of each norm (the sum of squares, then the normalized x's conversion to the parts).

The CTAs of a call are meant to be resident together: G is at most as many CTAs as fit an SM's shared memory
(common.resident_ctas) times the SMs, so that many rows (a larger RN) lower ctas_per_sm rather than start a second wave.

Legend: L layers, R rows of x, P parts (1 or 2), RN = P * R rounded up to a multiple of 8 (16, 32 or 64 when
scaled in the kernel), N output channels, Nb = N / 64 row blocks, Kd the contracted length, bk columns per
tile, Ks = Kd / bk tiles per row block, T = Nb * Ks tiles, G CTAs, J partial slots per row block, M ring slots
(max_concurrent_steps).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lcjax.ops import precision
from lcjax.ops.linear import WIDEN_MAX_ROWS, product_layout, scale_rows
from lcjax.ops.mosaic_gpu.common import load, resident_ctas, smem_transforms
from lcjax.ops.hardware import sm90_fp8_reason, sm_count

BLOCK_N = 64                   # output channels per CTA: a wgmma's M
SMEM_BYTES = 220 * 1024        # shared memory a CTA may plan for (Hopper: 227 KiB a block, some kept by Mosaic)
NORM_ROWS = 8                  # rows of x a GEMV with the norm inside takes: x^T tile columns r (hi), 8 + r (lo)
# Its parts of v = x * s (a float32 product, up to 24 significant bits): |v| >= NORM_BAND as v NORM_HI, the rest as
# v NORM_LO. Both stay normal float16 (11 significant bits: a relative error of at most 2^-11) for 2^-28 <= |v| <
# 2^31, and lo (|v| < 2, so below 2^15) cannot overflow.
NORM_BAND, NORM_HI, NORM_LO = 2.0, 2.0 ** -15, 2.0 ** 14


@dataclasses.dataclass(frozen=True)
class MgpuGemvTuning:
  """Static knobs of the kernel (part of the jit cache key)."""
  block_k: int = 256             # bk: e4m3 columns per tile; a tile is 64 * bk bytes (TMA boxes are <= 256 wide)
  max_concurrent_steps: int = 4  # M: tiles in flight per CTA
  ctas_per_sm: int = 2           # G = ctas_per_sm x the GPU's SMs (at most T, and as many as fit an SM)
  num_ctas: int | None = None    # G, overriding ctas_per_sm
  max_rows: int = WIDEN_MAX_ROWS
  fixed_split: bool = True       # bf16 x as `split_fixed`'s two parts (False: row-scaled; module docstring)
  a_in_smem: bool = False        # the widened weight tile stored to shared memory for the wgmma instead of read
                                 # from registers: 1.45x slower on the 70B shape, but the form Pallas' Mosaic GPU
                                 # interpreter runs (it models no wgmma operand in registers), for the CPU tests
  scale_in_kernel: bool = False  # 16-bit x handed over as it is (transposed, padded to 16, 32 or 64 rows), each
                                 # tile scaled to float16 in the kernel (`tile_scale`; overrides fixed_split)


def unsupported() -> str | None:
  """Why the kernel cannot be compiled here (None: it can): it needs a Hopper GPU (wgmma, TMA)."""
  return sm90_fp8_reason("Mosaic GPU fp8 GEMV kernel", "wgmma")


def unsupported_shape(N: int, Kd: int) -> str | None:
  """Why the kernel cannot multiply a weight of N rows of Kd (None: it can): both must be multiples of 64."""
  bad = [f"{name}={v}" for name, v in (("N", N), ("Kd", Kd)) if v % 64]
  if bad:
    return (f"the Mosaic GPU GEMV kernel tiles weights by 64 rows and 64 columns: {' and '.join(bad)} "
            f"{'is' if len(bad) == 1 else 'are'} not a multiple of 64")
  return None


@dataclasses.dataclass(frozen=True)
class Plan:
  """The kernel's shapes for one call (module docstring)."""
  R: int
  P: int
  RN: int
  N: int
  Kd: int
  bk: int
  G: int
  M: int                         # ring slots (max_concurrent_steps, fewer where x's rows need the room)
  scale_in_kernel: bool = False  # x arrives transposed [Kd, RN], in its 16-bit dtype, and is scaled tile by tile
  a_in_smem: bool = False        # MgpuGemvTuning.a_in_smem
  norm: bool = False             # x arrives as it is ([R, Kd] bf16) with a norm's scale: `gemv_stacked`'s norm

  @property
  def Ks(self) -> int:
    return self.Kd // self.bk

  @property
  def T(self) -> int:
    return self.N // BLOCK_N * self.Ks

  def first(self, g):
    """The first tile of CTA g's range (g an int, a numpy array or a traced int32)."""
    return g * self.T // self.G

  def owner(self, f):
    """The CTA whose range holds tile f: the largest g with first(g) <= f."""
    return ((f + 1) * self.G - 1) // self.T

  def slots(self) -> np.ndarray:
    """[J, Nb] bool: which partial slots of each row block the kernel writes."""
    n = np.arange(self.N // BLOCK_N)
    count = self.owner((n + 1) * self.Ks - 1) - self.owner(n * self.Ks) + 1
    return np.arange(count.max())[:, None] < count[None, :]


def plan(R: int, P: int, N: int, Kd: int, tuning: MgpuGemvTuning = MgpuGemvTuning(), *,
         scale_in_kernel: bool = False, norm: bool = False) -> Plan:
  """Tiles and CTAs for x [R, Kd] in P float16 parts (scale_in_kernel: one 16-bit part the kernel scales; norm: bf16
  rows the kernel normalizes and splits) times a weight of N rows of Kd."""
  if norm and scale_in_kernel:
    raise ValueError("a GEMV plan is for x scaled in the kernel or for the norm inside it, not both")
  if R > tuning.max_rows:
    raise ValueError(f"{R} rows exceed MgpuGemvTuning.max_rows={tuning.max_rows}: not a decode-sized product")
  if tuning.block_k not in (64, 128, 256):
    raise ValueError(f"block_k={tuning.block_k} must be 64, 128 or 256 (TMA boxes are at most 256 wide)")
  if tuning.max_concurrent_steps < 2 or tuning.ctas_per_sm < 1 or (tuning.num_ctas is not None
                                                                    and tuning.num_ctas < 1):
    raise ValueError(f"max_concurrent_steps={tuning.max_concurrent_steps} must be >= 2, ctas_per_sm="
                     f"{tuning.ctas_per_sm} and num_ctas={tuning.num_ctas} >= 1")
  reason = unsupported_shape(N, Kd)
  if reason:
    raise ValueError(reason)
  # x^T tiles [bk, RN] in shared memory have rows of RN 16-bit values, and Mosaic GPU swizzles rows of exactly 32,
  # 64 or 128 bytes: in-kernel scaling pads x to 16, 32 or 64 rows.
  if norm and R > NORM_ROWS:
    raise ValueError(f"{R} rows exceed the {NORM_ROWS} a GEMV with the norm inside takes")
  RN = 2 * NORM_ROWS if norm else next(n for n in (16, 32, 64) if n >= R) if scale_in_kernel else -(-(P * R) // 8) * 8
  bk, M = math.gcd(Kd, tuning.block_k), tuning.max_concurrent_steps    # bk: a multiple of 64 (unsupported_shape)
  a_in_smem, tiled = tuning.a_in_smem, scale_in_kernel or norm     # tiled: an x^T tile written in the kernel
  while smem_bytes(RN, bk, M, tiled, a_in_smem) > SMEM_BYTES and (M > 2 or bk > 64):   # many rows: a shallower
    M, bk = (M - 1, bk) if M > 2 else (M, bk // 2)                                    # ring, then narrower tiles
  T = N // BLOCK_N * (Kd // bk)
  fit = max(1, resident_ctas(smem_bytes(RN, bk, M, tiled, a_in_smem)))                # CTAs an SM holds at once
  G = min(T, tuning.num_ctas or min(tuning.ctas_per_sm, fit) * sm_count())
  if (T + 1) * G >= 2 ** 31:
    raise ValueError(f"{T} tiles over {G} CTAs overflow the kernel's int32 range arithmetic")
  return Plan(R=R, P=P, RN=RN, N=N, Kd=Kd, bk=bk, G=G, M=M, scale_in_kernel=scale_in_kernel, a_in_smem=a_in_smem,
              norm=norm)


def smem_bytes(RN: int, bk: int, M: int, x_tile: bool = False, a_in_smem: bool = False) -> int:
  """Shared memory of a CTA: the ring's M weight tiles [64, bk] e4m3 and x tiles [RN, bk] 16-bit (with the norm
  inside: x's rows and the scale's, fewer bytes), the partial [64, RN] float32 it writes out, with an x^T tile
  written in the kernel (scale_in_kernel or the norm) that tile [bk, RN] float16, and with a_in_smem the widened
  weight tile [64, bk] float16."""
  return (M * (BLOCK_N * bk + RN * bk * 2) + BLOCK_N * RN * 4 + (RN * bk * 2 if x_tile else 0)
          + (BLOCK_N * bk * 2 if a_in_smem else 0))


def tile_scale(xt):
  """xt [bk, RN] (a tile of x^T) -> (xt * s in float16, 1 / s): s [RN] the power of two that brings each column's
  absmax into [2^13, 2^14), so that a 16-bit column is exact in float16 but for values below 2^-27 of its absmax
  (exponents clipped to +-126: an all-zero column gets 2^126). Traced inside the kernel (WGMMA layout) and, as
  plain jnp, by the tests."""
  xf = xt.astype(jnp.float32)
  m = jnp.max(jnp.abs(xf), axis=0)                                   # [RN]
  e = lax.shift_right_logical(lax.bitcast_convert_type(m, jnp.int32), 23) & 0xFF   # m's biased exponent
  k = jnp.clip(140 - e, -126, 126)                                   # s = 2^k: m s in [2^13, 2^14)
  s = lax.bitcast_convert_type(lax.shift_left(k + 127, 23), jnp.float32)
  inv = lax.bitcast_convert_type(lax.shift_left(127 - k, 23), jnp.float32)
  return (xf * lax.broadcast_in_dim(s, xf.shape, [1])).astype(jnp.float16), inv


def _call(layer, x16, w, p: Plan, norm_scale=None, eps: float = 0.0):
  """The kernel: partials [J, N, RN] float32 (out^T of each CTA's share of a row block; slots `p.slots()` written)
  for x16 [RN, Kd] float16 and w [L, N, Kd] e4m3, or with p.scale_in_kernel x^T [Kd, RN] in x's 16-bit dtype,
  scaled to float16 tile by tile in the kernel (`tile_scale`), or with p.norm x [R, Kd] bf16 as it is and the
  norm's scale norm_scale [L, 1, Kd]: each tile of x * scale split in the kernel into two float16 parts (NORM_BAND)
  as the x^T tile's columns r and NORM_ROWS + r (`_normed_tile`), and each partial's columns multiplied by their
  row's rsqrt(mean(x^2) + eps), which every CTA computes from the whole row (`_row_factor`)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  bk, RN, Ks, scale_in_kernel, norm = p.bk, p.RN, p.Ks, p.scale_in_kernel, p.norm
  J = p.slots().shape[0]

  def body(layer_ref, x_ref, w_ref, *refs):
    (g_ref, o_ref, o_smem, *scratch) = refs if norm else (None, *refs)
    xs_smem = scratch[:1] if scale_in_kernel or norm else ()
    a_smem = scratch[-1] if p.a_in_smem else None
    g = lax.axis_index("g")
    layer = layer_ref[0]
    start = p.first(g)
    count = p.first(g + 1) - start
    if norm:                          # [64, RN]: row r's factor in columns r and NORM_ROWS + r, 0 elsewhere
      cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_N, RN), 1, layout=plgpu.Layout.WGMMA)
      col_factor = jnp.zeros((BLOCK_N, RN), jnp.float32)
      for r in range(p.R):
        col_factor = jnp.where((cols == r) | (cols == NORM_ROWS + r), _row_factor(x_ref, r, p.Kd, eps), col_factor)

    def step(idx, w_smem, x_smem, *rest):
      (g_smem, acc) = rest if norm else (None, *rest)
      f = start + idx[0]
      k = lax.rem(f, Ks)

      def tile(part_ref):
        # [64, bk] widened in registers, in the layout of wgmma's A operand (widening it into a float16
        # shared-memory tile that wgmma reads instead measured 1.45x slower on the Llama-3.1-70B shape)
        a = load(w_smem, plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
        a = plgpu.layout_cast(a, plgpu.Layout.WGMMA)
        if a_smem is not None:        # the previous step's wgmma_wait(0) has let go of the tile
          a_smem[...] = a
          plgpu.commit_smem()
          a = a_smem
        plgpu.wgmma(part_ref, a, b)                                    # W tile x^T [bk, RN]
        plgpu.wgmma_wait(0)
        return part_ref[...]

      if scale_in_kernel:             # x_smem is a tile of x^T [bk, RN]
        # One float16 buffer serves every step. The column max inside tile_scale reduces across the warpgroup's
        # four warps through shared memory behind a warpgroup barrier, which every warp reaches only after its
        # wgmma_wait of the previous step: no warp overwrites the buffer while the previous wgmma reads it.
        x16t, inv = tile_scale(load(x_smem, plgpu.Layout.WGMMA))
        xs_smem[0][...] = x16t
        plgpu.commit_smem()           # a proxy fence and a warpgroup barrier: the whole tile is there for wgmma
        b = xs_smem[0]
      elif norm:                      # x_smem [R, bk] bf16 rows, g_smem [1, bk]; the buffer as above
        xs_smem[0][...] = _normed_tile(x_smem, g_smem, p.R, bk, RN)
        plgpu.commit_smem()
        b = xs_smem[0]
      else:
        b = x_smem.transpose((1, 0))
      part = pl.run_scoped(tile, plgpu.ACC((BLOCK_N, RN), jnp.float32))
      if scale_in_kernel:
        part = part * lax.broadcast_in_dim(inv, part.shape, [1])
      # A row block's first tile in this CTA starts the sum over (a NaN or inf the previous row block met
      # carries into this one's partial too: weights lcjax quantizes have none).
      fresh = (k == 0) | (idx[0] == 0)
      acc = part + acc * jnp.where(fresh, 0.0, 1.0).astype(jnp.float32)

      @pl.when((k == Ks - 1) | (idx[0] == count - 1))                  # its last tile: write the partial
      def _():
        n = lax.div(f, Ks)
        plgpu.wait_smem_to_gmem(0)                                     # the previous partial has left o_smem
        o_smem[...] = acc * col_factor if norm else acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[g - p.owner(n * Ks), pl.ds(n * BLOCK_N, BLOCK_N)])

      return acc

    cols_of = lambda t: lax.rem(start + t, Ks)
    if norm:                          # x's rows and the scale's tile as they lie: no transforms
      x_specs = [plgpu.BlockSpec((p.R, bk), lambda t: (0, cols_of(t))),
                 plgpu.BlockSpec((1, bk), lambda t: (0, cols_of(t)))]
    elif scale_in_kernel:
      x_specs = [plgpu.BlockSpec((bk, RN), lambda t: (cols_of(t), 0), transforms=smem_transforms(x16.dtype, RN))]
    else:
      x_specs = [plgpu.BlockSpec((RN, bk), lambda t: (0, cols_of(t)), transforms=smem_transforms(jnp.float16, bk))]
    plgpu.emit_pipeline(
        step, grid=(count,),
        in_specs=[plgpu.BlockSpec((BLOCK_N, bk), lambda t: (lax.div(start + t, Ks), cols_of(t)),
                                  transforms=smem_transforms(w.dtype, bk))] + x_specs,
        max_concurrent_steps=p.M,
        init_carry=plgpu.layout_cast(jnp.zeros((BLOCK_N, RN), jnp.float32), plgpu.Layout.WGMMA),
    )(w_ref.at[layer], x_ref, *([g_ref.at[layer]] if norm else []))
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((J, p.N, RN), jnp.float32),
      grid=(p.G,),
      grid_names=("g",),
      scratch_types=[plgpu.SMEM((BLOCK_N, RN), jnp.float32)] + (
          [plgpu.SMEM((bk, RN), jnp.float16, transforms=smem_transforms(jnp.float16, RN))]
          if scale_in_kernel or norm else []) + (
          [plgpu.SMEM((BLOCK_N, bk), jnp.float16, transforms=smem_transforms(jnp.float16, bk))] if p.a_in_smem
          else []),
  )(layer, x16, w, *([norm_scale] if norm else []))


def _row_factor(x_ref, r: int, Kd: int, eps: float):
  """rsqrt(mean(x[r]^2) + eps) of row r of x [R, Kd] in global memory: plain loads of `w` values (8 a thread where
  Kd allows, one 16-byte load each), their squares summed in registers, then across the warpgroup."""
  import jax.experimental.pallas as pl
  w = 1024 if Kd % 1024 == 0 else 128

  def chunk(j, acc):
    v = x_ref[r, pl.ds(pl.multiple_of(j * w, w), w)].astype(jnp.float32)
    return acc + v * v

  total = lax.fori_loop(0, Kd // w, chunk, jnp.zeros((w,), jnp.float32), unroll=True)
  return lax.rsqrt(jnp.sum(total) / Kd + eps)


def _normed_tile(x_smem, g_smem, R: int, bk: int, RN: int):
  """The float16 x^T tile [bk, RN] of rows x_smem [R, bk] times g_smem [1, bk]: row r's two parts (NORM_BAND) in
  columns r and NORM_ROWS + r, zeros elsewhere (in WGMMA layout: each row read as a vector of one value a tile row,
  broadcast along the columns)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  rows = plgpu.Layout.WGMMA.reduce(1)
  gv = load(g_smem.at[0], rows).astype(jnp.float32)
  cols = plgpu.broadcasted_iota(jnp.int32, (bk, RN), 1, layout=plgpu.Layout.WGMMA)
  t = jnp.zeros((bk, RN), jnp.float32)
  for r in range(R):
    vt = lax.broadcast_in_dim(load(x_smem.at[r], rows).astype(jnp.float32) * gv, (bk, RN), [0])
    big = jnp.abs(vt) >= NORM_BAND
    t = jnp.where(cols == r, jnp.where(big, vt * NORM_HI, 0.0),
                  jnp.where(cols == NORM_ROWS + r, jnp.where(big, 0.0, vt * NORM_LO), t))
  return t.astype(jnp.float16)


def gemv_stacked(x, w8, scale, layer, spec: str, *, tuning: MgpuGemvTuning = MgpuGemvTuning(), dtype=None,
                 norm=None):
  """einsum(spec, x, w8[layer] * scale[layer]) in `dtype` (None: x's dtype): x of at most tuning.max_rows rows,
  w8 [L, ...] e4m3 and scale [L, ...] float32 stacked K-major weights (lcjax.ops.linear), layer a traced int
  scalar. Its float32 model is lcjax.ops.linear.gemv_stacked_reference.

  norm = (s [L, Kd], eps): the product of RMS-normed x, x * rsqrt(mean(x^2) + eps) * s[layer], computed inside
  the kernel from x as it is (bf16, at most NORM_ROWS rows, Kd a multiple of 128): no XLA op before it. x * s is
  rounded to two float16 parts (NORM_BAND: a relative error of at most 2^-11 a value for 2^-28 <= |x s| < 2^31,
  where the norm applied in bf16 rounds to 2^-8) and the rows' factor is applied to the float32 partials.
  tuning.scale_in_kernel and tuning.fixed_split do not apply."""
  return gemv_stacked_f32(x, w8, scale, layer, spec, tuning=tuning, norm=norm).astype(dtype or x.dtype)


def gemv_stacked_f32(x, w8, scale, layer, spec: str, *, tuning: MgpuGemvTuning = MgpuGemvTuning(), norm=None):
  """gemv_stacked's product in float32, before the cast to x's dtype."""
  L = w8.shape[0]
  R, N, Kd, out_shape = product_layout(x.shape, w8.shape, spec)
  wide = jnp.dtype(x.dtype).itemsize != 2
  w_scale = lax.dynamic_index_in_dim(scale.reshape(L, N), layer, keepdims=False)
  layer1 = jnp.reshape(layer, (1,)).astype(jnp.int32)
  if norm is not None:
    s, eps = norm
    if x.dtype != jnp.bfloat16 or s.shape != (L, Kd) or Kd % 128:
      raise ValueError(f"a GEMV with the norm inside takes bfloat16 x, a norm scale [L, Kd] = [{L}, {Kd}] and Kd a "
                       f"multiple of 128 (its rows are read 128 values at a time), got {x.dtype.name} x and a scale "
                       f"{tuple(s.shape)}")
    p = plan(R, 2, N, Kd, tuning, norm=True)
    parts = _call(layer1, x.reshape(R, Kd), w8.reshape(L, N, Kd), p, s.reshape(L, 1, Kd), float(eps))
    yt = sum_slots(parts, p.slots())                                  # [N, RN]: hi columns, then lo from NORM_ROWS
    y = (yt[:, :R] * (1 / NORM_HI) + yt[:, NORM_ROWS:NORM_ROWS + R] * (1 / NORM_LO)).T
    return (y * w_scale).reshape(out_shape)
  if tuning.scale_in_kernel and not wide:                             # x^T as it is, padded: [Kd, RN]
    P, xs = 1, None
    p = plan(R, P, N, Kd, tuning, scale_in_kernel=True)
    x16 = jnp.pad(x.reshape(R, Kd), ((0, p.RN - R), (0, 0))).T
  else:
    if x.dtype == jnp.float16:                                        # wgmma's operand as it is
      x16, xs = x.reshape(1, R, Kd), None
    else:
      fixed = tuning.fixed_split and x.dtype == jnp.bfloat16
      x16, xs = (split_fixed if fixed else scale_rows)(x.reshape(R, Kd))   # [P, R, Kd] float16, [R, 1] or [P]
    P = x16.shape[0]
    p = plan(R, P, N, Kd, tuning)
    x16 = jnp.pad(x16.reshape(P * R, Kd), ((0, p.RN - P * R), (0, 0)))  # [RN, Kd]
  parts = _call(layer1, x16, w8.reshape(L, N, Kd), p)                # [J, N, RN]
  yt = sum_slots(parts, p.slots())                                    # [N, RN]
  if xs is None:                                                      # float16 x, or scaled in the kernel
    y = yt[:, :R].T                                                   # [R, N]
  elif xs.ndim == 1:                                                  # split_fixed: a weight per part
    y = sum(yt[:, i * R:(i + 1) * R] * xs[i] for i in range(P)).T
  else:                                                               # scale_rows: one row scale
    y = sum(yt[:, i * R:(i + 1) * R] for i in range(P)).T * xs
  return (y * w_scale).reshape(out_shape)


def sum_slots(parts, slots: np.ndarray):
  """parts [J, N, RN] -> [N, RN]: each row block's written slots added (slots [J, Nb], static). Written as J - 1
  elementwise adds of static slices rather than a reduce, so that XLA can fuse it into whatever consumes the
  product (a reduce would be a kernel of its own)."""
  J, Nb = slots.shape
  parts = parts.reshape(J, Nb, BLOCK_N, parts.shape[-1])
  total = parts[0]                                                    # every row block writes slot 0
  for j in range(1, J):
    total = total + jnp.where(jnp.asarray(slots[j])[:, None, None], parts[j], 0.0)
  return total.reshape(Nb * BLOCK_N, parts.shape[-1])


SPLIT_BAND = 0.25                               # |x| >= SPLIT_BAND rides in hi, the rest in lo
SPLIT_HI, SPLIT_LO = 2.0 ** -15, 2.0 ** 18      # hi = x * SPLIT_HI, lo = x * SPLIT_LO, each where its band holds x


def split_fixed(x2):
  """bf16 x [R, Kd] -> (x16 [2, R, Kd] float16, (1 / SPLIT_HI, 1 / SPLIT_LO)): x = x16[0] / SPLIT_HI + x16[1] /
  SPLIT_LO, with no reduction and no rounding round trip, so XLA can fuse it into whatever makes x. Each value goes
  whole into one part by its magnitude: |x| >= 1/4 as x 2^-15 (in [2^-17, 2^16): bf16's 8 significant bits on
  float16's grid, exactly, up to the largest bf16 below 2^31; from 2^31 on, infinite), smaller ones as x 2^18
  (exact for |x| >= 2^-35; below, the float16 subnormal grid leaves an error of at most 2^-43). NaN rides in lo.
  x is widened by `precision.widen`: a float32 value that XLA kept unrounded can fall just below the band's edge
  and overflow lo to infinity (0.24999 * 2^18 > 65504)."""
  xf = precision.widen(x2)
  big = jnp.abs(xf) >= SPLIT_BAND
  hi = jnp.where(big, xf * SPLIT_HI, 0.0).astype(jnp.float16)
  lo = jnp.where(big, 0.0, xf * SPLIT_LO).astype(jnp.float16)
  return jnp.stack([hi, lo]), jnp.asarray([1 / SPLIT_HI, 1 / SPLIT_LO], jnp.float32)
