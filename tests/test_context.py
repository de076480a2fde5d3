"""The context cache on a tiny float32 model: cached == uncached, pinned contexts, save / restore, offload.

The oracle is the engine's uncached full forward (`Engine.logits`: no pages, no paged attention): a prompt's
logits through cached, pinned, restored or loaded pages equal its logits at 1e-5, and every generated token is
the argmax of the uncached logits before it. (An engine without a prefix cache is no oracle: it reads its pages
through the same paged path, so a bug there cancels out.) fp8 pages, which the uncached forward does not
quantize, are checked bit for bit against the pages they were saved or offloaded from.
"""
from __future__ import annotations

import dataclasses
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.config import RunConfig, preset
from lcjax.engine import context as ctxlib, context_file
from lcjax.engine.context import ContextError
from lcjax.engine.engine import Engine, RequestError
from tests.run_cache import REPO, cpu_env

TINY = dataclasses.replace(preset("tiny"), eos_ids=())
RUN = RunConfig(dtype="float32", page_size=8, prefill_chunk=32, max_context=256, max_batch=3, decode_steps=16)
RNG = np.random.default_rng(11)
DOC = RNG.integers(3, TINY.vocab_size, 45).tolist()          # ends inside page 5
DOC48 = RNG.integers(3, TINY.vocab_size, 48).tolist()        # ends on a page boundary
QS = [RNG.integers(3, TINY.vocab_size, n).tolist() for n in (5, 9, 14)]


def _engine(**kw):
  return Engine.random(TINY, run=RUN.replace(**kw), seed=3)


_SHARED: dict = {}


def _shared(n: int = 0, **kw):
  """Engine n (0, 1, ...) of the module's engines of RUN with `kw`, as a new `_engine(**kw)` is: idle, its prefix
  cache empty and its pool's pages zeros (a page a load or restore failed to write must not hold an earlier test's
  K/V of the same document), but its programs traced and lowered once for the module (each new engine traces and
  lowers its programs again; the run's compilation cache saves only their XLA compilation). A test that moves
  pages between two engines of one configuration asks for two (n=0, n=1). An engine a failed test left busy is
  replaced by a new one. Not for a test that patches what the programs trace (tests.patch_kv): its engines are
  its own."""
  key = (RUN.replace(**kw), n)
  e = _SHARED.get(key)
  if e is None or _busy(e):
    e = _SHARED[key] = _engine(**kw)
  e.prefix_cache.clear()
  _idle(e)
  _zero_pool(e)
  return e


def _zero_pool(e) -> None:
  """An idle engine's pool becomes a new engine's: zeros (what a page no load or restore wrote then holds)."""
  e.scheduler.cache = e.scheduler._new_cache()


@pytest.fixture(autouse=True)
def _shared_engines_idle_after(request):
  """After a test that passed, every shared engine is idle and its books are consistent: a test that leaks pages,
  sequences or pins fails itself, instead of its engine being replaced unseen by the next `_shared` (which replaces
  only what a failed test left)."""
  failed = request.session.testsfailed
  yield
  if request.session.testsfailed != failed:
    return
  for (run, n), e in _SHARED.items():
    try:
      _idle(e)
    except AssertionError as err:
      pytest.fail(f"{request.node.name} left shared engine {n} of {run} busy or inconsistent: {err}")


@pytest.fixture(scope="module")
def eng():
  return _shared()


def _uncached(eng, ids) -> np.ndarray:
  """The oracle: float32 logits [len(ids), V] of the engine's full causal forward over ids, without a cache. The
  ids are padded to 128 or 256 tokens (two compiled shapes); causal attention keeps the padding out of every
  earlier position."""
  T = 128 if len(ids) <= 128 else 256
  return eng.logits([list(ids) + [0] * (T - len(ids))])[0, :len(ids)]


def _assert_uncached_logits(eng, logits, ids):
  """logits [V] (of the last of `ids`, through pages) are the uncached forward's."""
  np.testing.assert_allclose(logits, _uncached(eng, ids)[-1], rtol=1e-5, atol=1e-5)


def _assert_greedy(eng, prompt, out):
  """`out` is the uncached forward's greedy continuation of `prompt`: each token the argmax of the logits of the
  position before it (one forward over prompt + out gives them all)."""
  logits = _uncached(eng, list(prompt) + list(out))
  assert list(out) == [int(np.argmax(logits[len(prompt) - 1 + i])) for i in range(len(out))]


def _pages(eng, pages) -> list[np.ndarray]:
  """What `pages` of the pool hold, with the model's own KV heads: K, V [L, n, Z, K, H] (and fp8 scales [L, n, K])."""
  rep = eng.kv_rep
  k, v, *scales = (np.asarray(x)[:, list(pages)] for x in eng.cache.parts())
  return [k[..., ::rep, :], v[..., ::rep, :], *(s[..., ::rep] for s in scales)]


def _busy(eng):
  """What an engine holds for requests or contexts (falsy when idle): pages in use, sequences, pinned contexts."""
  return eng.pool.pages_used or eng.pool.sequences or eng.scheduler.pinned


def _idle(eng):
  assert not _busy(eng), (eng.pool.pages_used, eng.pool.sequences, eng.scheduler.pinned)
  eng.pool.check()
  if eng.prefix_cache is not None:
    eng.prefix_cache.check()


@pytest.mark.parametrize("doc", [DOC, DOC48], ids=["inside-a-page", "page-boundary"])
def test_second_question_reuses_the_document(eng, doc):
  eng.prefix_cache.clear()
  first = eng.generate(doc + QS[0], max_new_tokens=12)
  second = eng.generate(doc + QS[1], max_new_tokens=12)
  assert first.stats["cached_tokens"] == 0
  assert second.stats["cached_tokens"] == len(doc) // 8 * 8
  assert second.stats["prefill_tokens"] == len(doc) + len(QS[1]) - second.stats["cached_tokens"]
  _assert_greedy(eng, doc + QS[0], first.token_ids)
  _assert_greedy(eng, doc + QS[1], second.token_ids)
  _assert_uncached_logits(eng, eng.prompt_logits(doc + QS[2][:3]), doc + QS[2][:3])
  _idle(eng)


def test_the_same_prompt_twice_recomputes_only_its_last_page(eng):
  eng.prefix_cache.clear()
  prompt = DOC48 + QS[0][:8]                       # 56 tokens: 7 full pages
  a = eng.generate(prompt, max_new_tokens=6)
  b = eng.generate(prompt, max_new_tokens=6)
  assert b.stats["cached_tokens"] == 48            # the last token's logits are needed: its page is computed
  assert a.token_ids == b.token_ids
  _assert_greedy(eng, prompt, b.token_ids)


def test_generated_tokens_are_cached_for_the_next_turn(eng):
  """A chat's next turn repeats the previous answer: its pages were kept when the request ended, and the next
  turn reads the K/V that decode wrote there (positions 45 .. 63) as the uncached forward computes them."""
  eng.prefix_cache.clear()
  turn1 = eng.generate(DOC, max_new_tokens=20)
  _assert_greedy(eng, DOC, turn1.token_ids)
  follow = DOC + turn1.token_ids + QS[0]
  _assert_uncached_logits(eng, eng.prompt_logits(follow), follow)
  turn2 = eng.generate(follow, max_new_tokens=8)
  assert turn2.stats["cached_tokens"] == (len(DOC) + 20 - 1) // 8 * 8
  _assert_greedy(eng, follow, turn2.token_ids)


def test_eviction_under_pressure_then_a_correct_recompute():
  eng = _engine(num_pages=13, max_batch=2)         # 12 usable pages: 96 tokens
  a = DOC + QS[0]                                  # 50 tokens + 6 = 7 pages, 6 of them kept
  want_a = eng.generate(a, max_new_tokens=6).token_ids
  _assert_greedy(eng, a, want_a)
  assert eng.pool.pages_cached == 6
  b = RNG.integers(3, TINY.vocab_size, 80).tolist()
  _assert_greedy(eng, b, eng.generate(b, max_new_tokens=10).token_ids)
  assert eng.prefix_cache.match(a) == []          # b needed all 12 pages: a's were evicted
  again = eng.generate(a, max_new_tokens=6)
  assert again.stats["cached_tokens"] == 0 and again.token_ids == want_a
  _idle(eng)


def test_eviction_never_takes_pages_in_use():
  """Two runs of one thread: the first holds cached pages it adopted; the second's admission must not evict
  them."""
  eng = _engine(num_pages=15, max_batch=2)                   # 14 usable pages
  a, c = DOC + QS[0], RNG.integers(3, TINY.vocab_size, 17).tolist()
  eng.generate(a, max_new_tokens=2)                          # a's 6 full pages cached
  eng.generate(c, max_new_tokens=2)                          # c's 2 full pages cached
  ra = eng._make_requests([a], 30, None)
  sa = eng.scheduler.serve(ra)
  next(sa)                                                   # a is prefilled on its 6 cached pages
  assert ra[0].cached == 48 and eng.pool.pages_used == 10 and eng.pool.pages_free == 2
  b = RNG.integers(3, TINY.vocab_size, 25).tolist()          # 30 tokens: 4 pages, 2 of them evicted
  got_b = eng.generate(b, max_new_tokens=5).token_ids
  assert eng.prefix_cache.match(c) == [] and len(eng.prefix_cache.match(a)) == 6
  for _ in sa:
    pass
  _assert_greedy(eng, b, got_b)
  _assert_greedy(eng, a, eng._result(ra[0]).token_ids)
  _idle(eng)


def test_a_batch_on_a_pinned_context(eng):
  with eng.prefill(DOC) as ctx:
    assert len(ctx) == len(DOC) and eng.scheduler.pinned
    got = [r.token_ids for r in eng.generate(QS, max_new_tokens=10, context=ctx)]
    stats = [r.stats for r in eng.last_results]
    again = eng.generate(QS[1], max_new_tokens=10, context=ctx).token_ids
    _assert_uncached_logits(eng, eng.prompt_logits(QS[2], context=ctx), DOC + QS[2])
  for q, out in zip(QS, got):
    _assert_greedy(eng, DOC + q, out)
  assert again == got[1]
  assert all(s["cached_tokens"] == len(DOC) for s in stats)
  _idle(eng)
  with pytest.raises(RequestError, match="closed"):
    eng.generate(QS[0], max_new_tokens=2, context=ctx)


def test_several_contexts_count_against_the_pool():
  eng = _shared(num_pages=17, max_batch=2)        # 16 usable pages
  c1 = eng.prefill(DOC)                           # 6 pages
  c2 = eng.prefill(DOC48 + [5] * 20)              # 9 pages
  assert eng.scheduler.pinned_pages() == 15
  with pytest.raises(Exception, match="pinned context"):
    eng.generate(QS[2], max_new_tokens=20)        # needs 5 pages, 1 is free
  c1.close()
  assert len(eng.generate(QS[2], max_new_tokens=20).token_ids) == 20
  c2.close()
  _idle(eng)


def test_context_continuation_gets_no_second_bos(eng):
  from lcjax.tokenizer import Tokenizer
  from tests import fixtures_ckpt as fx
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    fx.byte_level_tokenizer_json(os.path.join(d, "tokenizer.json"))
    tok = Tokenizer(d, bos_id=1, eos_ids=[2], add_bos=True)
  limits = eng.limits
  eng.tokenizer, eng.limits = tok, dataclasses.replace(limits, vocab_size=300)   # the tokenizer's vocabulary
  try:
    plain = eng._make_requests(["hello"], 1, None)[0].prompt
    cont = eng._make_requests(["hello"], 1, None, head=[7, 8])[0].prompt
  finally:
    eng.tokenizer, eng.limits = None, limits
  assert plain[0] == 1 and plain.count(1) == 1
  assert cont[:2] == [7, 8] and 1 not in cont and cont[2:] == plain[1:]


def test_save_and_restore_in_a_new_engine(tmp_path):
  eng = _shared()
  ctx = eng.prefill(DOC)
  ctx.save(tmp_path / "doc")
  assert sorted(os.listdir(tmp_path)) == ["doc"]
  fresh = _shared(n=1)
  restored = fresh.load_context(tmp_path / "doc")
  assert restored.token_ids == DOC and restored.stats["cached_tokens"] == 0
  for x, y in zip(_pages(fresh, restored.pages()), _pages(eng, ctx.pages()), strict=True):   # K, V
    np.testing.assert_array_equal(x, y)
  for q, r in zip(QS[:2], fresh.generate(QS[:2], max_new_tokens=10, context=restored)):
    _assert_greedy(fresh, DOC + q, r.token_ids)
  _assert_uncached_logits(fresh, fresh.prompt_logits(QS[2], context=restored), DOC + QS[2])
  restored.close()
  ctx.close()
  _idle(fresh)


def test_a_killed_save_leaves_nothing_that_loads(tmp_path, monkeypatch):
  eng = _shared()
  ctx = eng.prefill(DOC)
  real = ctxlib._blocks_out

  def dies(engine, pages):
    it = real(engine, pages)
    yield next(it)
    raise KeyboardInterrupt
  monkeypatch.setattr(ctxlib, "_blocks_out", dies)
  with pytest.raises(KeyboardInterrupt):
    ctx.save(tmp_path / "doc")
  assert os.listdir(tmp_path) == []
  with pytest.raises(ContextError, match="no such context"):
    eng.load_context(tmp_path / "doc")
  os.makedirs(tmp_path / "half")
  with pytest.raises(ContextError, match="not a complete saved context"):
    eng.load_context(tmp_path / "half")
  ctx.close()


@pytest.mark.parametrize("change, names", [
    (dict(page_size=16), ["page_size: saved 8, this engine 16"]),
    (dict(dtype="bfloat16"), ["cache_dtype: saved 'float32', this engine 'bfloat16'; dtype: saved 'float32', this "
                              "engine 'bfloat16'; weight_dtype: saved 'float32', this engine 'bfloat16'; weights:"]),
    (dict(weight_dtype="float8_e4m3fn"), ["weight_dtype: saved 'float32', this engine 'float8_e4m3fn'; weights:"]),
    (dict(seed=4), ["another model or run config: weights: saved"]),
])
def test_a_mismatched_restore_is_refused(tmp_path, change, names):
  eng = _shared()
  with eng.prefill(DOC) as ctx:
    ctx.save(tmp_path / "doc")
  change = dict(change)             # the parametrize dict itself stays whole for a rerun
  seed = change.pop("seed", 3)
  other = _shared(**change) if seed == 3 else Engine.random(TINY, run=RUN.replace(**change), seed=seed)
  with pytest.raises(ContextError) as e:
    other.load_context(tmp_path / "doc")
  assert "\n" not in str(e.value)
  for name in names:
    assert name in str(e.value), str(e.value)
  _idle(other)


def test_an_fp8_context_saved_with_unrotated_keys_is_refused():
  """fp8 pages hold the keys rotated (lcjax.model.llama); a context saved before then holds them as computed, and
  its fingerprint lacks `key_layout`: refused, naming both layouts. A cache dtype that differs says it alone."""
  from lcjax.config import WeightFormat
  from lcjax.engine import context_file
  fp8 = RUN.replace(cache_dtype="float8_e4m3fn")
  mine = context_file.fingerprint(TINY, fp8, WeightFormat(), "digest")
  older = {k: v for k, v in mine.items() if k != "key_layout"}
  with pytest.raises(ContextError, match=r"saved by another model or run config: key_layout: saved 'unrotated', "
                                         r"this engine 'rotated'$"):
    context_file.check_fingerprint("doc.ctx", dict(fingerprint=older), mine)
  context_file.check_fingerprint("doc.ctx", dict(fingerprint=dict(mine)), mine)
  f32 = context_file.fingerprint(TINY, RUN, WeightFormat(), "digest")
  assert "key_layout" not in f32
  assert context_file.mismatches(f32, mine) == ["cache_dtype: saved 'float32', this engine 'float8_e4m3fn'"]
  assert context_file.mismatches(mine, f32) == ["cache_dtype: saved 'float8_e4m3fn', this engine 'float32'"]


@pytest.mark.parametrize("save_at, load_at", [((2, 1), (1, 1)), ((1, 4), (2, 2))],
                         ids=["seq2-to-1", "tensor4-to-seq2-tensor2"])
def test_restore_across_meshes(tmp_path, save_at, load_at):
  """Pages saved from one mesh restore onto another (tensor=4 repeats the 2 KV heads: saved once each)."""
  (s1, t1), (s2, t2) = save_at, load_at
  a = _shared(seq=s1, tensor=t1)
  with a.prefill(DOC) as ctx:
    ctx.save(tmp_path / "doc")
  b = _shared(seq=s2, tensor=t2)
  with b.load_context(tmp_path / "doc") as ctx:
    got = [r.token_ids for r in b.generate(QS[:2], max_new_tokens=8, context=ctx)]
    _assert_uncached_logits(b, b.prompt_logits(QS[2], context=ctx), DOC + QS[2])
  for q, out in zip(QS[:2], got):
    _assert_greedy(b, DOC + q, out)
  _idle(b)


def test_offload_and_restore():
  eng = _shared(num_pages=17, max_batch=2)
  ctx = eng.prefill(DOC)
  want = eng.generate(QS[0], max_new_tokens=10, context=ctx).token_ids
  _assert_greedy(eng, DOC + QS[0], want)
  ctx.offload()
  assert not ctx.on_device and not eng.scheduler.pinned
  with pytest.raises(RequestError, match="offloaded"):
    eng.generate(QS[0], max_new_tokens=2, context=ctx)
  eng.generate(RNG.integers(3, TINY.vocab_size, 104).tolist(), max_new_tokens=24)   # all 16 pages: evicts it
  ctx.restore()
  assert ctx.stats["cached_tokens"] == 0
  assert eng.generate(QS[0], max_new_tokens=10, context=ctx).token_ids == want
  _assert_uncached_logits(eng, eng.prompt_logits(QS[1], context=ctx), DOC + QS[1])
  ctx.offload()
  ctx.restore()                                    # nothing evicted meanwhile: shares the cached full pages
  assert ctx.stats["cached_tokens"] == 40
  assert eng.generate(QS[0], max_new_tokens=10, context=ctx).token_ids == want
  _assert_uncached_logits(eng, eng.prompt_logits(QS[1], context=ctx), DOC + QS[1])
  ctx.close()
  _idle(eng)


def _slow_pins(eng, monkeypatch, seconds=0.3):
  """Each pin of eng's scheduler takes `seconds` longer: a window for a second thread's call."""
  import time as _time
  pin = eng.scheduler.pin

  def slow(*a, **kw):
    _time.sleep(seconds)
    return pin(*a, **kw)
  monkeypatch.setattr(eng.scheduler, "pin", slow)


def test_two_threads_restoring_one_context_pin_it_once(monkeypatch):
  """Two threads restore one offloaded context at once: one restores it, the other is refused in one line, and
  close() then frees all of it (both pinned it, and close freed one)."""
  import threading
  eng = _shared()
  ctx = eng.prefill(DOC)
  ctx.offload()
  _slow_pins(eng, monkeypatch)
  errors, barrier = [], threading.Barrier(2)

  def restore():
    barrier.wait()
    try:
      ctx.restore()
    except RequestError as e:
      errors.append(str(e))

  threads = [threading.Thread(target=restore) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == ["this context is being restored by another thread"], errors
  assert ctx.on_device and len(eng.scheduler.pinned) == 1
  ctx.close()
  _idle(eng)


def test_close_during_a_restore_gives_its_pages_back(monkeypatch):
  import threading
  eng = _shared()
  ctx = eng.prefill(DOC)
  ctx.offload()
  _slow_pins(eng, monkeypatch)
  errors = []

  def restore():
    try:
      ctx.restore()
    except RequestError as e:
      errors.append(str(e))

  t = threading.Thread(target=restore)
  t.start()
  while not ctx._restoring:
    pass
  ctx.close()
  t.join()
  assert errors == ["this context was closed while it was being restored"] and ctx.closed
  _idle(eng)


@pytest.mark.parametrize("dtype, cache_dtype", [("bfloat16", "auto"), ("bfloat16", "float8_e4m3fn")])
def test_low_precision_pools_move_bit_identically(tmp_path, dtype, cache_dtype):
  """bf16 and fp8 pools (no buffer protocol of their own in numpy) through host memory and disk, unchanged, fp8
  pages with their scales."""
  eng = _shared(dtype=dtype, cache_dtype=cache_dtype)
  ctx = eng.prefill(DOC)

  def pages(ctx):
    return [np.asarray(x)[:, ctx.pages()] for x in eng.cache.parts()]

  before = pages(ctx)
  assert len(before) == (4 if cache_dtype == "float8_e4m3fn" else 2)
  want = eng.generate(QS[0], max_new_tokens=6, context=ctx).token_ids
  ctx.offload()
  eng.prefix_cache.clear()
  _zero_pool(eng)                   # the restore must write every page, not find the prefill's still there
  ctx.restore()
  for a, b in zip(pages(ctx), before):
    np.testing.assert_array_equal(a, b)
  ctx.save(tmp_path / "c")
  ctx.close()
  eng.prefix_cache.clear()
  _zero_pool(eng)
  with eng.load_context(tmp_path / "c") as ctx:
    for a, b in zip(pages(ctx), before):
      np.testing.assert_array_equal(a, b)
    assert eng.generate(QS[0], max_new_tokens=6, context=ctx).token_ids == want


def test_a_lost_cache_voids_every_request_and_context_of_its_epoch(monkeypatch):
  """A step interrupted inside its device call loses the whole cache. A request of another run of this thread
  and a pinned context, both admitted before, are refused from then on; nothing of theirs enters the prefix
  cache, so a later request computes its prompt afresh and right."""
  eng = _engine()
  rb = eng._make_requests([DOC48 + QS[0]], 20, None)
  sb = eng.scheduler.serve(rb)
  next(sb)                                               # B is prefilled and waits to decode
  ctx = eng.prefill(DOC)
  real = eng.steps.prefill

  def dies(*a, **kw):
    real(*a, **kw)                                       # the cache went into the call ...
    raise KeyboardInterrupt                              # ... and never came back
  monkeypatch.setattr(eng.steps, "prefill", dies)
  with pytest.raises(KeyboardInterrupt):
    eng.generate(QS[2] * 3, max_new_tokens=2)
  monkeypatch.undo()
  with pytest.raises(RequestError, match="lost their cache"):
    for _ in sb:
      pass
  with pytest.raises(RequestError, match="lost when a device step was interrupted"):
    eng.generate(QS[1], max_new_tokens=4, context=ctx)
  ctx.close()
  again = eng.generate(DOC48 + QS[1], max_new_tokens=10)
  assert again.stats["cached_tokens"] == 0
  _assert_greedy(eng, DOC48 + QS[1], again.token_ids)
  _idle(eng)


def test_a_closed_engine_refuses_work_and_allocates_nothing():
  eng = _engine()
  ctx = eng.prefill(DOC)
  eng.close()
  for call in (lambda: eng.generate(QS[0], max_new_tokens=2), lambda: eng.prefill(DOC),
               lambda: eng.logits([QS[0]]), lambda: eng.generate(QS[0], max_new_tokens=2, context=ctx)):
    with pytest.raises(RequestError, match="engine is closed"):
      call()
  assert eng.cache.k.is_deleted() and eng.pool.pages_used == 0 and not eng.scheduler.pinned


def test_a_context_dropped_unclosed_gives_its_pages_back():
  import gc
  eng = _shared()
  for _ in range(3):
    ctx = eng.prefill(DOC)                               # each rebinding drops the previous Context
  del ctx
  gc.collect()
  eng.generate(QS[0], max_new_tokens=2)                  # the scheduler unpins orphans at its next call
  _idle(eng)


def test_closing_a_context_under_a_running_stream_is_a_clear_error():
  eng = _shared(max_batch=1)
  ctx = eng.prefill(DOC)
  reqs = eng._make_requests(QS, 4, None, head=ctx.token_ids)
  for r in reqs:
    r.prefix_seq = ctx.seq
  stream = eng.scheduler.serve(reqs)
  next(stream)
  ctx.close()
  with pytest.raises(RequestError, match="context was closed or offloaded"):
    for _ in stream:
      pass
  _idle(eng)


def test_closing_the_engine_under_a_suspended_stream_is_a_clear_error():
  """Engine.close() while a stream waits between steps: its next step is refused in one line (it read the deleted
  cache: RuntimeError 'Array has been deleted')."""
  eng = _engine()
  stream = eng.scheduler.serve(eng._make_requests(QS, 40, None), decode_steps=2)   # generate_stream's steps
  next(stream)
  eng.close()
  with pytest.raises(RequestError, match="^this engine is closed: load or make a new one$"):
    next(stream)


def test_an_fp8_context_restores_on_another_mesh(tmp_path):
  """fp8 pages saved from (seq, tensor) = (2, 2) (KV heads repeated 2x there) load on one device with their scales,
  bit for bit."""
  a = _shared(seq=2, tensor=2, cache_dtype="float8_e4m3fn")
  with a.prefill(DOC) as ctx:
    saved = _pages(a, ctx.pages())
    ctx.save(tmp_path / "doc")
  b = _shared(cache_dtype="float8_e4m3fn")
  want = b.generate(DOC + QS[0], max_new_tokens=8).token_ids
  b.prefix_cache.clear()
  with b.load_context(tmp_path / "doc") as ctx:
    assert ctx.stats["cached_tokens"] == 0
    for x, y in zip(_pages(b, ctx.pages()), saved, strict=True):
      np.testing.assert_array_equal(x, y)
    assert b.generate(QS[0], max_new_tokens=8, context=ctx).token_ids == want
  _idle(b)


def _spread_kv(monkeypatch):
  """Scale the K and V the model computes at position p by 4^(p // 8) and 8 * 4^(p // 8): every page then gets
  fp8 scales of its own, K's apart from V's. (The tiny model's own K and V sit under the fp8 scale floor, where
  every page has the same scale and a scale written to the wrong page or part goes unseen.)"""
  from tests.patch_kv import scale_kv_by_position
  scale_kv_by_position(monkeypatch, lambda p: jnp.exp2(2 * (p // 8).astype(jnp.float32)),
                       lambda p: 8 * jnp.exp2(2 * (p // 8).astype(jnp.float32)))


@pytest.mark.parametrize("cache_dtype, save_at, load_at", [
    ("auto", (1, 1), (1, 1)), ("float8_e4m3fn", (1, 1), (1, 1)),
    ("auto", (1, 1), (2, 2)), ("float8_e4m3fn", (2, 2), (1, 1))],
    ids=["float32", "fp8", "float32-1-to-seq2-tensor2", "fp8-seq2-tensor2-to-1"])
def test_a_context_moves_in_blocks_onto_pages_the_prefix_cache_holds(tmp_path, monkeypatch, cache_dtype, save_at,
                                                                     load_at):
  """Save, load, offload and restore move BLOCK_PAGES pages of a layer per call: made 2 here, so DOC's 6 pages
  move in 3 blocks per layer. The loading engine's prefix cache already holds DOC's first 3 pages: the load
  shares them and writes pages 3 .. 5 only, in blocks that start inside the context (the restore after an offload
  too, from host blocks of pages 2-3 and 4-5). Every page then holds, bit for bit, K, V (and the fp8 scales) as
  the loader computed them for the shared pages and as saved for the rest, and a question on the context gets
  the uncached forward's logits (float32) or the saving engine's (fp8, which the uncached forward does not
  quantize; K and V spread so that every page has scales of its own, K's apart from V's)."""
  monkeypatch.setattr(context_file, "BLOCK_PAGES", 2)     # the block size is the file format's
  fp8 = cache_dtype == "float8_e4m3fn"
  if fp8:
    _spread_kv(monkeypatch)
  (s1, t1), (s2, t2) = save_at, load_at

  def make(n, **kw):    # fp8: the model's K and V are patched (_spread_kv), so its engines are the test's own
    return _engine(**kw) if fp8 else _shared(n, **kw)

  a = make(0, seq=s1, tensor=t1, cache_dtype=cache_dtype)
  with a.prefill(DOC) as ctx:
    saved = _pages(a, ctx.pages())
    if fp8:            # scales that tell the pages, and K from V, apart: a scale moved or lost shows
      ks, vs = saved[2], saved[3]                                        # [L, 6, K]
      assert np.all(ks != vs) and np.all(ks[:, 1:] != ks[:, :-1]) and np.all(vs[:, 1:] != vs[:, :-1])
    want = a.prompt_logits(QS[1], context=ctx)
    ctx.save(tmp_path / "doc")
  b = make(int(save_at == load_at), seq=s2, tensor=t2, cache_dtype=cache_dtype)    # another engine than a

  def cache_the_first_pages():
    b.prefill(DOC[:24]).close()                                # its 3 full pages stay in the prefix cache
    shared = b.prefix_cache.match(DOC)
    assert len(shared) == 3
    return shared, _pages(b, shared)

  def check(ctx, shared, own):
    assert ctx.stats["cached_tokens"] == 24 and ctx.pages()[:3] == shared
    for got, mine, theirs in zip(_pages(b, ctx.pages()), own, saved, strict=True):
      np.testing.assert_array_equal(got[:, :3], mine)
      np.testing.assert_array_equal(got[:, 3:], theirs[:, 3:])
    logits = b.prompt_logits(QS[1], context=ctx)
    if not fp8:
      _assert_uncached_logits(b, logits, DOC + QS[1])
    else:      # the question's own K/V, computed on another mesh, may round to other fp8 values
      np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)

  shared, own = cache_the_first_pages()
  with b.load_context(tmp_path / "doc") as ctx:
    check(ctx, shared, own)
    ctx.offload()
    b.prefix_cache.clear()
    shared, own_again = cache_the_first_pages()
    for x, y in zip(own_again, own, strict=True):
      np.testing.assert_array_equal(x, y)
    ctx.restore()
    check(ctx, shared, own)
  _idle(b)


# -- saved contexts are checked ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8():
  """An fp8 engine (a context of it has all four files) and its reference answer to DOC + QS[0]."""
  e = _shared(cache_dtype="float8_e4m3fn")
  e.want = e.generate(DOC + QS[0], max_new_tokens=6).token_ids
  return e


@pytest.fixture(scope="module")
def saved(fp8, tmp_path_factory):
  path = tmp_path_factory.mktemp("saved") / "doc"
  with fp8.prefill(DOC) as ctx:
    ctx.meta = {"question_tail": "\n"}
    # The question on the context as prefilled: its fp8 pages (the last one requantized when the question's
    # tokens join it) are not the cold prefill of DOC + question's, so this, not fp8.want, is what a load gives.
    fp8.want_on_context = fp8.generate(QS[0], max_new_tokens=6, context=ctx).token_ids
    ctx.save(path)
  return path


def _flip(at):
  def corrupt(d, name):
    data = bytearray((d / name).read_bytes())
    i = min(int(at * len(data)), len(data) - 8)
    data[i:i + 8] = bytes(x ^ 0x5A for x in data[i:i + 8])
    (d / name).write_bytes(bytes(data))
  return corrupt


def _rewrite_json(change, keep_digest=False):
  """context.json rewritten by change(meta) -> new JSON value; with keep_digest=False the digest is recomputed,
  as a tool that knows the format would, so the field checks behind it are what refuses."""
  import json

  def corrupt(d, name):
    meta = json.loads((d / name).read_text())
    new = change(meta)
    if isinstance(new, dict) and not keep_digest:
      new["digest"] = ctxlib._meta_digest(new)
    (d / name).write_text(json.dumps(new))
  return corrupt


def _rewrite_npy(change):
  def corrupt(d, name):
    np.save(d / name, change(np.load(d / name)))
  return corrupt


def _swapped(ids):
  ids = ids.copy()
  ids[[3, 30]] = ids[[30, 3]]
  return ids


def _set(key, value):
  def change(meta):
    meta[key] = value
    return meta
  return change


def _drop(key):
  def change(meta):
    del meta[key]
    return meta
  return change


def _kv_blocks_less_one(meta):
  meta["checksums"]["files"]["kv.bin"]["blocks"][1][0].pop()
  return meta


CORRUPTIONS = {
    "truncated": lambda d, name: (d / name).write_bytes((d / name).read_bytes()[:(d / name).stat().st_size // 2]),
    "empty": lambda d, name: (d / name).write_bytes(b""),
    "missing": lambda d, name: os.remove(d / name),
    "flip-early": _flip(0.02), "flip-middle": _flip(0.5), "flip-late": _flip(0.98),
}
CASES = [(name, how) for name in ("context.json", "tokens.npy", "kv.bin", "scales.npy") for how in CORRUPTIONS]
CASES += [
    ("tokens.npy", "swap-ids"), ("tokens.npy", "other-valid-ids"), ("scales.npy", "scales-x100"),
    ("kv.bin", "swap-layers"),
    ("context.json", "a-list"), ("context.json", "no-pages"), ("context.json", "no-checksums"),
    ("context.json", "tokens-a-string"), ("context.json", "pages-a-bool"), ("context.json", "meta-a-list"),
    ("context.json", "fingerprint-a-list"), ("context.json", "one-block-sum-short"),
    ("context.json", "pages-edited-digest-kept"), ("context.json", "v2-without-checksums"),
]
SPECIAL = {
    "swap-ids": _rewrite_npy(_swapped),
    "other-valid-ids": _rewrite_npy(lambda ids: np.where(ids == ids[10], 7, ids).astype(np.int32)),
    "scales-x100": _rewrite_npy(lambda s: s * 100),
    "a-list": _rewrite_json(lambda meta: list(meta.items())),
    "no-pages": _rewrite_json(_drop("pages")),
    "no-checksums": _rewrite_json(_drop("checksums")),
    "tokens-a-string": _rewrite_json(_set("tokens", "45")),
    "pages-a-bool": _rewrite_json(_set("pages", True)),
    "meta-a-list": _rewrite_json(_set("meta", [])),
    "fingerprint-a-list": _rewrite_json(_set("fingerprint", [])),
    "one-block-sum-short": _rewrite_json(_kv_blocks_less_one),
    "pages-edited-digest-kept": _rewrite_json(_set("pages", 7), keep_digest=True),
    "v2-without-checksums": _rewrite_json(lambda m: _drop("checksums")(_set("format", "lcjax-context-v2")(m))),
}


def _swap_layers(d, name):
  data = (d / name).read_bytes()
  half = len(data) // 2                   # layer 0 (K, V) | layer 1 (K, V): the same size, each well formed
  (d / name).write_bytes(data[half:] + data[:half])


SPECIAL["swap-layers"] = _swap_layers
MESSAGES = {"v2-without-checksums": "has format 'lcjax-context-v2', saved without checksums; this lcjax reads "
                                    "lcjax-context-v3 only",
            "a-list": "holds a JSON list, not an object", "no-pages": "no 'pages' field",
            "tokens-a-string": "tokens='45' is not an integer", "pages-a-bool": "pages=True is not an integer",
            "one-block-sum-short": "checksums of kv.bin are not 2 layers x 2 x 1 blocks",
            "pages-edited-digest-kept": "context.json does not match its checksum",
            "swap-ids": r"tokens.npy \(308 bytes\) does not match its checksum",
            "scales-x100": r"scales.npy \(\d+ bytes\) does not match its checksum",
            "swap-layers": r"kv.bin \(layer 0 K pages 0..5\) does not match its checksum \(blake2b [0-9a-f]{16}, "
                           r"context.json says [0-9a-f]{16}\): it was changed or damaged after the save"}


@pytest.mark.parametrize("name, how", CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_a_damaged_saved_context_is_refused_and_nothing_of_it_is_cached(fp8, saved, tmp_path, name, how):
  """Every file of a saved context, damaged in each way: refused in one line naming the file, the engine usable,
  no page of the context left in the pool or the prefix cache (a plain prompt that starts with the document is
  answered as before: no poisoned page serves it)."""
  import re
  import shutil
  d = tmp_path / "doc"
  shutil.copytree(saved, d)
  (SPECIAL.get(how) or CORRUPTIONS[how])(d, name)
  fp8.prefix_cache.clear()
  with pytest.raises(ContextError) as e:
    fp8.load_context(d)
  msg = str(e.value)
  assert "\n" not in msg and len(msg) < 400, msg
  assert re.search(MESSAGES.get(how, re.escape(name if how != "missing" or name == "context.json" else
                                               f"has no {name}")), msg), msg
  _idle(fp8)
  assert fp8.prefix_cache.match(DOC, len(DOC)) == []
  got = fp8.generate(DOC + QS[0], max_new_tokens=6)
  assert got.stats["cached_tokens"] == 0 and got.token_ids == fp8.want


def _grow(size):
  def corrupt(d, name):
    os.truncate(d / name, size)        # sparse: no disk, and no memory unless it is read
  return corrupt


def _nest(d, name):
  (d / name).write_text("[" * 100_000 + "]" * 100_000)


def _tokens_past_the_context(d, name):
  """context.json edited consistently (digest and checksum lists too) to 10**7 tokens, tokens.npy of the size
  that implies."""
  T = 10**7
  def change(meta):
    meta["tokens"], meta["pages"] = T, -(-T // meta["page_size"])
    blocks = -(-meta["pages"] // ctxlib.BLOCK_PAGES)
    meta["checksums"]["files"]["kv.bin"].update(block_pages=ctxlib.BLOCK_PAGES,
                                                blocks=[[["0" * 32] * blocks] * 2] * meta["layers"])
    return meta
  _rewrite_json(change)(d, name)
  os.truncate(d / "tokens.npy", ctxlib._npy_bytes((T,), np.int32))


@pytest.mark.parametrize("name, how, names", [
    ("tokens.npy", _grow(4 << 30), "tokens.npy holds 4294967296 bytes, context.json's int32 \\(45,\\) needs 308"),
    ("scales.npy", _grow(4 << 30), r"scales.npy holds 4294967296 bytes, context.json's float32 \(2, 2, 6, 2\)"),
    ("context.json", _grow(1 << 30), "context.json holds 1073741824 bytes, past the 67108864 of any"),
    ("context.json", _nest, "context.json nests 100000 levels deep, past the 32 of any context.json"),
    ("context.json", _tokens_past_the_context, "holds 10000000 tokens, past the 255 this engine's context"),
], ids=["tokens-4GiB", "scales-4GiB", "json-1GiB", "json-nested", "tokens-past-the-context"])
def test_oversized_saved_context_files_are_refused_before_they_are_read(fp8, saved, tmp_path, name, how, names):
  """Each size was checked after the file was read whole (gigabytes and seconds) or not at all (a RecursionError):
  now against what context.json implies, before reading, under a time and memory bound."""
  import shutil
  import tracemalloc
  d = tmp_path / "doc"
  shutil.copytree(saved, d)
  how(d, name)
  tracemalloc.start()
  t0 = time.monotonic()
  try:
    with pytest.raises(ContextError, match=names) as e:
      fp8.load_context(d)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert time.monotonic() - t0 < 2 and peak < 16 << 20, (time.monotonic() - t0, peak)
  assert "\n" not in str(e.value)
  _idle(fp8)


def test_an_intact_saved_context_loads_after_the_matrix(fp8, saved):
  """The copy the matrix damaged loads untouched (its checksums match), and answers as the prefill did."""
  fp8.prefix_cache.clear()
  with fp8.load_context(saved) as ctx:
    assert ctx.meta == {"question_tail": "\n"}
    assert fp8.generate(QS[0], max_new_tokens=6, context=ctx).token_ids == fp8.want_on_context
  _idle(fp8)


def test_overwrite_replaces_only_a_saved_context(eng, tmp_path):
  keep = tmp_path / "notes"
  keep.mkdir()
  (keep / "thesis.txt").write_text("years of work")
  (tmp_path / "file").write_text("x")
  with eng.prefill(DOC) as ctx:
    for victim in (keep, tmp_path / "file"):
      with pytest.raises(ContextError, match=rf"{victim} is a (directory|file) but not a saved context \(no "
                                             r"context.json\): overwrite replaces only a saved context"):
        ctx.save(victim, overwrite=True)
    assert (keep / "thesis.txt").read_text() == "years of work" and (tmp_path / "file").read_text() == "x"
    ctx.save(tmp_path / "doc")
    with pytest.raises(ContextError, match="already exists: pass overwrite=True"):
      ctx.save(tmp_path / "doc")
    ctx.meta = {"second": True}
    ctx.save(tmp_path / "doc", overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["doc", "file", "notes"]
  with eng.load_context(tmp_path / "doc") as ctx:
    assert ctx.meta == {"second": True}
  _idle(eng)


def test_an_overwrite_killed_at_each_step_loads_the_old_or_the_new_context(eng, tmp_path):
  """Context.save(overwrite=True) killed before each filesystem change of its commit (tests.test_atomic): the
  next load_context finds the old context or the new one (put back if the kill fell between the renames), and
  the next save leaves only the context at the path."""
  import shutil
  from tests.test_atomic import Killed, _as_if_dead, _kill_at
  where = tmp_path / "w"
  dst = where / "doc"
  seen = set()
  with eng.prefill(DOC) as ctx:
    for k in range(12):
      shutil.rmtree(where, ignore_errors=True)
      ctx.meta = {"v": "old"}
      ctx.save(dst)
      with pytest.MonkeyPatch.context() as mp:
        _kill_at(mp, k)
        ctx.meta = {"v": "new"}
        try:
          ctx.save(dst, overwrite=True)
          killed = False
        except Killed:
          killed = True
      with pytest.MonkeyPatch.context() as mp:
        _as_if_dead(mp)
        with eng.load_context(dst) as back:
          assert back.token_ids == DOC and back.meta["v"] in ("old", "new"), (k, back.meta)
          seen.add(back.meta["v"])
        ctx.meta = {"v": "third"}
        ctx.save(dst, overwrite=True)
        assert os.listdir(where) == ["doc"], (k, os.listdir(where))
      if not killed:
        break
  assert not killed and seen == {"old", "new"}, (k, seen)


def test_a_save_or_load_touches_none_of_the_users_entries_named_like_leftovers(eng, tmp_path):
  """The user's own `report.old-2023/` and `report.tmp-77777` beside `report` survive its saves; `backup` missing
  with the user's `backup.old-3000/` (even a complete-looking saved context) beside it is no such context, and
  the directory is left where it is; a path under a regular file is no such context either."""
  import shutil
  mine = tmp_path / "report.old-2023"
  mine.mkdir()
  (mine / "q3.txt").write_text("numbers")
  (tmp_path / "report.tmp-77777").write_text("draft")
  with eng.prefill(DOC) as ctx:
    ctx.save(tmp_path / "report")
    ctx.save(tmp_path / "report", overwrite=True)
    shutil.copytree(tmp_path / "report", tmp_path / "backup.old-3000")
  assert (mine / "q3.txt").read_text() == "numbers" and (tmp_path / "report.tmp-77777").read_text() == "draft"
  (tmp_path / "afile").write_text("x")
  for path in (tmp_path / "backup", tmp_path / "afile" / "ctx"):
    with pytest.raises(ContextError, match="no such context directory") as e:
      eng.load_context(path)
    assert "\n" not in str(e.value)
  assert sorted(os.listdir(tmp_path)) == ["afile", "backup.old-3000", "report", "report.old-2023",
                                          "report.tmp-77777"]
  _idle(eng)


def test_two_threads_saving_two_contexts_to_one_path(eng, tmp_path):
  """Two contexts saved from two threads at once to one path (overwrite=True), several rounds: each save succeeds
  or raises a one-line ContextError, and the path then loads as one of the two contexts, complete, with nothing
  else beside it."""
  import threading
  dst = tmp_path / "doc"
  a, b = eng.prefill(DOC), eng.prefill(DOC48)
  a.meta, b.meta = {"who": "a"}, {"who": "b"}
  try:
    for _ in range(3):
      out = {}
      start = threading.Barrier(2)

      def save(ctx):
        start.wait()
        try:
          ctx.save(dst, overwrite=True)
          out[ctx.meta["who"]] = "ok"
        except ContextError as e:
          out[ctx.meta["who"]] = str(e)
          assert "\n" not in str(e)
        except BaseException as e:          # noqa: BLE001: any other exception is the failure this test finds
          out[ctx.meta["who"]] = e
      threads = [threading.Thread(target=save, args=(c,)) for c in (a, b)]
      for t in threads:
        t.start()
      for t in threads:
        t.join()
      assert all(isinstance(v, str) for v in out.values()) and len(out) == 2, out
      with eng.load_context(dst) as back:
        who = back.meta["who"]
        assert out[who] == "ok" and back.token_ids == (DOC if who == "a" else DOC48), (out, who)
      assert os.listdir(tmp_path) == ["doc"], os.listdir(tmp_path)
  finally:
    a.close()
    b.close()
  _idle(eng)


def test_the_weights_fingerprint_reads_every_element():
  """_weights_digest: a model that differs from another in one element of one middle layer, or by two swapped
  elements, gets another digest, so a context saved by one is refused by the other (a digest of 16 sampled values
  per parameter read no element of layers 1..3 of this wq); the same weights sharded over a mesh get the same
  digest."""
  import jax
  from lcjax.engine.engine import _weights_digest
  from lcjax.sharding import make_mesh
  cfg = dataclasses.replace(TINY, n_layers=5)
  a = Engine.random(cfg, run=RUN, seed=3)
  leaves, tree = jax.tree.flatten(a.params)
  i = next(k for k, x in enumerate(leaves) if x.ndim == 4)        # a stacked [L, ...] matrix: wq or the like
  layer2 = np.asarray(leaves[i]).copy()
  one = layer2.copy()
  one[2, 1, 3, 5] = np.nextafter(one[2, 1, 3, 5], np.float32(np.inf))   # one ulp in layer 2
  swap = layer2.copy()
  swap[2, 0, 0, [0, 1]] = swap[2, 0, 0, [1, 0]]
  digests = set()
  for x in (layer2, one, swap):
    digests.add(_weights_digest(jax.tree.unflatten(tree, leaves[:i] + [jax.numpy.asarray(x)] + leaves[i + 1:])))
  assert len(digests) == 3
  mesh = make_mesh(tensor=2, seq=4)
  P = jax.sharding.PartitionSpec
  sharded = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
      mesh, P(*[None] * (x.ndim - 1), ("seq", "tensor")))), a.params)      # the last axis over 8 devices
  assert _weights_digest(sharded) == _weights_digest(a.params) == a.fingerprint["weights"]
  b = Engine(cfg, jax.tree.unflatten(tree, leaves[:i] + [jax.numpy.asarray(one)] + leaves[i + 1:]), run=RUN)
  assert b.fingerprint["weights"] != a.fingerprint["weights"]


def test_cli_answers_the_same_from_a_fresh_and_a_saved_context(tmp_path, smollm2_checkpoint):
  """--context_file with --save_context, then --load_context: the same answer, the second without a prefill. The
  CLI's default model is the bundled one, converted into the run's LCJAX_CACHE_DIR by the fixture (once per run).
  Each run is `python -m lcjax.cli.generate` in a process of its own, forked by tests.forkserver."""
  import sys
  from tests import forkserver
  doc = tmp_path / "doc.txt"
  doc.write_text("The ferry ran twice an hour. Remember this: the password is PELICAN-42. The mill stood by the "
                 "river.", encoding="utf-8")
  env = cpu_env()
  common = ["--prompt=What is the password?", "--max_new_tokens=8", "--nowarmup", "--nostream",
            "--config=" + os.path.join(REPO, "configs", "default.py"), "--config.max_context=1024"]

  def cli(*args):
    p = forkserver.run([sys.executable, "-m", "lcjax.cli.generate", *common, *args], env=env, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split("\n\nstats\n")[0], p.stderr

  fresh, err1 = cli(f"--context_file={doc}", f"--save_context={tmp_path / 'ctx'}")
  restored, err2 = cli(f"--load_context={tmp_path / 'ctx'}")
  assert "prefilled" in err1 and "saved to" in err1 and "restored from" in err2
  assert fresh == restored and fresh.strip()


def test_chat_prompts_go_through_the_template(eng):
  """chat=True: text or messages rendered by the checkpoint's template (its own BOS, none added)."""
  import tempfile
  from lcjax.tokenizer import Tokenizer
  from tests import fixtures_ckpt as fx
  with tempfile.TemporaryDirectory() as d:
    fx.byte_level_tokenizer_json(os.path.join(d, "tokenizer.json"))
    tok = Tokenizer(d, bos_id=1, eos_ids=[2], add_bos=True)
  tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                       "{% if add_generation_prompt %}[assistant] {% endif %}")
  limits = eng.limits
  eng.tokenizer, eng.limits = tok, dataclasses.replace(limits, vocab_size=300)
  try:
    want = tok.encode("[user] hi\n[assistant] ", add_bos=True)
    assert eng._make_requests(["hi"], 1, None, chat=True)[0].prompt == want
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    reqs, single, _ = eng._requests(msgs, 1, None, None, None, chat=True)
    assert single and reqs[0].prompt == tok.encode("[system] be brief\n[user] hi\n[assistant] ", add_bos=True)
    assert reqs[0].prompt.count(1) == 1
    with pytest.raises(RequestError, match=r"not a prefix=: .* engine.prefill\(document, chat=True\)"):
      eng._requests(["hi"], 1, None, [5, 6], None, chat=True)
    with pytest.raises(RequestError, match="messages"):
      eng._make_requests([[{"role": "user"}]], 1, None, chat=True)
    tok.chat_template = None
    with pytest.raises(RequestError, match="chat template"):
      eng._make_requests(["hi"], 1, None, chat=True)
  finally:
    eng.tokenizer, eng.limits = None, limits


def test_evicted_pages_come_back_from_the_host_tier():
  """With host_cache_gib, cached pages evicted under pressure go to host memory and a later prompt with the same
  start takes them back instead of prefilling them; a tier too small for them drops them (least recent first)."""
  eng = _engine(num_pages=13, max_batch=2, host_cache_gib=0.01)
  a = DOC + QS[0]
  want_a = eng.generate(a, max_new_tokens=6).token_ids
  _assert_greedy(eng, a, want_a)
  b = RNG.integers(3, TINY.vocab_size, 80).tolist()
  _assert_greedy(eng, b, eng.generate(b, max_new_tokens=10).token_ids)
  assert eng.prefix_cache.match(a) == [] and len(eng.scheduler.host_tier) >= 6      # a's pages went to the host
  again = eng.generate(a, max_new_tokens=6)
  assert again.stats["cached_tokens"] == again.stats["host_cached_tokens"] == 48
  assert again.token_ids == want_a
  _idle(eng)
  page = 2 * TINY.n_layers * 8 * TINY.n_kv_heads * TINY.head_dim * 4                  # one float32 page, K and V
  small = _engine(num_pages=13, max_batch=2, host_cache_gib=3.5 * page / 2**30)       # room for 3 pages
  small.generate(a, max_new_tokens=6)
  small.generate(b, max_new_tokens=10)
  assert len(small.scheduler.host_tier) == 3 and small.scheduler.host_tier.bytes <= 3.5 * page
  again = small.generate(a, max_new_tokens=6)
  # evictions go tail first, so the tier kept the chain's head: 3 pages come back, the rest is prefilled
  assert again.token_ids == want_a and again.stats["host_cached_tokens"] == 24


def test_fp8_pages_come_back_from_the_host_tier_with_their_scales():
  """fp8 pages evicted to the host tier and taken back hold the same bits and scales, so the prompt answers as
  it does from pages that never left the device."""
  a, b = DOC + QS[0], RNG.integers(3, TINY.vocab_size, 80).tolist()
  kept = _shared(cache_dtype="float8_e4m3fn")
  kept.generate(a, max_new_tokens=6)
  want = kept.generate(a, max_new_tokens=6)
  assert want.stats["cached_tokens"] == 48
  eng = _engine(num_pages=13, max_batch=2, host_cache_gib=0.01, cache_dtype="float8_e4m3fn")
  eng.generate(a, max_new_tokens=6)
  before = [np.asarray(x)[:, eng.prefix_cache.match(a)] for x in eng.cache.parts()]
  eng.generate(b, max_new_tokens=10)
  assert eng.prefix_cache.match(a) == [] and len(eng.scheduler.host_tier) >= 6
  again = eng.generate(a, max_new_tokens=6)
  assert again.stats["host_cached_tokens"] == 48 and again.token_ids == want.token_ids
  after = [np.asarray(x)[:, eng.prefix_cache.match(a)] for x in eng.cache.parts()]
  assert len(after) == 4 and after[2].shape == (TINY.n_layers, 6, TINY.n_kv_heads)
  for x, y in zip(after, before):
    np.testing.assert_array_equal(x, y)
  _idle(eng)


# The child compiles as the test processes do (XLA's optimizations off, tests/conftest.py): only its save matters.
_KILLED_SAVE = """
import sys, time
import jax
jax.config.update("jax_disable_most_optimizations", True)
from lcjax.config import preset, RunConfig
from lcjax.engine import context_file
from lcjax.engine.engine import Engine
eng = Engine.random(preset("tiny"), run=RunConfig(dtype="float32", page_size=8, max_context=256, max_batch=1,
                                                  prefill_chunk=32, compile_cache="off"))
ctx = eng.prefill(list(range(3, 48)))
digest = context_file._digest
context_file._digest = lambda data: (time.sleep(0.3), digest(data))[1]     # a save of many seconds, to be killed in
ctx.save(sys.argv[1])
"""


def test_a_save_killed_with_sigkill_leaves_nothing_that_loads(tmp_path):
  """kill -9 in the middle of writing kv.bin: no cleanup code runs; neither the destination nor the dead save's
  temporary directory loads (one-line refusals), and a later save to the same path succeeds and loads. The save
  is a process of its own, forked by tests.forkserver (the server of the CLI test's environment)."""
  import signal
  import sys
  import time
  from tests import forkserver
  from tests.test_atomic import tmp_of
  dst = tmp_path / "doc"
  p = forkserver.start([sys.executable, "-c", _KILLED_SAVE, str(dst)], env=cpu_env())   # the CLI test's server
  deadline = time.time() + 120
  while not os.path.exists(os.path.join(tmp_of(dst, p.pid), "kv.bin")) and time.time() < deadline \
      and p.poll() is None:
    time.sleep(0.05)
  tmp = tmp_of(dst, p.pid)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert os.path.isdir(tmp) and not dst.exists(), p.stderr[-2000:]
  eng = _shared(max_batch=1)            # the other max_batch=1 test's engine
  for path, why in ((dst, "no such context directory"), (tmp, "not a complete saved context")):
    with pytest.raises(ContextError, match=why) as e:
      eng.load_context(path)
    assert "\n" not in str(e.value)
  with eng.prefill(list(range(3, 48))) as ctx:
    want = eng.generate([50, 51], max_new_tokens=4, context=ctx).token_ids
    ctx.save(dst)
  with eng.load_context(dst) as ctx:
    assert eng.generate([50, 51], max_new_tokens=4, context=ctx).token_ids == want


def _forge(path, rewrite=lambda data: data[len(data) // 2:] + data[:len(data) // 2]):
  """A forger's rewrite of a saved context that every checksum accepts: kv.bin rewritten (default: its two layers
  swapped; the tiny model has two), each block's checksum and the digest recomputed, no signature (the forger has
  no key). The contexts here hold one block of pages per layer and part."""
  import json
  meta = json.loads((path / "context.json").read_text())
  data = rewrite((path / "kv.bin").read_bytes())
  (path / "kv.bin").write_bytes(data)
  blocks = meta["checksums"]["files"]["kv.bin"]["blocks"]
  assert all(len(part) == 1 for layer in blocks for part in layer)
  seg = len(data) // (2 * len(blocks))
  meta["checksums"]["files"]["kv.bin"]["blocks"] = [[[ctxlib._digest(data[(2 * l + p) * seg:(2 * l + p + 1) * seg])]
                                                     for p in range(2)] for l in range(len(blocks))]
  meta.pop("signature", None)
  meta["digest"] = ctxlib._meta_digest(meta)
  (path / "context.json").write_text(json.dumps(meta))


def _greedy(eng, prompt, n):
  """n greedy tokens after `prompt` from the uncached forward (the oracle: no pages read)."""
  out = []
  for _ in range(n):
    out.append(int(np.argmax(eng.logits([prompt + out])[0, -1])))
  return out


def test_a_forged_context_answers_its_own_questions_and_never_another_prompt(tmp_path):
  """A context whose files a forger rewrote consistently (checksums and digest too) loads, unverified, for its own
  questions; its pages and its questions' pages stay out of the prefix cache, so a plain prompt that starts with
  its tokens is prefilled afresh and answered as the uncached forward answers it. Saved again it stays unsigned;
  share=True vouches for it. The genuine file, signed by this user, shares its pages."""
  eng = _shared()
  with eng.prefill(DOC) as ctx:
    assert ctx.stats["shared"]
    ctx.save(tmp_path / "c")
  eng.prefix_cache.clear()
  with eng.load_context(tmp_path / "c") as c:
    assert c.stats["verified"] and c.stats["shared"]
  assert len(eng.prefix_cache.match(DOC)) == len(DOC) // 8
  eng.prefix_cache.clear()

  _forge(tmp_path / "c")
  with eng.load_context(tmp_path / "c") as c:
    assert not c.stats["verified"] and not c.stats["shared"]
    forged = eng.generate(QS[0], context=c, max_new_tokens=6)
    c.save(tmp_path / "again")
  assert eng.prefix_cache.match(DOC) == [] and eng.prefix_cache.match(DOC + QS[0] + forged.token_ids) == []
  plain = eng.generate(DOC + QS[0], max_new_tokens=6)
  assert plain.stats["cached_tokens"] == 0
  assert plain.token_ids == _greedy(eng, DOC + QS[0], 6) != forged.token_ids
  with eng.load_context(tmp_path / "again") as c:
    assert not c.stats["verified"] and not c.stats["shared"]
  with eng.load_context(tmp_path / "c", share=True) as c:
    assert c.stats["shared"] and not c.stats["verified"]
  assert len(eng.prefix_cache.match(DOC)) == len(DOC) // 8
  eng.prefix_cache.clear()
  with pytest.raises(RequestError, match="share='yes' must be True, False or None"):
    eng.load_context(tmp_path / "c", share="yes")
  _idle(eng)


def test_a_context_signed_by_another_user_loads_unshared(tmp_path, monkeypatch):
  """The signing key is the user's: a genuine context saved under another user cache (another key) verifies
  nowhere else. The key file is the user's alone (0600) and made once."""
  eng = _shared()
  monkeypatch.setenv("LCJAX_CACHE_DIR", str(tmp_path / "other-user"))
  with eng.prefill(DOC) as ctx:
    ctx.save(tmp_path / "c")
  key = tmp_path / "other-user" / ctxlib.KEY_FILE
  assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == ctxlib.KEY_BYTES
  assert ctxlib.user_key() == key.read_bytes()
  monkeypatch.setenv("LCJAX_CACHE_DIR", str(tmp_path / "me"))
  eng.prefix_cache.clear()
  with eng.load_context(tmp_path / "c") as c:
    assert not c.stats["verified"] and not c.stats["shared"]
  assert eng.prefix_cache.match(DOC) == []
  _idle(eng)


def test_a_context_saved_before_the_weight_dtype_field_loads(tmp_path):
  """Contexts saved before the fingerprint named the weight dtype (their weights digest covers it) still load."""
  eng = _shared()
  with eng.prefill(DOC) as ctx:
    ctx.save(tmp_path / "doc")

  def older(meta):
    del meta["fingerprint"]["weight_dtype"]
    return meta
  _rewrite_json(older)(tmp_path / "doc", "context.json")
  with eng.load_context(tmp_path / "doc") as c:
    assert len(c) == len(DOC)
  _idle(eng)


@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_a_context_of_nan_pages_is_refused_and_leaves_no_nan(tmp_path, cache_dtype):
  """A forged context whose kv.bin is all NaN (0xFF bytes: NaN in float32 and in e4m3), checksums and digest
  recomputed: refused with one line, and no page of the pool holds a NaN after it (a freed page keeps its values,
  and attention masks the slots a sequence has not written by a zero weight, which a NaN survives), so a plain
  prompt afterwards is answered as the uncached forward answers it."""
  eng = _shared(cache_dtype=cache_dtype)
  with eng.prefill(DOC) as ctx:
    ctx.save(tmp_path / "c")
  _forge(tmp_path / "c", lambda data: b"\xff" * len(data))
  eng.prefix_cache.clear()
  with pytest.raises(ContextError, match=r"page\(s\) with a NaN or infinite K/V value") as e:
    eng.load_context(tmp_path / "c")
  assert "\n" not in str(e.value)
  assert not any(np.isnan(np.asarray(x, np.float32)).any() for x in eng.cache.parts())
  other = RNG.integers(3, TINY.vocab_size, 20).tolist()
  if cache_dtype == "float32":
    assert eng.generate(other, max_new_tokens=6).token_ids == _greedy(eng, other, 6)
  _idle(eng)


@pytest.mark.parametrize("how", ["nan-pages", "flip-late"])
def test_a_damaged_load_onto_shared_pages_leaves_their_context_as_it_was(tmp_path, how):
  """A damaged saved context of DOC loaded while another context of DOC is open: the load shares that context's 5
  full pages from the prefix cache and is refused (nan-pages: every page NaN, checksums recomputed, refused once
  written; flip-late: kv.bin's last layer fails its checksum after the first layer was written). The shared
  pages keep, bit for bit, what the open context computed, stay cached, and its question gets the uncached
  forward's answer; the engine is idle once it closes."""
  eng = _shared()
  with eng.prefill(DOC) as ctx:
    ctx.save(tmp_path / "c")
  if how == "nan-pages":
    _forge(tmp_path / "c", lambda data: b"\xff" * len(data))
  else:
    _flip(0.98)(tmp_path / "c", "kv.bin")
  eng.prefix_cache.clear()
  with eng.prefill(DOC) as live:
    full = live.pages()[:len(DOC) // RUN.page_size]
    before = _pages(eng, live.pages())
    assert eng.prefix_cache.match(DOC) == full
    with pytest.raises(ContextError, match="NaN or infinite" if how == "nan-pages" else "kv.bin") as e:
      eng.load_context(tmp_path / "c")
    assert "\n" not in str(e.value)
    for got, want in zip(_pages(eng, live.pages()), before, strict=True):
      np.testing.assert_array_equal(got, want)
    assert eng.prefix_cache.match(DOC) == full and list(eng.scheduler.pinned) == [live.seq]
    out = eng.generate(QS[0], context=live, max_new_tokens=6).token_ids
    _assert_greedy(eng, DOC + QS[0], out)
  _idle(eng)


def test_a_signing_key_others_can_reach_signs_nothing(tmp_path, monkeypatch):
  """A user cache others can write to (they could plant their own key), or a key file others can read, signs no
  context: it saves unsigned and loads unverified (and unshared), with a warning, never an error."""
  eng = _shared()
  shared_dir = tmp_path / "shared"
  shared_dir.mkdir()
  shared_dir.chmod(0o777)
  monkeypatch.setenv("LCJAX_CACHE_DIR", str(shared_dir))
  with pytest.raises(ContextError, match="directory .* is unsafe: it is writable by its group and all users"):
    ctxlib.user_key()
  with eng.prefill(DOC) as ctx:
    ctx.save(tmp_path / "c")
  assert "signature" not in (tmp_path / "c" / "context.json").read_text()
  mine = tmp_path / "mine"
  monkeypatch.setenv("LCJAX_CACHE_DIR", str(mine))
  key = ctxlib.user_key()
  (mine / ctxlib.KEY_FILE).chmod(0o644)
  with pytest.raises(ContextError, match="must be this user's alone"):
    ctxlib.user_key()
  (mine / ctxlib.KEY_FILE).chmod(0o600)
  assert ctxlib.user_key() == key
  eng.prefix_cache.clear()
  with eng.load_context(tmp_path / "c") as c:
    assert not c.stats["verified"] and not c.stats["shared"]
  _idle(eng)


def test_an_interrupt_before_host_pages_are_written_back_caches_none_of_them(monkeypatch):
  """A request, then a context, whose prefix comes back from the host tier, interrupted (SIGINT) before the pages
  are written back into the pool (the device cache stays whole, so nothing is rebuilt): the prefix cache gains
  none of the unwritten pages, no page stays held, and the prompt asked again gets the answer it got before."""
  eng = _engine(num_pages=13, max_batch=2, host_cache_gib=0.01)
  a, other = DOC + QS[0], RNG.integers(3, TINY.vocab_size, 80).tolist()
  want = eng.generate(a, max_new_tokens=6).token_ids

  def interrupted(*args, **kw):
    raise KeyboardInterrupt
  for call in (lambda: eng.generate(a, max_new_tokens=6), lambda: eng.prefill(a)):
    eng.generate(other, max_new_tokens=10)                                  # a's pages go to the host tier
    assert eng.prefix_cache.match(a) == [] and len(eng.scheduler.host_tier) >= 6
    monkeypatch.setattr(eng.steps, "scatter_pages", interrupted)
    with pytest.raises(KeyboardInterrupt):
      call()
    monkeypatch.undo()
    assert not eng.cache.k.is_deleted() and eng.pool.pages_used == 0
    assert eng.generate(a, max_new_tokens=6).token_ids == want


def test_a_context_whose_pages_another_thread_lost_is_refused(monkeypatch):
  """Another thread's step, interrupted inside its donated call between pin() and the Context taking its pages
  (the cache rebuilt, the epoch advanced): the context is of the lost pool, so offload, save and questions refuse
  it in one line instead of copying the new pool's zeros as its K/V."""
  eng = _engine()
  sched = eng.scheduler
  real = sched.pin

  def pin_then_another_thread_loses_the_cache(*args, **kw):
    out = real(*args, **kw)
    for x in (sched.cache.k, sched.cache.v):
      x.delete()
    sched.recover_cache()
    return out
  monkeypatch.setattr(sched, "pin", pin_then_another_thread_loses_the_cache)
  ctx = eng.prefill(DOC)
  monkeypatch.undo()
  lost = "this context's pages were lost when a device step was interrupted: prefill it again"
  with pytest.raises(RequestError, match=lost):
    ctx.offload()
  with pytest.raises(RequestError, match=lost):
    eng.generate(QS[0], max_new_tokens=6, context=ctx)
  ctx.close()
