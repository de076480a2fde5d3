"""convert_hf(overwrite=True) with a SIGKILL of itself at one exact point of the commit (the names
lcjax.checkpoint.writer renames): `python -m tests.fault_jobs SRC DST POINT`, POINT one of before-rename,
between-renames, removing-old. tests/test_faults.py runs it (and tools/convert_hf.py, killed from outside) as
processes forked by tests.forkserver."""
from __future__ import annotations

import os
import shutil
import signal
import sys


def convert_hooked(src: str, dst: str, point: str) -> None:
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


if __name__ == "__main__":
  convert_hooked(*sys.argv[1:4])
