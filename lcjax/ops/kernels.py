"""The kernels the model and the device cache receive as objects, as they receive the attention backend
(lcjax.ops.backends): a GEMV kernel multiplies fp8 weights in decode-sized calls (Llama(gemv_kernel=...)), a page
writer writes a decode step's K and V into fp8 pages (Llama(page_writer=...), lcjax.cache.kv.write_kv). Each is a
frozen (hashable) dataclass, so it sits in a jitted model as static structure, and calls its kernel module when
called (a test that replaces the module's function sees the calls).

`GEMV_KERNELS` and `PAGE_WRITERS` hold one object per name of lcjax.config's GEMV_NAMES and PAGE_WRITER_NAMES
but "xla"; "xla" is None (the model's and the cache's own XLA ops), what `gemv_kernel` and `page_writer` return
for it. `why_not(...)` returns why a kernel cannot serve here (or None), so lcjax.engine.placement can refuse a
kernel asked for by name and let "auto" take the next.

Legend: L layers, P pages, Z page size, K kv heads, H head dim, B rows.
"""
from __future__ import annotations

import dataclasses

from lcjax.config import GEMV_NAMES, PAGE_WRITER_NAMES
from lcjax.ops import hardware
from lcjax.ops.mosaic_gpu import gemv as mgpu_gemv
from lcjax.ops.mosaic_gpu import page_write as mgpu_page_write
from lcjax.ops.triton import gemv as triton_gemv
from lcjax.ops.triton import page_write as triton_page_write
from lcjax.ops.triton import paged as triton_paged


@dataclasses.dataclass(frozen=True)
class MosaicGemv:
  """lcjax.ops.mosaic_gpu.gemv's kernel on the stacked fp8 weights (a Hopper GPU; no interpreter)."""
  name = "mosaic"
  description = "the Mosaic GPU fp8 GEMV kernel (lcjax.ops.mosaic_gpu.gemv)"
  interpret = False

  def why_not(self, products: dict[str, tuple[int, int]]) -> str | None:
    """Why the kernel cannot run here, or multiply one of `products` ({weight name: (N, Kd)}, the products each
    device runs), naming the first such weight; None: it can."""
    bad = [f"{name}: {why}" for name, (N, Kd) in products.items() if (why := mgpu_gemv.unsupported_shape(N, Kd))]
    return mgpu_gemv.unsupported() or (bad[0] if bad else None)

  def __call__(self, x, w8, scale, layer, spec: str, *, dtype=None):
    """einsum(spec, x, w8[layer] * scale[layer]) in `dtype` (None: x's dtype): x of at most
    lcjax.ops.linear.WIDEN_MAX_ROWS rows, w8 [L, ...] e4m3 and scale [L, ...] float32 stacked K-major weights,
    layer a traced int scalar."""
    return mgpu_gemv.gemv_stacked(x, w8, scale, layer, spec, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class TritonGemv:
  """lcjax.ops.triton.gemv's kernel on the stacked fp8 weights (a CUDA GPU of sm_89+), or with `interpret` the same
  kernel in the Pallas interpreter (any device)."""
  interpret: bool = False

  @property
  def name(self) -> str:
    return "pallas-interpret" if self.interpret else "pallas"

  @property
  def description(self) -> str:
    return ("the fp8 GEMV kernel in the Pallas interpreter" if self.interpret
            else "the fp8 GEMV kernel (lcjax.ops.triton.gemv)")

  def why_not(self, products: dict[str, tuple[int, int]]) -> str | None:
    """Why the kernel cannot run here (None: it can); it multiplies `products` of any shape."""
    return hardware.pallas_triton_reason() if self.interpret else triton_gemv.unsupported()

  def __call__(self, x, w8, scale, layer, spec: str, *, dtype=None):
    """As MosaicGemv.__call__."""
    return triton_gemv.gemv_stacked(x, w8, scale, layer, spec, interpret=self.interpret, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class TritonPageWriter:
  """lcjax.ops.triton.page_write's kernel: a decode step's K, V and both page scales in one kernel, bit for bit
  lcjax.cache.kv's XLA write (a CUDA GPU of sm_89+), or with `interpret` in the Pallas interpreter."""
  interpret: bool = False

  @property
  def name(self) -> str:
    return "pallas-interpret" if self.interpret else "pallas"

  def why_not(self, page_size: int, head_dim: int) -> str | None:
    """Why the kernel cannot write pages of this shape here (None: it can)."""
    if self.interpret:
      return hardware.pallas_triton_reason() or triton_page_write.unsupported_shape(page_size, head_dim)
    return triton_page_write.unsupported(page_size, head_dim)

  def __call__(self, k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, layer):
    """Row b's token k_new[b], v_new[b] [K, H] into local page page[b] (Pl: written nowhere) at offset[b] of layer
    `layer` of fp8 pools [L, Pl, Z, K, H] with scales [L, Pl, K]. Returns (k_pool, v_pool, k_scale, v_scale)."""
    return triton_page_write.write_token(k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, layer,
                                         interpret=self.interpret)


@dataclasses.dataclass(frozen=True)
class MosaicPageWriter:
  """lcjax.ops.mosaic_gpu.page_write's kernel: TritonPageWriter's contract and bytes in Mosaic GPU (a Hopper GPU,
  JAX 0.11+)."""
  name = "mosaic"
  interpret = False

  def why_not(self, page_size: int, head_dim: int) -> str | None:
    """Why the kernel cannot write pages of this shape here (None: it can)."""
    return mgpu_page_write.unsupported(page_size, head_dim)

  def __call__(self, k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, layer):
    """As TritonPageWriter.__call__."""
    return mgpu_page_write.write_token(k_pool, v_pool, k_scale, v_scale, k_new, v_new, page, offset, layer)


@dataclasses.dataclass(frozen=True)
class TritonFp8Decode:
  """lcjax.ops.triton.paged's split-K decode kernel over fp8 pages (K and V widened to float16 in the kernel): the
  decode rows of a CUDA GPU of sm_89+ whose attention backend reads no fp8 pages itself (cuDNN, on GPUs without
  the Mosaic GPU kernels), or with `interpret` in the Pallas interpreter."""
  interpret: bool = False
  name = "triton"

  def why_not(self, page_size: int, head_dim: int) -> str | None:
    """Why the kernel cannot read fp8 pages of this shape here (None: it can)."""
    reason = None if self.interpret else hardware.fp8_convert_reason("Triton fp8 paged decode kernel")
    return reason or hardware.pallas_triton_reason() or triton_paged.unsupported_shape(page_size, head_dim)

  def __call__(self, q, k_pages, v_pages, page_table, *, q_pos, kv_len, k_scale, v_scale):
    """(out [B, T, N, H], lse [B, T, N]) of q [B, T, N, H] over fp8 pools [P, Z, K, H] with scales [P, K] through
    page_table [B, M] (lcjax.ops.attention's paged contract)."""
    return triton_paged.paged_decode(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kv_len, k_scale=k_scale,
                                     v_scale=v_scale, interpret=self.interpret)


# By name (lcjax.engine.placement picks among them: the GEMVs in this order, the page writers by
# AUTO_PAGE_WRITERS).
GEMV_KERNELS = {k.name: k for k in (MosaicGemv(), TritonGemv(), TritonGemv(interpret=True))}
PAGE_WRITERS = {k.name: k for k in (TritonPageWriter(), MosaicPageWriter(), TritonPageWriter(interpret=True))}


def _by_name(table: dict, names: tuple[str, ...], what: str, name: str):
  if name not in names:
    raise ValueError(f"{what}={name!r} must be one of {', '.join(names)}")
  return None if name == "xla" else table[name]


def gemv_kernel(name: str) -> MosaicGemv | TritonGemv | None:
  """The GEMV kernel called `name` (lcjax.config.GEMV_NAMES); None for "xla"."""
  return _by_name(GEMV_KERNELS, GEMV_NAMES, "gemv_kernel", name)


def page_writer(name: str) -> TritonPageWriter | MosaicPageWriter | None:
  """The page writer called `name` (lcjax.config.PAGE_WRITER_NAMES); None for "xla"."""
  return _by_name(PAGE_WRITERS, PAGE_WRITER_NAMES, "page_writer", name)
