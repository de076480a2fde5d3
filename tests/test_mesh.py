"""The engine on ("seq", "tensor") meshes of 8 fake CPU devices against the same engine on one device.

Oracle: one device runs the plain model (no shard_map, no ring, unsharded cache); every mesh must give the same
float32 logits (uncached forward and chunked paged prefill, <= 1e-4 relative), the same greedy tokens, the same
K/V in its pages, and the same tokens after a long prefill and many decode steps. The tiny model has 8 heads and
2 KV heads, so tensor=4 and 8 repeat KV heads (x2, x4); prompts span several prefill chunks so every chunk after
the first reads a cached prefix spread over the seq shards.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lcjax.config import ConfigError, ModelConfig, RunConfig
from lcjax.engine.engine import Engine
from lcjax.engine.placement import checkpoint_shardings
from tests.run_cache import optimized_xla

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")

CFG = ModelConfig("tiny-gqa8", vocab_size=128, dim=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8,
                  ffn_dim=64, max_position=512, bos_id=None, eos_ids=())
# Chunks of 16, the smallest bucket: every chunk of every prompt is one compiled prefill shape per engine.
RUN = RunConfig(dtype="float32", page_size=4, prefill_chunk=16, max_context=320, max_batch=3, decode_steps=16,
                attention="reference")
# (tensor, seq); (2, 3): six devices, a seq size that power-of-two chunks do not divide (the model pads).
MESHES = [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1), (2, 3)]
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, CFG.vocab_size, n).tolist() for n in (90, 5, 37)]
LONG = RNG.integers(0, CFG.vocab_size, 230).tolist()
_ENGINES: dict = {}


def engine(tensor=1, seq=1, cfg=CFG, **kw) -> Engine:
  """The engine of RUN with these fields, built once. Meshes are handed the one-device engine's weights (random,
  seed 1), which the Engine places: every engine of `cfg` runs the very same parameters."""
  key = (tensor, seq, cfg.name, tuple(sorted(kw.items())))
  if key not in _ENGINES:
    run = RUN.replace(tensor=tensor, seq=seq, **kw)
    one = (tensor, seq) == (1, 1) and not kw
    _ENGINES[key] = Engine.random(cfg, run=run, seed=1) if one else Engine(cfg, engine(cfg=cfg).params, run=run)
  return _ENGINES[key]


def rel(a, b):
  return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def prefill(eng: Engine, prompt):
  """Chunked paged prefill of one prompt: (last-position logits [V], K and V of its tokens [L, n, K, H])."""
  r = eng._make_requests([prompt], 1, None)[0]
  assert eng.scheduler.admit(r)
  captured = {}
  real = eng.steps.first_token

  def keep(logits, sp, pos):
    captured["logits"] = np.asarray(logits)[0]
    return real(logits, sp, pos)
  try:
    eng.steps.first_token = keep
    eng.scheduler.prefill(r)
    slots = eng.pool.slot_mapping(r.seq, 0, len(prompt))
    L, P, Z, K, H = eng.cache.k.shape
    k, v = (np.asarray(x).reshape(L, P * Z, K, H)[:, slots] for x in (eng.cache.k, eng.cache.v))
  finally:
    eng.steps.first_token = real
    eng.scheduler.release(r)
  return captured["logits"], k, v


@pytest.fixture(scope="module")
def ref():
  eng = engine()
  logits = eng.logits([PROMPTS[0][:37], PROMPTS[2]])
  return dict(logits=logits, prefill=prefill(eng, PROMPTS[0]),
              greedy=[r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=40)])


def test_random_weights_do_not_depend_on_the_mesh():
  """Engine.random draws on the mesh the very weights it draws on one device (the other tests hand mesh engines
  the one-device weights)."""
  got = jax.tree.leaves_with_path(Engine.random(CFG, run=RUN.replace(tensor=2, seq=3), seed=1).params)
  want = jax.tree.leaves_with_path(engine().params)
  assert [p for p, _ in got] == [p for p, _ in want] and got
  for (path, a), (_, b) in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("tensor,seq", MESHES)
def test_mesh_matches_one_device(ref, tensor, seq):
  eng = engine(tensor, seq)
  assert eng.kv_rep == {1: 1, 2: 1, 4: 2, 8: 4}[tensor]
  # Before its KV heads are repeated, the checkpoint-shaped wqkv is split along D, never whole on every device.
  _, ckpt = checkpoint_shardings(eng.cfg, eng.mesh, "float32")
  want = P(None, "tensor") if eng.kv_rep > 1 else P(None, None, "tensor", None, None)
  assert ckpt["layers"]["attn"]["wqkv"].spec == want
  # The weights it was handed are placed: the serving wqkv's heads split over `tensor`.
  wqkv = eng.params["layers"]["attn"]["wqkv"].get_value()
  assert wqkv.sharding.spec[2] == "tensor" and wqkv.sharding.is_fully_replicated == (tensor == 1)
  # Uncached forward (ring over the whole call), two rows.
  assert rel(eng.logits([PROMPTS[0][:37], PROMPTS[2]]), ref["logits"]) <= 1e-4
  # Chunked paged prefill: 6 chunks of 16, the later ones against a prefix held by the seq shards.
  logits, k, v = prefill(eng, PROMPTS[0])
  want_logits, want_k, want_v = ref["prefill"]
  assert rel(logits, want_logits) <= 1e-4
  # The pages hold each original KV head repeated kv_rep times, in place.
  np.testing.assert_allclose(k, np.repeat(want_k, eng.kv_rep, axis=2), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(v, np.repeat(want_v, eng.kv_rep, axis=2), rtol=1e-5, atol=1e-5)
  # Greedy generation of 40 tokens for three prompts decoded together (3 decode calls of 16 steps).
  got = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=40)]
  assert got == ref["greedy"] and all(len(t) == 40 for t in got)
  assert eng.pool.pages_used == 0


@pytest.mark.parametrize("tensor,seq", [(1, 8), (2, 4)])
def test_long_prefill_then_many_decode_steps(tensor, seq):
  """230 prompt tokens (15 chunks) then 80 decode steps: the sequence's pages end up on every seq shard, and
  each decode step combines the shards' partials. Page balance: shards differ by at most one page."""
  want = engine().generate(LONG, max_new_tokens=80).token_ids
  eng = engine(tensor, seq)
  r = eng._make_requests([LONG], 80, None)[0]
  assert eng.scheduler.admit(r)
  table = eng.pool.page_table(r.seq)
  per_shard = np.bincount([eng.pool.shard_of(p) for p in table], minlength=seq)
  assert per_shard.max() - per_shard.min() <= 1 and per_shard.sum() == len(table) == -(-310 // 4)
  eng.scheduler.release(r)
  assert eng.generate(LONG, max_new_tokens=80).token_ids == want


def test_prefix_sharing_on_a_mesh():
  """Forked page tables with a copy-on-write of the shared last page (the copy stays on its shard)."""
  prefix = RNG.integers(0, CFG.vocab_size, 45).tolist()
  suffixes = [p[:9] for p in PROMPTS]
  want = [r.token_ids for r in engine().generate(suffixes, max_new_tokens=12, prefix=prefix)]
  eng = engine(2, 4)
  assert [r.token_ids for r in eng.generate(suffixes, max_new_tokens=12, prefix=prefix)] == want
  assert eng.pool.pages_used == 0


def test_peak_device_memory_is_the_largest_of_the_engines_devices(monkeypatch):
  """stats["peak_device_bytes"] is the largest peak over the engine's own devices (the memory plan's per-device
  figure), not the process's first device's: an engine on devices 4-7 reports device 6's peak (the CPU reports
  none, so each device's memory_stats is faked here)."""
  devices = jax.devices()[4:]
  peaks = {d.id: 100 * (i + 1) for i, d in enumerate(jax.devices())}
  peaks[6] = 10**6
  eng = Engine(CFG, engine().params, run=RUN.replace(seq=2, tensor=2), mesh=jax.sharding.Mesh(
      np.array(devices).reshape(2, 2), ("seq", "tensor")))
  monkeypatch.setattr(type(devices[0]), "memory_stats", lambda d: {"peak_bytes_in_use": peaks[d.id]})
  assert eng.generate(PROMPTS[1], max_new_tokens=2).stats["peak_device_bytes"] == 10**6
  peaks[6] = 0
  assert eng.generate(PROMPTS[1], max_new_tokens=2).stats["peak_device_bytes"] == 800
  eng.close()


def test_fp8_cache_on_a_mesh():
  """fp8 pages on (tensor, seq) = (4, 2), each page on its own seq shard: a context's pages carry the one-device
  pages' scales (each repeated with its KV head) and values, and the prefill logits match the one-device fp8
  engine's."""
  one, mesh = engine(cache_dtype="float8_e4m3fn"), engine(4, 2, cache_dtype="float8_e4m3fn")

  def pages(eng):
    with eng.prefill(PROMPTS[0]) as ctx:
      table = ctx.pages()
      c = eng.cache
      ks, vs = (np.asarray(s)[:, table] for s in (c.k_scale, c.v_scale))                # [L, n, K]
      k, v = (np.asarray(x)[:, table].astype(np.float32) * s[:, :, None, :, None]
              for x, s in ((c.k, ks), (c.v, vs)))                                       # [L, n, Z, K, H]
    return ks, vs, k, v

  got, want = pages(mesh), pages(one)
  np.testing.assert_array_equal(got[0], np.repeat(want[0], 2, axis=2))
  np.testing.assert_array_equal(got[1], np.repeat(want[1], 2, axis=2))
  for g, w in zip(got[2:], want[2:]):
    np.testing.assert_allclose(g, np.repeat(w, 2, axis=3), rtol=2 ** -3, atol=1e-6)
  assert rel(prefill(mesh, PROMPTS[0])[0], prefill(one, PROMPTS[0])[0]) <= 1e-3


@pytest.mark.parametrize("tensor,seq,sp_mode,cache", [(1, 4, "ring", "auto"), (2, 2, "ring-plain", "auto"),
                                                      (1, 4, "ring", "float8_e4m3fn")])
def test_mesh_fast_path_matches_one_device(monkeypatch, tensor, seq, sp_mode, cache):
  """The cuDNN backend's side of the engine on a mesh: its dispatch (paged_case: padding-only calls for a prefix
  read by zigzag-gathered rows, the split chunk, decode rows) under shard_map, with a jnp model of cuDNN's masks
  in place of the library (the GPU runs the library: tests/test_gpu_engine.py). bf16, as cuDNN takes it; the
  oracle is the same backend on one device: prompts of several chunks, so later chunks read a sharded prefix
  (fp8: dequantized and read 16 keys at a time, so a shard's prefix takes several blocks; the mesh's decode steps
  write their pages through the page-write kernel, interpreted, each shard its own, where the oracle takes XLA's
  write)."""
  from lcjax.ops import backends
  from lcjax.ops.cudnn import backend as cudnn
  monkeypatch.setitem(backends._FACTORIES, "cudnn", lambda: cudnn.CudnnBackend(emulate=True, fp8_block_tokens=16))
  run = RUN.replace(dtype="bfloat16", attention="cudnn", cache_dtype=cache)
  want = _fast_path_oracle(run)
  page_write = "pallas-interpret" if cache == "float8_e4m3fn" else "auto"
  eng = Engine(CFG, want["params"], run=run.replace(tensor=tensor, seq=seq, sp_mode=sp_mode, page_write=page_write))
  assert eng.attention.name == "cudnn" and eng.attention.emulate and eng.page_write == page_write.replace("auto", "xla")
  assert rel(eng.logits([PROMPTS[0][:37], PROMPTS[2]]), want["logits"]) <= 2e-2
  assert rel(prefill(eng, PROMPTS[0])[0], want["prefill"]) <= 2e-2
  got = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=8)]
  assert all(g[:n] == w[:n] for g, w, n in zip(got, want["tokens"], want["decided"])), (got, want["tokens"])


_FAST_PATH_ORACLES: dict = {}


def _fast_path_oracle(run: RunConfig) -> dict:
  """The one-device cuDNN-emulating engine's weights (random, seed 1; the mesh engines are handed them), logits,
  prefill logits and tokens for `run`: computed once per run config (the two auto-cache cases share one), by the
  first case that needs it, under that case's monkeypatch."""
  if run not in _FAST_PATH_ORACLES:
    one = Engine.random(CFG, run=run, seed=1)
    assert one.attention.name == "cudnn" and one.attention.emulate
    tokens = [r.token_ids for r in one.generate(PROMPTS, max_new_tokens=8)]
    _FAST_PATH_ORACLES[run] = dict(
        params=one.params, logits=one.logits([PROMPTS[0][:37], PROMPTS[2]]), prefill=prefill(one, PROMPTS[0])[0],
        tokens=tokens, decided=_decided(PROMPTS, tokens, 4))
  return _FAST_PATH_ORACLES[run]


def _decided(prompts, tokens, most: int, margin: float = 0.05) -> list[int]:
  """Per prompt, how many leading greedy `tokens` (at most `most`) a bf16 run decides: each up to the first whose
  top-2 logit margin in the float32 full forward (`engine()`: reference attention, the same seed) is under
  `margin` (bf16's ~1e-2 relative error can pick either of a tie). One forward call: each row is its prompt and
  tokens, padded at the end (a causal forward, so the padding reaches no earlier position)."""
  rows = [p + t[:most] for p, t in zip(prompts, tokens)]
  width = max(map(len, rows))
  logits = engine().logits([r + [0] * (width - len(r)) for r in rows])
  decided = []
  for p, row in zip(prompts, logits):
    top2 = np.sort(row[len(p) - 1:len(p) - 1 + most], axis=-1)[:, -2:]
    close = np.nonzero(top2[:, 1] - top2[:, 0] < margin)[0]
    decided.append(int(close[0]) if close.size else most)
  return decided


KV4 = ModelConfig("tiny-kv4", vocab_size=128, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                  ffn_dim=64, max_position=512, bos_id=None, eos_ids=())


@pytest.mark.parametrize("cfg,tensor,seq", [(CFG, 1, 2), (KV4, 2, 2)], ids=["gqa8-1x2", "kv4-2x2"])
def test_ulysses_equals_ring_equals_one_device(cfg, tensor, seq):
  base = engine(cfg=cfg)
  uly, ring = engine(tensor, seq, cfg=cfg, sp_mode="ulysses"), engine(tensor, seq, cfg=cfg)
  plain = engine(tensor, seq, cfg=cfg, sp_mode="ring-plain")     # contiguous blocks: the zigzag's baseline
  want_logits = base.logits([PROMPTS[0]])
  want_prefill = prefill(base, PROMPTS[0])[0]
  for eng in (uly, ring, plain):
    assert rel(eng.logits([PROMPTS[0]]), want_logits) <= 1e-4
    assert rel(prefill(eng, PROMPTS[0])[0], want_prefill) <= 1e-4
  assert uly.generate(PROMPTS[0], max_new_tokens=32).token_ids == base.generate(PROMPTS[0],
                                                                                max_new_tokens=32).token_ids


def test_ring_plain_keeps_natural_order(monkeypatch):
  """sp_mode=ring-plain lays tokens out in contiguous blocks: the zigzag permutation is never built (the
  equality with one device above holds for any layout, so it cannot tell the two apart)."""
  import lcjax.model.llama as llama

  def no_zigzag(*a, **k):
    raise AssertionError("ring-plain built a zigzag layout")
  monkeypatch.setattr(llama, "zigzag_order", no_zigzag)
  eng = Engine.random(CFG, run=RUN.replace(seq=2, sp_mode="ring-plain"), seed=1)   # fresh: traced here
  assert rel(prefill(eng, PROMPTS[0])[0], prefill(engine(), PROMPTS[0])[0]) <= 1e-4
  with pytest.raises(AssertionError, match="zigzag layout"):
    Engine.random(CFG, run=RUN.replace(seq=2), seed=1).logits([PROMPTS[0]])


@pytest.mark.parametrize("kw,match", [
    (dict(tensor=3), "n_heads=8 is not divisible by tensor=3"),
    (dict(tensor=4, seq=4), r"seq=4 x tensor=4 needs 16 devices but only 8"),
    (dict(tensor=2, seq=2, sp_mode="ulysses"), r"Ulysses needs .* n_heads=4 n_kv_heads=1 seq=2"),
    (dict(seq=4, sp_mode="ulysses"), r"Ulysses needs .* n_heads=8 n_kv_heads=2 seq=4"),
])
def test_mesh_errors_name_the_numbers(kw, match):
  with pytest.raises((ConfigError, ValueError), match=match):
    Engine.random(CFG, run=RUN.replace(**kw))


def test_request_too_long_for_a_seq_shard():
  eng = Engine.random(CFG, run=RUN.replace(seq=4, num_pages=4 * 5, max_context=512), seed=1)
  with pytest.raises(ValueError, match=r"needs 20 pages \(80 tokens\), 5 of them on seq shard 0, but each of the "
                     r"4 seq shards has only 4 pages"):
    eng.generate(list(range(70)), max_new_tokens=10)
  assert len(eng.generate(list(range(60)), max_new_tokens=4).token_ids) == 4    # 16 pages: 4 per shard


# -- the real SmolLM2-135M (9 heads, 3 KV heads: tensor must divide 9) -------------------------------------------

@pytest.fixture(scope="module")
def smollm2_ckpt(request, tmp_path_factory):
  # The run's one conversion of the bundled GGUF (tests/conftest.py), with the converter's default row slabs: the
  # embedding's 128-row parts do not split over tensor=3, so this also checks that such parts are read replicated
  # and placed into the sharded array.
  try:
    full = request.getfixturevalue("smollm2_checkpoint")
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return _first_layers(full, str(tmp_path_factory.mktemp("smollm2") / f"ckpt-{SMOL_LAYERS}"), SMOL_LAYERS)


def _first_layers(src: str, dst: str, n: int) -> str:
  """A checkpoint of src's first n layers (its real weights, embedding, norm and tokenizer): the stored items of
  layers < n hard-linked, the config and manifest rewritten with n layers."""
  import json
  import os
  import shutil
  from lcjax.checkpoint.layout import CONFIG_FILE, MANIFEST_FILE
  shutil.copytree(src, dst, copy_function=os.link, ignore=lambda d, names: [
      x for x in names if len(x) == 5 and x.isdigit() and int(x) >= n] + [CONFIG_FILE, MANIFEST_FILE])
  config, manifest = (json.load(open(os.path.join(src, f))) for f in (CONFIG_FILE, MANIFEST_FILE))
  config["n_layers"] = n
  for t in manifest["tensors"].values():
    if t["layers"]:
      t["layers"], t["shape"][0] = n, n
  for f, d in ((CONFIG_FILE, config), (MANIFEST_FILE, manifest)):
    with open(os.path.join(dst, f), "w") as out:
      json.dump(d, out)
  return dst


# The sharding of SmolLM2's 9 query and 3 KV heads is the same in every layer: 2 of its 30 layers are checked (a
# stacked layer axis of more than one, the second layer reading the first's output; each layer took ~3.5 s of the
# test's 34 s with 4, its programs compiled with XLA's optimizations).
SMOL_LAYERS = 2
# Chunks of 16: the prompt's 35 tokens are three chunks (16, 16, and 3 padded to 16) of ONE compiled prefill shape
# per engine (chunks of 32 would be two shapes, 32 and 16: a second optimized compilation of the model).
SMOL_RUN = RunConfig(dtype="float32", page_size=16, prefill_chunk=16, max_context=256, max_batch=1,
                     decode_steps=32, attention="reference")
SMOL_PROMPT = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived a "
               "small robot who loved to read books about the ocean and")


def _generate_optimized(eng, ids):
  """Greedy tokens of a 32-step decode loop compiled with XLA's optimizations on (its 32 steps over the real
  49,152-token vocabulary run 3-6x longer unoptimized); the prefill chunks it runs first are the ones prefill()
  compiled (JAX's jit cache does not key on the optimization flag)."""
  with optimized_xla():
    return eng.generate(ids, max_new_tokens=32).token_ids


@pytest.mark.slow
def test_smollm2_on_meshes_matches_one_device(smollm2_ckpt):
  base = Engine.load(smollm2_ckpt, run=SMOL_RUN)
  assert base.cfg.n_layers == SMOL_LAYERS and (base.cfg.n_heads, base.cfg.n_kv_heads) == (9, 3)
  ids = base.encode(SMOL_PROMPT)
  assert len(ids) > 2 * SMOL_RUN.prefill_chunk       # three prefill chunks: the later ones read a cached prefix
  want_logits, want_prefill = base.logits([ids]), prefill(base, ids)[0]
  want = _generate_optimized(base, ids)
  for tensor, seq in [(3, 2), (1, 8)]:
    eng = Engine.load(smollm2_ckpt, run=SMOL_RUN, tensor=tensor, seq=seq)
    assert eng.kv_rep == 1 and eng.params["layers"]["attn"]["wqkv"].get_value().sharding.spec[2] == "tensor"
    assert rel(eng.logits([ids]), want_logits) <= 1e-4
    assert rel(prefill(eng, ids)[0], want_prefill) <= 1e-4
    assert _generate_optimized(eng, ids) == want, (tensor, seq)
