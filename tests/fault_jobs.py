"""The conversions tests/test_faults.py kills, run as processes forked from one forkserver that has already
imported lcjax.checkpoint (jax, orbax, safetensors): each killed conversion is a process of its own, killed with
SIGKILL, without the interpreter start and imports of a fresh `python` each time (about 2 s of each).
No pytest import here: the forkserver preloads this module."""
from __future__ import annotations

import multiprocessing
import os
import runpy
import shutil
import signal
import sys

import lcjax.checkpoint                 # noqa: F401  (preloaded: the imports every job needs)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def context():
  """The forkserver context whose server has this module (and so lcjax.checkpoint) imported."""
  ctx = multiprocessing.get_context("forkserver")
  ctx.set_forkserver_preload([__name__])
  return ctx


def _to_file(path: str) -> None:
  """This process's stdout and stderr into path, and its jax on the CPU (as the tests' processes run)."""
  import jax
  jax.config.update("jax_platforms", "cpu")
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)


def convert_tool(log: str, src: str, dst: str, overwrite: bool) -> None:
  """tools/convert_hf.py run as __main__ with these flags (absl's app.run exits with the tool's status)."""
  _to_file(log)
  sys.argv = [os.path.join(REPO, "tools", "convert_hf.py"), f"--src={src}", f"--dst={dst}"] + (
      ["--overwrite"] if overwrite else [])
  runpy.run_path(sys.argv[0], run_name="__main__")


def convert_hooked(log: str, src: str, dst: str, point: str) -> None:
  """convert_hf(overwrite=True) with a SIGKILL of itself at one exact point of the commit (the names
  lcjax.checkpoint.writer renames)."""
  _to_file(log)
  from lcjax.checkpoint import convert_hf
  rename, rmtree = os.rename, shutil.rmtree
  die = lambda: os.kill(os.getpid(), signal.SIGKILL)

  def hooked_rename(a, b):
    if point == "before-rename" and ".tmp-" in a:
      die()
    rename(a, b)
    if point == "between-renames" and ".old-" in b:
      die()

  def hooked_rmtree(path, *a, **kw):
    if point == "removing-old" and ".old-" in str(path):
      rmtree(os.path.join(path, "params", "layers"))
      die()
    return rmtree(path, *a, **kw)
  os.rename, shutil.rmtree = hooked_rename, hooked_rmtree
  convert_hf(src, dst, overwrite=True, progress=False)
