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


def version(dst) -> str:
  assert open(os.path.join(dst, MARKER)).read() == open(os.path.join(dst, "data")).read()
  return open(os.path.join(dst, "data")).read()


def test_a_leftover_link_is_removed_not_followed(tmp_path):
  """A link named as a dead process's leftover, to another saved directory: the next save removes the link and
  deletes nothing through it."""
  other = tmp_path / "other"
  save(other, "keep")
  dst = tmp_path / "dst"
  for kind in ("tmp", "old"):
    os.symlink(other, f"{dst}.{kind}-{_dead_pid()}")
  save(dst, "v1")
  assert version(other) == "keep" and version(dst) == "v1"
  assert sorted(os.listdir(tmp_path)) == ["dst", "other"]


def test_a_link_at_this_processes_own_tmp_name_is_removed_not_followed(tmp_path):
  other = tmp_path / "other"
  save(other, "keep")
  dst = tmp_path / "dst"
  os.symlink(other, f"{dst}.tmp-{os.getpid()}")
  save(dst, "v1")
  assert version(other) == "keep" and version(dst) == "v1"


@pytest.mark.parametrize("suffix", [".tmp-99999999999999999999", ".old-4294967296", ".tmp-²", ".tmp-0", ".tmp-",
                                    ".old-12x"])
def test_odd_leftover_names_are_left_alone(tmp_path, suffix):
  """Names that only look like leftovers (a pid no process can have: past a C long, past pid_t, not ASCII
  digits) neither fail a save nor are deleted."""
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
