"""The memory plan against the arrays it predicts, and the golden PartitionSpec of every parameter.

Oracles: the per-device bytes of the real sharded state of small engines (each device's addressable shards),
and for full-size presets the shard shapes that the engine's NamedShardings give `jax.eval_shape` results (no
memory allocated). The golden file records, per preset and mesh, the spec of every parameter of the model the
engine runs (after KV-head replication) and of the cache; regenerate it with LCJAX_UPDATE_GOLDEN=1 after a
deliberate layout change and review the diff.
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import jax
import pytest
from flax import nnx

from lcjax import sharding as sh
from lcjax.cache import kv as kvc
from lcjax.config import PRESETS, ConfigError, ModelConfig, RunConfig, WeightFormat, preset
from lcjax.engine import plan as planlib
from lcjax.engine.engine import Engine
from lcjax.engine.placement import serving_config, serving_model, serving_shardings

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")

GOLDEN = pathlib.Path(__file__).parent / "golden" / "partition_specs.json"
TINY8 = ModelConfig("tiny-gqa8", vocab_size=128, dim=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, max_position=512, bos_id=None, eos_ids=())


def _device_bytes(tree) -> dict:
  """Bytes each device holds of the arrays in tree."""
  out: dict = {}
  for x in jax.tree.leaves(tree):
    for s in x.addressable_shards:
      out[s.device] = out.get(s.device, 0) + s.data.nbytes
  return out


FP8 = "float8_e4m3fn"


@pytest.mark.parametrize("tensor,seq,cache_dtype,weight_dtype", [
    (1, 1, "auto", "auto"), (2, 4, "auto", "auto"), (4, 2, FP8, "auto"), (8, 1, "auto", "auto"),
    (1, 8, "bfloat16", "auto"), (1, 1, FP8, FP8), (2, 1, FP8, FP8), (2, 2, FP8, FP8), (4, 2, FP8, FP8),
    (8, 1, "auto", FP8)])
def test_plan_equals_sharded_state(tensor, seq, cache_dtype, weight_dtype):
  """fp8 weights: one byte a weight sharded as in the parameter dtype, float32 scales sharded with their output
  channels (wo's and w_down's, along D, replicated), the KV heads' repeats counted (tensor 4 and 8)."""
  run = RunConfig(dtype="float32", cache_dtype=cache_dtype, page_size=4, prefill_chunk=32, max_context=100,
                  max_batch=3, tensor=tensor, seq=seq, attention="reference", weight_dtype=weight_dtype)
  eng = Engine.random(TINY8, run=run)
  p = eng.plan
  assert eng.weights.fp8 == (weight_dtype == FP8) and p.weight_dtype.startswith("float8") == eng.weights.fp8
  weights, cache = _device_bytes(eng.params), _device_bytes(eng.cache)
  assert len(weights) == len(cache) == tensor * seq
  assert set(weights.values()) == {p.weights}
  assert set(cache.values()) == {p.kv_cache}
  assert p.num_pages == eng.cache.k.shape[1] == eng.pool.pages_total == seq * p.pages_per_device
  assert p.kv_replication == eng.kv_rep and p.kv_heads_per_device == eng.cache.k.shape[3] // tensor
  # Capacity: every one of max_batch sequences of max_context tokens fits, on the busiest shard too.
  assert eng.pool.fits(run.max_context)
  assert p.tokens_capacity == eng.pool.pages_allocatable * run.page_size >= run.max_batch * run.max_context


# Full-size presets: per-device bytes from the shard shapes of abstract arrays.
PRESET_MESHES = [(name, t, s) for name in sorted(PRESETS) for t, s in [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8)]
                 if PRESETS[name].n_heads % t == 0] + [("smollm2-135m", 3, 2)]


@pytest.mark.parametrize("name,tensor,seq", PRESET_MESHES)
def test_plan_equals_eval_shape_of_presets(name, tensor, seq):
  cfg = preset(name)
  run = RunConfig(dtype="bfloat16", tensor=tensor, seq=seq, max_batch=2, page_size=256, max_context=32768)
  mesh = sh.make_mesh(tensor=tensor, seq=seq)
  p = planlib.plan(cfg, run)
  _, shardings = serving_shardings(cfg, run, mesh)
  abstract = nnx.state(nnx.eval_shape(lambda: serving_model(cfg, run, mesh)), nnx.Param)
  leaves = zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
  weights = sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in leaves)
  assert weights == p.weights
  net, rep = serving_config(cfg, run)
  shape = kvc.cache_shape(cfg.n_layers, p.num_pages, run.page_size, net.n_kv_heads, cfg.head_dim)
  pool = kvc.cache_shardings(mesh, quantized=False).k
  assert 2 * math.prod(pool.shard_shape(shape)) * 2 == p.kv_cache
  assert rep == p.kv_replication


@pytest.mark.parametrize("tensor,seq", [(2, 1), (1, 2), (4, 1), (2, 2), (8, 1), (4, 2), (2, 4)])
def test_plan_of_fp8_70b_equals_eval_shape(tensor, seq):
  """Llama-3.1-70B with fp8 weights and an fp8 cache at 512K tokens on meshes of 2, 4 and 8 devices: the plan's
  weights and KV cache per device are the shards of the serving model's abstract state (e4m3 weights and their
  float32 scales) and of the pools with their float32 scales."""
  cfg = preset("llama3.1-70b")
  run = RunConfig(dtype="bfloat16", weight_dtype=FP8, cache_dtype=FP8, tensor=tensor, seq=seq, max_batch=1,
                  page_size=256, prefill_chunk=16384, max_context=524288, allow_beyond_trained_context=True)
  mesh = sh.make_mesh(tensor=tensor, seq=seq)
  fp8 = WeightFormat(fp8=True)
  p = planlib.plan(cfg, run, weights=fp8)
  _, shardings = serving_shardings(cfg, run, mesh, weights=fp8)
  abstract = nnx.state(nnx.eval_shape(lambda: serving_model(cfg, run, mesh, weights=fp8)), nnx.Param)
  leaves = list(zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))
  assert {a.dtype.name for a, _ in leaves} == {"float8_e4m3fn", "float32", "bfloat16"}
  assert sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in leaves) == p.weights
  net, _ = serving_config(cfg, run)
  shape = kvc.cache_shape(cfg.n_layers, p.num_pages, run.page_size, net.n_kv_heads, cfg.head_dim)
  pools = kvc.cache_shardings(mesh, quantized=True)
  scales = pools.k_scale.shard_shape((cfg.n_layers, p.num_pages, net.n_kv_heads))
  assert 2 * math.prod(pools.k.shard_shape(shape)) + 2 * math.prod(scales) * 4 == p.kv_cache
  assert p.tokens_capacity >= 524288


def test_plan_counts_the_fp8_prefix_read_it_compiles():
  """8-bit attention over an fp8 cache: a prefix read in place (V's bytes transposed) needs less than one gathered
  and quantized again, which `int8_fp8` and pages under 64 tokens take; the plan counts each as its run reads it
  (and never less than the bf16 pages' branch compiled beside it)."""
  cfg = preset("llama3.1-8b")
  run = RunConfig(dtype="bfloat16", cache_dtype="float8_e4m3fn", max_context=262144, max_batch=1,
                  prefill_chunk=16384)
  act = lambda **kw: planlib.plan(cfg, run.replace(**kw)).activations
  in_place, gathered = act(attention_dtype="float8_e4m3fn"), act(attention_dtype="int8_fp8")
  assert in_place < gathered
  assert act(attention_dtype="float8_e4m3fn", page_size=32) == act(attention_dtype="int8_fp8", page_size=32)
  assert act(attention_dtype="float8_e4m3fn", page_size=32) > act(attention_dtype="float8_e4m3fn", page_size=64)
  assert in_place >= act(attention_dtype="auto")


def test_plan_kv_replication_and_comm_model():
  cfg = preset("llama3.1-70b")
  # 8 KV heads on 16 tensor devices: each repeated twice, one per device; the weights count the repeats.
  p16 = planlib.plan(cfg, RunConfig(dtype="bfloat16", tensor=16, max_context=8192, max_batch=1))
  assert p16.kv_replication == 2 and p16.kv_heads_per_device == 1
  assert "KV heads replicated x2" in p16.table()
  p8 = planlib.plan(cfg, RunConfig(dtype="bfloat16", tensor=8, max_context=8192, max_batch=1))
  assert p8.kv_replication == 1
  # Per device, both hold one KV head's key and value per layer in wqkv (16 repeated heads / 16, 8 / 8) and the
  # replicated norms; everything else halves from tensor=8 to tensor=16.
  D, L, H = cfg.dim, cfg.n_layers, cfg.head_dim
  norms, kv = (2 * L * D + D) * 2, L * 2 * D * H * 2
  assert p16.weights == (p8.weights - norms - kv) // 2 + norms + kv
  # Ring: a block of chunk/seq tokens, K and V of the local KV heads per step.
  run = RunConfig(dtype="bfloat16", tensor=4, seq=2, prefill_chunk=16384, max_context=524288, max_batch=1)
  c = planlib.plan(cfg, run).comm
  assert c.block_tokens == 8192 and c.ring_steps == 1
  assert c.ring_step_bytes == 2 * 8192 * 2 * 128 * 2
  assert c.ring_step_flops == 2 * 8192 ** 2 * 16 * 128
  # GQA 8:1 hides the ring from a few hundred tokens of block, MHA from a few thousand (NVLink, bf16).
  assert 200 < c.overlap_block_tokens < 500 and c.overlaps
  mha = planlib.comm_plan(preset("llama2-7b"), run.replace(seq=8, prefill_chunk=8192))
  assert 2000 < mha.overlap_block_tokens < 4000 and not mha.overlaps          # 1024-token blocks
  assert planlib.comm_plan(preset("llama2-7b"), run.replace(seq=2, prefill_chunk=16384)).overlaps
  # An odd seq: the model pads a 2,048-token chunk to 2,052 (a multiple of 2 * 3) and a device holds 684 of them,
  # not ceil(2048 / 3) = 683.
  assert planlib.comm_plan(cfg, run.replace(seq=3, prefill_chunk=2048)).block_tokens == 684
  # A context shorter than the chunk: its prompt's one chunk is padded to its bucket, 2,049 tokens to 2,560 (the
  # scheduler's chunk_bucket: multiples of 512 between 2,048 and 4,096), and the plan counts those rows.
  short = RunConfig(dtype="bfloat16", prefill_chunk=4096, max_context=2049, max_batch=1)
  assert planlib.comm_plan(cfg, short).block_tokens == 2560
  assert planlib.plan(cfg, short).activations == planlib.plan(cfg, short.replace(max_context=2560)).activations


def _golden_data() -> dict:
  meshes = [(1, 8), (2, 4), (4, 2), (8, 1), (3, 2)]
  out = {}
  for name in sorted(PRESETS):
    cfg = preset(name)
    per = {}
    for t, s in meshes:
      run = RunConfig(dtype="bfloat16", tensor=t, seq=s)
      key = f"tensor={t} seq={s}"
      try:
        net, rep = serving_config(cfg, run)
      except ConfigError as e:
        per[key] = {"error": str(e)}
        continue
      mesh = sh.make_mesh(tensor=t, seq=s)
      _, shardings = serving_shardings(cfg, run, mesh)
      flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
      params = {"/".join(str(getattr(k, "key", k)) for k in path): [a if a is None else str(a) for a in
                                                                     tuple(ns.spec)] for path, ns in flat}
      per[key] = {"kv_replication": rep, "kv_heads": net.n_kv_heads, "params": params,
                  "cache": [a for a in tuple(kvc.cache_shardings(mesh, False).k.spec)]}
    out[name] = per
  return out


def test_golden_partition_specs():
  got = _golden_data()
  if os.environ.get("LCJAX_UPDATE_GOLDEN"):
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
  want = json.loads(GOLDEN.read_text())
  assert got == want
  # Independent spot checks of the table the golden file freezes.
  l70 = got["llama3.1-70b"]["tensor=8 seq=1"]["params"]
  assert l70["layers/attn/wqkv"] == [None, None, "tensor", None, None]
  assert l70["layers/attn/wo"] == [None, "tensor", None, None]
  assert l70["layers/mlp/w_gate_up"] == [None, None, None, "tensor"]
  assert l70["layers/mlp/w_down"] == [None, "tensor", None]
  assert l70["embed/embedding"] == ["tensor", None] and l70["lm_head/kernel"] == [None, "tensor"]
  assert l70["layers/attn_norm/scale"] == [None, None]
  assert got["llama3.1-70b"]["tensor=8 seq=1"]["cache"] == [None, "seq", None, "tensor", None]
  assert "n_heads=9 is not divisible by tensor=2" in got["smollm2-135m"]["tensor=2 seq=4"]["error"]
  assert got["smollm2-135m"]["tensor=3 seq=2"]["kv_replication"] == 1
  assert got["tiny"]["tensor=8 seq=1"]["error"].startswith("n_heads=4 is not divisible by tensor=8")
  assert got["tiny"]["tensor=4 seq=2"]["kv_replication"] == 2 and got["tiny"]["tensor=4 seq=2"]["kv_heads"] == 4


def test_engine_random_refuses_a_plan_that_does_not_fit_before_allocating():
  """Engine.random checks the memory plan against the device as Engine.load and the CLI do: a 70B at 128k tokens
  on this machine is one ConfigError, and nothing was allocated."""
  from lcjax.config import ConfigError, RunConfig, preset
  from lcjax.engine.engine import Engine
  before = len(jax.live_arrays())
  with pytest.raises(ConfigError) as e:
    Engine.random(preset("llama3.1-70b"), run=RunConfig(max_context=131072))
  msg = str(e.value)
  assert "\n" not in msg and "max_context=131072 x max_batch=4 does not fit: the memory plan needs" in msg, msg
  assert len(jax.live_arrays()) == before


def test_plan_command_prints_the_plans_it_is_asked_for():
  """`python -m lcjax.engine.plan` with a preset, contexts and meshes prints one row each, in bfloat16 by default
  (the rows equal plan() of the same run), and refuses a malformed mesh in one line."""
  import subprocess
  import sys
  from tests.run_cache import cpu_env
  run = [sys.executable, "-m", "lcjax.engine.plan", "--preset=llama3.1-8b", "--contexts=131072,1048576",
         "--meshes=1x1,2x1", "--cache_dtype=float8_e4m3fn"]
  p = subprocess.run(run, capture_output=True, text=True, env=cpu_env(), timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  rows = [l.split() for l in p.stdout.splitlines() if l.strip()[:1].isdigit()]
  assert [(r[0], r[1] + r[2] + r[3]) for r in rows] == [("131,072", "1x1"), ("131,072", "2x1"),
                                                         ("1,048,576", "1x1"), ("1,048,576", "2x1")]
  want = planlib.plan(preset("llama3.1-8b"), RunConfig(dtype="bfloat16", cache_dtype="float8_e4m3fn", max_batch=1,
                                                      page_size=256, prefill_chunk=16384, max_context=1048576,
                                                      tensor=2, allow_beyond_trained_context=True))
  assert float(rows[3][8]) == round(want.total / 2**30, 2)
  for flag, says in (("--meshes=8", "--meshes=8: give tensor x seq sizes"), ("--contexts=abc", "give int values"),
                     ("--preset=llama9", "unknown preset 'llama9'")):
    bad = subprocess.run(run[:3] + [flag], capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert bad.returncode != 0 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
