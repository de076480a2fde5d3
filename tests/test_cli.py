"""The generate CLI's output, run in this process (tests.cli_inprocess): the interactive transcript against the
Python API's answers, the memory plan printed once, the model named by its checkpoint, and `--config.FIELD=VALUE`
without --config. Refusals are in tests/test_errors.py."""
from __future__ import annotations

import dataclasses
import io
import re

import pytest

from lcjax.engine.engine import Engine
from lcjax.engine.scheduler import Scheduler
from tests import cli_inprocess
from tests import fixtures_ckpt as fx
from tests.test_errors import CFG, RUN, write_checkpoint

NO_EOS = dataclasses.replace(CFG, name="cli-tiny", eos_ids=())     # every answer runs to max_new_tokens
CLI_RUN = ["--config.max_context=256", "--config.page_size=16", "--config.prefill_chunk=64", "--config.max_batch=2",
           "--config.dtype=float32", "--nowarmup"]
DOC = "The ferry ran twice an hour. The password is PELICAN. The mill stood by the river. " * 2
QUESTIONS = ["What is the password?", "Where was the mill?"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  fx.byte_level_tokenizer_json(str(root / "tokenizer.json"))
  write_checkpoint(str(root / "ckpt"), NO_EOS, tokenizer_dir=str(root))
  (root / "doc.txt").write_text(DOC, encoding="utf-8")
  return root


def test_interactive_transcript(ckpt, monkeypatch):
  """Q: / A: per question, a blank line after each answer, the cut at max_new_tokens noted; the answers are the
  API's for the same context and question (this checkpoint has no chat template: plain text, which the CLI says
  once per prompt it builds)."""
  monkeypatch.setattr("sys.stdin", io.StringIO(QUESTIONS[0] + "\n\n" + QUESTIONS[1] + "\n quit \nWho ran it?\n"))
  p = cli_inprocess.run(CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", f"--context_file={ckpt / 'doc.txt'}",
                                   "--interactive", "--max_new_tokens=5"])
  assert p.returncode == 0, p.stderr[-3000:]
  eng = Engine.load(str(ckpt / "ckpt"), run=RUN.replace(decode_steps=32))
  with eng.prefill(DOC) as ctx:
    answers = [eng.generate(q, context=ctx, max_new_tokens=5).text for q in QUESTIONS]
  eng.close()
  want = "".join(f"Q: {q}\nA: {a}\n[cut at max_new_tokens=5]\n\n" for q, a in zip(QUESTIONS, answers))
  assert p.stdout == want, (p.stdout, want)
  assert "has no chat template: the prompt is plain text" in p.stderr
  assert p.stderr.count("time to first token") == 2            # `quit` ended it: the third question never ran
  assert "(quit, exit or Ctrl-D to end)" in p.stderr


def test_a_context_prefilled_and_saved_alone_then_asked(ckpt, tmp_path, monkeypatch):
  """--context_file with --save_context and no prompt prefills and saves (nothing on stdout); --load_context
  with --interactive then answers as the API answers on the prefilled context, until `exit`."""
  saved = tmp_path / "doc.ctx"
  p = cli_inprocess.run(CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", f"--context_file={ckpt / 'doc.txt'}",
                                   f"--save_context={saved}"])
  assert p.returncode == 0 and p.stdout == "" and "context: saved to" in p.stderr, p.stderr[-3000:]
  monkeypatch.setattr("sys.stdin", io.StringIO(QUESTIONS[0] + "\nexit\n" + QUESTIONS[1] + "\n"))
  p = cli_inprocess.run(CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", f"--load_context={saved}", "--interactive",
                                   "--max_new_tokens=5"])
  assert p.returncode == 0, p.stderr[-3000:]
  eng = Engine.load(str(ckpt / "ckpt"), run=RUN.replace(decode_steps=32))
  with eng.prefill(DOC) as ctx:
    answer = eng.generate(QUESTIONS[0], context=ctx, max_new_tokens=5).text
  eng.close()
  assert p.stdout == f"Q: {QUESTIONS[0]}\nA: {answer}\n[cut at max_new_tokens=5]\n\n", p.stdout
  # Another run config is refused from context.json before any weight is read, naming each field that differs.
  monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("the weights were loaded"))
  p = cli_inprocess.run(CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", f"--load_context={saved}", "--prompt=hi",
                                   "--config.page_size=32", "--config.cache_dtype=float8_e4m3fn"])
  assert p.returncode == 2 and p.stderr.count("error:") == 1, p.stderr[-3000:]
  assert ("another model or run config: cache_dtype: saved 'float32', this engine 'float8_e4m3fn'; page_size: "
          "saved 16, this engine 32") in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("args", [[], ["--context_file={doc}"]], ids=["no context", "plain context"])
def test_the_cli_asks_with_the_ids_the_api_builds(ckpt, monkeypatch, args):
  """The CLI builds no prompt of its own: the ids its engine serves for --prompt, alone or as a question on a plain
  (non-chat) context, are the ones Engine.generate(prompt, context=ctx) builds, which for a plain context are the
  document's tokens and then the question's with no BOS and nothing between them (this checkpoint has no chat
  template)."""
  served = []
  serve = Scheduler.serve

  def spy(self, reqs, *a, **kw):
    served.extend(list(r.prompt) for r in reqs)
    return serve(self, reqs, *a, **kw)

  monkeypatch.setattr(Scheduler, "serve", spy)
  p = cli_inprocess.run(CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", f"--prompt={QUESTIONS[0]}", "--max_new_tokens=2",
                                   *[a.format(doc=ckpt / "doc.txt") for a in args]])
  assert p.returncode == 0, p.stderr[-3000:]
  cli = served[-1]
  eng = Engine.load(str(ckpt / "ckpt"), run=RUN)
  if args:
    with eng.prefill(DOC) as ctx:
      eng.generate(QUESTIONS[0], context=ctx, max_new_tokens=2)
      want = eng.encode(DOC) + eng.encode(QUESTIONS[0], add_bos=False)
  else:
    eng.generate(QUESTIONS[0], max_new_tokens=2)
    want = eng.encode(QUESTIONS[0])
  eng.close()
  assert cli == served[-1] == want, (cli, served[-1], want)


def test_help_exits_zero():
  """--help prints the module's doc and its flags on stdout, status 0 (a process of its own: the help is the
  main module's)."""
  import sys
  from tests import forkserver
  from tests.run_cache import REPO, cpu_env
  p = forkserver.run([sys.executable, "-m", "lcjax.cli.generate", "--help"], env=cpu_env(), cwd=REPO, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.startswith("Generate text from a checkpoint") and "--context_file" in p.stdout


def test_plan_once_and_the_model_named_by_its_checkpoint(ckpt):
  p = cli_inprocess.run(CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", "--prompt=hello", "--max_new_tokens=2",
                                   "--nochat"])
  assert p.returncode == 0, p.stderr[-3000:]
  assert (p.stdout + p.stderr).count("memory plan per device") == 1
  model = re.search(r"^  model +(.*)$", p.stdout, re.M).group(1)
  assert model.startswith(f"{ckpt / 'ckpt'}, float32 weights") and NO_EOS.name not in model
  assert re.search(r"peak device memory .*\(memory plan: [0-9.]+ GiB\)", p.stdout)
  assert re.search(r"time to first token +[0-9.]+ s", p.stdout)
  assert re.search(r"^  decode +[0-9.]+ ms/token \(kernel: reference\)$", p.stdout, re.M), p.stdout
  fp8 = cli_inprocess.run(CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", "--prompt=hello", "--max_new_tokens=2",
                                     "--nochat", "--config.cache_dtype=float8_e4m3fn"])
  assert fp8.returncode == 0, fp8.stderr[-3000:]
  assert re.search(r"^  decode +[0-9.]+ ms/token \(kernel: reference, fp8 page write: xla\)$", fp8.stdout, re.M)


def test_speculation_from_the_command_line(ckpt):
  """--config.draft=prompt: the stats say how many tokens each decode call gained and how many drafts were kept;
  the answer is plain decoding's (greedy)."""
  args = CLI_RUN + [f"--checkpoint={ckpt / 'ckpt'}", "--prompt_ids=" + ",".join(["5", "6", "7", "8"] * 6),
                    "--max_new_tokens=24"]
  plain, spec = (cli_inprocess.run(args + extra) for extra in ([], ["--config.draft=prompt", "--config.draft_ngram=2"]))
  assert plain.returncode == spec.returncode == 0, spec.stderr[-3000:]
  assert "speculation" not in plain.stdout
  kept = re.search(r"^  speculation +([0-9.]+) tokens per decode call \(([0-9,]+) of ([0-9,]+) drafts from the "
                   r"prompt kept\)$", spec.stdout, re.M)
  assert kept and int(kept.group(3)) > 0, spec.stdout
  answer = lambda p: p.stdout.split("\n  model")[0]
  assert answer(spec) == answer(plain)


def test_config_overrides_without_a_config_file(ckpt):
  """--config.FIELD=VALUE alone overrides RunConfig's defaults (the plan shows them)."""
  p = cli_inprocess.run([f"--checkpoint={ckpt / 'ckpt'}", "--prompt_ids=5,6,7", "--max_new_tokens=2", "--nowarmup",
                         "--config.max_context=128", "--config.page_size=16", "--config.prefill_chunk=32",
                         "--config.max_batch=3"])
  assert p.returncode == 0, p.stderr[-3000:]
  assert "384 tokens of KV" in p.stderr                        # 3 sequences of 128 tokens


@pytest.mark.parametrize("args", [["--prompt=hello there"], ["--context_file={doc}", f"--prompt={QUESTIONS[0]}"],
                                  ["--context_file={doc}", "--interactive"]], ids=["prompt", "context", "interactive"])
def test_warm_up_leaves_nothing_to_compile(ckpt, monkeypatch, args):
  """After the CLI's warm-up (Engine.warm_up: compiled, nothing run), the run traces and compiles nothing more:
  the context's prefill (132 tokens: two chunks of 64, then 4 run as 16), the prompt's or questions' chunks (the
  question's 20 tokens run as 32), the first token, the streamed decode."""
  from tests.test_engine import _Compiles
  monkeypatch.setattr("sys.stdin", io.StringIO("Where?\n" + "Why is the mill by the river at all? " * 3 + "\n"))
  count = {}
  warm_up = Engine.warm_up

  def spy(self, *a, **kw):
    n = warm_up(self, *a, **kw)
    count["after"] = _Compiles()
    return n

  monkeypatch.setattr(Engine, "warm_up", spy)
  argv = [a.format(doc=ckpt / "doc.txt") for a in args]
  try:
    p = cli_inprocess.run([*CLI_RUN[:-1], f"--checkpoint={ckpt / 'ckpt'}", "--max_new_tokens=3", *argv])
    assert p.returncode == 0, p.stderr[-3000:]
    assert count["after"].seen == []
  finally:
    count["after"].close()
  assert re.search(r"warm-up +[0-9.]+ s \(compiling this run's [0-9]+ programs", p.stdout) or "--interactive" in args


def test_the_warm_up_counter_sees_a_run_that_was_not_warmed_up(ckpt, monkeypatch):
  """The positive control of the test above: with Engine.warm_up compiling nothing, the same counter sees the
  run trace and compile its programs (so an empty count there means the warm-up did the work)."""
  from tests.test_engine import _Compiles
  count = {}

  def skipped(self, *a, **kw):
    count["after"] = _Compiles()
    return 0

  monkeypatch.setattr(Engine, "warm_up", skipped)
  try:
    p = cli_inprocess.run([*CLI_RUN[:-1], f"--checkpoint={ckpt / 'ckpt'}", "--max_new_tokens=3",
                           "--prompt=a prompt of its own length"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert count["after"].seen, "the counter saw nothing of a run that compiled its programs"
  finally:
    count["after"].close()
