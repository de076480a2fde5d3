"""Restoring a checkpoint (the format of lcjax.checkpoint.layout) straight into sharded device arrays.

Each parameter is placed with its target sharding as it is read: stacked [L, ...] and split arrays are filled
part by part in a preallocated array (a donated in-place update), so the model is never held twice, on host or
device, and a process reads only what its devices hold.
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from lcjax.checkpoint.layout import (FUSED, MANIFEST_FILE, CheckpointError, flatten, item_dir, load_config,
                                     path_name, read_manifest, stored_shape, tensor_sources, unwrap)


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
    path = item_dir(os.path.abspath(self.dir), name, layer, part)
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
  abstract = dict(flatten(abstract_state))
  wanted = {src for name in abstract for src in (FUSED[name][1] if name in FUSED else (name,))}
  extra = sorted(set(tensors) - wanted)
  if extra:
    raise CheckpointError(f"{ckpt_dir}: checkpoint has tensor(s) {extra} that the model does not "
                          "(tie_embeddings or layer layout differ between checkpoint and model config)")
  sh_flat = {n: unwrap(s) for n, s in flatten(shardings)} if shardings is not None else {}
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  reader = _Reader(ckpt_dir)
  restored: dict[str, jax.Array] = {}
  total = sum(max(1, t["layers"]) for t in tensors.values())
  bar = tqdm(total=total, desc=f"restore {os.path.basename(os.path.normpath(ckpt_dir))}", unit="tensor",
             disable=(None if progress is None else not progress))
  with bar:
    for name, leaf in abstract.items():
      spec = unwrap(leaf)
      sharding = sh_flat.get(name) or getattr(spec, "sharding", None) or default
      dt = jnp.dtype(dtype or spec.dtype)
      first = FUSED[name][1][0] if name in FUSED else name
      if first not in tensors:
        raise CheckpointError(f"{ckpt_dir}: tensor {first} is missing from {MANIFEST_FILE}")
      stacked = bool(tensors[first]["layers"])
      item_shape = tuple(spec.shape[1:] if stacked else spec.shape)
      lead = spec.shape[:1] if stacked else ()
      sources = tensor_sources(name, item_shape)
      for src, view, _, axis in sources:
        stored = (*lead, *stored_shape(view, axis))
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
            shape = stored_shape(part_view, axis)
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
    value = restored[path_name(path)]
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
