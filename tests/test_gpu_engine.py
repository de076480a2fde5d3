"""The engine on the GPU: every fast attention backend gives the reference backend's results end to end, and the
stats name the kernels that ran.

Run through the device tool: `python3 -m pytest -m gpu tests/test_gpu_engine.py`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import jax
import numpy as np
import pytest

from lcjax.config import RunConfig, preset
from lcjax.engine.engine import Engine
from lcjax.ops.hardware import jax_at_least

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]

# Llama-3-8B's attention shape (32 query heads, 8 kv heads, head dim 128) with two layers and a small vocab (the
# prompts are token ids: no BOS, no EOS).
CFG = dataclasses.replace(preset("llama3-8b"), name="l3-2layer", n_layers=2, vocab_size=4096, bos_id=None,
                          eos_ids=())


def _engine(attention, dtype="bfloat16", cache_dtype="auto", **run):
  run = RunConfig(dtype=dtype, page_size=64, max_context=4096, max_batch=2, prefill_chunk=1024,
                  decode_steps=16, attention=attention, cache_dtype=cache_dtype, **run)
  return Engine.random(CFG, run=run, seed=1)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in (2500, 700)]


# The kernels' tolerance against another backend in bf16: logits within 2e-2 of their norm, and a greedy token's
# logit within 2e-2 of the logits' largest magnitude of the best one (bf16 and each kernel's own rounding and
# summation order make near-ties go either way).
TOL = 2e-2


def _forced_logits(eng, prompt, out, *, paged: bool) -> np.ndarray:
  """eng's logits [len(out), V] of the positions that sampled each token of `out` after `prompt`, teacher-forced:
  one uncached forward over prompt + out, or (paged) the prompt logits of prompt + out[:i] for each i, read through
  eng's paged cache (an fp8 cache: what its decode reads)."""
  if not paged:
    return eng.logits([prompt + out[:-1]])[0, len(prompt) - 1:]
  return np.stack([eng.prompt_logits(prompt + out[:i]) for i in range(len(out))])


def _skip_unless_served(linear_kernel="auto", page_write="auto"):
  """Skip where a kernel asked for by name cannot run here (the Mosaic GPU GEMV and page writer: Hopper; the page
  writer: JAX 0.11+), rather than fail on the engine's refusal."""
  from lcjax.ops import kernels
  reasons = [kernels.gemv_kernel(linear_kernel).why_not({}) if linear_kernel not in ("auto", "xla") else None,
             kernels.page_writer(page_write).why_not(64, 128) if page_write not in ("auto", "xla") else None]
  if any(reasons):
    pytest.skip("; ".join(r for r in reasons if r))


def _assert_greedy_under(logits, out):
  """Every token of `out` is a greedy choice of its row of logits [len(out), V], up to TOL near-ties."""
  logits = np.asarray(logits, np.float64)
  for i, (t, row) in enumerate(zip(out, logits)):
    gap, scale = row.max() - row[t], np.abs(row).max()
    assert gap <= TOL * scale, (i, out, int(np.argmax(row)), gap, scale)


# What lcjax.ops.attention logs when a fast backend runs a call through the jnp reference (traced or at run time).
REFERENCE_RAN = ("runs this call through the jnp reference", "ran a call through the jnp reference")


@contextlib.contextmanager
def _no_reference_branch():
  """Fail if a call inside runs the jnp reference where a fast backend should run a kernel: the warnings that
  lcjax.ops.attention logs for it, each once per process, are let through again and collected for the block."""
  from lcjax.ops import attention as ops_attention
  seen, handler = [], logging.Handler()
  handler.emit = lambda record: seen.append(record.getMessage())
  saved = set(ops_attention._announced)
  ops_attention._announced.clear()
  logging.getLogger().addHandler(handler)
  try:
    yield
    jax.effects_barrier()                        # run-time announcements are debug callbacks
  finally:
    logging.getLogger().removeHandler(handler)
    ops_attention._announced.update(saved)
  ran = [m for m in seen if any(r in m for r in REFERENCE_RAN)]
  assert not ran, ran


def _assert_agree(want, got, prompts, *, kernels, uncached=True, new_tokens=16):
  """`got` gives `want`'s results: last logits of an uncached forward (attend only) and of a chunked prefill
  against the paged prefix (attend + paged) within TOL of their norm, and every token of got's greedy generations
  (all `new_tokens` of them) a greedy choice of want's logits at its position, teacher-forced through want's
  paged cache (uncached=False: an fp8 cache, which the uncached forward does not quantize) or its uncached forward.
  `kernels`: (attention, decode kernel) that got's stats must name. No call of got's runs the jnp reference."""
  from tests.test_engine import _prefill_logits
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(a)
  for p in prompts:
    if uncached:
      w = want.logits([p[:1024]])[0, -1]
      with _no_reference_branch():
        assert rel(w, got.logits([p[:1024]])[0, -1]) < TOL
    w = _prefill_logits(want, p)
    with _no_reference_branch():
      assert rel(w, _prefill_logits(got, p)) < TOL
  with _no_reference_branch():
    results = got.generate(prompts, max_new_tokens=new_tokens)
  for p, r in zip(prompts, results):
    assert (r.stats["attention"], r.stats["decode_kernel"]) == kernels, r.stats
    assert len(r.token_ids) == new_tokens
    _assert_greedy_under(_forced_logits(want, p, r.token_ids, paged=not uncached), r.token_ids)


# The decode kernel each backend runs over bf16 pages (Engine.decode_kernel).
BF16_DECODE = {"cudnn": "cudnn", "pallas": "mosaic"}


@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
def test_backend_engine_matches_reference(backend, prompts):
  fast = _engine(backend)
  assert fast.attention.name == backend
  _assert_agree(_engine("reference"), fast, prompts, kernels=(backend, BF16_DECODE[backend]), new_tokens=24)


def test_bf16_generation_is_batch_invariant_up_to_ties(prompts):
  """Each prompt generates beside another what it generates alone, up to a tie at bf16's resolution: the decode
  kernels' split count and XLA's matmul algorithms depend on the batch, so the sums run in another order, and
  bf16 logits (as HF's) tie often on this random-weight model. Where the two runs part, the two tokens' logits in
  the alone run are within two bf16 steps of the logit scale."""
  eng = _engine("auto")
  assert eng.attention.name in BF16_DECODE
  results = eng.generate(prompts, max_new_tokens=16)
  assert all(r.stats["decode_kernel"] == BF16_DECODE[eng.attention.name] for r in results)
  together = [r.token_ids for r in results]
  for p, both in zip(prompts, together):
    alone = eng.generate(p, max_new_tokens=16).token_ids
    parted = [i for i, (a, b) in enumerate(zip(alone, both)) if a != b]
    if parted:
      d = parted[0]
      logits = np.asarray(eng.logits([p + alone[:d]])[0, -1], np.float64)
      gap, scale = abs(logits[alone[d]] - logits[both[d]]), np.abs(logits).max()
      assert gap <= 2 ** -6 * scale, (d, alone, both, gap, scale)


@pytest.mark.parametrize("prefill_kernel", ["mosaic", "cudnn"])
def test_paged_flash_prefill_matches_reference(prefill_kernel, prompts):
  """Each reader of the chunks' cached prefix on the pallas backend, asked for by name, == the reference backend,
  and the stats name it: "mosaic" (mgpu_flash.flash_attention_paged, in place; also `auto`'s on Hopper over bf16
  pages) and "cudnn" (cuDNN's paged kernel)."""
  from lcjax.ops import hardware
  if hardware.on_sm90():
    pytest.skip(hardware.on_sm90())
  fast = _engine("pallas", prefill_kernel=prefill_kernel)
  assert fast.kernels["prefill_kernel"] == prefill_kernel
  _assert_agree(_engine("reference"), fast, prompts, kernels=("pallas", BF16_DECODE["pallas"]))
  assert fast.generate(prompts[:1], max_new_tokens=2)[0].stats["prefill_kernel"] == prefill_kernel


@pytest.mark.parametrize("cache_dtype", ["auto", "float8_e4m3fn"])
def test_mosaic_decode_matches_reference(cache_dtype, prompts):
  """Hopper's default decode (decode_kernel "auto": the Mosaic GPU decode kernel and its Mosaic GPU split combine,
  bf16 or fp8 pages) == the reference backend on the same cache dtype, and the stats name it."""
  from lcjax.ops import hardware
  if hardware.on_sm90():
    pytest.skip(hardware.on_sm90())
  fast = _engine("pallas", cache_dtype=cache_dtype)
  assert fast.decode_kernel == "mosaic"
  _assert_agree(_engine("reference", cache_dtype=cache_dtype), fast, prompts, kernels=("pallas", "mosaic"),
                uncached=cache_dtype == "auto")


def test_fp8_cache_through_cudnn_matches_reference(prompts):
  """An fp8 cache through the cudnn backend (chunks: cuDNN over dequantized pages) == the same cache through the
  reference backend. cuDNN has no fp8 decode: the cudnn backend's decode rows over fp8 pages run the Triton fp8
  decode kernel (lcjax.ops.kernels.TritonFp8Decode, the decode of GPUs without the Mosaic GPU kernels), and its
  stats say so. (The pallas backend over fp8 pages: test_mosaic_decode_matches_reference.)"""
  fast = _engine("cudnn", cache_dtype="float8_e4m3fn")
  assert fast.attention.name == "cudnn" and fast.fp8_cache
  _assert_agree(_engine("reference", cache_dtype="float8_e4m3fn"), fast, prompts, kernels=("cudnn", "triton"),
                uncached=False)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tensor,seq,sp_mode", [(2, 1, "ring"), (1, 2, "ring"), (1, 2, "ring-plain")])
@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
def test_mesh_engine_matches_one_gpu(backend, tensor, seq, sp_mode, prompts):
  """Two GPUs (tensor-parallel heads, or the ring over a seq-sharded cache) == one GPU, same fast backend (bf16:
  the kernels take no float32): uncached forward, chunked paged prefill (later chunks read a prefix held by both
  seq shards), greedy tokens. The fake-CPU mesh tests run the same checks in float32 with the reference backend."""
  one = _engine(backend)
  many = Engine.random(CFG, run=one.run.replace(tensor=tensor, seq=seq, sp_mode=sp_mode), seed=1)
  assert many.attention.name == backend
  _assert_agree(one, many, prompts, kernels=(backend, BF16_DECODE[backend]))


def test_context_cache_matches_a_cold_prefill(prompts, tmp_path):
  """The prefix cache, a pinned context and a context restored from host memory and from disk give what the
  uncached forward gives, through the fast backend: the prompt's logits through cached pages within TOL of the
  uncached forward's (and of a cold prefill's), every generated token greedy under the uncached forward's logits
  teacher-forced; and nothing is left held."""
  from tests.test_engine import _prefill_logits
  doc, q = prompts[0][:2000], prompts[1][:300]
  eng = _engine("auto")
  kernels = (eng.attention.name, BF16_DECODE.get(eng.attention.name))
  cold = Engine.random(CFG, run=eng.run.replace(prefix_cache=False), seed=1)
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(a)
  full = eng.logits([doc + q])[0, -1]
  eng.generate(doc + prompts[1][300:400], max_new_tokens=2)                 # caches the document's pages
  auto = eng.generate(doc + q, max_new_tokens=8)
  assert auto.stats["cached_tokens"] == len(doc) // 64 * 64
  assert (auto.stats["attention"], auto.stats["decode_kernel"]) == kernels, auto.stats
  cached = _prefill_logits(eng, doc + q)
  assert rel(full, cached) < TOL and rel(_prefill_logits(cold, doc + q), cached) < TOL
  ctx = eng.prefill(doc)
  assert rel(full, eng.prompt_logits(q, context=ctx)) < TOL
  got = [eng.generate(q, max_new_tokens=8, context=ctx).token_ids]
  ctx.offload()
  eng.prefix_cache.clear()
  ctx.restore()
  got.append(eng.generate(q, max_new_tokens=8, context=ctx).token_ids)
  ctx.save(tmp_path / "ctx")
  ctx.close()
  eng.prefix_cache.clear()
  with eng.load_context(tmp_path / "ctx") as ctx:
    got.append(eng.generate(q, max_new_tokens=8, context=ctx).token_ids)
  for out in (auto.token_ids, got[0]):
    _assert_greedy_under(_forced_logits(eng, doc + q, out, paged=False), out)
  assert got[1] == got[0] == got[2]                # the same pages, moved: bit-identical
  assert eng.pool.pages_used == 0 and not eng.scheduler.pinned


# Prompts that repeat themselves: greedy decoding of a random-weight model falls into loops that the prompt-lookup
# drafts then predict, so verify steps accept drafts.
SPEC_PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18] * 40, list(range(100, 160)) * 6]


# Verify-step prompts: the first two of SPEC_PROMPTS, then two that the fp8-weight model falls into loops after
# (the prompts above give it none in 32 tokens).
VERIFY_PROMPTS = SPEC_PROMPTS + [[11, 12, 13, 14] * 80, [5, 6, 7] * 100]


@pytest.mark.parametrize("cache_dtype, weight_dtype, linear_kernel", [
    ("auto", "auto", "auto"), ("float8_e4m3fn", "float8_e4m3fn", "auto"),
    ("float8_e4m3fn", "float8_e4m3fn", "mosaic")])
def test_speculative_decoding_gives_plain_greedy_tokens(cache_dtype, weight_dtype, linear_kernel):
  """Prompt-lookup speculation on the GPU's default kernels (the verify rows through the paged decode kernel and,
  with fp8 weights, the fp8 GEMV with k + 1 rows a sequence, 40 rows a step; "mosaic" by name too): every token it
  generates is a greedy choice of the plain engine's logits teacher-forced through its paged cache (up to TOL
  near-ties), drafts were accepted, and the compiled decode loop copies no KV pool (pools larger than any weight:
  such a copy is a pool's)."""
  from tests.test_engine import pool_copies_in_decode_loop
  _skip_unless_served(linear_kernel)
  run = RunConfig(dtype="bfloat16", page_size=64, max_context=8192, max_batch=8, prefill_chunk=1024,
                  decode_steps=16, cache_dtype=cache_dtype, weight_dtype=weight_dtype, linear_kernel=linear_kernel)
  cfg = dataclasses.replace(CFG, ffn_dim=1024)       # every weight below one layer's pool of 64K tokens
  plain = Engine.random(cfg, run=run, seed=1)
  spec = Engine.random(cfg, run=run.replace(draft="prompt", draft_ngram=2, draft_tokens=4), seed=1)
  try:
    assert pool_copies_in_decode_loop(spec) == []
    results = spec.generate(VERIFY_PROMPTS, max_new_tokens=32)
    assert sum(r.stats["drafts_accepted"] for r in results) > 0, [r.stats for r in results]
    for p, r in zip(VERIFY_PROMPTS, results):
      assert len(r.token_ids) == 32 and r.stats["draft"] == "prompt", (r.finish_reason, len(r.token_ids))
      _assert_greedy_under(_forced_logits(plain, p, r.token_ids, paged=True), r.token_ids)
  finally:
    spec.close()
    plain.close()


FP8_CFG = dataclasses.replace(CFG, ffn_dim=1024)
FP8_RUN = RunConfig(dtype="bfloat16", page_size=64, max_context=8192, max_batch=8, prefill_chunk=1024,
                    decode_steps=16, cache_dtype="float8_e4m3fn", weight_dtype="float8_e4m3fn")


@pytest.fixture(scope="module")
def fp8_xla_engine():
  """fp8 weights + fp8 KV, a 1,024-wide MLP, max_batch 8, on XLA's products and XLA's page writes: the oracle of
  the GPU kernels in `test_fp8_weight_and_cache_kernels_match_xla`."""
  eng = Engine.random(FP8_CFG, run=FP8_RUN.replace(linear_kernel="xla", page_write="xla"), seed=1)
  yield eng
  eng.close()


@pytest.mark.parametrize("linear_kernel, page_write", [
    ("auto", "auto"), ("mosaic", "pallas"), ("mosaic", "xla"), ("mosaic", "mosaic"), ("pallas", "pallas"),
    ("xla", "pallas"), ("xla", "xla")])
def test_fp8_weight_and_cache_kernels_match_xla(linear_kernel, page_write, fp8_xla_engine):
  """fp8 weights + fp8 KV with a 1,024-wide MLP and max_batch 8, through each GPU GEMV kernel and page writer: a
  320-token prompt (5 whole pages), then the prompt plus one token (a 1-token chunk over the 5 cached pages), then a
  prompt ending inside a page and its 1-token follow-up, and greedy decode == the same model on XLA's products and
  page writes (its prefix cache cleared first, so that both engines read the same prompts from the cache): finite
  logits within TOL of its norm, every token a greedy choice of XLA's teacher-forced logits. Which case fails says
  which kernel breaks; (xla, xla) runs the oracle's kernels, so only its finiteness checks can fail it (the attention
  kernels every case shares)."""
  from tests.test_engine import _prefill_logits
  _skip_unless_served(linear_kernel, page_write)
  ref = fp8_xla_engine
  ref.prefix_cache.clear()
  eng = Engine.random(FP8_CFG, run=FP8_RUN.replace(linear_kernel=linear_kernel, page_write=page_write), seed=1)
  try:
    p = SPEC_PROMPTS[0]
    for prompt in (p, p + [7], p[:-5], p[:-5] + [7]):
      want, got = (_prefill_logits(e, prompt) for e in (ref, eng))
      assert np.isfinite(got).all(), (len(prompt), int(np.isnan(got).sum()))
      assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL, len(prompt)
    r = eng.generate(p, max_new_tokens=8)
    assert r.finish_reason == "length", r.finish_reason
    _assert_greedy_under(_forced_logits(ref, p, r.token_ids, paged=True), r.token_ids)
  finally:
    eng.close()


def test_fp8_sharded_path_on_a_one_device_mesh(monkeypatch):
  """The mesh code path on one GPU: with Llama's mesh rule replaced by the identity, a mesh of one device runs every
  fp8 product through the GEMV kernel inside shard_map (`Llama._gemv_mesh`) and attention through `_attend_mesh`.
  Oracle: the single-device path of the same weights. Prompt logits and the teacher-forced logits of the greedy
  continuation within TOL, greedy tokens equal."""
  from lcjax.model import llama
  from tests.test_engine import _prefill_logits
  plain = Engine.random(FP8_CFG, run=FP8_RUN, seed=1)
  calls = {"_gemv_mesh": 0, "_attend_mesh": 0}

  def counted(name):
    method = getattr(llama.Llama, name)

    def call(self, *a, **kw):
      calls[name] += 1
      return method(self, *a, **kw)
    return call

  monkeypatch.setattr(llama, "model_mesh", lambda mesh: mesh)
  for name in calls:
    monkeypatch.setattr(llama.Llama, name, counted(name))
  sharded = Engine(FP8_CFG, plain.params, run=FP8_RUN)
  try:
    p = SPEC_PROMPTS[1]
    want, got = (_prefill_logits(e, p) for e in (plain, sharded))       # 360 rows: XLA's fp8 x fp8 products
    assert np.isfinite(got).all() and np.linalg.norm(got - want) / np.linalg.norm(want) < TOL
    assert calls["_attend_mesh"] and not calls["_gemv_mesh"], calls
    want, got = (e.generate(p, max_new_tokens=16).token_ids for e in (plain, sharded))
    assert calls["_gemv_mesh"], "the sharded engine's decode steps never ran _gemv_mesh"
    assert got == want
    forced = [_forced_logits(e, p, want, paged=True) for e in (plain, sharded)]
    assert np.linalg.norm(forced[1] - forced[0]) / np.linalg.norm(forced[0]) < TOL
  finally:
    sharded.close()
    plain.close()


def test_mosaic_gemv_calls_of_a_question_checked_on_the_host(monkeypatch):
  """Every Mosaic GEMV call of a 1-token question over 5 cached pages (a 16-row chunk), its operands and float32
  result sent to the host from inside the compiled layer scan and checked there against the float64 product of the
  same operands: finite and within 1e-5 of the product's scale, and the logits finite: the kernel multiplies the
  bf16 x the host sees (its split reads x through lcjax.ops.precision.widen)."""
  from jax import lax
  from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
  from tests.test_fp8_gemv import _numpy_product
  seen, kernel = [], mgpu_gemv.gemv_stacked_f32

  def checked(x, w8, scale, layer, spec, *, tuning=mgpu_gemv.MgpuGemvTuning()):
    y = kernel(x, w8, scale, layer, spec, tuning=tuning)
    w_l, s_l = (lax.dynamic_index_in_dim(a, layer, keepdims=True) for a in (w8, scale))
    jax.debug.callback(lambda *a: seen.append((spec, *map(np.asarray, a))), x, w_l, s_l, layer, y)
    return y

  _skip_unless_served("mosaic")
  monkeypatch.setattr(mgpu_gemv, "gemv_stacked_f32", checked)
  eng = Engine.random(FP8_CFG, run=FP8_RUN.replace(linear_kernel="mosaic"), seed=1)
  try:
    p = SPEC_PROMPTS[0]
    eng.prompt_logits(p)
    seen.clear()
    logits = eng.prompt_logits(p + [7])
    assert len(seen) == 4 * FP8_CFG.n_layers, [c[0] for c in seen]
    for spec, x, w, s, layer, y in seen:
      want = _numpy_product(x, w, s, 0, spec)
      err = float(np.nanmax(np.abs(y - want)))
      assert np.isfinite(y).all() and err <= 1e-5 * np.abs(want).max(), (spec, int(layer), x.shape, err)
    assert np.isfinite(logits).all()
  finally:
    eng.close()


def test_page_writers_agree_in_the_engine():
  """The two page writer kernels inside the compiled decode loop (lcjax.ops.mosaic_gpu.page_write, the pools as
  mutable refs, and the Triton writer) on the same model (fp8 weights + fp8 KV, 64-token pages, head dim 128, two
  sequences decoded together): the same greedy tokens, and every page's bytes and scales equal. Both read the same
  materialized K and V, so they agree bit for bit or one of them is wrong. XLA's writer is not the oracle here:
  its program computes K in fusions of its own, so its K, and with it its tokens, may part from the kernels'
  (NOTES-attention); each writer equals XLA's on identical inputs in tests/test_fp8_page_write.py."""
  from tests.test_fp8_page_write import _bits
  _skip_unless_served(page_write="mosaic")
  _skip_unless_served(page_write="pallas")
  run = FP8_RUN.replace(linear_kernel="xla", max_batch=2)
  triton, mosaic = (Engine.random(FP8_CFG, run=run.replace(page_write=w), seed=1) for w in ("pallas", "mosaic"))
  try:
    prompts = [SPEC_PROMPTS[0][:100], SPEC_PROMPTS[1][:70]]
    a, b = (e.generate(prompts, max_new_tokens=40) for e in (triton, mosaic))
    assert (a[0].stats["page_write"], b[0].stats["page_write"]) == ("pallas", "mosaic")
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for i, (x, y) in enumerate(zip(triton.cache.parts(), mosaic.cache.parts())):
      x, y = _bits(np.asarray(x)[:, 1:]), _bits(np.asarray(y)[:, 1:])
      assert np.array_equal(x, y), f"part {i}: {int((x != y).sum())} of {x.size} bytes differ"
  finally:
    triton.close()
    mosaic.close()


TRITON_DEPRECATED = "The Pallas Triton backend is deprecated"


@pytest.mark.skipif(not jax_at_least(0, 11), reason="JAX warns of the Pallas Triton backend from 0.11 on")
@pytest.mark.parametrize("cache_dtype, weight_dtype, decode_kernel, page_write", [
    ("auto", "auto", "auto", "auto"), ("float8_e4m3fn", "float8_e4m3fn", "auto", "auto"),
    ("auto", "auto", "mosaic", "auto"), ("float8_e4m3fn", "float8_e4m3fn", "mosaic", "mosaic")])
def test_hopper_kernels_lower_no_pallas_triton_kernel(cache_dtype, weight_dtype, decode_kernel, page_write):
  """On a Hopper GPU, a bf16 model and fp8 weights + fp8 KV (prefill chunks, decode steps of two sequences, their
  page writes) lower no kernel through the deprecated Pallas Triton backend: JAX warns on each such lowering, and
  a fresh engine lowers every program it runs. The defaults and the Mosaic GPU kernels asked for by name."""
  import warnings
  from lcjax.ops import hardware
  if hardware.sm90_fp8_reason("test", "wgmma"):
    pytest.skip(hardware.sm90_fp8_reason("test", "wgmma"))
  run = RunConfig(dtype="bfloat16", page_size=64, max_context=4096, max_batch=2, prefill_chunk=1024,
                  decode_steps=16, cache_dtype=cache_dtype, weight_dtype=weight_dtype, decode_kernel=decode_kernel,
                  page_write=page_write)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    eng = Engine.random(dataclasses.replace(CFG, ffn_dim=1024), run=run, seed=1)
    try:
      res = eng.generate([SPEC_PROMPTS[0][:300], SPEC_PROMPTS[1][:70]], max_new_tokens=8)
    finally:
      eng.close()
  triton = [str(w.message)[:60] for w in seen if TRITON_DEPRECATED in str(w.message)]
  assert not triton, ({k: res[0].stats[k] for k in ("decode_kernel", "page_write", "linear")}, len(triton))
