"""The prefix cache: full KV pages kept after their sequences end, found again by the tokens they hold (layer L0).

A full page of a sequence is named by a hash chain: page m's key is hash(key of page m - 1, its page_size token
ids), and page 0's chain starts from a `salt` that names what computed the pages (model weights, dtypes, page
size, fp8 scales), so a key says "the KV of exactly these tokens at exactly these positions". A page is written
once (full pages are never written again, lcjax.cache.pages), so a cached page stays valid for as long as it is
kept.

The cache keeps a page by holding a reference of its own in the pool (`PagePool.hold`): a page that sequences
still use is never evicted, and a page only the cache holds is *cached* and can be taken back by the pool when a
shard runs short (the cache is the pool's `reclaimer`). Eviction is least recently used; a hit touches the pages
of a chain from its last page to its first, so a chain's tail goes before its head and a chain is never cut
in the middle while its tail survives.

Legend: Z page size, S sequence shards (page-table slot m lives on shard m % S).
"""
from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from lcjax.cache.pages import PagePool

ROOT = b"lcjax-prefix-v1"


def page_keys(tokens: Sequence[int], page_size: int, salt: bytes = b"", n_pages: int | None = None) -> list[bytes]:
  """Hash-chain keys of the full pages of `tokens` (the first `n_pages` of them when given)."""
  full = len(tokens) // page_size if n_pages is None else n_pages
  ids = np.asarray(tokens[:full * page_size], dtype="<i8")
  keys, prev = [], hashlib.blake2b(ROOT + salt, digest_size=16).digest()
  for m in range(full):
    prev = hashlib.blake2b(prev + ids[m * page_size:(m + 1) * page_size].tobytes(), digest_size=16).digest()
    keys.append(prev)
  return keys


class PrefixCache:
  """key -> page for full pages, holding one pool reference per cached page; the pool's reclaimer."""

  def __init__(self, pool: PagePool, salt: bytes = b""):
    self.pool = pool
    self.salt = salt
    # Called with [(key, page)] just before those pages are evicted (while they still hold their K/V): the
    # scheduler copies them to the host tier (lcjax.cache.host).
    self.on_evict = None
    self._page_of: dict[bytes, int] = {}
    self._key_of: dict[int, bytes] = {}
    self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()   # oldest first
    pool.reclaimer = self

  def __len__(self) -> int:
    return len(self._page_of)

  @property
  def page_size(self) -> int:
    return self.pool.page_size

  def keys(self, tokens: Sequence[int], n_pages: int | None = None) -> list[bytes]:
    return page_keys(tokens, self.page_size, self.salt, n_pages)

  def match(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
    """Pages of the longest cached chain of full pages that starts `tokens` and covers at most `limit` tokens
    (default all); touches them (most recently used)."""
    Z = self.page_size
    n = len(tokens) if limit is None else min(limit, len(tokens))
    pages = []
    for key in self.keys(tokens, n // Z):
      page = self._page_of.get(key)
      if page is None:
        break
      pages.append(page)
    for page in reversed(pages):
      self._lru.move_to_end(page)
    return pages

  def insert(self, tokens: Sequence[int], table: Sequence[int]) -> int:
    """Keep the full pages of a sequence that holds `tokens` (all written) in page table `table`. A key already
    cached under another page keeps that page. Returns the number of pages newly kept."""
    added = 0
    keys = self.keys(tokens)
    for key, page in zip(keys, table):
      if key not in self._page_of and page not in self._key_of:
        self.pool.hold(page)
        self._page_of[key], self._key_of[page] = page, key
        added += 1
    for key in reversed(keys):
      page = self._page_of[key]
      self._lru[page] = None
      self._lru.move_to_end(page)
    return added

  def _only_cached(self, page: int) -> bool:
    return self.pool.refcount(page) == 1

  def evictable(self, shard: int) -> int:
    return sum(1 for p in self._lru if self.pool.shard_of(p) == shard and self._only_cached(p))

  def evict(self, shard: int, n: int) -> int:
    """Let go of up to n least recently used pages of `shard` that no sequence holds; returns how many."""
    victims = []
    for page in self._lru:
      if len(victims) == n:
        break
      if self.pool.shard_of(page) == shard and self._only_cached(page):
        victims.append(page)
    if victims and self.on_evict is not None:
      self.on_evict([(self._key_of[p], p) for p in victims])
    for page in victims:
      self._drop(page)
    return len(victims)

  def _drop(self, page: int) -> None:
    del self._page_of[self._key_of.pop(page)]
    del self._lru[page]
    self.pool.unhold(page)

  def clear(self) -> None:
    """Let go of every cached page (pages sequences still use stay with them)."""
    for page in list(self._lru):
      self._drop(page)

  def check(self) -> None:
    """AssertionError when the maps disagree with each other or the pool (tests)."""
    assert set(self._key_of) == set(self._lru) == set(self._page_of.values()), "prefix cache maps disagree"
    for page in self._key_of:
      assert self.pool.refcount(page) >= 1, f"cached page {page} is free in the pool"
