"""A bounded check of a GGUF file's header, before the gguf package's reader sees it.

gguf.GGUFReader trusts the counts it reads: an array that claims 2^40 elements in a 109-byte file keeps it
reading (and allocating) for as long as memory lasts. Here every count and length is checked against the bytes
left in the file before anything is read past it, fixed-size arrays are skipped, not read, and tensor shapes,
types and data offsets must lie inside the file: reading a header costs time linear in its size and memory
independent of the counts it claims. Anything malformed is a one-line CheckpointError naming the field.

GGUF v2/v3 layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; metadata
(string key, u32 type, value); tensor infos (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64
offset); padding to `general.alignment` (32); tensor data. A string is a u64 length and that many bytes; an array
a u32 item type, a u64 count and the items.
"""
from __future__ import annotations

import os
import struct

from lcjax.checkpoint.layout import CheckpointError

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # value type -> bytes
_STRING, _ARRAY = 8, 9
_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
MAX_DIMS = 4                   # GGML_MAX_DIMS
MAX_DEPTH = 3                  # arrays of arrays nest at most this deep
MAX_KEY = 1 << 16              # bytes of a metadata key or tensor name


class _Reader:
  def __init__(self, f, size: int, path: str):
    self.f, self.size, self.path, self.pos = f, size, path, 0

  def fail(self, what: str) -> CheckpointError:
    return CheckpointError(f"{self.path}: malformed GGUF header: {what} (at byte {self.pos} of {self.size})")

  def left(self) -> int:
    return self.size - self.pos

  def take(self, n: int, what: str) -> bytes:
    if n > self.left():
      raise self.fail(f"{what} needs {n} bytes, {self.left()} are left")
    data = self.f.read(n)
    self.pos += n
    return data

  def skip(self, n: int, what: str) -> None:
    if n > self.left():
      raise self.fail(f"{what} needs {n} bytes, {self.left()} are left")
    self.pos += n
    self.f.seek(self.pos)

  def u32(self, what: str) -> int:
    return struct.unpack("<I", self.take(4, what))[0]

  def u64(self, what: str) -> int:
    return struct.unpack("<Q", self.take(8, what))[0]

  def string(self, what: str, limit: int | None = None, keep: bool = True) -> str | None:
    n = self.u64(f"the length of {what}")
    if limit is not None and n > limit:
      raise self.fail(f"{what} of {n} bytes (at most {limit})")
    if not keep:
      self.skip(n, what)
      return None
    raw = self.take(n, what)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise self.fail(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None

  def value(self, vtype: int, key: str, depth: int = 0):
    """Read (scalars and strings) or skip (arrays) one metadata value; returns integer scalars, else None."""
    if vtype in _SCALARS:
      raw = self.take(_SCALARS[vtype], f"the value of {key}")
      return struct.unpack(_INTS[vtype], raw)[0] if vtype in _INTS else None
    if vtype == _STRING:
      self.string(f"the value of {key}", keep=False)
      return None
    if vtype != _ARRAY:
      raise self.fail(f"{key} has value type {vtype} (GGUF defines 0..12)")
    if depth >= MAX_DEPTH:
      raise self.fail(f"{key} nests arrays more than {MAX_DEPTH} deep")
    item = self.u32(f"the item type of {key}")
    count = self.u64(f"the length of {key}")
    least = _SCALARS.get(item, 8 if item == _STRING else 12 if item == _ARRAY else None)
    if least is None:
      raise self.fail(f"{key} is an array of type {item} (GGUF defines 0..12)")
    if count > self.left() // least:
      raise self.fail(f"{key} claims {count} items of at least {least} bytes, {self.left()} bytes are left")
    if item in _SCALARS:
      self.skip(count * least, f"the items of {key}")
    else:
      for _ in range(count):
        self.value(item, key, depth + 1)
    return None


def check_gguf_header(path: str, ggml_sizes: dict) -> None:
  """Refuse (CheckpointError) a GGUF file whose header does not hold together: counts or lengths past the end of
  the file, unknown value or tensor types, tensors of more than MAX_DIMS dims or whose data lies outside the file.
  ggml_sizes: ggml tensor type -> (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    r = _Reader(f, size, path)
    magic = r.take(4, "the magic") if size >= 4 else b""
    if magic != b"GGUF":
      raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    version = r.u32("the version")
    if version not in (2, 3):
      raise r.fail(f"version {version} (lcjax reads GGUF versions 2 and 3)")
    n_tensors, n_kv = r.u64("the tensor count"), r.u64("the metadata count")
    if n_kv > r.left() // 13:                 # key length 8 + 1 byte, type 4, a value of at least 1 byte
      raise r.fail(f"{n_kv} metadata entries claimed, {r.left()} bytes are left")
    alignment = 32
    for i in range(n_kv):
      key = r.string(f"metadata key {i}", MAX_KEY)
      value = r.value(r.u32(f"the type of {key}"), key)
      if key == "general.alignment":
        if value is None or value < 1 or value & (value - 1) or value > 1 << 20:
          raise r.fail(f"general.alignment={value} (a power of two up to 2^20)")
        alignment = value
    if n_tensors > r.left() // 28:             # name 8 + 1, n_dims 4, one dim 8, type 4, offset 8 (minus padding)
      raise r.fail(f"{n_tensors} tensors claimed, {r.left()} bytes are left")
    tensors = []
    for i in range(n_tensors):
      name = r.string(f"tensor name {i}", MAX_KEY)
      n_dims = r.u32(f"the dims of tensor {name}")
      if not 1 <= n_dims <= MAX_DIMS:
        raise r.fail(f"tensor {name} has {n_dims} dims (1..{MAX_DIMS})")
      dims = [r.u64(f"the shape of tensor {name}") for _ in range(n_dims)]
      ttype, offset = r.u32(f"the type of tensor {name}"), r.u64(f"the offset of tensor {name}")
      if ttype not in ggml_sizes:
        raise r.fail(f"tensor {name} has ggml type {ttype}, which the gguf package does not know")
      tensors.append((name, dims, ttype, offset))
    data_start = -(-r.pos // alignment) * alignment
    for name, dims, ttype, offset in tensors:
      count = 1
      for d in dims:
        count *= d
      block, block_bytes = ggml_sizes[ttype]
      if count == 0 or count % block:
        raise r.fail(f"tensor {name} has shape {dims}: {count} elements, not a positive multiple of its type's "
                     f"block of {block}")
      end = data_start + offset + count // block * block_bytes
      if end > size:
        raise r.fail(f"tensor {name} {dims} at offset {offset} needs bytes up to {end}, the file has {size}")
