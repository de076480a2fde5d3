"""The caches lcjax reads programs and weights from cannot be planted: its cache directories are private (0700
whatever the umask), a compilation-cache directory that others can write to or that another user owns is not used
under "auto" (and used with a warning when named), and a converted checkpoint is keyed on more than size and mtime.
The compile-cache cases run `compile_cache.enable` in a process of its own (one setting per process; no engine),
forked from a server that has imported jax and lcjax (tests.forkserver) in the same environment."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from lcjax.checkpoint import sources
from tests import forkserver
from tests.run_cache import REPO, cpu_env, without_run_cache

_SCRIPT = r"""
import json, os, sys
os.umask(0)
from lcjax.engine import compile_cache
print("RESULT " + json.dumps(dict(dir=compile_cache.enable(sys.argv[1]))))
"""


def _enable(setting, home):
  env = without_run_cache(cpu_env(LCJAX_CACHE_DIR=str(home)))
  p = forkserver.run([sys.executable, "-c", _SCRIPT, setting], env=env, cwd=REPO, timeout=120)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.split("RESULT ")[-1])["dir"], p.stderr


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_cache_directories_are_private_under_any_umask(tmp_path):
  home = tmp_path / "a" / "home"
  d, err = _enable("auto", home)
  assert d == str(home / "jax-compile") and "unsafe" not in err
  assert _mode(home / "jax-compile") == _mode(home) == _mode(tmp_path / "a") == 0o700
  old = os.umask(0)
  try:
    made = sources.make_private_dir(str(tmp_path / "b" / "converted"))
  finally:
    os.umask(old)
  assert made == str(tmp_path / "b" / "converted") and _mode(made) == _mode(tmp_path / "b") == 0o700


@pytest.mark.parametrize("mode, who", [(0o777, "its group and all users"), (0o770, "its group"),
                                       (0o703, "all users")])
def test_a_compile_cache_others_can_write_is_refused_or_used_with_a_warning(tmp_path, mode, who):
  planted = tmp_path / "home" / "jax-compile"
  planted.mkdir(parents=True)
  planted.chmod(mode)
  d, err = _enable("auto", tmp_path / "home")
  assert d is None
  line = [l for l in err.splitlines() if "compilation cache is off" in l]
  assert len(line) == 1 and (f"{planted} is unsafe to run programs from, it is writable by {who} (mode {mode:o})"
                             in line[0]), err
  d, err = _enable(str(planted), tmp_path / "home")
  assert d == str(planted)
  assert f"compile_cache={planted} is used as named, but it is unsafe: it is writable by {who}" in err, err
  assert _mode(planted) == mode                     # named: used as it is, never changed


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_compile_cache_of_another_user_is_refused(tmp_path):
  planted = tmp_path / "home" / "jax-compile"
  planted.mkdir(parents=True, mode=0o700)
  os.chown(planted, 4321, -1)
  d, err = _enable("auto", tmp_path / "home")
  assert d is None and "it is owned by uid 4321, not by this user (uid 0)" in err, err


def test_the_conversion_key_changes_when_a_source_is_rewritten_with_its_size_and_mtime(tmp_path):
  src = tmp_path / "model.gguf"
  src.write_bytes(b"GGUF" + bytes(60))
  before = sources._source_id(str(src))
  st = os.stat(src)
  src.write_bytes(b"GGUF" + bytes([1]) * 60)             # same size
  os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))     # mtime put back
  assert os.stat(src).st_size == st.st_size and os.stat(src).st_mtime_ns == st.st_mtime_ns
  assert sources._source_id(str(src)) != before
  replaced = tmp_path / "other.gguf"
  replaced.write_bytes(src.read_bytes())
  os.utime(replaced, ns=(st.st_atime_ns, st.st_mtime_ns))
  os.replace(replaced, src)                              # another inode at the same path
  assert sources._source_id(str(src)) != before


def test_a_conversion_by_another_converter_version_is_not_reused(tmp_path, monkeypatch):
  """A converter fix changes what the same source converts to (a BOS id, a refused file): the conversion key
  names the converters' version, so a conversion cached by an lcjax before the fix is converted again, not
  loaded with the old answer."""
  src = tmp_path / "model.gguf"
  src.write_bytes(b"GGUF" + bytes(60))
  before = sources._source_id(str(src))
  monkeypatch.setattr(sources, "CONVERTER_VERSION", sources.CONVERTER_VERSION + 1)
  assert sources._source_id(str(src)) != before
