"""Prompt-lookup speculative decoding (RunConfig.draft="prompt"): tokens per model call on real answers, and what
a verify step costs beside a plain decode step.

  python tools/bench_speculation.py --task=answers                      # bundled SmolLM2 (CPU or GPU)
  python tools/bench_speculation.py --task=cost --preset=llama3.1-8b --contexts=32768,131072,524288 \\
      --variants=float8_e4m3fn+fp8w --name=speculation-cost-8b-h200     # H200
  JAX_PLATFORMS=cpu python tools/bench_speculation.py --task=cost --preset=llama3-8b --layers=1 \\
      --contexts=1024 --batches=1 --draft_tokens=2 --name=speculation-cost-cpu                # CPU smoke run

answers  A chat context of a short document (DOCUMENT) with the real model (--checkpoint, default the bundled
         SmolLM2-135M-Instruct), and questions of three kinds: answers that quote the document, summaries, and
         answers that do not draw on it. Each is answered greedily by plain decoding and by every --ngrams x
         --draft_tokens setting; a row per (question, setting): tokens per model call of the decode loop, drafts
         proposed and accepted, decode ms/token on this device, and whether the tokens equal plain decoding's
         (greedy: they must).
cost     Random weights of --preset. For each --contexts length, a pinned document of that length and each
         --batches size: a plain decode step (Steps.decode of one step) and one speculative step with k = each
         --draft_tokens drafts (Steps.spec_once: the verify call, acceptance and the kept tokens' cache writes),
         each a device call timed --reps times; generate's decode loop ms/token beside them. The ratio
         verify / plain is what a step with k drafts costs; tokens per step over that ratio is the speed-up (the
         answers task measures tokens per step).
Rows go to --out/--name.{json,md}.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("task", "answers", ["answers", "cost"], "what to measure")
flags.DEFINE_string("checkpoint", None, "answers: lcjax checkpoint (default: the bundled SmolLM2)")
flags.DEFINE_list("ngrams", ["3"], "answers: draft_ngram settings")
flags.DEFINE_list("draft_tokens", ["2", "4", "8"], "drafts per step (k) settings")
flags.DEFINE_integer("max_new_tokens", 96, "answers: tokens generated per question")
flags.DEFINE_string("preset", "llama3.1-8b", "cost: model preset (random weights)")
flags.DEFINE_integer("layers", 0, "cost: keep only this many layers (0: all)")
flags.DEFINE_list("variants", ["float8_e4m3fn+fp8w"], "cost: cache dtype with +fp8attn / +fp8w, one engine each")
flags.DEFINE_list("contexts", ["32768", "131072"], "cost: tokens of the pinned document")
flags.DEFINE_list("batches", ["1", "8"], "cost: sequences decoded together")
flags.DEFINE_integer("reps", 20, "cost: timed steps per point")
flags.DEFINE_integer("page_size", 64, "page size")
flags.DEFINE_string("dtype", "", "parameter / activation dtype (default: float32 on CPUs, bfloat16 elsewhere)")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "", "output file stem (default: speculation-<task>)")

DOCUMENT = """\
The Harbour Ledger of Vell, kept by the clerk Maren Osk, records every ship that entered the port in the spring of
its fortieth year. The Grey Heron arrived on the third of April with 120 barrels of salt and 45 bolts of wool; its
captain, Ilse Varro, paid a harbour fee of 14 silver marks. The Copper Wren came on the ninth of April carrying 300
crates of apples from the northern orchards, and it left two days later with a cargo of lamp oil. On the
twentieth of April a storm closed the harbour for four days, and the clerk wrote that the east pier lost eleven
planks and one crane. The Blue Lantern, the largest ship of the season, arrived on the second of May with 80 tons
of iron ore and a crew of 36; its fee was 52 silver marks, the highest of the year. Maren Osk noted that the new
lighthouse on Gull Point was lit for the first time on the fifteenth of May, and that the harbour master, Tomas
Reeve, ordered the fees for small fishing boats to be halved from that day on. The season closed on the thirtieth
of June with 47 ships recorded, 9 more than the year before."""

QUESTIONS = {
    "quote": ["Copy the first sentence of the ledger text word for word.",
              "Quote exactly what the ledger says about the Blue Lantern.",
              "Repeat the sentence about the storm exactly as written."],
    "summary": ["Summarize the ledger text in two sentences.",
                "What happened at the harbour in May? Answer in your own words."],
    "unrelated": ["Write a short poem about the moon.",
                  "Explain in simple words why the sky is blue."],
}


def _stage(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _dtype() -> str:
  import jax
  return FLAGS.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")


def answers() -> list[dict]:
  from lcjax.checkpoint.bundled import bundled_checkpoint
  from lcjax.engine.engine import Engine
  ckpt = FLAGS.checkpoint or bundled_checkpoint()
  settings = [None] + [(int(n), int(k)) for n in FLAGS.ngrams for k in FLAGS.draft_tokens]
  rows, plain = [], {}
  for setting in settings:
    draft = {} if setting is None else dict(draft="prompt", draft_ngram=setting[0], draft_tokens=setting[1])
    eng = Engine.load(ckpt, dtype=_dtype(), page_size=16, max_batch=1, prefill_chunk=512, max_context=512, **draft)
    name = "plain" if setting is None else f"ngram {setting[0]}, k {setting[1]}"
    _stage(f"answers: {name}")
    with eng.prefill(DOCUMENT, chat=True) as ctx:
      for kind, questions in QUESTIONS.items():
        for q in questions:
          r = eng.generate(q, context=ctx, chat=True, max_new_tokens=FLAGS.max_new_tokens)
          s = r.stats
          if setting is None:
            plain[q] = r.token_ids
          rows.append(dict(kind=kind, question=q, setting=name, ngram=setting and setting[0],
                           k=setting and setting[1], new_tokens=s["new_tokens"], decode_calls=s["decode_calls"],
                           tokens_per_call=s["tokens_per_decode_call"], drafts_proposed=s["drafts_proposed"],
                           drafts_accepted=s["drafts_accepted"], decode_ms_per_token=s["decode_ms_per_token"],
                           same_tokens_as_plain=r.token_ids == plain[q], answer=r.text[:160]))
          benchlib.emit_row(**rows[-1])
    eng.close()
  return rows


def answers_markdown(rows) -> str:
  """Tokens per model call by question kind and setting (mean over the kind's questions)."""
  settings = list(dict.fromkeys(r["setting"] for r in rows))
  kinds = list(dict.fromkeys(r["kind"] for r in rows))
  lines = ["| setting | " + " | ".join(f"{k}: tokens / call" for k in kinds) + " | accepted / proposed | "
           "ms/token (this device) | same tokens as plain |", "|---" * (len(kinds) + 4) + "|"]
  for s in settings:
    mine = [r for r in rows if r["setting"] == s]
    per = [statistics.mean(r["tokens_per_call"] for r in mine if r["kind"] == k) for k in kinds]
    prop = sum(r["drafts_proposed"] for r in mine)
    acc = sum(r["drafts_accepted"] for r in mine)
    ms = statistics.mean(r["decode_ms_per_token"] for r in mine)
    same = sum(r["same_tokens_as_plain"] for r in mine)
    lines.append(f"| {s} | " + " | ".join(f"{x:.2f}" for x in per)
                 + f" | {acc} / {prop} | {ms:.1f} | {same} / {len(mine)} |")
  return "\n".join(lines)


def cost() -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from lcjax.config import RunConfig
  from lcjax.engine.engine import Engine
  from lcjax.engine.sampling import SamplingParams, stack
  from lcjax.engine.steps import DecodeState
  from lcjax.ops.linear import WIDEN_MAX_ROWS
  contexts = sorted(map(int, FLAGS.contexts))
  batches = sorted(map(int, FLAGS.batches))
  ks = sorted(map(int, FLAGS.draft_tokens))
  rows = []
  for variant in FLAGS.variants:
    need = contexts[-1] + max(ks) + 64 + 1
    ctx_len = -(-need // FLAGS.page_size) * FLAGS.page_size
    cfg = benchlib.random_model_cfg(FLAGS.preset, ctx_len, FLAGS.layers)
    run = RunConfig(dtype=_dtype(), page_size=FLAGS.page_size, max_context=ctx_len, max_batch=max(batches),
                    prefill_chunk=min(16384, -(-contexts[-1] // FLAGS.page_size) * FLAGS.page_size),
                    prefix_cache=False, decode_steps=32, **benchlib.variant(variant))
    eng = Engine.random(cfg, run=run, seed=0)
    sched = eng.scheduler
    rng = np.random.default_rng(0)
    for n in contexts:
      _stage(f"cost: {variant}, context {n:,}")
      with eng.prefill(rng.integers(0, cfg.vocab_size, n).tolist()) as ctx:
        for B in batches:
          questions = [rng.integers(0, cfg.vocab_size, 8).tolist() for _ in range(B)]
          eng.generate(questions, context=ctx, max_new_tokens=33)               # compile
          res = eng.generate(questions, context=ctx, max_new_tokens=65)
          plain_ms = statistics.median(r.stats["decode_ms_per_token"] for r in res)
          # One speculative step at a time on requests admitted after the context, as decode runs them.
          reqs = eng._requests(questions, 2 * FLAGS.reps + 2, None, None, ctx, False)[0]
          for r in reqs:
            assert sched.admit(r)
            sched.prefill(r)
          try:
            table = jnp.asarray(sched.pool.page_table_array([r.seq for r in reqs], sched.table_width))
            pos = jnp.asarray([len(r.prompt) for r in reqs], jnp.int32)
            state = DecodeState(jnp.asarray([r.out[-1] for r in reqs], jnp.int32), pos, jnp.zeros(B, bool),
                                jnp.full(B, 2 * FLAGS.reps, jnp.int32))
            sp = stack([SamplingParams()] * B)
            # (k, drafts fed): the plain step, a step that found no draft (the one-row branch), then k drafts.
            for k, fed in [(0, 0), (ks[0], 0)] + [(k, k) for k in ks]:
              if k and eng.weights.fp8 and B * (k + 1) > WIDEN_MAX_ROWS:
                continue           # refused by lcjax.engine.serving.resolve: past the decode product's rows
              drafts = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, max(k, 1))), jnp.int32)
              count = jnp.full(B, fed, jnp.int32)
              times = []
              for rep in range(FLAGS.reps + 2):
                t0 = time.perf_counter()
                if k == 0:         # a plain decode step: the loop of one step
                  out, _, sched.cache = eng.steps.decode(eng.params, sched.cache, state, sp, table, sched.eos,
                                                         steps=1, greedy=True)
                else:
                  out, _, sched.cache = eng.steps.spec_once(eng.params, sched.cache, state, sp, table, sched.eos,
                                                            drafts, count)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
              step_ms = 1000 * statistics.median(times[2:])
              row = dict(variant=variant, context=n, batch=B, k=k, drafts_fed=fed, plain_decode_ms_per_token=plain_ms,
                         step_ms=step_ms, kernels=eng.kernels)
              rows.append(row)
              benchlib.emit_row(**row)
          finally:
            for r in reqs:
              sched.release(r)
    eng.close()
  for r in rows:
    base = next(x["step_ms"] for x in rows if (x["variant"], x["context"], x["batch"], x["k"]) ==
                (r["variant"], r["context"], r["batch"], 0))
    r["step_over_plain_step"] = r["step_ms"] / base
  return rows


def cost_markdown(rows) -> str:
  lines = ["| variant | context | batch | k | drafts fed | step ms | step / plain step | loop ms/token (plain) |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['variant']} | {r['context']:,} | {r['batch']} | {r['k']} | {r['drafts_fed']} | "
                 f"{r['step_ms']:.2f} | {r['step_over_plain_step']:.2f} | {r['plain_decode_ms_per_token']:.2f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  name = FLAGS.name or f"speculation-{FLAGS.task}"
  if FLAGS.task == "answers":
    rows = answers()
    note = ("Greedy answers on a chat context of a 270-word document; tokens per call = decoded tokens / model calls "
            "of the decode loop (1.0 without speculation). ms/token is this device's and includes each step's "
            "draft search.")
    benchlib.write_result(FLAGS.out, name, rows, answers_markdown(rows), note=note)
  else:
    rows = cost()
    note = ("k = 0: a plain decode step (Steps.decode, one step a call); every other row is one speculative step "
            "(Steps.spec_once) feeding k drafts per sequence, or none (drafts fed 0: the step of a sequence whose "
            "draft search found nothing). loop ms/token: generate's decode loop of the same "
            "engine, for reference.")
    benchlib.write_result(FLAGS.out, name, rows, cost_markdown(rows), note=note)


if __name__ == "__main__":
  app.run(main)
