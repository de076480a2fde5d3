"""Streaming granularity: generate_stream runs decode calls of RunConfig.stream_decode_steps tokens (or a call's
own decode_steps), so with 1 every yield carries the text up to the token sampled just before it, and whatever
the setting the streamed text and tokens are generate()'s greedy ones (the oracle: decode_steps only changes how
often the host looks, never the tokens)."""
from __future__ import annotations

import numpy as np
import pytest

from lcjax.config import ModelConfig, RunConfig
from lcjax.engine.engine import Engine, RequestError
from lcjax.tokenizer import Tokenizer
from tests import fixtures_ckpt as fx

# A tiny model with a real byte-level BPE tokenizer and no EOS: every generation runs to max_new_tokens.
TINY = ModelConfig("stream-tiny", vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   ffn_dim=128, max_position=4096, bos_id=0, eos_ids=(), add_bos=False)
RUN = RunConfig(dtype="float32", page_size=8, max_context=128, max_batch=2, prefill_chunk=32, decode_steps=16,
                stream_decode_steps=1)
N = 40


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  fx.byte_level_tokenizer_json(str(path / "tokenizer.json"))
  return Engine.random(TINY, run=RUN, seed=2, tokenizer=Tokenizer(str(path), bos_id=0, eos_ids=[], add_bos=False))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(2, TINY.vocab_size, 21).tolist(), rng.integers(2, TINY.vocab_size, 9).tolist()]


def _stream(eng, monkeypatch, prompt, **kw):
  """(steps of every decode call, [(decode calls before the yield, text so far)], the stream's result)."""
  calls = []
  real = eng.scheduler.decode_call

  def spy(live, **k):
    calls.append(k["steps"])
    return real(live, **k)
  monkeypatch.setattr(eng.scheduler, "decode_call", spy)
  seen, text = [], ""
  for _, delta in eng.generate_stream(prompt, max_new_tokens=N, **kw):
    text += delta
    seen.append((len(calls), text))
  monkeypatch.setattr(eng.scheduler, "decode_call", real)
  return calls, seen, eng.last_results[0]


def test_stream_yields_every_token_as_it_is_sampled(eng, monkeypatch, prompts):
  """stream_decode_steps=1: one decode call per token, and each yield holds the text of every token sampled so
  far (the prefill's token and one per call; a trailing incomplete UTF-8 sequence waits for its next byte)."""
  expected = eng.generate(prompts[0], max_new_tokens=N)
  calls, seen, res = _stream(eng, monkeypatch, prompts[0])
  assert calls == [1] * (N - 1)
  assert res.token_ids == expected.token_ids and seen[-1][1] == expected.text

  def text(k):   # the text of the first k tokens; before the last, without a trailing incomplete character
    t = eng.tokenizer.decode(res.token_ids[:k], skip_special_tokens=True)
    return t if k == N else t.rstrip("\ufffd")
  assert [t for _, t in seen] == [text(c + 1) for c, _ in seen]
  assert [c for c, _ in seen] == [c for c in range(N) if text(c + 1) != text(c)]    # a yield per token with text


def test_stream_in_bursts_gives_the_same_tokens(eng, monkeypatch, prompts):
  """decode_steps=16 per call (generate()'s setting): the same tokens and text, in at most one yield per call."""
  expected = eng.generate(prompts, max_new_tokens=N)
  calls, seen, _ = _stream(eng, monkeypatch, prompts, decode_steps=16)
  assert calls == [16] * -(-(N - 1) // 16) and len(seen) <= 2 * (len(calls) + 1)
  assert [r.token_ids for r in eng.last_results] == [r.token_ids for r in expected]
  assert [r.text for r in eng.last_results] == [r.text for r in expected]


def test_a_stream_left_unfinished_leaves_its_own_results(eng, prompts):
  """A stream the caller breaks off after its first piece leaves in last_results its tokens so far (a prefix of
  generate()'s), finish_reason "stopped", not the previous call's results; a call refused before it starts
  leaves none."""
  expected = eng.generate(prompts, max_new_tokens=N)
  for _ in eng.generate_stream(prompts[0], max_new_tokens=N, decode_steps=4):
    break
  (res,) = eng.last_results
  assert res.finish_reason == "stopped" and 0 < len(res.token_ids) < N
  assert res.token_ids == expected[0].token_ids[:len(res.token_ids)]
  with pytest.raises(RequestError):
    eng.generate(prompts[0], max_new_tokens=N, decode_steps=0)
  assert eng.last_results == []
  list(eng.generate_stream(prompts[1], max_new_tokens=N))
  assert [r.finish_reason for r in eng.last_results] == ["length"]


def test_generate_takes_decode_steps_per_call(eng, prompts):
  assert (eng.generate(prompts, max_new_tokens=N, decode_steps=1)[1].token_ids
          == eng.generate(prompts, max_new_tokens=N)[1].token_ids)
  for bad in (0, -3, 2.5, True):
    with pytest.raises(RequestError, match=f"decode_steps={bad!r} must be an integer from 1 to max_context="):
      eng.generate(prompts[0], max_new_tokens=4, decode_steps=bad)
