"""The Flax (NNX) LLaMA model (layer L3)."""
