"""Prompt-lookup speculative decoding (RunConfig.draft="prompt", lcjax.engine.speculate).

Oracles: a brute-force Python search for the drafts; the exact token distributions of the filtered logits for the
acceptance rule (tested statistically over thousands of seeds); and for the engine, plain decoding of the same
weights: greedy tokens identical token for token (with an fp8 cache, up to a near tie of the logits, where the two
part), and an fp8 cache whose pages and scales are bit for bit those plain decoding leaves (rejected drafts
undone).
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
from lcjax.engine.requests import RequestError
from lcjax.engine.sampling import SamplingParams, filtered_logits, stack
from tests.run_cache import optimized_xla

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
_find_drafts = jax.jit(speculate.find_drafts, static_argnames=("ngram", "k"))


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
  drafts, count = _find_drafts(hist, length, ngram=ngram, k=k)
  drafts, count = np.asarray(drafts), np.asarray(count)
  for b in range(B):
    want, n = drafts_oracle(hist[b].tolist(), int(length[b]), ngram, k)
    assert count[b] == n, (b, length[b])
    assert drafts[b, :n].tolist() == want


# -- acceptance -----------------------------------------------------------------------------------------------------
# accept and sample compiled whole, as the engine's decode steps call them (eagerly, each of their operations is
# dispatched alone, and compiled for each new shape).
_accept = jax.jit(speculate.accept, static_argnames="greedy")


def test_greedy_accepts_the_drafts_the_argmax_agrees_with():
  V = 8
  target = np.array([[3, 1, 4, 1], [3, 1, 4, 1], [2, 2, 2, 2]])
  logits = np.eye(V, dtype=np.float32)[target] * np.float32(5.0)                  # one_hot(target, V) * 5
  drafts = np.asarray([[3, 1, 5], [3, 1, 4], [2, 2, 2]], np.int32)
  count = np.asarray([3, 2, 0], np.int32)
  tokens, n, accepted = _accept(logits, drafts, count, stack([SamplingParams()] * 3), np.zeros(3, np.int32),
                                greedy=True)
  assert np.asarray(accepted).tolist() == [2, 2, 0]
  assert np.asarray(n).tolist() == [3, 3, 1]
  assert np.asarray(tokens)[:, 0].tolist() == [3, 3, 2]


@jax.jit
def _softmax_filtered(logits, sp):
  return jax.nn.softmax(filtered_logits(logits, sp), axis=-1)


def _probs(logits, sp):
  return np.asarray(_softmax_filtered(logits, sp))


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                      dict(temperature=1.3, top_p=0.8)])
def test_sampled_tokens_keep_the_model_distribution(sampling):
  """Whatever the drafts, the first token is distributed as p_0 and, given the first is draft d_0, the second as
  p_1: the speculative-sampling rule changes nothing the user can observe."""
  V, N = 6, 40000
  rng = np.random.default_rng(1)
  row_logits = rng.normal(0, 1.5, (3, V)).astype(np.float32)                # rows predict positions 1, 2, 3
  logits = np.broadcast_to(row_logits, (N, 3, V))
  d0 = int(np.argsort(row_logits[0])[-2])                                    # a likely draft, not the argmax
  drafts = np.broadcast_to(np.asarray([d0, 2], np.int32), (N, 2))
  sp = stack([SamplingParams(seed=s, **sampling) for s in range(N)])
  tokens, n, _ = _accept(logits, drafts, np.full(N, 2, np.int32), sp, np.zeros(N, np.int32), greedy=False)
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
  V, N, k = 50, 64, 3
  logits = jax.random.normal(jax.random.key(0), (N, k + 1, V))
  sp = stack([SamplingParams(temperature=0.9, seed=s) for s in range(N)])
  pos = np.arange(N, dtype=np.int32)
  from lcjax.engine.sampling import sample
  drafts = np.random.default_rng(0).integers(0, V, (N, k)).astype(np.int32)            # proposed, none counted
  tokens, n, accepted = _accept(logits, drafts, np.zeros(N, np.int32), sp, pos, greedy=False)
  assert np.asarray(n).tolist() == [1] * N and not np.asarray(accepted).any()
  first = jax.jit(lambda logits, sp, pos: sample(logits[:, 0], sp, pos + 1))(logits, sp, pos)
  np.testing.assert_array_equal(np.asarray(tokens)[:, 0], np.asarray(first))


# -- the engine -----------------------------------------------------------------------------------------------------
NEAR_TIE = 0.01              # fp8 caches: a top-2 logit gap under this may go either way (tiny's logits span ~6)


def same_greedy_tokens(eng, prompt, want, got, cache_dtype):
  """got == want; with an fp8 cache they may part at a near tie of `eng`'s logits (a verify step reads its own
  rows as computed, a plain step its token from its fp8 page): equal before it, and there the two tokens are the
  logits' top two, under NEAR_TIE apart. Past it the sequences are not compared."""
  if got == want or cache_dtype != "float8_e4m3fn":
    assert got == want
    return
  i = next(i for i, (a, b) in enumerate(zip(want + [None], got + [None])) if a != b)
  assert i < min(len(want), len(got)), (i, want, got)        # parted at a token, not by one stopping early
  eng.prefix_cache.clear()
  logits = np.asarray(eng.prompt_logits(prompt + want[:i]), np.float64)
  assert set(np.argsort(logits)[-2:]) == {want[i], got[i]}, (i, want[i], got[i], np.sort(logits)[-3:])
  assert abs(logits[want[i]] - logits[got[i]]) < NEAR_TIE, (i, logits[want[i]], logits[got[i]])


@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_greedy_tokens_equal_plain_decoding(cache_dtype):
  plain = engine(cache_dtype=cache_dtype).generate(PROMPTS, max_new_tokens=70)
  spec = engine(cache_dtype=cache_dtype, **SPEC).generate(PROMPTS, max_new_tokens=70)
  for prompt, a, b in zip(PROMPTS, plain, spec):
    same_greedy_tokens(engine(cache_dtype=cache_dtype), prompt, a.token_ids, b.token_ids, cache_dtype)
    assert b.stats["draft"] == "prompt" and a.stats["draft"] == "off"
  accepted = [r.stats["drafts_accepted"] for r in spec]
  assert sum(accepted) > 40 and max(r.stats["tokens_per_decode_call"] for r in spec) > 2.0, accepted
  for r in spec:
    assert r.stats["decode_calls"] < 69 or r.stats["drafts_accepted"] == 0
    assert r.stats["decode_calls"] + r.stats["drafts_accepted"] == len(r.token_ids) - 1


def test_the_cache_holds_what_plain_decoding_writes():
  """Every full page of prompt + answer holds plain decoding's K and V (float32 cache: to rounding; the verify
  computes k + 1 rows a call)."""
  engines = engine(), engine(**SPEC)
  prompt = PROMPTS[0]
  pages = []
  for eng in engines:
    eng.prefix_cache.clear()
    out = eng.generate([prompt], max_new_tokens=90)[0]
    assert out.stats["drafts_proposed"] > out.stats["drafts_accepted"] or out.stats["draft"] == "off"
    table = eng.prefix_cache.match(prompt + out.token_ids, len(prompt) + 89)
    pages.append([np.asarray(x)[:, np.asarray(table)] for x in eng.cache.parts()])
  assert pages[0][0].shape == pages[1][0].shape and pages[0][0].shape[1] > 10
  for a, b in zip(*pages):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _one_step(eng, prompt, drafts, count):
  """Steps.spec_once after `prompt` prefilled: (tokens [k + 1], n, every cache array after the step)."""
  from lcjax.engine.steps import DecodeState
  sched = eng.scheduler
  r = eng._make_requests([prompt], 8, None)[0]
  assert sched.admit(r)
  try:
    sched.prefill(r)
    table = jnp.asarray(sched.pool.page_table_array([r.seq], sched.table_width))
    state = DecodeState(jnp.asarray([r.out[-1]], jnp.int32), jnp.asarray([len(prompt)], jnp.int32),
                        jnp.zeros(1, bool), jnp.asarray([8], jnp.int32))
    tokens, n, sched.cache = eng.steps.spec_once(eng.params, sched.cache, state, stack([SamplingParams()]), table,
                                                 sched.eos, jnp.asarray([drafts], jnp.int32),
                                                 jnp.asarray([count], jnp.int32))
    return np.asarray(tokens)[0], int(np.asarray(n)[0]), [np.asarray(x) for x in sched.cache.parts()]
  finally:
    r.written = r.cached            # keep the step's pages out of the prefix cache: the next call starts afresh
    sched.release(r)


@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_rejected_drafts_leave_no_trace(cache_dtype):
  """Two steps whose different drafts are all rejected leave the cache, fp8 scales included, bit for bit alike:
  the verify call writes nothing, and only the kept token is written after it. A step without drafts (the
  one-row call) leaves what they leave up to rounding (its token's K/V come from a product of another shape)."""
  eng = engine(cache_dtype=cache_dtype, **SPEC)
  prompt, k = PROMPTS[0], SPEC["draft_tokens"]
  eng.prefix_cache.clear()
  tokens, n, plain = _one_step(eng, prompt, [0] * k, 0)
  steps = []
  for first in (1, 1 + k):
    eng.prefix_cache.clear()
    steps.append(_one_step(eng, prompt, [(int(tokens[0]) + first + i) % TINY.vocab_size for i in range(k)], k))
  assert [(m, int(t[0])) for t, m, _ in steps] == [(n, tokens[0])] * 2 and n == 1
  for a, b, c in zip(plain, steps[0][2], steps[1][2]):
    np.testing.assert_array_equal(b.astype(np.float32), c.astype(np.float32))
    # float32: rounding; float8_e4m3fn pages: at most one step of e4m3 (3 mantissa bits) where rounding flips a code.
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32),
                               rtol=1e-5 if cache_dtype == "float32" or a.dtype == np.float32 else 0.125, atol=1e-5)


def test_an_end_of_sequence_token_inside_accepted_drafts_ends_the_step():
  cfg = dataclasses.replace(TINY, eos_ids=())
  want = engine().generate([PROMPTS[0]], max_new_tokens=8)[0].token_ids
  eos = dataclasses.replace(TINY, eos_ids=(want[3],))
  eng = engine(eos, **SPEC)
  eng.prefix_cache.clear()
  tokens, n, _ = _one_step(eng, PROMPTS[0], want[1:1 + SPEC["draft_tokens"]], SPEC["draft_tokens"])
  first = want.index(want[3])                         # the first end-of-sequence token of the run
  assert n == first and tokens[:n].tolist() == want[1:1 + n], (tokens, n)
  assert cfg.eos_ids == ()


def test_stop_tokens_budgets_and_decode_calls():
  """An end-of-sequence token ends the answer where plain decoding ends it; max_new_tokens and a decode call's
  budget of 3 tokens cut runs of up to 7."""
  plain = engine().generate(PROMPTS, max_new_tokens=50)
  stop = plain[1].token_ids[23]
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


def test_sampled_generation_runs_and_without_matches_equals_plain_sampling():
  sampling = dict(temperature=0.8, seed=5)
  plain = engine().generate(PROMPTS, max_new_tokens=40, sampling=sampling)
  cold = engine(**SPEC).generate(PROMPTS, max_new_tokens=40, sampling=dict(temperature=0.05, seed=5))
  assert sum(r.stats["drafts_accepted"] for r in cold) > 10            # drafts kept by the sampling rule
  spec = engine(**SPEC).generate(PROMPTS, max_new_tokens=40, sampling=sampling)
  for b in spec:
    assert len(b.token_ids) == 40 and all(0 <= t < TINY.vocab_size for t in b.token_ids)
  # 16-token n-grams never recur here: every step gains one token with the key plain sampling uses.
  none = engine(draft="prompt", draft_ngram=16, draft_tokens=2).generate(PROMPTS, max_new_tokens=40,
                                                                          sampling=sampling)
  assert [r.stats["drafts_proposed"] for r in none] == [0, 0, 0]
  assert [r.token_ids for r in none] == [r.token_ids for r in plain]


@pytest.mark.parametrize("field,value", [("draft", "ngram"), ("draft_ngram", 0), ("draft_ngram", 17),
                                         ("draft_tokens", 0), ("draft_tokens", 16), ("draft_tokens", 2.0)])
def test_bad_draft_settings_are_refused_in_one_line(field, value):
  with pytest.raises(ConfigError, match=field) as e:
    RunConfig(**{field: value})
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_write_tokens_writes_as_decode_steps_do(dtype):
  """kv.write_tokens of T tokens (every layer at once, one token after another) leaves the pools bit for bit as T
  decode-step writes (write_kv, one token a call) do, fp8 scales included, for tokens 1000x apart that raise their
  page's scale; slot 0 writes nothing."""
  from lcjax.cache import kv as kvc
  L, P, Z, K, H, B, T = 2, 6, 4, 2, 8, 2, 4
  rng = np.random.default_rng(0)
  k = rng.normal(0, 1, (L, B, T, K, H)).astype(np.float32)
  k[:, :, 2] *= np.float32(1000.0)
  v = -k
  slots = np.asarray([[4 * 1 + 2, 4 * 1 + 3, 4 * 2 + 0, 0], [4 * 3 + 1, 4 * 3 + 2, 4 * 3 + 3, 4 * 4]], np.int32)
  want = got = jax.jit(kvc.init_cache, static_argnums=range(6))(L, P, Z, K, H, dtype)
  # One decode step's write of one layer: one program for every step and layer (the layer is traced).
  write_kv = jax.jit(lambda c, k, v, slots, layer: kvc.PagedKV(*kvc.write_kv(
      c.k, c.v, c.k_scale, c.v_scale, k, v, slots, kvc.written_pages(slots, Z), layer)))
  for t in range(T):
    for layer in range(L):
      want = write_kv(want, k[layer, :, t:t + 1], v[layer, :, t:t + 1], slots[:, t:t + 1], np.int32(layer))
  got = jax.jit(kvc.write_tokens)(got, k, v, slots)
  for a, b in zip(got.parts(), want.parts()):
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")
@pytest.mark.parametrize("tensor,seq,cache_dtype", [(2, 2, "float8_e4m3fn"), (1, 4, "float32")])
def test_a_mesh_speculates_as_one_device_decodes(tensor, seq, cache_dtype):
  one = engine(cache_dtype=cache_dtype)
  one.prefix_cache.clear()                  # both prefill every prompt whole (cached pages round differently)
  mesh = Engine(TINY, one.params, run=RUN.replace(tensor=tensor, seq=seq, cache_dtype=cache_dtype, **SPEC))
  want = one.generate(PROMPTS, max_new_tokens=40)
  got = mesh.generate(PROMPTS, max_new_tokens=40)
  for prompt, a, b in zip(PROMPTS, want, got):
    same_greedy_tokens(one, prompt, a.token_ids, b.token_ids, cache_dtype)
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
    assert eng.warm_up(len(PROMPTS[1])) == 4      # chunks of 32 (first, then with a prefix), first token, decode
    count.seen.clear()
    out = eng.generate(PROMPTS[1], max_new_tokens=40)
    assert count.seen == [] and out.stats["drafts_accepted"] > 0
  finally:
    count.close()
    eng.close()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the XLA:CPU program")
@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_the_speculative_loop_copies_no_pool(cache_dtype):
  """The speculative decode loop, compiled as serving runs it (Scheduler.lower_decode, XLA's optimizations on),
  copies no array as large as one layer's KV pool and makes none in a wider dtype: nothing in a step costs the
  pools' size (a lax.cond holding the cache, or a gather of the pages a step writes before the step, each made XLA
  copy the pools every step; float8 pools read or written by plain indexing are widened to float16 whole)."""
  from tests.test_engine import pool_copies_in_decode_loop
  # Weights and pools made as every test makes them: their values play no part in the loop's program, and the
  # weights' initializer compiled with XLA's optimizations took about 5 s of the test.
  eng = Engine.random(TINY, run=RUN.replace(page_size=16, max_context=2048, max_batch=1, cache_dtype=cache_dtype,
                                            **SPEC), seed=3)
  try:
    with optimized_xla():
      copies = pool_copies_in_decode_loop(eng, widened=True)
    assert copies == [], copies
  finally:
    eng.close()


def test_rows_block_is_dense_causal_attention_over_the_rows():
  """Llama's rows_block (elementwise products, for XLA to fuse) == the jnp dense baseline on the same rows: causal,
  keys past each sequence's length masked, grouped heads (G = 4), and its lse as well."""
  from lcjax.model.llama import rows_block
  from lcjax.ops.attention import attention_dense
  rng = np.random.default_rng(7)
  B, T, N, K, H = 3, 5, 8, 2, 16
  q, k, v = (rng.normal(size=(B, T, n, H)).astype(np.float32) for n in (N, K, K))
  positions = np.asarray([[40], [7], [0]], np.int32) + np.arange(T, dtype=np.int32)[None]
  lengths = np.asarray([5, 2, 1], np.int32)
  got, got_lse = jax.jit(rows_block)(q, k, v, positions, lengths)
  want, want_lse = jax.jit(attention_dense, static_argnames="causal")(q, k, v, q_pos=positions - positions[:, :1],
                                                                       kv_len=lengths, causal=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draft", ["off", "prompt"])
def test_nonfinite_logits_stop_the_request_and_say_so(draft):
  """Where the model's logits hold NaN (planted: the embedding row of the token a request feeds next), the request
  stops there with finish_reason 'nonfinite' and keeps only the tokens sampled before; another request of the batch
  runs on as it runs alone. At prefill (the prompt's last token planted) the request gets no token at all."""
  eng = engine(**(SPEC if draft == "prompt" else {}))
  eng.prefix_cache.clear()
  prompt, other = [11, 12, 13, 14, 15], PROMPTS[2]
  clean = [r.token_ids for r in eng.generate([prompt, other], max_new_tokens=12)]
  t1 = clean[0][0]
  assert t1 not in prompt and t1 not in clean[1] and t1 not in other, (t1, clean)
  emb = eng.params["embed"]["embedding"]
  saved = emb.value
  try:
    emb.value = saved.at[t1].set(jnp.nan)
    eng.prefix_cache.clear()
    got = eng.generate([prompt, other], max_new_tokens=12)
    assert (got[0].token_ids, got[0].finish_reason) == ([t1], "nonfinite")
    assert (got[1].token_ids, got[1].finish_reason) == (clean[1], "length")
    emb.value = saved.at[prompt[-1]].set(jnp.nan)
    eng.prefix_cache.clear()
    first = eng.generate(prompt, max_new_tokens=12)
    assert (first.token_ids, first.finish_reason) == ([], "nonfinite")
  finally:
    emb.value = saved
    eng.prefix_cache.clear()


def _planted_step(eng, prompt, token, drafts, count):
  """_one_step with the embedding row of `token` NaN (its K/V and the logits of a row that feeds it: NaN)."""
  emb = eng.params["embed"]["embedding"]
  saved = emb.value
  try:
    emb.value = saved.at[token].set(jnp.nan)
    eng.prefix_cache.clear()
    return _one_step(eng, prompt, drafts, count)
  finally:
    emb.value = saved
    eng.prefix_cache.clear()


def test_a_rejected_nonfinite_draft_leaves_the_step_as_it_was():
  """A draft whose K/V are NaN (planted) and that the model rejects changes nothing: plain decoding never feeds it,
  so the step keeps the fed token's one token, that of the step without drafts. The rows before it never see its
  value (rows_block leaves hidden keys out instead of weighting them by 0: 0 * NaN = NaN)."""
  eng = engine(**SPEC)
  prompt, k = PROMPTS[0], SPEC["draft_tokens"]
  eng.prefix_cache.clear()
  tokens, n, _ = _one_step(eng, prompt, [0] * k, 0)
  g = int(tokens[0])
  bad = next(t for t in range(1, TINY.vocab_size) if t not in prompt and t != g)
  got, m, _ = _planted_step(eng, prompt, bad, [bad] + [1] * (k - 1), 1)
  assert (m, int(got[0])) == (1, g), (m, got, g)


def test_tokens_before_a_nonfinite_row_are_kept():
  """Plain decoding emits the token g sampled from finite logits and stops only when feeding g gives NaN logits
  (planted). A verify step that accepted the draft g keeps g, as that decode step did, and stops after it."""
  eng = engine(**SPEC)
  prompt, k = PROMPTS[0], SPEC["draft_tokens"]
  eng.prefix_cache.clear()
  tokens, _, _ = _one_step(eng, prompt, [0] * k, 0)
  g = int(tokens[0])
  assert g not in prompt
  got, m, _ = _planted_step(eng, prompt, g, [g] + [1] * (k - 1), 1)
  assert (m, int(got[0])) == (1, g), (m, got, g)


@pytest.mark.parametrize("draft,cache_dtype", [("off", "float32"), ("prompt", "float32"),
                                               ("off", "float8_e4m3fn")])
def test_a_nonfinite_request_leaves_nothing_for_the_next(draft, cache_dtype):
  """A request stopped for NaN logits (planted: the embedding of the token it feeds next) may have written NaN K/V
  into its pages (a decode step writes the fed token before its logits are read). The next request, handed the same
  pages, generates what it generates on a fresh engine: the stopped request's own pages are zeroed when freed
  (kernels weight a page's unwritten slots by 0, and 0 * NaN = NaN). A context whose prefill gives NaN logits is
  refused in one line, and leaves nothing behind either."""
  eng = engine(cache_dtype=cache_dtype, **(SPEC if draft == "prompt" else {}))
  prompt, other = [11, 12, 13, 14, 15], [21, 22, 23]
  eng.prefix_cache.clear()
  want = eng.generate(other, max_new_tokens=12).token_ids
  eng.prefix_cache.clear()
  t1 = eng.generate(prompt, max_new_tokens=12).token_ids[0]
  emb = eng.params["embed"]["embedding"]
  saved = emb.value
  try:
    emb.value = saved.at[t1].set(jnp.nan)
    eng.prefix_cache.clear()
    assert eng.generate(prompt, max_new_tokens=12).finish_reason == "nonfinite"
    got = eng.generate(other, max_new_tokens=12)
    assert (got.token_ids, got.finish_reason) == (want, "length")
    with pytest.raises(RequestError, match=r"^the context was not kept: the model's logits after its 6 tokens hold "
                                           r"NaN or inf"):
      eng.prefill(prompt + [t1])
    got = eng.generate(other, max_new_tokens=12)
    assert (got.token_ids, got.finish_reason) == (want, "length")
  finally:
    emb.value = saved
    eng.prefix_cache.clear()
