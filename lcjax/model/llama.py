"""LLaMA in Flax NNX: embedding, RMSNorm, rotary GQA attention, SwiGLU MLP, tied or untied head.

Layer weights are stacked on a leading `layers` axis and the forward pass scans over them, so an 80-layer model
compiles as fast as a 1-layer one. Every parameter carries its logical axis names (metadata `axes`); the mesh
code turns them into shardings. Attention goes through a backend object with the `(out, lse)` contract
(`lcjax.ops`), decode-sized fp8 products through a GEMV kernel object and a decode step's fp8 page writes through
a page writer object (`lcjax.ops.kernels`), each chosen once outside the model; the model imports no kernel.

Call forms (B batch, T tokens in this call):
  logits, _ = model(tokens, positions)                          full causal forward over `tokens` alone
  logits, cache = model(tokens, positions, cache=..., slots=..., page_table=..., prefix_len=...)
      chunked prefill: the chunk's K/V are written to the paged cache at `slots`, the chunk attends to the
      cached prefix (`prefix_len` tokens, through the page table) and to itself, merged through (out, lse).
      A page table of no pages ([B, 0]) says nothing is cached before the chunk (prefix_len 0): the chunk
      attends to itself alone. (A prefix read's work is sized by the table's width, not by prefix_len.)
  logits, cache = model(tokens, positions, cache=..., slots=..., page_table=..., kv_len=...)
      decode: K/V written first, then the queries attend to `kv_len` cached tokens through the page table.
  logits, cache, (k, v) = model(tokens, positions, cache=..., page_table=..., kv_len=..., kv_out=True)
      decode rows that write nothing (slots=None; a speculative verify step): each row attends to the cached
      tokens before positions[:, 0] and to the call's rows up to its own; the cache comes back as it came in.
`lengths [B]` marks how many of the T tokens are real (the rest is padding); `logits_at [B]` keeps only the
logits of one position per sequence (prefill needs just the last one). An fp8 cache's pages get their scales
from the tokens written into them (lcjax.cache.kv). positions=None: the model builds them, row t at
(prefix_len[b] or 0) + t (the engine's chunks are called so); the backends are then told that the cached prefix
precedes the rows (`paged(..., past=True)`) and, on one device, get the chunk's own causal block without
positions, so neither is checked on the device (each check a lax.cond, which on a GPU waits for the queued
kernels). Positions given are checked as the backends check them.

On a mesh (`mesh=`, axes "seq" x "tensor"; lcjax.sharding) the same call forms hold, inputs and outputs in
natural token order. Weights shard on `tensor` through their logical axes (GSPMD does the projections and MLP,
but for the GEMV kernel's fp8 products, which run on each device's shards in a shard_map: `Llama._gemv_mesh`);
attention runs in one shard_map over both axes with the heads local:
  full forward / prefill chunk   the call's tokens are padded to a multiple of 2 * seq and permuted into the
      zigzag layout (lcjax.ops.ring) before the embedding, so activations stay split over `seq` through every
      layer (`sp_mode="ring-plain"` keeps natural order, contiguous blocks: the load-imbalanced baseline the
      zigzag is measured against). The chunk attends to itself by ring attention (or Ulysses), and to the
      cached prefix through the paged cache sharded on `seq`: the chunk's queries are all-gathered (in layout
      order), each shard attends them to its own pages, and the partials are reduce-scattered back
      (lcjax.ops.ring.combine_seq_partials).
  decode   the few query tokens are replicated over `seq`; each shard attends them to its own pages and the
      partials are combined: the query moves, the cache stays.
New K/V go to the pages' owner shard (page-table slot m on shard m % seq, lcjax.cache.pages); in a prefill chunk
they are all-gathered over `seq` first, as the ring moves them anyway.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import einops
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from lcjax.cache import kv as kvc
from lcjax.config import ModelConfig, WeightFormat
from lcjax.model.rope import apply_rope, inv_frequencies, rope_angles
from lcjax.ops.attention import merge
from lcjax.ops.backends import ReferenceBackend
from lcjax.ops.linear import (WIDEN_MAX_ROWS, contracted, dense, dequantize_weight, kmajor_axes, kmajor_spec,
                               path_for_rows, quantize_axes, quantize_weight)
from lcjax.ops.ring import combine_seq_partials, ring_attention_shard, zigzag_length, zigzag_order
from lcjax.ops.ulysses import check_ulysses, ulysses_attention_shard
from lcjax import sharding as sh
from lcjax.sharding import SEQ, TENSOR, constrain


@functools.lru_cache(maxsize=None)
def _inv_freq(cfg: ModelConfig):
  return inv_frequencies(cfg)


def _param(rngs, shape, axes, dtype, std, n_layers=None):
  """A parameter of `shape` ([L, *shape] with `n_layers`): ones (std None) or normal(0, std) in `dtype`, drawn
  layer by layer (one layer's float32 draw live at a time, however many layers)."""
  value = _draw(rngs, shape, dtype, std, n_layers)
  return nnx.Param(value, axes=("layers", *axes) if n_layers is not None else axes)


def _draw(rngs, shape, dtype, std, n_layers, transform=None):
  if std is None:
    value = jnp.ones(shape, dtype)
    value = value if transform is None else transform(value)
    if n_layers is None:
      return value
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n_layers, *a.shape)), value)

  def one(key):
    value = (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)
    return value if transform is None else transform(value)

  key = rngs.params()
  return one(key) if n_layers is None else jax.lax.map(one, jax.random.split(key, n_layers))


# The logical axes of the linear layers' weights in the model's layout, by checkpoint name.
LINEAR_AXES = {"layers/attn/wqkv": ("embed", "kv_heads", None, "head_dim"),
               "layers/attn/wo": ("heads", "head_dim", "embed"),
               "layers/mlp/w_gate_up": ("embed", None, "mlp"), "layers/mlp/w_down": ("mlp", "embed")}


def _linear(module, name, rngs, shape, axes, dtype, std, n_layers, spec, weights: WeightFormat):
  """Set the weight `name` of a linear layer (the second operand of einsum `spec`) on `module`: in `dtype`, or for
  fp8 weights as e4m3 `name` with float32 `name_scale`, both K-major (lcjax.ops.linear: the same draw in `dtype`,
  quantized per output channel) and, with static input scales, a per-layer `name_in_scale`."""
  laxes = ("layers", *axes) if n_layers is not None else axes
  if not weights.fp8:
    setattr(module, name, _param(rngs, shape, axes, dtype, std, n_layers))
    return
  w8, scale = _draw(rngs, shape, dtype, std, n_layers, lambda w: quantize_weight(w, spec))
  w_axes, scale_axes = kmajor_axes(spec, laxes)
  setattr(module, name, nnx.Param(w8, axes=w_axes))
  setattr(module, name + "_scale", nnx.Param(scale, axes=scale_axes))
  if weights.static_inputs:
    lead = () if n_layers is None else (n_layers,)
    setattr(module, name + "_in_scale", nnx.Param(jnp.ones((*lead, 1), jnp.float32), axes=(*laxes[:len(lead)], None)))


def _apply(module, name, x, spec, gemv=None, path=None):
  """einsum(spec, x, weight `name`) for a weight set by `_linear`. gemv: for fp8 weights held whole by the layer
  scan (stacked [L, ...]), the product of this layer's slice (`Llama._gemv`), handed the weight's and the scale's
  logical axes. path: the product `dense` runs for other fp8 weights (None: chosen by x's rows)."""
  w = getattr(module, name)[...]
  if not hasattr(module, name + "_scale"):
    return jnp.einsum(spec, x, w)
  if gemv is not None:
    scale = getattr(module, name + "_scale")
    axes = (getattr(module, name).get_metadata()["axes"], scale.get_metadata()["axes"])
    return gemv(x, w, scale[...], spec, axes)
  in_scale = getattr(module, name + "_in_scale", None)
  return dense(x, w, getattr(module, name + "_scale")[...], spec,
               in_scale=None if in_scale is None else in_scale[...], path=path)


def rms_norm(x, scale, eps):
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim, eps, *, dtype, rngs, n_layers=None):
    self.scale = _param(rngs, (dim,), ("embed",), dtype, None, n_layers)
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
  """Grouped-query attention. The projections are head-major so heads shard on `tensor` without reshapes.

  wqkv [D, K, G + 2, H] is the query, key and value projection in one: per KV head its G query heads (query head
  n = k * G + g, HF's order), then its key, then its value. One GEMM per layer: at batch-1 decode XLA rewrites a
  dot under 10M multiply-adds, such as a separate [D, K * H] key projection, into a reduce fusion that reads its
  weights at 1.4-1.7 TB/s (benchmarks/NOTES-longctx.md). Checkpoints keep one tensor per projection
  (lcjax.checkpoint.layout.FUSED assembles them on restore)."""

  QKV, OUT = "btd,dkgh->btkgh", "btnh,nhd->btd"

  def __init__(self, cfg: ModelConfig, *, dtype, rngs, n_layers=None, weights: WeightFormat = WeightFormat()):
    D, N, H = cfg.dim, cfg.n_heads, cfg.head_dim
    shapes = linear_shapes(cfg)
    _linear(self, "wqkv", rngs, shapes["layers/attn/wqkv"], LINEAR_AXES["layers/attn/wqkv"], dtype, D ** -0.5,
            n_layers, self.QKV, weights)
    _linear(self, "wo", rngs, shapes["layers/attn/wo"], LINEAR_AXES["layers/attn/wo"], dtype, (N * H) ** -0.5,
            n_layers, self.OUT, weights)

  def qkv(self, x, rope, gemv=None, path=None):
    """x [B, T, D], rope = rope_angles(positions) -> q [B, T, N, H], k and v [B, T, K, H], q and k rotated."""
    qkv = _apply(self, "wqkv", x, self.QKV, gemv, path)        # [B, T, K, G + 2, H]
    G = qkv.shape[3] - 2
    q = einops.rearrange(qkv[:, :, :, :G], "b t k g h -> b t (k g) h")    # query head n = k * G + g
    k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]                 # [B, T, K, H]
    return apply_rope(q, *rope), apply_rope(k, *rope), v

  def out(self, o, gemv=None, path=None):
    return _apply(self, "wo", o, self.OUT, gemv, path)


class MLP(nnx.Module):
  """SwiGLU. w_gate_up [D, 2, F] is the gate and up projections in one GEMM (a larger GEMV at decode)."""

  GATE_UP, DOWN = "btd,dcf->btcf", "btf,fd->btd"

  def __init__(self, cfg: ModelConfig, *, dtype, rngs, n_layers=None, weights: WeightFormat = WeightFormat()):
    D, F = cfg.dim, cfg.ffn_dim
    shapes = linear_shapes(cfg)
    _linear(self, "w_gate_up", rngs, shapes["layers/mlp/w_gate_up"], LINEAR_AXES["layers/mlp/w_gate_up"], dtype,
            D ** -0.5, n_layers, self.GATE_UP, weights)
    _linear(self, "w_down", rngs, shapes["layers/mlp/w_down"], LINEAR_AXES["layers/mlp/w_down"], dtype,
            F ** -0.5, n_layers, self.DOWN, weights)

  def __call__(self, x, gemv=None, path=None):
    gu = _apply(self, "w_gate_up", x, self.GATE_UP, gemv, path)  # [B, T, 2, F]
    return _apply(self, "w_down", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], self.DOWN, gemv, path)


class Block(nnx.Module):
  """One decoder layer. Built with `n_layers` set, its parameters are stacked [L, ...]."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs, n_layers=None, weights: WeightFormat = WeightFormat()):
    self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype, rngs=rngs, n_layers=n_layers)
    self.attn = Attention(cfg, dtype=dtype, rngs=rngs, n_layers=n_layers, weights=weights)
    self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype, rngs=rngs, n_layers=n_layers)
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, n_layers=n_layers, weights=weights)


@dataclasses.dataclass(frozen=True)
class CallContext:
  """Per-call static and traced context shared by every layer."""
  positions: jax.Array            # [B, T]
  lengths: jax.Array              # [B] real tokens in this call
  slots: jax.Array | None         # [B, T] cache slots (padding -> null page); None with a cache: the call reads it
                                  # and writes nothing (its rows see each other as a causal block)
  page_table: jax.Array | None    # [B, M]
  prefix_len: jax.Array | None    # [B] cached tokens before this chunk (prefill)
  kv_len: jax.Array | None        # [B] cached tokens including this call's (decode)
  rope: tuple[jax.Array, jax.Array]   # rope_angles(positions): (cos, sin) [B, T, 1, H/2], once for every layer
  pages: jax.Array | None = None  # [B, J] global pages the call writes (kv.written_pages; fp8 caches)
  token_at: tuple | None = None   # ([B], [B]) kv.token_page_offset of a call the page-write kernel writes, unsharded
  split: bool = False             # tokens split over `seq` (zigzag or plain layout; mesh prefill / full forward)
  built: bool = False             # positions[b] = (prefix_len[b] or 0) + arange(T), built by the model: every
                                  # cached key precedes every row, and (unsplit) the rows are in order
  linear_path: str | None = None  # the product lcjax.ops.linear.dense runs for fp8 weights, chosen by the call's
                                  # real rows (B x T before a split call's padding); None: by its operand's rows

  @property
  def reads_prefix(self) -> bool:
    """Whether a prefill chunk reads a cached prefix: a page table of no pages says nothing is cached before it."""
    return self.prefix_len is not None and self.page_table is not None and self.page_table.shape[1] > 0


def rows_block(q, k, v, positions, lengths):
  """The rows of a decode call of several tokens (a speculative verify step) against the call's own keys, causal:
  (out [B, T, N, H], lse [B, T, N]) in float32 arithmetic, row t seeing keys j <= t with j < lengths [B]. The rows
  see the cache through the backend's paged kernel, merged with this by LSE. T <= 16: both products are
  elementwise multiplies summed over one axis, which XLA fuses into one kernel each (as dots they took cuBLAS
  calls and transposes in every layer)."""
  B, T, N, H = q.shape
  K = k.shape[2]
  qg = q.astype(jnp.float32).reshape(B, T, 1, K, N // K, H) * H ** -0.5
  kf, vf = (a.astype(jnp.float32)[:, None, :, :, None, :] for a in (k, v))      # [B, 1, S=T, K, 1, H]
  s = jnp.sum(qg * kf, axis=-1)                                                   # [B, T, S, K, G]
  j = jnp.arange(T, dtype=jnp.int32)
  visible = (j[None, :] <= j[:, None])[None] & (j[None, None, :] < lengths[:, None, None])   # [B, T, S]
  s = jnp.where(visible[..., None, None], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=2)                                               # [B, T, K, G]
  p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[:, :, None])
  # A hidden key's value is left out, not weighted by 0: a later row's NaN value (0 * NaN = NaN) stays its own.
  out = jnp.sum(jnp.where(visible[..., None, None, None], p[..., None] * vf, 0.0), axis=2)   # [B, T, K, G, H]
  return out.reshape(B, T, N, H).astype(q.dtype), lse.reshape(B, T, N)


def check_mesh(cfg: ModelConfig, tensor: int, seq: int, sp_mode: str = "ring") -> None:
  """Raise unless the model's heads split over `tensor` (and over `seq` too for Ulysses). cfg.n_kv_heads is the
  count the model runs with, after any KV-head replication."""
  if cfg.n_heads % tensor:
    raise ValueError(f"n_heads={cfg.n_heads} is not divisible by {tensor=}: query heads cannot be split over the "
                     "tensor axis")
  if cfg.n_kv_heads % tensor:
    raise ValueError(f"n_kv_heads={cfg.n_kv_heads} is not divisible by {tensor=}: replicate KV heads first "
                     "(lcjax.sharding.kv_head_replication)")
  if sp_mode == "ulysses" and seq > 1:
    check_ulysses(cfg.n_heads // tensor, cfg.n_kv_heads // tensor, seq)


# The linear layers' weights (checkpoint names) and the einsum each is the second operand of.
LINEAR = {"layers/attn/wqkv": Attention.QKV, "layers/attn/wo": Attention.OUT, "layers/mlp/w_gate_up": MLP.GATE_UP,
          "layers/mlp/w_down": MLP.DOWN}


def linear_shapes(cfg: ModelConfig, tensor: int = 1) -> dict[str, tuple[int, ...]]:
  """The model-layout shapes of one layer's four linear weights, by checkpoint name (LINEAR's keys); with `tensor`
  the shapes of one device's shard on a mesh of that tensor size (the dimensions LINEAR_AXES puts on `tensor`
  divided; check_mesh's divisibility assumed)."""
  D, F, H, N, K = cfg.dim, cfg.ffn_dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
  shapes = {"layers/attn/wqkv": (D, K, N // K + 2, H), "layers/attn/wo": (N, H, D),
            "layers/mlp/w_gate_up": (D, 2, F), "layers/mlp/w_down": (F, D)}
  return {name: tuple(n // tensor if sh.spec((a,))[0] == TENSOR else n for n, a in zip(shape, LINEAR_AXES[name]))
          for name, shape in shapes.items()}


def product_dims(name: str, shape) -> tuple[int, int]:
  """(N, Kd) of linear weight `name` of model-layout `shape`: its output channels and its contracted length, as
  LINEAR's einsum multiplies it (its contracted axes: lcjax.ops.linear.quantize_axes)."""
  Kd = math.prod(shape[i] for i in quantize_axes(LINEAR[name]))
  return math.prod(shape) // Kd, Kd


# The fp8 weights and scales a decode-sized call's layer scan holds whole for the GEMV kernel (Llama._gemv).
_HELD = frozenset(n.split("/")[-1] + sfx for n in LINEAR for sfx in ("", "_scale"))
# Llama(pool_reads=...): how attention reads a layer's pages out of the pools of every layer.
POOL_READS = ("view", "layer")


def default_pool_reads(attention) -> str:
  """Llama's pool_reads when none is given: "layer" on XLA:CPU for backends that take it (`reads_layer_pools`: the
  jnp reference and dense), "view" elsewhere (GPU kernels read the view's pages in place).

  On XLA:CPU, reading a pool just written through the view ([L, P, Z, K, H] reshaped to [L * P, Z, K, H]) copies
  it when the write is a dynamic-update-slice (XLA's form of a one-row scatter: batch-1 decode) and the view is an
  operand of the reference's block loop (a while loop): XLA fuses the write with the reshape, a fusion whose output
  shape is not the pool's cannot update in place, and the pool is copied for it and again for the write the layer
  scan carries: 4 copies of K and 4 of V in every layer of every decode step, O(pool) per layer. Read as
  pools[layer, page], the written pool is never reshaped and XLA:CPU writes and reads it in place."""
  return "layer" if jax.default_backend() == "cpu" and getattr(attention, "reads_layer_pools", False) else "view"


def convert_weights(params, cfg: ModelConfig, target: WeightFormat, dtype):
  """A parameter state of Llama(cfg) with its linear weights in the `target` format (the state itself when they
  are in it), converted a layer at a time on the device (lax.map): for engines handed parameters directly."""
  source = weight_format(params)
  if source.fp8 == target.fp8 and source.static_inputs == target.static_inputs:
    return params
  if target.static_inputs:
    raise ValueError("fp8 weights with static input scales come only from a checkpoint that holds the scales")
  dtype = jnp.dtype(dtype)
  pure = params.to_pure_dict()

  def convert_layer(w, scale, spec):
    if target.fp8:
      return quantize_weight(w.astype(dtype), spec)
    return dequantize_weight(w, scale, spec, dtype), None

  @jax.jit
  def convert(pure):
    out = {}
    for name, spec in LINEAR.items():
      _, block, w = name.split("/")
      node = pure["layers"][block]
      out[name] = jax.lax.map(lambda a, spec=spec: convert_layer(*a, spec), (node[w], node.get(w + "_scale")))
    return out

  converted = convert(pure)
  for name, (w8, scale) in converted.items():
    _, block, w = name.split("/")
    node = pure["layers"][block]
    node[w] = w8
    for key in (w + "_scale", w + "_in_scale"):
      node.pop(key, None)
    if target.fp8:
      node[w + "_scale"] = scale
  state = nnx.state(nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, weights=target, rngs=nnx.Rngs(0))), nnx.Param)
  state.replace_by_pure_dict(pure)
  return state


def weight_format(params) -> WeightFormat:
  """The WeightFormat of a parameter state of Llama (concrete or abstract)."""
  attn = params["layers"]["attn"]
  return WeightFormat(fp8="wqkv_scale" in attn, static_inputs="wqkv_in_scale" in attn)


def repeat_kv_heads(params, rep: int):
  """Parameters with each KV head repeated `rep` times in place: a model of K * rep KV heads that computes exactly
  the same function, whose KV heads split over `tensor` when K alone does not. wqkv [L, D, K, G + 2, H] becomes
  [L, D, K * rep, G / rep + 2, H]: KV head k's G query heads are dealt in order to its rep copies, so query head n
  keeps its index and still reads original KV head n // G (rep divides G: lcjax.sharding.kv_head_replication)."""
  if rep == 1:
    return params

  def one(path, leaf):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if names[-2:] not in (["attn", "wqkv"], ["attn", "wqkv_scale"]):   # fp8 weights' scales are laid out alike
      return leaf
    w = leaf.get_value()
    k = list(leaf.get_metadata()["axes"]).index("kv_heads")    # [..., K, G + 2, ...]: H and D after, any order
    K, G = w.shape[k], w.shape[k + 1] - 2
    q = lax.slice_in_dim(w, 0, G, axis=k + 1)
    q = q.reshape(*w.shape[:k], K * rep, G // rep, *w.shape[k + 2:])
    kv = jnp.repeat(lax.slice_in_dim(w, G, G + 2, axis=k + 1), rep, axis=k)
    return leaf.replace(jnp.concatenate([q, kv], axis=k + 1))

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def model_mesh(mesh):
  """The mesh the model shards its calls over: None (the single-device code path) for no mesh or a mesh of one
  device. Tests replace it with the identity to run the sharded path on one device."""
  return mesh if mesh is not None and mesh.size > 1 else None


class Llama(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, param_dtype=None, attention=None, mesh=None,
               sp_mode: str = "ring", weights: WeightFormat = WeightFormat(), gemv_kernel=None, page_writer=None,
               pool_reads: str | None = None, rngs: nnx.Rngs):
    """weights: how the projection and MLP weights are held (fp8 or the parameter dtype); random fp8 weights
    are the same draw as in the parameter dtype, quantized. gemv_kernel: what multiplies fp8 weights in calls of
    at most lcjax.ops.linear.WIDEN_MAX_ROWS rows: a GEMV kernel (lcjax.ops.kernels: the kernel called on the
    stacked weights with the layer index; on a mesh on each device's shards, `_gemv_mesh`), or None
    (lcjax.ops.linear.dense's widened product on the layer's slice). page_writer: what writes a decode step's K
    and V into fp8 pages: a page writer (lcjax.ops.kernels), or None (lcjax.cache.kv's XLA write), handed to
    lcjax.cache.kv.write_kv. pool_reads: how the attention backend reads layer l's pages out of the pools of every
    layer [L, P, Z, K, H] that the layer scan carries (`_paged`): "view" (the pools reshaped to [L * P, Z, K, H], a
    free reshape, with page_offset = l * P) or "layer" (the pools themselves with layer=l; backends with
    `reads_layer_pools`); None: `default_pool_reads` decides, once, here. Both compute the same values."""
    if gemv_kernel is not None and not weights.fp8:
      raise ValueError(f"gemv_kernel {gemv_kernel.name!r} multiplies fp8 weights; these are in the parameter dtype")
    self.cfg = cfg
    self.weights = weights
    self.gemv_kernel = gemv_kernel
    self.page_writer = page_writer
    self.dtype = jnp.dtype(dtype)
    pdt = jnp.dtype(param_dtype or dtype)
    self.attention = attention or ReferenceBackend()
    pool_reads = default_pool_reads(self.attention) if pool_reads is None else pool_reads
    if pool_reads not in POOL_READS:
      raise ValueError(f"{pool_reads=} must be one of {', '.join(POOL_READS)}")
    if pool_reads == "layer" and not getattr(self.attention, "reads_layer_pools", False):
      raise ValueError(f"pool_reads='layer' needs a backend that reads the pools of every layer; "
                       f"{self.attention.name} reads one layer's pages as an offset into their [L * P] view")
    self.pool_reads = pool_reads
    self.mesh = model_mesh(mesh)
    self.sp_mode = sp_mode
    if self.mesh is not None:
      check_mesh(cfg, self.mesh.shape[TENSOR], self.mesh.shape[SEQ], sp_mode)
    self.embed = nnx.Module()
    self.embed.embedding = _param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", "embed"), pdt, 1.0)
    self.layers = Block(cfg, dtype=pdt, rngs=rngs, n_layers=cfg.n_layers, weights=weights)
    self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=pdt, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Module()
      self.lm_head.kernel = _param(rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"), pdt, cfg.dim ** -0.5)

  @property
  def _zigzag(self) -> bool:
    """Whether a split call's tokens are laid out in zigzag order over `seq` (else contiguous blocks)."""
    return self.sp_mode != "ring-plain"

  # -- attention of one layer -------------------------------------------------------------------
  def _attend(self, q, k, v, step: CallContext, cache_l):
    """q [B,T,N,H], k/v [B,T,K,H] -> o [B,T,N,H]; writes k/v into this layer's pages when caching."""
    be = self.attention
    # The call's rows against the call's own keys, causal: row t sees keys j <= t. Positions the model built are
    # that diagonal by construction; others are handed to the backend, which checks them.
    rows = {} if step.built else dict(q_pos=step.positions, k_start=step.positions[:, 0])
    if cache_l is None:
      if self.mesh is None:
        o, _ = be.attend(q, k, v, **rows, kv_len=step.lengths, q_len=step.lengths, causal=True)
      else:
        o = self._attend_mesh(q, k, v, step, None)
      return o, None
    if self.mesh is not None:
      return self._attend_mesh(q, k, v, step, cache_l)
    # The whole pools [L, P, Z, K, H] come in with the layer index: written in place at (layer, page, offset)
    # and read by `_paged`.
    k_all, v_all, layer, k_scale, v_scale = cache_l
    read_only = step.slots is None
    if not read_only:
      k_all, v_all, k_scale, v_scale = kvc.write_kv(k_all, v_all, k_scale, v_scale, k, v, step.slots, step.pages,
                                                    layer, page_writer=self.page_writer, token_at=step.token_at)
    if step.prefix_len is not None:
      # Chunked prefill: the chunk against itself (a contiguous causal block) merged with the chunk against
      # the cached prefix (every prefix key precedes every query, so kv_len alone masks it; the backends are
      # told so where the model built the positions, and check positions given to it).
      o, lse = be.attend(q, k, v, **rows, kv_len=step.lengths, q_len=step.lengths, causal=True)
      if step.reads_prefix:
        o_pre, lse_pre = self._paged(q, k_all, v_all, k_scale, v_scale, step.page_table, layer,
                                     q_pos=step.positions, kv_len=step.prefix_len, q_len=step.lengths,
                                     past=step.built)
        o, _ = merge(o, lse, o_pre, lse_pre)
    elif q.shape[1] > 1 or read_only:
      # Decode rows of several tokens, or of a call that writes nothing: the cache's keys before the call's first
      # token (which precede all its rows: past=True), merged with the call's own keys as a causal block (whether
      # or not the call wrote them).
      o_pre, lse_pre = self._paged(q, k_all, v_all, k_scale, v_scale, step.page_table, layer,
                                   q_pos=step.positions, kv_len=step.positions[:, 0], past=True)
      o, _ = merge(*rows_block(q, k, v, step.positions, step.lengths), o_pre, lse_pre)
    else:
      o, _ = self._paged(q, k_all, v_all, k_scale, v_scale, step.page_table, layer, q_pos=step.positions,
                         kv_len=step.kv_len)
    return o, None if read_only else (k_all, v_all, k_scale, v_scale)

  def _paged(self, q, k_all, v_all, k_scale, v_scale, page_table, layer, *, q_pos, kv_len, q_len=None, past=False):
    """The backend's `paged` over layer `layer`'s pages of the pools of every layer k_all, v_all [L, P, Z, K, H]
    (fp8 scales [L, P, K] or None), read as `pool_reads` says. "view": the pools as L * P pages (a free reshape)
    where layer `layer`'s page p is page layer * P + p; slicing pool[layer] instead makes XLA copy the layer's
    pool (GiBs at long context) for every kernel call. "layer": the pools as they are, with the layer index.
    q_len [B]: the call's real rows (the rest padding; lcjax.ops.backends); past: every key below kv_len[b]
    precedes b's rows (the backend's promise of lcjax.ops.backends). fp8 pages hold the keys rotated
    (lcjax.cache.kv.fp8_basis), so the queries are rotated alike."""
    be = self.attention
    if k_scale is not None:
      q = kvc.fp8_basis(q)
    if self.pool_reads == "layer":
      return be.paged(q, k_all, v_all, page_table, q_pos=q_pos, kv_len=kv_len, k_scale=k_scale, v_scale=v_scale,
                      layer=layer, q_len=q_len, past=past)
    L, P = k_all.shape[:2]
    k_pool, v_pool = (a.reshape(L * P, *a.shape[2:]) for a in (k_all, v_all))
    ks, vs = (None if s is None else s.reshape(L * P, s.shape[-1]) for s in (k_scale, v_scale))
    return be.paged(q, k_pool, v_pool, page_table, q_pos=q_pos, kv_len=kv_len, k_scale=ks, v_scale=vs,
                    page_offset=layer * P, q_len=q_len, past=past)

  def _attend_mesh(self, q, k, v, step: CallContext, cache_l):
    """The sharded attention of one layer, in one shard_map over ("seq", "tensor"); see the module docstring."""
    mesh, be = self.mesh, self.attention
    S = mesh.shape[SEQ]
    split = step.split
    length = SEQ if split else None
    heads, rows, rep = P(None, length, TENSOR, None), P(None, length), P()
    start = step.positions[:, 0]            # layout slot 0 is the call's first token (zigzag and plain alike)

    def own(q, k, v, pos, start, lengths):
      """The call's queries against the call's own keys (causal)."""
      if split:
        fn = ulysses_attention_shard if self.sp_mode == "ulysses" else ring_attention_shard
        return fn(q, k, v, backend=be, axis_name=SEQ, zigzag=self._zigzag, causal=True, offset=start,
                  kv_len=lengths)
      return be.attend(q, k, v, q_pos=pos, k_start=start, kv_len=lengths, q_len=lengths, causal=True)

    if cache_l is None:
      fn = jax.shard_map(lambda *a: own(*a)[0], mesh=mesh, in_specs=(heads, heads, heads, rows, rep, rep),
                         out_specs=heads, check_vma=False)
      return fn(q, k, v, step.positions, start, step.lengths)

    # Whole pools [L, P, Z, K, H] with the layer index, as without a mesh: locally [L, P/S, Z, K/T, H], read by
    # `_paged` (as L * P/S pages, layer `layer`'s local page p being page layer * P/S + p, or with the layer
    # index); fp8 scales [L, P/S, K/T] alike.
    k_all, v_all, layer, k_scale, v_scale = cache_l
    decode = step.prefix_len is None
    cached = step.kv_len if decode else step.prefix_len     # tokens the paged part reads
    # Decode rows of several tokens (a speculative verify step), as without a mesh: the paged part reads the keys
    # before the call's first token and the call's own tokens are a causal block (`rows_block`). (A shard's local
    # key index is below the key's position, so a causal check in the paged part could not keep a row from the
    # call's later tokens.)
    read_only = step.slots is None
    several = decode and (q.shape[1] > 1 or read_only)
    if several:
      cached = step.positions[:, 0]
    Pl, Z = k_all.shape[1] // S, k_all.shape[2]
    pool = P(None, SEQ, None, TENSOR, None)
    fp8 = () if k_scale is None else (step.pages, k_scale, v_scale)

    def body(q, k, v, pos, slots, start, lengths, cached, table, layer, k_all, v_all, *fp8):
      d = lax.axis_index(SEQ)
      gather = (lambda x: lax.all_gather(x, SEQ, axis=1, tiled=True)) if split else (lambda x: x)
      pages, ks, vs = fp8 if fp8 else (None, None, None)
      if not read_only:
        k_all, v_all, ks, vs = kvc.write_kv(k_all, v_all, ks, vs, gather(k), gather(v), gather(slots), pages,
                                            layer, shard=d, page_writer=self.page_writer)
      out = lambda o: (o,) if read_only else (o, k_all, v_all) + ((ks, vs) if fp8 else ())
      if not decode and not step.reads_prefix:
        return out(own(q, k, v, pos, start, lengths)[0])
      table_l = kvc.shard_table(table, d, S, Pl)
      lens = kvc.shard_lengths(cached, d, S, table_l.shape[1], Z)
      # Every prefix key precedes every query, so kv_len alone masks the paged part (as without a mesh); local
      # key indices never exceed the keys' true positions, so a backend's causal check cannot cut a valid key.
      q_all, pos_all = gather(q), gather(pos)
      if not decode:
        # A chunk's padding rows (at or past lengths; in layout order, which q_len cannot describe) are zeros, so
        # an FP8 backend's Q block scales are its real rows' alone.
        real = pos_all - start[:, None] < lengths[:, None]
        q_all = jnp.where(real[:, :, None, None], q_all, 0)
      o, lse = self._paged(q_all, k_all, v_all, ks, vs, table_l, layer, q_pos=pos_all, kv_len=lens,
                           past=step.built or several)
      if S > 1:
        o, lse = combine_seq_partials(o, lse, SEQ, scatter_axis=1 if split else None)
      if several:
        o, _ = merge(*rows_block(q, k, v, pos, lengths), o, lse)
      elif not decode:
        o, _ = merge(*own(q, k, v, pos, start, lengths), o, lse)
      return out(o)

    scale = P(None, SEQ, TENSOR)
    pools_out = () if read_only else (pool, pool) + ((scale, scale) if fp8 else ())
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(heads, heads, heads, rows, rows, rep, rep, rep, rep, rep, pool, pool,
                                 *((rep, scale, scale) if fp8 else ())),
                       out_specs=(heads, *pools_out), check_vma=False)
    slots = step.positions if read_only else step.slots     # (read_only: a placeholder the body does not read)
    o, *parts = fn(q, k, v, step.positions, slots, start, step.lengths, cached, step.page_table, layer, k_all, v_all,
                   *fp8)
    if read_only:
      return o, None
    k_all, v_all, *scales = parts
    return o, (k_all, v_all, *(scales or (None, None)))

  def _constrain(self, x, axes):
    return x if self.mesh is None else constrain(x, axes, self.mesh)

  def _layer(self, block: Block, x, step: CallContext, cache_l, gemv=None):
    """-> (x, the layer's new cache part, the call's (k, v) [B, T, K, H] of this layer)."""
    h = block.attn_norm(x)
    path = step.linear_path
    q, k, v = block.attn.qkv(h, step.rope, gemv, path)
    o, new_cache_l = self._attend(q, k, v, step, cache_l)
    x = self._constrain(x + block.attn.out(o, gemv, path), self._x_axes(step))
    x = self._constrain(x + block.mlp(block.mlp_norm(x), gemv, path), self._x_axes(step))
    return x, new_cache_l, (k, v)

  def holds_weights(self, rows: int) -> bool:
    """Whether a call of `rows` rows (batch x tokens) runs its fp8 products through the GEMV kernel: the layer
    scan then holds the fp8 weights and scales whole, and the kernel reads layer i's slice in place."""
    return self.weights.fp8 and self.gemv_kernel is not None and rows <= WIDEN_MAX_ROWS

  def _gemv(self, layer, split: bool = False):
    """The product `_apply` runs for layer `layer` over the whole stacked fp8 weights (on a mesh: `_gemv_mesh`,
    the call's tokens split over `seq` when `split`)."""
    if self.mesh is not None:
      return functools.partial(self._gemv_mesh, layer, split)
    return lambda x, w8, scale, spec, axes: self.gemv_kernel(x, w8, scale, layer, spec)

  def _gemv_mesh(self, layer, split: bool, x, w8, scale, spec: str, axes):
    """The GEMV kernel's product on the mesh, in one shard_map over ("seq", "tensor") in which each device runs the
    kernel on its own slices. The stacked weight and its scale come in as their logical `axes` shard them; x's
    rows as the call's tokens lie (split over `seq`, or replicated: a decode call's few tokens) and x's
    contracted channels as the weight's. Output channels sharded on `tensor` (wqkv by KV heads, w_gate_up by
    MLP channels) give the output sharded alike; contracted channels sharded on `tensor` (wo by heads, w_down by
    MLP channels) give each device a partial product of its input and weight slices, summed in float32 by a psum
    over `tensor`."""
    w_axes, s_axes = axes
    xs, ws, out = contracted(kmajor_spec(spec))
    w_spec = sh.spec(w_axes)
    if len(w_spec) != len(ws) + 1:
      raise ValueError(f"einsum {spec!r}: a stacked weight with logical axes {tuple(w_axes)} is not [L, {ws}]")
    on = dict(zip(ws, tuple(w_spec)[1:]))                    # weight label -> mesh axis (the leading L is whole)
    rows = [c for c in xs if c not in ws]                    # x's batch and token labels
    on.update(zip(rows, sh.spec(self._row_axes(split))))
    x_spec, out_spec = P(*(on[c] for c in xs)), P(*(on[c] for c in out))
    summed = tuple(dict.fromkeys(on[c] for c in xs if c in ws and c not in out and on[c] is not None))
    kernel = self.gemv_kernel

    def body(layer, x, w8, scale):
      if not summed:
        return kernel(x, w8, scale, layer, spec)
      return lax.psum(kernel(x, w8, scale, layer, spec, dtype=jnp.float32), summed).astype(x.dtype)

    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), x_spec, w_spec, sh.spec(s_axes)), out_specs=out_spec,
                       check_vma=False)
    return fn(layer, x, w8, scale)

  def _split_layers(self, rows: int):
    """(graphdef, the layer state the scan slices, the state it holds whole) of the stacked layers."""
    if not self.holds_weights(rows):
      graphdef, scanned = nnx.split(self.layers)
      return graphdef, scanned, None
    return nnx.split(self.layers, lambda path, _: str(path[-1]) not in _HELD, ...)

  @staticmethod
  def _row_axes(split: bool):
    """The logical axes of the batch and token dimensions of a call's activations."""
    return ("batch", "length" if split else None)

  @staticmethod
  def _x_axes(step: CallContext):
    return (*Llama._row_axes(step.split), "embed")

  # -- forward -----------------------------------------------------------------------------------
  def __call__(self, tokens, positions=None, *, cache: kvc.PagedKV | None = None, slots=None,
               page_table=None, prefix_len=None, kv_len=None, lengths=None, logits_at=None, kv_out: bool = False):
    """-> (logits, cache); with kv_out=True (a call with a cache, outside a split layout) (logits, cache, (k, v)):
    every layer's K and V of the call's tokens, [L, B, T, K, H] each, as the cache write received them."""
    B, T = tokens.shape
    built = positions is None
    if built:
      start = jnp.zeros((B, 1), jnp.int32) if prefix_len is None else jnp.reshape(prefix_len, (-1, 1))
      positions = jnp.broadcast_to(start.astype(jnp.int32), (B, 1)) + jnp.arange(T, dtype=jnp.int32)
    positions = positions.astype(jnp.int32)
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths
    seq = 1 if self.mesh is None else self.mesh.shape[SEQ]
    split = seq > 1 and kv_len is None
    if kv_out and (cache is None or split):
      raise ValueError("kv_out=True needs a call with a cache whose tokens are not split over seq (a decode call)")
    # The pages an fp8 cache's writes requantize, found in the call's own token order (before any permutation).
    pages = (None if cache is None or not cache.quantized or slots is None
             else kvc.written_pages(slots, cache.page_size))
    if split:
      # Pad to whole zigzag chunks (padding: token 0 at the following positions, slot 0: the null page, whose
      # writes are dropped; masked by `lengths`) and permute into the layout; `inv` maps a natural index to its
      # layout slot.
      Tp = zigzag_length(T, seq)
      if Tp > T:
        tokens = jnp.pad(tokens, ((0, 0), (0, Tp - T)))
        positions = jnp.concatenate([positions, positions[:, -1:] + 1 + jnp.arange(Tp - T, dtype=jnp.int32)], 1)
        slots = None if slots is None else jnp.pad(slots, ((0, 0), (0, Tp - T)))
      order = zigzag_order(Tp, seq) if self._zigzag else np.arange(Tp)
      inv = jnp.asarray(np.argsort(order), jnp.int32)
      tokens, positions = tokens[:, order], positions[:, order]
      slots = None if slots is None else slots[:, order]
      logits_at = None if logits_at is None else inv[logits_at]
    # Where the page-write kernel puts a decode step's token in unsharded pools: computed once here, so that the
    # layer scan does not recompute it for every layer.
    token_at = (kvc.token_page_offset(slots, cache.page_size, cache.k.shape[1])
                if cache is not None and slots is not None and self.mesh is None
                and kvc.writes_token_by_kernel(self.page_writer, cache.k_scale, slots) else None)
    step = CallContext(positions, lengths, slots, page_table, prefix_len, kv_len,
                       rope=rope_angles(positions, _inv_freq(self.cfg)), pages=pages, split=split, token_at=token_at,
                       built=built, linear_path=path_for_rows(B * T))
    x = self.embed.embedding[...][tokens].astype(self.dtype)     # [B, T, D]
    x = self._constrain(x, self._x_axes(step))

    graphdef, layer_state, held = self._split_layers(B * T)

    def block_and_gemv(layer_params, i):
      if held is None:
        return nnx.merge(graphdef, layer_params), None
      return nnx.merge(graphdef, layer_params, held), self._gemv(i, split)

    layer_ids = jnp.arange(self.cfg.n_layers)
    if cache is None:
      def body(x, xs):
        block, gemv = block_and_gemv(*xs)
        x, _, _ = self._layer(block, x, step, None, gemv)
        return x, None
      x, _ = jax.lax.scan(body, x, (layer_state, layer_ids))
    elif slots is None:
      # A call that writes nothing: every layer reads the pools as they came in.
      pools = (cache.k, cache.v, cache.k_scale, cache.v_scale)

      def body(x, xs):
        layer_params, i = xs
        block, gemv = block_and_gemv(layer_params, i)
        x, _, kv = self._layer(block, x, step, (*pools[:2], i, *pools[2:]), gemv)
        return x, kv if kv_out else None
      x, new_kv = jax.lax.scan(body, x, (layer_state, layer_ids))
    else:
      pool_dtype = cache.k.dtype

      def body(carry, xs):
        x, c = carry
        layer_params, i = xs
        block, gemv = block_and_gemv(layer_params, i)
        c = kvc.from_carry(c, pool_dtype)
        x, parts, kv = self._layer(block, x, step, (c.k, c.v, i, c.k_scale, c.v_scale), gemv)
        return (x, kvc.as_carry(kvc.PagedKV(*parts))), kv if kv_out else None
      (x, carried), new_kv = jax.lax.scan(body, (x, kvc.as_carry(cache)), (layer_state, layer_ids))
      c = kvc.from_carry(carried, pool_dtype)
      k_all, v_all = (self._constrain(a, kvc.POOL_AXES) for a in (c.k, c.v))
      k_scale, v_scale = (None if a is None else self._constrain(a, kvc.SCALE_AXES) for a in (c.k_scale, c.v_scale))
      cache = kvc.PagedKV(k_all, v_all, k_scale, v_scale)

    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)   # [B, 1, D]
    x = self.final_norm(x)
    head = self.embed.embedding[...].T if self.cfg.tie_embeddings else self.lm_head.kernel[...]
    # Logits in the activation dtype, as HF computes them (the GEMM accumulates in float32 either way), then
    # float32 for sampling. A float32-output dot over a bf16 head made XLA's cuBLAS path convert the whole head
    # (1 GiB for Llama-3-8B) to float32 on every decode step: 1.26 of 10.7 ms per token at 128K
    # (benchmarks/NOTES-longctx.md).
    logits = jnp.einsum("btd,dv->btv", x, head).astype(jnp.float32)
    if split and logits_at is None:
      logits = logits[:, inv[:T]]
    return (logits, cache, new_kv) if kv_out else (logits, cache)
