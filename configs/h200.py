"""One H200 (141 GB): bfloat16, 16K prefill chunks, the fastest measured attention backend.

Choosing max_context and max_batch: the KV cache holds max_context x max_batch tokens, and Llama-3-8B takes
128 KiB per token in bfloat16 (64 KiB with --config.cache_dtype=float8_e4m3fn) beside 15 GiB of weights. On one
H200 that is, for example,
  --config.max_context=131072  --config.max_batch=4      64 GiB of KV cache (bf16)
  --config.max_context=524288  --config.max_batch=1      64 GiB (bf16); one 512K context
  --config.max_context=1048576 --config.max_batch=1 --config.cache_dtype=float8_e4m3fn     64 GiB (fp8)
The memory plan is printed (and checked against the device) before any weights are read. max_context=0 means
the checkpoint's trained context (8K for Llama-3-8B, 128K for Llama-3.1-8B); a longer one is refused unless
--config.allow_beyond_trained_context=true (then a warning names both numbers): positions past it were never
trained, so a model needs rope scaling or fine-tuning for them to mean anything.
"""
import dataclasses

import ml_collections

from lcjax.config import RunConfig


def get_config():
  return ml_collections.ConfigDict(dataclasses.asdict(
      RunConfig(dtype="bfloat16", max_context=0, prefill_chunk=16384, decode_steps=128)))
