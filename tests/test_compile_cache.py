"""JAX's persistent compilation cache (RunConfig.compile_cache, lcjax.engine.compile_cache): a second process
with the same config reads the engine's compiled steps from the cache instead of compiling them (JAX's own
cache-hit log and monitoring events, never timings); "off" writes nothing; the first setting of a process holds.
Each case runs in a fresh process without the suite's own per-run cache (tests/conftest.py), with the user cache
directory in a temporary folder."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from lcjax.config import ConfigError, RunConfig
from lcjax.engine.compile_cache import resolve
from tests.run_cache import REPO, cpu_env, with_test_xla_optimizations, without_run_cache


# One engine with compile_cache=argv[1], one greedy generation, then compile_cache.enable(argv[2]) in the same
# process; prints the cache's counters and what the second setting got.
_SCRIPT = r"""
import json, sys
from lcjax.config import RunConfig, preset
from lcjax.engine import compile_cache
from lcjax.engine.engine import Engine
run = RunConfig(compile_cache=sys.argv[1], page_size=16, prefill_chunk=32, max_context=128, decode_steps=4)
Engine.random(preset("tiny"), run=run).generate([3, 4, 5, 6, 7], max_new_tokens=6)
again = compile_cache.enable(sys.argv[2])
print("RESULT " + json.dumps(dict(stats=compile_cache.stats(), again=again)))
"""


def _env(cache_home, **kw):
  # XLA's optimizations as in the test processes (tests/conftest.py): compiling the tiny model is most of each
  # process's time, and what is written to and read from the cache does not depend on them.
  env = cpu_env(XLA_FLAGS="", LCJAX_CACHE_DIR=str(cache_home), **kw)
  return with_test_xla_optimizations(without_run_cache(env))   # without the suite's run cache: lcjax's default


def _cli(cache_home, **env):
  """(the stats table's compilation cache row, the token ids, stderr) of a CLI run on the tiny preset."""
  p = subprocess.run([sys.executable, "-m", "lcjax.cli.generate", "--preset=tiny", "--prompt_ids=3,4,5,6,7",
                      "--max_new_tokens=4"], env=_env(cache_home, **env), cwd=REPO, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  return (re.search(r"compilation cache\s+(.*)", p.stdout).group(1),
          re.search(r"token ids: (.*)", p.stdout).group(1), p.stderr)


def _files(d):
  return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]


def test_resolve():
  home = "/home/u/.cache/lcjax"
  assert resolve("off", jax_dir="/j", jax_enabled=True, user_cache=home) is None
  assert resolve("auto", jax_dir=None, jax_enabled=True, user_cache=home) == f"{home}/jax-compile"
  assert resolve("auto", jax_dir="/j", jax_enabled=True, user_cache=home) == "/j"         # JAX's own setting
  assert resolve("auto", jax_dir="/j", jax_enabled=False, user_cache=home) is None       # JAX's own "off"
  assert resolve("/d", jax_dir="/j", jax_enabled=False, user_cache=home) == "/d"         # named: always used
  assert resolve("~/c", jax_dir=None, jax_enabled=True, user_cache=home) == os.path.expanduser("~/c")
  # Several processes: auto is off (a warm cache hangs them, lcjax.engine.compile_cache); a named one is used.
  assert resolve("auto", jax_dir="/j", jax_enabled=True, user_cache=home, processes=2) is None
  assert resolve("auto", jax_dir=None, jax_enabled=True, user_cache=home, processes=2) is None
  assert resolve("/d", jax_dir=None, jax_enabled=True, user_cache=home, processes=2) == "/d"
  with pytest.raises(ConfigError, match="compile_cache=''"):
    RunConfig(compile_cache="")


def test_cli_second_start_reads_every_program_from_the_cache(tmp_path):
  """The first start (default "auto") writes every program it compiles under $LCJAX_CACHE_DIR/jax-compile and
  reads none; the second reads every one, the prefill and decode steps included (JAX's cache-hit log), and
  generates the same tokens."""
  home = tmp_path / "home"
  row, tokens, _ = _cli(home)
  n = int(re.search(r"\(0 of (\d+) programs", row).group(1))
  assert row.startswith(str(home / "jax-compile")) and n > 0 and len(_files(home / "jax-compile")) >= n
  row2, tokens2, err = _cli(home, JAX_LOG_COMPILES="1")
  assert f"({n} of {n} programs read from it" in row2 and tokens2 == tokens
  hits = set(re.findall(r"Persistent compilation cache hit for '(\w+)'", err))
  assert {"jit__prefill", "jit__decode"} <= hits, hits


def test_off_writes_nothing_and_the_first_setting_holds(tmp_path):
  """compile_cache="off" compiles without the cache and writes nothing, neither under the user cache directory
  nor, later in the process, under a directory another engine names (ignored with a warning: one setting per
  process)."""
  p = subprocess.run([sys.executable, "-c", _SCRIPT, "off", str(tmp_path / "other")], env=_env(tmp_path / "home"),
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  res = json.loads(p.stdout.split("RESULT ")[-1])
  assert res == dict(stats=dict(dir=None, requests=0, hits=0), again=None)
  assert "is ignored" in p.stderr and _files(tmp_path) == []
