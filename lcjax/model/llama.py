"""LLaMA in Flax NNX: embedding, RMSNorm, rotary GQA attention, SwiGLU MLP, tied or untied head.

Layer weights are stacked on a leading `layers` axis and the forward pass scans over them, so an 80-layer model
compiles as fast as a 1-layer one. Every parameter carries its logical axis names (metadata `axes`); the mesh
code turns them into shardings. Attention goes through a backend object with the `(out, lse)` contract
(`lcjax.ops`), chosen once outside the model.

Call forms (B batch, T tokens in this call):
  logits, _ = model(tokens, positions)                          full causal forward over `tokens` alone
  logits, cache = model(tokens, positions, cache=..., slots=..., page_table=..., prefix_len=...)
      chunked prefill: the chunk's K/V are written to the paged cache at `slots`, the chunk attends to the
      cached prefix (`prefix_len` tokens, through the page table) and to itself, merged through (out, lse).
  logits, cache = model(tokens, positions, cache=..., slots=..., page_table=..., kv_len=...)
      decode: K/V written first, then the queries attend to `kv_len` cached tokens through the page table.
`lengths [B]` marks how many of the T tokens are real (the rest is padding); `logits_at [B]` keeps only the
logits of one position per sequence (prefill needs just the last one). `return_kv_absmax=True` (no cache)
returns the per-layer, per-kv-head max |k| and |v| [L, 2, K] instead of logits: fp8 cache calibration.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lcjax.cache import kv as kvc
from lcjax.config import ModelConfig
from lcjax.model.rope import apply_rope, inv_frequencies
from lcjax.ops.attention import merge
from lcjax.ops.backends import ReferenceBackend


@functools.lru_cache(maxsize=None)
def _inv_freq(cfg: ModelConfig):
  return inv_frequencies(cfg)


def _param(rngs, shape, axes, dtype, std, n_layers=None):
  if n_layers is not None:
    shape, axes = (n_layers, *shape), ("layers", *axes)
  if std is None:
    value = jnp.ones(shape, dtype)
  else:
    value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
  return nnx.Param(value, axes=axes)


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
  """Grouped-query attention. Projections are [D, heads, H] so heads shard on `tensor` without reshapes."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs, n_layers=None):
    D, N, K, H = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    std = D ** -0.5
    self.wq = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), dtype, std, n_layers)
    self.wk = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), dtype, std, n_layers)
    self.wv = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), dtype, std, n_layers)
    self.wo = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), dtype, (N * H) ** -0.5, n_layers)

  def qkv(self, x, positions, inv_freq):
    q = jnp.einsum("btd,dnh->btnh", x, self.wq[...])            # [B, T, N, H]
    k = jnp.einsum("btd,dkh->btkh", x, self.wk[...])            # [B, T, K, H]
    v = jnp.einsum("btd,dkh->btkh", x, self.wv[...])
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

  def out(self, o):
    return jnp.einsum("btnh,nhd->btd", o, self.wo[...])


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, rngs, n_layers=None):
    D, F = cfg.dim, cfg.ffn_dim
    self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), dtype, D ** -0.5, n_layers)
    self.w_up = _param(rngs, (D, F), ("embed", "mlp"), dtype, D ** -0.5, n_layers)
    self.w_down = _param(rngs, (F, D), ("mlp", "embed"), dtype, F ** -0.5, n_layers)

  def __call__(self, x):
    g = jnp.einsum("btd,df->btf", x, self.w_gate[...])
    u = jnp.einsum("btd,df->btf", x, self.w_up[...])
    return jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, self.w_down[...])


class Block(nnx.Module):
  """One decoder layer. Built with `n_layers` set, its parameters are stacked [L, ...]."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs, n_layers=None):
    self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype, rngs=rngs, n_layers=n_layers)
    self.attn = Attention(cfg, dtype=dtype, rngs=rngs, n_layers=n_layers)
    self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype, rngs=rngs, n_layers=n_layers)
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, n_layers=n_layers)


@dataclasses.dataclass(frozen=True)
class _Step:
  """Per-call static and traced context shared by every layer."""
  positions: jax.Array            # [B, T]
  lengths: jax.Array              # [B] real tokens in this call
  slots: jax.Array | None         # [B, T] cache slots (padding -> null page)
  page_table: jax.Array | None    # [B, M]
  prefix_len: jax.Array | None    # [B] cached tokens before this chunk (prefill)
  kv_len: jax.Array | None        # [B] cached tokens including this call's (decode)


class Llama(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, param_dtype=None, attention=None,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    pdt = jnp.dtype(param_dtype or dtype)
    self.attention = attention or ReferenceBackend()
    self.embed = nnx.Module()
    self.embed.embedding = _param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", "embed"), pdt, 1.0)
    self.layers = Block(cfg, dtype=pdt, rngs=rngs, n_layers=cfg.n_layers)
    self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=pdt, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Module()
      self.lm_head.kernel = _param(rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"), pdt, cfg.dim ** -0.5)

  # -- attention of one layer -------------------------------------------------------------------
  def _attend(self, q, k, v, step: _Step, cache_l):
    """q [B,T,N,H], k/v [B,T,K,H] -> o [B,T,N,H]; writes k/v into this layer's pages when caching."""
    be = self.attention
    start = step.positions[:, 0]
    if cache_l is None:
      o, _ = be.attend(q, k, v, q_pos=step.positions, k_start=start, kv_len=step.lengths, causal=True)
      # Per kv head |k| and |v| maxima: what an fp8 cache's scales are calibrated from.
      absmax = jnp.stack([jnp.abs(k).max(axis=(0, 1, 3)), jnp.abs(v).max(axis=(0, 1, 3))]).astype(jnp.float32)
      return o, absmax
    k_pool, v_pool, k_scale, v_scale = cache_l
    k_pool = kvc.write_layer(k_pool, kvc.quantize(k, k_scale), step.slots)
    v_pool = kvc.write_layer(v_pool, kvc.quantize(v, v_scale), step.slots)
    P = k_pool.shape[0]
    ks = None if k_scale is None else jnp.broadcast_to(k_scale, (P, k_scale.shape[-1]))
    vs = None if v_scale is None else jnp.broadcast_to(v_scale, (P, v_scale.shape[-1]))
    if step.prefix_len is not None:
      # Chunked prefill: the chunk against itself (a contiguous causal block) merged with the chunk against
      # the cached prefix (every prefix key precedes every query, so kv_len alone masks it).
      o_self, lse_self = be.attend(q, k, v, q_pos=step.positions, k_start=start, kv_len=step.lengths,
                                   causal=True)
      o_pre, lse_pre = be.paged(q, k_pool, v_pool, step.page_table, q_pos=step.positions,
                                kv_len=step.prefix_len, k_scale=ks, v_scale=vs)
      o, _ = merge(o_self, lse_self, o_pre, lse_pre)
    else:
      o, _ = be.paged(q, k_pool, v_pool, step.page_table, q_pos=step.positions, kv_len=step.kv_len,
                      k_scale=ks, v_scale=vs)
    return o, (k_pool, v_pool)

  def _layer(self, block: Block, x, step: _Step, cache_l):
    h = block.attn_norm(x)
    q, k, v = block.attn.qkv(h, step.positions, _inv_freq(self.cfg))
    o, new_cache_l = self._attend(q, k, v, step, cache_l)
    x = x + block.attn.out(o)
    x = x + block.mlp(block.mlp_norm(x))
    return x, new_cache_l

  # -- forward -----------------------------------------------------------------------------------
  def __call__(self, tokens, positions=None, *, cache: kvc.PagedKV | None = None, slots=None,
               page_table=None, prefix_len=None, kv_len=None, lengths=None, logits_at=None,
               return_kv_absmax=False):
    B, T = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths
    step = _Step(positions.astype(jnp.int32), lengths, slots, page_table, prefix_len, kv_len)
    x = self.embed.embedding[...][tokens].astype(self.dtype)     # [B, T, D]

    graphdef, layer_state = nnx.split(self.layers)

    if cache is None:
      def body(x, layer_params):
        x, kv_absmax = self._layer(nnx.merge(graphdef, layer_params), x, step, None)
        return x, kv_absmax
      x, kv_absmax = jax.lax.scan(body, x, layer_state)
      if return_kv_absmax:
        return kv_absmax
    else:
      def body(carry, xs):
        x, k_all, v_all = carry
        layer_params, i = xs
        scales = (None, None) if cache.k_scale is None else (cache.k_scale[i], cache.v_scale[i])
        x, (k_l, v_l) = self._layer(nnx.merge(graphdef, layer_params), x, step, (k_all[i], v_all[i], *scales))
        return (x, k_all.at[i].set(k_l), v_all.at[i].set(v_l)), None
      (x, k_all, v_all), _ = jax.lax.scan(body, (x, cache.k, cache.v),
                                          (layer_state, jnp.arange(self.cfg.n_layers)))
      cache = dataclasses.replace(cache, k=k_all, v=v_all)

    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)   # [B, 1, D]
    x = self.final_norm(x)
    head = self.embed.embedding[...].T if self.cfg.tie_embeddings else self.lm_head.kernel[...]
    logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    return logits, cache
