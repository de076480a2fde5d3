#!/bin/bash
# H200 call W (session 5): the 8K-128K rows of the final code (call U's tree) again, with HF in the same call, on
# whichever machine is lent now: calls U and V ran on one machine that was ~3% slow on everything (HF prefill
# 12.0-12.3 s at 128K against 11.7 in call T), where 128K decode read 9.10-9.11 ms/token.
# Predict: 128K decode 8.95-9.1 ms/token, prefill within 3% of call T.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/w
timeout 160 python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=8192,32768,131072 \
  --decode_steps=64 --time_budget_s=150 --out=$OUT/w --name=longctx-h200-w 2>&1 | grep -v "^[WI][0-9]" | tail -8
cd $OUT && tar czf call-w.tgz w && rm -rf w
