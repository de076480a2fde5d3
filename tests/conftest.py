"""Shared pytest setup. Mesh tests need 8 devices: fake them on the CPU before jax creates its backends.
(The slow and gpu markers are registered in pyproject.toml.)"""
from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)
