"""Model and run configuration (layer L0: stdlib only).

`ModelConfig` describes a LLaMA-family network; `RunConfig` describes how lcjax runs it (dtypes, paged cache,
chunked prefill, attention backend, mesh). Both are frozen dataclasses built from plain dicts that refuse unknown
keys by name, so a typo in a config file or a CLI override is an error, never silently ignored.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Any, Mapping


class ConfigError(ValueError):
  """A configuration value or key that lcjax cannot use."""


def _is_int(x) -> bool:
  """An integer and not a bool (JSON's true is no count); numpy's integers included."""
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


_TYPES = {"bool": ("true or false", lambda x: isinstance(x, bool)),
          "int": ("an integer", _is_int),
          "float": ("a number", lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)),
          "str": ("a string", lambda x: isinstance(x, str))}


def _check_type(name: str, value, annotation: str) -> None:
  """Refuse (one line) a field value of the wrong kind: a string "no" for a bool would read as True."""
  what, ok = _TYPES[annotation]
  if not ok(value):
    raise ConfigError(f"{name}={value!r} must be {what}")


def _refuse_unknown(cls, keys, where: str) -> None:
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(keys) - names)
  if unknown:
    raise ConfigError(f"unknown {where} key(s) {unknown}; known keys: {sorted(names)}")


def _from_dict(cls, d: Mapping[str, Any], where: str):
  _refuse_unknown(cls, d, where)
  return cls(**d)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1 ("llama3") frequency-dependent rotary scaling."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


# What transformers' LlamaConfig and MistralConfig take for a key config.json leaves out (the file's value wins).
HF_DEFAULTS = {"llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "num_key_value_heads": None},
               "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8}}


def _refuse_unimplemented(hf: Mapping[str, Any], family: str, rope_params: Mapping, rope_scaling: Mapping) -> None:
  """Refuse (one line) HF config fields that make transformers compute something lcjax's model does not: another
  MLP activation than SwiGLU's silu, rotary embeddings on part of each head, Mistral's sliding-window attention
  over a window shorter than the trained context (MistralConfig's default window is 4096)."""
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ConfigError(f"hidden_act={act!r} is not supported; lcjax's MLP is SwiGLU (hidden_act 'silu')")
  for where in (hf, rope_params, rope_scaling):
    partial = where.get("partial_rotary_factor")
    if partial is not None and partial != 1:
      raise ConfigError(f"partial_rotary_factor={partial!r} (rotary embeddings on part of each head) is not "
                        "supported; lcjax rotates the whole head")
  if family == "mistral":
    window = hf.get("sliding_window", 4096)
    trained = hf.get("max_position_embeddings", HF_DEFAULTS[family]["max_position_embeddings"])
    if window is not None and not (_is_int(window) and _is_int(trained) and window >= trained):
      raise ConfigError(f"sliding_window={window!r} is shorter than max_position_embeddings={trained!r}: "
                        "sliding-window attention is not supported (lcjax attends to every earlier token)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  name: str
  vocab_size: int
  dim: int                  # D
  n_layers: int             # L
  n_heads: int              # N
  n_kv_heads: int           # K
  head_dim: int             # H
  ffn_dim: int              # F
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_embeddings: bool = False
  max_position: int = 4096  # trained context length (max_position_embeddings)
  bos_id: int | None = 1
  eos_ids: tuple[int, ...] = (2,)
  add_bos: bool = True

  def __post_init__(self):
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_position"):
      v = getattr(self, f)
      if not _is_int(v) or v < 1 or v >= 2**31:
        raise ConfigError(f"{f}={v!r} must be an integer in [1, 2^31)")
      object.__setattr__(self, f, int(v))
    for f in ("norm_eps", "rope_theta"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < float("inf"):
        raise ConfigError(f"{f}={v!r} must be a finite number > 0")
      object.__setattr__(self, f, float(v))
    eos = self.eos_ids if isinstance(self.eos_ids, (list, tuple)) else (self.eos_ids,)
    for what, i in [("bos_id", self.bos_id)] + [("eos id", e) for e in eos]:
      if i is not None and (not _is_int(i) or not 0 <= i < self.vocab_size):
        raise ConfigError(f"{what}={i!r} is not a token id of the vocabulary [0, {self.vocab_size})")
    object.__setattr__(self, "eos_ids", tuple(eos))
    if self.bos_id is not None:
      object.__setattr__(self, "bos_id", int(self.bos_id))
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", _from_dict(RopeScaling, self.rope_scaling, "rope_scaling"))
    object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))

  @property
  def q_per_kv(self) -> int:
    return self.n_heads // self.n_kv_heads

  def param_count(self) -> int:
    """Exact number of parameters (checked against jax.eval_shape of the model in tests)."""
    D, F, V, L = self.dim, self.ffn_dim, self.vocab_size, self.n_layers
    attn = D * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * D * F + 2 * D
    head = 0 if self.tie_embeddings else V * D
    return V * D + L * per_layer + D + head

  def kv_bytes_per_token(self, itemsize: int = 2) -> int:
    return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["eos_ids"] = list(self.eos_ids)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    return _from_dict(cls, d, "model config")

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], name: str | None = None) -> "ModelConfig":
    """Build from an HF `config.json` dict (transformers 4.x `rope_scaling`/`rope_theta` or 5.x `rope_parameters`)."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type", "")
    family = model_type if model_type in HF_DEFAULTS else next(
        (t for t, a in (("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM")) if a in archs), None)
    if family is None:
      raise ConfigError(f"unsupported architecture model_type={model_type!r} architectures={archs}: "
                        "lcjax converts LLaMA-family models only")
    defaults = HF_DEFAULTS[family]
    rope_params = hf.get("rope_parameters") or {}
    rope_scaling = hf.get("rope_scaling") or None
    for key, v in (("rope_parameters", rope_params), ("rope_scaling", rope_scaling)):
      if v is not None and not isinstance(v, Mapping):
        raise ConfigError(f"{key}={str(v)[:60]!r} must be an object")
    # transformers 4.x reads the top-level rope_theta and rope_scaling, 5.x its rope_parameters: a file holding
    # both with different values means another model to each, so it is refused rather than read one way.
    for key, outer, inner in (("rope_theta", hf, rope_params), *((k, rope_scaling or {}, rope_params) for k in (
        "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))):
      if key in outer and key in inner and outer[key] != inner[key]:
        raise ConfigError(f"{key} is {outer[key]!r} at the top of config.json but {inner[key]!r} in rope_parameters: "
                          "transformers 4 and 5 would read different models; keep one")
    theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling_src = rope_scaling if rope_scaling else rope_params
    rope_type = (scaling_src or {}).get("rope_type", (scaling_src or {}).get("type", "default"))
    scaling = None
    if rope_type == "llama3":
      try:
        scaling = RopeScaling(
            factor=float(scaling_src["factor"]),
            low_freq_factor=float(scaling_src["low_freq_factor"]),
            high_freq_factor=float(scaling_src["high_freq_factor"]),
            original_max_position=int(scaling_src["original_max_position_embeddings"]))
      except KeyError as e:
        raise ConfigError(f"rope_scaling of rope_type 'llama3' has no {e.args[0]!r}") from None
      except (TypeError, ValueError) as e:
        raise ConfigError(f"rope_scaling of rope_type 'llama3' holds a value that is not a number ({e})") from None
    elif rope_type not in ("default", None):
      raise ConfigError(f"unsupported rope_type={rope_type!r}; lcjax supports 'default' and 'llama3'")
    _refuse_unimplemented(hf, family, rope_params, rope_scaling or {})
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if hf.get(k) is None]
    if missing:
      raise ConfigError(f"no {', '.join(missing)} in the HF config (every LLaMA config.json has them)")
    n_heads = hf["num_attention_heads"]
    if not _is_int(n_heads) or n_heads < 1 or not _is_int(hf["hidden_size"]):
      raise ConfigError(f"num_attention_heads={n_heads!r} and hidden_size={hf['hidden_size']!r} must be integers "
                        ">= 1")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
      raise ConfigError(f"rope_theta={theta!r} must be a number")
    eos = hf.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return cls(
        name=name or hf.get("_name_or_path") or model_type,
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads", defaults["num_key_value_heads"]) or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        ffn_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=float(theta),
        rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        bos_id=hf.get("bos_token_id"),
        eos_ids=eos_ids)

  def to_hf(self) -> dict:
    """An HF LlamaConfig dict of this model (used by tests that build an HF oracle)."""
    d = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=self.vocab_size,
             hidden_size=self.dim, num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
             num_key_value_heads=self.n_kv_heads, head_dim=self.head_dim, intermediate_size=self.ffn_dim,
             rms_norm_eps=self.norm_eps, rope_theta=self.rope_theta, tie_word_embeddings=self.tie_embeddings,
             max_position_embeddings=self.max_position, bos_token_id=self.bos_id,
             eos_token_id=list(self.eos_ids) if len(self.eos_ids) != 1 else self.eos_ids[0],
             hidden_act="silu", attention_bias=False, mlp_bias=False)
    if self.rope_scaling is not None:
      r = self.rope_scaling
      d["rope_scaling"] = dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                               high_freq_factor=r.high_freq_factor,
                               original_max_position_embeddings=r.original_max_position)
    return d


_L31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=128, rope_theta=10000.0, max_position=4096, bos_id=1, eos_ids=(2,)),
    "smollm2-135m": ModelConfig("smollm2-135m", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                head_dim=64, ffn_dim=1536, rope_theta=100000.0, tie_embeddings=True,
                                max_position=8192, bos_id=1, eos_ids=(2,), add_bos=False),
    "llama2-7b": ModelConfig("llama2-7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                             head_dim=128, ffn_dim=11008, rope_theta=10000.0, max_position=4096, bos_id=1,
                             eos_ids=(2,)),
    "llama3-8b": ModelConfig("llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             head_dim=128, ffn_dim=14336, rope_theta=500000.0, max_position=8192,
                             bos_id=128000, eos_ids=(128001, 128009)),
    "llama3.1-8b": ModelConfig("llama3.1-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                               n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0,
                               rope_scaling=_L31, max_position=131072, bos_id=128000,
                               eos_ids=(128001, 128008, 128009)),
    "llama3.1-70b": ModelConfig("llama3.1-70b", vocab_size=128256, dim=8192, n_layers=80, n_heads=64,
                                n_kv_heads=8, head_dim=128, ffn_dim=28672, rope_theta=500000.0,
                                rope_scaling=_L31, max_position=131072, bos_id=128000,
                                eos_ids=(128001, 128008, 128009)),
}


def preset(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise ConfigError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
  return PRESETS[name]


def load_model_config(path: str | os.PathLike) -> ModelConfig:
  """Read lcjax's own `lcjax_config.json` or an HF `config.json` (told apart by their keys)."""
  with open(path) as f:
    d = json.load(f)
  return ModelConfig.from_dict(d) if "n_layers" in d else ModelConfig.from_hf(d)


# RunConfig.attention_dtype -> the dtype the FP8 kernel quantizes Q and K to (P and V are e4m3 in both): e4m3
# throughout, or int8 Q K^T (exact integer products of absmax / 127 blocks) beside e4m3 P V.
ATTENTION_DTYPES = {"auto": None, "float8_e4m3fn": "float8_e4m3fn", "int8_fp8": "int8"}
# RunConfig.weight_dtype: "bfloat16" names the run's dtype (float32 on CPUs), i.e. unquantized weights.
WEIGHT_DTYPES = ("auto", "bfloat16", "float8_e4m3fn")
# The names of what multiplies fp8 weights in decode-sized calls: XLA's widened product, or a GEMV kernel
# (lcjax.ops.kernels.GEMV_KERNELS, by these names).
GEMV_NAMES = ("xla", "mosaic", "pallas", "pallas-interpret")
# The names of what writes a decode step's K and V into fp8 pages: XLA's ops, or a page writer
# (lcjax.ops.kernels.PAGE_WRITERS, by these names).
PAGE_WRITER_NAMES = ("xla", "pallas", "mosaic", "pallas-interpret")
# RunConfig.linear_kernel and RunConfig.page_write: one of those, or "auto" (lcjax.engine.placement.decode_linear,
# lcjax.engine.placement.page_write choose).
LINEAR_KERNELS = ("auto", *GEMV_NAMES)
# RunConfig.decode_kernel: which of the pallas backend's decode kernels reads the pages in decode steps
# (lcjax.ops.pallas_backend.PallasBackend.decode_route).
DECODE_KERNELS = ("auto", "mosaic", "triton")
# RunConfig.prefill_kernel: what reads a prefill chunk's keys from the pages on the pallas backend
# (lcjax.ops.pallas_backend.PallasBackend.prefill_route).
PREFILL_KERNELS = ("auto", "cudnn", "mosaic")
PAGE_WRITES = ("auto", *PAGE_WRITER_NAMES)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
  """How a model holds its projection and MLP weights: in the parameter dtype, or as e4m3 with float32 scales per
  output channel (lcjax.ops.linear). `static_inputs`: fp8 weights whose activations are quantized with the
  checkpoint's per-tensor input scales, not per token."""
  fp8: bool = False
  static_inputs: bool = False

  def __post_init__(self):
    if self.static_inputs and not self.fp8:
      raise ConfigError("static input scales need fp8 weights")

  @property
  def name(self) -> str | None:
    """The weight dtype's name ("float8_e4m3fn"), None for the parameter dtype."""
    return "float8_e4m3fn" if self.fp8 else None

  def describe(self, dtype: str) -> str:
    if not self.fp8:
      return dtype
    return "float8_e4m3fn (" + ("static per-tensor" if self.static_inputs else "per-token") + " activations)"

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | None) -> "WeightFormat":
    return cls() if not d else _from_dict(cls, d, "weight format")

  def for_run(self, weight_dtype: str) -> "WeightFormat":
    """The format a run serves a checkpoint stored in this format with (RunConfig.weight_dtype)."""
    if weight_dtype == "auto":
      return self
    if weight_dtype == "float8_e4m3fn":
      return self if self.fp8 else WeightFormat(fp8=True)
    return WeightFormat()


# RunConfig.draft and its limits: a verify step feeds k + 1 <= 16 rows a sequence.
DRAFT_SOURCES = ("off", "prompt")
MAX_DRAFT_NGRAM, MAX_DRAFT_TOKENS = 16, 15


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """How lcjax runs a model. Every field can be overridden from the CLI (`--config.page_size=128`)."""
  dtype: str = "auto"                # parameters and activations: "auto" (bfloat16 on accelerators, float32 on
                                     # CPUs, where bf16 matmuls are emulated), "bfloat16", "float32" (checks)
  cache_dtype: str = "auto"          # "auto" (= dtype), "bfloat16", "float32", "float8_e4m3fn"
  weight_dtype: str = "auto"         # the projection and MLP weights: "auto" (as the checkpoint stores them),
                                     # "bfloat16" (= dtype: an fp8 checkpoint is dequantized at load) or
                                     # "float8_e4m3fn" (a checkpoint in dtype is quantized at load, one scale per
                                     # output channel; lcjax.ops.linear). Embeddings, norms and the LM head stay
                                     # in dtype
  linear_kernel: str = "auto"        # fp8 weights in decode-sized calls (<= 64 rows): "auto" (on a GPU, each
                                     # device of a mesh on its shards: mosaic on Hopper for products that tile by
                                     # 64, else pallas; else xla; the log says why), "mosaic"
                                     # (lcjax.ops.mosaic_gpu.gemv: reads the stacked fp8 weights in place, one byte
                                     # a weight, TMA and wgmma),
                                     # "pallas" (lcjax.ops.triton.gemv: the same product in Pallas' Triton
                                     # lowering, sm_89+), "xla" (widened by XLA: a copy in dtype of each layer's
                                     # slice), "pallas-interpret" (the Triton kernel in Pallas' interpreter)
  page_write: str = "auto"           # a decode step's K and V into fp8 pages: "auto" (mosaic where it compiles,
                                     # else pallas where it compiles, else xla; the log says why),
                                     # "mosaic" (lcjax.ops.mosaic_gpu.page_write: K, V and their page scales in
                                     # one kernel; Hopper, JAX 0.11+, head_dim 128, page_size 64 or 128),
                                     # "pallas" (lcjax.ops.triton.page_write: the same in Triton; a CUDA GPU of
                                     # sm_89+, power-of-two page_size and head_dim),
                                     # "xla" (nine small XLA kernels a layer), "pallas-interpret"
  decode_kernel: str = "auto"        # decode steps over the pages, on the pallas backends: "auto" (mosaic on
                                     # Hopper where its kernels read the pages; else triton, the log says why),
                                     # "mosaic" (lcjax.ops.mosaic_gpu.paged and .combine, bf16 and fp8 pages: no
                                     # Triton attention kernel; Hopper), "triton" (lcjax.ops.triton.paged, both
                                     # page dtypes); cuDNN decodes with its own
  prefill_kernel: str = "auto"       # what reads a prefill chunk's cached prefix from the pages, on the pallas
                                     # backend: "auto" (mosaic on Hopper over bf16 pages of 64 tokens or more,
                                     # as timed; else cudnn, the table says why), "cudnn" (cuDNN's paged kernel),
                                     # "mosaic" (lcjax.ops.mosaic_gpu.flash.flash_attention_paged: our flash
                                     # kernel reading K and V where they lie; Hopper)
  page_size: int = 64                # Z: tokens per KV page
  num_pages: int = 0                 # P: pages in the pool (0: enough for max_batch * max_context + null page)
  max_context: int = 0               # 0: the model's trained context (max_position)
  allow_beyond_trained_context: bool = False   # max_context past the trained context: refused unless set
  max_batch: int = 4                 # sequences decoded together
  prefill_chunk: int = 2048          # tokens per prefill chunk (activation memory is bounded by this)
  decode_steps: int = 64             # decode tokens per device call (the on-device loop's budget)
  stream_decode_steps: int = 8       # decode tokens per device call of generate_stream, i.e. the most tokens one
                                     # yield carries (0: decode_steps; 1: every token as soon as it is sampled).
                                     # Llama-3-8B on an H100: 8 costs 1.05-1.07x the ms/token of 64, 1 costs
                                     # 1.41-1.44x (benchmarks/results/stream.md)
  decode_sync_every: int = 1         # decode steps between host checks for EOS: N > 1 saves a device-to-host
                                     # stall a token (~0.1 ms on an H200) but runs up to N - 1 steps after the
                                     # last live request ends; for long fixed-length generation (benchmarks).
                                     # Groups are the largest divisor of decode_steps up to N (1 if none)
  draft: str = "off"                 # speculative decoding (lcjax.engine.speculate): "off", or "prompt": each
                                     # decode step also feeds up to draft_tokens tokens that followed the
                                     # sequence's last draft_ngram tokens where they occurred before in it
                                     # (the document, the question, the answer), and keeps those the model
                                     # agrees with; greedy output is unchanged, sampled output keeps its
                                     # distribution (docs/speculative-decoding.md says when it pays)
  draft_ngram: int = 3               # tokens that must match for a draft (1 to 16)
  draft_tokens: int = 4              # k: drafts verified per step (1 to 15; a step feeds k + 1 rows a sequence)
  attention: str = "auto"            # auto | reference | cudnn | pallas | dense (baseline)
  attention_dtype: str = "auto"      # "auto" (attention computes in `dtype`) | "float8_e4m3fn": FP8 attention for
                                     # prefill (the pallas backend's FP8 kernel; independent of cache_dtype) |
                                     # "int8_fp8": the same kernel with int8 Q K^T and e4m3 P V
  prefix_cache: bool = True          # keep full KV pages after their requests end; reuse them for prompts
                                     # that start with the same tokens (lcjax.cache.prefix)
  host_cache_gib: float = 0.0        # host memory for cached pages evicted from the device (0: they are dropped)
  tensor: int = 1                    # mesh axis sizes
  seq: int = 1
  sp_mode: str = "ring"              # ring (zigzag layout) | ring-plain (contiguous blocks) | ulysses
  compile_cache: str = "auto"        # JAX's persistent compilation cache, so a second start does not compile
                                     # again: "auto" (JAX's own JAX_COMPILATION_CACHE_DIR or
                                     # JAX_ENABLE_COMPILATION_CACHE=false where set, else
                                     # <user cache>/jax-compile), "off", or a directory

  def __post_init__(self):
    for f in dataclasses.fields(self):
      _check_type(f.name, getattr(self, f.name), f.type)
    if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
      raise ConfigError(f"dtype={self.dtype!r} must be one of auto, bfloat16, float32, float16")
    if self.cache_dtype not in ("auto", "bfloat16", "float32", "float16", "float8_e4m3fn"):
      raise ConfigError(f"cache_dtype={self.cache_dtype!r} must be auto, bfloat16, float32, float16 or "
                        "float8_e4m3fn")
    if self.weight_dtype not in WEIGHT_DTYPES:
      raise ConfigError(f"weight_dtype={self.weight_dtype!r} must be one of {', '.join(WEIGHT_DTYPES)}")
    if self.linear_kernel not in LINEAR_KERNELS:
      raise ConfigError(f"linear_kernel={self.linear_kernel!r} must be one of {', '.join(LINEAR_KERNELS)}")
    if self.decode_kernel not in DECODE_KERNELS:
      raise ConfigError(f"decode_kernel={self.decode_kernel!r} must be one of {', '.join(DECODE_KERNELS)}")
    if self.prefill_kernel not in PREFILL_KERNELS:
      raise ConfigError(f"prefill_kernel={self.prefill_kernel!r} must be one of {', '.join(PREFILL_KERNELS)}")
    if self.page_write not in PAGE_WRITES:
      raise ConfigError(f"page_write={self.page_write!r} must be one of {', '.join(PAGE_WRITES)}")
    for f in ("page_size", "max_batch", "prefill_chunk", "decode_steps", "decode_sync_every", "tensor", "seq"):
      if getattr(self, f) < 1:
        raise ConfigError(f"{f}={getattr(self, f)} must be >= 1")
    if self.draft not in DRAFT_SOURCES:
      raise ConfigError(f"draft={self.draft!r} must be 'off' or 'prompt' (drafts looked up in the sequence itself)")
    for f, top in (("draft_ngram", MAX_DRAFT_NGRAM), ("draft_tokens", MAX_DRAFT_TOKENS)):
      v = getattr(self, f)
      if not 1 <= v <= top:                                        # an integer: checked with every field
        raise ConfigError(f"{f}={v!r} must be an integer from 1 to {top}")
    if self.stream_decode_steps < 0:
      raise ConfigError(f"stream_decode_steps={self.stream_decode_steps} must be >= 0 (0: decode_steps)")
    if self.max_context < 0:
      raise ConfigError(f"max_context={self.max_context} must be >= 0 (0: the model's trained context)")
    if self.num_pages < 0 or self.num_pages == 1:
      raise ConfigError(f"num_pages={self.num_pages} must be 0 (enough for max_batch sequences of max_context "
                        "tokens) or >= 2 (the null page and one more)")
    if self.host_cache_gib > 0 and not self.prefix_cache:
      raise ConfigError(f"host_cache_gib={self.host_cache_gib} keeps the prefix cache's evicted pages, but "
                        "prefix_cache=False keeps none: set prefix_cache=True or host_cache_gib=0")
    if not self.compile_cache.strip():
      raise ConfigError(f"compile_cache={self.compile_cache!r} must be 'auto', 'off' or a directory")
    if not 0 <= self.host_cache_gib < float("inf"):
      raise ConfigError(f"host_cache_gib={self.host_cache_gib} must be a finite number >= 0")
    if self.prefill_chunk % self.page_size:
      raise ConfigError(f"prefill_chunk={self.prefill_chunk} must be a multiple of page_size={self.page_size}")
    if self.attention not in ("auto", "reference", "cudnn", "pallas", "dense"):
      raise ConfigError(f"attention={self.attention!r} must be auto, reference, cudnn, pallas or dense "
                        "(the unoptimised baseline)")
    if self.attention_dtype not in ATTENTION_DTYPES:
      raise ConfigError(f"attention_dtype={self.attention_dtype!r} must be one of {', '.join(ATTENTION_DTYPES)}")
    if self.attention_dtype != "auto" and self.attention not in ("auto", "pallas"):
      raise ConfigError(f"attention_dtype={self.attention_dtype} runs on the pallas backend, "
                        f"not attention={self.attention!r}")
    if self.sp_mode not in ("ring", "ring-plain", "ulysses"):
      raise ConfigError(f"sp_mode={self.sp_mode!r} must be ring, ring-plain (no zigzag: the load-imbalanced "
                        "baseline) or ulysses")

  def for_platform(self, platform: str) -> "RunConfig":
    """This config with dtype="auto" made concrete for a JAX platform ("gpu", "cuda", "tpu", "cpu", ...)."""
    if self.dtype != "auto":
      return self
    return self.replace(dtype="float32" if platform == "cpu" else "bfloat16")

  @property
  def resolved_cache_dtype(self) -> str:
    if self.dtype == "auto" and self.cache_dtype == "auto":
      raise ConfigError("dtype='auto' is not resolved yet: call RunConfig.for_platform first")
    return self.dtype if self.cache_dtype == "auto" else self.cache_dtype

  @property
  def stream_steps(self) -> int:
    """Decode tokens per device call of a stream."""
    return self.stream_decode_steps or self.decode_steps

  def context_for(self, model: ModelConfig) -> int:
    return self.max_context or model.max_position

  def replace(self, **kw) -> "RunConfig":
    _refuse_unknown(RunConfig, kw, "run config")
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "RunConfig":
    return _from_dict(cls, d, "run config")
