"""The prefix cache and the page pool together, against a simulated device (no JAX).

Each cache slot of the simulated device holds the identity of the K/V a real model would write there: the token
ids of the whole prefix up to and including that position (a position's K/V depend on every token before it).
Requests start from the cache's longest match (then the host tier's pages that continue it, written back into
fresh pages), prefill (write) the rest, hand their pages to the cache and end; the cache evicts under pressure and
on demand, spilling each evicted page's contents to the host tier. After every step, reading any live sequence back gives exactly the
identities of its own prefixes (a wrong hit, or a page evicted and handed out while in use, would not), every
cached page still holds what its key names, and the pool's and cache's bookkeeping hold.
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("hypothesis", reason="the state machine runs under hypothesis: pip install -e '.[test]'")
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from lcjax.cache.pages import PagePool, PagePoolExhausted
from lcjax.cache.prefix import PrefixCache, page_keys

_DOCS = [[(7 * i + d) % 3 for i in range(12)] for d in range(3)] + [[]]
_STEPS = {"rules": 0, "hit_pages": 0, "host_pages": 0, "evicted": 0, "refused": 0}


class CacheMachine(RuleBasedStateMachine):

  @initialize(per_shard=st.integers(3, 30), page_size=st.integers(1, 4), shards=st.integers(1, 3))
  def setup(self, per_shard, page_size, shards):
    self.Z, self.S = page_size, shards
    self.pool = PagePool(per_shard * shards, page_size, shards=shards)
    self.cache = PrefixCache(self.pool, salt=b"test")
    self.device: dict[int, tuple] = {}         # cache slot -> prefix identity
    self.live: dict[int, list[int]] = {}       # seq -> tokens written
    self.key_tokens: dict[bytes, tuple] = {}   # every key ever made -> the tokens it names
    self.host: dict[bytes, list] = {}          # the host tier: evicted pages' slot contents by key
    self.cache.on_evict = self._spill

  def _spill(self, victims):
    for key, page in victims:
      self.host[key] = [self.device[page * self.Z + j] for j in range(self.Z)]

  def _write(self, seq, tokens, start):
    slots = self.pool.slot_mapping(seq, start, len(tokens) - start)
    for p, slot in zip(range(start, len(tokens)), slots):
      self.device[int(slot)] = tuple(tokens[:p + 1])

  def _pick(self, i):
    seqs = sorted(self.live)
    return seqs[i % len(seqs)]

  @rule(doc=st.integers(0, 3), cut=st.integers(0, 12), tail=st.lists(st.integers(0, 2), max_size=5),
        extra=st.integers(0, 4))
  def start(self, doc, cut, tail, extra):
    """A prompt that starts with a cut of one of a few documents (so prompts share prefixes), then its own."""
    _STEPS["rules"] += 1
    tokens = (_DOCS[doc][:cut] + tail) or [0]
    pages = self.cache.match(tokens, len(tokens) - 1)
    for key, page in zip(self.cache.keys(tokens), pages):
      assert self.key_tokens[key] == tuple(tokens[:len(self.key_tokens[key])])
    host = []
    for key in self.cache.keys(tokens, (len(tokens) - 1) // self.Z)[len(pages):]:
      if key not in self.host:
        break
      host.append(key)
    seq = self.pool.adopt(pages) if pages else self.pool.new_sequence()
    try:
      self.pool.extend(seq, len(tokens) - len(pages) * self.Z + extra)
    except PagePoolExhausted:
      _STEPS["refused"] += 1
      self.pool.free(seq)
      return
    _STEPS["hit_pages"] += len(pages)
    _STEPS["host_pages"] += len(host)
    table = self.pool.page_table(seq)
    for m, key in enumerate(host, start=len(pages)):        # back from the host tier, then kept again
      for j, content in enumerate(self.host.pop(key)):
        self.device[table[m] * self.Z + j] = content
    cached = (len(pages) + len(host)) * self.Z
    self._write(seq, tokens, cached)
    self.live[seq] = list(tokens)

  @precondition(lambda self: self.live)
  @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), max_size=4))
  def decode(self, i, more):
    """Write tokens into the room reserved beyond the prompt."""
    _STEPS["rules"] += 1
    seq = self._pick(i)
    tokens = self.live[seq]
    room = self.pool.length(seq) - len(tokens)
    more = more[:room]
    self._write(seq, tokens + more, len(tokens))
    tokens.extend(more)

  @precondition(lambda self: self.live)
  @rule(i=st.integers(0, 100))
  def keep(self, i):
    _STEPS["rules"] += 1
    seq = self._pick(i)
    tokens = self.live[seq]
    for key, n in zip(self.cache.keys(tokens), range(self.Z, len(tokens) + 1, self.Z)):
      self.key_tokens[key] = tuple(tokens[:n])
    self.cache.insert(tokens, self.pool.page_table(seq)[:len(tokens) // self.Z])

  @precondition(lambda self: self.live)
  @rule(i=st.integers(0, 100), keep=st.booleans())
  def end(self, i, keep):
    _STEPS["rules"] += 1
    if keep:
      self.keep(i)
    seq = self._pick(i)
    self.pool.free(seq)
    del self.live[seq]

  @rule(shard=st.integers(0, 2), n=st.integers(1, 5))
  def evict(self, shard, n):
    _STEPS["rules"] += 1
    shard %= self.S
    can = self.cache.evictable(shard)
    got = self.cache.evict(shard, n)
    assert got == min(n, can)
    _STEPS["evicted"] += got

  @rule()
  def clear(self):
    _STEPS["rules"] += 1
    self.cache.clear()
    assert len(self.cache) == 0
    assert self.pool.pages_cached == 0

  @invariant()
  def consistent(self):
    self.pool.check()
    self.cache.check()
    for seq, tokens in self.live.items():
      slots = self.pool.slot_mapping(seq, 0, len(tokens))
      assert [self.device[int(s)] for s in slots] == [tuple(tokens[:p + 1]) for p in range(len(tokens))]
    for key, page in self.cache._page_of.items():
      names = self.key_tokens[key]
      base = len(names) - self.Z
      assert [self.device[page * self.Z + j] for j in range(self.Z)] == [names[:base + j + 1] for j in range(self.Z)]
      assert self.pool.refcount(page) >= 1
    used = {p for s in self.live for p in self.pool.page_table(s)}
    assert self.pool.pages_used == len(used)
    assert self.pool.pages_free + len(used | set(self.cache._key_of)) == self.pool.pages_allocatable

  def teardown(self):
    if not hasattr(self, "pool"):
      return
    for seq in list(self.live):
      self.pool.free(seq)
    self.cache.clear()
    assert self.pool.pages_free == self.pool.pages_allocatable, "pages leaked"
    self.pool.check()


def test_cache_state_machine():
  for k in _STEPS:
    _STEPS[k] = 0
  t0 = time.perf_counter()
  run_state_machine_as_test(CacheMachine, settings=settings(
      max_examples=300, stateful_step_count=60, deadline=None, database=None, derandomize=True,
      suppress_health_check=[HealthCheck.too_slow]))
  print(f"cache state machine: {_STEPS} in {time.perf_counter() - t0:.1f}s")
  assert _STEPS["rules"] >= 10_000 and _STEPS["hit_pages"] and _STEPS["evicted"] and _STEPS["refused"]
  assert _STEPS["host_pages"]


def test_keys_chain_and_salt():
  """A full page's key changes with each of its tokens (and their order), with every token of every earlier page,
  and with the salt; it does not change with anything after the page, and the partly filled last page has none."""
  Z, tokens = 3, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]             # 3 full pages and one token
  keys = page_keys(tokens, Z, b"m")
  assert len(keys) == 3 and len(set(keys)) == 3
  assert page_keys(tokens[:9] + [99, 98], Z, b"m") == keys         # the partly filled page is not named
  assert page_keys(tokens, Z, b"m", n_pages=2) == keys[:2]
  for i in range(9):
    changed = tokens[:i] + [tokens[i] + 100] + tokens[i + 1:]
    other = page_keys(changed, Z, b"m")
    page = i // Z
    assert other[:page] == keys[:page], i                           # pages before the token keep their keys
    assert all(other[m] != keys[m] for m in range(page, 3)), i      # its page and every later page change
  swapped = [6, 5] + tokens[2:]                                     # the same tokens in another order
  assert all(x != y for x, y in zip(page_keys(swapped, Z, b"m"), keys))
  assert all(x != y for x, y in zip(page_keys(tokens, Z, b"other model"), keys))
  assert page_keys(tokens[3:], Z, b"m")[0] != keys[1]               # the same tokens at another position


def test_eviction_only_when_needed_and_lru_tail_first():
  pool = PagePool(6, 2)                                  # 5 usable pages of 2 tokens
  cache = PrefixCache(pool)
  s = pool.new_sequence()
  pool.extend(s, 6)
  cache.insert([1, 2, 3, 4, 5, 6], pool.page_table(s))
  head = pool.page_table(s)
  pool.free(s)
  assert pool.pages_cached == 3 and pool.pages_free == 2 and pool.pages_used == 0
  t = pool.new_sequence()
  pool.extend(t, 4)                                       # two free pages: nothing evicted
  assert len(cache) == 3
  pool.extend(t, 1)                                       # one more page: the chain's tail goes first
  assert len(cache) == 2 and cache.match([1, 2, 3, 4, 5, 6]) == head[:2]
  with pytest.raises(PagePoolExhausted):
    pool.extend(t, 100)                                   # cannot succeed: nothing is evicted for it
  assert len(cache) == 2
  u = pool.adopt(cache.match([1, 2, 3, 4, 9]))            # a sequence uses the cached pages ...
  assert cache.evictable(0) == 0 and cache.evict(0, 2) == 0
  with pytest.raises(PagePoolExhausted):
    pool.extend(t, 2)                                     # ... so they are never taken from it
  pool.free(u)
  pool.extend(t, 2)
  assert len(cache) == 1
  pool.free(t)
  cache.clear()
  assert pool.pages_free == pool.pages_allocatable
  pool.check()
