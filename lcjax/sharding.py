"""Mesh axes, the one logical-axis table, and the helpers that turn logical names into shardings (layer L1).

The mesh has two axes: `seq` (the sequence: ring prefill, sequence-sharded KV pages) and `tensor` (weights and
attention heads). Code above this layer names array dimensions logically (`("batch", "length", "embed")`) and
never spells a mesh axis, except inside shard_map bodies, which use the `SEQ` / `TENSOR` constants.

Axis types: the mesh is built with `AxisType.Auto` on both axes, deliberately. With Auto, GSPMD propagates
shardings from the parameters and from the few `constrain` calls at block boundaries, and `jax.shard_map`
reshards an input whose sharding differs from its `in_specs` instead of refusing it. Explicit axes (the default
of `jax.make_mesh` in jax 0.10/0.11) put shardings into types: every op whose output sharding is ambiguous (an
einsum contracting a sharded dimension) would need an explicit `out_sharding`, and shard_map would reject
mismatched inputs; that buys nothing for an inference engine whose layouts are fixed per mesh.
"""
from __future__ import annotations

import math
import types
from typing import Sequence

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

SEQ = "seq"
TENSOR = "tensor"
MESH_AXES = (SEQ, TENSOR)

# Logical dimension name -> mesh axis (None: replicated). The single source of truth for every layout.
LOGICAL_AXES = types.MappingProxyType({
    "vocab": TENSOR,
    "embed": None,
    "heads": TENSOR,
    "kv_heads": TENSOR,
    "head_dim": None,
    "mlp": TENSOR,
    "layers": None,
    "batch": None,
    "length": SEQ,
    "pages": SEQ,
})

Axes = Sequence[str | None]


def make_mesh(tensor: int = 1, seq: int = 1, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A ("seq", "tensor") mesh over the first seq * tensor devices.

  `tensor` is the minor axis so a tensor-parallel group sits on neighbouring devices (one NVLink island), where
  its per-layer all-reduces are cheapest; the ring over `seq` moves one K/V block per step and tolerates distance.
  """
  if tensor < 1 or seq < 1:
    raise ValueError(f"mesh axis sizes must be >= 1, got {seq=} {tensor=}")
  devices = list(jax.devices() if devices is None else devices)
  need = seq * tensor
  if len(devices) < need:
    raise ValueError(f"a mesh of {seq=} x {tensor=} needs {need} devices but only {len(devices)} are available")
  return jax.make_mesh((seq, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[:need])


def _mesh_axis(name: str | None) -> str | None:
  if name is None:
    return None
  if name not in LOGICAL_AXES:
    raise ValueError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_AXES)}")
  return LOGICAL_AXES[name]


def spec(axes: Axes) -> PartitionSpec:
  """PartitionSpec of an array whose dimensions carry the logical names `axes` (None: replicated)."""
  mapped = [_mesh_axis(a) for a in axes]
  used = [m for m in mapped if m is not None]
  if len(used) != len(set(used)):
    raise ValueError(f"logical axes {tuple(axes)} map two dimensions onto one mesh axis: {tuple(mapped)}")
  return PartitionSpec(*mapped)


def named_sharding(mesh: jax.sharding.Mesh, axes: Axes) -> NamedSharding:
  return NamedSharding(mesh, spec(axes))


def constrain(x, axes: Axes, mesh: jax.sharding.Mesh | None = None):
  """Pin the sharding of activation `x` to its logical `axes` on `mesh`, or on the active mesh (`jax.set_mesh`).

  A no-op without a mesh, so single-device code and tests run the same model code. Mesh axes that are Manual
  here (inside a shard_map body) are already local and are left out of the constraint. An explicit `mesh` is for
  code outside shard_map that holds its mesh (the model) and must not depend on a global context.
  """
  if mesh is not None:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes)))
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  auto = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
  p = spec(axes)
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*(a if a in auto else None for a in p)))


def kv_head_replication(n_kv_heads: int, tensor: int, *, n_heads: int) -> int:
  """How many times each KV head is repeated so the KV heads split evenly over `tensor` devices.

  Returns the minimal `rep` with `tensor | n_kv_heads * rep` (1 when tensor already divides n_kv_heads; vLLM
  does the same when kv heads < tensor). Repeating each KV head `rep` times in place keeps query head n paired
  with its KV head, because tensor | n_heads implies rep | n_heads // n_kv_heads.
  """
  if n_kv_heads < 1 or tensor < 1 or n_heads < 1:
    raise ValueError(f"head counts and tensor must be >= 1, got {n_heads=} {n_kv_heads=} {tensor=}")
  if n_heads % n_kv_heads:
    raise ValueError(f"{n_heads=} is not divisible by {n_kv_heads=}")
  if n_heads % tensor:
    raise ValueError(f"{n_heads=} is not divisible by {tensor=}: query heads cannot be split over the tensor axis")
  return tensor // math.gcd(n_kv_heads, tensor)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def param_shardings(state, mesh: jax.sharding.Mesh, *, replicate: frozenset[str] | set[str] = frozenset()):
  """Map a pytree of parameters to a same-shaped pytree of NamedSharding.

  Leaves are either nnx Variables carrying metadata `axes` (an nnx State, concrete or from `nnx.eval_shape`)
  or plain tuples of logical names. The result is a tree prefix of the state, so it serves directly as
  `jax.device_put(state, shardings)` target and as jit `out_shardings`. Logical axes named in `replicate` are
  left unsharded: a checkpoint's wqkv with fewer KV heads than `tensor` is restored without its KV-head split
  and then repeated into its sharded layout (see `kv_head_replication`, lcjax.engine.placement.checkpoint_shardings).
  """
  from flax import nnx  # lazily: L1 describes layouts and must import without the model's framework

  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

  def one(path, leaf):
    where = jax.tree_util.keystr(path)
    if isinstance(leaf, nnx.Variable):
      axes = leaf.get_metadata().get("axes")
      if axes is None:
        raise ValueError(f"parameter {where} ({type(leaf).__name__}) has no 'axes' metadata; give it logical "
                         "axis names or filter the state to annotated parameters (nnx.state(model, nnx.Param))")
      shape = tuple(leaf.get_value().shape)
      if len(axes) != len(shape):
        raise ValueError(f"parameter {where} has {shape=} but {len(axes)} logical axes {tuple(axes)}")
      p = spec(tuple(a if a not in replicate else None for a in axes))
      for dim, ax in zip(shape, p):
        if ax is not None and dim % sizes[ax]:
          raise ValueError(f"parameter {where} {shape=} axes={tuple(axes)}: dimension {dim} is not divisible by "
                           f"mesh axis {ax!r} of size {sizes[ax]}")
      return NamedSharding(mesh, p)
    if _is_axes(leaf):
      return NamedSharding(mesh, spec(tuple(a if a not in replicate else None for a in leaf)))
    raise TypeError(f"leaf {where} of type {type(leaf).__name__} is neither an nnx Variable nor a tuple of "
                    "logical axis names")

  return jax.tree_util.tree_map_with_path(one, state,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable) or _is_axes(x))
