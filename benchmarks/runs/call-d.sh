#!/bin/bash
# H200 call D: GPU tests of the fp8 chunk path, exactness vs a float32 oracle, a decode profile.
# Run from the repo root on the device: bash benchmarks/runs/call-d.sh  (writes under $OUT)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_gpu_engine.py \
    "tests/test_kernels.py::test_paged_gpu" > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
timeout 320 python3 tools/check_exact.py --preset=llama3-8b --contexts=4096,32768,131072 \
  --caches=bfloat16,float8_e4m3fn --out=$OUT --name=exact-llama3-8b-h200 2>&1 | grep -v "^[WI][0-9]" | tail -14
mkdir -p /tmp/p
timeout 90 python3 tools/profile_step.py --context=32768 --steps=16 --dump_hlo --out=/tmp/p --name=decode-default \
  2>&1 | grep -v "^[WI][0-9]" | tee $OUT/profile.txt | tail -40
(cd /tmp/p && tar czf $OUT/profile.tgz *.json hlo)
