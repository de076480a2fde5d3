"""The host page allocator against two independent oracles.

1. An allocation model: each sequence holds a list of abstract page ids; fork copies the list, extend replaces a
   shared partly filled last id by a fresh one (copy-on-write) and appends fresh ids. After every step the live
   abstract ids and the pool's physical pages must be in one-to-one correspondence (same sharing, no page given
   to two sequences that do not share it), with refcounts equal to the number of holders and no leak.
2. A simulated device pool: the test performs the copies that `extend` returns and writes a unique tag per new
   token through `slot_mapping`; reading every sequence back through `slot_mapping` must give exactly the tokens
   the model says it holds (paged == contiguous). A missing or wrong copy-on-write, or a page still in use handed
   out again, overwrites another sequence's tokens and fails here.
The machine also runs sequence-sharded pools (`shards` > 1): slot m of every table must come from shard m % S,
and exhaustion is judged per shard (the model knows each abstract page's shard from its slot).
"""
from __future__ import annotations

import collections
import time

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the state machine runs under hypothesis: pip install -e '.[test]'")
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from lcjax.cache.pages import PagePool, PagePoolExhausted

_STEPS = {"rules": 0, "exhausted": 0, "cow": 0}


def _ceil_div(a, b):
  return -(-a // b)


def _assert_equal(got, want):
  """np.testing.assert_array_equal (same pass / fail, same report), its report built only when the arrays differ:
  the invariant runs after each of the machine's ~20,000 steps, and the report's checks took most of its time."""
  if not np.array_equal(got, want):
    np.testing.assert_array_equal(got, want)


class PoolMachine(RuleBasedStateMachine):

  @initialize(per_shard=st.integers(2, 40), page_size=st.integers(1, 5), shards=st.integers(1, 3))
  def setup(self, per_shard, page_size, shards):
    num_pages = per_shard * shards
    self.P, self.Z, self.S, self.Pl = num_pages, page_size, shards, per_shard
    self.pool = PagePool(num_pages, page_size, shards=shards)
    self.ids: dict[int, list[int]] = {}      # seq -> abstract page ids
    self.tokens: dict[int, list[int]] = {}   # seq -> tag of each token
    self.dead: list[int] = []
    self.next_id = 0
    self.next_tag = 0
    self.device = np.full(num_pages * page_size, -1, dtype=np.int64)   # [P * Z] one tag per cache slot

  def _pick(self, i):
    live = sorted(self.ids)
    return live[i % len(live)]

  def _fresh_id(self):
    self.next_id += 1
    return self.next_id

  def _holders(self, pid):
    return sum(pid in ids for ids in self.ids.values())

  def _snapshot(self):
    seqs = {s: (self.pool.page_table(s), self.pool.length(s)) for s in self.pool.sequences}
    return seqs, self.pool.pages_free, [self.pool.refcount(p) for p in range(self.P)]

  def _held_on(self, shard):
    """Distinct abstract pages on a shard: a page sits at the same slot in every holder, slot m on shard m % S."""
    return len({pid for ids in self.ids.values() for m, pid in enumerate(ids) if m % self.S == shard})

  @rule()
  def new_sequence(self):
    _STEPS["rules"] += 1
    seq = self.pool.new_sequence()
    assert seq not in self.ids and seq not in self.dead
    self.ids[seq], self.tokens[seq] = [], []

  @precondition(lambda self: self.ids)
  @rule(i=st.integers(0, 1000), n=st.integers(0, 6))
  def extend(self, i, n):
    _STEPS["rules"] += 1
    seq = self._pick(i)
    length = len(self.tokens[seq])
    ids = self.ids[seq]
    cow = n > 0 and length % self.Z != 0 and self._holders(ids[-1]) > 1
    new_slots = list(range(len(ids), _ceil_div(length + n, self.Z))) if n else []
    slots_filled = ([len(ids) - 1] if cow else []) + new_slots
    needed = len(slots_filled)
    need_on = [sum(m % self.S == d for m in slots_filled) for d in range(self.S)]
    free_on = [self.Pl - 1 - self._held_on(d) for d in range(self.S)]
    short = [d for d in range(self.S) if need_on[d] > free_on[d]]
    assert self.pool.pages_needed_for(seq, n) == needed
    assert self.pool.can_extend(seq, n) == (not short)
    assert [self.pool.pages_free_on(d) for d in range(self.S)] == free_on
    if short:
      _STEPS["exhausted"] += 1
      before = self._snapshot()
      d = short[0]
      if self.S == 1:
        match = f"needs {needed} free pages .* {n} tokens .* only {free_on[0]} of {self.P - 1} "
      else:
        match = (f"needs {needed} free pages \\({need_on[d]} of them on seq shard {d} of {self.S}\\) .* {n} "
                 f"tokens .* only {free_on[d]} of {self.Pl - 1} ")
      with pytest.raises(PagePoolExhausted, match=match):
        self.pool.extend(seq, n)
      assert self._snapshot() == before
      return
    old_table = self.pool.page_table(seq)
    held_before = {p for s in self.pool.sequences for p in self.pool.page_table(s)}
    copies = self.pool.extend(seq, n)
    new_table = self.pool.page_table(seq)
    if cow:
      _STEPS["cow"] += 1
      assert copies == [(old_table[-1], new_table[len(old_table) - 1])]
      assert copies[0][1] not in held_before
      ids[-1] = self._fresh_id()
    else:
      assert copies == []
    assert new_table[:len(old_table) - cow] == old_table[:len(old_table) - cow]
    ids.extend(self._fresh_id() for _ in range(len(new_table) - len(old_table)))
    # The device side: copy, then scatter the new tokens' tags.
    for src, dst in copies:
      self.device[dst * self.Z:(dst + 1) * self.Z] = self.device[src * self.Z:(src + 1) * self.Z]
    slots = self.pool.slot_mapping(seq, length, n)
    assert slots.dtype == np.int32 and slots.shape == (n,)
    assert ((slots // self.Z) % self.Pl != 0).all(), "a token was written into a null page"
    tags = list(range(self.next_tag, self.next_tag + n))
    self.next_tag += n
    self.device[slots] = tags
    self.tokens[seq].extend(tags)

  @precondition(lambda self: self.ids)
  @rule(i=st.integers(0, 1000))
  def fork(self, i):
    _STEPS["rules"] += 1
    seq = self._pick(i)
    child = self.pool.fork(seq)
    assert child not in self.ids and child not in self.dead
    assert self.pool.page_table(child) == self.pool.page_table(seq)
    self.ids[child] = list(self.ids[seq])
    self.tokens[child] = list(self.tokens[seq])

  @precondition(lambda self: self.ids)
  @rule(i=st.integers(0, 1000))
  def free(self, i):
    _STEPS["rules"] += 1
    seq = self._pick(i)
    self.pool.free(seq)
    del self.ids[seq], self.tokens[seq]
    self.dead.append(seq)

  @precondition(lambda self: self.dead)
  @rule(i=st.integers(0, 1000))
  def use_freed(self, i):
    _STEPS["rules"] += 1
    seq = self.dead[i % len(self.dead)]
    for op in (self.pool.free, self.pool.length, lambda s: self.pool.extend(s, 1)):
      with pytest.raises(KeyError, match=f"seq={seq}"):
        op(seq)

  @invariant()
  def matches_model(self):
    pool = self.pool
    pool.check()
    assert sorted(pool.sequences) == sorted(self.ids)
    phys_of: dict[int, int] = {}
    for seq, ids in self.ids.items():
      table = pool.page_table(seq)
      assert pool.length(seq) == len(self.tokens[seq])
      assert len(table) == len(ids) == _ceil_div(len(self.tokens[seq]), self.Z)
      for pid, page in zip(ids, table):
        assert phys_of.setdefault(pid, page) == page, "pages shared in the model are not shared in the pool"
    pages = list(phys_of.values())
    assert len(set(pages)) == len(pages), "one page is held by sequences that do not share it"
    assert all(p % self.Pl for p in pages), "a null page was handed out"
    assert pool.pages_free + len(pages) == pool.pages_allocatable == self.P - self.S
    assert pool.pages_used == len(pages)
    holders = collections.Counter(pid for ids in self.ids.values() for pid in set(ids))   # = self._holders(pid)
    for pid, page in phys_of.items():
      assert pool.refcount(page) == holders[pid]
    assert pool.refcount(0) == 0
    # Every sequence at once: row r of the table array and the tokens of seqs[r], concatenated.
    seqs = sorted(self.ids)
    width = 1 + max((len(ids) for ids in self.ids.values()), default=0)
    tables = pool.page_table_array(seqs, width)                  # [len(seqs), M]
    lengths = [len(self.tokens[seq]) for seq in seqs]
    tags = np.array([t for seq in seqs for t in self.tokens[seq]], dtype=np.int64)                 # [T]
    slots = np.concatenate([pool.slot_mapping(seq, 0, n) for seq, n in zip(seqs, lengths)] + [np.zeros(0, int)])
    _assert_equal(self.device[slots], tags)
    # The layout paged attention reads: table slot m holds tokens m*Z .. m*Z+Z-1 in order.
    row = np.repeat(np.arange(len(seqs)), lengths)                                                  # [T]
    pos = np.arange(len(tags)) - np.repeat(np.cumsum([0] + lengths)[:-1], lengths)                    # [T]
    _assert_equal(slots, tables[row, pos // self.Z] * self.Z + pos % self.Z)
    held = np.arange(width)[None, :] < np.array([len(self.ids[seq]) for seq in seqs], int)[:, None]  # [len(seqs), M]
    assert (tables[~held] == 0).all()
    # The placement policy the device relies on: slot m on seq shard m % S.
    m = np.broadcast_to(np.arange(width), tables.shape)
    _assert_equal(tables[held] // self.Pl, m[held] % self.S)


def test_pool_state_machine():
  for k in _STEPS:
    _STEPS[k] = 0
  t0 = time.perf_counter()
  run_state_machine_as_test(PoolMachine, settings=settings(
      max_examples=400, stateful_step_count=60, deadline=None, database=None, derandomize=True,
      suppress_health_check=[HealthCheck.too_slow]))
  print(f"state machine: {_STEPS} in {time.perf_counter() - t0:.1f}s")
  assert _STEPS["rules"] >= 10_000, _STEPS
  # The interesting branches must actually be exercised, not just reachable. The counts are not fixed even with
  # derandomize (53 to 387 exhaustions seen: the draw differs with the process that runs it), so the floor is low.
  assert _STEPS["exhausted"] >= 30 and _STEPS["cow"] >= 30, _STEPS


# -- unit tests -------------------------------------------------------------------------------------------------

def test_constructor_errors_name_values():
  with pytest.raises(ValueError, match="num_pages=1"):
    PagePool(1, 4)
  with pytest.raises(ValueError, match="page_size=0"):
    PagePool(8, 0)
  with pytest.raises(ValueError, match="int32"):
    PagePool(2**20, 2**12)


def test_cow_only_for_shared_partly_filled_last_page():
  pool = PagePool(16, 4)
  full = pool.new_sequence()
  assert pool.extend(full, 8) == []                  # pages [1, 2], both full
  full_child = pool.fork(full)
  assert pool.pages_needed_for(full_child, 1) == 1   # a new page, no copy
  assert pool.extend(full_child, 1) == []
  assert pool.page_table(full_child) == [1, 2, 3]
  assert pool.page_table(full) == [1, 2]

  part = pool.new_sequence()
  pool.extend(part, 6)                               # pages [4, 5], page 5 holds 2 of 4 tokens
  assert pool.extend(part, 1) == []                  # partly filled but not shared: write in place
  child = pool.fork(part)
  assert pool.refcount(5) == 2
  assert pool.extend(child, 0) == []                 # nothing written, nothing copied
  assert pool.pages_needed_for(child, 1) == 1
  assert pool.extend(child, 1) == [(5, 6)]           # length 7 -> 8 fills the copy; no new page
  assert pool.page_table(child) == [4, 6] and pool.page_table(part) == [4, 5]
  assert (pool.refcount(4), pool.refcount(5), pool.refcount(6)) == (2, 1, 1)
  assert pool.extend(part, 1) == []                  # the parent is the sole holder of page 5 again
  assert pool.pages_needed_for(child, 5) == 2
  assert pool.extend(child, 5) == []
  pool.check()


def test_cow_and_growth_in_one_extend():
  pool = PagePool(8, 4)
  a = pool.new_sequence()
  pool.extend(a, 3)                                  # [1]
  b = pool.fork(a)
  assert pool.pages_needed_for(b, 5) == 2            # copy of page 1 plus one page for tokens 4..7
  assert pool.extend(b, 5) == [(1, 2)]
  assert pool.page_table(b) == [2, 3] and pool.length(b) == 8
  pool.check()


def test_exhausted_is_atomic_and_names_numbers():
  pool = PagePool(4, 2)                              # 3 allocatable pages
  a = pool.new_sequence()
  pool.extend(a, 3)                                  # [1, 2], page 2 half full
  b = pool.fork(a)
  assert not pool.can_extend(b, 4)                   # copy + 2 new pages > 1 free
  with pytest.raises(PagePoolExhausted) as e:
    pool.extend(b, 4)
  msg = str(e.value)
  assert isinstance(e.value, ValueError) and "\n" not in msg
  for part in ("sequence 1", "needs 3 free pages", "by 4 tokens", "length 3 -> 7", "page_size=2",
               "only 1 of 3"):
    assert part in msg, (part, msg)
  assert pool.page_table(b) == [1, 2] and pool.length(b) == 3 and pool.pages_free == 1
  assert [pool.refcount(p) for p in range(4)] == [0, 2, 2, 0]
  assert pool.extend(b, 1) == [(2, 3)]               # copy alone fits
  pool.check()


def test_argument_errors():
  pool = PagePool(4, 2)
  s = pool.new_sequence()
  pool.extend(s, 3)
  with pytest.raises(KeyError, match="seq=7"):
    pool.free(7)
  with pytest.raises(KeyError, match="seq=7"):
    pool.fork(7)
  with pytest.raises(ValueError, match="n_tokens=-1"):
    pool.extend(s, -1)
  with pytest.raises(ValueError, match="start=2 .. start \\+ n=4 .*length=3"):
    pool.slot_mapping(s, 2, 2)
  with pytest.raises(ValueError, match="holds 2 pages, more than the table width=1"):
    pool.page_table_array([s], 1)
  with pytest.raises(ValueError, match="page=4"):
    pool.refcount(4)


def test_slot_mapping_by_hand():
  pool = PagePool(8, 4)
  a, b = pool.new_sequence(), pool.new_sequence()
  pool.extend(a, 6)                                  # a: [1, 2]
  pool.extend(b, 3)                                  # b: [3]
  pool.extend(a, 3)                                  # a: [1, 2, 4]
  assert pool.page_table(a) == [1, 2, 4]
  # a's positions 0..8 live at page 1 offsets 0..3, page 2 offsets 0..3, page 4 offset 0.
  np.testing.assert_array_equal(pool.slot_mapping(a, 0, 9), [4, 5, 6, 7, 8, 9, 10, 11, 16])
  np.testing.assert_array_equal(pool.slot_mapping(a, 5, 3), [9, 10, 11])
  np.testing.assert_array_equal(pool.slot_mapping(b, 1, 2), [13, 14])
  assert pool.slot_mapping(b, 3, 0).shape == (0,)
  assert pool.slot_mapping(a, 0, 9).dtype == np.int32
  arr = pool.page_table_array([b, a], 4)
  assert arr.dtype == np.int32
  np.testing.assert_array_equal(arr, [[3, 0, 0, 0], [1, 2, 4, 0]])


def test_freeing_everything_returns_every_page():
  pool = PagePool(10, 3)
  assert pool.pages_total == 10 and pool.pages_free == 9 and pool.pages_needed(10) == 4
  a = pool.new_sequence()
  pool.extend(a, 7)
  b = pool.fork(a)
  pool.extend(b, 4)
  c = pool.fork(b)
  d = pool.new_sequence()
  pool.extend(d, 5)
  assert pool.pages_free < 9
  for s in (b, d, a, c):
    pool.free(s)
    pool.check()
  assert pool.sequences == () and pool.pages_free == 9 and pool.pages_used == 0
  assert all(pool.refcount(p) == 0 for p in range(10))
  # Every allocatable page can be handed out again, and not one more.
  e = pool.new_sequence()
  pool.extend(e, 27)
  assert sorted(pool.page_table(e)) == list(range(1, 10)) and pool.pages_free == 0
  with pytest.raises(PagePoolExhausted):
    pool.extend(e, 1)
  pool.check()


def test_fork_of_empty_sequence():
  pool = PagePool(4, 2)
  a = pool.new_sequence()
  b = pool.fork(a)
  assert pool.page_table(b) == [] and pool.length(b) == 0
  assert pool.extend(b, 1) == [] and pool.page_table(a) == []
  pool.check()


def test_check_detects_corruption():
  pool = PagePool(6, 2)
  s = pool.new_sequence()
  pool.extend(s, 3)
  pool._refcount[1] += 1
  with pytest.raises(AssertionError, match="refcounts"):
    pool.check()
  pool._refcount[1] -= 1
  pool._free[0].append(pool._free[0][0])
  with pytest.raises(AssertionError, match="twice in the free list"):
    pool.check()
  pool._free[0].pop()
  pool._free[0].remove(5)
  with pytest.raises(AssertionError, match="page 5 is neither free nor held"):
    pool.check()
  pool._free[0].append(1)
  with pytest.raises(AssertionError, match="both free and held"):
    pool.check()


# -- sequence-sharded pools -------------------------------------------------------------------------------------

def test_sharded_pool_places_slots_round_robin_by_hand():
  pool = PagePool(12, 2, shards=3)                   # shards own pages 0-3, 4-7, 8-11; nulls 0, 4, 8
  assert (pool.pages_per_shard, pool.pages_allocatable, pool.pages_free) == (4, 9, 9)
  a, b = pool.new_sequence(), pool.new_sequence()
  pool.extend(a, 7)                                  # slots 0..3 -> shards 0, 1, 2, 0
  assert pool.page_table(a) == [1, 5, 9, 2]
  pool.extend(b, 3)
  assert pool.page_table(b) == [3, 6]
  assert [pool.pages_free_on(d) for d in range(3)] == [0, 1, 2]
  np.testing.assert_array_equal(pool.slot_mapping(a, 5, 2), [19, 4])      # page 9 offset 1, page 2 offset 0
  c = pool.fork(b)                                   # b's last page (6, shard 1) is half full and now shared
  assert pool.extend(c, 1) == [(6, 7)]               # the copy stays on the slot's shard
  assert [pool.pages_free_on(d) for d in range(3)] == [0, 0, 2]
  with pytest.raises(PagePoolExhausted, match=r"needs 1 free pages \(1 of them on seq shard 1 of 3\) .* only 0 of 3 "
                     r"allocatable pages of that shard are free"):
    pool.extend(a, 2)                                # slot 4 belongs on shard 1, which is full
  assert pool.can_extend(a, 1) and not pool.can_extend(a, 2)
  pool.check()


def test_sharded_pool_fits_and_errors():
  pool = PagePool(8, 4, shards=2)                    # 3 allocatable pages per shard
  assert pool.fits(6 * 4) and not pool.fits(6 * 4 + 1)    # 7 pages: slots 0, 2, 4, 6 on shard 0
  with pytest.raises(ValueError, match="num_pages=9 is not divisible by shards=2"):
    PagePool(9, 4, shards=2)
  with pytest.raises(ValueError, match="num_pages=2 must be >= 2 per shard"):
    PagePool(2, 4, shards=2)
  with pytest.raises(ValueError, match="shards=0"):
    PagePool(8, 4, shards=0)
  s = pool.new_sequence()
  pool.extend(s, 24)
  assert pool.pages_free == 0
  pool.free(s)
  assert [pool.pages_free_on(d) for d in range(2)] == [3, 3]
  pool.check()
