"""Kernels in Pallas' Mosaic GPU lowering (layer L2; Hopper, sm_90): flash attention in bf16 and FP8 (flash), decode
over fp8 pages (paged), the fp8 GEMV of decode-sized products (gemv), and the shared-memory tiling and TMA ring
helpers they share (common)."""
