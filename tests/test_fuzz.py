"""Fuzzing the request path with hypothesis: prompts of random Unicode, control characters, long runs of one
character and special-token text, token-id prompts, and sampling options, valid or not.

The model is tiny and random but its tokenizer is real: SmolLM2's byte-level BPE (49,152 tokens), rebuilt from the
bundled GGUF, with the model's vocabulary the same size. Properties: a request either generates or is refused
with a RequestError exactly when an independent validity rule says it must be; generated tokens lie inside the
vocabulary; the same request with the same seed gives the same tokens and text again; the engine keeps no page
afterwards; and the tokenizer gives back the text it encoded, unless that text holds a byte the vocabulary lacks
(SmolLM2's has 235 of the 256 byte tokens: "\x16" and five other control characters, and 15 high bytes that
text hardly ever holds, 0xc0, 0xc1, 0xf1, 0xf2, 0xf5-0xff, are dropped, as transformers drops them). The
@example rows pin the cases the fuzzing found: a prompt that encodes to no token, and a top_k beyond int32.
"""
from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from lcjax.config import ModelConfig, RunConfig
from lcjax.engine.engine import Engine, RequestError
from lcjax.tokenizer import Tokenizer

V = 49152
CFG = ModelConfig("fuzz-tiny", vocab_size=V, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
                  max_position=8192, bos_id=1, eos_ids=(2,), add_bos=False)
RUN = RunConfig(dtype="float32", page_size=16, prefill_chunk=256, max_context=1024, max_batch=2, decode_steps=8)
FUZZ = settings(max_examples=int(os.environ.get("LCJAX_FUZZ_EXAMPLES", "40")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
  from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config, smollm2_gguf_path, write_tokenizer
  g = GGUFFile(smollm2_gguf_path())
  path = str(tmp_path_factory.mktemp("smollm2_tokenizer"))
  write_tokenizer(g, path, gguf_model_config(g))
  tok = Tokenizer(path)
  assert tok.vocab_size == V and tok.eos_ids == CFG.eos_ids
  e = Engine.random(CFG, run=RUN, seed=0, tokenizer=tok)
  vocab = {tok.id_to_token(i) for i in range(V)}
  e.byte_gaps = {b for b, c in _bytes_to_unicode().items() if c not in vocab}
  assert 0x16 in e.byte_gaps and 0x41 not in e.byte_gaps
  return e


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  out, n = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + n)
      n += 1
  return out


_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "user\n", "assistant\n", "\n", " ", "é", "🎉", "<|im_"]
_CONTROL = st.characters(max_codepoint=0x1f) | st.sampled_from("\x7f\x85\xa0\u2028\u2029\ufeff\u200b\u200d")
texts = st.one_of(
    st.text(min_size=1, max_size=300),                                            # any code point but surrogates
    st.text(_CONTROL, min_size=1, max_size=120),                                  # control characters
    st.builds(lambda c, n: c * n, st.characters(exclude_categories=("Cs",)),     # one character, many times
              st.integers(100, 4000)),
    st.lists(st.sampled_from(_SPECIAL), min_size=1, max_size=40).map("".join),   # special tokens as text
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=20), st.characters(categories=("Cs",)),
              st.text(max_size=20)),                                            # a lone surrogate
)
samplings = st.fixed_dictionaries({
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    "top_k": st.one_of(st.just(0), st.integers(1, V + 100)),
    "top_p": st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    "seed": st.integers(0, 2**32 - 1),
})


def _check_result(eng, res, max_new):
  assert 1 <= len(res.token_ids) <= max_new
  assert all(0 <= t < V for t in res.token_ids), res.token_ids
  if res.finish_reason == "eos":
    assert res.token_ids[-1] in CFG.eos_ids
  else:
    assert res.finish_reason == "length" and len(res.token_ids) == max_new
  assert isinstance(res.text, str)
  assert eng.pool.pages_used == 0


@FUZZ
@given(text=texts, sampling=samplings, max_new=st.integers(1, 12))
@example(text="", sampling=dict(temperature=0.0, top_k=0, top_p=1.0, seed=0), max_new=2)
@example(text="\x16", sampling=dict(temperature=0.0, top_k=0, top_p=1.0, seed=0), max_new=2)
@example(text="ab\udcffc", sampling=dict(temperature=0.0, top_k=0, top_p=1.0, seed=0), max_new=2)
@example(text="\x00" * 3000, sampling=dict(temperature=2.0, top_k=5, top_p=0.5, seed=2**32 - 1), max_new=12)
def test_text_prompts(eng, text, sampling, max_new):
  valid_unicode = not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
  if not text or not valid_unicode:
    event("refused: empty" if not text else "refused: not Unicode")
    with pytest.raises(RequestError, match="empty prompt" if not text else "not valid Unicode"):
      eng.generate(text, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  ids = eng.tokenizer.encode(text)
  if not eng.byte_gaps & set(text.encode("utf-8")):
    assert eng.tokenizer.decode(ids) == text                   # byte-level BPE loses nothing else
  if not ids:
    event("refused: no tokens")
    with pytest.raises(RequestError, match="encodes to no tokens"):
      eng.generate(text, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  if len(ids) + max_new > RUN.max_context:
    event("refused: longer than the context")
    with pytest.raises(RequestError, match=rf"has {len(ids)} tokens \+ max_new_tokens={max_new} = "
                                           rf"{len(ids) + max_new} > max context {RUN.max_context}"):
      eng.generate(text, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  event("generated")
  first = eng.generate(text, max_new_tokens=max_new, sampling=sampling)
  _check_result(eng, first, max_new)
  assert first.prompt_tokens == len(ids)
  again = eng.generate(text, max_new_tokens=max_new, sampling=sampling)
  assert (again.token_ids, again.text) == (first.token_ids, first.text)


def _valid_sampling(s) -> bool:
  """The rule the engine documents, written independently of lcjax.engine.sampling."""
  def integer(x):
    return isinstance(x, int) and not isinstance(x, bool)
  t, k, p, seed = s["temperature"], s["top_k"], s["top_p"], s["seed"]
  return (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 and integer(k) and k >= 0
          and isinstance(p, (int, float)) and 0 < p <= 1 and integer(seed) and 0 <= seed < 2**32)


any_number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**40, 2**40))
wild_samplings = st.fixed_dictionaries({
    "temperature": st.one_of(st.floats(-1, 3), any_number), "top_k": st.one_of(st.integers(-5, 100), any_number),
    "top_p": st.one_of(st.floats(-0.5, 1.5), any_number), "seed": st.one_of(st.integers(-5, 2**33), any_number)})


@FUZZ
@given(ids=st.one_of(st.lists(st.integers(0, V - 1), min_size=1, max_size=60),
                     st.lists(st.one_of(st.integers(-3, V + 3), st.integers(-2**62, 2**62)), max_size=60)),
       sampling=st.one_of(samplings, wild_samplings), max_new=st.integers(-2, 10))
@example(ids=[5, 6], sampling=dict(temperature=1.0, top_k=2**40, top_p=1.0, seed=2**32 - 1), max_new=3)
@example(ids=[5, 6], sampling=dict(temperature=1e300, top_k=0, top_p=0.5, seed=0), max_new=3)
@example(ids=[5, 6], sampling=dict(temperature=1.0, top_k=0, top_p=1.0, seed=2**32), max_new=3)
def test_token_id_prompts_and_sampling_options(eng, ids, sampling, max_new):
  valid = (bool(ids) and all(0 <= t < V for t in ids) and max_new >= 1 and _valid_sampling(sampling)
           and len(ids) + max_new <= RUN.max_context)
  event("refused" if not valid else "generated")
  if not valid:
    with pytest.raises(RequestError):
      eng.generate(ids, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  first = eng.generate(ids, max_new_tokens=max_new, sampling=sampling)
  _check_result(eng, first, max_new)
  assert eng.generate(ids, max_new_tokens=max_new, sampling=sampling).token_ids == first.token_ids
