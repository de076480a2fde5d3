"""fp8 weights on ("seq", "tensor") meshes of 8 fake CPU devices: the GEMV kernel (in the Pallas interpreter) runs
on each device's shards (lcjax.model.llama.Llama._gemv_mesh) and must give what it gives on one device.

Oracle: the one-device engine of the same fp8 weights and the same kernel. Every call here is at most 64 rows, so
every fp8 product runs through the kernel: the uncached forward of 20 tokens and the prefill chunks of 16 (both
split over `seq`) and the decode steps (replicated over `seq`). Logits within 1e-5 of their largest (float32
activations; only the order of the sums differs), greedy tokens equal. The kernel's calls are counted with the
weight shapes they see: each device multiplies its own slices (wqkv's KV heads, wo's heads and the MLP channels
split over `tensor`).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from lcjax.config import ModelConfig, RunConfig
from lcjax.engine.engine import Engine
from lcjax.model.llama import LINEAR
from lcjax.ops.triton import gemv as triton_gemv

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")

CFG = ModelConfig("tiny-gqa8", vocab_size=128, dim=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8,
                  ffn_dim=64, max_position=512, bos_id=None, eos_ids=())
RUN = RunConfig(dtype="float32", page_size=4, prefill_chunk=16, max_context=160, max_batch=2, decode_steps=8,
                attention="reference", weight_dtype="float8_e4m3fn", linear_kernel="pallas-interpret")
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, CFG.vocab_size, n).tolist() for n in (37, 5)]
NEW = 10
_ENGINES: dict = {}


def rel(a, b):
  return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def outputs(eng: Engine) -> dict:
  return dict(logits=eng.logits([PROMPTS[0][:20]]), prompt=eng.prompt_logits(PROMPTS[0]),
              greedy=[r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=NEW)])


@pytest.fixture(scope="module")
def one():
  """The one-device engine (random fp8 weights, seed 1) and its outputs."""
  eng = Engine.random(CFG, run=RUN, seed=1)
  return eng, outputs(eng)


def local_shapes(tensor: int) -> dict[str, tuple]:
  """The K-major stacked fp8 weights [L, outs..., ins...] one device holds: D 32, 2 KV heads of 4 query heads
  (G + 2 = 6 rows each), head dim 8, F 64; KV heads, query heads and MLP channels split over `tensor`."""
  T = tensor
  return {LINEAR["layers/attn/wqkv"]: (2, 2 // T, 6, 8, 32), LINEAR["layers/attn/wo"]: (2, 32, 8 // T, 8),
          LINEAR["layers/mlp/w_gate_up"]: (2, 2, 64 // T, 32), LINEAR["layers/mlp/w_down"]: (2, 32, 64 // T)}


@pytest.mark.parametrize("tensor,seq", [(1, 2), (2, 1), (2, 2), (2, 4)])
def test_gemv_on_a_mesh_matches_one_device(monkeypatch, one, tensor, seq):
  ref, want = one
  calls, kernel = [], triton_gemv.gemv_stacked

  def counted(x, w8, scale, layer, spec, **kw):
    calls.append((spec, w8.shape, x.shape[:2]))
    return kernel(x, w8, scale, layer, spec, **kw)

  monkeypatch.setattr(triton_gemv, "gemv_stacked", counted)
  eng = Engine(CFG, ref.params, run=RUN.replace(tensor=tensor, seq=seq))      # a new engine: traced here
  _ENGINES[tensor, seq] = eng
  got = outputs(eng)
  assert rel(got["logits"], want["logits"]) <= 1e-5
  assert rel(got["prompt"], want["prompt"]) <= 1e-5
  assert got["greedy"] == want["greedy"] and all(len(t) == NEW for t in got["greedy"])
  # Each device ran the kernel on its own slices of all four weights, in every program (forward, a prompt's first
  # prefill chunk, a chunk after a cached prefix, decode).
  assert {(spec, shape) for spec, shape, _ in calls} == set(local_shapes(tensor).items())
  assert len(calls) == 4 * len(LINEAR)
  # Split calls, each device its rows: of the forward's 20 tokens padded to whole zigzag chunks (2 * seq), of a
  # prefill chunk's 16; decode steps, both sequences' one token on every device.
  assert {rows for _, _, rows in calls} == {(1, -(-20 // (2 * seq)) * 2), (1, 16 // seq), (2, 1)}
  stats = eng.generate(PROMPTS[1], max_new_tokens=2).stats
  assert stats["linear"].endswith(f"else the fp8 GEMV kernel in the Pallas interpreter on each device's shards "
                                  f"(seq={seq} x tensor={tensor})")


def test_context_saved_on_one_mesh_loads_on_another(tmp_path, one):
  """A context prefilled through the kernel on seq=2 x tensor=1 and saved, loaded on seq=2 x tensor=2: its
  continuation is the one-device engine's greedy continuation of the whole prompt."""
  ref, _ = one
  a, b = (_ENGINES.get(m) or Engine(CFG, ref.params, run=RUN.replace(tensor=m[0], seq=m[1]))
          for m in ((1, 2), (2, 2)))
  doc, question = PROMPTS[0], PROMPTS[1]
  with a.prefill(doc) as ctx:
    ctx.save(tmp_path / "doc")
  with b.load_context(tmp_path / "doc") as ctx:
    got = b.generate(question, max_new_tokens=NEW, context=ctx).token_ids
  assert got == ref.generate(doc + question, max_new_tokens=NEW).token_ids
