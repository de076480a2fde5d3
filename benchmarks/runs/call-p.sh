#!/bin/bash
# H200 call P (session 4): the fused wqkv / w_gate_up projections and the grouped decode loop, measured.
# 1. GPU engine tests: the cuDNN and Pallas engines == the reference engine with the fused projections.
# 2. The 8K-256K sweep with HF in the same call (dense: call J's rows stand; its OOM point does not move).
#    Predict: decode 128K 9.64 (call O) -> ~9.35 ms/token (wk/wv's reduce fusions, 0.33 ms, become part of one
#    cuBLAS GEMV); prefill within noise of call J (a few fewer, larger GEMMs).
# 3. The 128K decode profile (predict: no input_reduce_fusion_1/_3, one GEMV more of ~50 MB per layer).
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/p
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
  "tests/test_gpu_engine.py::test_backend_engine_matches_reference" > $OUT/p/gpu-tests.txt 2>&1
tail -2 $OUT/p/gpu-tests.txt
timeout 390 python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=8192,32768,131072,262144 \
  --decode_steps=32 --time_budget_s=330 --out=$OUT/p --name=longctx-h200-p 2>&1 | $F | tail -12
timeout 75 python3 tools/profile_step.py --context=131072 --steps=16 --top=14 --out=$OUT/p \
  --name=dec-128k-fused 2>&1 | $F | head -17
rm -rf $OUT/p/trace-*
cd $OUT && tar czf call-p.tgz p && rm -rf p
