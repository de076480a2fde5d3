#!/bin/bash
# H200 call R (session 4, last device minutes): the paged decode kernel writes only its R0 = T * G real rows of
# split partials, and _combine reads only those (16 padded rows before: 8.6 MB written and read per layer at 128K).
# 1. GPU tests of the Pallas paged kernel (64- and 256-token pages, fp8, two query tokens) and the Pallas engine.
# 2. 128K decode profile. Predict 9.38 (call P) -> ~9.2 ms/token: input_reduce_fusion_1 (the weighted sum over
#    splits, 0.132 ms) to ~0.04, the kernel ~0.03 ms shorter.
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/r
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
  "tests/test_kernels.py::test_paged_gpu[64-1-False-pallas]" "tests/test_kernels.py::test_paged_gpu[64-2-False-pallas]" \
  "tests/test_kernels.py::test_paged_gpu[64-1-True-pallas]" "tests/test_kernels.py::test_paged_gpu[256-64-True-pallas]" \
  "tests/test_kernels.py::test_paged_gpu[256-64-False-pallas]" \
  "tests/test_gpu_engine.py::test_backend_engine_matches_reference[pallas]" > $OUT/r/gpu-tests.txt 2>&1
tail -2 $OUT/r/gpu-tests.txt
timeout 80 python3 tools/profile_step.py --context=131072 --steps=16 --top=14 --out=$OUT/r \
  --name=dec-128k-r-realrows 2>&1 | $F | head -17
rm -rf $OUT/r/trace-*
cd $OUT && tar czf call-r.tgz r && rm -rf r
