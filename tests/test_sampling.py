"""Sampling against plain numpy definitions of greedy, temperature, top-k and top-p."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.engine.sampling import SamplingParams, all_greedy, sample, stack


def _draw(logits, params, n, start=0):
  """n samples of one row: each draw uses a different position (the key's only other input)."""
  lg = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
  sp = stack([params] * n)
  return np.asarray(jax.jit(sample)(lg, sp, jnp.arange(start, start + n, dtype=jnp.int32)))


LOGITS = np.log(np.array([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]))


def test_greedy_is_argmax():
  rng = np.random.default_rng(0)
  lg = rng.normal(size=(5, 50)).astype(np.float32)
  out = sample(jnp.asarray(lg), stack([SamplingParams()] * 5), jnp.zeros(5, jnp.int32))
  np.testing.assert_array_equal(np.asarray(out), lg.argmax(-1))


def test_greedy_flag_skips_only_what_greedy_rows_ignore():
  lg = jnp.asarray(np.random.default_rng(1).normal(size=(4, 300)).astype(np.float32))
  params = [SamplingParams(top_k=5, top_p=0.5, seed=s) for s in range(4)]     # temperature 0: greedy
  assert all_greedy(params) and not all_greedy(params + [SamplingParams(temperature=0.5)])
  pos = jnp.arange(4, dtype=jnp.int32)
  np.testing.assert_array_equal(np.asarray(sample(lg, stack(params), pos, greedy=True)),
                                np.asarray(sample(lg, stack(params), pos)))


def test_temperature_frequencies_follow_softmax():
  n = 20000
  for t in (1.0, 0.5):
    got = np.bincount(_draw(LOGITS, SamplingParams(temperature=t, seed=1), n), minlength=8) / n
    p = np.exp(LOGITS / t) / np.exp(LOGITS / t).sum()
    assert np.abs(got - p).max() < 4 * np.sqrt(p.max() / n) + 1e-3, (t, got, p)


def test_top_k_only_draws_the_k_best():
  got = _draw(LOGITS, SamplingParams(temperature=1.0, top_k=3, seed=2), 5000)
  assert set(np.unique(got)) == {0, 1, 2}
  freq = np.bincount(got, minlength=3)[:3] / len(got)
  p = np.array([0.35, 0.25, 0.15]) / 0.75
  assert np.abs(freq - p).max() < 0.03


def test_top_p_keeps_the_smallest_prefix_reaching_p():
  # cumulative 0.35, 0.60, 0.75, 0.85: p=0.7 keeps the first three tokens
  got = _draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.7, seed=3), 5000)
  assert set(np.unique(got)) == {0, 1, 2}
  assert set(np.unique(_draw(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6, seed=3), 200))) == {0}


def test_top_p_one_keeps_every_token():
  """top_p = 1 is off (transformers adds no top-p step for it): every token stays drawable, also a tail whose
  probabilities (2e-9 each) float32's running sum no longer adds to 1.0."""
  from lcjax.engine.sampling import filtered_logits
  logits = jnp.asarray([[20.0, 0.0, 0.0, 0.0]], jnp.float32)
  kept = np.isfinite(np.asarray(filtered_logits(logits, stack([SamplingParams(temperature=1.0, top_p=1.0)]))))
  assert kept.all(), kept


def test_top_k_and_top_p_combine():
  got = _draw(LOGITS, SamplingParams(temperature=1.0, top_k=2, top_p=0.9, seed=4), 3000)
  assert set(np.unique(got)) == {0, 1}


def test_seeded_and_reproducible():
  a = _draw(LOGITS, SamplingParams(temperature=1.0, seed=5), 100)
  b = _draw(LOGITS, SamplingParams(temperature=1.0, seed=5), 100)
  c = _draw(LOGITS, SamplingParams(temperature=1.0, seed=6), 100)
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()


@pytest.mark.parametrize("kw, match", [(dict(temperature=-1.0), "temperature=-1.0"), (dict(top_k=-3), "top_k=-3"),
                                       (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
                                       (dict(temperature=float("nan")), "temperature=nan")])
def test_bad_parameters(kw, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kw)


def test_unknown_option_named():
  with pytest.raises(ValueError, match=r"unknown sampling option\(s\) \['topk'\]"):
    SamplingParams.make({"topk": 3})
