#!/bin/bash
# H200 call M (session 4): verify session 3's untested GPU changes, then profile 128K decode with every kernel kept.
# 1. GPU tests: the Pallas paged kernel on 256-token pages (block_tokens), the fp8 prefix read in 128K-key blocks
#    on the real cuDNN, the engine tests (predict: all pass).
# 2. 128K decode profile, default options (predict ~9.7 ms wall: paged 4.1, GEMVs 3.6, head 0.24, rest small).
# 3. The same with cuBLASLt for the GEMVs (--xla_gpu_enable_cublaslt; predict: GEMVs 3.7 -> 4.0+ TB/s, or no
#    change if XLA keeps the legacy cuBLAS path for batch-1 dots).
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/m
timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf "tests/test_kernels.py::test_paged_gpu" \
  "tests/test_kernels.py::test_paged_gpu_fp8_blocks" tests/test_gpu_engine.py > $OUT/m/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/m/gpu-tests.txt | tail -6
timeout 100 python3 tools/profile_step.py --context=131072 --steps=16 --top=40 --out=$OUT/m \
  --name=dec-128k-default 2>&1 | $F | head -46
timeout 100 python3 tools/profile_step.py --context=131072 --steps=16 --top=12 --out=$OUT/m \
  --name=dec-128k-cublaslt --xla_flags=--xla_gpu_enable_cublaslt=true 2>&1 | $F | head -16
cd $OUT && tar czf call-m.tgz m && rm -rf m
