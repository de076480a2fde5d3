"""The jitted device steps: a full forward, a prefill chunk, and the on-device decode loop.

Each is a pure function of (params, cache, inputs); the model's graph definition is closed over, so one Engine
compiles each step once per shape bucket. The cache is donated through every step, so its pools are updated in
place and never copied.

On a mesh the cache keeps its sharding through every step (explicit out_shardings), and whatever the host reads
(logits, sampled tokens, decode state) comes back replicated: small arrays, and in a multi-process run every
process can read them (an array spread over other processes' devices cannot be fetched).
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lcjax.cache import kv as kvc
from lcjax.engine import speculate
from lcjax.engine.sampling import sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  """Per batch slot: the token to feed next and where it goes."""
  tokens: jax.Array      # [B] int32, last sampled token (fed at `pos`)
  pos: jax.Array         # [B] int32, its position
  done: jax.Array        # [B] bool
  remaining: jax.Array   # [B] int32, tokens still allowed


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftCounts:
  """Per batch slot, over one speculative decode call: model calls it took part in, drafts proposed to it and
  drafts accepted (each [B] int32; the tokens it gained are the call's output)."""
  steps: jax.Array
  proposed: jax.Array
  accepted: jax.Array


def decode_compiler_options() -> dict | None:
  """XLA options for the decode loop on GPUs (None: XLA's defaults).

  The layer scan reads layer l's weights as a dynamic slice of the stacked [L, ...] arrays. XLA's Triton GEMM
  fusions cannot read such a slice in place: with them each decode step copies 5 of the 7 weight matrices of every
  layer before multiplying (160 memcpys, 6.6 of 13.0 ms of a Llama-3-8B token at 32K on the H200). cuBLAS with
  dynamic-slice fusion reads the slice where it lies (benchmarks/NOTES-longctx.md). Prefill keeps XLA's
  defaults: a chunk's GEMMs are compute-bound and one copy per layer is noise there. LCJAX_DECODE_XLA_DEFAULTS=1,
  set before an Engine is made (its steps are built then), compiles decode with XLA's defaults too (e.g. to rule
  these options out when chasing a numerical problem).
  """
  if jax.default_backend() != "gpu" or os.environ.get("LCJAX_DECODE_XLA_DEFAULTS") == "1":
    return None
  return {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}


def fp8_weight_compiler_options() -> dict | None:
  """XLA options for the prefill and forward steps of a model with fp8 weights on GPUs: no Triton GEMM fusions.
  XLA's Triton GEMM autotuner profiled the fp8 products of the layer scan on buffers of the whole stacked weight
  (35 GiB for Llama-3.1-70B's w_gate_up) and failed with an out-of-memory error beside the 68 GiB model; cuBLASLt
  runs the fp8 x fp8 products, and its autotuning allocates one layer's operands."""
  if jax.default_backend() != "gpu":
    return None
  return {"xla_gpu_enable_triton_gemm": False}


# A decode loop's output token where a slot's logits held NaN or inf: the slot stops there (its tokens would not be
# the model's); -1 is a step in which a slot produced nothing.
NONFINITE = -2


def finite(logits):
  """Whether each row of logits [..., V] is all finite [...]: a row that is not stops its sequence (NONFINITE)."""
  return jnp.all(jnp.isfinite(logits), axis=-1)


def sample_first(logits, sp, pos):
  """The prompt's first token from its last logits [B, V] (`sample`), NONFINITE where they are not all finite."""
  return jnp.where(finite(logits), sample(logits, sp, pos), NONFINITE)


class Steps:
  def __init__(self, graphdef, page_size: int, mesh=None, cache_shardings=None, sync_every: int = 1,
               fp8_weights: bool = False):
    """mesh, cache_shardings: the engine's mesh and the PagedKV of its pools' shardings (None: one device).
    sync_every: decode steps between host checks of the loop condition (RunConfig.decode_sync_every).
    fp8_weights: the model's linear weights are fp8 (fp8_weight_compiler_options)."""
    self.graphdef = graphdef
    self.page_size = page_size
    self.sync_every = sync_every
    rep = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    host = {} if mesh is None else dict(out_shardings=rep)
    opts = dict(compiler_options=fp8_weight_compiler_options()) if fp8_weights else {}
    self.forward = jax.jit(self._forward, **host, **opts)
    self.prefill = jax.jit(self._prefill, donate_argnames=("cache",), **opts,
                           **({} if mesh is None else dict(out_shardings=(rep, cache_shardings))))
    self.decode = jax.jit(self._decode, donate_argnames=("cache",), static_argnames=("steps", "greedy"),
                          compiler_options=decode_compiler_options(),
                          **({} if mesh is None else dict(out_shardings=(rep, rep, cache_shardings))))
    self.decode_spec = jax.jit(self._decode_spec, donate_argnames=("cache",),
                               static_argnames=("steps", "greedy", "ngram", "k"),
                               compiler_options=decode_compiler_options(),
                               **({} if mesh is None else dict(out_shardings=(rep, rep, cache_shardings, rep))))
    self.spec_once = jax.jit(self._spec_once, donate_argnames=("cache",), static_argnames=("greedy",),
                             compiler_options=decode_compiler_options(),
                             **({} if mesh is None else dict(out_shardings=(rep, rep, cache_shardings))))
    self.first_token = jax.jit(sample_first, **host)
    self.copy_pages = jax.jit(kvc.copy_pages, donate_argnums=0,
                              **({} if mesh is None else dict(out_shardings=cache_shardings)))
    self.gather_pages = jax.jit(kvc.gather_pages, **({} if mesh is None else dict(out_shardings=rep)))
    self.scatter_pages = jax.jit(kvc.scatter_pages, donate_argnums=0,
                                 **({} if mesh is None else dict(out_shardings=cache_shardings)))
    self.zero_pages = jax.jit(kvc.zero_pages, donate_argnums=0,
                              **({} if mesh is None else dict(out_shardings=cache_shardings)))

  def _model(self, params):
    return nnx.merge(self.graphdef, params)

  def _forward(self, params, tokens):
    logits, _ = self._model(params)(tokens)
    return logits

  def _prefill(self, params, cache, tokens, slots, page_table, prefix_len, lengths):
    """One chunk [B, C] of one or more prompts, row t of sequence b at position prefix_len[b] + t. Returns the
    logits of each row's last real token [B, V]."""
    logits, cache = self._model(params)(tokens, cache=cache, slots=slots, page_table=page_table,
                                        prefix_len=prefix_len, lengths=lengths, logits_at=lengths - 1)
    return logits[:, 0], cache

  def _decode(self, params, cache, state: DecodeState, sp, page_table, eos_ids, *, steps: int,
              greedy: bool = False):
    """Up to `steps` tokens for every live slot, stopping early when all are done. Returns tokens [B, steps]
    (-1 where a slot produced nothing; NONFINITE where its logits were not finite, and it stopped), the new state
    and the cache. greedy: every slot samples greedily (sampling.all_greedy; a second compiled loop, without the
    vocabulary sort)."""
    model = self._model(params)
    B = state.tokens.shape[0]
    Z = self.page_size
    group = sync_group(steps, self.sync_every)

    pool_dtype = cache.k.dtype

    def one(c):
      i, st, cache, out = c
      page = jnp.take_along_axis(page_table, (st.pos // Z)[:, None], axis=1)[:, 0]
      slot = jnp.where(st.done, 0, page * Z + st.pos % Z)                    # done slots: the null page (dropped)
      logits, cache = model(st.tokens[:, None], st.pos[:, None], cache=kvc.from_carry(cache, pool_dtype),
                            slots=slot[:, None], page_table=page_table, kv_len=st.pos + 1)
      cache = kvc.as_carry(cache)
      nxt = sample(logits[:, 0], sp, st.pos + 1, greedy)
      live = ~st.done
      bad = live & ~finite(logits[:, 0])
      ok = live & ~bad
      out = out.at[:, i].set(jnp.where(ok, nxt, jnp.where(bad, NONFINITE, -1)))
      remaining = st.remaining - ok.astype(jnp.int32)
      is_eos = jnp.any(nxt[:, None] == eos_ids[None, :], axis=-1)
      done = st.done | bad | (ok & is_eos) | (remaining <= 0)
      st = DecodeState(jnp.where(ok, nxt, st.tokens), jnp.where(ok, st.pos + 1, st.pos), done, remaining)
      return i + 1, st, cache, out

    def cond(c):
      i, st, _, _ = c
      return (i < steps) & ~jnp.all(st.done)

    def body(c):
      # `group` steps per test of the loop condition: the test is a device-to-host copy that stalls the GPU
      # (~0.1 ms a token at batch 1, benchmarks/NOTES-longctx.md). Steps after every slot is done
      # within a group run on the null page and emit -1, as done slots always have: wasted, so grouping pays
      # only for long generations (hence RunConfig.decode_sync_every defaults to 1).
      return jax.lax.fori_loop(0, group, lambda _, c: one(c), c) if group > 1 else one(c)

    out = jnp.full((B, steps), -1, jnp.int32)
    _, state, cache, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state, kvc.as_carry(cache), out))
    return out, state, kvc.from_carry(cache, pool_dtype)

  def _spec_step(self, model, cache, st: DecodeState, room, drafts, count, sp, page_table, eos_ids, greedy: bool):
    """One model call of speculative decoding: every slot with room > 0 feeds its last token and its first
    count [B] of drafts [B, k] as k + 1 rows (a slot without drafts gains one token, as from a plain step). room
    [B]: tokens the slot may still gain (0: none). Returns (tokens [B, k + 1], n [B] kept of them, whether the
    n-th ends the sequence [B], drafts accepted [B], whether a kept row's logits were not finite [B] (then n counts
    the rows before the first such row), cache).

    The call writes nothing into the cache: its rows attend to the cache's keys before them and to each other
    (lcjax.model.llama.rows_block), and the kept rows' K/V (the fed token and the accepted drafts before the last
    kept token) are then written one token after another, as decode steps write them (kvc.write_tokens). Rejected
    drafts leave no trace, fp8 page scales included. A step in which no slot has a draft runs one row a slot (a
    conditional that only reads the cache: the writes come after it), so drafts that never match cost little."""
    B, k = drafts.shape
    Z, M = self.page_size, page_table.shape[1]
    rows = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    positions = st.pos[:, None] + rows                                      # [B, k + 1]
    fed = jnp.concatenate([st.tokens[:, None], drafts], axis=1)
    page = jnp.take_along_axis(page_table, jnp.clip(positions // Z, 0, M - 1), axis=1)
    lengths = jnp.where(room > 0, count + 1, 1)

    def verify(T):
      """The model call over the first T of the k + 1 rows (reading the cache, writing nothing): logits
      [B, k + 1, V] and every layer's K, V [L, B, k + 1, K, H], rows past T zero."""
      def call():
        logits, _, kv = model(fed[:, :T], positions[:, :T], cache=cache, page_table=page_table,
                              kv_len=st.pos + 1 + count, lengths=jnp.minimum(lengths, T), kv_out=True)
        pad = lambda x, axis: jnp.pad(x, [(0, k + 1 - T if a == axis else 0) for a in range(x.ndim)])
        return pad(logits, 1), *(pad(x, 2) for x in kv)
      return call

    logits, k_new, v_new = jax.lax.cond(jnp.any(count > 0), verify(k + 1), verify(1))
    tokens, n, accepted = speculate.accept(logits, drafts, count, sp, st.pos, greedy=greedy)
    n = jnp.minimum(n, room)
    is_eos = jnp.any(tokens[:, :, None] == eos_ids[None, None, :], axis=-1) & (rows < n[:, None])
    eos = jnp.any(is_eos, axis=1)
    n = jnp.where(eos, jnp.argmax(is_eos, axis=1) + 1, n)                  # nothing after an end-of-sequence token
    # A kept row whose logits are not finite ends the slot there, as a decode step would: the tokens of the rows
    # before it are kept, then the slot stops (NONFINITE after them).
    nonfinite = ~finite(logits) & (rows < n[:, None])                       # [B, k + 1]
    bad = jnp.any(nonfinite, axis=1)
    n, eos = jnp.where(bad, jnp.argmax(nonfinite, axis=1), n), eos & ~bad
    kept = jnp.where(rows < n[:, None], page * Z + positions % Z, 0)        # the fed tokens of the n kept: rows < n
    return tokens, n, eos, accepted, bad, kvc.write_tokens(cache, k_new, v_new, kept)

  def _spec_once(self, params, cache, state: DecodeState, sp, page_table, eos_ids, drafts, count, *,
                 greedy: bool = True):
    """One `_spec_step` with the given drafts, every slot that is not done taking part (tools/bench_speculation.py
    times it beside `decode` of one step). Returns (tokens, n, cache)."""
    room = jnp.where(state.done, 0, state.remaining)
    count = jnp.clip(jnp.minimum(count, room - 1), 0, drafts.shape[1])
    tokens, n, _, _, _, cache = self._spec_step(self._model(params), cache, state, room, drafts, count, sp,
                                                page_table, eos_ids, greedy)
    return tokens, n, cache

  def _decode_spec(self, params, cache, state: DecodeState, sp, page_table, eos_ids, history, *, steps: int,
                   greedy: bool, ngram: int, k: int):
    """`_decode` with prompt-lookup speculation (lcjax.engine.speculate): each model call (`_spec_step`) feeds
    every live slot's last token and up to k drafts found in its `history` [B, W] (the token at each position; the
    slot's fed token at `pos`) and gains 1 to k + 1 tokens. Up to `steps` tokens per slot. Returns (tokens
    [B, steps] (-1 past a slot's last; NONFINITE where its logits were not finite, and it stopped), the new state,
    the cache, DraftCounts)."""
    model = self._model(params)
    B, W = history.shape
    rows = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

    pool_dtype = cache.k.dtype

    def one(c):
      i, st, cache, out, n_out, history, counts = c
      cache = kvc.from_carry(cache, pool_dtype)
      active = ~st.done & (n_out < steps)
      room = jnp.where(active, jnp.minimum(st.remaining, steps - n_out), 0)  # tokens the slot may still gain
      drafts, count = speculate.find_drafts(history, st.pos + 1, ngram=ngram, k=k)
      count = jnp.clip(jnp.minimum(count, room - 1), 0, k)
      tokens, n, eos, accepted, bad, cache = self._spec_step(model, cache, st, room, drafts, count, sp, page_table,
                                                             eos_ids, greedy)
      keep = rows < n[:, None]
      out = out.at[jnp.arange(B)[:, None], jnp.where(keep, n_out[:, None] + rows, steps)].set(tokens, mode="drop")
      out = out.at[jnp.arange(B), jnp.where(bad, n_out + n, steps)].set(NONFINITE, mode="drop")
      history = history.at[jnp.arange(B)[:, None], jnp.where(keep, st.pos[:, None] + 1 + rows, W)].set(
          tokens, mode="drop")
      last = jnp.take_along_axis(tokens, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
      remaining = st.remaining - n
      done = st.done | bad | (active & (eos | (remaining <= 0)))
      st = DecodeState(jnp.where(n > 0, last, st.tokens), st.pos + n, done, remaining)
      counts = DraftCounts(counts.steps + active, counts.proposed + count, counts.accepted + jnp.minimum(accepted, n))
      return i + 1, st, kvc.as_carry(cache), out, n_out + n, history, counts

    def cond(c):
      i, st, _, _, n_out, _, _ = c
      return (i < steps) & jnp.any(~st.done & (n_out < steps))

    group = sync_group(steps, self.sync_every)

    def body(c):
      return jax.lax.fori_loop(0, group, lambda _, c: one(c), c) if group > 1 else one(c)

    zeros = jnp.zeros(B, jnp.int32)
    out = jnp.full((B, steps), -1, jnp.int32)
    carry = (jnp.int32(0), state, kvc.as_carry(cache), out, zeros, history, DraftCounts(zeros, zeros, zeros))
    _, state, cache, out, _, _, counts = jax.lax.while_loop(cond, body, carry)
    return out, state, kvc.from_carry(cache, pool_dtype), counts


def sync_group(steps: int, most: int) -> int:
  """Decode steps run between two host checks of `done`: the largest divisor of `steps` up to `most`, so a call
  never runs past `steps`."""
  return max(d for d in range(1, min(most, steps) + 1) if steps % d == 0)
