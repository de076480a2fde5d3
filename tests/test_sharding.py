"""The logical-axis table, mesh construction, constraints, KV-head replication and parameter shardings."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from lcjax import sharding as sh

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")


def test_spec_maps_logical_names():
  assert sh.spec(("batch", "length", "heads", "head_dim")) == P(None, "seq", "tensor", None)
  assert sh.spec(("layers", "embed", "mlp")) == P(None, None, "tensor")
  assert sh.spec(("vocab", None)) == P("tensor", None)
  assert sh.spec(("pages", None, "kv_heads", "head_dim")) == P("seq", None, "tensor", None)
  assert sh.spec(()) == P()


def test_spec_errors():
  with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
    sh.spec(("batch", "hidden"))
  with pytest.raises(ValueError, match="two dimensions onto one mesh axis"):
    sh.spec(("heads", "mlp"))


@needs8
@pytest.mark.parametrize("seq,tensor", [(1, 1), (4, 2), (2, 4), (8, 1)])
def test_make_mesh(seq, tensor):
  mesh = sh.make_mesh(tensor=tensor, seq=seq)
  assert mesh.axis_names == ("seq", "tensor")
  assert dict(mesh.shape) == {"seq": seq, "tensor": tensor}
  assert tuple(mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
  assert list(mesh.devices.flat) == jax.devices()[:seq * tensor]


@needs8
def test_make_mesh_errors():
  with pytest.raises(ValueError, match=r"seq=4 x tensor=4 needs 16 devices but only 8"):
    sh.make_mesh(tensor=4, seq=4)
  with pytest.raises(ValueError, match=r"seq=2 x tensor=2 needs 4 devices but only 3"):
    sh.make_mesh(tensor=2, seq=2, devices=jax.devices()[:3])
  with pytest.raises(ValueError, match="seq=0"):
    sh.make_mesh(seq=0)


@needs8
def test_make_mesh_explicit_devices():
  devs = jax.devices()[4:8]
  mesh = sh.make_mesh(tensor=2, seq=2, devices=devs)
  assert list(mesh.devices.flat) == devs


@needs8
def test_named_sharding_places_shards():
  mesh = sh.make_mesh(tensor=2, seq=4)
  x = jnp.arange(4 * 8 * 6, dtype=jnp.float32).reshape(4, 8, 6)
  s = sh.named_sharding(mesh, ("batch", "length", "heads"))
  assert s == NamedSharding(mesh, P(None, "seq", "tensor"))
  y = jax.device_put(x, s)
  assert {sh_.data.shape for sh_ in y.addressable_shards} == {(4, 2, 3)}


def test_constrain_is_noop_without_mesh():
  x = jnp.ones((2, 8, 4))
  assert sh.constrain(x, ("batch", "length", "embed")) is x
  np.testing.assert_array_equal(jax.jit(lambda x: sh.constrain(x, ("batch", "length", "embed")) * 2)(x), 2 * x)


@needs8
def test_constrain_under_mesh():
  mesh = sh.make_mesh(tensor=2, seq=4)
  x = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4)
  with jax.set_mesh(mesh):
    y = jax.jit(lambda x: sh.constrain(x + 1, ("batch", "length", "heads")))(x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "seq", "tensor")), 3)
  np.testing.assert_array_equal(y, x + 1)


@needs8
def test_constrain_inside_shard_map_leaves_manual_axes_out():
  mesh = sh.make_mesh(tensor=2, seq=4)
  x = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4)

  def body(x):  # seq is manual here: "length" must not be constrained again, "heads" (tensor, auto) may be
    return sh.constrain(x * 3, ("batch", "length", "heads"))

  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"),
                              axis_names={"seq"}))
    np.testing.assert_array_equal(f(x), 3 * x)


def _min_rep(k, t):
  return next(r for r in itertools.count(1) if (k * r) % t == 0)


@pytest.mark.parametrize("n_heads,n_kv,tensor,want", [
    (32, 8, 1, 1), (32, 8, 8, 1), (32, 8, 16, 2), (64, 8, 32, 4), (32, 32, 4, 1), (6, 3, 2, 2), (9, 3, 3, 1),
    (8, 1, 8, 8)])
def test_kv_head_replication_cases(n_heads, n_kv, tensor, want):
  assert sh.kv_head_replication(n_kv, tensor, n_heads=n_heads) == want


def test_kv_head_replication_against_brute_force():
  for k, g, t in itertools.product(range(1, 9), range(1, 9), range(1, 17)):
    n = k * g
    if n % t:
      with pytest.raises(ValueError, match=f"n_heads={n} is not divisible by tensor={t}"):
        sh.kv_head_replication(k, t, n_heads=n)
      continue
    rep = sh.kv_head_replication(k, t, n_heads=n)
    assert rep == _min_rep(k, t)
    assert g % rep == 0  # in-place repetition keeps every query head with its own kv head


def test_kv_head_replication_errors():
  with pytest.raises(ValueError, match="n_heads=12 is not divisible by n_kv_heads=5"):
    sh.kv_head_replication(5, 1, n_heads=12)
  with pytest.raises(ValueError, match="n_heads=9 is not divisible by tensor=2"):
    sh.kv_head_replication(3, 2, n_heads=9)


class _Toy(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.normal()
    self.embed = nnx.Param(init(rngs.params(), (16, 8)), axes=("vocab", "embed"))
    self.wq = nnx.Param(init(rngs.params(), (2, 8, 4, 2)), axes=("layers", "embed", "heads", "head_dim"))
    self.norm = nnx.Param(jnp.ones((2, 8)), axes=("layers", "embed"))


@needs8
def test_param_shardings_from_abstract_state():
  mesh = sh.make_mesh(tensor=2, seq=4)
  abstract = nnx.state(nnx.eval_shape(lambda: _Toy(nnx.Rngs(0))), nnx.Param)
  shardings = sh.param_shardings(abstract, mesh)
  assert shardings["embed"] == NamedSharding(mesh, P("tensor", None))
  assert shardings["wq"] == NamedSharding(mesh, P(None, None, "tensor", None))
  assert shardings["norm"] == NamedSharding(mesh, P(None, None))
  # The result is a tree prefix of the concrete state, usable as a device_put target.
  state = nnx.state(_Toy(nnx.Rngs(0)), nnx.Param)
  placed = jax.device_put(state, shardings)
  assert placed["wq"].get_value().sharding == shardings["wq"]
  assert {s.data.shape for s in placed["wq"].get_value().addressable_shards} == {(2, 8, 2, 2)}


@needs8
def test_param_shardings_plain_axes_tree():
  mesh = sh.make_mesh(tensor=2, seq=2)
  tree = {"a": ("vocab", "embed"), "b": [("length",), ()]}
  got = sh.param_shardings(tree, mesh)
  assert got == {"a": NamedSharding(mesh, P("tensor", None)),
                 "b": [NamedSharding(mesh, P("seq")), NamedSharding(mesh, P())]}


@needs8
def test_param_shardings_errors():
  mesh = sh.make_mesh(tensor=4, seq=1)
  with pytest.raises(ValueError, match=r"'w'.*has no 'axes' metadata"):
    sh.param_shardings({"w": nnx.Param(jnp.ones((4, 4)))}, mesh)
  with pytest.raises(ValueError, match=r"shape=\(4, 4\) but 1 logical axes"):
    sh.param_shardings({"w": nnx.Param(jnp.ones((4, 4)), axes=("embed",))}, mesh)
  with pytest.raises(ValueError, match=r"dimension 6 is not divisible by mesh axis 'tensor' of size 4"):
    sh.param_shardings({"w": nnx.Param(jnp.ones((4, 6)), axes=("embed", "mlp"))}, mesh)
  with pytest.raises(TypeError, match="neither an nnx Variable"):
    sh.param_shardings({"w": jnp.ones(3)}, mesh)
