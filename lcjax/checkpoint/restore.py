"""Restoring a checkpoint (the format of lcjax.checkpoint.layout) straight into sharded device arrays.

Each parameter is placed with its target sharding as it is read: stacked [L, ...] and split arrays are filled
part by part in a preallocated array (a donated in-place update), so the model is never held twice, on host or
device, and a process reads only what its devices hold. Stored parts are read in batches of at most BATCH_BYTES,
the parts of a batch concurrently (lcjax.checkpoint.items), and placed before the next batch is read.
"""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from lcjax.checkpoint import items
from lcjax.checkpoint.values import SCALE_MAX, SCALE_MIN
from lcjax.checkpoint.layout import (FUSED, MANIFEST_FILE, QUANTIZED, CheckpointError, flatten, item_dir, load_config,
                                     path_name, read_manifest, stored_format, stored_shape, tensor_sources, unwrap)
from lcjax.config import WeightFormat
from lcjax.model.llama import LINEAR
from lcjax.ops.linear import dequantize_stored, from_stored, kmajor_order, quantize_axes, quantize_weight


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


@functools.lru_cache(maxsize=None)
def _placer(sharding):
  return jax.jit(_place, donate_argnums=0, out_shardings=sharding, static_argnums=3)


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


# The bytes of the stored parts read in one batch, each part counted at the wider of its stored and read dtypes: a
# batch is read concurrently (lcjax.checkpoint.items) and its parts add up to at most this, or it is one part that
# is larger (parts are at most layout.PART_BYTES as stored). A batch is the transient memory of a restore: on the
# host its parts as decoded and cast (about this bound), on the devices its parts as read; a batch's parts are
# freed when their placements run, which dispatch queues asynchronously, so the next batch's reads can begin
# first: up to about two batches. Besides that, only the one layer that a format conversion assembles
# (_convert_linear).
BATCH_BYTES = 256 << 20


class _Reader:
  """Reads a checkpoint's stored parts in batches of at most `batch_bytes`. `read` queues a part with the step that
  uses it, `then` a step without a part; when the next part would pass the budget, and on `flush`, the queued
  parts are read concurrently and the queued steps run in the order they were queued, each given its part. Steps
  run after the code that queued them has moved on: they keep what they build in a dict (`box[key]`), not in
  local variables."""

  def __init__(self, ckpt_dir: str, tensors: dict, batch_bytes: int | None = None):
    self.dir = ckpt_dir
    self.tensors = tensors
    self.batch_bytes = BATCH_BYTES if batch_bytes is None else batch_bytes
    self.queue: list[tuple[items.Part | None, object]] = []
    self.queued_bytes = 0

  def stacked(self, name: str) -> bool:
    first = FUSED[name][1][0] if name in FUSED else name
    if first not in self.tensors:
      raise CheckpointError(f"{self.dir}: tensor {first} is missing from {MANIFEST_FILE}")
    return bool(self.tensors[first]["layers"])

  def read(self, name: str, layer: int | None, part: int, shape, dtype, sharding, use) -> None:
    """Queue stored part `part` of tensor `name` (layer `layer`), read as an array of `shape`, `dtype` and
    `sharding` and handed to `use`."""
    where = f"tensor {name}" + ("" if layer is None else f" layer {layer}") + (f" part {part}" if part else "")
    path = item_dir(os.path.abspath(self.dir), name, layer, part)
    if not os.path.isdir(path):
      raise CheckpointError(f"{self.dir}: {where} is missing ({path})")
    p = items.Part(path, where, tuple(shape), dtype, sharding)
    size = part_bytes(p, self.tensors[name]["dtype"])
    if self.queued_bytes and self.queued_bytes + size > self.batch_bytes:
      self.flush()
    self.queue.append((p, use))
    self.queued_bytes += size

  def then(self, step) -> None:
    """Queue `step()` to run after the steps queued before it."""
    self.queue.append((None, step))

  def flush(self) -> None:
    """Read the queued parts and run the queued steps; each part is dropped once its step has run."""
    queue, self.queue, self.queued_bytes = self.queue, [], 0
    values = items.read_parts(self.dir, [p for p, _ in queue if p is not None])
    values.reverse()
    for part, step in queue:
      if part is None:
        step()
      else:
        step(values.pop())

  def read_model_tensor(self, name: str, layer: int | None, item_shape, dt, sharding, box: dict, key: str, *,
                        stacked_full: bool = True) -> None:
    """Queue the reads that assemble model tensor `name` (layer `layer` of a stacked one; `item_shape` without the
    layers axis) from its stored tensors and parts into box[key]: with stacked_full, box[key] is the stacked
    [L, *item_shape] array (donated, with `sharding`) and layer `layer` of it is written; else box[key] becomes a
    new array with `sharding` (a whole unstacked tensor, or one layer of a stacked one, `sharding` then being the
    layer's)."""
    item_shape = tuple(item_shape)
    stacked = layer is not None
    sources = tensor_sources(name, item_shape)
    lead = (self.tensors[sources[0][0]]["layers"],) if stacked else ()
    for src, view, _, axis in sources:
      stored = (*lead, *stored_shape(view, axis))
      if src not in self.tensors:
        raise CheckpointError(f"{self.dir}: tensor {src} is missing from {MANIFEST_FILE}")
      if tuple(self.tensors[src]["shape"]) != stored:
        raise CheckpointError(f"{self.dir}: tensor {src} has shape {tuple(self.tensors[src]['shape'])} in the "
                              f"checkpoint, the model expects {stored}")
    rows = item_shape[0] if item_shape else 1
    if len(sources) == 1 and not stacked and self.tensors[name]["part_rows"] >= rows:
      self.read(name, None, 0, item_shape, dt, sharding, functools.partial(box.__setitem__, key))
      return
    in_full = stacked and stacked_full
    slab_sharding = _slab_sharding(sharding, len(item_shape) + in_full, in_full)
    if not in_full:       # a new array, made when the steps run (a layer's is alive only until its step uses it)
      self.then(lambda: box.__setitem__(key, jax.jit(lambda: jnp.zeros(item_shape, dt), out_shardings=sharding)()))
    place = _placer(sharding)
    for src, view, offset, axis in sources:
      step = self.tensors[src]["part_rows"]
      read_sharding = _drop_axis(slab_sharding, axis, len(item_shape))
      for part, start in enumerate(range(0, rows, step)):
        part_view = (min(step, rows - start), *view[1:])
        shape = stored_shape(part_view, axis)
        at = [0] * len(item_shape)
        at[0] = start
        at[axis] += offset
        offsets = tuple(np.int32(o) for o in ((layer,) if in_full else ()) + tuple(at))
        self.read(src, layer, part, shape, dt, _fit_sharding(read_sharding, shape),
                  functools.partial(_place_into, box, key, place, offsets, part_view))


def part_bytes(part: items.Part, stored_dtype) -> int:
  """What a part counts against BATCH_BYTES: its elements at the wider of its stored and read dtypes."""
  return part.nbytes // jnp.dtype(part.dtype).itemsize * max(jnp.dtype(part.dtype).itemsize,
                                                              jnp.dtype(stored_dtype).itemsize)


def _place_into(box: dict, key: str, place, offsets, view, slab) -> None:
  box[key] = place(box[key], slab, offsets, view)


def _model_names(names, fmt: WeightFormat) -> set[str]:
  """The model tensors of a state whose names are `names`, less any fp8 scales, plus those of format `fmt`."""
  plain = {n for n in names if not any(n == w + suffix for w in LINEAR for suffix in ("_scale", "_in_scale"))}
  return plain | {w + "_scale" for w in LINEAR if fmt.fp8} | {w + "_in_scale" for w in LINEAR if fmt.static_inputs}


def restore_params(ckpt_dir: str, abstract_state, shardings=None, dtype=None, *, progress: bool | None = None):
  """Restore a checkpoint into a tree shaped like `abstract_state`.

  abstract_state: `nnx.state(nnx.eval_shape(lambda: Llama(cfg, ...)), nnx.Param)` or any pytree whose leaves are
    ShapeDtypeStruct (or nnx Variables holding them), with paths such as embed/embedding, layers/attn/wqkv
    (a FUSED tensor is assembled from its stored tensors).
  shardings: optional pytree of the same structure whose leaves are `jax.sharding.Sharding` (or Variables holding
    them). Leaves without one use the ShapeDtypeStruct's own `.sharding`, else the default device.
  dtype: the parameter dtype to cast to on restore (default: each abstract leaf's dtype); fp8 weights and their
    scales keep theirs.
  Returns the same structure with jax.Arrays (Variables stay Variables with their metadata), ready for
  `nnx.update(model, state)`. Each array is placed directly with its sharding; stacked [L, ...] and split arrays
  are filled part by part in place, so peak device memory is the model plus about two batches of stored parts
  (BATCH_BYTES each, or one part larger than that: BATCH_BYTES says why two), and the host's transient is about
  one batch. When the state's
  linear weights are in another format than the checkpoint's (fp8 or not: `lcjax.model.llama.weight_format`),
  they are quantized or dequantized a layer at a time as they are read: the model is never held in the wider
  format (one layer is, while it is converted).
  """
  manifest = read_manifest(ckpt_dir)
  tensors = manifest["tensors"]
  abstract = dict(flatten(abstract_state))
  stored, target = stored_format(tensors), _format_of(abstract)
  # fp8 weights (stored or served) go through _convert_linear: served K-major, quantized or dequantized.
  convert = stored.fp8 or target.fp8
  not_e4m3 = [f"{n} is {tensors[n]['dtype']}" for n in sorted(QUANTIZED) if n in tensors and stored.fp8
              and tensors[n]["dtype"] != "float8_e4m3fn"]
  if not_e4m3:       # read as e4m3, another dtype's bytes would be converted by value: other weights, or NaN
    raise CheckpointError(f"{ckpt_dir}: fp8 weights must be stored as float8_e4m3fn; {', '.join(not_e4m3)}")
  if target.static_inputs and not stored.static_inputs:
    raise CheckpointError(f"{ckpt_dir}: holds no static input scales to quantize activations with")
  names = _model_names(abstract, stored) if convert else set(abstract)
  wanted = {src for name in names for src in (FUSED[name][1] if name in FUSED else (name,))}
  extra = sorted(set(tensors) - wanted)
  if extra:
    raise CheckpointError(f"{ckpt_dir}: checkpoint has tensor(s) {extra} that the model does not "
                          "(tie_embeddings, layer layout or weight format differ between checkpoint and model)")
  sh_flat = {n: unwrap(s) for n, s in flatten(shardings)} if shardings is not None else {}
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  reader = _Reader(ckpt_dir, tensors)
  restored: dict[str, jax.Array] = {}      # filled as the reader's steps run; complete after its last flush
  fp8_checks: list[tuple[str, int, jax.Array]] = []     # (name, layer, _fp8_faults of its stored fp8 layer)
  total = sum(max(1, t["layers"]) for t in tensors.values())
  bar = tqdm(total=total, desc=f"restore {os.path.basename(os.path.normpath(ckpt_dir))}", unit="tensor",
             disable=(None if progress is None else not progress))
  with bar:
    for name, leaf in abstract.items():
      if name in restored:
        continue
      spec = unwrap(leaf)
      sharding = sh_flat.get(name) or getattr(spec, "sharding", None) or default
      if convert and name in LINEAR:
        scale = name + "_scale"
        _convert_linear(reader, restored, name, stored, target, spec, sharding,
                        unwrap(abstract[scale]) if target.fp8 else None, sh_flat.get(scale) or default,
                        jnp.dtype(dtype or spec.dtype), lambda: bar.update(2 if stored.fp8 else 1), fp8_checks)
        continue
      dt = spec.dtype if spec.dtype in _KEEP_DTYPES else jnp.dtype(dtype or spec.dtype)
      if reader.stacked(name):
        restored[name] = jax.jit(lambda: jnp.zeros(spec.shape, dt), out_shardings=sharding)()
        for layer in range(spec.shape[0]):
          reader.read_model_tensor(name, layer, spec.shape[1:], dt, sharding, restored, name)
          reader.then(functools.partial(bar.update, 1))
      else:
        reader.read_model_tensor(name, None, spec.shape, dt, sharding, restored, name)
        reader.then(functools.partial(bar.update, 1))
    reader.flush()
  _check_fp8_values(ckpt_dir, fp8_checks, {n: a for n, a in restored.items() if n.endswith("_in_scale")})

  def fill(path, leaf):
    value = restored[path_name(path)]
    return leaf.replace(value) if isinstance(leaf, nnx.Variable) else value

  is_leaf = lambda x: isinstance(x, (nnx.Variable, jax.ShapeDtypeStruct))
  return jax.tree_util.tree_map_with_path(fill, abstract_state, is_leaf=is_leaf)


# fp8 weights and their float32 scales are restored in their own dtype, whatever the parameter dtype.
_KEEP_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32))


def _format_of(abstract: dict) -> WeightFormat:
  return WeightFormat(fp8="layers/attn/wqkv_scale" in abstract, static_inputs="layers/attn/wqkv_in_scale" in abstract)


def _sane_scale(scale):
  """Whether each scale entry is within [SCALE_MIN, SCALE_MAX] (lcjax.checkpoint.values; NaN is not)."""
  return (scale >= SCALE_MIN) & (scale <= SCALE_MAX)


def _fp8_faults(w8, scale):
  """[scale entries outside [SCALE_MIN, SCALE_MAX], NaN bytes (0x7F, 0xFF) of w8], any of each, as an int32
  pair."""
  bad_scale = ~jnp.all(_sane_scale(scale))
  nan = jnp.any((jax.lax.bitcast_convert_type(w8, jnp.uint8) & 0x7F) == 0x7F)
  return jnp.stack([bad_scale, nan]).astype(jnp.int32)


def _scale_ok(scales):
  """Per layer of stacked [L, ...] scales: every entry within [SCALE_MIN, SCALE_MAX]."""
  return jnp.all(_sane_scale(scales).reshape(scales.shape[0], -1), axis=1)


def _check_fp8_values(ckpt_dir: str, checks, in_scales: dict) -> None:
  """Refuse a checkpoint whose stored fp8 layers (`checks`: (name, layer, _fp8_faults)) or static input scales
  (name -> [L, 1] array) hold a scale that is not finite and > 0 or a NaN weight: one line naming the first."""
  faults = jax.device_get([f.addressable_data(0) for _, _, f in checks])
  for (name, layer, _), (bad_scale, nan) in zip(checks, faults):
    if bad_scale or nan:
      what = (f"a scale outside [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}]" if bad_scale else "a NaN float8_e4m3fn weight")
      parts = f" (stored as {', '.join(FUSED[name][1])})" if name in FUSED else ""
      raise CheckpointError(f"{ckpt_dir}: layer {layer} of {name}{parts} holds {what} (the checkpoint is corrupt)")
  for name, arr in in_scales.items():
    sharding = arr.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    ok = jax.jit(_scale_ok, out_shardings=sharding)(arr)
    ok = np.asarray(jax.device_get(ok.addressable_data(0)))
    if not ok.all():
      layer = int(np.flatnonzero(~ok)[0])
      raise CheckpointError(f"{ckpt_dir}: layer {layer} of {name} is an input scale outside [{SCALE_MIN:.3g}, "
                            f"{SCALE_MAX:.3g}] (the checkpoint is corrupt)")


def _convert_linear(reader, restored: dict, name, stored: WeightFormat, target: WeightFormat, spec, sharding,
                    scale_spec, scale_sharding, dtype, done, fp8_checks: list) -> None:
  """Queue the reads of a stacked linear weight, a layer at a time as the checkpoint stores it (the model's layout,
  in dtype or e4m3 with its scale), placed as the model holds it into restored[name] in dtype, or restored[name]
  (w8) and restored[name + "_scale"], K-major (lcjax.ops.linear), fp8 bytes kept as stored and other weights
  quantized per output channel. `done()` runs after each layer's step; each stored fp8 layer appends
  (name, layer, _fp8_faults of it) to `fp8_checks`."""
  L, lin = spec.shape[0], LINEAR[name]
  order = kmajor_order(lin)
  item = spec.shape[1:] if not target.fp8 else tuple(spec.shape[1:][order.index(i)] for i in range(len(order)))
  scale_item = tuple(1 if i in quantize_axes(lin) else n for i, n in enumerate(item))
  w_dt = jnp.dtype(jnp.float8_e4m3fn) if stored.fp8 else dtype
  # A layer is read whole on each device (a replicated sharding: its layout is not the placed array's when that is
  # K-major) and converted there; the placed array keeps its own sharding.
  whole = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
           if isinstance(sharding, jax.sharding.NamedSharding) else sharding)
  layer_sh = whole if target.fp8 else _slab_sharding(sharding, len(spec.shape), True)
  restored[name] = jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=sharding)()
  out_sh = {name: sharding}
  if target.fp8:
    restored[name + "_scale"] = jax.jit(lambda: jnp.zeros(scale_spec.shape, jnp.float32),
                                        out_shardings=scale_sharding)()
    out_sh[name + "_scale"] = scale_sharding

  @functools.partial(jax.jit, donate_argnums=0, out_shardings=(out_sh, whole))
  def put(out, w, s, layer):
    faults = _fp8_faults(w, s) if s is not None else jnp.zeros(2, jnp.int32)
    if target.fp8:
      w, s = from_stored(w, s, lin) if s is not None else quantize_weight(w.astype(dtype), lin)
    else:
      w, s = (w.astype(dtype) if s is None else dequantize_stored(w, s, dtype)), None
    new = {name: jax.lax.dynamic_update_index_in_dim(out[name], w.astype(out[name].dtype), layer, 0)}
    if s is not None:
      new[name + "_scale"] = jax.lax.dynamic_update_index_in_dim(out[name + "_scale"], s, layer, 0)
    return new, faults

  layer_parts: dict[str, jax.Array] = {}      # "w" and "s" of the layer being assembled

  def put_layer(layer):
    out, faults = put({k: restored[k] for k in out_sh}, layer_parts.pop("w"), layer_parts.pop("s", None),
                      jnp.int32(layer))
    restored.update(out)
    if stored.fp8:
      fp8_checks.append((name, layer, faults))
    done()

  for layer in range(L):
    reader.read_model_tensor(name, layer, item, w_dt, layer_sh, layer_parts, "w", stacked_full=False)
    if stored.fp8:
      reader.read_model_tensor(name + "_scale", layer, scale_item, jnp.float32, whole, layer_parts, "s",
                               stacked_full=False)
    reader.then(functools.partial(put_layer, layer))


def load_checkpoint(ckpt_dir: str, *, dtype: str = "bfloat16", mesh: jax.sharding.Mesh | None = None,
                    progress: bool | None = None):
  """(ModelConfig, params, Tokenizer or None) of a checkpoint, for `Engine.load`.

  params is `nnx.state(Llama(cfg, dtype=dtype, weights=<the checkpoint's format>), nnx.Param)` filled from the
  checkpoint, each array placed with its sharding on `mesh` (lcjax.sharding.param_shardings) when one is given,
  else on the default device.
  """
  from lcjax.model.llama import Llama
  from lcjax.tokenizer import find_tokenizer
  cfg = load_config(ckpt_dir)
  weights = stored_format(read_manifest(ckpt_dir)["tensors"])
  abstract = nnx.state(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.dtype(dtype), weights=weights,
                                                    rngs=nnx.Rngs(0))), nnx.Param)
  shardings = None
  if mesh is not None:
    from lcjax.sharding import param_shardings
    shardings = param_shardings(abstract, mesh)
  params = restore_params(ckpt_dir, abstract, shardings, dtype=dtype, progress=progress)
  return cfg, params, find_tokenizer(ckpt_dir)
