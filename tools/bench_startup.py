"""Start-up benchmark: what JAX's persistent compilation cache (RunConfig.compile_cache) saves a second start of
the CLI. Each start is a fresh `python -m lcjax.cli.generate` process, timed from launch to exit.

  python tools/bench_startup.py --preset=llama3-8b                                   # H200, random weights
  python tools/bench_startup.py --checkpoint=DIR --config=configs/h200.py            # a real checkpoint
  python tools/bench_startup.py --preset=tiny --max_new_tokens=4                      # CPU, seconds

Modes, two consecutive starts each:
  off   --config.compile_cache=off: every start compiles (the second shows what the first paid once only:
        imports, the OS page cache, the CUDA driver's own caches)
  on    --config.compile_cache=DIR with DIR empty before the first start (cold: compiles and writes) and full
        before the second (warm: reads)
Each row: the process's wall time, the CLI's own warm-up (its programs compiled ahead of time, none run),
prefill, time to first token and decode figures from its stats table, how many of the programs it compiled came
from the cache, and the cache directory's size after the start. The prompt is --prompt_tokens random token ids (no
tokenizer needed).
Rows go to --out/--name.{json,md}.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tools import benchlib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "llama3-8b", "model preset (random weights made on the device)")
flags.DEFINE_string("checkpoint", None, "a checkpoint (lcjax, HF folder or GGUF) instead of a preset")
flags.DEFINE_string("config", os.path.join(REPO, "configs", "default.py"), "the CLI's --config file")
flags.DEFINE_list("overrides", [], "more CLI config overrides, e.g. prefill_chunk=16384,max_context=32768")
flags.DEFINE_integer("prompt_tokens", 512, "prompt length (random token ids)")
flags.DEFINE_integer("max_new_tokens", 32, "tokens generated per start")
flags.DEFINE_list("modes", ["off", "on"], "off: cache off; on: a cold then a warm cache directory")
flags.DEFINE_string("cache_dir", None, "the cache directory of mode 'on' (emptied first; default: a temporary one)")
flags.DEFINE_integer("timeout_s", 1200, "the longest one start may take")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "startup", "output file stem")

# An id list must fit one command-line argument (Linux: 128 KiB); start-up depends on the prefill chunk shapes,
# not on the length.
MAX_PROMPT_TOKENS = 16384


def _stat(text: str, key: str, pattern: str = r"([\d.,]+)") -> float | None:
  m = re.search(rf"^\s+{re.escape(key)}\s+{pattern}", text, re.M)
  return float(m.group(1).replace(",", "")) if m else None


def parse_stats(stdout: str) -> dict:
  """The numbers of the CLI's stats table (None where a row is absent)."""
  m = re.search(r"^\s+compilation cache\s+.*?\((\d+) of (\d+) programs", stdout, re.M)
  return dict(warmup_s=_stat(stdout, "warm-up"), prefill_s=_stat(stdout, "prefill"),
              ttft_s=_stat(stdout, "time to first token"), decode_ms_per_token=_stat(stdout, "decode"),
              programs_read=int(m.group(1)) if m else None, programs_compiled_through_cache=int(m.group(2)) if m
              else None)


def _dir_size(path: str) -> tuple[int, int]:
  files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
  return len(files), sum(os.path.getsize(f) for f in files)


def _start(setting: str, label: str, cache_dir: str | None, prompt_ids: str) -> dict:
  model = [f"--checkpoint={FLAGS.checkpoint}"] if FLAGS.checkpoint else [f"--preset={FLAGS.preset}"]
  argv = [sys.executable, "-m", "lcjax.cli.generate", *model, f"--prompt_ids={prompt_ids}",
          f"--max_new_tokens={FLAGS.max_new_tokens}", f"--config={FLAGS.config}",
          f"--config.compile_cache={setting}", *[f"--config.{o}" for o in FLAGS.overrides]]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
  t0 = time.perf_counter()
  p = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=FLAGS.timeout_s)
  wall = time.perf_counter() - t0
  if p.returncode != 0:
    raise SystemExit(f"the {label} start failed (status {p.returncode}):\n{p.stderr[-3000:]}")
  files, size = _dir_size(cache_dir) if cache_dir else (0, 0)
  row = dict(mode=label, wall_s=round(wall, 2), **parse_stats(p.stdout), cache_files=files,
             cache_mib=round(size / 2**20, 1))
  print(row, flush=True)
  return row


def _table(rows: list[dict]) -> str:
  def f(x, fmt):
    return "-" if x is None else format(x, fmt)
  lines = ["| start | wall s | warm-up s | prefill s | first token s | decode ms/token | programs read | cache |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    read = "-" if r["programs_read"] is None else f"{r['programs_read']} of {r['programs_compiled_through_cache']}"
    cache = f"{r['cache_files']} files, {r['cache_mib']} MiB" if r["cache_files"] else "-"
    lines.append(f"| {r['mode']} | {r['wall_s']:.2f} | {f(r['warmup_s'], '.2f')} | {f(r['prefill_s'], '.2f')} | "
                 f"{f(r['ttft_s'], '.2f')} | {f(r['decode_ms_per_token'], '.1f')} | {read} | {cache} |")
  return "\n".join(lines)


def main(argv):
  del argv
  if not 1 <= FLAGS.prompt_tokens <= MAX_PROMPT_TOKENS:
    raise SystemExit(f"--prompt_tokens={FLAGS.prompt_tokens} must be in 1..{MAX_PROMPT_TOKENS} (the ids go on "
                     "one command line; start-up cost depends on the prefill chunk shapes, not the length)")
  unknown = sorted(set(FLAGS.modes) - {"off", "on"})
  if unknown or not FLAGS.modes:
    raise SystemExit(f"--modes={','.join(FLAGS.modes)}: modes are off and on")
  import numpy as np
  prompt_ids = ",".join(map(str, np.random.default_rng(0).integers(3, 256, FLAGS.prompt_tokens)))
  rows = []
  if "off" in FLAGS.modes:
    rows += [_start("off", f"off #{i}", None, prompt_ids) for i in (1, 2)]
  if "on" in FLAGS.modes:
    tmp = None if FLAGS.cache_dir else tempfile.mkdtemp(prefix="lcjax-bench-startup-")
    cache_dir = FLAGS.cache_dir or os.path.join(tmp, "jax-compile")
    shutil.rmtree(cache_dir, ignore_errors=True)
    try:
      rows += [_start(cache_dir, label, cache_dir, prompt_ids) for label in ("on, cold", "on, warm")]
    finally:
      if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
  model = dict(checkpoint=FLAGS.checkpoint) if FLAGS.checkpoint else dict(preset=FLAGS.preset)
  note = (f"Fresh CLI processes, {FLAGS.prompt_tokens} prompt tokens, {FLAGS.max_new_tokens} new tokens, "
          f"--config={os.path.relpath(FLAGS.config, REPO)} {' '.join('--config.' + o for o in FLAGS.overrides)}; "
          "wall = launch to exit (imports, weights, warm-up compilation, generation).")
  benchlib.write_result(FLAGS.out, FLAGS.name, rows, _table(rows), note=note, model=model,
                        prompt_tokens=FLAGS.prompt_tokens, max_new_tokens=FLAGS.max_new_tokens)
  print(_table(rows))


if __name__ == "__main__":
  app.run(main)
