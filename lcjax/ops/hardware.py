"""The hardware probes: what the device this process runs on can compile, asked by every lowering's kernels
(lcjax.ops.triton, lcjax.ops.mosaic_gpu) and by the backends that choose between them (lcjax.ops.pallas_backend).

Each returns why a kernel cannot run here (a sentence naming what it needs and what this machine has), or None."""
from __future__ import annotations

import functools
import importlib

import jax


def compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the first device on a CUDA GPU; None elsewhere."""
  cc = getattr(jax.devices()[0], "compute_capability", None) if jax.default_backend() == "gpu" else None
  return None if cc is None else tuple(int(x) for x in str(cc).split(".")[:2])


def fp8_convert_reason(kernel: str) -> str | None:
  """Why `kernel` (named in the message) cannot be compiled here (None: it can): it needs a CUDA GPU that converts
  e4m3 in hardware (sm_89+; measured on sm_90)."""
  if jax.default_backend() != "gpu":
    return f"the {kernel} needs a CUDA GPU, not {jax.default_backend()!r}"
  cc = compute_capability()
  if cc is None or cc < (8, 9):
    return f"the {kernel} needs a CUDA GPU of compute capability 8.9 or later, got {cc}"
  return None


def sm90_fp8_reason(kernel: str, uses: str) -> str | None:
  """Why `kernel` (named in the message) cannot be compiled here (None: it can): it converts e4m3
  (`fp8_convert_reason`) and uses Hopper's `uses` (wgmma, TMA), so it needs sm_90."""
  reason = fp8_convert_reason(kernel)
  cc = compute_capability()
  if not reason and cc[0] != 9:
    return f"the {kernel} needs a Hopper GPU (sm_90, {uses}), not compute capability {cc}"
  return reason


@functools.cache
def pallas_triton_reason() -> str | None:
  """Why this JAX cannot lower Pallas kernels through Triton (None: it can), asked as JAX's own GPU lowering asks:
  by importing its Triton registration (which needs jaxlib's Triton dialect). JAX deprecated that lowering in 0.11
  and will remove it. The kernels of lcjax.ops.triton need it; at the presets' shapes no Hopper default does."""
  try:
    importlib.import_module("jax._src.pallas.triton.pallas_call_registration")
  except ImportError as e:
    return f"this JAX ({jax.__version__}) has no Pallas Triton lowering ({e})"
  return None


def sm_count() -> int:
  """Streaming multiprocessors of the default device (132 on an H100 SXM or H200; 132 where the device does not
  say): the Mosaic GPU kernels size their grids by it."""
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def jax_at_least(major: int, minor: int) -> bool:
  """Whether this JAX is major.minor or later (what the Mosaic GPU lowering and interpreter can do changes with it)."""
  return tuple(map(int, jax.__version__.split(".")[:2])) >= (major, minor)


def on_sm90() -> str | None:
  """Why the Mosaic GPU kernels built on wgmma (the decode kernels, the paged flash kernel) cannot run here: wgmma
  needs sm_90a exactly (Blackwell has none). None: they can."""
  if jax.default_backend() != "gpu":
    return f"needs a CUDA GPU; jax.default_backend()={jax.default_backend()!r}"
  cc = compute_capability()
  if cc is None or cc[0] != 9:
    return f"the Mosaic GPU kernels' wgmma needs a Hopper GPU (sm_90), got compute capability {cc}"
  return None
