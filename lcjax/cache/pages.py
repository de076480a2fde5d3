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

Legend: P pages, Z page size, M page-table slots per sequence.
"""
from __future__ import annotations

import heapq

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


class PagePoolExhausted(ValueError):
  """The pool has fewer free pages than a request needs; the pool is left unchanged."""


class PagePool:
  """Free list, per-page reference counts, and per-sequence page tables and lengths.

  Free pages are handed out lowest-first (a heap), so allocation is deterministic. Sequence ids are never
  reused, so a stale id after `free` is an error rather than a silent alias of a newer sequence.
  """

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 2:
      raise ValueError(f"{num_pages=} must be >= 2: page 0 is the reserved null page")
    if page_size < 1:
      raise ValueError(f"{page_size=} must be >= 1")
    # Slot ids go to the device as int32 scatter indices.
    if num_pages * page_size - 1 > _INT32_MAX:
      raise ValueError(f"{num_pages=} * {page_size=} cache slots do not fit int32 slot ids")
    self._num_pages = num_pages
    self._page_size = page_size
    self._free = list(range(1, num_pages))   # a heap; an ascending list already is one
    self._refcount = [0] * num_pages
    self._tables: dict[int, list[int]] = {}
    self._lengths: dict[int, int] = {}
    self._next_seq = 0

  # -- sizes --------------------------------------------------------------------------------------------------

  @property
  def page_size(self) -> int:
    return self._page_size

  @property
  def pages_total(self) -> int:
    """P, the size of the device pool, null page included (so at most P - 1 pages are ever in use)."""
    return self._num_pages

  @property
  def pages_free(self) -> int:
    return len(self._free)

  @property
  def pages_used(self) -> int:
    """Distinct pages held by at least one sequence (a shared page counts once)."""
    return self._num_pages - 1 - len(self._free)

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

  def pages_needed_for(self, seq: int, n_tokens: int) -> int:
    """Free pages that `extend(seq, n_tokens)` takes, the copy-on-write page included."""
    if n_tokens < 0:
      raise ValueError(f"{n_tokens=} must be >= 0")
    have = len(self._table(seq))
    new = self.pages_needed(self._lengths[seq] + n_tokens) - have if n_tokens > 0 else 0
    return new + (self._cow_page(seq, n_tokens) is not None)

  def can_extend(self, seq: int, n_tokens: int) -> bool:
    return self.pages_needed_for(seq, n_tokens) <= len(self._free)

  def extend(self, seq: int, n_tokens: int) -> list[tuple[int, int]]:
    """Reserve room for n_tokens more tokens of seq; return the (src, dst) page copies to do before writing.

    All or nothing: if the pool cannot supply the pages it raises PagePoolExhausted and changes nothing.
    """
    needed = self.pages_needed_for(seq, n_tokens)   # validates seq and n_tokens
    if needed > len(self._free):
      length = self._lengths[seq]
      raise PagePoolExhausted(
          f"sequence {seq} needs {needed} free pages to extend by {n_tokens} tokens (length {length} -> "
          f"{length + n_tokens}, page_size={self._page_size}) but only {len(self._free)} of "
          f"{self._num_pages - 1} allocatable pages are free")
    table = self._table(seq)
    copies = []
    src = self._cow_page(seq, n_tokens)
    if src is not None:
      dst = heapq.heappop(self._free)
      self._refcount[src] -= 1
      self._refcount[dst] = 1
      table[-1] = dst
      copies.append((src, dst))
      needed -= 1
    for _ in range(needed):
      page = heapq.heappop(self._free)
      self._refcount[page] = 1
      table.append(page)
    self._lengths[seq] += n_tokens
    return copies

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
        heapq.heappush(self._free, page)
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

    free = set(self._free)
    if len(free) != len(self._free):
      fail(f"a page is twice in the free list {sorted(self._free)}")
    if 0 in free:
      fail("null page 0 is in the free list")
    if not free <= set(range(1, self._num_pages)):
      fail(f"free list {sorted(free)} holds pages outside 1..{self._num_pages - 1}")
    held = [0] * self._num_pages
    for seq, table in self._tables.items():
      if len(set(table)) != len(table):
        fail(f"sequence {seq} holds a page twice: {table}")
      if len(table) != self.pages_needed(self._lengths[seq]):
        fail(f"sequence {seq} of length {self._lengths[seq]} holds {len(table)} pages")
      for page in table:
        if not 1 <= page < self._num_pages:
          fail(f"sequence {seq} holds page {page} outside 1..{self._num_pages - 1}")
        held[page] += 1
    if held != self._refcount:
      bad = [p for p in range(self._num_pages) if held[p] != self._refcount[p]]
      fail(f"refcounts {[(p, self._refcount[p]) for p in bad]} != tables' counts {[(p, held[p]) for p in bad]}")
    for page in range(1, self._num_pages):
      if (page in free) == (held[page] > 0):
        fail(f"page {page} is {'both free and held' if page in free else 'neither free nor held'}")
