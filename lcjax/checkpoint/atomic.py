"""Directories written atomically: built in `DST.tmp-<pid>` and renamed to DST only once complete.

A process killed at any point leaves nothing at DST that looks complete: a directory is complete when it holds
its `marker` file (written last), and a directory being deleted loses its marker first. Leftovers of dead
processes (`.tmp-<pid>`, and the `.old-<pid>` an interrupted overwrite was replacing) are removed by the next
writer of the same DST; a live process's are left alone. Checkpoints (lcjax.checkpoint.writer) and saved contexts
(lcjax.engine.context) are written this way.
"""
from __future__ import annotations

import os
import shutil


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_directory(path: str, marker: str) -> None:
  """Delete a directory marker first, so that one half removed never looks complete."""
  try:
    os.remove(os.path.join(path, marker))
  except FileNotFoundError:
    pass
  shutil.rmtree(path, ignore_errors=True)


class AtomicDirectory:
  """with AtomicDirectory(dst, marker, overwrite=..., exists_error=...) as d:  write into d.tmp, then d.commit().

  Leaving the block without commit() (an exception) removes what was written. `exists_error` is raised on entry
  when DST exists and `overwrite` is false."""

  def __init__(self, dst: str, marker: str, *, overwrite: bool, exists_error: Exception):
    self.dst = os.path.abspath(dst)
    self.marker = marker
    self.overwrite = overwrite
    self.exists_error = exists_error
    self.tmp = f"{self.dst}.tmp-{os.getpid()}"

  def __enter__(self) -> "AtomicDirectory":
    if os.path.exists(self.dst) and not self.overwrite:
      raise self.exists_error
    parent = os.path.dirname(self.dst)
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):
      for suffix in (".tmp-", ".old-"):
        base = os.path.basename(self.dst) + suffix
        if entry.startswith(base) and entry[len(base):].isdigit() and not _pid_alive(int(entry[len(base):])):
          remove_directory(os.path.join(parent, entry), self.marker)
    shutil.rmtree(self.tmp, ignore_errors=True)
    os.makedirs(self.tmp)
    return self

  def commit(self) -> None:
    """Put the finished directory at DST (replacing the one there, if any)."""
    old = None
    if os.path.exists(self.dst):
      old = f"{self.dst}.old-{os.getpid()}"
      os.rename(self.dst, old)
    os.rename(self.tmp, self.dst)
    if old:
      remove_directory(old, self.marker)

  def __exit__(self, *exc) -> None:
    if os.path.exists(self.tmp):
      shutil.rmtree(self.tmp, ignore_errors=True)
