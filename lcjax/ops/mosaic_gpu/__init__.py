"""Kernels in Pallas' Mosaic GPU lowering (layer L2; Hopper, sm_90): flash attention in bf16 and FP8, and over
pages (flash), split-K decode over fp8 and bf16 pages (paged) and its split combine (combine), the fp8 GEMV of
decode-sized products (gemv), the fp8 page write (page_write), and the shared-memory tiling and TMA ring helpers
they share (common)."""
