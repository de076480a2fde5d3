#!/bin/bash
# 2x H200 call K (session 3; the nvidia-h200-x2 kind was lent): the sharded engine on two real GPUs against one GPU
# (tests/test_gpu_engine.py::test_mesh_engine_matches_one_gpu: tensor=2, seq=2 zigzag, seq=2 plain; cuDNN and
# Pallas), then tools/bench_multigpu.py on the Llama-3.1-70B shape with 8 of its 80 layers: meshes 2x1 and 1x2 at
# 128K, and ring-prefill scaling 1 -> 2 GPUs at 64K tokens per GPU in zigzag and plain order.
export PYTHONUNBUFFERED=1
mkdir -p $OUT/k
nvidia-smi topo -m > $OUT/k/topo.txt 2>&1
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_gpu_engine.py -k mesh \
  > $OUT/k/gpu-mesh-tests.txt 2>&1; tail -4 $OUT/k/gpu-mesh-tests.txt
timeout 300 python3 tools/bench_multigpu.py --preset=llama3.1-70b --layers=8 --meshes=2x1,1x2 --contexts=131072 \
  --decode_batches=1 --scaling_tokens_per_gpu=65536 --scaling_gpus=1,2 --scaling_orders=zigzag,plain \
  --time_budget_s=290 --out=$OUT/k --name=2xh200-l70b-8layers 2>&1 | grep -v "^[WI][0-9]" | tail -14
cd $OUT && tar czf call-k.tgz k && rm -rf k
