"""FP8 (float8_e4m3fn) attention operands: block-scaled quantization, key smoothing, the incoherence rotation, and
the exact jnp model of the FP8 flash kernel (`lcjax.ops.mosaic_gpu.flash.flash_attention_fp8`).

Quantization: x is stored as e4m3(x / scale) with scale = absmax / 448 over a block, so the block's largest value
maps to e4m3's largest finite value. With qk_dtype="int8" (RunConfig attention_dtype="int8_fp8") Q and K are
int8 instead, round(x / scale) with scale = absmax / 127, and the kernel's Q K^T is an exact int32 product; V and
P stay e4m3. Q gets one scale per (batch, `block_q` rows, head), K one per (batch,
`block_kv` keys, kv head), V one per (batch, kv head). The kernel reads V transposed, [B, K, H, S], because
Hopper's fp8 tensor-core product wants both operands contiguous along the contracted axis (keys, for P @ V); that
layout is made next to the kernel (`lcjax.ops.mosaic_gpu.flash.v_operand`), V is quantized here in its own.

Incoherent processing: Q and K are multiplied by the same orthogonal matrix R = D H / sqrt(H) (H a Sylvester
Hadamard matrix, D a fixed random +-1 diagonal) before quantization. Q R (K R)^T = Q K^T in exact arithmetic; the
rotation spreads an outlier channel over all channels, so a block's absmax, and with it the quantization step of
every other value, shrinks.

The kernel, per query block and key block i (m, l, acc start at -1e30, 0, 0):
  s   = q8 k8_i^T (exact products, float32 sums; int32 for int8)      c_i = log2(e) / sqrt(H) * qs * ks_i
  m'  = max(m, max_j s * c_i)                         p   = exp2(s * c_i - (m' - 8))    (P scaled by 2^8)
  l   = l * exp2(m - m') + sum_j p                    acc = acc * exp2(m - m') + e4m3(p) v8_i
  out = acc / l * vs,  lse = (m + log2(l) - 8) * ln 2
P * 2^8 <= 256 fits e4m3 (max 448) and keeps small probabilities out of its subnormal range. Each key block's
P @ V product starts from a zero accumulator and is added to `acc` in float32 (the tensor cores' fp8 products
accumulate with fewer bits than float32). `attention_fp8_model` computes exactly this, block by block.

P is scaled against the running row maximum, not each block's own: on SmolLM2 (2,048 tokens of text, KL of the
last logits against float32) the per-block form measured 1.2e-2 against 5.1e-3 (both with smoothed keys). Keys
whose p * 2^8 falls below e4m3's subnormals drop out of P @ V; their scores carry the largest relative error of
the e4m3 Q K^T product, whose noise inflates a row's many small probabilities (E[exp(x + noise)] > exp(x)).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
F32_MAX = float(np.finfo(np.float32).max)
INT8_MAX = 127.0
P_SHIFT = 8                  # P is quantized as p * 2^P_SHIFT
_SCALE_FLOOR = 1e-12         # an all-zero block gets this absmax (its values quantize to 0 either way)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_FLOOR = -1e30


def scale_for(absmax, top: float = E4M3_MAX):
  """The scale that maps `absmax` to `top` (the largest value of the 8-bit type); all-zero blocks get a floor."""
  return jnp.maximum(absmax, _SCALE_FLOOR) / top


def clip_finite(x, y):
  """y = x / a scale, clipped to e4m3's range, and NaN where x is not finite. Clipping an inf to 448 would make a
  finite value of one the model never produced, and the request would go on from it; a NaN reaches the logits,
  which stop it (finish 'nonfinite'), as a bf16 value would. A plain comparison, not isfinite, so that every
  lowering (XLA, Triton, Mosaic GPU) keeps it."""
  return jnp.where(jnp.abs(x) <= F32_MAX, jnp.clip(y, -E4M3_MAX, E4M3_MAX), jnp.nan)


def absmax_scale(x, axes, top: float = E4M3_MAX):
  """x's absmax over `axes` (non-negative) times 1/top, floored as `scale_for` floors it, in one reduction: |x|
  times the float32 1/top is reduced from the floor's scale up (a product with a positive constant commutes with
  the max), so XLA makes the scale in the reduction's own kernel instead of one more kernel after it. Equals
  jnp.maximum(absmax, floor) * float32(1 / top); `scale_for` divides instead (within an ulp)."""
  inv = np.float32(1.0 / top)
  return lax.reduce(jnp.abs(x.astype(jnp.float32)) * inv, np.float32(np.float32(_SCALE_FLOOR) * inv), lax.max,
                    tuple(axes))


def take(pool, index):
  """pool[index]. On the CPU a pool of 8-bit floats is read through its uint8 view, the same bytes: XLA's CPU
  backend has no float8 gather or slice and widens the whole operand to float16 first (the whole cache of every
  layer, for each layer's read of a few pages). GPUs read float8 as it is."""
  if not _byte_floats(pool):
    return pool[index]
  return lax.bitcast_convert_type(_bytes(pool)[index], pool.dtype)


def set_at(pool, index, values, **kw):
  """pool.at[index].set(values, **kw), values cast to the pool's dtype. On the CPU a pool of 8-bit floats is updated
  through its uint8 view, the same bytes: XLA's CPU backend has no float8 update and widens the whole pool to
  float16 and back around each one (benchmarks/NOTES-fp8.md measures the cost: with `take` and `as_carry`, fp8
  decode on the CPU runs near float32's speed). GPUs update float8 as it is."""
  values = jnp.asarray(values).astype(pool.dtype)
  if not _byte_floats(pool):
    return pool.at[index].set(values, **kw)
  return lax.bitcast_convert_type(_bytes(pool).at[index].set(_bytes(values), **kw), pool.dtype)


def as_carry(x):
  """x as a loop carries it: on the CPU an array of 8-bit floats as its uint8 view (`from_carry` undoes it), so
  that the updates of `set_at` inside the loop meet a uint8 buffer they can write in place; x itself elsewhere
  (None stays None)."""
  return _bytes(x) if x is not None and _byte_floats(x) else x


def from_carry(x, dtype):
  """The array `as_carry` made from an array of `dtype`, back in `dtype` (the same bytes)."""
  return lax.bitcast_convert_type(x, dtype) if x is not None and x.dtype == jnp.uint8 != jnp.dtype(dtype) else x


def _byte_floats(x) -> bool:
  """Whether x is an array of 8-bit floats and JAX's default backend is the CPU (where `take`, `set_at` and
  `as_carry` use the uint8 view)."""
  return (jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 8
          and jax.default_backend() == "cpu")


def _bytes(x):
  return lax.bitcast_convert_type(x, jnp.uint8)


def round_to_e4m3(x):
  """float32 x with |x| <= 448 -> the nearest float8_e4m3fn value (ties to even), as float32, by integer and
  float32 arithmetic. A round trip x.astype(e4m3).astype(float32) computes the same, but XLA may fold it back to
  x (its GPU default allows excess precision), which a residual x - round(x) must not see. Normal values
  (|x| >= 2^-6) keep 3 mantissa bits; below, e4m3's subnormal step is 2^-9."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  half_ulp = jnp.uint32(0x7FFFF) + ((bits >> 20) & 1)                     # ties to even on the kept bits
  normal = lax.bitcast_convert_type((bits + half_ulp) & jnp.uint32(0xFFF00000), jnp.float32)
  subnormal = jnp.round(x * 512.0) * (1.0 / 512.0)
  return jnp.where(jnp.abs(x) >= 2.0 ** -6, normal, subnormal)


def quantize_rows(x, block: int, dtype=E4M3):
  """x [B, T, N, H] (T % block == 0) -> (x8 [B, T, N, H] of `dtype`, scale [B, N, T // block] float32), one scale
  per `block` rows of each head: the block's absmax maps to the largest value of `dtype`. e4m3 rounds each value
  to 3 mantissa bits; int8 (round(x / scale), absmax / 127) is a uniform grid over the block, whose largest
  values keep 7 bits."""
  B, T, N, H = x.shape
  if T % block:
    raise ValueError(f"rows T={T} must be a multiple of block={block}")
  top = INT8_MAX if jnp.dtype(dtype) == jnp.int8 else E4M3_MAX
  xb = x.astype(jnp.float32).reshape(B, T // block, block, N, H)
  scale = scale_for(jnp.max(jnp.abs(xb), axis=(2, 4)), top)                  # [B, T/block, N]
  y = xb / scale[:, :, None, :, None]
  if top == INT8_MAX:
    y = jnp.round(y)
  x8 = jnp.clip(y, -top, top).astype(dtype).reshape(B, T, N, H)
  return x8, jnp.transpose(scale, (0, 2, 1))


def quantize_v(v):
  """v [B, S, K, H] -> (v8 [B, S, K, H] e4m3, scale [B, K] float32), one scale per kv head."""
  vf = v.astype(jnp.float32)
  scale = scale_for(jnp.max(jnp.abs(vf), axis=(1, 3)))                     # [B, K]
  return jnp.clip(vf / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(E4M3), scale


def has_rotation(head_dim: int) -> bool:
  """Whether `rotation` exists for this head dim: a Sylvester Hadamard matrix, made for powers of two."""
  return head_dim & (head_dim - 1) == 0


@functools.lru_cache(maxsize=None)
def _signed_hadamard(head_dim: int, seed: int) -> np.ndarray:
  if not has_rotation(head_dim):
    raise ValueError(f"the incoherence rotation needs a power-of-two head_dim, got {head_dim}")
  h = np.ones((1, 1))
  while h.shape[0] < head_dim:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=head_dim)
  return (signs[:, None] * h).astype(np.float32)


def rotation(head_dim: int, seed: int = 0) -> jax.Array:
  """The orthogonal [H, H] matrix D Hadamard / sqrt(H) of incoherent processing (fixed by `seed`)."""
  return jnp.asarray(_signed_hadamard(head_dim, seed) / math.sqrt(head_dim))


def rotate(x, seed: int = 0):
  """x [..., H] @ rotation(H) in x's dtype. The +-1 matrix is exact in any float dtype, so a bf16 x is rotated on
  the tensor cores with float32 sums (one bf16 rounding of the result, far below e4m3's), then scaled by
  1 / sqrt(H)."""
  H = x.shape[-1]
  signed = jnp.asarray(_signed_hadamard(H, seed), x.dtype)
  y = jnp.einsum("...h,hg->...g", x, signed, preferred_element_type=x.dtype,
                 precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
  return y * jnp.asarray(1.0 / math.sqrt(H), x.dtype)


def smooth_keys(q, k, kv_len):
  """(k - kbar, lse shift [B, T, N] float32) with kbar [B, K, H] the mean of each kv head's first kv_len[b] keys.

  Softmax is unchanged when every score of a row moves by the same amount, and q . kbar / sqrt(H) is such an
  amount, so attention over k - kbar has the same output and an lse lower by exactly that shift, added back in
  float32. Trained models' keys share a large per-channel bias; without it each key's e4m3 rounding error (relative
  to its magnitude) is far smaller, and the score errors that would inflate the many small probabilities of a row
  (E[exp(x + noise)] > exp(x)) shrink with it. q, k: [B, T, N, H], [B, S, K, H]; kv_len [B]. Keys past kv_len
  weigh 0 in the mean and must be finite (cache pages always are: zeros or keys written earlier)."""
  B, S, K, H = k.shape
  N = q.shape[2]
  # The sum over keys as a [B, 1, S] x [B, S, K*H] product with float32 accumulation: one read of k at the
  # memory's speed (an XLA column reduction over 128K keys into K*H = 1,024 sums measured ~40x slower).
  valid = (jnp.arange(S, dtype=jnp.int32)[None, :] < kv_len[:, None]).astype(k.dtype)              # [B, S]
  ksum = jnp.einsum("bs,bskh->bkh", valid, k, preferred_element_type=jnp.float32,
                    precision=lax.Precision.HIGHEST if k.dtype == jnp.float32 else None)
  # kbar in k's dtype, used as such by both the subtraction and the shift, so they cancel up to the residual's
  # rounding in k's dtype (far below e4m3's). The residual keeps k's dtype: a float32 k would make the rotation
  # (lcjax.ops.fp8.rotate, in its input's dtype) a float32 matmul, and a float32 copy of the gathered prefix
  # block measured 1 ms a call at 128K keys.
  kbar = (ksum / jnp.maximum(kv_len, 1).astype(jnp.float32)[:, None, None]).astype(k.dtype)
  shift = jnp.einsum("btkgh,bkh->btkg", q.astype(jnp.float32).reshape(B, -1, K, N // K, H),
                     kbar.astype(jnp.float32), precision=lax.Precision.HIGHEST).reshape(B, -1, N) / math.sqrt(H)
  return k - kbar[:, None], shift


QK_DTYPES = ("float8_e4m3fn", "int8")


def quantize_operands(q, k, v, *, block_q: int, block_kv: int, incoherent: bool, qk_dtype: str = "float8_e4m3fn"):
  """bf16/float32 q [B, T, N, H], k/v [B, S, K, H] -> the FP8 kernel's operands
  (q8, qs [B, N, T/block_q]), (k8, ks [B, K, S/block_kv]), (v8 [B, S, K, H], vs [B, K]); q8 and k8 are e4m3 or,
  with qk_dtype="int8", int8 (V is e4m3 either way)."""
  if qk_dtype not in QK_DTYPES:
    raise ValueError(f"qk_dtype={qk_dtype!r}: expected one of {QK_DTYPES}")
  if incoherent:
    q, k = rotate(q), rotate(k)
  q8, qs = quantize_rows(q, block_q, qk_dtype)
  k8, ks = quantize_rows(k, block_kv, qk_dtype)
  return (q8, qs), (k8, ks), quantize_v(v)


class PageScales(NamedTuple):
  """The scales of fp8 pages the FP8 kernel reads where they lie (`page_scales`): each key block of block_kv keys is
  n groups of block_kv / n keys, a group within one page. [B, K, NB, n] but v_max [B, K, NB].

  A group's scores take its page's K scale. V's page scales differ within a block and between blocks, and the
  kernel's P @ V products of a block add into one accumulator: the block's P is quantized against its largest V
  scale v_max, each group's P scaled by 2^v_log2 = its V scale / v_max (a power of two for lcjax's pages:
  exact), and its row sums by v_inv = 2^-v_log2 back. The running accumulator is kept in units of the current
  block's v_max: it is rescaled by the ratio of consecutive blocks' v_max with the softmax's own per-row
  correction."""
  k: jax.Array
  v_log2: jax.Array
  v_inv: jax.Array
  v_max: jax.Array


# The smallest V scale of a group against its block's v_max that `page_scales` keeps: a smaller one (a page whose
# values are all zero) is raised to it, so its P underflows e4m3 (its V contributes nothing, as its values are ~0)
# while its row sums stay finite.
V_RATIO_FLOOR = 2.0 ** -64


def page_groups(page_size: int, block_kv: int) -> int:
  """Groups of keys of one page in a key block of `block_kv` keys: block_kv / page_size for smaller pages, else 1."""
  return max(1, block_kv // page_size)


def page_scales(k_scale, v_scale, table, kv_len, *, page_size: int, block_kv: int) -> PageScales:
  """The PageScales of pages read through table [B, M] (pool page ids, offset applied) with scales k_scale,
  v_scale [P, K] float32, over the first kv_len[b] keys of sequence b (M * Z keys in NB = ceil(M * Z / block_kv)
  blocks; page_size and block_kv divide one another). Groups from kv_len on weigh nothing: K scale 1, v_log2 0,
  v_inv 1, and they do not count in v_max (1 where a block has none before kv_len)."""
  B, M = table.shape
  Z = page_size
  if Z % block_kv and block_kv % Z:
    raise ValueError(f"page_size={Z} and block_kv={block_kv}: one must divide the other")
  n = page_groups(Z, block_kv)
  size = block_kv // n
  NB = -(-M * Z // block_kv)
  first = jnp.arange(NB * n, dtype=jnp.int32) * size                      # each group's first key
  pages = table[:, jnp.minimum(first // Z, M - 1)]                         # [B, NB * n]
  live = (first[None, :] < jnp.reshape(kv_len, (-1, 1)))[..., None]       # [B, NB * n, 1]
  grouped = lambda x: jnp.moveaxis(x.reshape(B, NB, n, -1), 3, 1)          # [B, NB * n, K] -> [B, K, NB, n]
  ks = grouped(jnp.where(live, k_scale[pages].astype(jnp.float32), 1.0))
  vs = grouped(jnp.where(live, v_scale[pages].astype(jnp.float32), 0.0))
  live = grouped(jnp.broadcast_to(live, vs.shape[:1] + (NB * n, vs.shape[1])))
  v_max = vs.max(axis=-1)
  v_max = jnp.where(v_max > 0, v_max, 1.0)
  vc = jnp.where(live, jnp.maximum(vs, v_max[..., None] * V_RATIO_FLOOR), v_max[..., None])
  return PageScales(ks, jnp.log2(vc / v_max[..., None]), v_max[..., None] / vc, v_max)


def block_scales(ks, vs) -> PageScales:
  """The PageScales of operands quantized by `quantize_operands`: ks [B, K, NB] per key block, vs [B, K] per head."""
  ones = jnp.ones_like(ks)[..., None]
  return PageScales(ks[..., None], jnp.zeros_like(ones), ones, jnp.broadcast_to(vs[..., None], ks.shape))


def attention_fp8_model(q8, qs, k8, ks, v8, vs, d, kv_len, *, causal: bool, block_q: int, block_kv: int):
  """The FP8 kernel's arithmetic in jnp (see the module docstring): (out [B, T, N, H] float32, lse [B, T, N]).

  ks, vs: the scales `quantize_operands` makes (ks [B, K, S / block_kv], vs [B, K]), or ks a PageScales and vs
  None (pages read in place: k8, v8 the pages' bytes in key order). Same masking as the bf16 flash kernel: key j is
  visible to row i iff j < kv_len[b] and (not causal or j <= i + d[b]). Rows that see no key give out 0 and lse
  -inf."""
  B, T, N, H = q8.shape
  S, K = v8.shape[1], v8.shape[2]
  G = N // K
  sc = ks if isinstance(ks, PageScales) else block_scales(ks, vs)
  n = sc.k.shape[-1]
  nq, nk = T // block_q, S // block_kv
  c = _LOG2E / math.sqrt(H)
  qf = q8.astype(jnp.float32).reshape(B, nq, block_q, K, G, H)
  cq = (c * qs).reshape(B, K, G, nq)
  rows = jnp.arange(T, dtype=jnp.int32).reshape(nq, block_q)
  at = lambda x, i: lax.dynamic_index_in_dim(x, i, axis=2, keepdims=False)                  # [B, K, (n)]
  grouped = lambda x: x[:, :, None, None, None, :, None]                                    # [B, K, n] -> s's

  def step(carry, i):
    m, l, acc, ref_v = carry                                             # [B, K, G, nq, bq](, H); ref_v [B, K]
    kb = lax.dynamic_slice_in_dim(k8, i * block_kv, block_kv, axis=1).astype(jnp.float32)    # [B, bkv, K, H]
    vb = lax.dynamic_slice_in_dim(v8, i * block_kv, block_kv, axis=1).astype(jnp.float32)    # [B, bkv, K, H]
    s = jnp.einsum("bqrkgh,bjkh->bkgqrj", qf, kb, precision=lax.Precision.HIGHEST)
    s = s.reshape(*s.shape[:-1], n, block_kv // n)                      # [B, K, G, nq, bq, n, bkv / n]
    ci = cq[..., None, None, None] * grouped(at(sc.k, i))
    cols = (i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)).reshape(n, -1)
    vis = cols < kv_len[:, None, None, None, None, None, None]                              # [B, 1, .., n, g]
    if causal:
      vis = vis & (cols <= rows[:, :, None, None] + d[:, None, None, None, None, None, None])
    x = jnp.where(vis, s * ci, -jnp.inf)
    m_new = jnp.maximum(m, x.max(axis=(-2, -1)))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(x - (m_new[..., None, None] - P_SHIFT - grouped(at(sc.v_log2, i))))
    l = l * alpha + (p.sum(axis=-1) * grouped(at(sc.v_inv, i))[..., 0]).sum(axis=-1)
    v_max = at(sc.v_max, i)                                              # [B, K]
    # p <= 2^P_SHIFT: rounded to e4m3 as the kernel's P operand is, in float32 arithmetic (`round_to_e4m3`: a round
    # trip through e4m3 may be folded away by XLA on a GPU).
    pv = jnp.einsum("bkgqrj,bjkh->bkgqrh", round_to_e4m3(p).reshape(*s.shape[:5], block_kv), vb,
                    precision=lax.Precision.HIGHEST)
    rescale = alpha * (ref_v / v_max)[:, :, None, None, None]
    return (m_new, l, acc * rescale[..., None] + pv, v_max), None

  init = (jnp.full((B, K, G, nq, block_q), _M_FLOOR, jnp.float32), jnp.zeros((B, K, G, nq, block_q), jnp.float32),
          jnp.zeros((B, K, G, nq, block_q, H), jnp.float32), jnp.ones((B, K), jnp.float32))
  (m, l, acc, ref_v), _ = lax.scan(step, init, jnp.arange(nk))
  empty = l == 0                                                # not l > 0: a NaN l (a NaN or inf score) stays NaN
  l_safe = jnp.where(empty, 1.0, l)
  out = acc / l_safe[..., None] * ref_v[:, :, None, None, None, None]
  lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe) - P_SHIFT) * _LN2)
  out = jnp.transpose(out, (0, 3, 4, 1, 2, 5)).reshape(B, T, N, H)
  lse = jnp.transpose(lse, (0, 3, 4, 1, 2)).reshape(B, T, N)
  return out, lse
