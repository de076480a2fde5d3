"""Shared pytest setup. Mesh tests need 8 devices: fake them on the CPU before jax creates its backends.
(The slow and gpu markers are registered in pyproject.toml.)

JAX's persistent compilation cache is off for the suite and the processes it starts (RunConfig.compile_cache
"auto" defers to JAX_ENABLE_COMPILATION_CACHE): nothing is written to the user's cache directory, and compile
times are what a cold start pays. Tests of the cache name a temporary directory instead."""
from __future__ import annotations

import os

os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", False)
