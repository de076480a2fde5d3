"""Kernels in Pallas' Triton lowering (layer L2), which JAX has deprecated: the split-K paged decode and its split
combine (paged), the fp8 GEMV of decode-sized products (gemv), the fp8 page write (page_write).

Dropping the lowering is this folder and its choices in the kernel table (lcjax.engine.serving), once the modules
outside it that import it have other kernels for those calls: lcjax.ops.pallas_backend (decode rows off Hopper),
lcjax.ops.mosaic_gpu.paged (the split combine), lcjax.ops.kernels (the fp8 GEMV and the page write, which the
model and the cache receive). tests/test_layers.py holds that list."""
