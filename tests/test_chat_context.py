"""Questions about a document the way users ask them: a chat context (`Engine.prefill(doc, chat=True)`) continued by
`generate(question, context=ctx, chat=True)`, with the bundled SmolLM2's real tokenizer and chat template on a tiny
random model of its vocabulary (8-token pages, so documents end mid-page and questions span pages).

Oracles: the ids of the cold chat [{"role": "user", "content": document + "\\n\\n" + question}] rendered and
encoded whole (Tokenizer.encode_chat, the path `generate(messages, chat=True)` takes), and the greedy tokens of an
engine without a prefix cache given those ids.
"""
from __future__ import annotations

import copy

import pytest

from lcjax.config import ModelConfig, RunConfig
from lcjax.engine.engine import Engine, RequestError
from lcjax.engine.scheduler import Scheduler
from lcjax.tokenizer import Tokenizer

CFG = ModelConfig("smollm2-vocab-tiny", vocab_size=49152, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                  ffn_dim=64, max_position=1024, tie_embeddings=True, bos_id=1, eos_ids=(2,), add_bos=False)
RUN = RunConfig(dtype="float32", page_size=8, prefill_chunk=64, max_context=512, max_batch=2, decode_steps=4)

DOCS = {"a sentence": "The ferry ran twice an hour. Remember this: the password is PELICAN-42. The mill stood by "
                      "the river.",
        "a trailing newline": "Notes from the market.\nSalt, wool and apples were sold.\n",
        "trailing spaces": "The bridge counts boats   ",
        "digits mid-word": "Ledger entry 20451x",
        "blank lines and punctuation": "Chapter 1!!\n\n\n"}
QUESTIONS = ["What is the password?", "\nAnswer in one word: where did the mill stand?",
             "Summarize every sentence of the text above in order, then list each product that the merchants sold "
             "on market days and say which of them came in barrels."]     # longer than a page


@pytest.fixture(scope="module")
def tok(smollm2_checkpoint):
  return Tokenizer(smollm2_checkpoint)


@pytest.fixture(scope="module")
def eng(tok):
  return Engine.random(CFG, run=RUN, seed=1, tokenizer=tok)


@pytest.fixture
def seen(monkeypatch):
  """The prompt ids of every request served."""
  got = []
  serve = Scheduler.serve

  def spy(self, reqs, *a, **kw):
    got.extend(list(r.prompt) for r in reqs)
    return serve(self, reqs, *a, **kw)

  monkeypatch.setattr(Scheduler, "serve", spy)
  return got


def _cold(tok, doc, q):
  """The oracle's ids: the user turn's text written out here ("\\n\\n" between document and question, as
  Engine.prefill documents it), not taken from lcjax.tokenizer."""
  return tok.encode_chat([{"role": "user", "content": doc + "\n\n" + q}])


@pytest.mark.parametrize("name", list(DOCS))
def test_chat_context_tokens_are_the_cold_chat(eng, tok, seen, name):
  doc = DOCS[name]
  with eng.prefill(doc, chat=True) as ctx:
    assert len(ctx) % RUN.page_size                  # every context here ends inside a page
    eng.generate(QUESTIONS, context=ctx, chat=True, max_new_tokens=1)
    for q in QUESTIONS[:1]:
      for _ in eng.generate_stream(q, context=ctx, chat=True, max_new_tokens=1):
        pass
  assert len(seen) == 4
  for ids, q in zip(seen, QUESTIONS + QUESTIONS[:1]):
    want = _cold(tok, doc, q)
    assert ids == want, (name, q)
    assert ids[:len(ctx)] == ctx.token_ids
    assert ids.count(CFG.bos_id) == want.count(CFG.bos_id)    # one BOS: the template's, none added at the join
  assert len(_cold(tok, doc, QUESTIONS[2])) - len(ctx) > RUN.page_size


def test_chat_context_answers_as_the_cold_chat(eng, tok):
  """Several questions on one context are independent, and each generates what the cold chat generates on an
  engine without a prefix cache; a system turn takes the template default's place."""
  doc = DOCS["a sentence"]
  oracle = Engine.random(CFG, run=RUN.replace(prefix_cache=False), seed=1, tokenizer=tok)   # eng's weights
  with eng.prefill(doc, chat=True, system="Answer briefly.") as ctx:
    outs = eng.generate(QUESTIONS[:2], context=ctx, chat=True, max_new_tokens=6)
    again = eng.generate(QUESTIONS[1], context=ctx, chat=True, max_new_tokens=6)
  for q, out in zip(QUESTIONS, outs):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": doc + "\n\n" + q}]
    want = oracle.generate(msgs, chat=True, max_new_tokens=6)
    assert out.token_ids == want.token_ids and out.prompt_tokens == want.prompt_tokens
  assert again.token_ids == outs[1].token_ids
  assert outs[0].stats["cached_tokens"] == len(ctx)
  oracle.close()


def test_chat_context_survives_save_and_load(eng, tok, tmp_path, seen):
  with eng.prefill(DOCS["a trailing newline"], chat=True) as ctx:
    ctx.save(tmp_path / "ctx")
  with eng.load_context(tmp_path / "ctx") as back:
    assert back.chat == ctx.chat
    eng.generate(QUESTIONS[0], context=back, chat=True, max_new_tokens=1)
  assert seen == [_cold(tok, DOCS["a trailing newline"], QUESTIONS[0])]


def test_chat_context_refusals(eng, tok):
  """One line each: no chat template, a chat context asked without chat and the reverse, ids as a chat
  document, a system turn without chat."""
  plain = copy.copy(tok)
  plain.chat_template = None
  eng.tokenizer = plain
  try:
    with pytest.raises(RequestError, match=r"chat=True needs a checkpoint with a chat template; .* has none"):
      eng.prefill("doc", chat=True)
  finally:
    eng.tokenizer = tok
  with eng.prefill("doc", chat=True) as ctx, eng.prefill("doc") as raw:
    with pytest.raises(RequestError, match="ask with chat=True"):
      eng.generate("q", context=ctx)
    with pytest.raises(RequestError, match=r"prefill\(document, chat=True\)"):
      eng.generate("q", context=raw, chat=True)
    with pytest.raises(RequestError, match="is text"):
      eng.generate([[5, 6]], context=ctx, chat=True)
  with pytest.raises(RequestError, match="text document"):
    eng.prefill([5, 6, 7], chat=True)
  with pytest.raises(RequestError, match="give chat=True too"):
    eng.prefill("doc", system="be brief")
  assert eng.pool.pages_used == 0 and not eng.scheduler.pinned


def test_the_split_holds_back_what_a_question_could_merge(tok):
  """Tokenizer.chat_document: the pinned ids never end in a token the next text would merge with (a trailing
  newline joins the separator's), for documents ending in every kind of character."""
  for doc in ["end\n", "end \t", "end.", "end", "x" * 50, "é" * 20, "1234"]:
    split = tok.chat_document(doc)
    held = split.continuation.held
    assert held and split.continuation.text("q").startswith(held)
    for q in ("q", "\n\nq", " q"):
      assert split.ids + tok.encode(split.continuation.text(q), add_bos=False) == _cold(tok, doc, q), (doc, q)


def test_warm_up_takes_the_question_as_text(eng):
  """Engine.warm_up(question, context=ctx, chat=True) compiles the chunk lengths the question's tokens need (the
  rest of the chat turn, not the question's own token count), so its generate compiles nothing: compile_s is 0
  there and was not on the cold call before it."""
  from tests.test_engine import _Compiles
  q = QUESTIONS[2]                                  # longer than a page
  with eng.prefill(DOCS["a sentence"], chat=True) as ctx:
    count = _Compiles()
    try:
      eng.warm_up(q, context=ctx, chat=True, decode_steps=2)
      count.seen.clear()
      res = eng.generate(q, context=ctx, chat=True, max_new_tokens=3, decode_steps=2)
      assert count.seen == [] and res.stats["compile_s"] == 0.0
    finally:
      count.close()
  cold = Engine.random(CFG, run=RUN, seed=1, tokenizer=eng.tokenizer)
  assert cold.generate("hi", chat=True, max_new_tokens=2).stats["compile_s"] > 0
  cold.close()
