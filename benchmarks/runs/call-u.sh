#!/bin/bash
# H200 call U (session 5): greedy batches decode in a loop compiled without the sampler's vocabulary sort.
# Call T at 128K: 9.03 ms/token in the sweep (9.04 profile); the sampler's sort and its small kernels are ~0.09 ms
# of every token (cub radix sort x4 0.034 ms + ~20 one-off kernels), unused by greedy requests (the benches').
# 1. GPU test: the Pallas engine == the reference engine (greedy generation goes through the new loop).
# 2. 128K decode profile. Predict 9.04 -> ~8.95 ms/token (no radix sort kernels).
# 3. The 8K-128K rows with HF in the same call. Predict lcjax decode 128K ~8.95 ms (<= 9: the goal).
# 4. Exactness at 128K vs the float32 HF oracle (cut by its 170 s limit in call T; session 2, call E: max |diff| /
#    scale 2.96e-2, KL 3.7e-4, top-1 and top-10 identical). Predict within 10% of those.
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/u
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
  "tests/test_gpu_engine.py::test_backend_engine_matches_reference[pallas]" > $OUT/u/gpu-tests.txt 2>&1
tail -1 $OUT/u/gpu-tests.txt
timeout 75 python3 tools/profile_step.py --context=131072 --steps=16 --top=12 --out=$OUT/u \
  --name=dec-128k-u-greedy 2>&1 | $F | head -15
timeout 150 python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=8192,32768,131072 \
  --decode_steps=32 --time_budget_s=140 --out=$OUT/u --name=longctx-h200-u 2>&1 | $F | tail -8
timeout 270 python3 tools/check_exact.py --preset=llama3-8b --contexts=131072 --caches=bfloat16 \
  --out=$OUT/u --name=exact-llama3-8b-h200-u 2>&1 | $F | tail -8
rm -rf $OUT/u/trace-*
cd $OUT && tar czf call-u.tgz u && rm -rf u
