"""The weights digest: a hash of every bit of every parameter, computed where the shards are.

The digest is part of an engine's fingerprint (lcjax.engine.context_file.fingerprint): a saved context loads only
on an engine whose weights hash the same, on any mesh.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}   # itemsize -> the bit pattern's type
_LANES = (0x243F6A88, 0x85A308D3)         # one seed per 32-bit lane of a parameter's digest


def fmix32(h):
  """MurmurHash3's finalizer: a bijection of uint32 that spreads every input bit over the output."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def bits_checksum(x) -> jax.Array:
  """[2] uint32: over every element of x, the sum mod 2^32 of fmix32(bits ^ fmix32(position * c + seed)), one
  seed per lane. A change of any one element changes its term (fmix32 is a bijection), so the sum; a swap or a
  move of values changes the terms' positions. Integer sums mod 2^32 do not depend on their order: the same value
  on every mesh, computed where the shards are."""
  bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)   # 8 bytes: [..., 2]
  pos = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(bits.ndim)):
    pos = pos + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride % 2**32)
    stride *= bits.shape[d]
  return jnp.stack([jnp.sum(fmix32(bits ^ fmix32(pos * jnp.uint32(0x9E3779B1) + jnp.uint32(seed))),
                            dtype=jnp.uint32) for seed in _LANES])


_weights_checksums = jax.jit(lambda state: [bits_checksum(leaf) for leaf in jax.tree.leaves(state)])


def weights_digest(params) -> str:
  """A digest of every bit of every parameter (its name, shape and dtype too), from checksums computed on the
  device (`bits_checksum`): the same on any mesh, different for weights that differ in any element."""
  h = hashlib.blake2b(digest_size=16)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  for (path, leaf), sums in zip(leaves, _weights_checksums(params)):
    h.update(f"{jax.tree_util.keystr(path)}:{tuple(leaf.shape)}:{leaf.dtype};".encode())
    h.update(np.asarray(sums).tobytes())
  return h.hexdigest()
