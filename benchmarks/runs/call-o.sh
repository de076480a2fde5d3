#!/bin/bash
# H200 call O (session 4). Predictions in benchmarks/NOTES-longctx.md "Session 4".
# 1. GPU engine tests at this tree (the decode loop now tests `done` once per 8 steps; the fp8 Pallas engine test
#    that call M's 220 s cut off).
# 2. 128K decode profile with the grouped loop (predict 9.72-9.94 -> ~9.6 ms: the per-token D2H stall goes).
# 3. The same with XLA's dot strength reduction off for decode (predict: wk/wv become cuBLAS GEMVs, 0.35 -> ~0.2 ms).
# 4. 1M fp8 KV, 8 of 32 layers, 16K chunks (predict: peak 25.3 GiB = W+KV+4.1 by the planner, prefill within 2% of
#    call G's 148.6 s, decode ~8 ms).
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/o
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
  "tests/test_gpu_engine.py::test_backend_engine_matches_reference" \
  "tests/test_gpu_engine.py::test_fp8_cache_matches_reference[pallas]" > $OUT/o/gpu-tests.txt 2>&1
tail -3 $OUT/o/gpu-tests.txt
timeout 75 python3 tools/profile_step.py --context=131072 --steps=16 --top=12 --out=$OUT/o \
  --name=dec-128k-grouped 2>&1 | $F | head -16
timeout 75 python3 tools/profile_step.py --context=131072 --steps=16 --top=12 --out=$OUT/o \
  --name=dec-128k-nodsr --xla_flags=--xla_gpu_enable_dot_strength_reduction=false 2>&1 | $F | head -16
rm -rf $OUT/o/trace-*
timeout 250 python3 tools/bench_longctx.py --impls=lcjax-fp8kv --layers=8 --contexts=1048576 --decode_steps=32 \
  --time_budget_s=240 --out=$OUT/o --name=longctx-h200-o-8layers 2>&1 | $F | tail -4
cd $OUT && tar czf call-o.tgz o && rm -rf o
