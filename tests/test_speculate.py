"""Prompt-lookup speculative decoding (RunConfig.draft="prompt", lcjax.engine.speculate).

Oracles: a brute-force Python search for the drafts; the exact token distributions of the filtered logits for the
acceptance rule (tested statistically over thousands of seeds); and for the engine, plain decoding of the same
weights: greedy tokens identical token for token, and an fp8 cache whose pages and scales are bit for bit those
plain decoding leaves (rejected drafts undone).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.config import ConfigError, RunConfig, preset
from lcjax.engine import speculate
from lcjax.engine.engine import Engine
from lcjax.engine.sampling import SamplingParams, filtered_logits, stack

TINY = dataclasses.replace(preset("tiny"), eos_ids=())
RUN = RunConfig(dtype="float32", page_size=8, prefill_chunk=32, max_context=256, max_batch=3, decode_steps=16)
SPEC = dict(draft="prompt", draft_ngram=1, draft_tokens=6)
RNG = np.random.default_rng(0)
# Different lengths; the second and third repeat themselves, so drafts are found and many accepted.
PROMPTS = [RNG.integers(1, 200, 40).tolist(), RNG.integers(1, 50, 10).tolist() * 5, [5, 6, 7, 8] * 8]
_ENGINES: dict = {}


def engine(cfg=TINY, **kw) -> Engine:
  key = (cfg.eos_ids, tuple(sorted(kw.items())))
  if key not in _ENGINES:
    _ENGINES[key] = Engine.random(cfg, run=RUN.replace(**kw), seed=3)
  return _ENGINES[key]


# -- drafts -------------------------------------------------------------------------------------------------------
def drafts_oracle(hist, length, ngram, k):
  tail = hist[length - ngram:length]
  for start in range(length - 1, ngram - 1, -1):          # the most recent earlier occurrence, followed by a token
    if length >= ngram + 1 and hist[start - ngram:start] == tail:
      got = hist[start:min(start + k, length)]
      return got, len(got)
  return [], 0


@pytest.mark.parametrize("ngram,k", [(1, 4), (2, 3), (3, 6)])
def test_drafts_are_what_followed_the_last_ngram_most_recently(ngram, k):
  rng = np.random.default_rng(ngram)
  B, W = 64, 40
  hist = rng.integers(0, 3, (B, W)).astype(np.int32)       # three tokens: matches at every n-gram length
  length = rng.integers(1, W + 1, B).astype(np.int32)
  drafts, count = speculate.find_drafts(jnp.asarray(hist), jnp.asarray(length), ngram=ngram, k=k)
  drafts, count = np.asarray(drafts), np.asarray(count)
  for b in range(B):
    want, n = drafts_oracle(hist[b].tolist(), int(length[b]), ngram, k)
    assert count[b] == n, (b, length[b])
    assert drafts[b, :n].tolist() == want


# -- acceptance -----------------------------------------------------------------------------------------------------
def test_greedy_accepts_the_drafts_the_argmax_agrees_with():
  V = 8
  target = np.array([[3, 1, 4, 1], [3, 1, 4, 1], [2, 2, 2, 2]])
  logits = jax.nn.one_hot(target, V) * 5.0
  drafts = jnp.asarray([[3, 1, 5], [3, 1, 4], [2, 2, 2]], jnp.int32)
  count = jnp.asarray([3, 2, 0], jnp.int32)
  tokens, n, accepted = speculate.accept(logits, drafts, count, stack([SamplingParams()] * 3),
                                         jnp.zeros(3, jnp.int32), greedy=True)
  assert np.asarray(accepted).tolist() == [2, 2, 0]
  assert np.asarray(n).tolist() == [3, 3, 1]
  assert np.asarray(tokens)[:, 0].tolist() == [3, 3, 2]


def _probs(logits, sp):
  return np.asarray(jax.nn.softmax(filtered_logits(logits, sp), axis=-1))


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                      dict(temperature=1.3, top_p=0.8)])
def test_sampled_tokens_keep_the_model_distribution(sampling):
  """Whatever the drafts, the first token is distributed as p_0 and, given the first is draft d_0, the second as
  p_1: the speculative-sampling rule changes nothing the user can observe."""
  V, N = 6, 40000
  rng = np.random.default_rng(1)
  row_logits = jnp.asarray(rng.normal(0, 1.5, (3, V)), jnp.float32)          # rows predict positions 1, 2, 3
  logits = jnp.broadcast_to(row_logits, (N, 3, V))
  d0 = int(np.argsort(np.asarray(row_logits[0]))[-2])                       # a likely draft, not the argmax
  drafts = jnp.broadcast_to(jnp.asarray([d0, 2], jnp.int32), (N, 2))
  sp = stack([SamplingParams(seed=s, **sampling) for s in range(N)])
  tokens, n, _ = speculate.accept(logits, drafts, jnp.full(N, 2, jnp.int32), sp, jnp.zeros(N, jnp.int32),
                                  greedy=False)
  tokens, n = np.asarray(tokens), np.asarray(n)
  p = _probs(row_logits, stack([SamplingParams(**sampling)] * 3))
  first = np.bincount(tokens[:, 0], minlength=V) / N
  assert np.abs(first - p[0]).max() < 0.015, (first, p[0])
  took = tokens[:, 0] == d0
  assert took.mean() == pytest.approx(p[0, d0], abs=0.015)
  assert np.all(n[took] >= 2)
  second = np.bincount(tokens[took, 1], minlength=V) / took.sum()
  assert np.abs(second - p[1]).max() < 0.03, (second, p[1])


def test_a_step_without_drafts_samples_what_plain_sampling_samples():
  V, N = 50, 64
  logits = jax.random.normal(jax.random.key(0), (N, 1, V))
  sp = stack([SamplingParams(temperature=0.9, seed=s) for s in range(N)])
  pos = jnp.arange(N, dtype=jnp.int32)
  from lcjax.engine.sampling import sample
  tokens, n, _ = speculate.accept(logits, jnp.zeros((N, 0), jnp.int32), jnp.zeros(N, jnp.int32), sp, pos,
                                  greedy=False)
  assert np.asarray(n).tolist() == [1] * N
  np.testing.assert_array_equal(np.asarray(tokens)[:, 0], np.asarray(sample(logits[:, 0], sp, pos + 1)))


# -- the engine -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_greedy_tokens_equal_plain_decoding(cache_dtype):
  plain = engine(cache_dtype=cache_dtype).generate(PROMPTS, max_new_tokens=70)
  spec = engine(cache_dtype=cache_dtype, **SPEC).generate(PROMPTS, max_new_tokens=70)
  for a, b in zip(plain, spec):
    assert b.token_ids == a.token_ids
    assert b.stats["draft"] == "prompt" and a.stats["draft"] == "off"
  accepted = [r.stats["drafts_accepted"] for r in spec]
  assert sum(accepted) > 40 and max(r.stats["tokens_per_decode_call"] for r in spec) > 2.0, accepted
  for r in spec:
    assert r.stats["decode_calls"] < 69 or r.stats["drafts_accepted"] == 0
    assert r.stats["decode_calls"] + r.stats["drafts_accepted"] == len(r.token_ids) - 1


def test_fp8_pages_are_bit_for_bit_plain_decodings():
  """Rejected drafts wrote K/V (and could raise page scales) past the kept tokens: undone, so every full page of
  prompt + answer, values and scales, is what plain decoding wrote."""
  engines = engine(cache_dtype="float8_e4m3fn"), engine(cache_dtype="float8_e4m3fn", **SPEC)
  prompt = PROMPTS[0]
  pages = []
  for eng in engines:
    eng.prefix_cache.clear()
    out = eng.generate([prompt], max_new_tokens=90)[0]
    assert out.stats["drafts_proposed"] > out.stats["drafts_accepted"] or out.stats["draft"] == "off"
    table = eng.prefix_cache.match(prompt + out.token_ids, len(prompt) + 89)
    pages.append([np.asarray(x[:, np.asarray(table)]).astype(np.float32) for x in eng.cache.parts()])
  assert len(pages[0][0][0]) == len(pages[1][0][0]) > 0
  for a, b in zip(*pages):
    np.testing.assert_array_equal(a, b)


def test_stop_tokens_budgets_and_decode_calls():
  """An end-of-sequence token inside an accepted run ends the answer there; max_new_tokens and a decode call's
  budget of 3 tokens cut runs of up to 7."""
  plain = engine().generate(PROMPTS, max_new_tokens=50)
  stop = plain[1].token_ids[23]                       # deep in the repeated prompt's accepted runs
  cfg = dataclasses.replace(TINY, eos_ids=(stop,))
  for kw in (dict(), dict(decode_steps=3)):
    a = engine(cfg, **kw).generate(PROMPTS, max_new_tokens=50)
    b = engine(cfg, **kw, **SPEC).generate(PROMPTS, max_new_tokens=50)
    for x, y in zip(a, b):
      assert y.token_ids == x.token_ids and y.finish_reason == x.finish_reason
    assert b[1].finish_reason == "eos" and b[1].token_ids[-1] == stop
  for n in (1, 2, 9):
    assert [len(r.token_ids) for r in engine(**SPEC).generate(PROMPTS, max_new_tokens=n)] == [n] * 3


def test_streams_and_contexts_speculate_too():
  eng, ref = engine(**SPEC), engine()
  doc, question = PROMPTS[1] * 2, PROMPTS[1][:7]
  ctx, ctx_ref = eng.prefill(doc), ref.prefill(doc)
  try:
    got = eng.generate([question], context=ctx, max_new_tokens=40)[0]
    assert got.token_ids == ref.generate([question], context=ctx_ref, max_new_tokens=40)[0].token_ids
    assert got.stats["drafts_accepted"] > 10
  finally:
    ctx.close()
    ctx_ref.close()
  for _ in eng.generate_stream(PROMPTS, max_new_tokens=30, decode_steps=4):   # no tokenizer: no text, results
    pass
  assert [r.token_ids for r in eng.last_results] == [r.token_ids for r in ref.generate(PROMPTS, max_new_tokens=30)]


def test_sampled_generation_runs_and_a_row_without_drafts_matches_plain_sampling():
  sampling = dict(temperature=0.8, seed=5)
  spec = engine(**SPEC).generate(PROMPTS, max_new_tokens=40, sampling=sampling)
  plain = engine().generate(PROMPTS, max_new_tokens=40, sampling=sampling)
  for a, b in zip(plain, spec):
    assert len(b.token_ids) == 40 and all(0 <= t < TINY.vocab_size for t in b.token_ids)
    if b.stats["drafts_proposed"] == 0:
      assert b.token_ids == a.token_ids


@pytest.mark.parametrize("field,value", [("draft", "ngram"), ("draft_ngram", 0), ("draft_ngram", 17),
                                         ("draft_tokens", 0), ("draft_tokens", 16), ("draft_tokens", 2.0)])
def test_bad_draft_settings_are_refused_in_one_line(field, value):
  with pytest.raises(ConfigError, match=field) as e:
    RunConfig(**{field: value})
  assert "\n" not in str(e.value)


def test_rewrite_undoes_a_rejected_token_that_raised_its_page_scale():
  """The verify step writes k + 1 tokens in one call; a rejected one 1000x larger than the rest raises its page's
  scale (requantizing the kept tokens). rewrite_tokens leaves the pages as writing only the kept tokens, one call
  each, does: the oracle."""
  from lcjax.cache import kv as kvc
  L, P, Z, K, H, B, T = 2, 6, 4, 2, 8, 2, 4
  cache = kvc.init_cache(L, P, Z, K, H, jnp.float8_e4m3fn)
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.normal(0, 1, (L, B, T, K, H)), jnp.float32)
  k = k.at[:, :, 2].multiply(1000.0)                          # rejected: rows 2 and 3
  v = -k
  slots = jnp.asarray([[4 * 1 + 2, 4 * 1 + 3, 4 * 2 + 0, 4 * 2 + 1], [4 * 3 + 1, 4 * 3 + 2, 4 * 3 + 3, 4 * 4]])
  kept = jnp.where(jnp.arange(T)[None, :] < 2, slots, 0)
  prior = kvc.init_cache(L, P, Z, K, H, jnp.float8_e4m3fn)
  for layer in range(L):                                      # earlier tokens in the first pages
    parts = kvc.write_kv(*prior.parts(), k[layer, :, :1] * 0.01, v[layer, :, :1] * 0.01, slots[:, :1] - 1,
                         kvc.written_pages(slots[:, :1] - 1, Z), layer)
    prior = kvc.PagedKV(*parts)
  want = prior
  for t in range(2):
    for layer in range(L):
      want = kvc.PagedKV(*kvc.write_kv(*want.parts(), k[layer, :, t:t + 1], v[layer, :, t:t + 1], kept[:, t:t + 1],
                                       None, layer))
  pages = kvc.written_pages(slots, Z).reshape(-1)
  saved = kvc.gather_pages(prior, pages)
  got = prior
  for layer in range(L):
    got = kvc.PagedKV(*kvc.write_kv(*got.parts(), k[layer], v[layer], slots, kvc.written_pages(slots, Z), layer))
  assert not np.array_equal(np.asarray(got.k_scale), np.asarray(want.k_scale))     # the rejected rows did harm
  got = kvc.rewrite_tokens(got, saved, pages, k, v, kept)
  for a, b in zip(got.parts(), want.parts()):
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")
@pytest.mark.parametrize("tensor,seq,cache_dtype", [(2, 2, "float8_e4m3fn"), (1, 4, "float32")])
def test_a_mesh_speculates_as_one_device_decodes(tensor, seq, cache_dtype):
  one = engine(cache_dtype=cache_dtype)
  mesh = Engine(TINY, one.params, run=RUN.replace(tensor=tensor, seq=seq, cache_dtype=cache_dtype, **SPEC))
  want = one.generate(PROMPTS, max_new_tokens=40)
  got = mesh.generate(PROMPTS, max_new_tokens=40)
  assert [r.token_ids for r in got] == [r.token_ids for r in want]
  assert sum(r.stats["drafts_accepted"] for r in got) > 20


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")
def test_verify_rows_on_a_seq_mesh_see_only_earlier_tokens():
  """A decode-form call of 4 rows after a cached prompt, on a seq mesh: each row's logits are the uncached full
  forward's at its position (a row that saw the call's later tokens would differ)."""
  from flax import nnx
  one = engine()
  eng = Engine(TINY, one.params, run=RUN.replace(seq=4))
  prompt, rows = PROMPTS[0], [7, 9, 11, 13]
  want = np.asarray(one.logits([prompt + rows]))[0, len(prompt):]
  r = eng._make_requests([prompt], 8, None)[0]
  assert eng.scheduler.admit(r)
  try:
    eng.scheduler.prefill(r, sample=False)
    n, T = len(prompt), len(rows)
    table = jnp.asarray(eng.pool.page_table_array([r.seq], eng.scheduler.table_width))
    slots = jnp.asarray(eng.pool.slot_mapping(r.seq, n, T))[None]
    positions = (n + jnp.arange(T, dtype=jnp.int32))[None]
    call = jax.jit(lambda params, cache: nnx.merge(eng.graphdef, params)(
        jnp.asarray([rows], jnp.int32), positions, cache=cache, slots=slots, page_table=table,
        kv_len=jnp.asarray([n + T], jnp.int32))[0])
    got = np.asarray(call(eng.params, eng.cache))[0]
  finally:
    eng.scheduler.release(r)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_warm_up_compiles_the_speculative_loop_generate_then_uses():
  from tests.test_engine import _Compiles
  eng = Engine.random(TINY, run=RUN.replace(decode_steps=4, **SPEC), seed=3)
  count = _Compiles()
  try:
    assert eng.warm_up(len(PROMPTS[1])) == 3                # chunks of 32 (both), first token, decode
    count.seen.clear()
    out = eng.generate(PROMPTS[1], max_new_tokens=40)
    assert count.seen == [] and out.stats["drafts_accepted"] > 0
  finally:
    count.close()
    eng.close()
