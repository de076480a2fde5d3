"""Builders for checkpoint and tokenizer tests: HF folders with random weights, tiny tokenizers, GGUF files.

Everything is made on the fly (no network): HF folders through transformers' save_pretrained, tokenizers
trained on a few sentences with the `tokenizers` and `sentencepiece` libraries, GGUF files with gguf.GGUFWriter.
"""
from __future__ import annotations

import io
import json
import os

import numpy as np

from tests import hf_oracle

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 123 456",
    "Ünïcödé text: café, naïve, 日本語, Привет мир, emoji 🎉.",
    "Numbers 3.14159 and 2718281828; tabs\tand  double  spaces.",
    "Hello world! Hello again, world. Lorem ipsum dolor sit amet.",
] * 20

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "multiple   spaces\n\n\ttabs\r\nand newlines",
    "digits 0123456789 and 3.14159 and 1,000,000",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Ünïcödé: café naïve 日本語 中文 Привет мир 🎉🚀👍🏽",
    "",
    "<|im_start|>user\nHi there<|im_end|>\n",
]


def byte_level_tokenizer_json(path: str, vocab_size: int = 300) -> dict:
  """A trained byte-level BPE with <s>/</s> (ids 0/1) whose post-processor prepends <s>, like Llama 3's."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(CORPUS, trainer)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", 0)])
  tok.save(path)
  return {"bos": 0, "eos": 1, "vocab_size": tok.get_vocab_size()}


def sentencepiece_model(path: str, vocab_size: int = 400) -> None:
  """A trained sentencepiece BPE model shaped like Llama 2's (<unk>, <s>, </s>, byte fallback, identity
  normalization, no whitespace squeezing)."""
  import sentencepiece as spm
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=vocab_size,
                                 model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                 remove_extra_whitespaces=False, split_digits=True, unk_id=0, bos_id=1,
                                 eos_id=2, character_coverage=0.99, minloglevel=2)
  with open(path, "wb") as f:
    f.write(buf.getvalue())


def make_hf_folder(dst: str, cfg, *, seed: int = 0, max_shard_size=None, tokenizer: bool = True):
  """save_pretrained a random HF LlamaForCausalLM of `cfg` (float32 safetensors) into dst; returns the model."""
  model = hf_oracle.make_hf_llama(cfg, seed=seed)
  kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(dst, safe_serialization=True, **kw)
  if tokenizer:
    byte_level_tokenizer_json(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
      json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, f)
    with open(os.path.join(dst, "chat_template.jinja"), "w") as f:
      f.write(LLAMA3_TEMPLATE)
  return model


def hf_state_dict(model) -> dict[str, np.ndarray]:
  return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


# Llama-3-8B-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if "
    "loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def lcjax_model(ckpt_dir: str, dtype: str = "float32", mesh=None):
  """(model, tokenizer) restored from an lcjax checkpoint through lcjax.checkpoint.load_checkpoint."""
  from flax import nnx
  import jax.numpy as jnp
  from lcjax.checkpoint import load_checkpoint
  from lcjax.model.llama import Llama
  cfg, params, tokenizer = load_checkpoint(ckpt_dir, dtype=dtype, mesh=mesh)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))),
                          nnx.Param)
  return nnx.merge(graphdef, params), tokenizer


def write_gguf(path: str, *, arch: str = "llama", cfg=None, tensors: dict | None = None, tokenizer=None,
               extra: dict | None = None) -> None:
  """A GGUF file: `llama.*` hyperparameters of cfg, float32 `tensors` (GGUF names, row-major [out, in]),
  and a tokenizer dict {model, tokens, scores, token_type, bos, eos, unk, add_bos, merges, pre}."""
  import gguf
  w = gguf.GGUFWriter(path, arch)
  if cfg is not None:
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
  for key, value in (extra or {}).items():
    if isinstance(value, bool):
      w.add_bool(key, value)
    elif isinstance(value, int):
      w.add_uint32(key, value)
    elif isinstance(value, float):
      w.add_float32(key, value)
    else:
      w.add_string(key, value)
  if tokenizer is not None:
    w.add_tokenizer_model(tokenizer["model"])
    if "pre" in tokenizer:
      w.add_tokenizer_pre(tokenizer["pre"])
    w.add_token_list(tokenizer["tokens"])
    if "scores" in tokenizer:
      w.add_token_scores(tokenizer["scores"])
    w.add_token_types(tokenizer["token_type"])
    if "merges" in tokenizer:
      w.add_token_merges(tokenizer["merges"])
    for key, fn in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id)):
      if tokenizer.get(key) is not None:
        fn(tokenizer[key])
    if "add_bos" in tokenizer:
      w.add_add_bos_token(tokenizer["add_bos"])
  for name, arr in (tensors or {}).items():
    w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def sentencepiece_vocab(model_file: str) -> dict:
  """The tokenizer dict of write_gguf for a sentencepiece model, as llama.cpp's converter stores it."""
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=model_file)
  n = sp.get_piece_size()
  types = []
  for i in range(n):
    types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
                 5 if sp.is_unused(i) else 1)
  return {"model": "llama", "tokens": [sp.id_to_piece(i) for i in range(n)],
          "scores": [sp.get_score(i) for i in range(n)], "token_type": types, "bos": sp.bos_id(),
          "eos": sp.eos_id(), "unk": sp.unk_id(), "add_bos": True}
