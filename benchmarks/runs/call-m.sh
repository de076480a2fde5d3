#!/bin/bash
# H200 call M: PREPARED in session 3 (no device time left), not run yet. Run first next session.
# 1. GPU tests of what session 3 changed after its last GPU call: the Pallas paged kernel on 256-token pages
#    (block_tokens), the fp8 prefix read in blocks on the real cuDNN, the engine tests (predict: all pass).
# 2. 1M tokens, fp8 KV, 8 of 32 layers, 16K chunks (predict: peak 25.3 GiB = W+KV+4.1 by the planner; prefill
#    within 2% of call G's 148.6 s; decode ~8.1 ms, call G's 9.1 minus the float32 head).
# 3. Decode profile at 128K with every kernel kept in the JSON (the ~1.3 ms/token of small kernels itemised).
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/m
timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf "tests/test_kernels.py::test_paged_gpu" \
  "tests/test_kernels.py::test_paged_gpu_fp8_blocks" tests/test_gpu_engine.py > $OUT/m/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/m/gpu-tests.txt | tail -6
timeout 250 python3 tools/bench_longctx.py --impls=lcjax-fp8kv --layers=8 --contexts=1048576 --decode_steps=32 \
  --time_budget_s=240 --out=$OUT/m --name=longctx-h200-m-8layers 2>&1 | $F | tail -3
timeout 80 python3 tools/profile_step.py --context=131072 --steps=16 --top=30 --out=$OUT/m \
  --name=dec-128k-bf16head 2>&1 | $F | head -34
cd $OUT && tar czf call-m.tgz m && rm -rf m
