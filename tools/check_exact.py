"""Exactness at long context: lcjax's serving path against a float32 oracle on the same weights.

  python tools/check_exact.py --preset=llama3-8b --contexts=4096,131072 --caches=bfloat16,float8_e4m3fn
  python tools/check_exact.py --checkpoint=bundled --dtype=float32 --contexts=32768 --caches=bfloat16,float8_e4m3fn

lcjax side: `Engine.prompt_logits`, i.e. chunked prefill into the paged cache with the engine's attention backend
(cuDNN / Pallas flash on the GPU) and the given KV cache dtype; the last position's float32 logits. With
`--positions=N`, the last N positions: one call per prefix, each reusing the earlier calls' full pages through the
prefix cache (so the cached-prefix read is what is measured), summarised per row (mean and largest KL, top-1
agreements). One position's KL is a noisy sample; a few dozen make comparisons of variants firm.
Oracle: HF transformers LlamaForCausalLM in float32 (TF32 off; attention: torch's fused float32 SDPA kernel on
repeated KV heads), written by other people, run on the same weights (copied out of lcjax with `export_hf`) and
the same prompt, in one forward without a cache.
Per context and cache dtype it reports, against the oracle: max |diff| over the logit scale (max |oracle|), RMS
diff over RMS oracle, KL(oracle || lcjax) in nats, top-1 agreement (where it differs, the margin: how far below its
own top-1 the reference puts lcjax's, over the logit scale; a margin within the logits' error is a near-tie)
and top-10 overlap; and each cache against the first one (the quality cost of fp8 against bf16). A short
context beside a long one separates what long context adds from what the model dtype costs everywhere.

Weights: random (`--preset`, made on the device) or a converted checkpoint (`--checkpoint`, "bundled" for the
bundled SmolLM2). Prompts: random ids, or `--prompt=text`: Python's own documentation (pydoc_data), tokenized.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time

# The oracle runs after lcjax in this process: let JAX hand freed device memory back to the driver.
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3-8b", "model preset for random weights (ignored with --checkpoint)")
flags.DEFINE_integer("layers", 0, "random weights: use only this many layers (0: all)")
flags.DEFINE_string("checkpoint", None, "an lcjax checkpoint instead of random weights; 'bundled': SmolLM2")
flags.DEFINE_list("contexts", ["4096", "131072"], "prompt lengths (tokens)")
flags.DEFINE_list("caches", ["bfloat16", "float8_e4m3fn"], "KV cache dtypes to check (the first is the base); "
                  "a '+fp8attn' suffix adds FP8 attention (attention_dtype=float8_e4m3fn), '+int8attn' its int8 Q K^T "
                  "form (int8_fp8), '+fp8w' fp8 weights (weight_dtype=float8_e4m3fn, quantized at load; the oracle "
                  "keeps the weights as stored), e.g. bfloat16+fp8attn+fp8w")
flags.DEFINE_string("dtype", "bfloat16", "lcjax parameter / activation dtype")
flags.DEFINE_string("attention", "auto", "lcjax attention backend")
flags.DEFINE_integer("prefill_chunk", 32768, "lcjax prefill chunk")
flags.DEFINE_integer("page_size", 64, "lcjax page size")
flags.DEFINE_enum("prompt", "random", ["random", "text"], "random ids, or tokenized Python documentation")
flags.DEFINE_integer("seed", 0, "weights and prompt seed")
flags.DEFINE_integer("positions", 1, "compare the last this many positions of each prompt (lcjax: one call per "
                     "prefix, the earlier ones' full pages reused from the prefix cache; the oracle: one forward); "
                     "rows report the mean KL, the largest, and how many top-1s agree")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "exact", "output file stem")


def prompts(cfg, tokenizer, contexts):
  import numpy as np
  if FLAGS.prompt == "random":
    rng = np.random.default_rng(FLAGS.seed)
    return {S: rng.integers(0, cfg.vocab_size, S).tolist() for S in contexts}
  if tokenizer is None:
    raise app.UsageError("--prompt=text needs a checkpoint with a tokenizer")
  from pydoc_data.topics import topics
  ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
  while len(ids) < max(contexts):
    ids = ids + ids
  return {S: ids[:S] for S in contexts}


def lcjax_side(contexts):
  """Last-position logits per (cache dtype, S), then the weights on the host (HF names) for the oracle."""
  import jax
  import numpy as np
  from lcjax.checkpoint.hf import export_hf
  from lcjax.config import RunConfig, preset
  from lcjax.engine.engine import Engine
  ctx = -(-(max(contexts) + 1) // FLAGS.page_size) * FLAGS.page_size
  base = dict(dtype=FLAGS.dtype, max_context=ctx, max_batch=1, page_size=FLAGS.page_size,
              prefill_chunk=min(FLAGS.prefill_chunk, ctx), attention=FLAGS.attention)
  # The weights as stored (random: drawn in dtype), which the oracle gets; a '+fp8w' entry quantizes them.
  first = dict(benchlib.variant(FLAGS.caches[0]), weight_dtype="auto")
  if FLAGS.checkpoint:
    from lcjax.checkpoint.bundled import bundled_checkpoint
    ckpt = bundled_checkpoint() if FLAGS.checkpoint == "bundled" else FLAGS.checkpoint
    eng = Engine.load(ckpt, run=RunConfig(**base, **first))
    cfg = eng.cfg
  else:
    cfg = preset(FLAGS.preset)
    cfg = dataclasses.replace(cfg, max_position=max(cfg.max_position, ctx),
                              n_layers=FLAGS.layers or cfg.n_layers)
    eng = Engine.random(cfg, run=RunConfig(**base, **first), seed=FLAGS.seed)
  ids = prompts(cfg, eng.tokenizer, contexts)
  got, info = {}, {}
  params, tokenizer = eng.params, eng.tokenizer
  for i, cache in enumerate(FLAGS.caches):
    if i or benchlib.variant(cache) != first:
      eng = None                      # the previous engine's buffers go before this one's are made
      gc.collect()
      eng = Engine(cfg, params, run=RunConfig(**base, **benchlib.variant(cache)), tokenizer=tokenizer)
    info[cache] = dict(attention=eng.attention.name, weights=eng.weights.describe(eng.run.dtype))
    for S in contexts:
      t = time.perf_counter()
      got[cache, S] = np.stack([eng.prompt_logits(ids[S][:n]) for n in range(S - FLAGS.positions + 1, S + 1)])
      info[cache][S] = time.perf_counter() - t
      eng.prefix_cache.clear()
      print(f"lcjax cache={cache} S={S}: {info[cache][S]:.1f} s", flush=True)
    eng = None
    gc.collect()
  weights = [(name, np.asarray(w)) for name, w in export_hf(params, cfg)]
  del params
  gc.collect()
  jax.clear_caches()
  return cfg, ids, got, info, weights


def register_oracle_attention(device: str) -> str:
  """HF's attention with torch's fused float32 SDPA kernel (memory-efficient attention, O(n) memory; on the CPU
  torch's own choice) on repeated KV heads. HF's "sdpa" passes enable_gqa, which in float32 on CUDA sends torch
  to its O(n^2) math kernel (128 GiB of scores at 128K)."""
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel
  from transformers import AttentionInterface
  from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
  backends = ([SDPBackend.EFFICIENT_ATTENTION] if device == "cuda" else
              [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

  def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if attention_mask is not None:
      raise ValueError("the float32 oracle expects one unpadded causal sequence (got an explicit mask)")
    rep = query.shape[1] // key.shape[1]
    key, value = (x.repeat_interleave(rep, dim=1) for x in (key, value))      # [B, N, S, H]
    with sdpa_kernel(backends):
      out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None

  AttentionInterface.register("oracle_f32", attention)
  AttentionMaskInterface.register("oracle_f32", sdpa_mask)
  return "oracle_f32"


def oracle_side(cfg, ids, weights, contexts):
  import numpy as np
  import torch
  import transformers
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"},
                                    attn_implementation=register_oracle_attention(dev))
  with torch.device(dev):
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
  sd = model.state_dict()
  with torch.no_grad():
    for name, w in weights:
      sd[name].copy_(torch.from_numpy(np.array(w, np.float32)))
  weights.clear()
  out, secs = {}, {}
  for S in contexts:
    t = time.perf_counter()
    with torch.inference_mode():
      x = torch.as_tensor([ids[S]], device=dev)
      out[S] = model(input_ids=x, use_cache=False, logits_to_keep=FLAGS.positions).logits[0].float().cpu().numpy()
    secs[S] = time.perf_counter() - t
    print(f"oracle S={S}: {secs[S]:.1f} s", flush=True)
  return out, secs


def main(argv):
  del argv
  contexts = sorted(map(int, FLAGS.contexts))
  if not 1 <= FLAGS.positions <= contexts[0]:
    raise app.UsageError(f"--positions={FLAGS.positions} must be between 1 and the shortest context {contexts[0]}")
  t0 = time.time()
  cfg, ids, got, info, weights = lcjax_side(contexts)
  ref, ref_s = oracle_side(cfg, ids, weights, contexts)
  rows = []
  first = FLAGS.caches[0]
  for S in contexts:
    for cache in FLAGS.caches:
      row = dict(S=S, cache=cache, attention=info[cache]["attention"], weights=info[cache]["weights"],
                 lcjax_s=info[cache][S],
                 oracle_s=ref_s[S], vs_oracle=benchlib.logits_metrics_over(got[cache, S], ref[S]))
      if cache != first:
        row["vs_" + first] = benchlib.logits_metrics_over(got[cache, S], got[first, S])
      rows.append(row)
  n = FLAGS.positions
  if n == 1:
    lines = ["| S | KV cache | vs | max abs diff / logit scale | RMS diff / RMS | KL (nats) | top-1 | top-10 |",
             "|---|---|---|---|---|---|---|---|"]
  else:
    lines = [f"Over the last {n} positions of each prompt: the largest diff, the mean RMS diff, KL and top-10 "
             "overlap, the largest KL, and the positions whose top-1 agrees.", "",
             "| S | KV cache | vs | max abs diff / logit scale | RMS diff / RMS | KL (nats), mean | KL, max | top-1 "
             "| top-10 |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    for key in [k for k in r if k.startswith("vs_")]:
      m = r[key]
      top1 = ('same' if m['top1'] else 'DIFF') if n == 1 else f"{round(m['top1'] * n)}/{n}"
      if m["top1_margin"] > 0:
        top1 += f" (margin {m['top1_margin']:.1e})"
      kl = f"{m['kl']:.2e}" if n == 1 else f"{m['kl']:.2e} | {m['kl_max']:.2e}"
      lines.append(f"| {r['S']:,} | {r['cache']} | {key[3:]} | {m['max_abs']:.4f} / {m['scale']:.2f} = "
                   f"{m['rel_max']:.2e} | {m['rel_rms']:.2e} | {kl} | {top1} | {m['top10']:.1f} |")
  table = "\n".join(lines)
  oracle = ("HF transformers LlamaForCausalLM, float32, TF32 off, torch fused float32 SDPA (memory-efficient kernel "
            "on CUDA), one forward without cache")
  weights = FLAGS.checkpoint or f"random (seed {FLAGS.seed})"
  benchlib.write_result(
      FLAGS.out, FLAGS.name, rows, table, oracle=oracle, seconds=time.time() - t0,
      note=f"lcjax against a float32 oracle ({oracle}) on the same weights: {cfg.name}, {cfg.n_layers} layers, "
           f"{FLAGS.dtype}, {weights}, {FLAGS.prompt} prompt",
      model=dict(name=cfg.name, layers=cfg.n_layers, dtype=FLAGS.dtype, weights=weights, prompt=FLAGS.prompt,
                 prefill_chunk=FLAGS.prefill_chunk, page_size=FLAGS.page_size, positions=FLAGS.positions))
  print(table)


if __name__ == "__main__":
  app.run(main)
