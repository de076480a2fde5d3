"""HF transformers LLaMA folders (config.json + safetensors) to lcjax checkpoints, one tensor at a time.

Safetensors headers are parsed here (8-byte length + JSON) and each tensor is read with one `np.fromfile`, so
host memory stays near the largest single tensor (plus its transposed copy) however large the model is, and
bfloat16 needs no torch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import time
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from tqdm import tqdm

from lcjax.checkpoint.layout import (QUANTIZED, CheckpointError, flatten, param_shapes, stored_shapes,
                                     stored_tensor, unwrap)
from lcjax.checkpoint.patterns import MAX_VISITS, Pattern
from lcjax.checkpoint.values import cast_finite, check_e4m3, check_scale
from lcjax.checkpoint.writer import CheckpointWriter
from lcjax.config import ConfigError, ModelConfig, WeightFormat
from lcjax import tokenizer as tok

# HF tensor name -> (lcjax name, in_dims). in_dims None: same layout. in_dims k: HF's [out, in] matrix is
# transposed to [in, out] and reshaped to lcjax's shape, whose first k dims are the input dims; e.g. q_proj
# [N*H, D] -> [D, N, H] (k=1), o_proj [D, N*H] -> [N, H, D] (k=2). The rotary layout stays HF's rotate_half.
HF_NAMES: dict[str, tuple[str, int | None]] = {
    "model.embed_tokens.weight": ("embed/embedding", None),
    "model.layers.{i}.input_layernorm.weight": ("layers/attn_norm/scale", None),
    "model.layers.{i}.self_attn.q_proj.weight": ("layers/attn/wq", 1),
    "model.layers.{i}.self_attn.k_proj.weight": ("layers/attn/wk", 1),
    "model.layers.{i}.self_attn.v_proj.weight": ("layers/attn/wv", 1),
    "model.layers.{i}.self_attn.o_proj.weight": ("layers/attn/wo", 2),
    "model.layers.{i}.post_attention_layernorm.weight": ("layers/mlp_norm/scale", None),
    "model.layers.{i}.mlp.gate_proj.weight": ("layers/mlp/w_gate", 1),
    "model.layers.{i}.mlp.up_proj.weight": ("layers/mlp/w_up", 1),
    "model.layers.{i}.mlp.down_proj.weight": ("layers/mlp/w_down", 1),
    "model.norm.weight": ("final_norm/scale", None),
    "lm_head.weight": ("lm_head/kernel", 1),
}
# Buffers some exporters save that carry no weights (recomputed from the config).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LAYER = re.compile(r"\.(\d+)\.")
# Files copied into the checkpoint as they are; the Tokenizer reads them from there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
           "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def hf_shape(shape: tuple[int, ...], in_dims: int | None) -> tuple[int, ...]:
  """The HF shape of a tensor whose lcjax (per-layer) shape is `shape`."""
  if in_dims is None:
    return tuple(shape)
  return (int(np.prod(shape[in_dims:])), int(np.prod(shape[:in_dims])))


def to_lcjax(w: np.ndarray, shape: tuple[int, ...], in_dims: int | None) -> np.ndarray:
  """The lcjax layout of an HF [out, in] matrix: a strided view, no copy (the writer copies it once anyway)."""
  if in_dims is None:
    return w
  return w.T.reshape(shape)


def to_hf(w: np.ndarray, in_dims: int | None) -> np.ndarray:
  """The inverse of `to_lcjax`: an lcjax (per-layer) tensor in HF's [out, in] layout."""
  if in_dims is None:
    return w
  return w.reshape(int(np.prod(w.shape[:in_dims])), -1).T


def export_hf(params, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
  """(HF tensor name, array) for every tensor of a checkpoint-shaped lcjax state (an `nnx.State`, such as
  `Engine.params` unless a mesh made it repeat KV heads), one tensor at a time on the host: HF_NAMES read backwards.
  Loads lcjax weights into HF transformers (an oracle on the same weights) or writes them back out."""
  flat = {name: unwrap(leaf) for name, leaf in flatten(params)}
  shapes = param_shapes(cfg)
  have = stored_shapes({name: tuple(arr.shape) for name, arr in flat.items()})
  for name, (shape, _) in shapes.items():
    if name in have and tuple(have[name]) != tuple(shape):
      raise ValueError(f"{name} has shape {tuple(have[name])}, {cfg.name} has {tuple(shape)}: export the "
                       "checkpoint-shaped state (an Engine on a mesh with tensor > n_kv_heads holds repeated KV "
                       "heads)")
  for hf_name, (name, in_dims) in HF_NAMES.items():
    if name not in shapes:        # lm_head with tied embeddings
      continue
    if "{i}" in hf_name:
      for i in range(cfg.n_layers):
        yield hf_name.replace("{i}", str(i)), to_hf(np.asarray(stored_tensor(flat, name, i)), in_dims)
    else:
      yield hf_name, to_hf(np.asarray(stored_tensor(flat, name)), in_dims)


def match_name(name: str) -> tuple[str, int | None] | None:
  """HF tensor name -> (HF_NAMES key, layer index) or None."""
  m = _LAYER.search(name)
  if m and name.startswith("model.layers."):
    key = name[:m.start()] + ".{i}." + name[m.end():]
    return (key, int(m.group(1))) if key in HF_NAMES else None
  return (name, None) if name in HF_NAMES else None


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
  dtype: np.dtype
  shape: tuple[int, ...]
  begin: int
  end: int

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))


class SafetensorsFile:
  """A safetensors file's header, and reads of single tensors from it."""

  def __init__(self, path: str):
    self.path = path
    self.size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({self.size} bytes, no header)")
      (n,) = struct.unpack("<Q", raw)
      if n > self.size - 8 or n > MAX_HEADER:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes, file "
                              f"{self.size}, at most {MAX_HEADER})")
      header = _parse_header(path, f.read(n))
    self.data_start = 8 + n
    check_header(path, header, self.size - self.data_start)
    self.tensors: dict[str, _TensorInfo] = {}
    for name, h in header.items():
      if name == "__metadata__":
        continue
      if h["dtype"] not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name} has dtype {h['dtype']}; lcjax converts "
                              f"{sorted(_DTYPES)} only")
      self.tensors[name] = _TensorInfo(_DTYPES[h["dtype"]], tuple(h["shape"]), *h["data_offsets"])

  def read(self, name: str) -> np.ndarray:
    t = self.tensors[name]
    if self.data_start + t.end > self.size:
      raise CheckpointError(f"{self.path}: tensor {name} is truncated (needs bytes up to "
                            f"{self.data_start + t.end}, file has {self.size})")
    count = int(np.prod(t.shape))
    if (t.end - t.begin) != count * t.dtype.itemsize:
      raise CheckpointError(f"{self.path}: tensor {name} spans {t.end - t.begin} bytes, shape {t.shape} "
                            f"needs {count * t.dtype.itemsize}")
    return np.fromfile(self.path, dtype=t.dtype, count=count, offset=self.data_start + t.begin).reshape(t.shape)

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of tensor `name` (axis 0), read alone (its bounds were checked by `read`'s rules)."""
    t = self.tensors[name]
    row = int(np.prod(t.shape[1:]))
    stop = min(stop, t.shape[0])
    return np.fromfile(self.path, dtype=t.dtype, count=(stop - start) * row,
                       offset=self.data_start + t.begin + start * row * t.dtype.itemsize).reshape(-1, *t.shape[1:])


def _same_values(a: SafetensorsFile, a_name: str, b: SafetensorsFile, b_name: str) -> bool:
  """Whether two tensors hold the same values (compared as float32, as torch.equal does after loading both into the
  model's dtype), read in slabs of about 64 MiB (as float32) so that neither is held whole."""
  ta, tb = a.tensors[a_name], b.tensors[b_name]
  if ta.shape != tb.shape:
    return False
  if not ta.shape:
    return bool(np.array_equal(a.read(a_name).astype(np.float32), b.read(b_name).astype(np.float32)))
  row_bytes = max(1, int(np.prod(ta.shape[1:]))) * 4
  step = max(1, (64 << 20) // row_bytes)
  for start in range(0, ta.shape[0], step):
    x = a.read_rows(a_name, start, start + step).astype(np.float32)
    y = b.read_rows(b_name, start, start + step).astype(np.float32)
    if not np.array_equal(x, y):
      return False
  return True


# -- validation: every field of a header, config or index is checked before it is used -----------------------------

MAX_HEADER = 100 << 20          # bytes of a safetensors JSON header (the format's own limit)
MAX_IGNORE = 1000               # entries of a quantization_config `ignore` list


def _parse_header(path: str, raw: bytes) -> dict:
  try:
    header = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path}: corrupt safetensors header ({type(e).__name__}: {str(e)[:100]})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
  return header


def check_header(path: str, header: dict, data_bytes: int) -> None:
  """Every tensor entry of a safetensors header: a dtype string, a shape of non-negative integers, and
  data_offsets [begin, end] with 0 <= begin <= end <= the data section's size, spanning shape x itemsize bytes
  where lcjax knows the dtype; and the spans tile the data section (check_spans)."""
  for name, h in header.items():
    if name == "__metadata__":
      continue
    if not isinstance(h, dict):
      raise CheckpointError(f"{path}: tensor {name}: header entry {str(h)[:60]!r} is not an object")
    dtype, shape, offsets = h.get("dtype"), h.get("shape"), h.get("data_offsets")
    if not isinstance(dtype, str):
      raise CheckpointError(f"{path}: tensor {name} has no dtype string (dtype={str(dtype)[:40]!r})")
    if (not isinstance(shape, list) or len(shape) > 8
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
      raise CheckpointError(f"{path}: tensor {name} has shape {str(shape)[:60]}, not a list of at most 8 "
                            "non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
      raise CheckpointError(f"{path}: tensor {name} has data_offsets {str(offsets)[:60]}, not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
      raise CheckpointError(f"{path}: tensor {name} has data_offsets [{begin}, {end}] outside the data section "
                            f"[0, {data_bytes}] (the file is truncated or its header corrupt)")
    if dtype in _DTYPES:
      count = int(np.prod(shape, dtype=object)) if shape else 1
      if end - begin != count * _DTYPES[dtype].itemsize:
        raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes, shape {tuple(shape)} of {dtype} "
                              f"needs {count * _DTYPES[dtype].itemsize}")
  check_spans(path, header, data_bytes)


def check_spans(path: str, header: dict, data_bytes: int) -> None:
  """The tensors' data_offsets, in order of offset, tile the data section [0, data_bytes) exactly: no two overlap
  (one tensor would read another's bytes), none leaves a gap, the last ends at the end of the file, as the
  safetensors library requires."""
  spans = sorted((h["data_offsets"][0], h["data_offsets"][1], name) for name, h in header.items()
                 if name != "__metadata__")
  at, before = 0, None
  for begin, end, name in spans:
    if begin < at:
      raise CheckpointError(f"{path}: tensor {name} has data_offsets [{begin}, {end}] overlapping tensor {before}'s "
                            f"bytes (up to {at}): one tensor would read another's bytes")
    if begin > at:
      raise CheckpointError(f"{path}: tensor {name} has data_offsets [{begin}, {end}], leaving bytes [{at}, {begin}) "
                            f"{'after tensor ' + before if before else 'at the start'} unused (a corrupt header)")
    at, before = end, name
  if at != data_bytes:
    raise CheckpointError(f"{path}: the tensors' data_offsets end at byte {at} of a data section of {data_bytes} "
                          "bytes (a corrupt header)")


def check_weight_map(index: str, src: str, weight_map) -> None:
  """An index's weight_map: tensor name -> a shard file name inside the checkpoint folder (no path that leads out
  of it, no link to elsewhere)."""
  if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in weight_map.items()):
    raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
  root = os.path.realpath(src)
  for tensor, fname in weight_map.items():
    where = os.path.realpath(os.path.join(src, fname))
    if os.path.isabs(fname) or os.path.dirname(where) != root:
      raise CheckpointError(f"{index}: shard {fname!r} (holding tensor {tensor}) is not a file of the checkpoint "
                            f"folder {src}")


def _read_json(path: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is corrupt ({type(e).__name__}: {str(e)[:100]})") from None


def _read_object(path: str) -> dict:
  d = _read_json(path)
  if not isinstance(d, dict):
    raise CheckpointError(f"{path} holds a JSON {type(d).__name__}, not an object")
  return d


def _shard_files(src: str) -> tuple[list[str], dict[str, str] | None]:
  """The safetensors files of a folder, and the index's tensor -> file map when there is one: model.safetensors
  first, as transformers' from_pretrained takes it before an index beside it."""
  index = os.path.join(src, "model.safetensors.index.json")
  single = os.path.join(src, "model.safetensors")
  if os.path.exists(index) and not os.path.exists(single):
    weight_map = _read_object(index).get("weight_map")
    check_weight_map(index, src, weight_map)
    files = sorted(set(weight_map.values()))
    for fname in files:
      if not os.path.exists(os.path.join(src, fname)):
        tensor = next(t for t, f in weight_map.items() if f == fname)
        raise CheckpointError(f"{index}: shard {fname} (holding tensor {tensor}) is missing")
    return files, weight_map
  if os.path.exists(single):
    return ["model.safetensors"], None
  others = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
  if not others:
    raise CheckpointError(f"{src}: no model.safetensors or model.safetensors.index.json (lcjax reads "
                          "safetensors only; re-save with save_pretrained(safe_serialization=True))")
  return others, None


def hf_config_json(src: str) -> dict:
  """An HF folder's config.json, a JSON object."""
  return _read_object(os.path.join(src, "config.json"))


def hf_model_config(src: str) -> ModelConfig:
  """ModelConfig of an HF folder, with BOS/EOS as its tokenizer and generation config say."""
  path = os.path.join(src, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{path}: missing (not an HF model folder)")
  hf = _read_object(path)
  try:
    cfg = ModelConfig.from_hf(hf, name=hf.get("_name_or_path") or os.path.basename(os.path.normpath(src)))
  except ConfigError as e:
    raise CheckpointError(f"{path}: {e}") from None
  eos = list(cfg.eos_ids)
  gen = os.path.join(src, "generation_config.json")
  if os.path.exists(gen):
    g = _read_object(gen).get("eos_token_id")
    for e in (g if isinstance(g, list) else [] if g is None else [g]):
      if e not in eos:
        eos.append(e)
  add_bos = tok.infer_add_bos(src)
  try:
    cfg = dataclasses.replace(cfg, eos_ids=tuple(eos), add_bos=cfg.add_bos if add_bos is None else add_bos)
  except ConfigError as e:
    raise CheckpointError(f"{gen}: {e}") from None
  bos = tok.infer_bos_id(src)       # the tokenizer's own BOS is what HF prepends, whatever config.json says
  try:
    return cfg if bos is None else dataclasses.replace(cfg, bos_id=bos)
  except ConfigError as e:
    raise CheckpointError(f"{src}: the tokenizer's BOS token: {e}") from None


# The lcjax input-scale tensor each HF projection's static input scale joins (the fused projections share their
# input, which is quantized with the largest of their scales).
_IN_SCALE = {"layers/attn/wq": "layers/attn/wqkv_in_scale", "layers/attn/wk": "layers/attn/wqkv_in_scale",
             "layers/attn/wv": "layers/attn/wqkv_in_scale", "layers/attn/wo": "layers/attn/wo_in_scale",
             "layers/mlp/w_gate": "layers/mlp/w_gate_up_in_scale", "layers/mlp/w_up": "layers/mlp/w_gate_up_in_scale",
             "layers/mlp/w_down": "layers/mlp/w_down_in_scale"}
# Per-layer KV-cache scales of quantized checkpoints: lcjax's fp8 cache computes its own per page.
_KV_SCALES = re.compile(r"model\.layers\.\d+\.self_attn\.(k|v)_(scale|proj\.output_scale)")
_SUFFIXES = (".weight_scale", ".input_scale")


def quantization_format(hf: dict, where: str) -> WeightFormat:
  """The WeightFormat of an HF config's `quantization_config` (none: bf16). FP8 checkpoints lcjax loads:
  compressed-tensors "float-quantized" with 8-bit float weights per channel or per tensor and 8-bit float
  activations dynamic per token or static per tensor, and `quant_method: "fp8"` (per-tensor scales, static or
  dynamic activations). Every other scheme is refused with one line naming it."""
  q = hf.get("quantization_config")
  if not q:
    return WeightFormat()
  if not isinstance(q, dict):
    raise CheckpointError(f"{where}: quantization_config is {type(q).__name__}, not an object")
  method = q.get("quant_method")
  refuse = lambda scheme: CheckpointError(      # noqa: E731
      f"{where}: quant_method={method!r} with {scheme} is not a scheme lcjax loads (it loads fp8 e4m3 weights "
      "per channel or per tensor: compressed-tensors float-quantized, or quant_method 'fp8')")
  if method == "fp8":
    if q.get("weight_block_size"):
      raise refuse(f"weight_block_size={q['weight_block_size']} (block-wise fp8)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
      raise refuse(f"activation_scheme={scheme!r}")
    return WeightFormat(fp8=True, static_inputs=scheme == "static")
  if method != "compressed-tensors":
    raise refuse(f"config {json.dumps({k: q[k] for k in list(q)[:4]}, default=str)[:200]}")
  fmt = q.get("format")
  if fmt != "float-quantized":
    raise refuse(f"format={fmt!r}")
  groups = q.get("config_groups") or {}
  if not isinstance(groups, dict):
    raise CheckpointError(f"{where}: quantization_config config_groups is a {type(groups).__name__}, not an object")
  if not groups:
    raise refuse("no config_groups")
  statics = set()
  for key, g in groups.items():
    w, a = (g.get("weights") or {}, g.get("input_activations")) if isinstance(g, dict) else (None, None)
    if not isinstance(w, dict) or not isinstance(a, (dict, type(None))):
      raise CheckpointError(f"{where}: quantization_config config_groups[{key!r}] = "
                            f"{json.dumps(g, default=str)[:200]} is not an object whose weights and "
                            "input_activations are objects")
    if (w.get("num_bits"), w.get("type")) != (8, "float") or w.get("strategy") not in ("channel", "tensor") \
        or w.get("dynamic") or w.get("symmetric") is False:
      raise refuse(f"weights {json.dumps(w, sort_keys=True)[:200]}")
    if a is None:
      raise refuse("weight-only quantization (input_activations null)")
    if (a.get("num_bits"), a.get("type")) != (8, "float") or a.get("strategy") not in ("token", "tensor") \
        or bool(a.get("dynamic")) != (a.get("strategy") == "token"):
      raise refuse(f"input_activations {json.dumps(a, sort_keys=True)[:200]}")
    statics.add(a.get("strategy") == "tensor")
  if len(statics) > 1:
    raise refuse("both static and dynamic activation groups")
  return WeightFormat(fp8=True, static_inputs=statics.pop())


def _ignored_projections(hf: dict, cfg: ModelConfig, where: str) -> None:
  """Refuse an `ignore` list that keeps some decoder layer's projection unquantized: lcjax holds each projection
  of every layer in one format (lm_head, which lcjax keeps in dtype anyway, may be ignored). A "re:" entry is
  matched as compressed-tensors matches it (re.match: anchored at the start of the module name), without
  backtracking (lcjax.checkpoint.patterns); one that is invalid or past that matcher's bounds is refused."""
  ignore = hf["quantization_config"].get("ignore") or []
  if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
    raise CheckpointError(f"{where}: quantization_config ignore={json.dumps(ignore, default=str)[:100]} is not a "
                          "list of module names and 're:' patterns")
  if len(ignore) > MAX_IGNORE:
    raise CheckpointError(f"{where}: quantization_config ignore has {len(ignore)} entries, more than the "
                          f"{MAX_IGNORE} lcjax reads")
  names = [k.replace("{i}", str(i))[:-len(".weight")] for k in HF_NAMES if "{i}" in k and QUANTIZED.get(
      HF_NAMES[k][0]) for i in range(cfg.n_layers)]
  left = MAX_VISITS                       # one matching budget for all the entries
  for p in ignore:
    if p.startswith("re:"):
      try:
        pattern = Pattern(p[3:], max_visits=left)
        hits = [n for n in names if pattern.match(n)]
        left -= pattern.visits
      except ValueError as e:
        raise CheckpointError(f"{where}: quantization_config ignore entry {p[:80]!r} {e}") from None
    else:
      hits = [n for n in names if n == p or n.endswith("." + p)]
    if hits:
      raise CheckpointError(f"{where}: quantization_config ignore entry {p!r} leaves {hits[0]} "
                            f"{'and others ' if len(hits) > 1 else ''}unquantized; lcjax needs every layer's "
                            "projections in one format (fp8 throughout, or a bf16 checkpoint)")


def _plan(src: str, cfg: ModelConfig, weights: WeightFormat = WeightFormat()):
  """[(file, hf name, lcjax name, layer, in_dims)] for every tensor to convert, checked before any write. For fp8
  checkpoints the lcjax name of a scale is the weight's + "_scale" (weight_scale) or + "_in" (input_scale)."""
  files, weight_map = _shard_files(src)
  shapes = param_shapes(cfg, weights)
  headers = {f: SafetensorsFile(os.path.join(src, f)) for f in files}
  if weight_map is not None:
    for tensor, fname in weight_map.items():
      if tensor not in headers[fname].tensors:
        raise CheckpointError(f"{os.path.join(src, fname)}: tensor {tensor} is listed in the index but absent")
  plan, seen, tied_head = [], {}, None
  for fname, header in headers.items():
    for name, info in header.tensors.items():
      if _IGNORED.fullmatch(name) or (weights.fp8 and _KV_SCALES.fullmatch(name)):
        continue
      if info.dtype == E4M3 and not weights.fp8:
        raise CheckpointError(f"{header.path}: tensor {name} is float8_e4m3fn, but config.json has no fp8 "
                              "quantization_config to give its scales (lcjax does not load raw e4m3 values)")
      suffix = next((x for x in _SUFFIXES if weights.fp8 and name.endswith(x)), "")
      m = match_name(name[:-len(suffix)] + ".weight" if suffix else name)
      if m is None:
        raise CheckpointError(f"{header.path}: tensor {name} is not part of a LLaMA model lcjax knows "
                              "(the names it knows are HF_NAMES in lcjax/checkpoint/hf.py)")
      key, layer = m
      dst, in_dims = HF_NAMES[key]
      if dst not in shapes:  # lm_head.weight saved beside tied embeddings: the model uses the embedding
        tied_head = tied_head if suffix else (header, name)
        continue
      full, stacked = shapes[dst]
      if stacked and not 0 <= layer < cfg.n_layers:
        raise CheckpointError(f"{header.path}: tensor {name} has layer {layer}, config.json has "
                              f"num_hidden_layers={cfg.n_layers}")
      want = hf_shape(full[1:] if stacked else full, in_dims)
      fp8 = weights.fp8 and dst in QUANTIZED
      if suffix:
        if dst not in QUANTIZED and suffix == ".input_scale":
          continue                # an input scale of a tensor lcjax keeps in dtype (e.g. a quantized lm_head)
        if suffix == ".input_scale" and not weights.static_inputs:
          raise CheckpointError(f"{header.path}: tensor {name} is a static input scale, but quantization_config "
                                "says activations are dynamic")
        if info.size not in ((1, want[0]) if suffix == ".weight_scale" else (1,)):
          raise CheckpointError(f"{header.path}: tensor {name} has shape {info.shape}: a scale per tensor or "
                                f"per output channel ({want[0]}) is expected")
        dst += "_scale" if suffix == ".weight_scale" else "_in"
      elif fp8 and info.dtype != E4M3:
        raise CheckpointError(f"{header.path}: tensor {name} is {info.dtype}, quantization_config says fp8 "
                              "(float8_e4m3fn) weights")
      elif info.shape != want:
        raise CheckpointError(f"{header.path}: tensor {name} has shape {info.shape}, config.json implies {want}")
      if (dst, layer) in seen:
        raise CheckpointError(f"{header.path}: tensor {name} also appears in {seen[(dst, layer)]}")
      seen[(dst, layer)] = header.path
      plan.append((header, name, dst, layer, in_dims))
  for header, name, dst, layer, _ in plan:
    if header.tensors[name].dtype == E4M3 and dst not in QUANTIZED and (dst + "_scale", layer) not in seen:
      raise CheckpointError(f"{header.path}: tensor {name} is float8_e4m3fn without a weight_scale to dequantize "
                            f"it with (lcjax keeps {dst} in the model's dtype)")
  embed = next(((h, n) for h, n, d, *_ in plan if d == "embed/embedding"), None)
  if tied_head is not None and embed is not None and not _same_values(*tied_head, *embed):
    # transformers unties such a head ("both are present in the checkpoints with different values")
    raise CheckpointError(f"{tied_head[0].path}: tensor {tied_head[1]} differs from {embed[1]} but config.json has "
                          "tie_word_embeddings=true (transformers then uses the stored head): set "
                          "tie_word_embeddings to false to convert it")
  # Each projection's input scale (written as its fused projection's) instead of the lcjax _in_scale tensors.
  required = {n: v for n, v in shapes.items() if not n.endswith("_in_scale")}
  required.update({w + "_in": shapes[w] for w in QUANTIZED if weights.static_inputs})
  for dst, (full, stacked) in required.items():
    for layer in (range(full[0]) if stacked else [None]):
      if (dst, layer) not in seen:
        base = dst[:-len("_scale")] if dst.endswith("_scale") else dst[:-len("_in")] if dst.endswith("_in") else dst
        hf_name = next(k for k, v in HF_NAMES.items() if v[0] == base).replace("{i}", str(layer))
        if dst != base:
          hf_name = hf_name[:-len(".weight")] + (".weight_scale" if dst.endswith("_scale") else ".input_scale")
        raise CheckpointError(f"{src}: tensor {hf_name} is missing from the safetensors files {files}")
  return plan


def _check_scales(plan) -> None:
  """Refuse a plan with a weight or input scale that is not finite and > 0: all of them read (a few floats per
  output channel) before anything is written."""
  for header, name, dst, *_ in plan:
    if dst.endswith(("_scale", "_in")):
      check_scale(header.read(name), f"{header.path}: tensor {name}")


def _scale_layout(scale: np.ndarray, shape: tuple[int, ...], in_dims: int) -> np.ndarray:
  """An HF weight_scale (per tensor, or [out, 1] per output channel) as lcjax's: float32 of the lcjax weight's
  (per-layer) `shape` with its `in_dims` input dims 1."""
  out = tuple(shape[in_dims:])
  s = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (int(np.prod(out)),))
  return np.ascontiguousarray(s.reshape((1,) * in_dims + out))


def convert_hf(src: str, dst: str, *, dtype: str | None = None, overwrite: bool = False,
               progress: bool | None = None) -> dict:
  """Convert an HF LLaMA folder to an lcjax checkpoint. dtype None keeps each tensor's stored dtype (fp8 weights
  and their scales always keep theirs).

  FP8 checkpoints (`quantization_format`) keep their e4m3 weights as they are, with one float32 scale per output
  channel (a per-tensor scale broadcast over the channels, so fused projections need no requantization) and,
  with static activations, each fused projection's input scale (the largest of its parts'). A quantized
  tensor that lcjax keeps in dtype (the LM head) is dequantized.

  Returns {"tensors", "bytes", "seconds"}. Raises CheckpointError (one line, naming file and tensor) for an
  unknown architecture, a missing shard, a missing or unknown tensor, a shape mismatch, a truncated file,
  overlapping tensor spans, an fp8 scale that is not finite and > 0, a NaN e4m3 value, or e4m3 tensors outside an
  fp8 quantization_config.
  """
  t0 = time.time()
  cfg = hf_model_config(src)
  config_path = os.path.join(src, "config.json")
  hf = hf_config_json(src)
  weights = quantization_format(hf, config_path)
  if weights.fp8:
    _ignored_projections(hf, cfg, config_path)
  plan = _plan(src, cfg, weights)
  _check_scales(plan)
  cast = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype) if dtype else None
  total = sum(h.tensors[n].end - h.tensors[n].begin for h, n, *_ in plan)
  full_shapes = param_shapes(cfg, weights)
  scales = {(d[:-len("_scale")], layer): (h, n) for h, n, d, layer, _ in plan if d.endswith("_scale")}
  in_scales: dict[tuple[str, int], float] = {}
  with CheckpointWriter(dst, cfg, weights=weights, overwrite=overwrite, source=os.path.abspath(src)) as w:
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"convert {os.path.basename(src)}",
              disable=(None if progress is None else not progress)) as bar:
      for header, name, dst_name, layer, in_dims in plan:
        nb = header.tensors[name].end - header.tensors[name].begin
        if dst_name.endswith("_in"):
          key = (_IN_SCALE[dst_name[:-len("_in")]], layer)
          in_scales[key] = max(in_scales.get(key, 0.0), float(np.asarray(header.read(name), np.float32).max()))
          bar.update(nb)
          continue
        if dst_name.endswith("_scale"):
          weight = dst_name[:-len("_scale")]
          full, stacked = full_shapes[weight]
          if weight in QUANTIZED:
            w.write(dst_name, _scale_layout(header.read(name), full[1:] if stacked else full, in_dims), layer)
          bar.update(nb)
          continue
        full, stacked = full_shapes[dst_name]
        w_hf = header.read(name)
        if w_hf.dtype == E4M3:
          check_e4m3(w_hf, f"{header.path}: tensor {name}")
        if w_hf.dtype == E4M3 and dst_name not in QUANTIZED:    # dequantized: lcjax keeps it in dtype
          sh, sn = scales[(dst_name, layer)]
          w_hf = (w_hf.astype(np.float32) * np.asarray(sh.read(sn), np.float32).reshape(-1, 1)).astype(
              cast or np.dtype(ml_dtypes.bfloat16))
        x = to_lcjax(w_hf, full[1:] if stacked else full, in_dims)
        del w_hf
        if cast is not None and x.dtype != cast and x.dtype != E4M3:
          with np.errstate(over="ignore"):                # an overflow is refused by cast_finite in one line
            x = cast_finite(x, cast, f"{header.path}: tensor {name}")
        w.write(dst_name, x, layer)
        del x
        bar.update(nb)
      for (name, layer), value in sorted(in_scales.items()):
        w.write(name, np.array([value], np.float32), layer)
    for fname in TOKENIZER_FILES:
      if os.path.exists(os.path.join(src, fname)):
        w.copy_file(os.path.join(src, fname))
  return {"tensors": len(plan), "bytes": total, "seconds": time.time() - t0}
