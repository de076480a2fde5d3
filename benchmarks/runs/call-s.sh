#!/bin/bash
# H200 call S (session 5): 128K decode, the last ~0.25 ms to the 9 ms goal.
# 1. GPU tests of the paged kernel, which now builds each row's causal bound from q_pos [B, T] itself (the padded
#    [B, R] q_pos array was one XLA kernel a layer), and the Pallas engine == reference.
# 2. benchmarks/runs/gemv_probe.py: cuBLAS GEMV vs split-K by hand vs a Pallas GEMV on the four projection shapes.
#    Predict: xla qkv ~3.2 TB/s, wo ~2.8, gate_up ~4.1, down ~4.0; split 2-4 lifts qkv and wo to >= 3.8.
# 3. 128K decode profiles at decode_split_k 1 (with the optimized HLO, to name the small fusions), 2 and 4.
#    Predict: split 1 9.23 -> ~9.17 ms/token (no loop_pad_fusion_1); split 4 ~8.95 (qkv, wo, down GEMVs faster).
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/s
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
  "tests/test_kernels.py::test_paged_gpu[64-1-False-pallas]" "tests/test_kernels.py::test_paged_gpu[64-2-False-pallas]" \
  "tests/test_kernels.py::test_paged_gpu[64-1-True-pallas]" "tests/test_kernels.py::test_paged_gpu[256-64-True-pallas]" \
  "tests/test_kernels.py::test_paged_gpu[256-64-False-pallas]" \
  "tests/test_gpu_engine.py::test_backend_engine_matches_reference[pallas]" > $OUT/s/gpu-tests.txt 2>&1
tail -2 $OUT/s/gpu-tests.txt
OUT=$OUT/s timeout 100 python3 benchmarks/runs/gemv_probe.py 2>&1 | $F | grep -v "^I1\|^W1"
timeout 90 python3 tools/profile_step.py --context=131072 --steps=16 --top=24 --out=$OUT/s --dump_hlo \
  --decode_split_k=1 --name=dec-128k-s-split1 2>&1 | $F | head -27
for K in 2 4; do
  timeout 80 python3 tools/profile_step.py --context=131072 --steps=16 --top=8 --out=$OUT/s \
    --decode_split_k=$K --name=dec-128k-s-split$K 2>&1 | $F | head -11
done
rm -rf $OUT/s/trace-*
cd $OUT && tar czf call-s.tgz s && rm -rf s
