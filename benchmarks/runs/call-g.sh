#!/bin/bash
# H200 call G: 1M tokens with an fp8 KV cache, Llama-3-8B shape with 8 of its 32 layers (a full 1M prefill runs
# ~575 s at ~530 TFLOP/s: it does not fit one 10-minute call with start-up), to validate per-layer time and memory.
export PYTHONUNBUFFERED=1
timeout 285 python3 tools/bench_longctx.py --impls=lcjax-fp8kv --layers=8 --contexts=1048576 --decode_steps=32 \
  --time_budget_s=280 --out=$OUT --name=longctx-h200-g-8layers 2>&1 | grep -v "^[WI][0-9]" | tail -5
