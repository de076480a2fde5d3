"""Needle-in-a-haystack retrieval with a real model: a fact placed at several depths of a long filler document,
asked about at the end; reports accuracy per depth and writes JSON + markdown.

  python tools/eval_needle.py --words=2000 --depths=0.1,0.3,0.5,0.7,0.9 --out=benchmarks/results

The default model is the bundled SmolLM2-135M-Instruct (trained context 8K): keep prompts within it.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "lcjax checkpoint (default: the bundled SmolLM2, converted on first use)")
flags.DEFINE_list("words", ["1000", "2000", "4000"], "filler words per document (~1.2 tokens per word)")
flags.DEFINE_list("depths", ["0.1", "0.3", "0.5", "0.7", "0.9"], "needle positions as fractions of the document")
flags.DEFINE_list("cache_dtypes", ["auto"], "KV cache dtypes to compare (auto, bfloat16, float8_e4m3fn); a '+fp8attn' "
                  "suffix adds FP8 attention, '+int8attn' its int8 Q K^T form (both need a Hopper GPU), '+fp8w' fp8 "
                  "weights (weight_dtype=float8_e4m3fn, quantized at load), e.g. bfloat16,bfloat16+fp8attn,auto+fp8w")
flags.DEFINE_string("dtype", "float32", "model dtype")
flags.DEFINE_string("out", "benchmarks/results", "output folder")
flags.DEFINE_string("name", "needle-smollm2", "output file stem")

_FILLER = ("The river town kept its ledgers in a stone house by the mill. Merchants came on market days with "
           "barrels of salt, bolts of wool and crates of apples. The ferry ran twice an hour while the weather "
           "held, and the children counted the boats from the bridge. ").split()
_CODES = ["PELICAN-42", "MARBLE-17", "COPPER-88", "ORCHID-53", "TUNDRA-29", "VIOLET-64", "GRANITE-31"]


def haystack(words: int, depth: float, code: str) -> str:
  body = [_FILLER[i % len(_FILLER)] for i in range(words)]
  body.insert(int(depth * words), f"Remember this: the password is {code}.")
  return " ".join(body) + "\n\nWhat is the password?"


def main(argv):
  del argv
  from lcjax.checkpoint.bundled import bundled_checkpoint
  from lcjax.config import RunConfig
  from lcjax.engine.engine import Engine
  ckpt = FLAGS.checkpoint or bundled_checkpoint()
  rows = []
  for cache_dtype in FLAGS.cache_dtypes:
    run = RunConfig(dtype=FLAGS.dtype, max_context=8192, max_batch=len(FLAGS.depths), prefill_chunk=2048,
                    decode_steps=16, **benchlib.variant(cache_dtype))
    engine = Engine.load(ckpt, run=run, dtype=FLAGS.dtype)
    for words in map(int, FLAGS.words):
      prompts, codes = [], []
      for i, depth in enumerate(map(float, FLAGS.depths)):
        code = _CODES[i % len(_CODES)]
        text = haystack(words, depth, code)
        prompts.append(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        codes.append(code)
      t0 = time.time()
      results = engine.generate(prompts, max_new_tokens=16)
      for depth, code, res in zip(map(float, FLAGS.depths), codes, results):
        rows.append(dict(cache_dtype=cache_dtype, words=words, tokens=res.prompt_tokens, depth=depth,
                         found=code in res.text, answer=res.text.strip()[:80],
                         **engine.kernels, attention_dtype=res.stats["attention_dtype"],
                         weight_dtype=res.stats["weight_dtype"]))
        print(json.dumps(rows[-1]), flush=True)
      print(f"{words} words: {time.time() - t0:.1f} s", flush=True)
  lines = ["| cache | words | tokens | " + " | ".join(f"depth {d}" for d in FLAGS.depths) + " | accuracy |",
           "|---|---|---|" + "---|" * len(FLAGS.depths) + "---|"]
  for cache_dtype in FLAGS.cache_dtypes:
    for words in map(int, FLAGS.words):
      rs = [r for r in rows if r["words"] == words and r["cache_dtype"] == cache_dtype]
      lines.append(f"| {cache_dtype} | {words} | {rs[0]['tokens']:,} | "
                   + " | ".join("found" if r["found"] else "missed" for r in rs)
                   + f" | {sum(r['found'] for r in rs)}/{len(rs)} |")
  table = "\n".join(lines)
  benchlib.write_result(FLAGS.out, FLAGS.name, rows, table,
                        note=f"Needle retrieval, SmolLM2-135M-Instruct ({FLAGS.dtype})",
                        checkpoint=os.path.basename(os.path.normpath(ckpt)), dtype=FLAGS.dtype)
  print(table)


if __name__ == "__main__":
  app.run(main)
