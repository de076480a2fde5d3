#!/bin/bash
# H200 call E: the GPU tests call D ran out of time for; decode-overhead A/B (8 layers, 8K: where the 160 weight
# memcpys per token go); exactness vs the float32 oracle (HF + torch fused f32 SDPA).
export PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider "tests/test_kernels.py::test_paged_gpu" -k "64" 2>&1 | tail -3
P="python3 tools/profile_step.py --layers=8 --context=8192 --steps=16 --out=$OUT"
for v in "default|" "dsfusion|--xla_gpu_enable_dynamic_slice_fusion=true" \
         "dsfusion-cublas|--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false"; do
  timeout 60 $P --name=dec-${v%%|*} --xla_flags="${v#*|}" 2>&1 | grep -v "^[WI][0-9]" | head -9
done
LCJAX_EXPERIMENT_UNROLL_DECODE=1 timeout 80 $P --name=dec-unroll 2>&1 | grep -v "^[WI][0-9]" | head -9
timeout 330 python3 tools/check_exact.py --preset=llama3-8b --contexts=4096,32768,131072 \
  --caches=bfloat16,float8_e4m3fn --out=$OUT --name=exact-llama3-8b-h200 2>&1 | grep -v "^[WI][0-9]" | tail -14
