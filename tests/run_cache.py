"""The environment of the processes tests start: this checkout's lcjax on the CPU; the test run's JAX compilation
cache (set up in tests/conftest.py), and its removal for the processes that must not use it; the test processes'
XLA optimization setting, for the processes that share it, and XLA's optimizations on for a block of a test."""
from __future__ import annotations

import contextlib
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Set by conftest for every process of the run: the run's cache directory, a 0 s compile-time floor, no size limit.
CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_COMPILATION_CACHE_MAX_SIZE")
# Set by conftest for every process of the run: the XLA CPU flags the run compiles with ("" where XLA lacks them).
RUN_XLA_FLAGS = "LCJAX_TEST_RUN_XLA_CPU_FLAGS"


def cpu_env(**extra) -> dict:
  """This process's environment with this checkout as PYTHONPATH and JAX on the CPU, plus `extra`: what a process a
  test starts (a CLI, a tool, a script) runs in."""
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", **extra)


def with_run_xla_flags(env) -> None:
  """Append the run's XLA CPU flags (this process's $LCJAX_TEST_RUN_XLA_CPU_FLAGS) to env's XLA_FLAGS, once."""
  flags = os.environ.get(RUN_XLA_FLAGS, "")
  if flags and flags not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()


def without_run_cache(env: dict) -> dict:
  """env without the run's cache variables (and without JAX_ENABLE_COMPILATION_CACHE): a process started with it
  uses lcjax's own default."""
  for var in CACHE_ENV + ("JAX_ENABLE_COMPILATION_CACHE",):
    env.pop(var, None)
  return env


def with_test_xla_optimizations(env: dict) -> dict:
  """env with this process's setting of jax_disable_most_optimizations and the run's XLA CPU code-generation flags
  (tests/conftest.py): a process started with it compiles as the test processes do."""
  import jax
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1" if jax.config.read("jax_disable_most_optimizations") else "0"
  with_run_xla_flags(env)
  return env


@contextlib.contextmanager
def optimized_xla():
  """XLA's optimizations on in this process for what the block compiles (tests/conftest.py turns most of them off
  in the test processes; a test marked `optimized_xla` runs whole inside this block)."""
  import jax
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)
