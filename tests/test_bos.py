"""Exactly one BOS, with Llama-3's real vocabulary (tests/llama3_vocab.py: llama.cpp's ggml-vocab-llama-bpe.gguf,
a committed subset exact on the texts used here) read through lcjax's GGUF converter.

Oracles: llama.cpp's own ids for its 46 tokenizer test strings, the ids transformers gives to Meta's Llama-3
instruct template (recorded from the full vocabulary), and the literal ids of the known special tokens. The
engine's and the CLI's prompt paths (plain prompt, chat, prefix=, a context and its question) are observed where
the ids reach the scheduler.
"""
from __future__ import annotations

import numpy as np
import pytest

from lcjax.config import ModelConfig, RunConfig
from lcjax.engine.scheduler import Scheduler
from lcjax.tokenizer import Tokenizer
from tests import cli_inprocess
from tests import fixtures_ckpt as fx
from tests import llama3_vocab as l3

BOS = l3.BOS
# <|begin_of_text|> <|start_header_id|> user <|end_header_id|> \n\n Hello there <|eot_id|> <|start_header_id|>
# assistant <|end_header_id|> \n\n
HELLO_CHAT = [128000, 128006, 882, 128007, 271, 9906, 1070, 128009, 128006, 78191, 128007, 271]
HELLO = [9906, 1070]
TINY = ModelConfig("llama3-vocab-tiny", vocab_size=128256, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                   head_dim=16, ffn_dim=64, rope_theta=500000.0, max_position=512, tie_embeddings=True,
                   bos_id=BOS, eos_ids=(l3.EOT,), add_bos=True)
RUN = RunConfig(dtype="float32", page_size=16, prefill_chunk=64, max_context=256, max_batch=2, decode_steps=4)


def _tensors(cfg: ModelConfig, seed: int = 0) -> dict:
  """Random float32 GGUF tensors (row-major [out, in]) of a llama model."""
  rng = np.random.default_rng(seed)
  w = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  t = {"token_embd.weight": w(cfg.vocab_size, cfg.dim), "output_norm.weight": np.ones(cfg.dim, np.float32)}
  for i in range(cfg.n_layers):
    t.update({f"blk.{i}.attn_norm.weight": np.ones(cfg.dim, np.float32), f"blk.{i}.attn_q.weight": w(q, cfg.dim),
              f"blk.{i}.attn_k.weight": w(kv, cfg.dim), f"blk.{i}.attn_v.weight": w(kv, cfg.dim),
              f"blk.{i}.attn_output.weight": w(cfg.dim, q), f"blk.{i}.ffn_norm.weight": np.ones(cfg.dim, np.float32),
              f"blk.{i}.ffn_gate.weight": w(cfg.ffn_dim, cfg.dim), f"blk.{i}.ffn_up.weight": w(cfg.ffn_dim, cfg.dim),
              f"blk.{i}.ffn_down.weight": w(cfg.dim, cfg.ffn_dim)})
  return t


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """(fixture dict, lcjax checkpoint dir): a tiny random model with Llama-3's vocabulary and Meta's instruct
  template written as a GGUF file and converted by lcjax (reading a 128K-token GGUF takes the gguf package
  seconds: once per module)."""
  from lcjax.checkpoint import convert_gguf
  d = tmp_path_factory.mktemp("llama3-vocab")
  path = str(d / "tiny-llama3.gguf")
  fix = l3.write_gguf(path, cfg=TINY, tensors=_tensors(TINY), extra={"tokenizer.chat_template": fx.LLAMA3_TEMPLATE})
  convert_gguf(path, str(d / "ckpt"), progress=False)
  return fix, str(d / "ckpt")


@pytest.fixture(scope="module")
def vocab(ckpt):
  """(fixture dict, lcjax's Tokenizer of the converted GGUF)."""
  return ckpt[0], Tokenizer(ckpt[1])


def test_the_vocabulary_tokenizes_as_llama_cpp(vocab):
  """The GGUF rebuilt by lcjax: llama.cpp's ids on its 46 test strings; BOS added by default (the GGUF has no
  tokenizer.ggml.add_bos_token key and llama.cpp adds BOS for the llama-bpe pre-tokenizer)."""
  fix, tok = vocab
  assert (fix["texts"], fix["chats"]) == (l3.TEXTS, l3.CHATS), "texts changed: derive the fixture again"
  assert len(fix["llama_cpp_vectors"]) == 46
  for v in fix["llama_cpp_vectors"]:
    assert tok.encode(v["text"], add_bos=False) == v["ids"], v["text"]
  assert (tok.bos_id, tok.add_bos, tok.vocab_size) == (BOS, True, 128256)
  assert tok.encode("Hello there") == [BOS] + HELLO


def test_chat_template_gives_the_ids_transformers_gives(vocab):
  fix, tok = vocab
  assert fix["transformers_chat_ids"][0] == HELLO_CHAT
  for msgs, want in zip(l3.CHATS, fix["transformers_chat_ids"]):
    assert tok.encode_chat(msgs) == want
  # A rendered template already starts with <|begin_of_text|>: encoding it adds no second BOS.
  assert tok.encode(tok.apply_chat_template(l3.CHATS[0])) == HELLO_CHAT


@pytest.fixture
def seen(monkeypatch):
  """The token ids that reach the scheduler: the prompt of every request served, every context pinned."""
  got = []
  serve, pin = Scheduler.serve, Scheduler._pin       # _pin: contexts and a call's shared prefix alike

  def spy_serve(self, reqs, *a, **kw):
    got.extend(list(r.prompt) for r in reqs)
    return serve(self, reqs, *a, **kw)

  def spy_pin(self, ids, *a, **kw):
    got.append(list(ids))
    return pin(self, ids, *a, **kw)

  monkeypatch.setattr(Scheduler, "serve", spy_serve)
  monkeypatch.setattr(Scheduler, "_pin", spy_pin)
  return got


def _one_bos(ids):
  return ids[0] == BOS and ids.count(BOS) == 1


@pytest.fixture(scope="module")
def eng(vocab):
  from lcjax.engine.engine import Engine
  return Engine.random(TINY, run=RUN, tokenizer=vocab[1])


def test_engine_prompts_get_exactly_one_bos(eng, vocab, seen):
  fix, tok = vocab
  eng.generate("Hello there", max_new_tokens=1)
  eng.generate("Hello there", chat=True, max_new_tokens=1)
  eng.generate(l3.CHATS[1], chat=True, max_new_tokens=1)
  eng.generate(tok.apply_chat_template(l3.CHATS[0]), max_new_tokens=1)       # a template rendered by the user
  assert seen == [[BOS] + HELLO, HELLO_CHAT, fix["transformers_chat_ids"][1], HELLO_CHAT]


def test_prefix_and_context_continuations_get_no_second_bos(eng, vocab, seen):
  _, tok = vocab
  system, qs = l3.TEXTS[1], l3.TEXTS[2:4]
  eng.generate(qs, prefix=system, max_new_tokens=1)
  head = tok.encode(system)
  assert seen == [head + tok.encode(q, add_bos=False) for q in qs] + [head] and head[0] == BOS   # + the pinned prefix
  seen.clear()
  with eng.prefill(l3.DOC) as ctx:
    eng.generate(l3.TEXTS[5], context=ctx, max_new_tokens=1)
  doc = tok.encode(l3.DOC)
  assert seen == [doc, doc + tok.encode(l3.TEXTS[5], add_bos=False)]
  assert all(_one_bos(ids) for ids in seen)


def test_a_chat_context_and_its_question_are_the_chat_transformers_renders(eng, vocab, seen):
  """engine.prefill(doc, chat=True) + generate(question, context=ctx, chat=True): the ids transformers gives the
  whole chat, one BOS."""
  fix, _ = vocab
  with eng.prefill(l3.DOC, chat=True) as ctx:
    eng.generate("What is the password?", context=ctx, chat=True, max_new_tokens=1)
  assert seen[1] == fix["transformers_chat_ids"][2] and seen[1][:len(seen[0])] == seen[0]
  assert _one_bos(seen[1])


# -- the CLI, in this process ----------------------------------------------------------------------------------

def test_cli_prompts_get_exactly_one_bos(ckpt, seen, tmp_path):
  """The CLI's chat prompt, plain prompt and context + question."""
  fix, path = ckpt
  common = [f"--checkpoint={path}", "--max_new_tokens=1", "--nowarmup", "--nostream"]
  for extra in ([], ["--nochat"]):
    p = cli_inprocess.run(common + ["--prompt=Hello there", *extra])
    assert p.returncode == 0, p.stderr
  assert seen == [HELLO_CHAT, [BOS] + HELLO]
  seen.clear()
  # The context ends where the chat's user turn ends before its question; the question closes the turn. The
  # document ends in a word, so the split does not cut a token the whole chat would merge: the two pieces
  # together are the chat's ids.
  doc = tmp_path / "doc.txt"
  doc.write_text(l3.DOC, encoding="utf-8")
  p = cli_inprocess.run(common + [f"--context_file={doc}", "--prompt=What is the password?"])
  assert p.returncode == 0, p.stderr
  assert len(seen) == 2 and seen[1][:len(seen[0])] == seen[0]
  assert seen[1] == fix["transformers_chat_ids"][2]
