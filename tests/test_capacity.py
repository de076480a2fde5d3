"""Many requests at once whose total is far beyond the page pool: queued (or refused up front by policy), never a
crash, and every output equal to running that request alone on the same engine (the oracle: a sequence's tokens
depend only on its prompt, its sampling seed and the weights, never on what else is in the pool).

Covered: one call of many prompts (greedy and sampled), several threads calling one engine, streams of one
thread interleaved on one engine, a shared prefix under pool pressure, and a sequence-sharded pool. The host
allocator's own state machine (tests/test_pages.py::test_pool_state_machine) runs in the default suite too.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from lcjax.cache.pages import PagePoolExhausted
from lcjax.config import ModelConfig, RunConfig
from lcjax.engine.engine import Engine, RequestError
from lcjax.tokenizer import Tokenizer
from tests import fixtures_ckpt as fx

# A tiny model with a real (trained byte-level BPE) tokenizer, so that streams yield text as they go.
TINY = ModelConfig("cap-tiny", vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   max_position=4096, bos_id=0, eos_ids=(1,))
# 16 usable pages of 8 tokens: 128 tokens of KV for 4 batch slots, and a request may take the whole pool.
RUN = RunConfig(dtype="float32", page_size=8, num_pages=17, max_context=128, max_batch=4, prefill_chunk=32,
                decode_steps=8)
SAMPLED = dict(temperature=1.0, top_k=40, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  assert fx.byte_level_tokenizer_json(str(path / "tokenizer.json"))["vocab_size"] == TINY.vocab_size
  return Tokenizer(str(path), bos_id=0, eos_ids=[1], add_bos=False)


@pytest.fixture(scope="module")
def eng(tokenizer):
  return Engine.random(TINY, run=RUN, seed=1, tokenizer=tokenizer)


def _prompts(seed, n, lo=1, hi=100):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, TINY.vocab_size, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]


def _watch(eng, monkeypatch):
  """Record the live sequences of every decode call and the pages in use after every admission."""
  seen = {"live": [], "pages": []}
  decode, admit = eng.scheduler.decode_call, eng.scheduler.admit

  def decode_call(live, **kw):
    seen["live"].append(sum(r is not None for r in live))
    return decode(live, **kw)

  def admit_one(r):
    ok = admit(r)
    seen["pages"].append(eng.pool.pages_used)
    return ok
  monkeypatch.setattr(eng.scheduler, "decode_call", decode_call)
  monkeypatch.setattr(eng.scheduler, "admit", admit_one)
  return seen


def _nth(sampling, i):
  """The sampling of prompt i of a batch (its seed + i), for the same prompt run alone."""
  return None if sampling is None else dict(sampling, seed=sampling["seed"] + i)


def _idle(eng):
  assert eng.pool.pages_used == 0 and eng.pool.sequences == ()
  eng.pool.check()


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_many_prompts_beyond_the_pool_equal_each_alone(eng, monkeypatch, sampling):
  prompts = _prompts(0 if sampling is None else 1, 24)
  need = sum(-(-(len(p) + 12) // RUN.page_size) for p in prompts)
  assert need > 5 * eng.pool.pages_allocatable           # several pools' worth, queued
  alone = [eng.generate(p, max_new_tokens=12, sampling=_nth(sampling, i)).token_ids for i, p in enumerate(prompts)]
  seen = _watch(eng, monkeypatch)
  together = [r.token_ids for r in eng.generate(prompts, max_new_tokens=12, sampling=sampling)]
  assert together == alone
  assert max(seen["live"]) > 1                            # sequences decoded together ...
  assert max(seen["pages"]) >= eng.pool.pages_allocatable - 2   # ... and so did the pool
  assert eng.peak_pages_used <= eng.pool.pages_allocatable
  _idle(eng)


def test_threads_on_one_engine_queue_and_equal_each_alone(eng):
  """Each thread's call runs whole, one after another (the cache is donated through every step, so two runs
  must not interleave their device calls); none fails and none sees another's tokens."""
  jobs = [(_prompts(10 + t, 3, hi=60), dict(temperature=0.5 + 0.1 * t, top_k=0, top_p=0.95, seed=t))
          for t in range(6)]
  alone = [[eng.generate(p, max_new_tokens=10, sampling=_nth(s, i)).token_ids for i, p in enumerate(ps)]
           for ps, s in jobs]
  got, errors = [None] * len(jobs), []
  start = threading.Barrier(len(jobs))

  def work(t):
    try:
      start.wait()
      ps, s = jobs[t]
      got[t] = [r.token_ids for r in eng.generate(ps, max_new_tokens=10, sampling=s)]
    except BaseException as e:  # noqa: BLE001 - reported below with the thread's index
      errors.append((t, repr(e)))
  threads = [threading.Thread(target=work, args=(t,)) for t in range(len(jobs))]
  for th in threads:
    th.start()
  for th in threads:
    th.join(timeout=300)
  assert not errors, errors
  assert got == alone
  _idle(eng)


def _drain(streams):
  """Advance generators round-robin until all finish; returns {name: exception} of those that raised."""
  failed, live = {}, dict(streams)
  while live:
    for name, g in list(live.items()):
      try:
        next(g)
      except StopIteration:
        del live[name]
      except Exception as e:  # noqa: BLE001 - collected for the caller
        failed[name] = e
        del live[name]
  return failed


def test_interleaved_streams_equal_each_alone_and_an_unadmittable_one_is_refused(eng):
  """Streams of one thread advanced in turn share the pool. Two that fit run to the end with their own
  tokens; a third whose first request finds too few free pages, with none of its own running to wait for,
  is refused with a PagePoolExhausted that says why, and the other two go on unharmed."""
  a, b = _prompts(20, 2, lo=5, hi=10), _prompts(21, 2, lo=5, hi=10)   # at most 4 pages each: 16 in all
  c = _prompts(22, 1, lo=90, hi=90)                                       # 106 tokens: 14 pages
  sa, sb = dict(SAMPLED, seed=1), dict(SAMPLED, seed=2, temperature=0.7)
  want_a = [eng.generate(p, max_new_tokens=16, sampling=_nth(sa, i)).token_ids for i, p in enumerate(a)]
  want_b = [eng.generate(p, max_new_tokens=16, sampling=_nth(sb, i)).token_ids for i, p in enumerate(b)]
  want_c = eng.generate(c[0], max_new_tokens=16).token_ids
  texts = {}
  ga = eng.generate_stream(a, max_new_tokens=16, sampling=sa)
  gb = eng.generate_stream(b, max_new_tokens=16, sampling=sb)
  def keep(name, g):
    yield from g
    texts[name] = [r.token_ids for r in eng.last_results]
  failed = _drain({"a": keep("a", ga), "b": keep("b", gb),      # c starts once a and b hold their pages
                   "c": keep("c", eng.generate_stream(c, max_new_tokens=16))})
  assert set(failed) == {"c"} and isinstance(failed["c"], PagePoolExhausted), failed
  msg = str(failed["c"])
  assert "request 0 cannot be admitted" in msg and "of 16 pages are free" in msg and "generate_stream" in msg, msg
  assert texts["a"] == want_a and texts["b"] == want_b
  _idle(eng)
  assert eng.generate(c[0], max_new_tokens=16).token_ids == want_c     # alone it fits


def test_shared_prefix_under_pool_pressure(eng):
  """A prefix's pages stay held while its requests run, beside each request's copy of its partly filled last
  page: a request that fits alone but not beside the prefix is refused up front (never left unadmittable), and
  many requests sharing the prefix queue through the pool with the tokens they have without the prefix."""
  prefix = _prompts(30, 1, lo=20, hi=20)[0]                # 2 full pages + 4 tokens
  big = _prompts(31, 1, lo=96, hi=96)[0]                   # 20 + 96 + 12 = 128 tokens: the whole pool alone
  with pytest.raises(RequestError, match=r"needs 17 pages \(128 tokens, with the shared prefix's pages held "
                                         r"beside them\) but the pool has only 16 pages"):
    eng.generate([big], max_new_tokens=12, prefix=prefix)
  _idle(eng)
  assert len(eng.generate(prefix + big, max_new_tokens=12).token_ids) == 12
  # 120 tokens: 15 pages alone; beside the prefix, 3 of its pages + a copy of the third + 12 more = 16.
  fits = _prompts(32, 1, lo=88, hi=88)[0]
  suffixes = [fits] + _prompts(33, 11, lo=5, hi=60)
  alone = [eng.generate(prefix + s, max_new_tokens=12).token_ids for s in suffixes]
  got = [r.token_ids for r in eng.generate(suffixes, max_new_tokens=12, prefix=prefix)]
  assert got == alone
  assert eng.peak_pages_used <= eng.pool.pages_allocatable
  _idle(eng)


def test_sequence_sharded_pool_beyond_capacity_equals_each_alone(eng):
  """A pool split over 2 seq shards (8 usable pages each; slot m of a table on shard m % 2): requests beyond it
  queue, and each output equals the request alone on the one-device engine with the same weights (same seed)."""
  run = RUN.replace(seq=2, num_pages=16, max_batch=3)
  sharded = Engine.random(TINY, run=run, seed=1)
  prompts = _prompts(40, 12, hi=95)                      # up to 107 tokens: 14 pages, 7 on each shard
  alone = [eng.generate(p, max_new_tokens=12).token_ids for p in prompts]
  assert [r.token_ids for r in sharded.generate(prompts, max_new_tokens=12)] == alone
  _idle(sharded)
  # 120 tokens: 15 pages, 8 on shard 0 (slots 0, 2, .., 14) where only 7 are allocatable
  with pytest.raises(RequestError, match=r"needs 15 pages \(120 tokens\), 8 of them on seq shard 0, but each of "
                                         r"the 2 seq shards has only 7 pages"):
    sharded.generate([[5] * 108], max_new_tokens=12)
  _idle(sharded)


def test_more_prompts_than_slots_that_finish_at_prefill(eng):
  """max_new_tokens=1 finishes every request at its prefill: each gives its pages back at once and the next is
  admitted, however many there are beyond max_batch."""
  prompts = _prompts(50, 9, hi=60)
  alone = [eng.generate(p, max_new_tokens=1).token_ids for p in prompts]
  assert [r.token_ids for r in eng.generate(prompts, max_new_tokens=1)] == alone
  _idle(eng)


def test_soak_of_mixed_calls_leaves_every_page_free_and_tokens_unchanged(eng):
  """A seeded mix of calls on one engine: batches beyond max_batch, max_new_tokens=1, sampling, refused
  requests, abandoned streams, a pinned context. Afterwards every page is free (or only cached) and greedy
  tokens equal a fresh engine's."""
  rng = np.random.default_rng(77)
  probe = _prompts(60, 3, hi=40)
  for step in range(40):
    kind = rng.integers(0, 6)
    prompts = _prompts(int(rng.integers(1 << 20)), int(rng.integers(1, 9)), hi=70)
    new = int(rng.choice([1, 2, 9]))
    sampling = SAMPLED if kind == 1 else None
    if kind == 2:                                           # refused up front: nothing may leak
      with pytest.raises(RequestError):
        eng.generate(prompts + [[5] * 200], max_new_tokens=new)
    elif kind == 3:                                         # a stream abandoned midway
      g = eng.generate_stream(prompts, max_new_tokens=new + 8)
      next(g, None)
      g.close()
    elif kind == 4:                                         # a pinned context, questions on it, closed
      with eng.prefill(prompts[0][:30]) as ctx:
        eng.generate([p[:20] for p in prompts[1:]] or [[7]], max_new_tokens=new, context=ctx)
    else:
      eng.generate(prompts, max_new_tokens=new, sampling=sampling)
    assert eng.pool.pages_used == 0, step
    eng.pool.check()
    eng.prefix_cache.check()
  fresh = Engine.random(TINY, run=RUN, seed=1)
  assert [r.token_ids for r in eng.generate(probe, max_new_tokens=12)] == \
      [r.token_ids for r in fresh.generate(probe, max_new_tokens=12)]
  _idle(eng)
