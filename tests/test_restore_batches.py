"""Batched, concurrent restore (lcjax.checkpoint.items, restore._Reader) against orbax's own single-item restore.

Checkpoints of a tiny model are written with small parts (many items per tensor and layer) from random values:
float32 weights, and fp8 e4m3 weights with their float32 scales. Two oracles: orbax's PyTreeCheckpointer restoring
each item alone (the per-item restore the batches replace), and the values written.
"""
from __future__ import annotations

import asyncio
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lcjax.checkpoint import items, layout, restore
from lcjax.checkpoint.layout import item_dir, param_shapes, stored_tensor
from lcjax.checkpoint.writer import CheckpointWriter
from lcjax.config import ModelConfig, WeightFormat
from lcjax.engine.placement import checkpoint_shardings
from lcjax.sharding import make_mesh

CFG = ModelConfig("batch-tiny", vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=96, max_position=256, bos_id=0, eos_ids=(1,))
FP8 = WeightFormat(fp8=True)
E4M3 = jnp.float8_e4m3fn                # ml_dtypes.float8_e4m3fn: a numpy dtype


def _write(dst: str, weights: WeightFormat) -> dict:
  """Random values of every stored tensor written in parts of at most 8 KiB; returns {(name, layer): array}."""
  rng = np.random.default_rng(7)
  written = {}
  with CheckpointWriter(dst, CFG, weights=weights) as w:
    for name, (shape, stacked) in param_shapes(CFG, weights).items():
      for layer in (range(shape[0]) if stacked else [None]):
        item = shape[1:] if stacked else shape
        a = (0.2 * rng.standard_normal(item)).astype(np.float32)
        if name.endswith("_scale"):
          a = np.abs(a) + 0.01
        elif weights.fp8 and name in layout.QUANTIZED:
          a = (8 * a).astype(E4M3)
        written[name, layer] = a
        w.write(name, a, layer)
  return written


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("batches")
  mp = pytest.MonkeyPatch()
  mp.setattr(layout, "PART_BYTES", 8 << 10)
  try:
    return {fmt: (str(root / fmt), _write(str(root / fmt), w)) for fmt, w in (("f32", WeightFormat()), ("fp8", FP8))}
  finally:
    mp.undo()


def _items(dst: str):
  """(item directory, stored name, layer, part, part shape, stored dtype) of every item the manifest lists."""
  out = []
  for name, t in layout.read_manifest(dst)["tensors"].items():
    shape = tuple(t["shape"][1:] if t["layers"] else t["shape"])
    for layer in (range(t["layers"]) if t["layers"] else [None]):
      for part, start in enumerate(range(0, shape[0], t["part_rows"])):
        rows = min(t["part_rows"], shape[0] - start)
        out.append((item_dir(dst, name, layer, part), name, layer, part, (rows, *shape[1:]), jnp.dtype(t["dtype"])))
  return out


def _single_item(path: str) -> np.ndarray:
  """Orbax's plain restore of one item, as stored (numpy, no sharding, no cast)."""
  return np.asarray(ocp.PyTreeCheckpointer().restore(path)["value"])


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("fmt", ["f32", "fp8"])
def test_batched_reads_equal_single_item_restores(ckpts, fmt):
  """Every item of a checkpoint read in one batch, split over a 2 x 4 mesh where its rows divide (else
  replicated; the embedding's float32 parts read as bfloat16): the same bits as orbax restoring each item
  alone (then cast), in the dtype and with the sharding asked for."""
  dst, written = ckpts[fmt]
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
  parts, want = [], []
  for path, name, layer, part, shape, dtype in _items(dst):
    spec = P(("a", "b")) if shape[0] % 8 == 0 else P("b") if shape[0] % 4 == 0 else P()
    read_as = jnp.dtype(jnp.bfloat16) if name == "embed/embedding" else dtype
    parts.append(items.Part(path, f"{name} {layer} {part}", shape, read_as, NamedSharding(mesh, spec)))
    want.append(_single_item(path).astype(read_as))
  kinds = {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)} | ({jnp.dtype(E4M3)} if fmt == "fp8" else set())
  assert len(parts) >= 50 and {p.dtype for p in parts} == kinds
  assert {str(p.sharding.spec) for p in parts} == {str(P(("a", "b"))), str(P("b")), str(P())}
  got = items.read_parts(dst, parts)
  assert len(got) == len(parts)
  for p, g, w in zip(parts, got, want):  # noqa: B905
    assert g.shape == p.shape and g.dtype == p.dtype, p.where
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (p.where, g.sharding)
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=p.where)


def _serial_read_parts(ckpt_dir, parts):
  """The oracle reader: each part restored alone by orbax's PyTreeCheckpointer, straight into its sharding."""
  out = []
  for p in parts:
    args = ocp.args.PyTreeRestore(restore_args={"value": ocp.ArrayRestoreArgs(
        sharding=p.sharding, global_shape=tuple(p.shape), dtype=p.dtype)})
    out.append(ocp.PyTreeCheckpointer().restore(p.path, args=args)["value"])
  return out


def _restore(dst, target: WeightFormat, mesh, monkeypatch, budget: int, reader):
  """restore_params of dst into a state of format `target` placed as Engine.load places it on `mesh`, with
  batches of `budget` bytes read by `reader`; returns (flat state, the batches' parts)."""
  batches = []

  def recording(ckpt_dir, parts):
    batches.append(list(parts))
    return reader(ckpt_dir, parts)

  monkeypatch.setattr(restore, "BATCH_BYTES", budget)
  monkeypatch.setattr(items, "read_parts", recording)
  abstract, shardings = checkpoint_shardings(CFG, mesh, "float32", target)
  state = restore.restore_params(dst, abstract, shardings, dtype="float32", progress=False)
  monkeypatch.undo()
  return {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(state)}, [b for b in batches if b]


@pytest.mark.parametrize("stored,target", [("f32", WeightFormat()), ("fp8", FP8), ("f32", FP8),
                                           ("fp8", WeightFormat())])
def test_restore_in_batches_equals_item_by_item(ckpts, monkeypatch, stored, target):
  """restore_params on a (seq=2, tensor=2) mesh reading batches of at most 24 KiB concurrently: the same arrays,
  bit for bit and with the same shardings, as reading each item alone with orbax's restore and using it before
  the next is read (the order of a one-part budget); fp8 weights with their scales kept, quantized at load or
  dequantized. Every item is read once, no batch passes the budget unless it is one part, and batches hold
  several parts."""
  dst, _ = ckpts[stored]
  mesh = make_mesh(tensor=2, seq=2, devices=jax.devices()[:4])
  want, one_by_one = _restore(dst, target, mesh, monkeypatch, 0, _serial_read_parts)
  budget = 24 << 10
  got, batches = _restore(dst, target, mesh, monkeypatch, budget, items.read_parts)
  assert all(len(b) == 1 for b in one_by_one)
  paths = sorted(p.path for b in batches for p in b)
  assert paths == sorted(path for path, *_ in _items(dst))                 # every item, once
  width = {path: dt.itemsize for path, *_, dt in _items(dst)}          # each part at its wider dtype
  assert all(sum(int(np.prod(p.shape)) * max(width[p.path], jnp.dtype(p.dtype).itemsize) for p in b) <= budget
             or len(b) == 1 for b in batches)
  assert max(len(b) for b in batches) >= 4 and len(batches) > 8
  assert sorted(got) == sorted(want)
  for name in want:
    assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
    assert got[name].sharding.is_equivalent_to(want[name].sharding, got[name].ndim), name
    np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=name)


@pytest.mark.parametrize("in_loop", [False, True], ids=["plain", "inside-a-running-event-loop"])
def test_restored_model_holds_the_values_written(ckpts, monkeypatch, in_loop):
  """The float32 checkpoint restored in small batches on a mesh, cut back into its stored tensors
  (layout.stored_tensor, the export direction): exactly the arrays written, layer by layer. Also when restore is
  called from a coroutine, as a notebook kernel runs a cell (its loop is running: the batches are read on a thread
  of their own)."""
  dst, written = ckpts["f32"]
  mesh = make_mesh(tensor=2, seq=2, devices=jax.devices()[:4])
  if in_loop:
    async def cell():
      asyncio.get_running_loop()
      return _restore(dst, WeightFormat(), mesh, monkeypatch, 24 << 10, items.read_parts)
    got, _ = asyncio.run(cell())
  else:
    got, _ = _restore(dst, WeightFormat(), mesh, monkeypatch, 24 << 10, items.read_parts)
  flat = {k: np.asarray(v) for k, v in got.items()}
  for (name, layer), want in written.items():
    np.testing.assert_array_equal(np.asarray(stored_tensor(flat, name, layer)), want, err_msg=f"{name} {layer}")


def _two_leaves(path):
  shutil.rmtree(path)
  ocp.PyTreeCheckpointer().save(path, args=ocp.args.PyTreeSave({"value": np.ones((8, 96), np.float32),
                                                                "other": np.ones(3, np.float32)}))


@pytest.mark.parametrize("damage,needle", [
    (lambda path: os.unlink(os.path.join(path, items.TREE_METADATA_FILE)), "_METADATA is missing"),
    (_two_leaves, "holds 2 leaves, not the one leaf 'value'")], ids=["no-tree-metadata", "two-leaves"])
def test_a_part_that_cannot_be_read_is_named(ckpts, tmp_path, damage, needle):
  """One item of a batch without its tree metadata, or holding another tree: the batch fails in one line that
  names the checkpoint, the part and what is wrong."""
  dst = str(tmp_path / "ckpt")
  shutil.copytree(ckpts["f32"][0], dst)
  path, *_ = next(i for i in _items(dst) if i[1] == "layers/mlp/w_down" and i[2] == 1 and i[3] == 1)
  damage(path)
  abstract, shardings = checkpoint_shardings(CFG, make_mesh(tensor=1, seq=1, devices=jax.devices()[:1]),
                                             "float32")
  with pytest.raises(layout.CheckpointError) as e:
    restore.restore_params(dst, abstract, shardings, progress=False)
  msg = str(e.value)
  assert "\n" not in msg and "cannot read tensor layers/mlp/w_down layer 1 part 1" in msg, msg
  assert msg.startswith(dst + ":") and needle in msg, msg
