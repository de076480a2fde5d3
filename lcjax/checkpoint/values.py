"""Checks on the values of fp8 checkpoint tensors, which a header cannot show: every weight and input scale finite
and > 0, every float8_e4m3fn tensor free of NaN.

An inf scale turns every logit NaN, a NaN, zero or negative one yields finite but wrong logits, and a NaN byte of
e4m3 (0x7F or 0xFF; the format has no infinities) poisons every product it enters. The converters call these on
the arrays they read anyway: the scales are a few floats per output channel, the e4m3 check is one vectorized
pass over the bytes in chunks of CHUNK (no copy of the tensor).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from lcjax.checkpoint.layout import CheckpointError

CHUNK = 1 << 18               # bytes of an e4m3 tensor compared at a time (temporaries that stay in cache)
# A scale lcjax multiplies (weights) or divides by (activations) in float32: at least float32's smallest normal,
# and small enough that a weight of 448 (e4m3's largest) times it stays finite.
SCALE_MIN = float(np.finfo(np.float32).tiny)
SCALE_MAX = float(np.finfo(np.float32).max) / 448.0


def bad_scale(scale: np.ndarray) -> tuple[int, float] | None:
  """(flat index, value) of the first entry of `scale` outside [SCALE_MIN, SCALE_MAX] (NaN included), or None."""
  s = np.asarray(scale, np.float32).reshape(-1)
  bad = np.flatnonzero(~((s >= SCALE_MIN) & (s <= SCALE_MAX)))
  return (int(bad[0]), float(s[bad[0]])) if bad.size else None


def check_scale(scale: np.ndarray, where: str) -> None:
  """Refuse a weight or input scale with an entry that is not finite and > 0 (one line naming `where`, the entry
  and its value)."""
  bad = bad_scale(scale)
  if bad is not None:
    i, v = bad
    raise CheckpointError(f"{where}: scale {v} at index {i} of {np.size(scale)} is outside [{SCALE_MIN:.3g}, "
                          f"{SCALE_MAX:.3g}] (fp8 scales multiply the weights and divide the activations in float32; "
                          "the checkpoint is corrupt)")


def nan_e4m3(w: np.ndarray) -> int | None:
  """Flat index of the first NaN (byte 0x7F or 0xFF) of a float8_e4m3fn array, or None."""
  b = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
  low = np.empty(min(CHUNK, b.size), np.uint8)
  for start in range(0, b.size, CHUNK):
    chunk = b[start:start + CHUNK]
    np.bitwise_and(chunk, 0x7F, out=low[:chunk.size])
    hit = low[:chunk.size] == 0x7F
    if hit.any():
      return start + int(np.argmax(hit))
  return None


def check_e4m3(w: np.ndarray, where: str) -> None:
  """Refuse a float8_e4m3fn tensor that holds a NaN (one line naming `where` and the element)."""
  i = nan_e4m3(w)
  if i is not None:
    at = tuple(int(j) for j in np.unravel_index(i, w.shape))
    byte = int(np.asarray(w).reshape(-1)[i:i + 1].view(np.uint8)[0])
    raise CheckpointError(f"{where}: element {at} of the float8_e4m3fn tensor is NaN (byte 0x{byte:02X}); the "
                          "checkpoint is corrupt")


def cast_finite(x: np.ndarray, dtype, where: str) -> np.ndarray:
  """`x` cast to `dtype`, refusing (one line naming `where`, the element and its value) a finite value the cast
  turns infinite: past float16's largest (65504) or bfloat16's. Checked only where `dtype`'s range is narrower
  than `x`'s."""
  dtype = np.dtype(dtype)
  y = x.astype(dtype)
  if dtype == x.dtype or dtype.kind not in "fV" or ml_dtypes.finfo(dtype).max >= ml_dtypes.finfo(x.dtype).max:
    return y
  flat_x, flat_y = (x, y) if x.ndim else (x.reshape(1), y.reshape(1))
  step = max(1, CHUNK // max(1, int(np.prod(flat_y.shape[1:]))))      # rows at a time: small temporaries
  for start in range(0, flat_y.shape[0], step):
    bad = np.argwhere(np.isinf(flat_y[start:start + step]) & np.isfinite(flat_x[start:start + step]))
    if bad.size:
      at = (start + int(bad[0][0]), *(int(j) for j in bad[0][1:]))
      raise CheckpointError(f"{where}: element {at[:x.ndim]} = {float(flat_x[at])} is past {dtype}'s largest "
                            f"value ({float(ml_dtypes.finfo(dtype).max)}): convert to a wider dtype")
  return y
