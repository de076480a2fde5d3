"""Directories written atomically: built in `DST.tmp-<pid>` and renamed to DST only once complete.

A process killed at any point leaves nothing at DST that looks complete: a directory is complete when it holds
its `marker` file (written last), and a directory being deleted loses its marker first. Leftovers of dead
processes (`.tmp-<pid>`, and the `.old-<pid>` an interrupted overwrite was replacing) are removed by the next
writer of the same DST; a live process's are left alone. Checkpoints (lcjax.checkpoint.writer) and saved contexts
(lcjax.engine.context) are written this way.

Before the rename every file and directory written is flushed to disk (fsync), and the parent directory after it,
so a machine that loses power after a save returns the old DST or the new one, complete. `overwrite` replaces only
a DST that holds the marker (one of ours); any other file or directory there is refused, never deleted.
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


def _fsync_path(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def sync_tree(root: str) -> None:
  """fsync every file under `root`, then every directory, deepest first (their entries), `root` last."""
  for where, dirs, files in os.walk(root, topdown=False):
    for name in files:
      _fsync_path(os.path.join(where, name))
    _fsync_path(where)


class AtomicDirectory:
  """with AtomicDirectory(dst, marker, overwrite=..., exists_error=...) as d:  write into d.tmp, then d.commit().

  Leaving the block without commit() (an exception) removes what was written. `exists_error` is raised on entry
  when DST exists and `overwrite` is false; `error` (an exception class) names DST when it exists but is not a
  `what` (no marker), which overwrite never replaces."""

  def __init__(self, dst: str, marker: str, *, overwrite: bool, exists_error: Exception,
               error: type[Exception] = ValueError, what: str = "directory"):
    self.dst = os.path.abspath(dst)
    self.marker = marker
    self.overwrite = overwrite
    self.exists_error = exists_error
    self.error = error
    self.what = what
    self.tmp = f"{self.dst}.tmp-{os.getpid()}"

  def __enter__(self) -> "AtomicDirectory":
    if os.path.lexists(self.dst):
      if not self.overwrite:
        raise self.exists_error
      if os.path.islink(self.dst) or not os.path.isfile(os.path.join(self.dst, self.marker)):
        kind = "a link" if os.path.islink(self.dst) else "a directory" if os.path.isdir(self.dst) else "a file"
        raise self.error(f"{self.dst} is {kind} but not a {self.what} (no {self.marker}): overwrite replaces "
                         f"only a {self.what}; remove it yourself or choose another path")
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
    sync_tree(self.tmp)
    old = None
    if os.path.exists(self.dst):
      old = f"{self.dst}.old-{os.getpid()}"
      os.rename(self.dst, old)
    os.rename(self.tmp, self.dst)
    _fsync_path(os.path.dirname(self.dst))
    if old:
      remove_directory(old, self.marker)

  def __exit__(self, *exc) -> None:
    if os.path.exists(self.tmp):
      shutil.rmtree(self.tmp, ignore_errors=True)
