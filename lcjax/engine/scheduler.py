"""The scheduler: the page pool, the device KV cache and the compiled steps, driving requests given as token ids.

Admission: a request is admitted when the pool can hold its whole prompt + max_new_tokens (so a running request
never runs out of pages), first taking the longest cached run of its prompt's full pages from the prefix cache
(lcjax.cache.prefix) or forking a pinned context / shared prefix, and evicting cached pages nobody uses when a
shard runs short. Prompts are prefilled chunk by chunk from the first token not already cached; then every live
request decodes together in one on-device loop of up to `run.decode_steps` tokens per call (or the call's own
`decode_steps`). A request releases its pages the moment it finishes (at prefill too), its written full pages
staying in the prefix cache, and waiting requests are admitted as long as any wait.

The device cache is donated through every step: a step interrupted midway leaves no cache, so the scheduler
makes a fresh one, forgets every cached page and advances `epoch`. Pages of an earlier epoch hold nothing: a
request or pinned sequence admitted before it is refused (never decoded, never handed to the prefix cache).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from lcjax.cache import kv as kvc
from lcjax.cache.host import HostTier
from lcjax.cache.pages import PagePool, PagePoolExhausted
from lcjax.cache.prefix import PrefixCache
from lcjax.config import RunConfig
from lcjax.engine.requests import RequestError
from lcjax.engine.sampling import SamplingParams, all_greedy, stack as stack_sampling
from lcjax.engine.steps import NONFINITE, DecodeState, Steps


@dataclasses.dataclass
class Request:
  index: int
  prompt: list[int]                # every token id of the sequence's prompt, a shared prefix included
  max_new: int
  sampling: SamplingParams
  prefix_len: int = 0              # leading prompt tokens held by `prefix_seq` (a pinned context or prefix)
  prefix_seq: int | None = None
  private: bool = False            # its pages never join the prefix cache (it continues a private pinned sequence)
  seq: int | None = None           # the request's own sequence in the pool, once admitted
  cached: int = 0                  # leading prompt tokens already in the cache at admission (not prefilled)
  from_host: int = 0               # of those, tokens brought back from the host tier
  written: int = 0                 # tokens whose K/V are in the cache
  epoch: int = -1                  # the scheduler's epoch at admission (its pages are void in a later one)
  out: list[int] = dataclasses.field(default_factory=list)
  prefill_s: float = 0.0          # seconds of this request's own prefill (and first token)
  shared_prefill_s: float = 0.0   # seconds of the call's shared prefix prefill, paid by its first request
  shared_prefill_tokens: int = 0  # tokens of that prefix prefilled (not taken from the prefix cache)
  first_token_at: float | None = None   # time.perf_counter() when the first token was sampled
  decode_s: float = 0.0
  decode_calls: int = 0            # model calls of the decode loop it took part in (speculation: verify steps)
  drafts_proposed: int = 0         # speculative decoding (RunConfig.draft): drafts fed, and those accepted
  drafts_accepted: int = 0
  finish: str | None = None        # "eos" | "length" | "nonfinite" (the logits held NaN or inf: it stopped)
  # Called after each prefill chunk of this request with (index, tokens prefilled, tokens to prefill); the chunk is
  # waited for first, so the numbers are what the device has done. Each call's own: never another caller's.
  on_progress: Callable[[int, int, int], None] | None = None

  @functools.cached_property
  def prompt_ids(self) -> np.ndarray:
    """The prompt as an int32 array (made once: speculative decoding copies it into every decode call's input)."""
    return np.asarray(self.prompt, np.int32)


def _bucket(n: int, lo: int, hi: int | None = None) -> int:
  b = max(lo, 1 << max(0, n - 1).bit_length())
  return min(b, hi) if hi else b


def _null_padded(pages) -> np.ndarray:
  """Page ids as int32, padded to a power of two with the null page (which page moves skip): one compile of a
  page move per power of two."""
  idx = np.zeros(_bucket(len(pages), 1), np.int32)
  idx[:len(pages)] = pages
  return idx


# Prefill chunk lengths: powers of two from CHUNK_MIN to POW2_UP_TO tokens, where a step costs about the same
# at any of them (it reads every weight and the cached prefix); above, multiples of an eighth of the next power
# of two (four lengths an octave) and of ROW_TILE (the flash kernels' query tile): fewer than max(n / 4, 128)
# padded rows for n tokens.
CHUNK_MIN, POW2_UP_TO, ROW_TILE = 16, 256, 128


def chunk_bucket(n: int, chunk: int) -> int:
  """The padded length of a prefill chunk of n tokens (1 <= n <= chunk), at most `chunk`: 1,100 -> 1,280,
  3,000 -> 3,072, 12,288 -> 12,288."""
  if n <= POW2_UP_TO:
    return min(_bucket(n, CHUNK_MIN), chunk)
  step = max(ROW_TILE, _bucket(n, 1) // 8)
  return min(-(-n // step) * step, chunk)


def chunk_buckets(n: int, chunk: int) -> set[int]:
  """The padded lengths of the chunks `Scheduler.prefill` runs for n tokens: whole chunks, then the rest's
  bucket."""
  return {length for length, _ in chunk_programs(n, chunk)}


def chunk_programs(n: int, chunk: int, cached: int = 0) -> set[tuple[int, bool]]:
  """The prefill programs `Scheduler.prefill` runs for n tokens after `cached` ones: (padded length, whether the
  chunk reads a cached prefix) of each chunk. A prompt's first chunk (nothing cached) reads none: it runs with a
  page table of no pages, which costs nothing however long the engine's table is."""
  return {(chunk_bucket(min(chunk, n - c0), chunk), cached + c0 > 0) for c0 in range(0, n, chunk)}


class Scheduler:
  def __init__(self, steps: Steps, params, run: RunConfig, num_pages: int, max_context: int,
               new_cache: Callable[[], kvc.PagedKV], eos_ids: tuple[int, ...], salt: bytes = b""):
    """new_cache: makes a zeroed device cache of `num_pages` pages; salt: names what computed the pages (the
    prefix cache's keys start from it)."""
    self.steps = steps
    self.params = params
    self.run = run
    self.max_context = max_context
    self.eos_ids = tuple(eos_ids)
    self._new_cache = new_cache
    self.pool = PagePool(num_pages, run.page_size, shards=run.seq)
    self.prefix_cache = PrefixCache(self.pool, salt) if run.prefix_cache else None
    self.host_tier = None
    if self.prefix_cache is not None and run.host_cache_gib > 0:
      self.host_tier = HostTier(int(run.host_cache_gib * 2**30))
      self.prefix_cache.on_evict = self._spill
    self.cache = new_cache()
    self.eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
    self.epoch = 0                   # advances whenever the device cache is lost and made afresh
    self.pinned: dict[int, int] = {}  # pinned sequence -> the epoch it was pinned in
    self.private: set[int] = set()   # pinned sequences whose pages, and their continuations', stay out of the
                                     # prefix cache (contexts restored from an unverified file)
    self.orphans: list[int] = []     # pinned sequences whose Context was dropped unclosed (unpinned under the lock)
    self.closed = False
    self.peak_pages_used = 0
    self.lock = threading.RLock()          # held by one step at a time (never across a yield of `serve`)
    self._runs: dict[object, int] = {}     # runs under way -> the thread that started each
    self._runs_changed = threading.Condition()

  @property
  def table_width(self) -> int:
    """Page-table slots per sequence: one width for every call, so each step compiles once per chunk size; a
    multiple of seq, so every seq shard reads an equal slice of it."""
    # Rounded to 16, not to a power of two: kernels that read B * M pages must not see twice the context.
    w = -(-math.ceil(self.max_context / self.run.page_size) // 16) * 16
    return -(-w // self.run.seq) * self.run.seq

  # -- pages --------------------------------------------------------------------------------------------------
  def admit(self, r: Request, cached_limit: int | None = None) -> bool:
    """Reserve every page the request will need: fork its prefix sequence, or start from the prefix cache's
    longest match of at most `cached_limit` tokens (default: all but the last prompt token, whose logits are
    needed). False, holding nothing, when the pool cannot supply the pages."""
    n = len(r.prompt)
    Z = self.run.page_size
    host = []
    if r.prefix_seq is not None:
      if r.prefix_seq not in self.pinned:
        raise RequestError(f"request {r.index}'s context was closed or offloaded while its generation ran")
      if self.pinned[r.prefix_seq] != self.epoch:
        raise RequestError(f"request {r.index}'s context lost its pages when a device step was interrupted: "
                           "prefill it again")
      r.seq, r.cached = self.pool.fork(r.prefix_seq), r.prefix_len
      r.private = r.prefix_seq in self.private
    else:
      limit = n - 1 if cached_limit is None else cached_limit
      pages = self.prefix_cache.match(r.prompt, limit) if self.prefix_cache is not None else []
      host = self._host_hits(r.prompt, limit, len(pages))
      r.seq = self.pool.adopt(pages) if pages else self.pool.new_sequence()
      r.cached = (len(pages) + len(host)) * Z
    r.epoch, r.from_host = self.epoch, len(host) * Z
    in_table = r.cached - r.from_host                # tokens the sequence's table already holds
    r.written = in_table                             # the host tier's pages count once _unspill has written them
    try:
      copies = self.pool.extend(r.seq, n - in_table + r.max_new)
    except PagePoolExhausted:
      for key, value in host:                      # back where they were
        self.host_tier.put(key, value, self._page_bytes(value))
      self.pool.free(r.seq)
      r.seq = None
      return False
    if host:
      self._unspill(r, host)
    if copies:
      src, dst = (jnp.asarray(c, jnp.int32) for c in zip(*copies))
      self.cache = self.steps.copy_pages(self.cache, src, dst)
    self.peak_pages_used = max(self.peak_pages_used, self.pool.pages_used)
    return True

  # -- the host tier ---------------------------------------------------------------------------------------------
  @staticmethod
  def _page_bytes(value) -> int:
    return sum(x.nbytes for x in value)

  def _spill(self, victims: list[tuple[bytes, int]]) -> None:
    """Copy pages about to be evicted to the host tier (PrefixCache.on_evict)."""
    keys, pages = zip(*victims)
    # K, V [L, n, Z, K, H] (and fp8 scales [L, n, K])
    parts = [np.asarray(x) for x in self.steps.gather_pages(self.cache, jnp.asarray(_null_padded(pages)))]
    for i, key in enumerate(keys):
      value = tuple(np.ascontiguousarray(x[:, i]) for x in parts)
      self.host_tier.put(key, value, self._page_bytes(value))

  def _host_hits(self, prompt: list[int], limit: int, on_device: int) -> list[tuple[bytes, tuple]]:
    """The host tier's pages that continue the device's cached run of `prompt` (taken out of the tier)."""
    if self.host_tier is None or not len(self.host_tier):
      return []
    hits = []
    for key in self.prefix_cache.keys(prompt, limit // self.run.page_size)[on_device:]:
      if key not in self.host_tier:
        break
      hits.append((key, self.host_tier.take(key)))
    return hits

  def _unspill(self, r: Request, host: list[tuple[bytes, tuple]]) -> None:
    """Write pages back from the host tier into the request's table slots after its device-cached ones."""
    table = self.pool.page_table(r.seq)
    first = r.cached // self.run.page_size - len(host)
    idx = _null_padded(table[first:first + len(host)])
    n = len(idx)
    # K, V [L, h, Z, K, H] (and fp8 scales [L, h, K])
    parts = [np.stack([value[i] for _, value in host], 1) for i in range(len(host[0][1]))]
    if n > len(host):
      parts = [np.concatenate([x, np.zeros((x.shape[0], n - len(host), *x.shape[2:]), x.dtype)], 1) for x in parts]
    self.cache = self.steps.scatter_pages(self.cache, jnp.asarray(idx), *(jnp.asarray(x) for x in parts))
    r.written = r.cached
    self._keep_written(r, cached_only=True)       # the prefix cache's own pages, back from the host: kept

  def _keep_written(self, r: Request, cached_only: bool = False) -> None:
    """Hand the request's written full pages to the prefix cache (none of a private request's, but for
    cached_only=True: r.written then counts only pages that came from the prefix cache or its host tier)."""
    if (self.prefix_cache is not None and r.seq is not None and r.written and r.epoch == self.epoch
        and (cached_only or not r.private)):
      tokens = (r.prompt + r.out)[:r.written]
      self.prefix_cache.insert(tokens, self.pool.page_table(r.seq)[:len(tokens) // self.run.page_size])

  def release(self, r: Request) -> None:
    if r.seq is not None:
      if r.finish == "nonfinite":
        self._scrub(r.seq)
      else:
        self._keep_written(r)
      self.pool.free(r.seq)
      r.seq = None

  def _scrub(self, seq: int) -> None:
    """Zero the pages only `seq` holds, before they go back to the free list. A request whose logits held NaN or
    inf may have written non-finite K/V there, and a later owner of such a page reads its unwritten slots masked:
    weighted by 0 in the kernels' products, and 0 * NaN is NaN. Pages shared with the prefix cache or a context
    hold only what finite logits followed: none of them is zeroed or handed to the prefix cache from here."""
    own = [p for p in self.pool.page_table(seq) if self.pool.refcount(p) == 1]
    if own and not self.cache.k.is_deleted():     # a cache lost in an interrupted step is rebuilt as zeros
      self.cache = self.steps.zero_pages(self.cache, jnp.asarray(_null_padded(own)))

  def recover_cache(self) -> None:
    """After an interruption inside a donated call the pools are gone: start afresh. Cached pages are forgotten
    and pinned contexts become stale (`epoch`)."""
    if self.cache.k.is_deleted() and not self.closed:
      if self.prefix_cache is not None:
        self.prefix_cache.clear()
      if self.host_tier is not None:
        self.host_tier.clear()         # spilled under this epoch's keys too, from pages now gone with it
      self.cache = self._new_cache()
      self.epoch += 1

  # -- pinned sequences (contexts and shared prefixes) ---------------------------------------------------------
  def pin(self, ids: list[int], fill: Callable[[list[int], int], None] | None = None,
          what: str = "the context", on_progress=None, share: bool = True) -> tuple[int, int]:
    """A sequence of `ids` that stays until `unpin`: (sequence, tokens taken from the prefix cache). Its full
    pages already in the prefix cache are shared; the rest are prefilled, or, with `fill`, written by
    `fill(pages, first)`, which must write the K/V of the sequence's pages[first:] (restored from host or
    disk). on_progress: the prefill's progress callback (Request.on_progress), index -1. share=False: the pages
    it writes, and those of every request that continues it, never join the prefix cache (other requests
    cannot be answered from them)."""
    with self.exclusive():
      return self._pin(ids, what, fill, on_progress, share)

  def _pin(self, ids, what, fill, on_progress, share: bool = True) -> tuple[int, int]:
    with self.lock:
      self.check_open()
      r = Request(-1, list(ids), 0, SamplingParams(), on_progress=on_progress, private=not share)
      try:
        if not self.admit(r, cached_limit=len(ids)):      # inside: an interrupt in admit's writes frees r's pages
          raise PagePoolExhausted(self.blocked_message(r, what))
        if fill is None:
          self.prefill(r, sample=False)
          if r.finish == "nonfinite":
            raise RequestError(f"{what} was not kept: the model's logits after its {len(ids)} tokens hold NaN or "
                               "inf (weights, a kernel or the cache produced them)")
        else:
          fill(self.pool.page_table(r.seq), r.cached // self.run.page_size)
          r.written = len(ids)
        self._keep_written(r)
      except BaseException:
        r.written = min(r.written, r.cached)      # no chunk of its own; host pages only once written back
        self.release(r)
        self.recover_cache()
        raise
      self.pinned[r.seq] = self.epoch
      if not share:
        self.private.add(r.seq)
      return r.seq, r.cached

  def unpin(self, seq: int) -> None:
    with self.lock:
      if self.pinned.pop(seq, None) is not None:
        self.private.discard(seq)
        self.pool.free(seq)

  def check_open(self) -> None:
    """Refuse work on a closed engine; unpin the sequences of contexts dropped without close()."""
    if self.closed:
      raise RequestError("this engine is closed: load or make a new one")
    while self.orphans:
      self.unpin(self.orphans.pop())

  def close(self) -> None:
    """Free every pinned sequence and cached page, then the device cache; refuse any later work."""
    with self.lock:
      for seq in list(self.pinned):
        self.unpin(seq)
      if self.prefix_cache is not None:
        self.prefix_cache.clear()
      if self.host_tier is not None:
        self.host_tier.clear()
      self.closed = True
      for x in (self.cache.k, self.cache.v):
        if not x.is_deleted():
          x.delete()

  def pinned_pages(self) -> int:
    pages = set()
    for seq in self.pinned:
      pages.update(self.pool.page_table(seq))
    return len(pages)

  def blocked_message(self, r: Request, what: str | None = None) -> str:
    used, pinned = self.pool.pages_used, self.pinned_pages()
    return (f"{what or f'request {r.index}'} cannot be admitted: it needs pages for {len(r.prompt) + r.max_new} "
            f"tokens; {self.pool.pages_free} of {self.pool.pages_allocatable} pages are free, "
            f"{self.pool.pages_cached} cached, {pinned} held by {len(self.pinned)} pinned context(s) and "
            f"{used - pinned} by other generations on this engine (an unfinished generate_stream): close a "
            "context or finish the stream")

  # -- driving ------------------------------------------------------------------------------------------------
  def serve(self, reqs: list[Request], prefix: list[int] | None = None,
            decode_steps: int | None = None, on_progress=None) -> Iterator[Request]:
    """Drive requests to completion, yielding a request each time it gains tokens. One run at a time per
    thread group: a run (this generator, from its first step to its end) excludes the runs of other threads, which
    wait for it (`exclusive`); runs of its own thread, e.g. a second stream, interleave, their pages their own.
    Each step holds the scheduler lock only while it runs, never across a yield, so the consumer may advance the
    run from any thread, and a run dropped unfinished is ended by whichever thread closes or collects it.
    `prefix`: token ids every request's prompt starts with, prefilled once into a sequence they fork.
    decode_steps: tokens per decode call (None: run.decode_steps). on_progress: the prefix's prefill progress
    callback (each request carries its own)."""
    token = self._begin_run()
    base = None
    try:
      with self.lock:
        self.check_open()
        if prefix is not None:
          t0 = time.perf_counter()
          base, cached = self._pin(prefix, "the shared prefix", None, on_progress)
          for r in reqs:
            r.prefix_seq, r.prefix_len = base, len(prefix)
          if reqs:      # paid once, reported by the first request
            reqs[0].shared_prefill_s = time.perf_counter() - t0
            reqs[0].shared_prefill_tokens = len(prefix) - cached
      steps = self._drive(reqs, decode_steps or self.run.decode_steps)
      while True:
        with self.lock:
          self.check_open()         # the engine may have been closed while the consumer held a yielded step
          r = next(steps, None)
        if r is None:
          return
        yield r
    finally:
      with self.lock:
        for r in reqs:
          self.release(r)
        if base is not None:
          self.unpin(base)
        self.recover_cache()
      self._end_run(token)

  # -- runs of several threads -----------------------------------------------------------------------------------
  def _begin_run(self) -> object:
    """Wait until no run of another thread is under way, then register one of this thread."""
    me = threading.get_ident()
    token = object()
    with self._runs_changed:
      while any(owner != me for owner in self._runs.values()):
        self._runs_changed.wait()
      self._runs[token] = me
    return token

  def _end_run(self, token) -> None:
    """End a run (from any thread: the one that closed or collected it)."""
    with self._runs_changed:
      self._runs.pop(token, None)
      self._runs_changed.notify_all()

  @contextlib.contextmanager
  def exclusive(self):
    """A run of this thread (as `serve` is) holding the scheduler lock throughout: for calls that do device work
    in one go (prefill, restore, load)."""
    token = self._begin_run()
    try:
      with self.lock:
        yield
    finally:
      self._end_run(token)

  def _drive(self, reqs: list[Request], decode_steps: int) -> Iterator[Request]:
    waiting = collections.deque(reqs)
    live: list[Request | None] = [None] * self.run.max_batch
    while waiting or any(live):
      while waiting and None in live and self.admit(waiting[0]):
        r = waiting.popleft()
        self.prefill(r)
        yield r
        if r.finish:
          self.release(r)
        else:
          live[live.index(None)] = r
      if not any(live):
        if waiting:   # nothing of this run holds pages: they are pinned or held by another run of this thread
          raise PagePoolExhausted(self.blocked_message(waiting[0]))
        break
      lost = [r.index for r in live if r is not None and r.epoch != self.epoch]
      if lost:          # another run of this thread was interrupted inside a step: these pages hold nothing
        raise RequestError(f"request(s) {lost} lost their cache when another generation's device step was "
                           "interrupted: run them again")
      yield from self.decode_call(live, steps=decode_steps)
      for b, r in enumerate(live):
        if r is not None and r.finish:
          self.release(r)
          live[b] = None

  # -- ahead-of-time compilation ---------------------------------------------------------------------------------
  def compile_programs(self, chunks=(), decode: tuple[tuple[int, bool], ...] = (), first_token: bool = False,
                       copies: tuple[int, ...] = ()) -> int:
    """Compile, without running them, the programs serving calls will use: the prefill chunk of each (padded
    length, reads a cached prefix) in `chunks` (`chunk_programs`), the first-token sampler, the decode loop of each
    (steps, greedy) in `decode`, and the page copy of each count in `copies`. Each is lowered
    (`.lower(...).compile()`) on arguments of the kinds and shapes the serving calls pass, which leaves it in jit's
    caches (and the persistent compilation cache): those calls then neither trace nor compile. Returns the number
    of programs."""
    i32 = lambda *shape: jnp.asarray(np.zeros(shape, np.int32))
    W, n = self.table_width, 0
    logits = None
    for Tb, reads_prefix in sorted(set(chunks)):
      z = i32(1, Tb)
      compiled = self.steps.prefill.lower(self.params, self.cache, z, z, i32(1, W if reads_prefix else 0), i32(1),
                                          i32(1)).compile()
      logits = compiled.out_info[0]
      n += 1
    if first_token:
      if logits is None:
        logits = self.steps.prefill.lower(self.params, self.cache, i32(1, 16), i32(1, 16), i32(1, W), i32(1),
                                          i32(1)).out_info[0]
      self.steps.first_token.lower(logits, stack_sampling([SamplingParams()]), i32(1)).compile()
      n += 1
    for steps, greedy in sorted(set(decode)):
      self.lower_decode(steps, greedy).compile()
      n += 1
    for k in sorted(set(copies)):
      src = jnp.asarray(tuple(range(k)), jnp.int32)
      self.steps.copy_pages.lower(self.cache, src, src).compile()
      n += 1
    return n

  def lower_decode(self, steps: int, greedy: bool):
    """The decode loop of `steps` steps (speculative when RunConfig.draft says so) lowered, not compiled, on
    arguments of the kinds and shapes serving calls pass it (`compile_programs` compiles it)."""
    i32 = lambda *shape: jnp.asarray(np.zeros(shape, np.int32))
    W, B = self.table_width, self.run.max_batch
    state = DecodeState(i32(B), i32(B), jnp.asarray(np.ones(B, bool)), i32(B))
    sp = stack_sampling([SamplingParams()] * B)
    if self.run.draft == "off":
      return self.steps.decode.lower(self.params, self.cache, state, sp, i32(B, W), self.eos, steps=steps,
                                     greedy=greedy)
    return self.steps.decode_spec.lower(self.params, self.cache, state, sp, i32(B, W), self.eos,
                                        i32(B, W * self.run.page_size), steps=steps, greedy=greedy,
                                        **self._draft_args())

  def prefill(self, r: Request, sample: bool = True):
    """Prefill r.prompt[r.cached:] in chunks (what comes before is in the cache), then sample a token (or, with
    sample=False, return the last chunk's logits [1, V], None when nothing was left to prefill)."""
    t0 = time.perf_counter()
    C = self.run.prefill_chunk
    n = len(r.prompt)
    logits = None
    table = self.pool.page_table_array([r.seq], self.table_width)   # pages are reserved up front
    # A chunk with nothing cached before it gets a table of no pages (`chunk_programs`).
    tables = {False: jnp.asarray(table[:, :0]), True: jnp.asarray(table)}
    for c0 in range(r.cached, n, C):
      piece = r.prompt[c0:c0 + C]
      Tb = chunk_bucket(len(piece), C)
      tokens = np.zeros((1, Tb), np.int32)
      tokens[0, :len(piece)] = piece
      slots = np.zeros((1, Tb), np.int32)
      slots[0, :len(piece)] = self.pool.slot_mapping(r.seq, c0, len(piece))
      logits, self.cache = self.steps.prefill(
          self.params, self.cache, jnp.asarray(tokens), jnp.asarray(slots), tables[c0 > 0],
          jnp.asarray([c0], jnp.int32), jnp.asarray([len(piece)], jnp.int32))
      r.written = c0 + len(piece)
      if r.on_progress is not None:
        jax.block_until_ready(logits)
        r.on_progress(r.index, r.written - r.cached, n - r.cached)
    if not sample:
      if logits is not None and not np.isfinite(np.asarray(logits)).all():
        r.finish = "nonfinite"                 # release() zeroes its pages rather than caching them
      r.prefill_s = time.perf_counter() - t0
      return logits
    tok = self.steps.first_token(logits, stack_sampling([r.sampling]), jnp.asarray([n], jnp.int32))
    tok = int(np.asarray(tok)[0])          # read on the host: indexing the device array would compile a program
    r.first_token_at = time.perf_counter()
    r.prefill_s = r.first_token_at - t0
    if tok == NONFINITE:
      self._stop_nonfinite(r)
      return
    r.out.append(tok)
    if tok in self.eos_ids:
      r.finish = "eos"
    elif r.max_new <= 1:
      r.finish = "length"
    self._keep_written(r)                    # the prompt's full pages serve requests admitted from now on

  @staticmethod
  def _stop_nonfinite(r: Request) -> None:
    """r ends where the model's logits held NaN or inf: what would follow is not the model's output."""
    r.finish = "nonfinite"
    logging.error("request %d stopped after %d generated tokens: the model's logits held NaN or inf (weights, a "
                  "kernel or the cache produced them); its result has finish_reason 'nonfinite'", r.index, len(r.out))

  def _draft_args(self) -> dict:
    return dict(ngram=self.run.draft_ngram, k=self.run.draft_tokens)

  def _history(self, live: list[Request | None]) -> np.ndarray:
    """Each batch slot's tokens by position [B, table_width * page_size] (the prompt, then the generated tokens;
    zeros past them): where speculative decoding looks up its drafts."""
    hist = np.zeros((len(live), self.table_width * self.run.page_size), np.int32)
    for b, r in enumerate(live):
      if r is not None:
        n = len(r.prompt)
        hist[b, :n] = r.prompt_ids
        hist[b, n:n + len(r.out)] = r.out
    return hist

  def decode_call(self, live: list[Request | None], steps: int | None = None) -> list[Request]:
    """One call of the on-device decode loop over the batch slots `live`: up to `steps` tokens each (None:
    run.decode_steps). Returns the requests that took part."""
    B = len(live)
    alive = [r for r in live if r is not None]
    tokens = np.zeros(B, np.int32)
    pos = np.zeros(B, np.int32)
    done = np.ones(B, bool)
    remaining = np.zeros(B, np.int32)
    table = np.zeros((B, self.table_width), np.int32)
    for b, r in enumerate(live):
      if r is not None:
        tokens[b], pos[b], done[b] = r.out[-1], len(r.prompt) + len(r.out) - 1, False
        remaining[b] = r.max_new - len(r.out)
        table[b] = self.pool.page_table_array([r.seq], self.table_width)[0]
    sampling = [r.sampling if r is not None else SamplingParams() for r in live]
    state = DecodeState(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(done), jnp.asarray(remaining))
    args = (self.params, self.cache, state, stack_sampling(sampling), jnp.asarray(table), self.eos)
    kw = dict(steps=steps or self.run.decode_steps, greedy=all_greedy(sampling))
    t0 = time.perf_counter()
    if self.run.draft == "off":
      out, state, self.cache = self.steps.decode(*args, **kw)
      counts = None
    else:
      out, state, self.cache, counts = self.steps.decode_spec(*args, jnp.asarray(self._history(live)), **kw,
                                                              **self._draft_args())
      counts = {f.name: np.asarray(getattr(counts, f.name)) for f in dataclasses.fields(counts)}
    out = np.asarray(out)
    dt = time.perf_counter() - t0
    final_done = np.asarray(state.done)
    # Each slot is charged the call's time in proportion to the model steps it took part in: the loop runs on
    # for the others after a slot stops.
    took = counts["steps"] if counts is not None else (out != -1).sum(axis=1)
    ran = max(int(np.max(took)), 1)
    for b, r in enumerate(live):
      if r is None:
        continue
      got = [int(t) for t in out[b] if t >= 0]
      r.out.extend(got)
      r.written = len(r.prompt) + len(r.out) - 1        # the last token is sampled, not yet fed
      r.decode_s += dt * int(took[b]) / ran
      if counts is None:
        r.decode_calls += len(got)
      else:
        r.decode_calls += int(counts["steps"][b])
        r.drafts_proposed += int(counts["proposed"][b])
        r.drafts_accepted += int(counts["accepted"][b])
      if (out[b] == NONFINITE).any():
        self._stop_nonfinite(r)
      elif final_done[b]:
        r.finish = "eos" if r.out[-1] in self.eos_ids else "length"
    return alive
