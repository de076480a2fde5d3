#!/bin/bash
# H200 call F: Llama-3-8B shape at 1M tokens with an fp8 KV cache (lcjax-fp8kv), then the fp8 chunk unit test
# and a decode profile at 128K with the decode compile options.
export PYTHONUNBUFFERED=1
timeout 470 python3 tools/bench_longctx.py --impls=lcjax-fp8kv --contexts=1048576 --decode_steps=32 \
  --time_budget_s=460 --out=$OUT --name=longctx-h200-f 2>&1 | grep -v "^[WI][0-9]" | tail -6
timeout 55 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=line -rf "tests/test_kernels.py::test_paged_gpu" \
  -k "64" 2>&1 | tail -6
timeout 60 python3 tools/profile_step.py --context=131072 --steps=16 --top=8 --out=$OUT --name=dec-128k \
  2>&1 | grep -v "^[WI][0-9]" | head -11
