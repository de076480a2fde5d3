"""The model against HF transformers on the same weights, plus structural checks of the presets."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lcjax.cache import kv as kvc
from lcjax.config import ModelConfig, RopeScaling, preset
from lcjax.model.llama import Llama
from lcjax.ops.backends import ReferenceBackend
from tests import hf_oracle

# Published parameter counts (model cards / HF safetensors index totals).
PUBLISHED = {"smollm2-135m": 134.5e6, "llama2-7b": 6.74e9, "llama3-8b": 8.03e9, "llama3.1-8b": 8.03e9,
             "llama3.1-70b": 70.55e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
  cfg = preset(name)
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert n == cfg.param_count()
  assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.005, (name, n)


def _cfg(**kw):
  base = ModelConfig("t", vocab_size=97, dim=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16,
                     ffn_dim=80, rope_theta=500000.0, max_position=256,
                     rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position=32))
  return dataclasses.replace(base, **kw)


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True, "rope_scaling": None},
                                {"n_kv_heads": 6}, {"n_kv_heads": 1, "head_dim": 8}])
def test_logits_match_hf_transformers(kw):
  cfg = _cfg(**kw)
  hf = hf_oracle.make_hf_llama(cfg, seed=1)
  model = Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  hf_oracle.load_into(model, hf_oracle.hf_to_lcjax_state(hf, cfg))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 70))
  ref = hf_oracle.hf_logits(hf, tokens)
  got, _ = model(jnp.asarray(tokens, jnp.int32))
  scale = np.abs(ref).max()
  assert scale > 1.0, "oracle logits too small to be a meaningful check"
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4 * scale, rtol=0)


def test_bf16_close_to_f32():
  cfg = _cfg()
  hf = hf_oracle.make_hf_llama(cfg, seed=2)
  flat = hf_oracle.hf_to_lcjax_state(hf, cfg)
  m32 = hf_oracle.load_into(Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), flat)
  m16 = hf_oracle.load_into(Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), flat)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 40)), jnp.int32)
  a, _ = m32(tokens)
  b, _ = m16(tokens)
  assert b.dtype == jnp.float32  # logits are accumulated and returned in float32
  rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
  assert rel < 0.05, rel


def test_pool_reads_default_and_refusal():
  """pool_reads: "layer" on CPUs for the reference and dense backends, "view" for backends that read one layer's
  pages as an offset into the [L * P] view; "layer" is refused for those."""
  from lcjax.ops.backends import DenseBackend
  from lcjax.ops.pallas_backend import PallasBackend
  cfg = _cfg()
  build = lambda **kw: nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), **kw))
  cpu = jax.default_backend() == "cpu"
  assert build().pool_reads == build(attention=DenseBackend()).pool_reads == ("layer" if cpu else "view")
  assert build(attention=PallasBackend(interpret=True)).pool_reads == "view"
  with pytest.raises(ValueError, match="pool_reads"):
    build(attention=PallasBackend(interpret=True), pool_reads="layer")


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.float8_e4m3fn], ids=["f32", "fp8"])
def test_pool_reads_layer_and_view_compute_the_same(cache_dtype):
  """A chunked prefill through the paged cache, then decode steps, with the pools read with the layer index
  (pool_reads="layer") and as the [L * P] view with page offsets (pool_reads="view", what GPU kernels read): the same
  logits and the same pools, and for float32 pools the uncached forward's logits."""
  cfg = _cfg()
  L, K, H, Z, M = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, 12
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, cfg.vocab_size, 30)
  table = jnp.asarray(rng.permutation(np.arange(1, 2 * M))[None, :M], jnp.int32)   # pages out of order, 0: null

  def slots(start, n):
    pos = np.arange(start, start + n)
    return jnp.asarray(np.asarray(table)[0, pos // Z] * Z + pos % Z, jnp.int32)[None]

  # Each kind of call is one compiled program, as the engine's steps are: run eagerly, each of the 9 calls of both
  # models would dispatch its operations one by one, compiling a small program for each new shape.
  chunk_call = nnx.jit(lambda model, x, pos, cache, slots, prefix_len: model(
      x, pos, cache=cache, slots=slots, page_table=table, prefix_len=prefix_len))
  step_call = nnx.jit(lambda model, x, pos, cache, slots, kv_len: model(
      x, pos, cache=cache, slots=slots, page_table=table, kv_len=kv_len))

  def run(pool_reads):
    model = Llama(cfg, dtype=jnp.float32, pool_reads=pool_reads, rngs=nnx.Rngs(0))
    cache = kvc.init_cache(L, 2 * M, Z, K, H, cache_dtype)
    out = []
    for c0 in (0, 8, 16):            # prefill: 24 tokens in 3 chunks of 8
      chunk = jnp.asarray(tokens[None, c0:c0 + 8], jnp.int32)
      logits, cache = chunk_call(model, chunk, jnp.arange(c0, c0 + 8, dtype=jnp.int32)[None], cache, slots(c0, 8),
                                 jnp.asarray([c0], jnp.int32))
      out.append(logits)
    for n in range(24, 30):          # decode: one token a step
      logits, cache = step_call(model, jnp.asarray(tokens[None, n:n + 1], jnp.int32), jnp.asarray([[n]], jnp.int32),
                                cache, slots(n, 1), jnp.asarray([n + 1], jnp.int32))
      out.append(logits)
    return model, np.concatenate([np.asarray(x) for x in out], axis=1), cache

  model, view, view_cache = run("view")
  _, layer, layer_cache = run("layer")
  assert model.pool_reads == "view"
  np.testing.assert_allclose(layer, view, rtol=1e-6, atol=1e-6)
  for a, b in zip(view_cache.parts(), layer_cache.parts()):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
  if cache_dtype == jnp.float32:
    full, _ = model(jnp.asarray(tokens[None], jnp.int32))
    np.testing.assert_allclose(view, np.asarray(full), rtol=1e-4, atol=1e-4)


_TOLD_ROWS = {"attend": [], "paged": []}


def _garbage_past(q_len, out, lse, told: list):
  """out, lse with the rows at or past q_len set to 1e3 (what a kernel that skips them may leave), q_len recorded."""
  jax.debug.callback(lambda n: told.append(np.asarray(n).tolist()), q_len)    # q_len may be traced
  pad = jnp.arange(out.shape[1])[None, :] >= q_len[:, None]                   # [B, T]
  return jnp.where(pad[..., None, None], 1e3, out), jnp.where(pad[..., None], 1e3, lse)


@dataclasses.dataclass(frozen=True)
class _PaddingIsGarbage(ReferenceBackend):
  """ReferenceBackend whose `attend` and `paged` fill the rows they are told are padding (rows at or past q_len)
  with 1e3, as a kernel that skips them may leave anything there; they record each q_len they are given."""
  name: str = "padding-is-garbage"

  def attend(self, q, k, v, *, q_len=None, **kw):
    out, lse = super().attend(q, k, v, q_len=q_len, **kw)
    return (out, lse) if q_len is None else _garbage_past(q_len, out, lse, _TOLD_ROWS["attend"])

  def paged(self, q, *args, q_len=None, **kw):
    out, lse = super().paged(q, *args, q_len=q_len, **kw)
    return (out, lse) if q_len is None else _garbage_past(q_len, out, lse, _TOLD_ROWS["paged"])


def _primitives(jaxpr) -> list[str]:
  """The names of the primitives of a jaxpr and of every jaxpr nested in its equations' parameters."""
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          names += _primitives(sub)
  return names


@pytest.mark.parametrize("backend, cache_dtype", [("cudnn", jnp.bfloat16), ("cudnn", jnp.float8_e4m3fn),
                                                  ("pallas-fp8", jnp.float8_e4m3fn)])
def test_a_chunk_at_the_positions_the_model_builds_has_no_device_side_choice(monkeypatch, backend, cache_dtype):
  """A prefill chunk over a cached prefix at the positions the model builds from prefix_len (as the engine's chunks
  are) traces no lax.cond: its prefix read promises the backend that the prefix precedes its rows (past=True) and
  its own causal block comes without positions, so the backends check nothing on the device (a GPU copies such a
  check's predicate to the host and waits for every kernel queued before it). Its logits equal those of the same
  chunk with the same positions passed in, which promises nothing (the positive control: past=False in every
  layer, and the checks traced)."""
  from lcjax.ops.cudnn.backend import CudnnBackend
  from lcjax.ops.pallas_backend import PallasFp8Backend
  from tests.test_fp8 import spy_promises
  be = CudnnBackend(emulate=True) if backend == "cudnn" else PallasFp8Backend(interpret=True)
  told = spy_promises(monkeypatch, type(be))
  # The FP8 kernel's head dim, 64-token pages; 48 rows of 2 heads a kv head: past the decode kernels' 64 rows.
  cfg = _cfg(dim=128, n_heads=2, n_kv_heads=1, head_dim=64)
  L, K, H, Z = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 64
  model = Llama(cfg, dtype=jnp.bfloat16, attention=be, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (1, 120)), jnp.int32)
  table = jnp.asarray([[3, 1]], jnp.int32)
  slots = lambda c0, n: jnp.asarray([[table[0, j // Z] * Z + j % Z for j in range(c0, c0 + n)]], jnp.int32)
  _, cache = model(tokens[:, :72], cache=kvc.init_cache(L, 4, Z, K, H, cache_dtype), slots=slots(0, 72),
                   page_table=table, prefix_len=jnp.zeros(1, jnp.int32))

  def chunk(positions):
    return lambda cache: model(tokens[:, 72:], positions, cache=cache, slots=slots(72, 48), page_table=table,
                               prefix_len=jnp.asarray([72], jnp.int32))[0]

  given = jnp.arange(72, 120, dtype=jnp.int32)[None]
  told.clear()
  assert _primitives(jax.make_jaxpr(chunk(None))(cache).jaxpr).count("cond") == 0
  assert told == [True]
  told.clear()
  assert _primitives(jax.make_jaxpr(chunk(given))(cache).jaxpr).count("cond") >= 2
  assert told == [False]
  # Each compiled whole without XLA's excess precision: where a fusion keeps a bf16 chain in float32, the chunk whose
  # prefix read sits in a cond branch (fused apart) rounds otherwise than the inline one, by a bf16 unit.
  exact = lambda f: jax.jit(f).lower(cache).compile({"xla_allow_excess_precision": False})(cache)
  np.testing.assert_allclose(np.asarray(exact(chunk(None)), np.float32), np.asarray(exact(chunk(given)), np.float32),
                             rtol=1e-6, atol=1e-6)


def test_an_uncached_padded_call_tells_attend_its_real_rows():
  """A call without a cache of 8 rows of which 5 and 3 are real: the model tells attend the real rows (q_len =
  lengths), and the real rows' logits do not depend on what attend leaves in the padded rows."""
  cfg = _cfg()
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
  lengths = jnp.asarray([5, 3], jnp.int32)

  def run(backend):
    model = Llama(cfg, dtype=jnp.float32, attention=backend, rngs=nnx.Rngs(0))
    logits = model(tokens, jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8)), lengths=lengths,
                   logits_at=lengths - 1)
    return np.asarray(logits[0] if isinstance(logits, tuple) else logits)

  _TOLD_ROWS["attend"].clear()
  got = run(_PaddingIsGarbage())
  assert _TOLD_ROWS["attend"] == [[5, 3]] * cfg.n_layers, _TOLD_ROWS
  np.testing.assert_allclose(got, run(ReferenceBackend()), rtol=1e-5, atol=1e-5)


def test_a_padded_chunk_tells_the_prefix_read_its_real_rows():
  """A chunk of 8 rows of which 5 and 3 are real (two sequences), over a cached prefix of 8 tokens: the model tells
  the chunk's self-attention and the backend's prefix read the real rows (q_len = lengths; the FP8 kernels keep
  padding out of Q's block scales with it), and the real rows' logits do not depend on what either leaves in the
  padded rows (the other layers never see them)."""
  cfg = _cfg()
  L, K, H, Z, M = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, 6
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
  table = jnp.asarray([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], jnp.int32)
  lengths = jnp.asarray([5, 3], jnp.int32)

  def slots(c0, n):
    pos = np.arange(c0, c0 + 8)
    s = np.asarray(table)[:, pos // Z] * Z + pos % Z
    return jnp.asarray(np.where(np.arange(8)[None, :] < np.asarray(n)[:, None], s, 0), jnp.int32)

  def run(backend):
    model = Llama(cfg, dtype=jnp.float32, attention=backend, rngs=nnx.Rngs(0))
    cache = kvc.init_cache(L, 13, Z, K, H, jnp.float32)
    pos = lambda c0: jnp.broadcast_to(jnp.arange(c0, c0 + 8, dtype=jnp.int32), (2, 8))
    _, cache = model(tokens[:, :8], pos(0), cache=cache, slots=slots(0, [8, 8]), page_table=table,
                     prefix_len=jnp.zeros(2, jnp.int32))
    logits, _ = model(tokens[:, 8:], pos(8), cache=cache, slots=slots(8, lengths), page_table=table,
                      prefix_len=jnp.full(2, 8, jnp.int32), lengths=lengths, logits_at=lengths - 1)
    return np.asarray(logits)

  for told in _TOLD_ROWS.values():
    told.clear()
  got = run(_PaddingIsGarbage())
  assert _TOLD_ROWS["paged"] == [[8, 8]] * L + [[5, 3]] * L, _TOLD_ROWS           # each layer's prefix read
  assert _TOLD_ROWS["attend"] == [[8, 8]] * L + [[5, 3]] * L, _TOLD_ROWS          # each layer's own chunk
  np.testing.assert_allclose(got, run(ReferenceBackend()), rtol=1e-5, atol=1e-5)
