"""Prefill time grows with length on the GPU: a chunk padded to its bucket costs no more than a chunk of the
bucket's length, for bf16 and fp8 KV, bf16 and FP8 attention, with and without a cached prefix.

Padded tokens write nothing (lcjax.cache.kv drops slot 0); when they were scattered into the null page, every
padded row of a chunk contended for the same page's elements and cost more than a real row. tests/test_kv.py pins
that mechanism on the CPU; this file times it.

Run through the device tool: `python3 -m pytest -m gpu tests/test_gpu_lengths.py`.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import pytest

from lcjax.config import RunConfig, preset
from lcjax.engine.context import Context
from lcjax.engine.engine import Engine
from lcjax.engine.scheduler import chunk_bucket

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]

# Llama-3-8B's layer shapes, four layers, a small vocab (prompts are token ids).
CFG = dataclasses.replace(preset("llama3-8b"), name="l3-4layer", n_layers=4, vocab_size=4096, max_position=16384,
                          bos_id=None, eos_ids=())
CHUNK = 4096
PREFIX = 8192                     # the cached prefix of the question rows
PADDED = 2 * CHUNK + 2049         # last chunk of 2,049 tokens in the 2,560 bucket: 511 padded rows
ALIGNED = 2 * CHUNK + 2560        # the same bucket, no padding
SLACK = 1.10                      # timing noise on a four-layer step of tens of ms


@pytest.mark.parametrize("cache_dtype,attention_dtype", [("bfloat16", "auto"), ("float8_e4m3fn", "auto"),
                                                          ("float8_e4m3fn", "float8_e4m3fn")])
def test_a_padded_chunk_costs_no_more_than_its_bucket(cache_dtype, attention_dtype):
  assert chunk_bucket(PADDED - 2 * CHUNK, CHUNK) == ALIGNED - 2 * CHUNK
  run = RunConfig(dtype="bfloat16", page_size=64, max_context=16384, max_batch=1, prefill_chunk=CHUNK,
                  cache_dtype=cache_dtype, attention_dtype=attention_dtype, prefix_cache=False)
  eng = Engine.random(CFG, run=run, seed=0)
  rng = np.random.default_rng(0)
  eng.warm_up(None, context_tokens=ALIGNED)
  eng.warm_up(None, context_tokens=PREFIX, more_buckets=(ALIGNED - PREFIX,))

  def best_of_three(call, n):
    """The shortest of three runs of call(fresh random ids of n tokens); a Context it returns is closed after."""
    times = []
    for _ in range(3):
      ids = rng.integers(0, CFG.vocab_size, n).tolist()
      t0 = time.perf_counter()
      out = call(ids)
      times.append(time.perf_counter() - t0)
      if isinstance(out, Context):
        out.close()
    return min(times)

  padded, aligned = best_of_three(eng.prefill, PADDED), best_of_three(eng.prefill, ALIGNED)
  assert padded <= SLACK * aligned, (padded, aligned)
  with eng.prefill(rng.integers(0, CFG.vocab_size, PREFIX).tolist()) as ctx:
    question = lambda ids: eng.generate(ids, context=ctx, max_new_tokens=1)    # time to the first token
    q_padded = best_of_three(question, PADDED - 2 * CHUNK)
    q_aligned = best_of_three(question, ALIGNED - 2 * CHUNK)
  assert q_padded <= SLACK * q_aligned, (q_padded, q_aligned)
