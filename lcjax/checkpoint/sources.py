"""Where checkpoints come from: an lcjax checkpoint directory as it is, or an HF folder (config.json +
safetensors) or a GGUF file converted once into the user cache, as transformers' `from_pretrained` takes a folder.

The user cache is $LCJAX_CACHE_DIR, else $XDG_CACHE_HOME/lcjax, else ~/.cache/lcjax; the directories lcjax makes
in it are private to the user (0700, whatever the umask). A conversion is named by the source's absolute path and,
for every file in it, its size, modification and status-change times (ns), inode and a hash of its first and last
64 KiB and 16 blocks between, so an edited or replaced source converts again, one rewritten in place with its size
and mtime restored included (the write changes its ctime, which no user can set back, and the sampled bytes where
the edit touched them), and by the converters' version (CONVERTER_VERSION), so a conversion cached by an lcjax
whose converter wrote something else is not reused; conversions are atomic (lcjax.checkpoint.writer), so a killed
one leaves nothing that loads.
"""
from __future__ import annotations

import hashlib
import os
import sys

from lcjax.checkpoint.layout import MANIFEST_FILE, CheckpointError, checkpoint_format, load_config
from lcjax.config import ModelConfig, WeightFormat


def user_cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.environ.get("LCJAX_CACHE_DIR") or os.path.join(base, "lcjax")


def make_private_dir(path: str) -> str:
  """Create `path` and any missing parents as directories only the user can enter (0700, whatever the umask);
  directories that exist are left as they are. Returns the path."""
  path = os.path.abspath(path)
  missing = []
  while not os.path.isdir(path):
    missing.append(path)
    path = os.path.dirname(path)
  for d in reversed(missing):
    try:
      os.mkdir(d, 0o700)
    except FileExistsError:
      if not os.path.isdir(d):
        raise
      continue
    os.chmod(d, 0o700)
  return missing[0] if missing else path


def unsafe_dir(path: str) -> str | None:
  """Why a directory whose contents lcjax would run or load is unsafe: owned by another user, or writable by
  others (group or world); None when it is safe or absent."""
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return None
  if hasattr(os, "getuid") and st.st_uid != os.getuid():
    return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
  if st.st_mode & 0o022:
    who = {0o022: "its group and all users", 0o020: "its group", 0o002: "all users"}[st.st_mode & 0o022]
    return f"it is writable by {who} (mode {st.st_mode & 0o777:o})"
  return None


def _is_gguf(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(4) == b"GGUF"


# The converters' version, part of every conversion's name: raised whenever a converter writes something else for
# the same source (a fixed BOS id, a refused file), so conversions cached before are converted again.
CONVERTER_VERSION = 2

SAMPLE_EDGE = 1 << 16         # bytes hashed at each end of a source file (GGUF / safetensors headers live there)
SAMPLE_BLOCKS = 16            # blocks of SAMPLE_BLOCK bytes hashed at even spacing in between
SAMPLE_BLOCK = 1 << 12


def _hash_samples(h, path: str, size: int) -> None:
  """Feed `h` the first and last SAMPLE_EDGE bytes of a file and SAMPLE_BLOCKS evenly spaced blocks between
  them (all of a small file): ~200 KB read per file, whatever its size."""
  with open(path, "rb") as f:
    if size <= 2 * SAMPLE_EDGE + SAMPLE_BLOCKS * SAMPLE_BLOCK:
      h.update(f.read())
      return
    starts = [0, size - SAMPLE_EDGE] + [SAMPLE_EDGE + i * (size - 2 * SAMPLE_EDGE) // SAMPLE_BLOCKS
                                        for i in range(SAMPLE_BLOCKS)]
    for start in starts:
      f.seek(start)
      h.update(f.read(SAMPLE_EDGE if start in (0, size - SAMPLE_EDGE) else SAMPLE_BLOCK))


def _source_id(path: str) -> str:
  """A name for a conversion of `path`: its absolute path, the converters' version, and of every file in it the
  size, mtime, ctime, inode and a hash of sampled blocks (_hash_samples)."""
  path = os.path.abspath(path)
  files = [path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path))
  h = hashlib.blake2b(path.encode(), digest_size=8)
  h.update(f"converter {CONVERTER_VERSION};".encode())
  for f in files:
    if os.path.isfile(f):
      st = os.stat(f)
      h.update(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino};".encode())
      _hash_samples(h, f, st.st_size)
  stem = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
  return f"{stem}-{h.hexdigest()}"


def _kind(path: str) -> str:
  """"gguf", "hf" or "lcjax": what `path` holds."""
  if os.path.isfile(path):
    if not _is_gguf(path):
      raise CheckpointError(f"{path} is a file but not a GGUF file: give an lcjax checkpoint directory, an HF model "
                            "folder or a GGUF file")
    return "gguf"
  if os.path.isfile(os.path.join(path, "config.json")) and not os.path.exists(os.path.join(path, MANIFEST_FILE)):
    return "hf"
  return "lcjax"


def source_config(path) -> tuple[ModelConfig, WeightFormat]:
  """The ModelConfig and stored WeightFormat that `path` (an lcjax checkpoint, an HF folder or a GGUF file) holds or
  converts to, read from its config alone (config.json, the GGUF header): what a memory plan needs, known before
  anything is converted."""
  path = os.fspath(path)
  kind = _kind(path)
  if kind == "lcjax":
    return load_config(path), checkpoint_format(path)
  if kind == "gguf":
    from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config
    return gguf_model_config(GGUFFile(path)), WeightFormat()
  from lcjax.checkpoint.hf import hf_config_json, hf_model_config, quantization_format
  return hf_model_config(path), quantization_format(hf_config_json(path), os.path.join(path, "config.json"))


def resolve_checkpoint(path, *, progress: bool | None = None) -> str:
  """The lcjax checkpoint directory for `path`: itself, or the user-cache conversion of an HF folder or a GGUF
  file (converted now if it is not there yet)."""
  path = os.fspath(path)
  kind = _kind(path)
  if kind == "lcjax":
    return path
  dst = os.path.join(make_private_dir(os.path.join(user_cache_dir(), "converted")), _source_id(path))
  try:
    load_config(dst)
    return dst
  except CheckpointError:
    pass
  print(f"converting {path} into {dst} (once)...", file=sys.stderr)
  if kind == "gguf":
    from lcjax.checkpoint.gguf import convert_gguf
    convert_gguf(path, dst, overwrite=True, progress=progress)
  else:
    from lcjax.checkpoint.hf import convert_hf
    convert_hf(path, dst, overwrite=True, progress=progress)
  return dst
