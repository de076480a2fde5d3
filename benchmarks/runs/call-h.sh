#!/bin/bash
# H200 call H (session 3): GPU correctness after the decode compile options, the paged_case dispatch and the
# bf16 lm_head (tests/test_gpu_engine.py + the paged kernel tests); decode overhead A/B at 8 layers / 8K (the new
# default vs XLA command buffers that also capture the while loops); 128K with 16K and 32K prefill chunks, HF in
# the same call. Everything lands in one tarball (the call returns at most 8 files).
export PYTHONUNBUFFERED=1
F="grep -v ^[WI][0-9]"
mkdir -p $OUT/h
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_gpu_engine.py \
  "tests/test_kernels.py::test_paged_gpu" > $OUT/h/gpu-tests.txt 2>&1; tail -4 $OUT/h/gpu-tests.txt
P="python3 tools/profile_step.py --layers=8 --context=8192 --steps=16 --top=10 --out=$OUT/h"
timeout 50 $P --name=dec8-default 2>&1 | $F | head -13
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION"
timeout 50 $P --name=dec8-cmdbuf --xla_flags="$CB" 2>&1 | $F | head -13
timeout 150 python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=131072 --prefill_chunk=16384 \
  --decode_steps=64 --out=$OUT/h --name=longctx-h200-h-16k 2>&1 | $F | tail -4
timeout 80 python3 tools/bench_longctx.py --impls=lcjax --contexts=131072 --prefill_chunk=32768 \
  --decode_steps=64 --out=$OUT/h --name=longctx-h200-h-32k 2>&1 | $F | tail -3
python3 -c "import json,glob
for f in sorted(glob.glob('$OUT/h/longctx*.json')):
  for r in json.load(open(f))['rows']: print(f.split('/')[-1], {k: (round(v,3) if isinstance(v,float) else v) for k,v in r.items()})"
cd $OUT && tar czf call-h.tgz h && rm -rf h
