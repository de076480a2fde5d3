"""Mosaic GPU pieces the Hopper kernels share (lcjax.ops.mosaic_gpu's flash, paged, gemv and combine): the shared-memory
tiling wgmma reads its operands in, the TMA warpgroup's ring of K/V shared-memory slots, and loads of a
shared-memory ref in a register layout.

Every function here runs while a kernel body is traced; the Pallas Mosaic GPU modules are imported inside them,
so this module imports on machines without a GPU.
"""
from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
from jax import lax

SM_SMEM_BYTES = 228 * 1024   # shared memory of a Hopper SM, shared by its resident CTAs (1 KiB of each reserved)
CTA_RESERVED_BYTES = 1024    # the shared memory the hardware keeps for each resident CTA


def resident_ctas(smem_bytes: int, reserved: int = CTA_RESERVED_BYTES) -> int:
  """CTAs of `smem_bytes` of shared memory each (plus `reserved`) that one Hopper SM holds at once."""
  return SM_SMEM_BYTES // (smem_bytes + reserved)


def smem_transforms(dtype, cols: int):
  """Shared-memory tiling of rows of `cols` elements in swizzled chunks of up to 128 bytes, the layout a wgmma
  reads its operands in (both operands share one swizzle)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  swizzle = min(128, cols * jnp.dtype(dtype).itemsize)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def prime_ring(issue, steps, slots: int):
  """issue(i, i) for the first min(steps, slots) steps of a ring of `slots` shared-memory slots."""
  import jax.experimental.pallas as pl
  for i in range(slots):
    pl.when(i < steps)(functools.partial(issue, i, i))


def fill_ring(issue, steps, slots: int, k_free, v_free):
  """A TMA warpgroup's loop: issue(i, slot) loads step i = 0 .. steps - 1 into a ring of `slots` shared-memory
  slots, the first `slots` at once, then each into slot i % slots once its K and V consumers released it."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  prime_ring(issue, steps, slots)

  @pl.loop(slots, jnp.maximum(steps, slots))
  def _(i):
    slot = lax.rem(i, jnp.array(slots, i.dtype))
    plgpu.barrier_wait(k_free.at[slot])
    plgpu.barrier_wait(v_free.at[slot])
    issue(i, slot)


def load(ref, layout):
  """plgpu.load of a whole shared-memory ref in `layout` (jax 0.11 takes the ref alone; 0.10 also an index)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)
