"""Shared pytest setup. Mesh tests need 8 devices: fake them on the CPU before jax creates its backends.
(The slow and gpu markers are registered in pyproject.toml.)

JAX's persistent compilation cache of a test run is a fresh temporary directory, shared by every process of the
run (the xdist workers, and through the environment the processes that tests start) and removed when the run
ends: engines built with the same model and run config compile each program once per run, not once per engine,
and nothing is read from or written to the user's cache directory (RunConfig.compile_cache "auto" defers to
JAX_COMPILATION_CACHE_DIR). Tracing and lowering still run for every engine; only the XLA compilation of an
identical program is read back. A size limit turns on JAX's file lock, which orders the processes' reads and
writes. Tests of the cache itself remove these variables and name their own temporary directories.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import jax

from tests.run_cache import CACHE_ENV
_RUN_CACHE = "LCJAX_TEST_RUN_XLA_CACHE"      # set by the run's first process (xdist's controller), which removes it
_OWN_CACHE = _RUN_CACHE not in os.environ
if _OWN_CACHE:
  os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="lcjax-test-xla-cache-")
os.environ.pop("JAX_ENABLE_COMPILATION_CACHE", None)
os.environ.update(zip(CACHE_ENV, (os.environ[_RUN_CACHE], "0", str(8 << 30))))

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", True)
jax.config.update("jax_compilation_cache_dir", os.environ[_RUN_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_compilation_cache_max_size", 8 << 30)


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)
