#!/bin/bash
# 2x H200 call N (nvidia-h200-x2): PREPARED in session 3, not run yet. Call L again (call-l.sh: the bench rows,
# then the 2-GPU tests), now with the paged kernel fixed (block_tokens) and 300 s for the tests. Predictions: all
# 6 mesh tests pass; the 70B 8-layer rows run (planned 14.4 GiB per GPU at 2x1, 22.9 at 1x2); ring scaling 1 -> 2
# GPUs at 64K tokens per GPU near 100% (ring_hidden: true); zigzag faster than plain by up to ~1.3x at 2 GPUs
# (plain's second device does 3 of the 4 causal quarters).
CALL=n TESTS_S=300 exec bash "$(dirname "$0")/call-l.sh"
