"""Attention and linear kernels (layer L2, subpackages included): import jax only, never flax or the model.

At the top: the contracts and their jnp references (attention, linear, fp8), sequence-parallel attention (ring,
ulysses), the hardware probes (hardware), the backends that choose between kernels (backends, pallas_backend) and
the GEMV kernels and page writers the model and the device cache receive (kernels).
The kernels sit in the folder of their lowering: mosaic_gpu/ (Pallas, Mosaic GPU), triton/ (Pallas, Triton; JAX
has deprecated it), cudnn/ (cuDNN). docs/architecture.md has the map."""
