"""Llama-3's real vocabulary for tokenizer and BOS tests, as a small committed subset of llama.cpp's
`ggml-vocab-llama-bpe.gguf` (the tokenizer-only GGUF that llama.cpp ships in the llama-cpp-python source
package).

tests/data/llama3-vocab.json holds, at their real ids, the tokens and merges byte-level BPE uses on the covered
texts (llama.cpp's 46 tokenizer test strings and the prompts of the BOS tests: `TEXTS`, `CHATS`), the 256 byte
tokens and all 256 special tokens, with the source's version and sha256s. For a covered text the subset tokenizes
exactly as the full vocabulary does: BPE applies, word by word, the lowest-ranked merge present, and every merge
it applies is kept in the original order. `write_gguf` writes it back as a 128,256-token GGUF (the other ids hold
filler tokens no text reaches: a letter then digits, which the pre-tokenizer always splits) with the original's
metadata, no `tokenizer.ggml.add_bos_token` key included, so lcjax's GGUF converter reads it as it reads the
original.

The fixture also records, computed from the full vocabulary: llama.cpp's own ids for its 46 strings (the .out
file next to the GGUF) and the ids transformers gives to each chat of `CHATS` under Meta's Llama-3 instruct
template (transformers' GGUF tokenizer and `apply_chat_template`).

Derive it again (downloads the ~77 MB sdist from PyPI; transformers reads the full GGUF in a minute or two):

  python -m tests.llama3_vocab [--version=0.3.36] [--sdist=llama_cpp_python-0.3.36.tar.gz]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "llama3-vocab.json")
VERSION = "0.3.36"
MEMBER = "vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf"

# Texts the BOS tests encode: a plain prompt, a prefix and its continuations, a context document and its question.
DOC = "The ferry ran twice an hour. Remember this: the password is PELICAN-42. The mill stood by the river"
TEXTS = ["Hello there", "You are a helpful assistant.", " What is the capital of France?", " Name a river in Paris.",
         DOC, " What is the password?"]
# Conversations rendered with Meta's template (tests.fixtures_ckpt.LLAMA3_TEMPLATE).
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": DOC + "\n\nWhat is the password?"}],
]
BOS, EOT = 128000, 128009


def load() -> dict:
  with open(FIXTURE, encoding="utf-8") as f:
    return json.load(f)


def _filler(i: int) -> str:
  return f"x{i}"


def write_gguf(path: str, *, cfg=None, tensors: dict | None = None, extra: dict | None = None,
               fix: dict | None = None) -> dict:
  """Write the fixture (default: the committed one) as a GGUF file: Llama-3's vocabulary (128,256 ids), with
  `cfg`'s hyperparameters and `tensors` when given (a model), else the original's metadata only, plus `extra`
  keys. Returns the fixture."""
  from lcjax.config import ModelConfig
  from tests import fixtures_ckpt as fx
  fix = fix or load()
  meta = fix["metadata"]
  n = meta["llama.vocab_size"]
  tokens = [_filler(i) for i in range(n)]
  types = [1] * n
  for i, t in fix["tokens"].items():
    tokens[int(i)] = t
  for i, ty in fix["token_types"].items():
    types[int(i)] = ty
  if cfg is None:
    cfg = ModelConfig(meta["general.name"], vocab_size=n, dim=meta["llama.embedding_length"],
                      n_layers=meta["llama.block_count"], n_heads=meta["llama.attention.head_count"],
                      n_kv_heads=meta["llama.attention.head_count_kv"],
                      head_dim=meta["llama.rope.dimension_count"], ffn_dim=meta["llama.feed_forward_length"],
                      rope_theta=meta["llama.rope.freq_base"], max_position=meta["llama.context_length"],
                      norm_eps=meta["llama.attention.layer_norm_rms_epsilon"])
  fx.write_gguf(path, cfg=cfg, tensors=tensors, extra={"general.name": meta["general.name"], **(extra or {})},
                tokenizer={"model": meta["tokenizer.ggml.model"], "pre": meta["tokenizer.ggml.pre"],
                           "tokens": tokens, "token_type": types, "merges": fix["merges"],
                           "bos": meta["tokenizer.ggml.bos_token_id"], "eos": meta["tokenizer.ggml.eos_token_id"]})
  return fix


# -- deriving the fixture from the sdist ------------------------------------------------------------------------

def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _fetch(version: str, work: str, sdist: str | None) -> tuple[str, str]:
  """(sdist path, directory holding the vocabulary GGUF and its .inp/.out) of llama-cpp-python==version, from
  PyPI unless `sdist` is the file already downloaded."""
  if sdist is None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", work,
                    f"llama-cpp-python=={version}"], check=True)
    sdist = os.path.join(work, f"llama_cpp_python-{version}.tar.gz")
  with tarfile.open(sdist) as tar:
    for ext in ("", ".inp", ".out"):
      tar.extract(f"llama_cpp_python-{version}/{MEMBER}{ext}", work, filter="data")
  return sdist, os.path.join(work, f"llama_cpp_python-{version}", os.path.dirname(MEMBER))


def _vectors(models_dir: str) -> tuple[list[str], list[list[int]]]:
  """llama.cpp's tokenizer test strings and their ids (test-tokenizer-0's file format)."""
  base = os.path.join(models_dir, os.path.basename(MEMBER))
  with open(base + ".inp", encoding="utf-8") as f:
    texts = f.read().split("\n__ggml_vocab_test__\n")[:-1]
  with open(base + ".out", encoding="utf-8") as f:
    ids = [[int(x) for x in line.split()] for line in f.read().split("\n")[:-1]]
  assert len(texts) == len(ids), (len(texts), len(ids))
  return texts, ids


def _used(tok, merges: list[str], special: list[str], texts: list[str]) -> tuple[set[str], set[str]]:
  """(tokens, merges) that byte-level BPE with Llama-3's rules (whole words in the vocabulary first) uses on texts.
  tok: a `tokenizers.Tokenizer` of the full vocabulary, for its pre-tokenizer."""
  vocab = tok.get_vocab(with_added_tokens=False)
  rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
  split = re.compile("(" + "|".join(re.escape(s) for s in sorted(special, key=len, reverse=True)) + ")")
  used_tokens, used_merges = set(), set()
  for text in texts:
    for part in split.split(text):
      if not part or part in special:
        continue
      for word, _ in tok.pre_tokenizer.pre_tokenize_str(part):
        if word in vocab:
          used_tokens.add(word)
          continue
        syms = list(word)
        used_tokens.update(syms)
        while len(syms) > 1:
          pairs = [(rank.get(p, len(rank)), i) for i, p in enumerate(zip(syms, syms[1:]))]
          r, i = min(pairs)
          if r == len(rank):
            break
          used_merges.add(merges[r])
          syms[i:i + 2] = [syms[i] + syms[i + 1]]
          used_tokens.add(syms[i])
  return used_tokens, used_merges


def derive(version: str, sdist: str | None = None) -> dict:
  import jinja2
  import transformers
  from lcjax.checkpoint.gguf import GGUFFile, _byte_level_tokenizer
  from tests.fixtures_ckpt import LLAMA3_TEMPLATE
  with tempfile.TemporaryDirectory() as work:
    sdist, models = _fetch(version, work, sdist)
    path = os.path.join(models, os.path.basename(MEMBER))
    g = GGUFFile(path)
    tokens = g.get("tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type")
    merges = g.get("tokenizer.ggml.merges")
    special = [t for t, ty in zip(tokens, types) if ty == 3]
    ll_texts, ll_ids = _vectors(models)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(LLAMA3_TEMPLATE)
    rendered = [template.render(messages=c, add_generation_prompt=True, bos_token=tokens[BOS]) for c in CHATS]
    full = _byte_level_tokenizer(g)
    used_tokens, used_merges = _used(full, merges, special, ll_texts + TEXTS + rendered)
    keep = sorted({i for i, t in enumerate(tokens) if t in used_tokens or types[i] != 1}
                  | {i for i, t in enumerate(tokens) if len(t) == 1})   # the byte alphabet
    assert not any(_filler(i) in used_tokens for i in range(len(tokens)))
    hf = transformers.AutoTokenizer.from_pretrained(models, gguf_file=os.path.basename(MEMBER))
    hf.chat_template = LLAMA3_TEMPLATE
    chat_ids = [list(hf.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
                for c in CHATS]
    meta = {k: g.get(k) for k in g.keys() if not k.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                                 "tokenizer.ggml.merges"))}
    fix = {
        "source": {"package": "llama-cpp-python", "version": version, "sdist_sha256": _sha256(sdist),
                   "file": MEMBER, "file_sha256": _sha256(path)},
        "metadata": meta,
        "tokens": {str(i): tokens[i] for i in keep},
        "token_types": {str(i): types[i] for i in keep if types[i] != 1},
        "merges": [m for m in merges if m in used_merges],
        "llama_cpp_vectors": [{"text": t, "ids": ids} for t, ids in zip(ll_texts, ll_ids)],
        "transformers_chat_ids": chat_ids,
        "texts": TEXTS,
        "chats": CHATS,
    }
    # The subset must tokenize every covered text as the full vocabulary does (lcjax's rebuild of both).
    with tempfile.TemporaryDirectory() as d:
      small = os.path.join(d, "subset.gguf")
      write_gguf(small, fix=fix)
      sub = _byte_level_tokenizer(GGUFFile(small))
      for text in ll_texts + TEXTS + rendered:
        want = full.encode(text, add_special_tokens=False).ids
        assert sub.encode(text, add_special_tokens=False).ids == want, text
      agree = sum(full.encode(t, add_special_tokens=False).ids == ids for t, ids in zip(ll_texts, ll_ids))
      hf_agree = sum(hf.encode(t, add_special_tokens=False) == ids for t, ids in zip(ll_texts, ll_ids))
    print(f"{len(keep)} tokens, {len(fix['merges'])} merges kept; llama.cpp vectors: lcjax {agree}/{len(ll_ids)}, "
          f"transformers {hf_agree}/{len(ll_ids)}; chat ids {chat_ids}")
  return fix


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--version", default=VERSION, help="llama-cpp-python sdist version")
  p.add_argument("--sdist", help="the sdist (llama_cpp_python-VERSION.tar.gz) already downloaded")
  args = p.parse_args()
  fix = derive(args.version, args.sdist)
  os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
  with open(FIXTURE, "w", encoding="utf-8") as f:
    json.dump(fix, f, ensure_ascii=False, indent=0)
  print(f"wrote {FIXTURE} ({os.path.getsize(FIXTURE):,} bytes)")


if __name__ == "__main__":
  main()
