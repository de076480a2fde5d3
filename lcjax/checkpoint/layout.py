"""lcjax's checkpoint format: where each tensor of a checkpoint lives and under what name and shape.

A checkpoint directory holds
  lcjax_config.json     ModelConfig.to_dict()
  lcjax_manifest.json   every tensor's name, full shape, dtype, layer count and rows per part; written last, so
                        its presence is the completion marker (lcjax.checkpoint.writer renames atomically)
  params/<name>/[<layer>/]<part>/
                        one orbax PyTree item {"value": rows of the tensor} per part, per layer of a stacked
                        tensor: "layers/attn/wq/00017/000" is rows 0.. of layer 17's [D, N, H] array
  tokenizer files       tokenizer.json or tokenizer.model, tokenizer_config.json, chat_template.jinja, ...

Why items per layer and per part: the model's layer weights are stacked [L, ...] (80 x 1.7 GB for a 70B) and a
converter that assembled a stacked array on the host would need the whole model in RAM; and orbax's save holds
about two extra copies of what it writes. Writing at most `PART_BYTES` per item keeps a converter's peak near one
source tensor, and lcjax.checkpoint.restore fills a preallocated, already-sharded device array part by part.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import jax
import numpy as np
from flax import nnx

from lcjax.checkpoint import atomic
from lcjax.config import ModelConfig, WeightFormat

FORMAT = "lcjax-orbax-v2"
CONFIG_FILE = "lcjax_config.json"
MANIFEST_FILE = "lcjax_manifest.json"
PARAMS_DIR = "params"
# Largest item written: tensors above it are split into row slabs (the host transient of a write).
PART_BYTES = 64 << 20
# orbax writes each item as chunks of at most this size, so a sharded restore reads only what it needs.
CHUNK_BYTES = 16 << 20


class CheckpointError(ValueError):
  """A checkpoint or conversion source that lcjax refuses; the message names the file and the tensor."""


def param_shapes(cfg: ModelConfig, weights: WeightFormat = WeightFormat()) -> dict[str, tuple[tuple[int, ...], bool]]:
  """name -> (full shape, stacked over layers): the tensors a checkpoint stores, i.e. the parameter tree of
  `lcjax.model.llama.Llama` with each fused projection (FUSED) as the tensors it is assembled from. fp8 weights
  add a float32 scale per output channel of each projection (its shape with the input dims 1) and, with static
  input scales, one per layer for each fused projection's input."""
  D, N, K, H, F, V, L = (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size,
                         cfg.n_layers)
  shapes = {
      "embed/embedding": ((V, D), False),
      "layers/attn_norm/scale": ((L, D), True),
      "layers/attn/wq": ((L, D, N, H), True),
      "layers/attn/wk": ((L, D, K, H), True),
      "layers/attn/wv": ((L, D, K, H), True),
      "layers/attn/wo": ((L, N, H, D), True),
      "layers/mlp_norm/scale": ((L, D), True),
      "layers/mlp/w_gate": ((L, D, F), True),
      "layers/mlp/w_up": ((L, D, F), True),
      "layers/mlp/w_down": ((L, F, D), True),
      "final_norm/scale": ((D,), False),
  }
  if not cfg.tie_embeddings:
    shapes["lm_head/kernel"] = ((D, V), False)
  if weights.fp8:
    for name in QUANTIZED:
      (L, *shape), _ = shapes[name]
      shapes[name + "_scale"] = ((L, *(1 if i < QUANTIZED[name] else n for i, n in enumerate(shape))), True)
  if weights.static_inputs:
    for name in ("layers/attn/wqkv", "layers/attn/wo", "layers/mlp/w_gate_up", "layers/mlp/w_down"):
      shapes[name + "_in_scale"] = ((L, 1), True)
  return shapes


# Stored tensors of fp8 checkpoints -> the number of input dims they lead with (their scales set those to 1).
QUANTIZED = {"layers/attn/wq": 1, "layers/attn/wk": 1, "layers/attn/wv": 1, "layers/attn/wo": 2,
             "layers/mlp/w_gate": 1, "layers/mlp/w_up": 1, "layers/mlp/w_down": 1}


def stored_format(tensors) -> WeightFormat:
  """The WeightFormat of a checkpoint whose manifest lists `tensors` (names)."""
  return WeightFormat(fp8="layers/attn/wq_scale" in tensors, static_inputs="layers/attn/wqkv_in_scale" in tensors)


# Model tensors that checkpoints store as several: HF's one tensor per projection, which converters write one
# source tensor at a time, while the model runs fused projections (one GEMM each, lcjax.model.llama). Model name ->
# (the axis of its per-layer array along which the stored tensors are stacked, the stored names in order). Each
# stored tensor is that array's slice along `axis` merged into the axis before it: wq [D, N, H] is wqkv's
# [D, K, G, H] part, wk [D, K, H] its [D, K, 1, H] part; w_gate [D, F] is w_gate_up's [D, 1, F] part.
FUSED = {
    "layers/attn/wqkv": (2, ("layers/attn/wq", "layers/attn/wk", "layers/attn/wv")),
    "layers/mlp/w_gate_up": (1, ("layers/mlp/w_gate", "layers/mlp/w_up")),
    # fp8 weights' scales ([1, K, G + 2, H] and [1, 2, F] a layer) are assembled the same way
    "layers/attn/wqkv_scale": (2, ("layers/attn/wq_scale", "layers/attn/wk_scale", "layers/attn/wv_scale")),
    "layers/mlp/w_gate_up_scale": (1, ("layers/mlp/w_gate_scale", "layers/mlp/w_up_scale")),
}


def tensor_sources(name: str, item_shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], int, int]]:
  """(stored name, view shape, offset along the fused axis, fused axis) of each stored tensor that makes up the
  model tensor `name`, whose per-layer array has `item_shape`; a tensor stored as itself is its own whole view."""
  if name not in FUSED:
    return [(name, item_shape, 0, 0)]
  axis, names = FUSED[name]
  if name.startswith("layers/attn/wqkv"):   # [D, K, G + 2, H]: the G query heads of each KV head, its key, value
    widths = (item_shape[axis] - 2, 1, 1)
  else:
    widths = (1,) * len(names)
  views, offset = [], 0
  for stored, width in zip(names, widths):
    views.append((stored, (*item_shape[:axis], width, *item_shape[axis + 1:]), offset, axis))
    offset += width
  return views


def stored_shape(view: tuple[int, ...], axis: int) -> tuple[int, ...]:
  """A fused view's shape as stored: its `axis` merged into the one before (axis 0: the view itself)."""
  if not axis:
    return view
  return (*view[:axis - 1], view[axis - 1] * view[axis], *view[axis + 1:])


def stored_shapes(model_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
  """Shapes of the stored tensors that make up model tensors of `model_shapes` (name -> full shape)."""
  out = {}
  for name, shape in model_shapes.items():
    lead, item = (shape[:1], shape[1:]) if name.startswith("layers/") else ((), shape)
    for src, view, _, axis in tensor_sources(name, tuple(item)):
      out[src] = (*lead, *stored_shape(view, axis))
  return out


def stored_tensor(flat: dict[str, Any], name: str, layer: int | None = None):
  """The stored tensor `name` (layer `layer` of it) cut from model-layout arrays `flat`: restore's assembly
  backwards (for export)."""
  model = next((m for m, (_, srcs) in FUSED.items() if name in srcs), name)
  arr = flat[model] if layer is None else flat[model][layer]
  if model == name:
    return arr
  lead = 1 if layer is None and model.startswith("layers/") else 0
  for src, view, offset, axis in tensor_sources(model, tuple(arr.shape[lead:])):
    if src == name:
      piece = arr[(slice(None),) * (lead + axis) + (slice(offset, offset + view[axis]),)]
      return piece.reshape(*arr.shape[:lead], *stored_shape(view, axis))
  raise KeyError(name)


def item_dir(root: str, name: str, layer: int | None, part: int) -> str:
  path = os.path.join(root, PARAMS_DIR, *name.split("/"))
  if layer is not None:
    path = os.path.join(path, f"{layer:05d}")
  return os.path.join(path, f"{part:03d}")


def part_rows(shape: tuple[int, ...], itemsize: int) -> int:
  """Rows (of axis 0) per stored part of an array of `shape`: a multiple of 128 (else a power of two) so parts
  split evenly over any mesh axis that splits the whole dimension."""
  if not shape:
    return 1
  fit = max(1, PART_BYTES // max(1, int(np.prod(shape[1:])) * itemsize))
  if fit >= shape[0]:
    return shape[0]
  return fit // 128 * 128 if fit >= 128 else 1 << (fit.bit_length() - 1)


def read_manifest(ckpt_dir: str) -> dict:
  path = os.path.join(ckpt_dir, MANIFEST_FILE)
  atomic.recover(ckpt_dir, MANIFEST_FILE)       # an overwrite killed between its renames
  if not os.path.isdir(ckpt_dir):
    raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
  if not os.path.exists(path):
    raise CheckpointError(f"{ckpt_dir}: incomplete checkpoint ({MANIFEST_FILE} is missing); rerun the conversion")
  manifest = read_json(path)
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    raise CheckpointError(f"{path}: format {got!r} is not {FORMAT!r}")
  return manifest


def checkpoint_format(ckpt_dir: str) -> WeightFormat:
  """The WeightFormat a complete checkpoint stores its linear weights in."""
  return stored_format(read_manifest(ckpt_dir)["tensors"])


def load_config(ckpt_dir: str) -> ModelConfig:
  """The ModelConfig of a complete checkpoint (CheckpointError when it is incomplete)."""
  read_manifest(ckpt_dir)
  path = os.path.join(ckpt_dir, CONFIG_FILE)
  d = read_json(path)
  try:
    return ModelConfig.from_dict(d)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: not a valid lcjax model config: {e}") from None


def read_json(path: str):
  """A checkpoint's JSON file, or a CheckpointError naming the file when it is missing or corrupt."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path} is missing") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is corrupt ({e}); rerun the conversion") from None


def path_name(path) -> str:
  parts = []
  for k in path:
    parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(parts)


def flatten(tree) -> Iterator[tuple[str, Any]]:
  is_leaf = lambda x: isinstance(x, (nnx.Variable, jax.ShapeDtypeStruct, jax.sharding.Sharding))
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
    yield path_name(path), leaf


def unwrap(leaf):
  return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
