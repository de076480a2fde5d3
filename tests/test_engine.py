"""Engine invariants on a tiny float32 model: cached == uncached, chunked == one-shot, batched == alone.

The oracle for what runs through the paged cache is the uncached full forward (`Engine.logits`), never a second
engine running the same paged path."""
from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.config import RunConfig, preset
from lcjax.engine.engine import Engine, RequestError
from lcjax.engine.sampling import SamplingParams
from lcjax.engine.scheduler import ROW_TILE, chunk_bucket, chunk_buckets, chunk_programs
from tests.run_cache import optimized_xla

TINY = dataclasses.replace(preset("tiny"), eos_ids=())   # random weights: lengths must not hinge on an EOS


def _engine(cfg=TINY, **kw):
  run = RunConfig(dtype="float32", page_size=8, prefill_chunk=32, max_context=256, max_batch=3,
                  decode_steps=16).replace(**kw)
  return Engine.random(cfg, run=run, seed=3)


@pytest.fixture(scope="module")
def eng():
  return _engine()


def test_cached_decode_equals_uncached_forward(eng):
  """Every generated token is the argmax of the uncached causal forward over the prompt and the tokens before
  it: one forward over prompt + generated gives all of them (position p sees tokens <= p only), which is the
  token-by-token uncached greedy loop without its 40 differently shaped compilations."""
  prompt = list(np.random.default_rng(0).integers(3, TINY.vocab_size, 45))
  got = eng.generate(prompt, max_new_tokens=40).token_ids
  assert len(got) >= 32
  logits = eng.logits([prompt + got])[0]
  assert got == [int(np.argmax(logits[len(prompt) - 1 + i])) for i in range(len(got))]


def test_random_engines_of_one_seed_hold_the_same_weights_in_arrays_of_their_own(eng):
  """Engine.random keeps its program for the next engine of the same model, dtype and weight format, whatever its
  seed: an engine of the same seed holds weights equal to the first's in new arrays (closing one engine deletes
  none of the other's); another seed draws the weights the model's own initialisation draws for it (the eager
  Llama with nnx.Rngs(seed)), and another dtype other weights."""
  leaves = lambda e: jax.tree.leaves(e.params)
  again = _engine(max_batch=1)
  for a, b in zip(leaves(eng), leaves(again), strict=True):
    assert a is not b and a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  again.close()
  assert all(not a.is_deleted() for a in leaves(eng))
  other_seed = Engine.random(TINY, run=eng.run, seed=4)
  wqkv = lambda e: np.asarray(e.params["layers"]["attn"]["wqkv"].get_value())
  assert not np.array_equal(wqkv(other_seed), wqkv(eng))
  from flax import nnx
  from lcjax.model.llama import Llama
  eager = nnx.state(Llama(TINY, dtype=jnp.dtype(eng.run.dtype), weights=other_seed.weights, rngs=nnx.Rngs(4)),
                    nnx.Param)
  np.testing.assert_array_equal(wqkv(other_seed), np.asarray(eager["layers"]["attn"]["wqkv"].get_value()))
  bf16 = _engine(dtype="bfloat16")
  assert bf16.params["layers"]["attn"]["wqkv"].get_value().dtype == jnp.bfloat16


def test_chunked_prefill_equals_one_shot():
  """One chunk of 100 tokens and 7 chunks of 16 (each after the first reading the ones before from the pages):
  the prompt's logits are the uncached forward's, and so are the greedy tokens."""
  prompt = list(np.random.default_rng(1).integers(3, TINY.vocab_size, 100))
  one, chunked = _engine(prefill_chunk=128), _engine(prefill_chunk=16)
  full = one.logits([prompt])[0, -1]
  for e in (one, chunked):
    np.testing.assert_allclose(_prefill_logits(e, prompt), full, rtol=1e-5, atol=1e-5)
  got = one.generate(prompt, max_new_tokens=20).token_ids
  assert chunked.generate(prompt, max_new_tokens=20).token_ids == got
  logits = one.logits([prompt + got])[0]
  assert got == [int(np.argmax(logits[len(prompt) - 1 + i])) for i in range(len(got))]


def test_prefill_logits_match_full_forward(eng):
  """Last-position logits of a chunked, paged prefill (77 tokens: 3 chunks of 32) equal the uncached forward's, and
  so does the first token sampled from them."""
  prompt = list(np.random.default_rng(2).integers(3, TINY.vocab_size, 77))
  full = eng.logits([prompt])[0, -1]
  np.testing.assert_allclose(_prefill_logits(eng, prompt), full, rtol=1e-5, atol=1e-5)
  r = eng._make_requests([prompt], 1, None)[0]
  assert eng.scheduler.admit(r)
  try:
    eng.scheduler.prefill(r)
  finally:
    eng.scheduler.release(r)
  assert r.out[0] == int(np.argmax(full))


def test_a_first_chunk_reads_no_prefix(monkeypatch):
  """A prompt's first chunk runs with a page table of no pages, and its program holds no prefix read (whose work
  is sized by the table, however short the prefix); every later chunk gets the whole table. Both kinds give the
  uncached forward's logits (test above)."""
  eng = _engine()
  W = eng.scheduler.table_width
  widths, reads = [], []
  real_prefill, real_paged = eng.steps.prefill, type(eng.attention).paged

  def prefill(*a):
    widths.append((int(a[5][0]), a[4].shape[1]))           # (prefix_len, table width)
    return real_prefill(*a)

  def paged(self, q, *a, **kw):
    reads.append(q.shape[1])                               # traced once a program: rows of each paged read
    return real_paged(self, q, *a, **kw)
  monkeypatch.setattr(eng.steps, "prefill", prefill)
  monkeypatch.setattr(type(eng.attention), "paged", paged)
  try:
    eng.generate(list(np.random.default_rng(2).integers(3, TINY.vocab_size, 77)), max_new_tokens=1)
    assert widths == [(0, 0), (32, W), (64, W)]
    assert reads == [32, 16]                 # the chunk of 32 with a prefix and the last one; none without
  finally:
    eng.close()


def test_batch_equals_alone(eng):
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(3, TINY.vocab_size, n)) for n in (5, 60, 23)]
  sampling = dict(temperature=0.8, top_k=20, top_p=0.9, seed=7)
  together = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, sampling=sampling)]
  alone = [eng.generate(p, max_new_tokens=24, sampling=dict(sampling, seed=7 + i)).token_ids   # prompt i: seed + i
           for i, p in enumerate(prompts)]
  assert together == alone
  assert eng.pool.pages_used == 0   # every page came back


def test_greedy_decode_loop_equals_the_general_sampler(eng, monkeypatch):
  """A batch of greedy requests decodes in a loop compiled without the top-k / top-p sort (greedy=True); a greedy
  request batched with a sampled one goes through the general sampler. Its tokens are the same either way."""
  rng = np.random.default_rng(8)
  prompts = [list(rng.integers(3, TINY.vocab_size, n)) for n in (30, 12)]
  flags = []
  real = eng.steps.decode
  monkeypatch.setattr(eng.steps, "decode", lambda *a, **k: (flags.append(k["greedy"]), real(*a, **k))[1])
  alone = eng.generate(prompts[0], max_new_tokens=24).token_ids
  assert flags and all(flags)
  flags.clear()
  reqs = eng._make_requests(prompts, 24, None)
  reqs[1].sampling = SamplingParams(temperature=1.0, seed=3)
  for _ in eng.scheduler.serve(reqs):
    pass
  assert flags and not any(flags)
  assert eng._result(reqs[0]).token_ids == alone


def test_more_requests_than_batch_slots_and_pages():
  eng = _engine(num_pages=12, max_batch=2)   # 11 usable pages of 8 tokens
  rng = np.random.default_rng(4)
  prompts = [list(rng.integers(3, TINY.vocab_size, n)) for n in (20, 30, 10, 25, 5)]
  together = [r.token_ids for r in eng.generate(prompts, max_new_tokens=12)]
  alone = [eng.generate(p, max_new_tokens=12).token_ids for p in prompts]
  assert together == alone
  assert eng.pool.pages_used == 0


def test_fragmented_pool_pages_out_of_order():
  """Pages handed out in scrambled order give the same tokens as a fresh pool."""
  prompt = list(np.random.default_rng(5).integers(3, TINY.vocab_size, 50))
  fresh = _engine().generate(prompt, max_new_tokens=16).token_ids
  eng = _engine()
  seqs = [eng.pool.new_sequence() for _ in range(6)]
  for s in seqs:
    eng.pool.extend(s, 8 * 3)
  for s in seqs[::2]:
    eng.pool.free(s)                         # holes all over the pool
  assert eng.generate(prompt, max_new_tokens=16).token_ids == fresh


@pytest.mark.parametrize("bad, match", [
    (dict(prompts=[], max_new_tokens=4), "no prompts"),
    (dict(prompts=[[]], max_new_tokens=4), "empty prompt"),
    (dict(prompts=[1, 2, 3], max_new_tokens=0), "max_new_tokens=0"),
    (dict(prompts=[1, 2, 3], max_new_tokens=-2), "max_new_tokens=-2"),
    (dict(prompts=[1, 2, 999], max_new_tokens=4), r"token id\(s\) \[999\] outside the vocabulary \[0, 256\)"),
    (dict(prompts=[1] * 250, max_new_tokens=10), "260 > max context 256"),
    (dict(prompts=[1, 2], max_new_tokens=4, sampling=dict(tmperature=1.0)), r"unknown sampling option\(s\) \['tmperature'\]"),
    (dict(prompts=[1, 2], max_new_tokens=4, sampling=dict(top_p=0.0)), r"top_p=0.0 must be in \(0, 1\]"),
])
def test_bad_requests_are_refused_and_engine_stays_usable(eng, bad, match):
  with pytest.raises(RequestError, match=match):
    eng.generate(bad.pop("prompts"), **bad)
  assert eng.pool.pages_used == 0
  assert len(eng.generate([5, 6, 7], max_new_tokens=3).token_ids) == 3


def test_request_larger_than_pool_is_refused_before_allocating():
  eng = _engine(num_pages=5)
  with pytest.raises(RequestError, match=r"needs 9 pages \(70 tokens\) but the pool has only 4 pages \(32 tokens"):
    eng.generate([[1] * 10, [2] * 60], max_new_tokens=10)
  assert eng.pool.pages_used == 0


def test_interrupted_generation_frees_pages(eng, monkeypatch):
  prompt = [4, 5, 6, 7]
  expected = eng.generate(prompt, max_new_tokens=20).token_ids
  calls = {"n": 0}
  real = eng.scheduler.decode_call

  def interrupt(live, **kw):
    calls["n"] += 1
    raise KeyboardInterrupt
  monkeypatch.setattr(eng.scheduler, "decode_call", interrupt)
  with pytest.raises(KeyboardInterrupt):
    eng.generate(prompt, max_new_tokens=20)
  monkeypatch.setattr(eng.scheduler, "decode_call", real)
  assert calls["n"] == 1 and eng.pool.pages_used == 0
  assert eng.generate(prompt, max_new_tokens=20).token_ids == expected


def test_prefix_sharing_saves_pages_and_keeps_outputs():
  rng = np.random.default_rng(6)
  prefix = list(rng.integers(3, TINY.vocab_size, 45))          # 5 full pages + a partly filled one
  suffixes = [list(rng.integers(3, TINY.vocab_size, n)) for n in (3, 9, 14)]
  plain = _engine(prefix_cache=False)
  expected = [r.token_ids for r in plain.generate([prefix + s for s in suffixes], max_new_tokens=10)]
  shared = _engine()
  got = [r.token_ids for r in shared.generate(suffixes, max_new_tokens=10, prefix=prefix)]
  assert got == expected
  for s, out in zip(suffixes, got):                            # the uncached forward's greedy tokens
    logits = shared.logits([prefix + s + out])[0]
    assert out == [int(np.argmax(logits[len(prefix) + len(s) - 1 + i])) for i in range(len(out))]
  assert shared.pool.pages_used == 0
  # Without sharing: ceil((45 + suffix + 10) / 8) = 8 + 8 + 9 = 25 pages. With sharing the 5 full prefix pages
  # are stored once; the prefix's partly filled 6th page stays with the prefix and each request copies it.
  assert plain.peak_pages_used == 25
  assert shared.peak_pages_used == 25 - 2 * 5 + 1


def _prefill_logits(eng, prompt):
  logits = eng.prompt_logits(prompt)
  assert eng.pool.pages_used == 0
  return logits


def test_fp8_cache_close_to_float32_cache():
  """A calibrated e4m3 cache changes the logits of a chunked prefill (prefix read from fp8 pages) by little."""
  prompt = list(np.random.default_rng(7).integers(3, TINY.vocab_size, 120))
  ref = _prefill_logits(_engine(prefill_chunk=32), prompt)
  fp8 = _engine(prefill_chunk=32, cache_dtype="float8_e4m3fn")
  assert fp8.cache.k.dtype == jnp.float8_e4m3fn
  assert fp8.cache.k_scale.shape == fp8.cache.v_scale.shape == (TINY.n_layers, fp8.plan.num_pages, TINY.n_kv_heads)
  got = _prefill_logits(fp8, prompt)
  rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  assert 0 < rel < 0.03, rel


def test_fp8_cache_holds_outliers_a_per_layer_calibration_would_clip(monkeypatch):
  """K and V of every token after the first page scaled 4x: past twice the first page's largest |k|, |v|, where
  per-(layer, kv head) scales calibrated on outlier-free text with 2x headroom would clip them. Each page's own
  scale holds them: layer 0's fp8 pages (the same float K/V in every engine) dequantize within e4m3's rounding,
  and the chunked-prefill logits equal a float32 engine's whose writes round each page to e4m3 at its page's
  scale (chunks are whole pages). Their error against the float32 cache is e4m3's alone: a float32 engine
  writing with clipped per-layer scales errs far more. fp8 pages hold the keys rotated (kvc.fp8_basis), so K is
  compared, and rounded in the float32 engines, in that basis."""
  from lcjax.cache import kv as kvc
  from tests.patch_kv import scale_kv_by_position
  real_write = kvc.write_kv
  four_after_first_page = lambda p: jnp.where(p >= 8, 4.0, 1.0)      # noqa: E731
  scale_kv_by_position(monkeypatch, four_after_first_page, four_after_first_page)
  prompt = list(np.random.default_rng(7).integers(3, TINY.vocab_size, 120))
  f32, fp8 = _engine(prefill_chunk=32), _engine(prefill_chunk=32, cache_dtype="float8_e4m3fn")
  # Prompt logits first: a later prompt would read its chunks' keys from the prefix cache's fp8 pages, where a
  # first one attends to its own chunk's keys in float.
  ref, out = _prefill_logits(f32, prompt), _prefill_logits(fp8, prompt)
  with f32.prefill(prompt) as ref_ctx, fp8.prefill(prompt) as ctx:
    want = [np.asarray(x)[:, ref_ctx.pages()] for x in (kvc.fp8_basis(f32.cache.k), f32.cache.v)]  # [L, n, Z, K, H]
    scales = [np.asarray(s)[:, ctx.pages()][:, :, None, :, None] for s in (fp8.cache.k_scale, fp8.cache.v_scale)]
    got = [np.asarray(x)[:, ctx.pages()].astype(np.float32) * s for x, s in zip((fp8.cache.k, fp8.cache.v), scales)]
  for w, g, s in zip(want, got, scales):
    assert np.all(np.abs(w[0, 1:]).max(axis=(0, 1, 3)) > 2 * np.abs(w[0, 0]).max(axis=(0, 2)))
    assert np.all(np.abs(g[0] - w[0]) <= 2.0 ** -4 * np.abs(w[0]) + 2.0 ** -9 * s[0])

  def rounded(scale_of):
    """A float32 engine whose K, V writes are rounded to e4m3 at scale_of(x [B, T, K, H], layer, is_v)."""
    def round_e4m3(new, s):
      return (kvc.fp8_ops.round_to_e4m3(jnp.clip(new / s, -448, 448)) * s).astype(new.dtype)

    def write(k_all, v_all, k_scale, v_scale, k, v, slots, pages, layer, **kw):
      k_rot = kvc.fp8_basis(k)                                    # rounded where fp8 pages round it, rotated back
      k = round_e4m3(k_rot, scale_of(k_rot, layer, 0)) @ kvc.fp8_ops.rotation(k.shape[-1]).T
      v = round_e4m3(v, scale_of(v, layer, 1))
      return real_write(k_all, v_all, k_scale, v_scale, k, v, slots, pages, layer, **kw)
    monkeypatch.setattr(kvc, "write_kv", write)
    try:
      return _prefill_logits(_engine(prefill_chunk=32), prompt)
    finally:
      monkeypatch.setattr(kvc, "write_kv", real_write)

  def per_page(x, layer, is_v):
    B, T, K, H = x.shape
    return jnp.repeat(kvc.scale_for(jnp.abs(x.reshape(B, T // 8, 8, K, H)).max(axis=(2, 4))), 8, axis=1)[..., None]

  calibrated = jnp.asarray([np.abs(w[:, 0]).max(axis=(1, 3)) * 2 / 448 for w in want])         # [2, L, K]
  clipped = rounded(lambda x, layer, is_v: calibrated[is_v, layer][:, None])
  np.testing.assert_allclose(out, rounded(per_page), rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  rel = lambda a: np.linalg.norm(a - ref) / np.linalg.norm(ref)
  assert 0 < rel(out) < 0.5 * rel(clipped), (rel(out), rel(clipped))


@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_an_overflowed_value_stops_the_request_in_every_cache(monkeypatch, cache_dtype):
  """V at one decode position overflows (planted in decode calls, whose positions are [B, 1]: times inf, and none of
  its values is 0). A float32 cache holds the inf, the logits go NaN and the request stops 'nonfinite' with the
  tokens sampled before. fp8 pages store a value that is not finite as NaN and stop it at the same token: clipped to
  448, the inf would be a finite value the model never produced, and decoding would go on from it."""
  from tests.patch_kv import scale_kv_by_position
  at_7 = lambda p: jnp.where(p == 7, jnp.inf if p.shape[1] == 1 else 1.0, 1.0)      # noqa: E731
  scale_kv_by_position(monkeypatch, lambda p: jnp.ones(p.shape), at_7)
  got = _engine(cache_dtype=cache_dtype).generate(list(range(3, 8)), max_new_tokens=8)
  assert (len(got.token_ids), got.finish_reason) == (3, "nonfinite")      # fed at positions 5 and 6, then 7


@pytest.mark.parametrize("cache_dtype,attention_dtype", [("float32", "auto"), ("float8_e4m3fn", "auto"),
                                                           ("float8_e4m3fn", "float8_e4m3fn")])
def test_an_overflowed_key_stops_the_request_in_every_cache(monkeypatch, cache_dtype, attention_dtype):
  """As above with K: K at position 7 times inf (inf, -inf and NaN values). Every row that sees it has a NaN or inf
  score and a NaN softmax sum, which must reach the logits and stop the request 'nonfinite' with the 3 tokens
  sampled before, through the jnp reference and the FP8 path (its jnp model, the Triton decode kernel in the
  interpreter). Read as 'no key seen' (output 0, lse -inf), the NaN left attention out of every later row and the
  request ran to its length on finite, wrong logits."""
  from tests.patch_kv import scale_kv_by_position
  at_7 = lambda p: jnp.where(p == 7, jnp.inf if p.shape[1] == 1 else 1.0, 1.0)      # noqa: E731
  scale_kv_by_position(monkeypatch, at_7, lambda p: jnp.ones(p.shape))
  fp8 = {} if attention_dtype == "auto" else dict(page_size=16)                     # the Triton kernel's pages
  cfg = TINY if attention_dtype == "auto" else dataclasses.replace(TINY, head_dim=64)     # the FP8 kernel's
  eng = _engine(cfg, cache_dtype=cache_dtype, attention_dtype=attention_dtype, max_batch=1, **fp8)
  got = eng.generate(list(range(3, 8)), max_new_tokens=8)
  assert (len(got.token_ids), got.finish_reason) == (3, "nonfinite")


def test_decode_groups_match_one_step_per_check():
  """decode_sync_every > 1 tests `done` once per group of steps (a host sync): slots that end mid-group (EOS, or
  their token budget) give the same tokens, finish reasons and pages back as with a check after every step."""
  from lcjax.engine.steps import sync_group
  assert [sync_group(n, 8) for n in (16, 12, 13, 7, 3, 1)] == [8, 6, 1, 7, 3, 1]
  assert sync_group(16, 1) == 1
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(3, TINY.vocab_size, n)) for n in (9, 30, 17)]
  budgets = dict(max_new_tokens=21)
  free = [r.token_ids for r in _engine(decode_steps=16).generate(prompts, **budgets)]
  # EOS: the first token of prompt 1's output that neither its earlier tokens nor the other outputs hold
  j = next(j for j in range(1, 21) if free[1][j] not in free[1][:j] + free[0] + free[2])
  cfg = dataclasses.replace(TINY, eos_ids=(free[1][j],))

  def run(every):
    eng = _engine(cfg, decode_sync_every=every)
    assert eng.steps.sync_every == every
    res = eng.generate(prompts, **budgets)
    assert eng.pool.pages_used == 0
    return [(r.token_ids, r.finish_reason) for r in res]

  grouped, single = run(8), run(1)
  assert grouped == single
  assert grouped == [(free[0], "length"), (free[1][:j + 1], "eos"), (free[2], "length")]
  assert j % 8 != 0          # prompt 1 ends mid-group: token j (j >= 1) comes from decode step j - 1 of 0..7


def test_stats_add_up_to_the_prefill_work(eng, monkeypatch):
  """The prefill seconds reported over a call's results (a shared prefix's once, in the first result) cover every
  prefill chunk the call ran, each timed here to its completion; the tokens add up to the prompts'; the time to
  the first token lies between the request's own prefill and the call's wall time."""
  rng = np.random.default_rng(12)
  prefix = rng.integers(3, TINY.vocab_size, 150).tolist()       # 5 chunks of 32
  questions = [rng.integers(3, TINY.vocab_size, n).tolist() for n in (5, 40)]
  eng.prefix_cache.clear()
  spent = []
  prefill = eng.steps.prefill

  def timed(*a, **kw):
    t0 = time.perf_counter()
    out = prefill(*a, **kw)
    jax.block_until_ready(out)
    spent.append(time.perf_counter() - t0)
    return out

  monkeypatch.setattr(eng.steps, "prefill", timed)
  t0 = time.perf_counter()
  outs = eng.generate(questions, prefix=prefix, max_new_tokens=3)
  wall = time.perf_counter() - t0
  assert len(spent) == 5 + 1 + 2
  s = [o.stats for o in outs]
  assert sum(x["prefill_s"] for x in s) >= sum(spent)
  assert s[0]["shared_prefix_prefill_s"] > 0 and s[1]["shared_prefix_prefill_s"] == 0
  assert s[0]["prefill_tokens"] == 150 + 5 and s[0]["cached_tokens"] == 0
  assert s[1]["prefill_tokens"] == 40 and s[1]["cached_tokens"] == 150
  for x in s:
    assert x["prefill_s"] - x["shared_prefix_prefill_s"] <= x["time_to_first_token_s"] <= wall
  # A second call finds the prefix's full pages in the prefix cache: only its last, partly filled page is paid.
  again = eng.generate(questions[0], prefix=prefix, max_new_tokens=3).stats
  assert again["prefill_tokens"] == 150 - 144 + 5 and again["cached_tokens"] == 144


def test_a_request_that_stops_early_in_a_batch_is_charged_its_own_steps(eng, monkeypatch):
  """Two prompts decoded together, 16 steps a device call: prompt 0 stops at EOS after one decoded token while
  prompt 1 decodes 39 in calls of 16, 16 and 7 steps. On a clock where every call takes one second, each is
  charged its calls' time in proportion to the steps it took part in: prompt 0 1/16 s (62.5 ms for its token;
  charged the whole call it reported 1,000 ms), prompt 1 3 s for its 39."""
  from lcjax.engine import scheduler

  class Clock:                  # the scheduler's clock: each reading one second after the one before
    t = 0.0

    def perf_counter(self):
      self.t += 1.0
      return self.t
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(3, TINY.vocab_size, n)) for n in (9, 30)]
  free = [r.token_ids for r in eng.generate(prompts, max_new_tokens=40)]
  eos = free[0][1]
  assert eos not in free[1] and eos != free[0][0]
  stops = _engine(dataclasses.replace(TINY, eos_ids=(eos,)))
  monkeypatch.setattr(scheduler, "time", Clock())
  a, b = stops.generate(prompts, max_new_tokens=40)
  assert (a.finish_reason, a.stats["new_tokens"], b.finish_reason, b.stats["new_tokens"]) == ("eos", 2, "length", 40)
  assert a.stats["decode_ms_per_token"] == 1000 / 16
  assert b.stats["decode_ms_per_token"] == 3000 / 39


def test_each_prompt_of_a_batch_samples_its_own_stream(eng):
  """Prompt i draws with seed + i: three copies of one prompt differ, a call repeats exactly, and prompt i equals
  the prompt alone with seed + i (the oracle: one request's stream depends only on its seed)."""
  p = [5, 6, 7, 8]
  sp = dict(temperature=1.5, seed=7)
  outs = [o.token_ids for o in eng.generate([p] * 3, max_new_tokens=8, sampling=sp)]
  assert len({tuple(o) for o in outs}) == 3
  assert [o.token_ids for o in eng.generate([p] * 3, max_new_tokens=8, sampling=sp)] == outs
  for i, o in enumerate(outs):
    assert eng.generate(p, max_new_tokens=8, sampling=dict(sp, seed=7 + i)).token_ids == o


class _Compiles:
  """Counts what jax does to get a program: traces, compilations and persistent-cache reads (jax.monitoring)."""
  EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration",
            "/jax/compilation_cache/cache_retrieval_time_sec")

  def __init__(self):
    self.seen = []
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, name, secs, **kw):
    if name in self.EVENTS:
      self.seen.append((name, kw.get("fun_name")))

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._on)


@pytest.mark.parametrize("sampling", [None, dict(temperature=0.7, seed=1)], ids=["greedy", "sampled"])
def test_warm_up_compiles_what_generate_then_uses(sampling):
  """Engine.warm_up compiles without running (the cache and the pool are untouched), and the generate it was
  told about then traces and compiles nothing: a prompt of two chunks, and a question on a context whose last
  page is partly filled and whose last chunk (13 tokens, run as 16) is shorter than the question's (20, as 32)."""
  eng = _engine(decode_steps=4)
  rng = np.random.default_rng(13)
  doc, q, prompt = (rng.integers(3, TINY.vocab_size, n).tolist() for n in (45, 20, 50))
  count = _Compiles()
  try:
    cache_before = np.asarray(eng.cache.k).copy()
    # chunks of 32 (the first, then one with a prefix), first token, decode
    assert eng.warm_up(len(prompt), sampling=sampling) == 4
    assert count.seen and np.array_equal(np.asarray(eng.cache.k), cache_before) and eng.pool.pages_used == 0
    count.seen.clear()
    eng.generate(prompt, max_new_tokens=6, sampling=sampling)
    assert count.seen == []
    n = eng.warm_up(len(q), context_tokens=len(doc), sampling=sampling, decode_steps=2)
    # chunks: the context's 32 (first) and 16, the question's 32 (both with a prefix); first token, decode, copy
    assert n == 3 + 1 + 1 + 1
    count.seen.clear()
    with eng.prefill(doc) as ctx:
      eng.generate(q, context=ctx, max_new_tokens=6, sampling=sampling, decode_steps=2)
    assert count.seen == []
  finally:
    count.close()
    eng.close()


def _copies_of_at_least(hlo: str, elements: int, widened: bool = False) -> list[str]:
  """The copy instructions of optimized HLO text whose result holds at least `elements` elements (widened: and the
  float16 / float32 results of converts, which XLA's CPU backend makes of whole float8 operands)."""
  found = []
  for line in hlo.splitlines():
    m = re.search(r"= (?:\w+\[([\d,]*)\]\S* copy|(?:f16|f32)\[([\d,]*)\]\S* convert)\(" if widened else
                  r"= \w+\[([\d,]*)\]\S* copy\(", line)
    dims = m and next(g for g in m.groups() if g is not None)
    if m and math.prod(int(d) for d in dims.split(",") if d) >= elements:
      found.append(line.strip()[:160])
  return found


def pool_copies_in_decode_loop(eng, widened: bool = False) -> list[str]:
  """The copies at least one layer's KV pool in size in the decode loop XLA compiles for `eng` (as serving runs it:
  Scheduler.lower_decode, the arguments of warm-up); widened: and the converts of that size to float16 / float32.
  The engine's pools must be larger than any weight, so such a copy is a copy of a pool."""
  k = eng.cache.k
  layer_pool = k.size // k.shape[0]
  assert max(x.size for x in jax.tree.leaves(eng.scheduler.params)) < layer_pool
  hlo = eng.scheduler.lower_decode(4, greedy=True).compile().as_text()
  assert "while" in hlo
  return _copies_of_at_least(hlo, layer_pool, widened)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the XLA:CPU program (Llama.pool_reads)")
@pytest.mark.parametrize("cache_dtype", ["auto", "float8_e4m3fn"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_loop_copies_no_pool_on_cpu(batch, cache_dtype):
  """The decode loop XLA:CPU compiles (as serving runs it: Scheduler.lower_decode, the arguments of warm-up, XLA's
  optimizations on) copies no array as large as one layer's KV pool: the layer scan writes the pools and attention
  reads them in place, so a step costs the tokens cached, not the pools (Llama's pool_reads: with attention reading
  them as the reshaped [L * P] view, pool_reads="view", XLA:CPU copies K and V 4 times each in every layer of every
  step). The pools are made larger than any weight, so a copy that size is a copy of a pool. Batch 1 (XLA turns
  the write of one row into a dynamic-update-slice) and 3 (a scatter); float32 and fp8 pools (which the loops carry
  as uint8 on the CPU, fp8.as_carry: a float8 carry is copied whole around its updates), none widened whole to a
  wider float either (what XLA's CPU backend does to float8 pools read or written by plain indexing)."""
  # Weights and pools made as every test makes them: their values play no part in the loop's program, and the
  # weights' initializer compiled with XLA's optimizations took about 5 s of the first case.
  eng = _engine(page_size=16, max_context=2048, max_batch=batch, cache_dtype=cache_dtype)
  try:
    with optimized_xla():
      copies = pool_copies_in_decode_loop(eng, widened=True)
    assert copies == [], copies
  finally:
    eng.close()


@pytest.mark.parametrize("chunk", [16384, 4096, 1000])
def test_chunk_buckets_pad_little_and_few(chunk):
  """A prefill chunk of n tokens runs at a padded length b: n <= b <= chunk, b grows with n, above 256 tokens
  fewer than max(n / 4, 128) padded rows (padded rows cost like real ones) and a multiple of the kernels' 128-row
  tile (or the chunk itself), and there are few lengths to compile (27 for 16K chunks)."""
  got = [chunk_bucket(n, chunk) for n in range(1, chunk + 1)]
  assert all(n <= b <= chunk for n, b in zip(range(1, chunk + 1), got))
  assert got == sorted(got)
  assert all(b - n < max(n / 4, ROW_TILE) for n, b in zip(range(257, chunk + 1), got[256:]))
  assert all(b % ROW_TILE == 0 or b == chunk for b in got[256:])
  assert [chunk_bucket(n, 16384) for n in (520, 1100, 3000, 12288, 15360)] == [640, 1280, 3072, 12288, 16384]
  assert len(set(got)) <= {16384: 27, 4096: 19, 1000: 12}[chunk]
  assert chunk_buckets(2 * chunk + 300, chunk) == {chunk, chunk_bucket(300, chunk)}
  # A prompt's first chunk is a program of its own (no prefix read); after a context every chunk reads one.
  assert chunk_programs(2 * chunk + 300, chunk) == {(chunk, False), (chunk, True), (chunk_bucket(300, chunk), True)}
  assert chunk_programs(300, chunk) == {(chunk_bucket(300, chunk), False)}
  assert chunk_programs(300, chunk, cached=5) == {(chunk_bucket(300, chunk), True)}
