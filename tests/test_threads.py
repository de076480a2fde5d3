"""Calls from several threads on one engine (tiny float32 model): each call's progress callback is its own, and a
stream advanced from several threads works, answering as one thread does, and leaves nothing held. The oracle is
the same call made alone on one thread."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from lcjax.config import RunConfig, preset
from lcjax.engine.engine import Engine

RUN = RunConfig(dtype="float32", page_size=8, prefill_chunk=16, max_context=256, max_batch=2, decode_steps=4,
                stream_decode_steps=1)
A = list(range(3, 60))          # 57 tokens: 4 prefill chunks
B = list(range(70, 100))        # 30 tokens: 2 chunks


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
  """A tiny model with a byte-level tokenizer of its vocabulary (streams yield text) and no EOS."""
  from lcjax.tokenizer import Tokenizer
  from tests import fixtures_ckpt as fx
  d = tmp_path_factory.mktemp("tok")
  fx.byte_level_tokenizer_json(str(d / "tokenizer.json"))
  cfg = dataclasses.replace(preset("tiny"), vocab_size=300, eos_ids=())
  return Engine.random(cfg, run=RUN, seed=1, tokenizer=Tokenizer(str(d), bos_id=1, eos_ids=[], add_bos=False))


def _run_in_threads(*fns):
  errors = []

  def wrap(fn):
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - reported below
      errors.append(e)
  threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
    assert not t.is_alive(), "a thread is still blocked"
  return errors


def test_each_call_sees_only_its_own_progress(eng):
  """Two threads generate at once, one with a callback that records, one with a callback that fails: the
  recording call sees its own prompt's chunks only, and the failure fails its own call only."""
  eng.prefix_cache.clear()
  want = eng.generate(A, max_new_tokens=5).token_ids
  eng.prefix_cache.clear()
  seen, results = [], {}

  def failing(*args):
    raise RuntimeError("the other caller's callback")

  def recorder():
    results["a"] = eng.generate(A, max_new_tokens=5, on_progress=lambda *a: seen.append(a)).token_ids

  def failer():
    eng.generate(B, max_new_tokens=5, on_progress=failing)

  for _ in range(3):
    seen.clear()
    eng.prefix_cache.clear()
    errors = _run_in_threads(recorder, failer)
    assert [str(e) for e in errors] == ["the other caller's callback"]
    assert results["a"] == want
    assert seen == [(0, 16, 57), (0, 32, 57), (0, 48, 57), (0, 57, 57)], seen
  assert eng.pool.pages_used == 0
  assert eng.generate(A, max_new_tokens=5).token_ids == want      # no callback left installed


def test_a_stream_advanced_from_two_threads_works_and_leaves_nothing_held(eng):
  """One thread takes the first delta, another the rest (the first stays alive meanwhile, so no later thread can
  reuse its id): the deltas are those of a stream on one thread, and afterwards other threads' calls run."""
  eng.prefix_cache.clear()
  want = [t for _, t in eng.generate_stream(A, max_new_tokens=24)]
  assert len(want) >= 6, want
  eng.prefix_cache.clear()
  stream = eng.generate_stream(A, max_new_tokens=24)
  got, first_done, all_done = [], threading.Event(), threading.Event()

  def first():
    got.append(next(stream)[1])
    first_done.set()
    all_done.wait(60)

  def rest():
    first_done.wait(60)
    got.extend(t for _, t in stream)
    out = eng.generate(B, max_new_tokens=3)          # this thread's next call
    assert len(out.token_ids) == 3

  def other():
    all_done.wait(60)
    assert len(eng.generate(B, max_new_tokens=3).token_ids) == 3

  def finish():
    first_done.wait(60)
    while len(got) < len(want) and not all_done.wait(0.05):
      pass
    all_done.set()

  assert _run_in_threads(first, rest, other, finish) == []
  assert got == want and eng.pool.pages_used == 0


def test_a_stream_dropped_by_its_thread_is_ended_by_another(eng):
  """A stream advanced on a worker thread (still alive), then closed from another thread: the close ends it, and
  calls from other threads are not blocked by it."""
  stream = eng.generate_stream(A, max_new_tokens=50)
  started, done = threading.Event(), threading.Event()

  def worker():
    next(stream)
    started.set()
    done.wait(60)

  def closer():
    started.wait(60)
    stream.close()
    assert len(eng.generate(B, max_new_tokens=3).token_ids) == 3
    done.set()

  assert _run_in_threads(worker, closer) == []
  assert eng.pool.pages_used == 0
