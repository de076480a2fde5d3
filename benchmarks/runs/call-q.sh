#!/bin/bash
# H200 call Q (session 4): 512K at this tree (fused projections, grouped decode loop) with HF in the same call, so
# the 512K row of the results table is the code of the 8K-256K rows (call P).
# Predict: decode 21.7 (call I) -> ~21.1 ms/token (call P's 128K gain, ~0.35 ms); prefill within noise of 143.8 s;
# peak 82.4 GiB = W+KV + 3.4.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/q
timeout 520 python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=524288 --decode_steps=32 \
  --time_budget_s=500 --out=$OUT/q --name=longctx-h200-q 2>&1 | grep -v "^[WI][0-9]" | tail -5
cd $OUT && tar czf call-q.tgz q && rm -rf q
