"""The cuDNN attention backend (layer L2): CudnnBackend and its decomposition of position patterns into cuDNN's
masks (backend), the cuDNN calls themselves and their jnp model (calls)."""
