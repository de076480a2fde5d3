"""The request validator: what a request must satisfy before anything is allocated (no JAX here).

One set of rules for the Engine and the CLI (which refuses before it reads any weights): token ids inside the
vocabulary, prompt + max_new_tokens inside the context, and pages that a pool of the run's size could ever hold
(with a shared prefix, its pages are held beside the request's own).
"""
from __future__ import annotations

import dataclasses
import logging
import numbers

import numpy as np

from lcjax.config import ConfigError, ModelConfig, RunConfig


class RequestError(ValueError):
  """A request lcjax refuses (bad prompt, limits); the engine stays usable."""


def check_context_length(model_cfg: ModelConfig, run: RunConfig) -> None:
  """Refuse a max_context past the model's trained context (max_position, rope scaling included) unless
  run.allow_beyond_trained_context; when allowed, warn with both numbers."""
  ctx, trained = run.context_for(model_cfg), model_cfg.max_position
  if ctx <= trained:
    return
  what = (f"max_context={ctx} is past {model_cfg.name}'s trained context of {trained} tokens"
          + ("" if model_cfg.rope_scaling else " and it has no rope scaling"))
  if not run.allow_beyond_trained_context:
    raise ConfigError(f"{what}: positions past {trained} were never trained; set "
                      "allow_beyond_trained_context=True to run anyway")
  logging.warning("%s: positions past %d were never trained (allow_beyond_trained_context=True)", what, trained)


@dataclasses.dataclass(frozen=True)
class Limits:
  vocab_size: int
  max_context: int
  page_size: int          # Z
  shards: int             # S: seq shards of the page pool
  pages_per_shard: int    # P / S, the shard's null page included

  @classmethod
  def of(cls, model_cfg: ModelConfig, run: RunConfig, num_pages: int) -> "Limits":
    """The limits of a run whose context length serving.resolve has checked."""
    return cls(model_cfg.vocab_size, run.context_for(model_cfg), run.page_size, run.seq, num_pages // run.seq)

  def check_ids(self, ids) -> None:
    bad = [t for t in ids if not 0 <= t < self.vocab_size]
    if bad:
      raise RequestError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")

  @staticmethod
  def check_max_new(max_new_tokens) -> None:
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral)
        or max_new_tokens < 1):
      raise RequestError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")

  def decode_steps(self, given, default: int) -> int:
    """A call's decode_steps (None: `default`): an integer from 1 to max_context (a decode call outputs
    [max_batch, decode_steps] tokens, and no request decodes more than the context holds)."""
    if given is None:
      return default
    if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or not 1 <= given <= self.max_context:
      raise RequestError(f"decode_steps={given!r} must be an integer from 1 to max_context={self.max_context}")
    return int(given)

  def check_warm_up(self, prompt_tokens, context_tokens, more_buckets, chunk: int) -> None:
    """Refuse a warm-up's token counts (Engine.warm_up) outside the context, or chunk lengths outside 1..chunk."""
    if not isinstance(more_buckets, (list, tuple, set, frozenset, range)):
      raise RequestError(f"more_buckets={more_buckets!r} must be a sequence of chunk lengths")
    for name, n, low, top in (("prompt_tokens", prompt_tokens or 0, 0, self.max_context),
                              ("context_tokens", context_tokens, 0, self.max_context),
                              *(("more_buckets", b, 1, chunk) for b in more_buckets)):
      if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not low <= n <= top:
        raise RequestError(f"{name}: {n!r} must be an integer from {low} to {top}")

  def pages_held(self, n: int, prefix_len: int = 0) -> list[int]:
    """Pages per seq shard held while a request of n tokens runs: with a shared prefix of `prefix_len` tokens,
    the prefix sequence's pages too, and the request's copy of the prefix's partly filled last page."""
    Z, S = self.page_size, self.shards
    slots = list(range(-(-prefix_len // Z))) + list(range(prefix_len // Z, -(-n // Z)))   # slot m: shard m % S
    return [sum(1 for m in slots if m % S == d) for d in range(S)]

  def check(self, index: int, ids, max_new_tokens: int, prefix_len: int = 0, what: str | None = None) -> None:
    """Refuse prompt `index` (all its ids, prefix included) when it can never run; `what` names it in the
    message instead ("the context": a context to prefill or load, which needs room for one more token)."""
    self.check_max_new(max_new_tokens)
    max_new_tokens = int(max_new_tokens)        # a narrow numpy integer would wrap in the sums below
    self.check_ids(ids)
    n = len(ids) + max_new_tokens
    name = what or f"prompt {index}"
    if n > self.max_context:
      room = f"{len(ids)} tokens + max_new_tokens={max_new_tokens}" if what is None else f"{len(ids)} tokens + 1"
      raise RequestError(f"{name} has {room} = {n} > max context {self.max_context}: shorten "
                         f"{'the prompt' if what is None else 'it'} or raise max_context")
    per_shard = self.pages_held(n, prefix_len)
    need, per = sum(per_shard), self.pages_per_shard - 1
    if max(per_shard) <= per:
      return
    held = f"{n} tokens" + (", with the shared prefix's pages held beside them" if prefix_len else "")
    if self.shards == 1:
      raise RequestError(f"{name} needs {need} pages ({held}) but the pool has only {per} pages "
                         f"({per * self.page_size} tokens; num_pages={self.pages_per_shard}): raise num_pages or "
                         "lower max_new_tokens")
    raise RequestError(f"{name} needs {need} pages ({held}), {max(per_shard)} of them on seq shard "
                       f"{per_shard.index(max(per_shard))}, but each of the {self.shards} seq shards has only "
                       f"{per} pages: raise num_pages or lower max_new_tokens")
