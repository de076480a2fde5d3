"""Checkpoint values that a header cannot show, refused in one line before they give silent wrong answers: fp8
weight and input scales that are not finite and > 0, NaN bytes of e4m3 weights, e4m3 tensors outside an fp8
quantization_config or without a scale, and safetensors spans that overlap or leave gaps.

The HF folders here are written byte by byte (tests.test_checkpoint_values.write_safetensors: the format's 8-byte
header length, JSON header, data), so a test can plant any value or offset; a well-formed folder converts (the
first test), so each refusal is the planted value's.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from lcjax.checkpoint import CheckpointError
from lcjax.checkpoint.hf import HF_NAMES, SafetensorsFile, convert_hf, hf_shape
from lcjax.checkpoint.layout import QUANTIZED, param_shapes
from lcjax.config import ModelConfig

CFG = ModelConfig("values-test", vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                  ffn_dim=64, max_position=128, bos_id=0, eos_ids=(1,))
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_CODES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", E4M3: "F8_E4M3"}


def write_safetensors(path: str, tensors: dict[str, np.ndarray], offsets: dict[str, list[int]] | None = None,
                      tail: bytes = b"") -> None:
  """A safetensors file of `tensors` in order, their data_offsets as laid out unless `offsets` names others, and
  `tail` appended after the data."""
  header, data = {}, b""
  for name, a in tensors.items():
    header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape), "data_offsets": [len(data), len(data) + a.nbytes]}
    data += a.tobytes()
  for name, o in (offsets or {}).items():
    header[name]["data_offsets"] = o
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + data + tail)


# -- safetensors spans: as the safetensors library, every byte of the data section belongs to one tensor ----------

_A, _B = np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)


@pytest.mark.parametrize("offsets,tail,names", [
    ({"b": [8, 24]}, b"", ["tensor b", "[8, 24]", "overlapping tensor a"]),     # b reads a's last 8 bytes
    ({"b": [0, 16]}, b"", ["overlapping tensor"]),                             # b is a's bytes
    ({"a": [16, 32], "b": [0, 16]}, b"", None),                                # out of order in the JSON: fine
    ({}, b"\0" * 8, ["end at byte 32 of a data section of 40"]),               # bytes no tensor owns
], ids=["overlap", "same-bytes", "json-order", "trailing"])
def test_safetensors_spans_tile_the_data_section(tmp_path, offsets, tail, names):
  path = str(tmp_path / "x.safetensors")
  write_safetensors(path, {"a": _A, "b": _B}, offsets, tail)
  if names is None:
    f = SafetensorsFile(path)
    np.testing.assert_array_equal(f.read("a"), _B)        # a's span is where b's bytes were written
    return
  with pytest.raises(CheckpointError) as e:
    SafetensorsFile(path)
  for n in names:
    assert n in str(e.value), str(e.value)


def test_a_gap_between_spans_is_refused(tmp_path):
  path = str(tmp_path / "x.safetensors")
  write_safetensors(path, {"a": _A, "b": _B}, {"b": [24, 40]}, b"\0" * 8)
  with pytest.raises(CheckpointError, match=r"leaving bytes \[16, 24\) after tensor a unused"):
    SafetensorsFile(path)
