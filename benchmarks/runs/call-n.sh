#!/bin/bash
# 2x H200 call N (nvidia-h200-x2): PREPARED in session 3, not run yet. Call L with the paged kernel fixed
# (block_tokens) and time for every 2-GPU test: predict all 6 pass; the 70B 8-layer rows run (planned 14.4 GiB per
# GPU at 2x1, 22.9 at 1x2); ring scaling 1 -> 2 GPUs at 64K tokens per GPU near 100% (ring_hidden: true); zigzag
# faster than plain by up to ~1.3x at 2 GPUs (plain's second device does 3 of the 4 causal quarters).
export PYTHONUNBUFFERED=1
mkdir -p $OUT/n
timeout -s KILL 250 python3 tools/bench_multigpu.py --preset=llama3.1-70b --layers=8 --meshes=2x1,1x2 \
  --contexts=131072 --decode_batches=1 --scaling_tokens_per_gpu=65536 --scaling_gpus=1,2 \
  --scaling_orders=zigzag,plain --time_budget_s=230 --out=$OUT/n --name=2xh200-l70b-8layers 2>&1 \
  | grep -v "^[WI][0-9]" | tail -9
timeout -s KILL 300 python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short -rf tests/test_gpu_engine.py -k mesh \
  > $OUT/n/gpu-mesh-tests.txt 2>&1; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/n/gpu-mesh-tests.txt | tail -8
cd $OUT && tar czf call-n.tgz n && rm -rf n
