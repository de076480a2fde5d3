"""Directories written atomically: built in `DST.tmp-<pid>` and renamed to DST only once complete.

A process killed at any point leaves nothing at DST that looks complete: a directory is complete when it holds
its `marker` file (written last), and a directory being deleted loses its marker first. An overwrite moves the old
DST to `DST.old-<pid>`, renames the new one in, then deletes the old; killed between the two renames it leaves DST
missing, which `recover` (run by the next writer of DST and by the readers of saved contexts and checkpoints)
puts back: the new directory when it is complete, else the old one. Leftovers of dead processes (`.tmp-<pid>`,
`.old-<pid>`) are then removed by the next writer of the same DST; a live process's are left alone, and so is any
entry whose name only looks like one (a pid no process can have). A leftover that is a symbolic link is removed
itself: nothing is ever deleted through a link. Checkpoints (lcjax.checkpoint.writer) and saved contexts
(lcjax.engine.context) are written this way.

Before the rename every file and directory written is flushed to disk (fsync), and the parent directory after it,
so a machine that loses power after a save returns the old DST or the new one, complete. `overwrite` replaces only
a DST that holds the marker (one of ours); any other file or directory there is refused, never deleted.
"""
from __future__ import annotations

import os
import re
import shutil

_MAX_PID = 2**31 - 1          # pid_t: a larger number names no process
_LEFTOVER = re.compile(r"\.(tmp|old)-([0-9]{1,10})")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_directory(path: str, marker: str) -> None:
  """Delete a directory marker first, so that one half removed never looks complete. A link (or a file) at `path`
  is removed itself, never what it points to."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
  except FileNotFoundError:
    return
  except OSError:                   # a link (ELOOP) or not a directory (ENOTDIR)
    os.unlink(path)
    return
  try:
    os.unlink(marker, dir_fd=fd)
  except FileNotFoundError:
    pass
  finally:
    os.close(fd)
  shutil.rmtree(path, ignore_errors=True)


def _leftovers(dst: str) -> list[tuple[str, int, str]]:
  """(kind "tmp" | "old", pid, path) of the entries beside DST named as this module names them, of dead
  processes."""
  parent, base = os.path.split(dst)
  try:
    entries = os.listdir(parent)
  except FileNotFoundError:
    return []
  found = []
  for entry in entries:
    m = _LEFTOVER.fullmatch(entry[len(base):]) if entry.startswith(base) else None
    if m and 0 < int(m[2]) <= _MAX_PID and not _pid_alive(int(m[2])):
      found.append((m[1], int(m[2]), os.path.join(parent, entry)))
  return found


def _complete(path: str, marker: str) -> bool:
  return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, marker))


def recover(dst: str, marker: str) -> bool:
  """Put back a DST that an overwrite killed between its two renames left missing: its new directory
  (`DST.tmp-<pid>`) when complete, else the old one (`DST.old-<pid>`), of a dead process. True when it did."""
  dst = os.path.abspath(dst)
  if os.path.lexists(dst):
    return False
  found = _leftovers(dst)
  for pid in sorted({pid for kind, pid, _ in found if kind == "old"}):
    paths = {kind: path for kind, p, path in found if p == pid}
    for kind in ("tmp", "old"):
      if kind in paths and _complete(paths[kind], marker):
        try:
          os.rename(paths[kind], dst)
        except FileExistsError:      # another process recovered it first
          return False
        _fsync_path(os.path.dirname(dst))
        return True
  return False


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
    recover(self.dst, self.marker)
    if os.path.lexists(self.dst):
      if not self.overwrite:
        raise self.exists_error
      if os.path.islink(self.dst) or not os.path.isfile(os.path.join(self.dst, self.marker)):
        kind = "a link" if os.path.islink(self.dst) else "a directory" if os.path.isdir(self.dst) else "a file"
        raise self.error(f"{self.dst} is {kind} but not a {self.what} (no {self.marker}): overwrite replaces "
                         f"only a {self.what}; remove it yourself or choose another path")
    os.makedirs(os.path.dirname(self.dst), exist_ok=True)
    for _, _, path in _leftovers(self.dst):
      remove_directory(path, self.marker)
    remove_directory(self.tmp, self.marker)      # this pid's, of a process before it
    os.makedirs(self.tmp)
    return self

  def commit(self) -> None:
    """Put the finished directory at DST (replacing the one there, if any)."""
    if not os.path.isfile(os.path.join(self.tmp, self.marker)):
      raise RuntimeError(f"{self.tmp}: commit() before its {self.marker} was written")
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
    remove_directory(self.tmp, self.marker)
