"""Where checkpoints come from: an lcjax checkpoint directory as it is, or an HF folder (config.json +
safetensors) or a GGUF file converted once into the user cache, as transformers' `from_pretrained` takes a folder.

The user cache is $LCJAX_CACHE_DIR, else $XDG_CACHE_HOME/lcjax, else ~/.cache/lcjax. A conversion is named by
the source's absolute path, file sizes and modification times, so an edited or replaced source converts again;
conversions are atomic (lcjax.checkpoint.writer), so a killed one leaves nothing that loads.
"""
from __future__ import annotations

import hashlib
import os
import sys

from lcjax.checkpoint.layout import MANIFEST_FILE, CheckpointError, load_config


def user_cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.environ.get("LCJAX_CACHE_DIR") or os.path.join(base, "lcjax")


def _is_gguf(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(4) == b"GGUF"


def _source_id(path: str) -> str:
  """A name for a conversion of `path`: its absolute path, and the size and mtime of every file in it."""
  path = os.path.abspath(path)
  files = [path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path))
  h = hashlib.blake2b(path.encode(), digest_size=8)
  for f in files:
    if os.path.isfile(f):
      st = os.stat(f)
      h.update(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns};".encode())
  stem = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
  return f"{stem}-{h.hexdigest()}"


def resolve_checkpoint(path, *, progress: bool | None = None) -> str:
  """The lcjax checkpoint directory for `path`: itself, or the user-cache conversion of an HF folder or a GGUF
  file (converted now if it is not there yet)."""
  path = os.fspath(path)
  if os.path.isfile(path):
    if not _is_gguf(path):
      raise CheckpointError(f"{path} is a file but not a GGUF file: give an lcjax checkpoint directory, an HF model "
                            "folder or a GGUF file")
    kind = "gguf"
  elif os.path.isfile(os.path.join(path, "config.json")) and not os.path.exists(os.path.join(path, MANIFEST_FILE)):
    kind = "hf"
  else:
    return path
  dst = os.path.join(user_cache_dir(), "converted", _source_id(path))
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
