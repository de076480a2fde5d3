"""lcjax.checkpoint.atomic: leftovers removed without following links or choking on odd names, and an overwrite
killed at each step of its commit leaves the old or the new directory at DST (put back by the next open or save).

A kill is simulated in this process: the k-th filesystem change of a commit raises `Killed` and the writer's
cleanup is skipped (a killed process runs none); its pid then counts as dead, as a killed process's would.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from lcjax.checkpoint import atomic
from lcjax.checkpoint.atomic import AtomicDirectory

MARKER = "marker.json"


class Killed(BaseException):
  pass


def _dead_pid() -> int:
  p = subprocess.Popen(["true"])
  p.wait()
  return p.pid


def save(dst, version: str, overwrite: bool = True, fail_before_commit: bool = False) -> None:
  with AtomicDirectory(str(dst), MARKER, overwrite=overwrite, exists_error=FileExistsError(str(dst))) as d:
    with open(os.path.join(d.tmp, "data"), "w") as f:
      f.write(version)
    if fail_before_commit:
      raise Killed("before commit")
    with open(os.path.join(d.tmp, MARKER), "w") as f:
      f.write(version)
    d.commit()


def tmp_of(dst, pid: int) -> str:
  """The temporary directory process `pid` writes for `dst` (`DST.tmp-<pid>-<token>`), or a name that does not
  exist while it has none."""
  parent, base = os.path.split(os.path.abspath(dst))
  prefix = f"{base}.tmp-{pid}-"
  for entry in os.listdir(parent) if os.path.isdir(parent) else ():
    if entry.startswith(prefix):
      return os.path.join(parent, entry)
  return os.path.join(parent, prefix + "none-yet")


def version(dst) -> str:
  assert open(os.path.join(dst, MARKER)).read() == open(os.path.join(dst, "data")).read()
  return open(os.path.join(dst, "data")).read()


def test_a_link_named_as_a_leftover_is_left_alone_and_not_followed(tmp_path):
  """A link named exactly as a dead process's leftover, to another saved directory: the next save neither
  deletes it nor anything through it, nor puts it back as DST."""
  other = tmp_path / "other"
  save(other, "keep")
  dst = tmp_path / "dst"
  links = [f"dst.{kind}-{_dead_pid()}-{'ab' * 8}" for kind in ("tmp", "old")]
  for name in links:
    os.symlink(other, tmp_path / name)
  assert not atomic.recover(str(dst), MARKER)
  save(dst, "v1")
  save(dst, "v2")
  assert version(other) == "keep" and version(dst) == "v2"
  assert sorted(os.listdir(tmp_path)) == sorted(["dst", "other", *links])


@pytest.mark.parametrize("suffix", [".tmp-99999999999999999999", ".old-4294967296", ".tmp-²", ".tmp-0", ".tmp-",
                                    ".old-12x", ".tmp-99999999999999999999-" + "0" * 16,
                                    ".old-4294967296-" + "0" * 16, ".tmp-0-" + "0" * 16,
                                    ".tmp-2147483647-" + "0" * 15, ".old-2147483647-" + "A" * 16])
def test_odd_leftover_names_are_left_alone(tmp_path, suffix):
  """Names that only look like leftovers (a pid no process can have: past a C long, past pid_t, not ASCII
  digits; a token not of 16 lowercase hex digits) neither fail a save nor are deleted."""
  dst = tmp_path / "dst"
  odd = tmp_path / f"dst{suffix}"
  save(odd, "someone's")
  save(dst, "v1")
  save(dst, "v2")
  assert version(dst) == "v2" and version(odd) == "someone's"


def _kill_at(monkeypatch, k: int) -> list:
  """Make the k-th filesystem change of the next commit (rename, unlink, rmtree) raise Killed, and skip the
  writer's cleanup; returns the log of changes made."""
  log = []
  real = {"rename": os.rename, "unlink": os.unlink, "remove": os.remove, "rmtree": shutil.rmtree}
  in_commit = [False]

  def hook(name, module):
    def call(*a, **kw):
      if in_commit[0]:
        if len(log) == k:
          raise Killed(f"{name} {a[0]}")
        log.append(name)
      return real[name](*a, **kw)
    monkeypatch.setattr(module, name, call)

  for name in ("rename", "unlink", "remove"):
    hook(name, os)
  hook("rmtree", shutil)
  commit = AtomicDirectory.commit

  def hooked_commit(self):
    in_commit[0] = True
    try:
      commit(self)
    finally:
      in_commit[0] = False
  monkeypatch.setattr(AtomicDirectory, "commit", hooked_commit)
  monkeypatch.setattr(AtomicDirectory, "__exit__", lambda self, *exc: None)
  return log


def _as_if_dead(monkeypatch) -> None:
  """This process's leftovers from here on are a dead process's (its pid is in their names)."""
  alive = atomic._pid_alive
  monkeypatch.setattr(atomic, "_pid_alive", lambda pid: pid != os.getpid() and alive(pid))


@pytest.mark.parametrize("then", ["open", "save", "failed-save"])
def test_an_overwrite_killed_at_each_step_leaves_the_old_or_the_new(tmp_path, then):
  """Kill the commit of an overwrite before each of its filesystem changes (and not at all): DST then holds the
  old or the new directory, at once or after the next open (`recover`, which the readers run) or save; a next
  save that itself fails before its commit still leaves one of them (the kill's leftovers are not both deleted);
  a next save that completes leaves nothing else beside DST."""
  seen = []
  for k in range(10):
    with pytest.MonkeyPatch.context() as mp:
      where = tmp_path / f"k{k}"
      dst = where / "dst"
      save(dst, "old")
      log = _kill_at(mp, k)
      try:
        save(dst, "new")
        killed = False
      except Killed:
        killed = True
    with pytest.MonkeyPatch.context() as mp:
      _as_if_dead(mp)
      if then == "open":
        atomic.recover(str(dst), MARKER)
      elif then == "failed-save":
        with pytest.raises(Killed):
          save(dst, "third", fail_before_commit=True)
      else:
        save(dst, "third")
      got = version(dst)
      seen.append(got)
      if then == "save":
        assert got == "third" and os.listdir(where) == ["dst"], (k, os.listdir(where))
      else:
        assert got in ("old", "new"), (k, got)
        assert got == "new" or len(log) < 2, (k, log, got)    # after the second rename, never the old
        save(dst, "fourth")
        assert version(dst) == "fourth" and os.listdir(where) == ["dst"], (k, os.listdir(where))
    if not killed:
      break
  assert killed is False and k >= 4, k          # every step was reached: rename x 2, unlink, rmtree
  if then != "save":
    assert {"old", "new"} <= set(seen), seen


class Refused(Exception):
  pass


def save_as(dst, version: str, error=Refused) -> None:
  """save(), with the module's errors raised as `error`."""
  with AtomicDirectory(str(dst), MARKER, overwrite=True, exists_error=FileExistsError(str(dst)), error=error) as d:
    with open(os.path.join(d.tmp, "data"), "w") as f:
      f.write(version)
    with open(os.path.join(d.tmp, MARKER), "w") as f:
      f.write(version)
    d.commit()


def _users_entries(tmp_path) -> dict:
  """Entries beside `report` named like leftovers but made by the user: their names, and what each holds."""
  dead = _dead_pid()
  made = {}
  for name in ("report.old-2023", f"report.old-{dead}", f"report.tmp-{dead}", f"report.old-{dead}-{'0' * 16}",
               f"report.tmp-{dead}-{'0' * 16}"):
    os.makedirs(tmp_path / name / "sub")
    (tmp_path / name / "notes.txt").write_text(f"mine: {name}")
    (tmp_path / name / MARKER).write_text("looks complete")
    made[name] = f"mine: {name}"
  for name in ("report.tmp-77777", f"report.tmp-{_dead_pid()}", f"report.old-{dead}-{'1' * 16}"):
    (tmp_path / name).write_text(f"mine: {name}")
    made[name] = f"mine: {name}"
  return made


def _intact(tmp_path, made) -> None:
  for name, text in made.items():
    p = tmp_path / name
    got = (p / "notes.txt" if p.is_dir() else p).read_text()
    assert got == text, name


def test_the_users_entries_named_like_leftovers_are_never_deleted(tmp_path):
  """Directories and files the user made beside DST with names lcjax uses (of dead pids, with and without a
  token, even holding the completion marker): saves and overwrites delete none of them."""
  made = _users_entries(tmp_path)
  save(tmp_path / "report", "v1")
  save(tmp_path / "report", "v2")
  assert version(tmp_path / "report") == "v2"
  _intact(tmp_path, made)
  assert sorted(os.listdir(tmp_path)) == sorted(["report", *made])


def test_recover_puts_back_only_what_this_module_made(tmp_path):
  """DST missing and only the user's `DST.old-N` (complete-looking) beside it: nothing is renamed into place.
  A leftover of ours that is not complete is not put back either."""
  made = _users_entries(tmp_path)
  dst = tmp_path / "report"
  assert not atomic.recover(str(dst), MARKER)
  assert not dst.exists()
  _intact(tmp_path, made)
  dead = _dead_pid()
  half = tmp_path / f"report.old-{dead}-{'2' * 16}"
  os.makedirs(half)
  (half / atomic.OWNER_FILE).write_text("")
  assert not atomic.recover(str(dst), MARKER) and not dst.exists()
  (half / MARKER).write_text("old")
  (half / "data").write_text("old")
  assert atomic.recover(str(dst), MARKER) and version(dst) == "old"
  _intact(tmp_path, made)


def test_our_empty_leftover_directory_is_removed(tmp_path):
  """A writer killed after making its directory and before its OWNER_FILE leaves it empty: the next save
  removes it (rmdir deletes no content)."""
  empty = tmp_path / f"dst.tmp-{_dead_pid()}-{'3' * 16}"
  os.makedirs(empty)
  save(tmp_path / "dst", "v1")
  assert os.listdir(tmp_path) == ["dst"]


def test_concurrent_overwrites_from_threads_each_succeed_or_fail_in_one_line(tmp_path):
  """Threads saving to one DST at once (overwrite=True), their writes interleaved: each either succeeds or
  raises the caller's error (one line); DST then holds one complete directory, a successful writer's, and
  nothing else is left beside it."""
  import threading
  dst = tmp_path / "dst"
  save(dst, "first")
  n = 8
  barrier = threading.Barrier(n, timeout=5)
  results = [None] * n

  def writer(i):
    try:
      with AtomicDirectory(str(dst), MARKER, overwrite=True, exists_error=FileExistsError(str(dst)),
                           error=Refused) as d:
        barrier.wait()
        with open(os.path.join(d.tmp, "data"), "w") as f:
          f.write(f"v{i}")
        barrier.wait()
        with open(os.path.join(d.tmp, MARKER), "w") as f:
          f.write(f"v{i}")
        barrier.wait()
        d.commit()
      results[i] = "ok"
    except Refused as e:
      results[i] = str(e)
      assert "\n" not in str(e)
    except BaseException as e:           # noqa: BLE001: any other exception is the failure this test finds
      results[i] = e
    finally:
      barrier.abort()                    # a writer that left early keeps none of the others waiting

  threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert all(isinstance(r, str) for r in results), results
  got = version(dst)
  assert results[int(got[1:])] == "ok", (got, results)
  assert os.listdir(tmp_path) == ["dst"], os.listdir(tmp_path)


def test_a_temporary_directory_that_cannot_be_made_is_the_callers_one_line_error(tmp_path, monkeypatch):
  """The temporary name taken (a directory that cannot be removed), or mkdir refused: the caller's error class,
  one line, and the entry there is left as it was."""
  dst = tmp_path / "dst"
  monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: "0" * (2 * n))
  for name in (f"dst.tmp-{os.getpid()}", f"dst.tmp-{os.getpid()}-{'0' * 16}"):
    os.makedirs(tmp_path / name)
    (tmp_path / name / "notes.txt").write_text("mine")
  monkeypatch.setattr(shutil, "rmtree", lambda *a, **kw: None)        # as if undeletable (immutable)
  with pytest.raises(Refused) as e:
    save_as(dst, "v1")
  assert "\n" not in str(e.value) and str(dst) in str(e.value)
  assert (tmp_path / f"dst.tmp-{os.getpid()}-{'0' * 16}" / "notes.txt").read_text() == "mine"
  monkeypatch.undo()
  real = os.mkdir

  def refuse(path, *a, **kw):
    if ".tmp-" in os.fspath(path):
      raise PermissionError(13, "Permission denied", os.fspath(path))
    return real(path, *a, **kw)
  monkeypatch.setattr(os, "mkdir", refuse)
  with pytest.raises(Refused, match="Permission denied") as e:
    save_as(tmp_path / "other", "v1")
  assert "\n" not in str(e.value)


def test_recover_under_a_file_unreadable_or_read_only_is_no_recovery(tmp_path, monkeypatch):
  """A DST under a regular file, a parent that cannot be listed, a rename refused (read-only mount): recover
  finds nothing to put back and raises nothing, so the caller's own "no such ..." error is what is seen."""
  (tmp_path / "afile").write_text("x")
  assert not atomic.recover(str(tmp_path / "afile" / "ctx"), MARKER)
  real = os.listdir
  monkeypatch.setattr(os, "listdir", lambda p=".": (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                      if os.fspath(p) == str(tmp_path) else real(p))
  assert not atomic.recover(str(tmp_path / "dst"), MARKER)
  monkeypatch.undo()
  old = tmp_path / f"dst.old-{_dead_pid()}-{'4' * 16}"
  save(old, "old")
  monkeypatch.setattr(os, "rename", lambda a, b: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
  assert not atomic.recover(str(tmp_path / "dst"), MARKER)
  monkeypatch.undo()
  assert atomic.recover(str(tmp_path / "dst"), MARKER) and version(tmp_path / "dst") == "old"


def test_an_overwrite_of_a_directory_without_owner_file_killed_between_renames_leaves_nothing(tmp_path, monkeypatch):
  """DST written before OWNER_FILE existed (no such file in it), overwritten and killed between the two renames:
  the old directory, now named `.old-`, carries OWNER_FILE, so the next open puts the new one back and the next
  save removes the old."""
  dst = tmp_path / "dst"
  save(dst, "old")
  os.unlink(dst / atomic.OWNER_FILE)
  with pytest.MonkeyPatch.context() as mp:
    _kill_at(mp, 1)                     # after the first rename (DST -> DST.old-)
    with pytest.raises(Killed):
      save(dst, "new")
  assert not dst.exists()
  _as_if_dead(monkeypatch)
  assert atomic.recover(str(dst), MARKER) and version(dst) == "new"
  save(dst, "third")
  assert version(dst) == "third" and os.listdir(tmp_path) == ["dst"], os.listdir(tmp_path)
