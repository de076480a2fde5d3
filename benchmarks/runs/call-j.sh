#!/bin/bash
# H200 call J (session 3): the 8K-256K sweep at HEAD (16K chunks, bf16 lm_head, decode compile options) with HF
# (sdpa) and the dense no-optimisation baseline in the same call; 512K is call I.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/j
timeout 450 python3 tools/bench_longctx.py --impls=lcjax,hf,dense --contexts=8192,32768,131072,262144 \
  --limits=dense:32768 --decode_steps=32 --time_budget_s=440 --out=$OUT/j --name=longctx-h200-j 2>&1 \
  | grep -v "^[WI][0-9]" | tail -14
cd $OUT && tar czf call-j.tgz j && rm -rf j
