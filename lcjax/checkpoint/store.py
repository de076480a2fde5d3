"""lcjax's checkpoint format: orbax items written one slab at a time, restored in place into stacked arrays.

A checkpoint directory holds
  lcjax_config.json     ModelConfig.to_dict()
  lcjax_manifest.json   every tensor's name, full shape, dtype, layer count and rows per part; written last, so
                        its presence is the completion marker (with the atomic rename below)
  params/<name>/[<layer>/]<part>/
                        one orbax PyTree item {"value": rows of the tensor} per part, per layer of a stacked
                        tensor: "layers/attn/wq/00017/000" is rows 0.. of layer 17's [D, N, H] array
  tokenizer files       tokenizer.json or tokenizer.model, tokenizer_config.json, chat_template.jinja, ...

Why items per layer and per part: the model's layer weights are stacked [L, ...] (80 x 1.7 GB for a 70B) and a
converter that assembled a stacked array on the host would need the whole model in RAM; and orbax's save holds
about two extra copies of what it writes. Writing at most `PART_BYTES` per item keeps a converter's peak near one
source tensor, and `restore_params` fills a preallocated, already-sharded device array part by part (a donated
in-place update), so the model is never held twice, on host or device.

Writes are atomic: everything goes to `DST.tmp-<pid>` and is renamed to DST only after the manifest is written,
so an interrupted conversion leaves nothing that looks like a checkpoint; leftovers of dead processes are
removed by the next run.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from lcjax.config import ModelConfig

FORMAT = "lcjax-orbax-v2"
CONFIG_FILE = "lcjax_config.json"
MANIFEST_FILE = "lcjax_manifest.json"
PARAMS_DIR = "params"
# Largest item written: tensors above it are split into row slabs (the host transient of a write).
PART_BYTES = 64 << 20
# orbax writes each item as chunks of at most this size, so a sharded restore reads only what it needs.
_CHUNK_BYTES = 16 << 20


class CheckpointError(ValueError):
  """A checkpoint or conversion source that lcjax refuses; the message names the file and the tensor."""


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
  """name -> (full shape, stacked over layers): the tensors a checkpoint stores, i.e. the parameter tree of
  `lcjax.model.llama.Llama` with each fused projection (FUSED) as the tensors it is assembled from."""
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
  return shapes


# Model tensors that checkpoints store as several: HF's one tensor per projection, which converters write one
# source tensor at a time, while the model runs fused projections (one GEMM each, lcjax.model.llama). Model name ->
# (the axis of its per-layer array along which the stored tensors are stacked, the stored names in order). Each
# stored tensor is that array's slice along `axis` merged into the axis before it: wq [D, N, H] is wqkv's
# [D, K, G, H] part, wk [D, K, H] its [D, K, 1, H] part; w_gate [D, F] is w_gate_up's [D, 1, F] part.
FUSED = {
    "layers/attn/wqkv": (2, ("layers/attn/wq", "layers/attn/wk", "layers/attn/wv")),
    "layers/mlp/w_gate_up": (1, ("layers/mlp/w_gate", "layers/mlp/w_up")),
}


def _sources(name: str, item_shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], int, int]]:
  """(stored name, view shape, offset along the fused axis, fused axis) of each stored tensor that makes up the
  model tensor `name`, whose per-layer array has `item_shape`; a tensor stored as itself is its own whole view."""
  if name not in FUSED:
    return [(name, item_shape, 0, 0)]
  axis, names = FUSED[name]
  if name == "layers/attn/wqkv":      # [D, K, G + 2, H]: the G query heads of each KV head, its key, its value
    widths = (item_shape[axis] - 2, 1, 1)
  else:
    widths = (1,) * len(names)
  views, offset = [], 0
  for stored, width in zip(names, widths):
    views.append((stored, (*item_shape[:axis], width, *item_shape[axis + 1:]), offset, axis))
    offset += width
  return views


def _stored_shape(view: tuple[int, ...], axis: int) -> tuple[int, ...]:
  """A fused view's shape as stored: its `axis` merged into the one before (axis 0: the view itself)."""
  if not axis:
    return view
  return (*view[:axis - 1], view[axis - 1] * view[axis], *view[axis + 1:])


def stored_shapes(model_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
  """Shapes of the stored tensors that make up model tensors of `model_shapes` (name -> full shape)."""
  out = {}
  for name, shape in model_shapes.items():
    lead, item = (shape[:1], shape[1:]) if name.startswith("layers/") else ((), shape)
    for src, view, _, axis in _sources(name, tuple(item)):
      out[src] = (*lead, *_stored_shape(view, axis))
  return out


def stored_tensor(flat: dict[str, Any], name: str, layer: int | None = None):
  """The stored tensor `name` (layer `layer` of it) cut from model-layout arrays `flat`: restore's assembly
  backwards (for export)."""
  model = next((m for m, (_, srcs) in FUSED.items() if name in srcs), name)
  arr = flat[model] if layer is None else flat[model][layer]
  if model == name:
    return arr
  lead = 1 if layer is None and model.startswith("layers/") else 0
  for src, view, offset, axis in _sources(model, tuple(arr.shape[lead:])):
    if src == name:
      piece = arr[(slice(None),) * (lead + axis) + (slice(offset, offset + view[axis]),)]
      return piece.reshape(*arr.shape[:lead], *_stored_shape(view, axis))
  raise KeyError(name)


def _item_dir(root: str, name: str, layer: int | None, part: int) -> str:
  path = os.path.join(root, PARAMS_DIR, *name.split("/"))
  if layer is not None:
    path = os.path.join(path, f"{layer:05d}")
  return os.path.join(path, f"{part:03d}")


def _part_rows(shape: tuple[int, ...], itemsize: int) -> int:
  """Rows (of axis 0) per stored part of an array of `shape`: a multiple of 128 (else a power of two) so parts
  split evenly over any mesh axis that splits the whole dimension."""
  if not shape:
    return 1
  fit = max(1, PART_BYTES // max(1, int(np.prod(shape[1:])) * itemsize))
  if fit >= shape[0]:
    return shape[0]
  return fit // 128 * 128 if fit >= 128 else 1 << (fit.bit_length() - 1)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _remove_checkpoint(path: str) -> None:
  """Delete a checkpoint directory manifest first, so that one half removed never looks complete."""
  try:
    os.remove(os.path.join(path, MANIFEST_FILE))
  except FileNotFoundError:
    pass
  shutil.rmtree(path, ignore_errors=True)


class CheckpointWriter:
  """Writes a checkpoint tensor by tensor into `DST.tmp-<pid>`, renamed to DST on a clean exit.

    with CheckpointWriter(dst, cfg) as w:
      w.write("embed/embedding", array)            # unstacked tensor, full shape
      w.write("layers/attn/wq", array, layer=3)    # one layer of a stacked tensor, shape without L
      w.copy_file(path)                            # tokenizer files etc.
  """

  def __init__(self, dst: str, cfg: ModelConfig, *, overwrite: bool = False, source: str = ""):
    self.dst = os.path.abspath(dst)
    self.cfg = cfg
    self.overwrite = overwrite
    self.source = source
    self.tmp = f"{self.dst}.tmp-{os.getpid()}"
    self.expected = param_shapes(cfg)
    self.written: dict[str, dict[str, Any]] = {}
    self._ckptr = None

  def __enter__(self) -> "CheckpointWriter":
    if os.path.exists(self.dst) and not self.overwrite:
      raise CheckpointError(f"{self.dst} already exists; pass --overwrite to replace it")
    parent = os.path.dirname(self.dst)
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):
      # A dead process's partial output (.tmp-<pid>), or the checkpoint an interrupted overwrite was replacing
      # (.old-<pid>); a live process's (another conversion running now) is left alone.
      for suffix in (".tmp-", ".old-"):
        base = os.path.basename(self.dst) + suffix
        if entry.startswith(base) and entry[len(base):].isdigit() and not _pid_alive(int(entry[len(base):])):
          _remove_checkpoint(os.path.join(parent, entry))
    shutil.rmtree(self.tmp, ignore_errors=True)
    os.makedirs(os.path.join(self.tmp, PARAMS_DIR))
    self._ckptr = ocp.PyTreeCheckpointer()
    return self

  def write(self, name: str, array: np.ndarray, layer: int | None = None) -> None:
    if name not in self.expected:
      raise CheckpointError(f"tensor {name} is not a parameter of this model; parameters: {sorted(self.expected)}")
    full, stacked = self.expected[name]
    if stacked != (layer is not None):
      raise CheckpointError(f"tensor {name}: {'a layer index is' if stacked else 'no layer index is'} expected")
    want = full[1:] if stacked else full
    if tuple(array.shape) != want:
      raise CheckpointError(f"tensor {name}{'' if layer is None else f' layer {layer}'} has shape "
                            f"{tuple(array.shape)}, the model config implies {want}")
    rows = _part_rows(want, array.dtype.itemsize)
    entry = self.written.setdefault(name, {"shape": list(full), "dtype": str(array.dtype),
                                           "layers": full[0] if stacked else 0, "part_rows": rows,
                                           "done": set()})
    if entry["dtype"] != str(array.dtype):
      raise CheckpointError(f"tensor {name} layer {layer} has dtype {array.dtype}, earlier layers {entry['dtype']}")
    for part, start in enumerate(range(0, max(1, want[0] if want else 1), rows)):
      slab = array[start:start + rows] if want else array
      save_args = ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES) if slab.nbytes > _CHUNK_BYTES else ocp.SaveArgs()
      self._ckptr.save(_item_dir(self.tmp, name, layer, part),
                       args=ocp.args.PyTreeSave({"value": slab}, save_args={"value": save_args}))
      del slab
    entry["done"].add(layer)

  def copy_file(self, path: str, name: str | None = None) -> None:
    shutil.copyfile(path, os.path.join(self.tmp, name or os.path.basename(path)))

  def write_text(self, name: str, text: str) -> None:
    with open(os.path.join(self.tmp, name), "w", encoding="utf-8") as f:
      f.write(text)

  def _finish(self) -> None:
    for name, (full, stacked) in self.expected.items():
      done = self.written.get(name, {}).get("done", set())
      missing = sorted(set(range(full[0])) - done) if stacked else ([] if done else [None])
      if missing:
        where = "" if missing == [None] else f" layers {missing}"
        raise CheckpointError(f"{self.source or self.dst}: tensor {name}{where} was never written")
    tensors = {n: {k: v for k, v in e.items() if k != "done"} for n, e in self.written.items()}
    self.write_text(CONFIG_FILE, json.dumps(self.cfg.to_dict(), indent=2))
    self.write_text(MANIFEST_FILE, json.dumps({"format": FORMAT, "source": self.source, "tensors": tensors},
                                              indent=2))
    old = None
    if os.path.exists(self.dst):
      old = f"{self.dst}.old-{os.getpid()}"
      os.rename(self.dst, old)
    os.rename(self.tmp, self.dst)
    if old:
      _remove_checkpoint(old)

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if exc_type is None:
        self._finish()
    finally:
      if os.path.exists(self.tmp):
        shutil.rmtree(self.tmp, ignore_errors=True)


def read_manifest(ckpt_dir: str) -> dict:
  path = os.path.join(ckpt_dir, MANIFEST_FILE)
  if not os.path.isdir(ckpt_dir):
    raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
  if not os.path.exists(path):
    raise CheckpointError(f"{ckpt_dir}: incomplete checkpoint ({MANIFEST_FILE} is missing); rerun the conversion")
  manifest = _read_json(path)
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    raise CheckpointError(f"{path}: format {got!r} is not {FORMAT!r}")
  return manifest


def load_config(ckpt_dir: str) -> ModelConfig:
  """The ModelConfig of a complete checkpoint (CheckpointError when it is incomplete)."""
  read_manifest(ckpt_dir)
  path = os.path.join(ckpt_dir, CONFIG_FILE)
  d = _read_json(path)
  try:
    return ModelConfig.from_dict(d)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: not a valid lcjax model config: {e}") from None


def _read_json(path: str):
  """A checkpoint's JSON file, or a CheckpointError naming the file when it is missing or corrupt."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path} is missing") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is corrupt ({e}); rerun the conversion") from None


def _path_name(path) -> str:
  parts = []
  for k in path:
    parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(parts)


def _flatten(tree) -> Iterator[tuple[str, Any]]:
  is_leaf = lambda x: isinstance(x, (nnx.Variable, jax.ShapeDtypeStruct, jax.sharding.Sharding))
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
    yield _path_name(path), leaf


def _unwrap(leaf):
  return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def _slab_sharding(sharding: jax.sharding.Sharding, ndim: int, stacked: bool):
  """The sharding of one stored part: the full array's, less the layers axis. Parts hold a multiple of 128 (or
  a power of two) rows, so they split over a mesh axis whenever the whole dimension does."""
  if not (stacked and isinstance(sharding, jax.sharding.NamedSharding)):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))


def _fit_sharding(sharding: jax.sharding.Sharding, shape) -> jax.sharding.Sharding:
  """`sharding` for an array of `shape`, with every axis whose length the mesh does not divide replicated: the
  last part of a split tensor (or every part, e.g. 128-row parts of a vocab split over tensor=3) is read whole
  on each device of that axis and placed into the full array, which keeps its own sharding."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  for i, entry in enumerate(spec[:len(shape)]):
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    if axes and shape[i] % math.prod(sharding.mesh.shape[a] for a in axes):
      spec[i] = None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:len(shape)]))


def _place(full, slab, offsets, view):
  """full with `slab` (a stored part, reshaped to its `view` within one layer) written at `offsets`. On a mesh of
  Explicit axes (jax.make_mesh's default) the update runs with auto axes: a part whose rows do not split over a
  sharded axis is read whole on that axis, and an explicit dynamic_update_slice refuses shardings that differ."""
  shape = (1,) * (full.ndim - len(view)) + tuple(view)               # a layer of a stacked array

  def put(full, slab):
    return jax.lax.dynamic_update_slice(full, slab.reshape(shape).astype(full.dtype), offsets)

  typed = jax.typeof(full).sharding
  if any(t == jax.sharding.AxisType.Explicit for t in getattr(typed.mesh, "axis_types", ())):
    return jax.sharding.auto_axes(put, out_sharding=typed)(full, slab)
  return put(full, slab)


def _drop_axis(sharding: jax.sharding.Sharding, axis: int, ndim: int) -> jax.sharding.Sharding:
  """The sharding of a stored tensor read for a fused view: the view's, less the fused axis (never sharded: a
  query-head axis merged with its KV-head axis splits as the KV heads do, KV-head major)."""
  if not (axis and isinstance(sharding, jax.sharding.NamedSharding)):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  if spec[axis] is not None:
    raise ValueError(f"a fused tensor's sharding {spec} splits its fused axis {axis}; its stored parts cannot be "
                     "read into that layout")
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:axis], *spec[axis + 1:]))


class _Reader:
  def __init__(self, ckpt_dir: str):
    self.dir = ckpt_dir
    self.ckptr = ocp.PyTreeCheckpointer()

  def read(self, name: str, layer: int | None, part: int, shape, dtype, sharding) -> jax.Array:
    where = f"tensor {name}" + ("" if layer is None else f" layer {layer}") + (f" part {part}" if part else "")
    path = _item_dir(os.path.abspath(self.dir), name, layer, part)
    if not os.path.isdir(path):
      raise CheckpointError(f"{self.dir}: {where} is missing ({path})")
    args = ocp.args.PyTreeRestore(restore_args={"value": ocp.ArrayRestoreArgs(
        sharding=sharding, global_shape=tuple(shape), dtype=dtype)})
    try:
      value = self.ckptr.restore(path, args=args)["value"]
    except Exception as e:  # orbax/tensorstore raise many types for missing or truncated chunks
      # tensorstore appends its whole JSON spec; the first clause says what went wrong.
      msg = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0][:400]
      raise CheckpointError(f"{self.dir}: cannot read {where}: {type(e).__name__}: {msg}") from e
    if tuple(value.shape) != tuple(shape):
      raise CheckpointError(f"{self.dir}: {where} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value


def restore_params(ckpt_dir: str, abstract_state, shardings=None, dtype=None, *, progress: bool | None = None):
  """Restore a checkpoint into a tree shaped like `abstract_state`.

  abstract_state: `nnx.state(nnx.eval_shape(lambda: Llama(cfg, ...)), nnx.Param)` or any pytree whose leaves are
    ShapeDtypeStruct (or nnx Variables holding them), with paths such as embed/embedding, layers/attn/wqkv
    (a FUSED tensor is assembled from its stored tensors).
  shardings: optional pytree of the same structure whose leaves are `jax.sharding.Sharding` (or Variables holding
    them). Leaves without one use the ShapeDtypeStruct's own `.sharding`, else the default device.
  dtype: the parameter dtype to cast to on restore (default: each abstract leaf's dtype).
  Returns the same structure with jax.Arrays (Variables stay Variables with their metadata), ready for
  `nnx.update(model, state)`. Each array is placed directly with its sharding; stacked [L, ...] and split arrays
  are filled part by part in place, so peak device memory is the model plus one stored part.
  """
  manifest = read_manifest(ckpt_dir)
  tensors = manifest["tensors"]
  abstract = dict(_flatten(abstract_state))
  wanted = {src for name in abstract for src in (FUSED[name][1] if name in FUSED else (name,))}
  extra = sorted(set(tensors) - wanted)
  if extra:
    raise CheckpointError(f"{ckpt_dir}: checkpoint has tensor(s) {extra} that the model does not "
                          "(tie_embeddings or layer layout differ between checkpoint and model config)")
  sh_flat = {n: _unwrap(s) for n, s in _flatten(shardings)} if shardings is not None else {}
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  reader = _Reader(ckpt_dir)
  restored: dict[str, jax.Array] = {}
  total = sum(max(1, t["layers"]) for t in tensors.values())
  bar = tqdm(total=total, desc=f"restore {os.path.basename(os.path.normpath(ckpt_dir))}", unit="tensor",
             disable=(None if progress is None else not progress))
  with bar:
    for name, leaf in abstract.items():
      spec = _unwrap(leaf)
      sharding = sh_flat.get(name) or getattr(spec, "sharding", None) or default
      dt = jnp.dtype(dtype or spec.dtype)
      first = FUSED[name][1][0] if name in FUSED else name
      if first not in tensors:
        raise CheckpointError(f"{ckpt_dir}: tensor {first} is missing from {MANIFEST_FILE}")
      stacked = bool(tensors[first]["layers"])
      item_shape = tuple(spec.shape[1:] if stacked else spec.shape)
      lead = spec.shape[:1] if stacked else ()
      sources = _sources(name, item_shape)
      for src, view, _, axis in sources:
        stored = (*lead, *_stored_shape(view, axis))
        if src not in tensors:
          raise CheckpointError(f"{ckpt_dir}: tensor {src} is missing from {MANIFEST_FILE}")
        if tuple(tensors[src]["shape"]) != stored:
          raise CheckpointError(f"{ckpt_dir}: tensor {src} has shape {tuple(tensors[src]['shape'])} in the "
                                f"checkpoint, the model expects {stored}")
      rows = item_shape[0] if item_shape else 1
      if len(sources) == 1 and not stacked and tensors[name]["part_rows"] >= rows:
        restored[name] = reader.read(name, None, 0, spec.shape, dt, sharding)
        bar.update(1)
        continue
      slab_sharding = _slab_sharding(sharding, len(spec.shape), stacked)
      full = jax.jit(lambda: jnp.zeros(spec.shape, dt), out_shardings=sharding)()
      place = jax.jit(_place, donate_argnums=0, out_shardings=sharding, static_argnums=3)
      for src, view, offset, axis in sources:
        step = tensors[src]["part_rows"]
        read_sharding = _drop_axis(slab_sharding, axis, len(item_shape))
        for layer in (range(spec.shape[0]) if stacked else [None]):
          for part, start in enumerate(range(0, rows, step)):
            part_view = (min(step, rows - start), *view[1:])
            shape = _stored_shape(part_view, axis)
            slab = reader.read(src, layer, part, shape, dt, _fit_sharding(read_sharding, shape))
            at = [0] * len(item_shape)
            at[0] = start
            at[axis] += offset
            offsets = tuple(jnp.int32(o) for o in ((layer,) if stacked else ()) + tuple(at))
            full = place(full, slab, offsets, part_view)
            del slab
          bar.update(1)
      restored[name] = full

  def fill(path, leaf):
    value = restored[_path_name(path)]
    return leaf.replace(value) if isinstance(leaf, nnx.Variable) else value

  is_leaf = lambda x: isinstance(x, (nnx.Variable, jax.ShapeDtypeStruct))
  return jax.tree_util.tree_map_with_path(fill, abstract_state, is_leaf=is_leaf)


def load_checkpoint(ckpt_dir: str, *, dtype: str = "bfloat16", mesh: jax.sharding.Mesh | None = None,
                    progress: bool | None = None):
  """(ModelConfig, params, Tokenizer or None) of a checkpoint, for `Engine.load`.

  params is `nnx.state(Llama(cfg, dtype=dtype), nnx.Param)` filled from the checkpoint, each array placed with
  its sharding on `mesh` (lcjax.sharding.param_shardings) when one is given, else on the default device.
  """
  from lcjax.model.llama import Llama
  from lcjax.tokenizer import find_tokenizer
  cfg = load_config(ckpt_dir)
  abstract = nnx.state(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))), nnx.Param)
  shardings = None
  if mesh is not None:
    from lcjax.sharding import param_shardings
    shardings = param_shardings(abstract, mesh)
  params = restore_params(ckpt_dir, abstract, shardings, dtype=dtype, progress=progress)
  return cfg, params, find_tokenizer(ckpt_dir)
