"""Prompt-lookup speculative decoding: drafts from the sequence's own tokens, verified k + 1 rows at a time.

A decode step feeds one token and reads every weight and the whole cached prefix to get the next one. Answers
about a document quote it, so the tokens that followed the sequence's last n tokens where those n tokens occurred
before (in the document, the question or the answer so far) are likely to follow again. `find_drafts` proposes up
to k of them; the verify step feeds the last token and the drafts as k + 1 rows of one decode-form call (each row
attends to the cache and to the rows before it), and `accept` keeps the longest run of drafts the model agrees
with plus one token of the model's own: 1 to k + 1 tokens for one pass over the weights and the cache.

Greedy rows accept a draft iff it is the argmax, so their tokens are plain greedy decoding's. Sampled rows take the
speculative-sampling rule for a draft distribution that is one token (probability 1): accept draft d with
probability p(d), and on rejection draw from p with d removed, renormalised. Every token then has p's
distribution. The token drawn at a position uses the key plain sampling uses there (`sampling.token_key`), so a
step with no drafts samples exactly what plain decoding samples; acceptance tests draw from another stream.

Legend: B batch rows, W history length (positions), k drafts per step, T = k + 1 rows fed, V vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lcjax.engine.sampling import filtered_logits, token_key


def find_drafts(history, length, *, ngram: int, k: int):
  """history [B, W] int32 (token at each position; past `length` anything), length [B] (tokens held; the last one,
  at length - 1, is the one fed next) -> (drafts [B, k] int32, count [B] int32).

  A row's drafts are the up to k tokens that followed the most recent earlier occurrence of its last `ngram`
  tokens; count 0 where they did not occur before (or the row holds fewer than ngram + 1 tokens)."""
  B, W = history.shape
  j = jnp.arange(W, dtype=jnp.int32)[None, :]                     # candidate first draft position
  match = (j >= ngram) & (j < length[:, None])                    # an earlier occurrence, followed by a token
  for i in range(ngram):
    back = jnp.pad(history, ((0, 0), (i + 1, 0)), constant_values=-1)[:, :W]                  # history[j - 1 - i]
    tail = jnp.take_along_axis(history, jnp.maximum(length - 1 - i, 0)[:, None], axis=1)      # [B, 1]
    match &= back == tail
  start = jnp.max(jnp.where(match, j, -1), axis=1)                # the most recent occurrence (-1: none)
  count = jnp.where(start >= 0, jnp.minimum(k, length - start), 0).astype(jnp.int32)
  idx = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, W - 1)
  return jnp.take_along_axis(history, idx, axis=1), count


def accept(logits, drafts, count, sp: dict, pos, *, greedy: bool):
  """logits [B, T, V] float32 of the verify rows (row t predicts the token at position pos + 1 + t), drafts [B, k]
  (valid: the first `count` [B]), sp from sampling.stack, pos [B] the position of the fed token -> (tokens [B, T]
  int32, n [B] int32, accepted [B] int32): the step's tokens are tokens[:, :n], n = accepted + 1 (the accepted
  drafts, then the model's token after them). greedy (static): every row's temperature is 0."""
  B, T, V = logits.shape
  k = T - 1
  t = jnp.arange(k, dtype=jnp.int32)[None, :]
  target = jnp.argmax(logits, axis=-1).astype(jnp.int32)         # [B, T]
  ok = (drafts == target[:, :k]) & (t < count[:, None])
  a_greedy = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  if greedy:
    return target, a_greedy + 1, a_greedy

  rep = {name: jnp.repeat(value, T, axis=0) for name, value in sp.items()}
  masked = filtered_logits(logits.reshape(B * T, V), rep).reshape(B, T, V)
  logp = jax.nn.log_softmax(masked, axis=-1)
  p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], drafts[:, :, None], axis=-1)[:, :, 0])      # [B, k]
  only = jnp.sum(jnp.isfinite(masked[:, :k]), axis=-1) == 1      # nothing else to draw: a valid draft stands

  def uniforms(seed, p):
    return jax.vmap(lambda i: jax.random.uniform(token_key(seed, p + 1 + i, stream=1)))(jnp.arange(k))

  u = jax.vmap(uniforms)(sp["seed"], pos.astype(jnp.uint32))     # [B, k]
  ok = (t < count[:, None]) & ((u < p_draft) | (only & (drafts == target[:, :k])))
  a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
  row = jnp.take_along_axis(masked, a[:, None, None], axis=1)[:, 0]                               # [B, V]
  rejected = jnp.take_along_axis(drafts, jnp.minimum(a, k - 1)[:, None], axis=1)[:, 0]
  row = jnp.where((a < count)[:, None] & (jnp.arange(V)[None, :] == rejected[:, None]), -jnp.inf, row)
  drawn = jax.vmap(lambda seed, p, r: jax.random.categorical(token_key(seed, p), r).astype(jnp.int32))(
      sp["seed"], (pos + 1 + a).astype(jnp.uint32), row)
  tokens = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
  tokens = jnp.where(jnp.arange(T)[None, :] == a[:, None], drawn[:, None], tokens)
  sampled = sp["temperature"] > 0
  return (jnp.where(sampled[:, None], tokens, target), jnp.where(sampled, a, a_greedy) + 1,
          jnp.where(sampled, a, a_greedy))
