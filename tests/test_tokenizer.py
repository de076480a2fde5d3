"""lcjax.tokenizer: sentencepiece against the sentencepiece library, byte-level BPE (SmolLM2's vocabulary rebuilt
from its GGUF) for streaming, BOS/EOS defaults, and the incremental decoder against full decodes.

(ids against HF's own tokenizers are checked in test_convert_gguf.py and test_convert_hf.py.)
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from lcjax.chat_template import ChatTemplateError
from lcjax.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError, infer_add_bos
from tests import fixtures_ckpt as fx

_FFFD = "\ufffd"


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
  from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config, smollm2_gguf_path, write_tokenizer
  d = str(tmp_path_factory.mktemp("smollm2_tok"))
  g = GGUFFile(smollm2_gguf_path())
  write_tokenizer(g, d, gguf_model_config(g))
  return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("sp_tok"))
  fx.sentencepiece_model(os.path.join(d, "tokenizer.model"))
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}}, f)
  return d


@pytest.fixture(scope="module")
def sp(sp_dir):
  import sentencepiece as spm
  return spm.SentencePieceProcessor(model_file=os.path.join(sp_dir, "tokenizer.model"))


def test_sentencepiece_matches_the_library(sp_dir, sp):
  tok = Tokenizer(sp_dir)
  assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.vocab_size) == (1, (2,), True, sp.get_piece_size())
  for text in fx.TEXTS:
    assert tok.encode(text) == [1] + sp.encode(text), text
    assert tok.encode(text, add_bos=False) == sp.encode(text)
    assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_sentencepiece_control_tokens_written_in_text(sp_dir, sp):
  tok = Tokenizer(sp_dir)
  ids = tok.encode("Hello <s> world</s>")
  # each text piece keeps sentencepiece's dummy-prefix space, as llama.cpp does after a special token
  assert ids == [1] + sp.encode("Hello ") + [1] + sp.encode(" world") + [2]
  # and decoding drops that space again: the text round-trips
  assert tok.decode(ids) == "<s>Hello <s> world</s>"
  assert tok.decode(ids, skip_special_tokens=True) == "Hello  world"


def test_byte_level_special_tokens(smollm2_dir):
  tok = Tokenizer(smollm2_dir)   # no lcjax_config.json: BOS/EOS from tokenizer_config.json
  assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (1, (2,), False)
  ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
  assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
  assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
  assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"


def _stream(tok, ids, chunks):
  dec = IncrementalDecoder(tok)
  out, deltas, pos = "", [], 0
  for n in chunks:
    d = dec.push(ids[pos:pos + n])
    pos += n
    assert _FFFD not in d
    deltas.append(d)
    out += d
  return out + dec.flush(), deltas


@pytest.mark.parametrize("which", ["smollm2_dir", "sp_dir"])
def test_incremental_decoder_equals_full_decode(which, request):
  tok = Tokenizer(request.getfixturevalue(which))
  rng = random.Random(0)
  for text in fx.TEXTS + ["🎉🚀👍🏽 終わり", "naïve café " * 5]:
    ids = tok.encode(text, add_bos=False)
    full = tok.decode(ids)
    one_by_one, deltas = _stream(tok, ids, [1] * len(ids))
    assert one_by_one == full, text
    acc = ""
    for d in deltas:
      acc += d
      assert full.startswith(acc)
    chunks = []
    while sum(chunks) < len(ids):
      chunks.append(rng.randint(1, 4))
    assert _stream(tok, ids, chunks)[0] == full


def test_incremental_decoder_holds_back_split_characters(smollm2_dir):
  tok = Tokenizer(smollm2_dir)
  ids = tok.encode("🎉")
  assert len(ids) > 1 and _FFFD in tok.decode(ids[:1])   # a byte-level emoji spans several tokens
  dec = IncrementalDecoder(tok)
  assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
  assert dec.push(ids[-1:]) == "🎉"
  dec = IncrementalDecoder(tok)
  assert dec.push(ids[:1]) == ""
  assert dec.flush() == tok.decode(ids[:1])   # the incomplete tail is released at the end


def test_defaults_from_lcjax_config_and_overrides(sp_dir, tmp_path):
  d = str(tmp_path / "ckpt")
  shutil.copytree(sp_dir, d)
  with open(os.path.join(d, "lcjax_config.json"), "w") as f:
    json.dump({"bos_id": 2, "eos_ids": [1, 0], "add_bos": False}, f)
  tok = Tokenizer(d)
  assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (2, (1, 0), False)
  assert tok.encode("Hello", add_bos=True)[0] == 2
  tok = Tokenizer(d, bos_id=1, eos_ids=[2], add_bos=True)
  assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (1, (2,), True)
  tok = Tokenizer(d, bos_id=None, add_bos=True)
  assert tok.add_bos is False and tok.encode("Hello")[0] != 1   # no BOS id: nothing to add


def test_infer_add_bos(tmp_path, sp_dir):
  empty = tmp_path / "empty"
  empty.mkdir()
  assert infer_add_bos(str(empty)) is None
  assert infer_add_bos(sp_dir) is True
  bl = tmp_path / "bl"
  bl.mkdir()
  fx.byte_level_tokenizer_json(str(bl / "tokenizer.json"))
  assert infer_add_bos(str(bl)) is True          # TemplateProcessing starting with <s>
  (bl / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
  assert infer_add_bos(str(bl)) is False         # the explicit flag wins
  tj = json.loads((bl / "tokenizer.json").read_text())
  tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True}
  (bl / "tokenizer.json").write_text(json.dumps(tj))
  (bl / "tokenizer_config.json").unlink()
  assert infer_add_bos(str(bl)) is False         # SmolLM2-style: no template, no BOS


def test_chat_template_errors(sp_dir, tmp_path):
  tok = Tokenizer(sp_dir)
  with pytest.raises(ValueError, match="has no chat template"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  d = str(tmp_path / "t")
  shutil.copytree(sp_dir, d)
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template":
               "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
               "{{ bos_token }}{{ messages[0]['content'] | tojson }}"}]}, f)
  tok = Tokenizer(d, bos_id=1)
  assert tok.apply_chat_template([{"role": "user", "content": "héllo"}]) == '<s>"héllo"'
  with pytest.raises(ChatTemplateError, match="tokenizer_config.json: the chat template failed: TemplateError: user "
                     "first$"):
    tok.apply_chat_template([{"role": "system", "content": "x"}])
  with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
    Tokenizer(str(tmp_path))


def test_chat_templates_see_what_transformers_hands_them(sp_dir, tmp_path):
  """tools and documents None and tokenizer_config.json's special tokens, as transformers renders every template
  (its render_jinja_template, the oracle): a template's `tools is not none` guard is false, `tools is defined`
  true, and unk_token and pad_token are its strings; given tools reach the template."""
  render_jinja_template = pytest.importorskip(
      "transformers.utils.chat_template_utils", reason="transformers renders the oracle").render_jinja_template
  template = ("{{ bos_token }}{% if tools is not none %}[TOOLS {{ tools | length }}]{% endif %}"
              "{% if documents is defined %}[DOCS {{ documents }}]{% endif %}"
              "{% for m in messages %}[INST] {{ m.content }}[/INST]{% endfor %}{{ unk_token }}|{{ pad_token }}|"
              "{{ eos_token }}")
  special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
  d = str(tmp_path / "t")
  shutil.copytree(sp_dir, d)
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({**special, "chat_template": template}, f)
  tok = Tokenizer(d)
  msgs = [{"role": "user", "content": "Hi"}]
  for kw in ({}, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}):
    want = render_jinja_template(conversations=[msgs], chat_template=template, add_generation_prompt=True,
                                 **special, **kw)[0][0]
    assert tok.apply_chat_template(msgs, **kw) == want, kw


@pytest.mark.parametrize("fname, content, exc, names", [
    ("tokenizer_config.json", "[1, 2]", TokenizerError, "holds a JSON list, not an object"),
    ("tokenizer_config.json", "{", TokenizerError, "not a readable JSON file: JSONDecodeError"),
    ("tokenizer_config.json", "[" * 100000 + "]" * 100000, TokenizerError, "not a readable JSON file"),
    ("tokenizer_config.json", json.dumps({"bos_token": 5, "eos_token": ["x"]}), None, None),
    ("tokenizer_config.json", json.dumps({"chat_template": 7}), ChatTemplateError, "is a int, not text"),
    ("tokenizer_config.json", json.dumps({"chat_template": [{"name": "default"}, 3]}), None, None),
    ("lcjax_config.json", json.dumps({"bos_id": "1", "eos_ids": 2}), TokenizerError, "must be token ids"),
    ("lcjax_config.json", json.dumps({"bos_id": 1, "eos_ids": [True]}), TokenizerError, "must be token ids"),
    ("chat_template.jinja", "{% for %}", ChatTemplateError, "does not compile: TemplateSyntaxError"),
    ("chat_template.jinja", b"\xff\xfe{{ x }}", TokenizerError, "chat_template.jinja: not UTF-8 text"),
], ids=["list", "cut", "deep", "odd-tokens", "template-int", "template-list", "config-types", "config-bool",
        "syntax", "not-utf8"])
def test_broken_tokenizer_files_are_refused_when_loaded(sp_dir, tmp_path, fname, content, exc, names):
  """A tokenizer file of the wrong shape or a template that does not compile is one line naming the file, when
  the Tokenizer is made (before any weight is restored); odd values that mean nothing are ignored."""
  d = str(tmp_path / "t")
  shutil.copytree(sp_dir, d)
  with open(os.path.join(d, fname), "wb") as f:
    f.write(content if isinstance(content, bytes) else content.encode())
  if exc is None:
    Tokenizer(d)
    return
  with pytest.raises(exc, match=names) as e:
    Tokenizer(d)
  assert fname in str(e.value) and "\n" not in str(e.value)
