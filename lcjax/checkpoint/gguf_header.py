"""A GGUF file's header, read with bounds: metadata, tensor infos and where the tensor data starts.

Every count and length is checked against the bytes left in the file before anything is read past it: an array
that claims 2^40 elements in a 109-byte file is refused, not allocated (the gguf package's GGUFReader trusts such
counts and keeps reading for as long as memory lasts). The walk over the header keeps only each metadata value's
type and byte offset; a value is decoded when it is asked for (GGUFHeader.value), so reading a header costs time
linear in its size and memory independent of the counts it claims. Tensor shapes, types and data offsets must lie
inside the file, keys and tensor names must be unique. Anything malformed is a one-line CheckpointError naming the
field.

GGUF v2/v3 layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; metadata
(string key, u32 type, value); tensor infos (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64
offset); padding to `general.alignment` (32); tensor data. A string is a u64 length and that many bytes; an array
a u32 item type, a u64 count and the items.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Any, NamedTuple

import numpy as np

from lcjax.checkpoint.layout import CheckpointError

# value type -> (bytes, struct format, numpy dtype of an array of them)
_SCALARS = {0: (1, "<B", "<u1"), 1: (1, "<b", "<i1"), 2: (2, "<H", "<u2"), 3: (2, "<h", "<i2"),
            4: (4, "<I", "<u4"), 5: (4, "<i", "<i4"), 6: (4, "<f", "<f4"), 7: (1, "<?", "?"),
            10: (8, "<Q", "<u8"), 11: (8, "<q", "<i8"), 12: (8, "<d", "<f8")}
_INTS = (0, 1, 2, 3, 4, 5, 10, 11)
_UINT32, _STRING, _ARRAY = 4, 8, 9
MAX_DIMS = 4                   # GGML_MAX_DIMS
MAX_DEPTH = 3                  # arrays of arrays nest at most this deep
MAX_KEY = 1 << 16              # bytes of a metadata key or tensor name


class GGUFTensorInfo(NamedTuple):
  """A tensor's entry in the header. shape: the dims as GGUF lists them (innermost first); offset: the file offset
  of its data; nbytes: the data's size."""
  name: str
  shape: tuple[int, ...]
  ggml_type: int
  offset: int
  nbytes: int


class _Reader:
  def __init__(self, buf, size: int, path: str, pos: int = 0):
    self.buf, self.size, self.path, self.pos = buf, size, path, pos

  def fail(self, what: str) -> CheckpointError:
    return CheckpointError(f"{self.path}: malformed GGUF header: {what} (at byte {self.pos} of {self.size})")

  def left(self) -> int:
    return self.size - self.pos

  def need(self, n: int, what: str) -> int:
    """The current position, advanced past n bytes that must be in the file."""
    if n > self.left():
      raise self.fail(f"{what} needs {n} bytes, {self.left()} are left")
    at, self.pos = self.pos, self.pos + n
    return at

  def scalar(self, vtype: int, what: str):
    n, fmt, _ = _SCALARS[vtype]
    return struct.unpack_from(fmt, self.buf, self.need(n, what))[0]

  def u32(self, what: str) -> int:
    return self.scalar(4, what)

  def u64(self, what: str) -> int:
    return self.scalar(10, what)

  def raw_string(self, what: str, limit: int | None = None) -> bytes | None:
    """A string's bytes (None: skipped, limit None)."""
    n = self.u64(f"the length of {what}")
    if limit is not None and n > limit:
      raise self.fail(f"{what} of {n} bytes (at most {limit})")
    at = self.need(n, what)
    return None if limit is None else self.buf[at:at + n]

  def name(self, what: str) -> str:
    """A key or tensor name (UTF-8, at most MAX_KEY bytes)."""
    raw = self.raw_string(what, MAX_KEY)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise self.fail(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None

  def skip_value(self, vtype: int, key: str, depth: int = 0) -> None:
    """Walk past one metadata value, checking its counts and types against the bytes left."""
    if vtype in _SCALARS:
      self.need(_SCALARS[vtype][0], f"the value of {key}")
      return
    if vtype == _STRING:
      self.raw_string(f"the value of {key}")
      return
    if vtype != _ARRAY:
      raise self.fail(f"{key} has value type {vtype} (GGUF defines 0..12)")
    if depth >= MAX_DEPTH:
      raise self.fail(f"{key} nests arrays more than {MAX_DEPTH} deep")
    item = self.u32(f"the item type of {key}")
    count = self.u64(f"the length of {key}")
    least = _SCALARS[item][0] if item in _SCALARS else 8 if item == _STRING else 12 if item == _ARRAY else None
    if least is None:
      raise self.fail(f"{key} is an array of type {item} (GGUF defines 0..12)")
    if count > self.left() // least:
      raise self.fail(f"{key} claims {count} items of at least {least} bytes, {self.left()} bytes are left")
    if item in _SCALARS:
      self.need(count * least, f"the items of {key}")
    else:
      for _ in range(count):
        self.skip_value(item, key, depth + 1)

  def value(self, vtype: int, key: str) -> Any:
    """One metadata value, walked by skip_value before: a Python scalar, str (UnicodeDecodeError when its bytes
    are not UTF-8) or list."""
    if vtype in _SCALARS:
      return self.scalar(vtype, f"the value of {key}")
    if vtype == _STRING:
      n = self.u64(f"the length of the value of {key}")
      at = self.need(n, f"the value of {key}")
      return str(self.buf[at:at + n], "utf-8")
    item, count = self.u32(f"the item type of {key}"), self.u64(f"the length of {key}")
    if item in _SCALARS:
      at = self.need(count * _SCALARS[item][0], f"the items of {key}")
      return np.frombuffer(self.buf, _SCALARS[item][2], count, at).tolist()
    return [self.value(item, key) for _ in range(count)]


class GGUFHeader:
  """A GGUF file's header (read_gguf_header): `fields` maps each metadata key to its value type and the byte
  offset of its value, `tensors` each tensor name to its GGUFTensorInfo, in the file's order."""

  def __init__(self, path: str, buf, size: int, version: int, fields: dict[str, tuple[int, int]],
               tensors: dict[str, GGUFTensorInfo]):
    self.path, self._buf, self.size, self.version = path, buf, size, version
    self.fields, self.tensors = fields, tensors

  def value(self, key: str) -> Any:
    """The value of metadata `key` (KeyError when absent): ints, floats and bools as Python scalars, strings as
    str (UnicodeDecodeError when not UTF-8), arrays as lists."""
    vtype, at = self.fields[key]
    return _Reader(self._buf, self.size, self.path, at).value(vtype, key)

  def tensor_bytes(self, name: str) -> np.ndarray:
    """Tensor `name`'s data: a read-only uint8 view of the memory-mapped file."""
    t = self.tensors[name]
    return np.frombuffer(self._buf, np.uint8, t.nbytes, t.offset)


def read_gguf_header(path: str, ggml_sizes: dict) -> GGUFHeader:
  """The header of the GGUF file at `path`, or a CheckpointError when it does not hold together: counts or lengths
  past the end of the file, unknown value or tensor types, a key or tensor name twice, tensors of more than MAX_DIMS
  dims, whose rows are not whole blocks of their type or whose data lies outside the file.
  ggml_sizes: ggml tensor type -> (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    magic = f.read(4)
    if magic != b"GGUF":
      raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  r = _Reader(buf, size, path, 4)
  version = r.u32("the version")
  if version not in (2, 3):
    raise r.fail(f"version {version} (lcjax reads GGUF versions 2 and 3)")
  n_tensors, n_kv = r.u64("the tensor count"), r.u64("the metadata count")
  if n_kv > r.left() // 13:                 # key length 8 + 1 byte, type 4, a value of at least 1 byte
    raise r.fail(f"{n_kv} metadata entries claimed, {r.left()} bytes are left")
  alignment = 32
  fields: dict[str, tuple[int, int]] = {}
  for i in range(n_kv):
    key = r.name(f"metadata key {i}")
    if key in fields:
      raise r.fail(f"metadata key {key} appears twice")
    vtype = r.u32(f"the type of {key}")
    fields[key] = (vtype, r.pos)
    if key == "general.alignment":
      if vtype != _UINT32:
        raise r.fail(f"general.alignment has value type {vtype}, not uint32 ({_UINT32})")
      alignment = r.u32(f"the value of {key}")
      if alignment < 1 or alignment & (alignment - 1) or alignment > 1 << 20:
        raise r.fail(f"general.alignment={alignment} (a power of two up to 2^20)")
    else:
      r.skip_value(vtype, key)
  if n_tensors > r.left() // 28:             # name 8 + 1, n_dims 4, one dim 8, type 4, offset 8 (minus padding)
    raise r.fail(f"{n_tensors} tensors claimed, {r.left()} bytes are left")
  infos = []
  for i in range(n_tensors):
    name = r.name(f"tensor name {i}")
    n_dims = r.u32(f"the dims of tensor {name}")
    if not 1 <= n_dims <= MAX_DIMS:
      raise r.fail(f"tensor {name} has {n_dims} dims (1..{MAX_DIMS})")
    dims = tuple(r.u64(f"the shape of tensor {name}") for _ in range(n_dims))
    ttype, offset = r.u32(f"the type of tensor {name}"), r.u64(f"the offset of tensor {name}")
    if ttype not in ggml_sizes:
      raise r.fail(f"tensor {name} has ggml type {ttype}, which the gguf package does not know")
    infos.append((name, dims, ttype, offset))
  data_start = -(-r.pos // alignment) * alignment
  tensors: dict[str, GGUFTensorInfo] = {}
  for name, dims, ttype, offset in infos:
    if name in tensors:
      raise r.fail(f"tensor name {name} appears twice")
    count = 1
    for d in dims:
      count *= d
    block, block_bytes = ggml_sizes[ttype]
    if count == 0 or dims[0] % block:
      raise r.fail(f"tensor {name} has shape {list(dims)}: {count} elements in rows of {dims[0]}, not positive "
                   f"whole blocks of its type's {block}")
    nbytes = count // block * block_bytes
    end = data_start + offset + nbytes
    if end > size:
      raise r.fail(f"tensor {name} {list(dims)} at offset {offset} needs bytes up to {end}, the file has {size}")
    tensors[name] = GGUFTensorInfo(name, dims, ttype, data_start + offset, nbytes)
  return GGUFHeader(path, buf, size, version, fields, tensors)
