"""Attention kernels (layer L2): import jax only, never flax or the model."""
