"""Host-side page allocator of the paged KV cache (layer L0: stdlib and numpy only, never jax).

The device holds one K and one V pool `[L, P, Z, K, H]`; this module decides which of the P pages each sequence
owns. Page 0 is the null page: it is never handed out, and unused page-table slots point at it so that a padded
table gathers harmless data that `kv_len` masks away.

A sequence's page table holds exactly `ceil(length / Z)` pages; slot m covers tokens m*Z .. m*Z+Z-1 (the layout
`paged_attention_reference` reads). Pages are reference counted so that `fork` can share a prefilled prefix (a
common system prompt) between sequences without copying it. A shared page is never written again: full pages
need no write, and a partly filled shared last page is copied to a fresh page the first time one of its holders
extends (copy-on-write). The copy itself is device work, so `extend` returns the `(src, dst)` pairs for the
caller to perform before it writes the new tokens.

Sequence-sharded pools (`shards=S`, the `seq` mesh axis): the device pool's P pages are split into S equal
slices, shard d owning pages [d * P/S, (d+1) * P/S), and the first page of every slice is that shard's null page.
Placement policy: page-table slot m of every sequence lives on shard m % S (round-robin), so a sequence's pages,
and the attention work over them, are balanced across shards within one page, however long it grows by decode;
and the device finds shard d's part of any table as the columns d, d+S, d+2S, ... with no lookup. Copy-on-write
keeps a page's slot, hence its shard.

Holds outside sequences: the prefix cache (lcjax.cache.prefix) keeps pages whose sequences have ended by holding a
reference of its own (`hold` / `unhold`); a page only it holds is *cached*, not used, and goes back to the free
list when the cache lets go of it. A pool made with a `reclaimer` asks it to let go of cached pages when a shard
runs short (`extend` evicts only what it needs, and only when the extend can then succeed); `adopt` starts a
sequence on cached full pages.

Legend: P pages, Z page size, M page-table slots per sequence, S sequence shards.
"""
from __future__ import annotations

import heapq

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


class PagePoolExhausted(ValueError):
  """The pool has fewer free pages than a request needs; the pool is left unchanged."""


class PagePool:
  """Free lists, per-page reference counts, and per-sequence page tables and lengths.

  Free pages are handed out lowest-first (a heap per shard), so allocation is deterministic. Sequence ids are
  never reused, so a stale id after `free` is an error rather than a silent alias of a newer sequence.
  """

  def __init__(self, num_pages: int, page_size: int, shards: int = 1, reclaimer=None):
    """reclaimer: an object with `evictable(shard) -> int` (pages it can let go of on that shard) and
    `evict(shard, n)` (lets go of n of them through `unhold`), asked when an `extend` finds a shard short."""
    if shards < 1:
      raise ValueError(f"{shards=} must be >= 1")
    if num_pages % shards:
      raise ValueError(f"{num_pages=} is not divisible by {shards=}: every shard holds an equal slice")
    if num_pages // shards < 2:
      raise ValueError(f"{num_pages=} must be >= 2 per shard ({shards=}): the first page of every shard is its "
                       "reserved null page")
    if page_size < 1:
      raise ValueError(f"{page_size=} must be >= 1")
    # Slot ids go to the device as int32 scatter indices.
    if num_pages * page_size - 1 > _INT32_MAX:
      raise ValueError(f"{num_pages=} * {page_size=} cache slots do not fit int32 slot ids")
    self._num_pages = num_pages
    self._page_size = page_size
    self._shards = shards
    self._per_shard = num_pages // shards
    # One heap per shard; an ascending list already is one.
    self._free = [list(range(d * self._per_shard + 1, (d + 1) * self._per_shard)) for d in range(shards)]
    self._refcount = [0] * num_pages
    self._outside = [0] * num_pages      # references held outside sequences (`hold`)
    self.reclaimer = reclaimer
    self._tables: dict[int, list[int]] = {}
    self._lengths: dict[int, int] = {}
    self._next_seq = 0

  # -- sizes --------------------------------------------------------------------------------------------------

  @property
  def page_size(self) -> int:
    return self._page_size

  @property
  def pages_total(self) -> int:
    """P, the size of the device pool, null pages included (so at most P - S pages are ever in use)."""
    return self._num_pages

  @property
  def shards(self) -> int:
    return self._shards

  @property
  def pages_per_shard(self) -> int:
    return self._per_shard

  @property
  def pages_allocatable(self) -> int:
    return self._num_pages - self._shards

  @property
  def pages_free(self) -> int:
    return sum(len(f) for f in self._free)

  def pages_free_on(self, shard: int) -> int:
    return len(self._free[shard])

  @property
  def pages_used(self) -> int:
    """Distinct pages held by at least one sequence (a shared page counts once); cached pages not included."""
    return self.pages_allocatable - self.pages_free - self.pages_cached

  @property
  def pages_cached(self) -> int:
    """Pages held only outside sequences (by the prefix cache): reclaimable."""
    return sum(1 for p, n in enumerate(self._outside) if n and n == self._refcount[p])

  def shard_of(self, page: int) -> int:
    return page // self._per_shard

  def fits(self, n_tokens: int) -> bool:
    """Whether an empty pool can hold one sequence of n_tokens (its busiest shard holds slots 0, S, 2S, ...)."""
    return -(-self.pages_needed(n_tokens) // self._shards) <= self._per_shard - 1

  @property
  def sequences(self) -> tuple[int, ...]:
    return tuple(self._tables)

  def pages_needed(self, n_tokens: int) -> int:
    """Pages that hold n_tokens tokens from an empty sequence."""
    if n_tokens < 0:
      raise ValueError(f"{n_tokens=} must be >= 0")
    return -(-n_tokens // self._page_size)

  def refcount(self, page: int) -> int:
    if not 0 <= page < self._num_pages:
      raise ValueError(f"{page=} is outside the pool of {self._num_pages} pages")
    return self._refcount[page]

  # -- sequences ----------------------------------------------------------------------------------------------

  def _table(self, seq: int) -> list[int]:
    try:
      return self._tables[seq]
    except KeyError:
      raise KeyError(f"unknown sequence {seq=}") from None

  def new_sequence(self) -> int:
    seq = self._next_seq
    self._next_seq += 1
    self._tables[seq] = []
    self._lengths[seq] = 0
    return seq

  def length(self, seq: int) -> int:
    """Tokens reserved for the sequence (written or about to be written)."""
    self._table(seq)
    return self._lengths[seq]

  def page_table(self, seq: int) -> list[int]:
    return list(self._table(seq))

  def _cow_page(self, seq: int, n_tokens: int) -> int | None:
    """The shared, partly filled last page that a write of n_tokens > 0 tokens would touch, if any."""
    table = self._table(seq)
    if n_tokens > 0 and self._lengths[seq] % self._page_size and self._refcount[table[-1]] > 1:
      return table[-1]
    return None

  def _slots_to_fill(self, seq: int, n_tokens: int) -> list[int]:
    """Page-table slots that `extend(seq, n_tokens)` takes fresh pages for, the copy-on-write slot first."""
    if n_tokens < 0:
      raise ValueError(f"{n_tokens=} must be >= 0")
    have = len(self._table(seq))
    new = self.pages_needed(self._lengths[seq] + n_tokens) - have if n_tokens > 0 else 0
    cow = [have - 1] if self._cow_page(seq, n_tokens) is not None else []
    return cow + list(range(have, have + new))

  def pages_needed_for(self, seq: int, n_tokens: int) -> int:
    """Free pages that `extend(seq, n_tokens)` takes, the copy-on-write page included."""
    return len(self._slots_to_fill(seq, n_tokens))

  def _short_shard(self, slots: list[int]) -> tuple[int, int] | None:
    """(shard, pages it needs) of the first shard that cannot supply its share of `slots`, else None."""
    need = [0] * self._shards
    for m in slots:
      need[m % self._shards] += 1
    for d, n in enumerate(need):
      if n > len(self._free[d]):
        return d, n
    return None

  def _reclaim_for(self, slots: list[int]) -> bool:
    """Evict cached pages so that every shard can supply its share of `slots`; False (nothing evicted) when even
    eviction cannot."""
    need = [0] * self._shards
    for m in slots:
      need[m % self._shards] += 1
    short = [(d, n - len(self._free[d])) for d, n in enumerate(need) if n > len(self._free[d])]
    if not short:
      return True
    if self.reclaimer is None or any(self.reclaimer.evictable(d) < k for d, k in short):
      return False
    for d, k in short:
      self.reclaimer.evict(d, k)
    return True

  def can_extend(self, seq: int, n_tokens: int) -> bool:
    slots = self._slots_to_fill(seq, n_tokens)
    if self._short_shard(slots) is None:
      return True
    if self.reclaimer is None:
      return False
    need = [0] * self._shards
    for m in slots:
      need[m % self._shards] += 1
    return all(n <= len(self._free[d]) + self.reclaimer.evictable(d) for d, n in enumerate(need))

  def extend(self, seq: int, n_tokens: int) -> list[tuple[int, int]]:
    """Reserve room for n_tokens more tokens of seq; return the (src, dst) page copies to do before writing.

    All or nothing: if the pool cannot supply the pages (after evicting cached pages, when there is a reclaimer)
    it raises PagePoolExhausted and changes nothing.
    """
    slots = self._slots_to_fill(seq, n_tokens)   # validates seq and n_tokens
    self._reclaim_for(slots)
    short = self._short_shard(slots)
    if short is not None:
      length = self._lengths[seq]
      where = ""
      if self._shards > 1:
        where = f" ({short[1]} of them on seq shard {short[0]} of {self._shards})"
      free = len(self._free[short[0]]) if self._shards > 1 else self.pages_free
      of = self._per_shard - 1 if self._shards > 1 else self.pages_allocatable
      raise PagePoolExhausted(
          f"sequence {seq} needs {len(slots)} free pages{where} to extend by {n_tokens} tokens (length {length} "
          f"-> {length + n_tokens}, page_size={self._page_size}) but only {free} of {of} allocatable pages "
          f"{'of that shard ' if self._shards > 1 else ''}are free")
    table = self._table(seq)
    copies = []
    src = self._cow_page(seq, n_tokens)
    for m in slots:
      page = heapq.heappop(self._free[m % self._shards])
      self._refcount[page] = 1
      if m < len(table):        # the copy-on-write slot
        self._refcount[src] -= 1
        table[m] = page
        copies.append((src, page))
      else:
        table.append(page)
    self._lengths[seq] += n_tokens
    return copies

  def adopt(self, pages: list[int]) -> int:
    """A new sequence whose table is `pages`, all full (length len(pages) * page_size), each already held (by
    the prefix cache) and placed on the shard of its slot; their refcounts grow by one."""
    for m, page in enumerate(pages):
      if not 0 <= page < self._num_pages or self._refcount[page] < 1:
        raise ValueError(f"page {page} at slot {m} is not held: only held (cached) pages can be adopted")
      if self.shard_of(page) != m % self._shards:
        raise ValueError(f"page {page} is on shard {self.shard_of(page)}, slot {m} belongs on {m % self._shards}")
    seq = self.new_sequence()
    self._tables[seq] = list(pages)
    self._lengths[seq] = len(pages) * self._page_size
    for page in pages:
      self._refcount[page] += 1
    return seq

  def hold(self, page: int) -> None:
    """One more reference to a page that a sequence holds, kept outside sequences (the prefix cache's)."""
    if not 0 <= page < self._num_pages or self._refcount[page] < 1:
      raise ValueError(f"page {page} is not held by any sequence: only a held page can be kept")
    self._refcount[page] += 1
    self._outside[page] += 1

  def unhold(self, page: int) -> None:
    """Drop a reference taken by `hold`; the page goes back to the free list when nothing else holds it."""
    if not 0 <= page < self._num_pages or self._outside[page] < 1:
      raise ValueError(f"page {page} has no reference held outside sequences")
    self._outside[page] -= 1
    self._refcount[page] -= 1
    if self._refcount[page] == 0:
      heapq.heappush(self._free[self.shard_of(page)], page)

  def fork(self, seq: int) -> int:
    """A new sequence sharing every page of seq (the prefix is not copied), with the same length."""
    table = self._table(seq)
    child = self.new_sequence()
    self._tables[child] = list(table)
    self._lengths[child] = self._lengths[seq]
    for page in table:
      self._refcount[page] += 1
    return child

  def free(self, seq: int) -> None:
    """Drop seq; pages no other sequence holds go back to the free list."""
    table = self._table(seq)
    for page in table:
      self._refcount[page] -= 1
      if self._refcount[page] == 0:
        heapq.heappush(self._free[self.shard_of(page)], page)
    del self._tables[seq]
    del self._lengths[seq]

  # -- device views -------------------------------------------------------------------------------------------

  def slot_mapping(self, seq: int, start: int, n: int) -> np.ndarray:
    """Flat cache slots (page * Z + offset) of token positions start .. start+n-1 of seq: int32 [n].

    The device writes new K/V with one scatter into the pool viewed as [P * Z, K, H], a jit-safe shape.
    """
    table = self._table(seq)
    length = self._lengths[seq]
    if start < 0 or n < 0 or start + n > length:
      raise ValueError(f"positions {start=} .. {start + n=} are outside sequence {seq} of {length=}")
    pos = np.arange(start, start + n, dtype=np.int64)
    pages = np.asarray(table, dtype=np.int64).reshape(-1)
    return (pages[pos // self._page_size] * self._page_size + pos % self._page_size).astype(np.int32)

  def page_table_array(self, seqs, width: int) -> np.ndarray:
    """Page tables of seqs as int32 [len(seqs), width], padded with the null page 0."""
    seqs = list(seqs)
    out = np.zeros((len(seqs), width), dtype=np.int32)
    for row, seq in enumerate(seqs):
      table = self._table(seq)
      if len(table) > width:
        raise ValueError(f"sequence {seq} holds {len(table)} pages, more than the table {width=}")
      out[row, :len(table)] = table
    return out

  # -- invariants ---------------------------------------------------------------------------------------------

  def check(self) -> None:
    """Raise AssertionError if the bookkeeping is inconsistent (for tests and debugging; O(P + pages held))."""
    def fail(msg):
      raise AssertionError(f"PagePool invariant broken: {msg}")

    nulls = set(range(0, self._num_pages, self._per_shard))
    all_free = [p for f in self._free for p in f]
    free = set(all_free)
    if len(free) != len(all_free):
      fail(f"a page is twice in the free list {sorted(all_free)}")
    if free & nulls:
      fail(f"null page(s) {sorted(free & nulls)} in the free list")
    for d, f in enumerate(self._free):
      if any(self.shard_of(p) != d for p in f):
        fail(f"free list of shard {d} holds pages of another shard: {sorted(f)}")
    if not free <= set(range(1, self._num_pages)):
      fail(f"free list {sorted(free)} holds pages outside 1..{self._num_pages - 1}")
    held = [0] * self._num_pages
    for seq, table in self._tables.items():
      if len(set(table)) != len(table):
        fail(f"sequence {seq} holds a page twice: {table}")
      if len(table) != self.pages_needed(self._lengths[seq]):
        fail(f"sequence {seq} of length {self._lengths[seq]} holds {len(table)} pages")
      for m, page in enumerate(table):
        if not 0 <= page < self._num_pages or page in nulls:
          fail(f"sequence {seq} holds page {page}, a null page or outside 0..{self._num_pages - 1}")
        if self.shard_of(page) != m % self._shards:
          fail(f"sequence {seq} holds page {page} (shard {self.shard_of(page)}) at slot {m}, which belongs "
               f"on shard {m % self._shards}")
        held[page] += 1
    for page, n in enumerate(self._outside):
      if n < 0 or (n and page in nulls):
        fail(f"page {page} holds {n} outside references")
      held[page] += n
    if held != self._refcount:
      bad = [p for p in range(self._num_pages) if held[p] != self._refcount[p]]
      fail(f"refcounts {[(p, self._refcount[p]) for p in bad]} != tables' counts {[(p, held[p]) for p in bad]}")
    for page in sorted(set(range(self._num_pages)) - nulls):
      if (page in free) == (held[page] > 0):
        fail(f"page {page} is {'both free and held' if page in free else 'neither free nor held'}")
