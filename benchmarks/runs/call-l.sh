#!/bin/bash
# 2x H200 call L (session 3): call K again, bench first. In call K every bench row ran out of memory right after
# the mesh tests were killed at their time limit (even the one-GPU row that ran on the one-GPU kind at 25 GiB):
# GPU memory is logged before and after, and the OOM text is now kept in the rows.
# CALL (default l: the folder and tarball) and TESTS_S (default 100: the mesh tests' limit) are what call-n.sh
# changes to run it again; the defaults are call L as it ran.
export PYTHONUNBUFFERED=1
C=${CALL:-l}
mkdir -p $OUT/$C
Q="nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader"
$Q; $Q > $OUT/$C/smi-before.txt
timeout -s KILL 230 python3 tools/bench_multigpu.py --preset=llama3.1-70b --layers=8 --meshes=2x1,1x2 \
  --contexts=131072 --decode_batches=1 --scaling_tokens_per_gpu=65536 --scaling_gpus=1,2 \
  --scaling_orders=zigzag,plain --time_budget_s=200 --out=$OUT/$C --name=2xh200-l70b-8layers 2>&1 \
  | grep -v "^[WI][0-9]" | tail -9
$Q
timeout -s KILL ${TESTS_S:-100} python3 -m pytest -v -m gpu -p no:cacheprovider --tb=line -rf tests/test_gpu_engine.py -k mesh \
  > $OUT/$C/gpu-mesh-tests.txt 2>&1; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/$C/gpu-mesh-tests.txt | tail -8
cd $OUT && tar czf call-$C.tgz $C && rm -rf $C
