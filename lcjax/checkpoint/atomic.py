"""Directories written atomically: built in `DST.tmp-<pid>-<token>` and renamed to DST only once complete.

Each writer names its temporary directory with its pid and a random token of 16 hex digits of its own, so two
writers of one DST (two processes, or two threads of one) never share one. The first thing written into it is
OWNER_FILE, which marks the directory as this module's: a leftover is deleted or put back only when it carries
that file.

A process killed at any point leaves nothing at DST that looks complete: a directory is complete when it holds
its `marker` file (written last), and a directory being deleted loses its marker first (and OWNER_FILE last). An
overwrite moves the old DST to `DST.old-<pid>-<token>` (the token of its temporary directory), renames the new one
in, then deletes the old; killed between the two renames it leaves DST missing, which `recover` (run by the next
writer of DST and by the readers of saved contexts and checkpoints) puts back: the new directory when it is
complete, else the old one. Commits to one DST in one process run one at a time; a commit that finds DST
replaced under it by another process puts nothing there and raises the caller's one-line error.

Leftovers beside DST are removed by the next writer of the same DST only when all of this holds: the name is
`DST.tmp-<pid>-<token>` or `DST.old-<pid>-<token>` exactly, no live process has that pid, the entry is a directory
(not a link) and it holds OWNER_FILE (a regular file). An empty directory so named is removed too (a writer killed
before its OWNER_FILE, or after deleting it). Anything else (a file, a link, a directory of the user's with a name
of its own such as `DST.old-2023`) is left alone, and nothing is ever deleted through a link. A failure to read
the parent directory, or to rename a leftover back, means no leftovers and no recovery: the caller's own error
("no such ...") is what the user sees.

Before the rename every file and directory written is flushed to disk (fsync), and the parent directory after it,
so a machine that loses power after a save returns the old DST or the new one, complete. `overwrite` replaces only
a DST that holds the marker (one of ours); any other file or directory there is refused, never deleted.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import threading

OWNER_FILE = ".lcjax-atomic"  # written first into each temporary directory: the directory is this module's
_OWNER_TEXT = b"lcjax atomic directory\n"
_MAX_PID = 2**31 - 1          # pid_t: a larger number names no process
_LEFTOVER = re.compile(r"\.(tmp|old)-([0-9]{1,10})-([0-9a-f]{16})")
_commit_locks: dict[str, threading.Lock] = {}
_commit_locks_lock = threading.Lock()


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _open_directory(path: str) -> int | None:
  """A descriptor of the directory at `path` itself (never through a link), or None."""
  try:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
  except OSError:
    return None


def _owned(fd: int) -> bool:
  try:
    return stat.S_ISREG(os.stat(OWNER_FILE, dir_fd=fd, follow_symlinks=False).st_mode)
  except OSError:
    return False


def is_owned(path: str) -> bool:
  """Whether `path` is a directory (not a link) that holds OWNER_FILE: one this module made."""
  fd = _open_directory(path)
  if fd is None:
    return False
  try:
    return _owned(fd)
  finally:
    os.close(fd)


def remove_directory(path: str, marker: str) -> None:
  """Delete a directory this module made: its marker first (so that one half removed never looks complete), then
  its other entries, then OWNER_FILE, then the directory. Anything at `path` that is not such a directory (a file,
  a link, a directory without OWNER_FILE) is left as it is, but for an empty directory, which is removed; so is
  OWNER_FILE while any other entry could not be deleted. Errors are ignored: what stays is removed by a
  later writer."""
  fd = _open_directory(path)
  if fd is None:
    return
  try:
    if not _owned(fd):
      if not os.listdir(fd):
        os.rmdir(path)               # fails, deleting nothing, if an entry appeared since
      return
    try:
      os.unlink(marker, dir_fd=fd)
    except FileNotFoundError:
      pass
    except OSError:
      return                         # still complete: deleting the rest would leave a complete-looking half
    for name in os.listdir(fd):
      if name == OWNER_FILE:
        continue
      try:
        if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
          shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        else:
          os.unlink(name, dir_fd=fd)
      except OSError:
        pass
    if os.listdir(fd) == [OWNER_FILE]:
      os.unlink(OWNER_FILE, dir_fd=fd)
  except OSError:
    return
  finally:
    os.close(fd)
  try:
    os.rmdir(path)
  except OSError:
    pass


def _leftovers(dst: str) -> list[tuple[str, int, str, str]]:
  """(kind "tmp" | "old", pid, token, path) of the entries beside DST named as this module names them, of dead
  processes. Their ownership is not checked here."""
  parent, base = os.path.split(dst)
  try:
    entries = os.listdir(parent)
  except OSError:                    # no parent, not a directory, not readable: no leftovers
    return []
  found = []
  for entry in entries:
    m = _LEFTOVER.fullmatch(entry[len(base):]) if entry.startswith(base) else None
    if m and 0 < int(m[2]) <= _MAX_PID and not _pid_alive(int(m[2])):
      found.append((m[1], int(m[2]), m[3], os.path.join(parent, entry)))
  return found


def _complete(path: str, marker: str) -> bool:
  """A directory of this module's (OWNER_FILE) holding its marker (a regular file)."""
  fd = _open_directory(path)
  if fd is None:
    return False
  try:
    return _owned(fd) and stat.S_ISREG(os.stat(marker, dir_fd=fd, follow_symlinks=False).st_mode)
  except OSError:
    return False
  finally:
    os.close(fd)


def recover(dst: str, marker: str) -> bool:
  """Put back a DST that an overwrite killed between its two renames left missing: its new directory
  (`DST.tmp-<pid>-<token>`) when complete, else the old one (`DST.old-<pid>-<token>`), of a dead process, each
  only when it is this module's (OWNER_FILE) and complete. True when it did. Any OSError means no recovery."""
  dst = os.path.abspath(dst)
  if os.path.lexists(dst):
    return False
  found = _leftovers(dst)
  for pid, token in sorted({(pid, token) for kind, pid, token, _ in found if kind == "old"}):
    paths = {kind: path for kind, p, t, path in found if (p, t) == (pid, token)}
    for kind in ("tmp", "old"):
      if kind in paths and _complete(paths[kind], marker):
        try:
          os.rename(paths[kind], dst)
        except OSError:              # another process recovered it first, or the parent is read-only
          return False
        try:
          _fsync_path(os.path.dirname(dst))
        except OSError:
          pass
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


def _write_owner(path: str) -> None:
  """OWNER_FILE into the directory `path` (kept when it is there)."""
  try:
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
  except FileExistsError:
    return
  try:
    os.write(fd, _OWNER_TEXT)
    os.fsync(fd)
  finally:
    os.close(fd)


def _commit_lock(dst: str) -> threading.Lock:
  with _commit_locks_lock:
    return _commit_locks.setdefault(dst, threading.Lock())


def not_replaceable(dst: str, marker: str) -> str | None:
  """What an existing `dst` is ("a link", "a directory", "a file") when an overwriting AtomicDirectory(dst,
  marker) would refuse to replace it (a link, or no `marker` file in it); None when absent or replaceable."""
  if not os.path.lexists(dst) or (not os.path.islink(dst) and os.path.isfile(os.path.join(dst, marker))):
    return None
  return "a link" if os.path.islink(dst) else "a directory" if os.path.isdir(dst) else "a file"


class AtomicDirectory:
  """with AtomicDirectory(dst, marker, overwrite=..., exists_error=...) as d:  write into d.tmp, then d.commit().

  Leaving the block without commit() (an exception) removes what was written. `exists_error` is raised on entry
  (and at the commit) when DST exists and `overwrite` is false; `error` (an exception class) names DST when it
  exists but is not a `what` (no marker), which overwrite never replaces, and carries any failure of the
  filesystem (one line)."""

  def __init__(self, dst: str, marker: str, *, overwrite: bool, exists_error: Exception,
               error: type[Exception] = ValueError, what: str = "directory"):
    self.dst = os.path.abspath(dst)
    self.marker = marker
    self.overwrite = overwrite
    self.exists_error = exists_error
    self.error = error
    self.what = what
    self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
    self.tmp = f"{self.dst}.tmp-{self.token}"

  def _fail(self, doing: str, e: OSError) -> Exception:
    where = f" ({e.filename})" if e.filename else ""
    return self.error(f"cannot {doing} {self.dst}: {e.strerror or e}{where}")

  def _check_dst(self) -> None:
    """DST absent, or (overwrite) one of ours: else exists_error or error."""
    if os.path.lexists(self.dst):
      if not self.overwrite:
        raise self.exists_error
      kind = not_replaceable(self.dst, self.marker)
      if kind:
        raise self.error(f"{self.dst} is {kind} but not a {self.what} (no {self.marker}): overwrite replaces "
                         f"only a {self.what}; remove it yourself or choose another path")

  def __enter__(self) -> "AtomicDirectory":
    recover(self.dst, self.marker)
    self._check_dst()
    try:
      os.makedirs(os.path.dirname(self.dst), exist_ok=True)
    except OSError as e:
      raise self._fail("make the directory of", e) from None
    for _, _, _, path in _leftovers(self.dst):
      remove_directory(path, self.marker)
    try:
      os.mkdir(self.tmp)
    except OSError as e:
      raise self._fail(f"write a {self.what} at", e) from None
    try:
      _write_owner(self.tmp)         # first: from here on the directory is known as this module's
    except OSError as e:
      try:
        os.rmdir(self.tmp)
      except OSError:
        pass
      raise self._fail(f"write a {self.what} at", e) from None
    return self

  def commit(self) -> None:
    """Put the finished directory at DST (replacing the one there, if any)."""
    if not os.path.isfile(os.path.join(self.tmp, self.marker)):
      raise RuntimeError(f"{self.tmp}: commit() before its {self.marker} was written")
    try:
      sync_tree(self.tmp)
    except OSError as e:
      raise self._fail(f"flush the {self.what} written for", e) from None
    old = None
    with _commit_lock(self.dst):
      self._check_dst()               # another writer may have put something at DST since __enter__
      try:
        if os.path.lexists(self.dst):
          _write_owner(self.dst)      # a DST written before OWNER_FILE existed: its .old- stays recoverable
          os.rename(self.dst, f"{self.dst}.old-{self.token}")
          old = f"{self.dst}.old-{self.token}"
        os.rename(self.tmp, self.dst)
      except OSError as e:
        if old and not os.path.lexists(self.dst):
          try:
            os.rename(old, self.dst)   # the old one back: DST as it was
          except OSError:
            pass                       # DST missing: `old` is recovered once this process is gone
        elif old:
          remove_directory(old, self.marker)   # DST holds another writer's complete directory
        raise self._fail(f"put the {self.what} at", e) from None
      try:
        _fsync_path(os.path.dirname(self.dst))
      except OSError:
        pass
    if old:
      remove_directory(old, self.marker)

  def __exit__(self, *exc) -> None:
    remove_directory(self.tmp, self.marker)
