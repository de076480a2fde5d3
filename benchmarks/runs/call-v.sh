#!/bin/bash
# H200 call V (session 5, last device minutes): the 128K and 256K rows again with HF in the same call.
# Call U's machine ran ~3% slow on everything (HF prefill 12.02 vs 11.70 s in call T, the paged kernel 4.27 vs
# 4.01 ms) while its profile lost the sampler's sort kernels as predicted (8.80 ms of kernels, 4.27 of them
# attention). Predict 128K decode 8.9-9.1 ms/token depending on the machine; 256K ~12.9 ms (call P 13.2).
export PYTHONUNBUFFERED=1
mkdir -p $OUT/v
timeout 280 python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=131072,262144 \
  --decode_steps=64 --time_budget_s=270 --out=$OUT/v --name=longctx-h200-v 2>&1 | grep -v "^[WI][0-9]" | tail -6
cd $OUT && tar czf call-v.tgz v && rm -rf v
