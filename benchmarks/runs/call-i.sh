#!/bin/bash
# H200 call I (session 3): Llama-3-8B shape at 512K tokens, bf16 KV, 16K prefill chunks, after the bf16 lm_head
# (decode goal <= 22 ms/token, peak goal <= weights + KV + 4 GiB), HF transformers (sdpa) in the same call.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/i
timeout 570 python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=524288 --decode_steps=32 \
  --time_budget_s=560 --out=$OUT/i --name=longctx-h200-i 2>&1 | grep -v "^[WI][0-9]" | tail -4
python3 -c "import json
for r in json.load(open('$OUT/i/longctx-h200-i.json'))['rows']: print({k: (round(v,3) if isinstance(v,float) else v) for k,v in r.items()})"
cd $OUT && tar czf call-i.tgz i && rm -rf i
