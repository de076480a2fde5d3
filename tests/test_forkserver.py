"""tests.forkserver: a forked job ends, prints and sees what a fresh `python` with the same command line would (the
fresh process is the oracle here, for the cases the suite's jobs use)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ("json",)          # a server that starts in a moment; what is preloaded does not change the cases below
_SEEN = "import json, os, sys; print(json.dumps([sys.argv, os.getcwd(), sys.path[0], os.environ.get('FS_X')]))"


def _both(argv, env, cwd):
  """(forked, fresh) outcomes of one command line: exit status, stdout, stderr's last line."""
  out = []
  for p in (forkserver.run(argv, env=env, cwd=cwd, timeout=60, preload=PRELOAD),
            subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)):
    out.append((p.returncode, p.stdout, (p.stderr.strip().splitlines() or [""])[-1]))
  return out


@pytest.mark.parametrize("code, status", [
    (_SEEN, 0),
    (_SEEN + "; sys.exit(3)", 3),
    (_SEEN + "; sys.exit('a message')", 1),
    (_SEEN + "; raise ValueError('boom')", 1),
    (_SEEN + "; import atexit; atexit.register(lambda: print('at exit'))", 0),
    (_SEEN + "; import threading, time; threading.Thread(target=lambda: (time.sleep(0.2), print('joined'))).start()",
     0),
    (_SEEN + "; raise KeyboardInterrupt", -signal.SIGINT),
])
def test_a_forked_c_job_ends_as_a_fresh_process(tmp_path, code, status):
  env = dict(os.environ, FS_X="1", PYTHONPATH=REPO)
  forked, fresh = _both([sys.executable, "-c", code, "arg"], env, str(tmp_path))
  assert forked == fresh and forked[0] == status, (forked, fresh)


def test_module_and_script_jobs_see_their_argv_cwd_and_path(tmp_path):
  script = tmp_path / "s" / "job.py"
  script.parent.mkdir()
  script.write_text(_SEEN + "\n")
  env = dict(os.environ, FS_X="2", PYTHONPATH=f"{tmp_path / 's'}{os.pathsep}{REPO}")
  for argv in ([sys.executable, str(script), "a", "b"], [sys.executable, "-m", "job", "a"]):
    forked, fresh = _both(argv, env, str(tmp_path))
    assert forked == fresh and forked[0] == 0, (forked, fresh)


def test_a_job_in_another_checkout_imports_its_tests_package(tmp_path):
  """The server runs as `-m tests.forkserver` from this repository; a job whose cwd holds a `tests` package of its
  own (the mutation check's copies) imports that one, as a fresh `python` there does."""
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "__init__.py").write_text("")
  code = "import os, tests; print(os.path.dirname(os.path.realpath(tests.__file__)))"
  forked, fresh = _both([sys.executable, "-c", code], dict(os.environ), str(tmp_path))
  assert forked == fresh and forked[1].strip() == os.path.realpath(tmp_path / "tests"), (forked, fresh)


def test_a_job_is_its_own_process_that_can_be_killed():
  env = dict(os.environ, PYTHONPATH=REPO)
  job = forkserver.start([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                         env=env, preload=PRELOAD)
  deadline = time.time() + 30
  while not open(job.out_path).read() and time.time() < deadline:
    time.sleep(0.01)
  assert job.poll() is None and int(open(job.out_path).read()) == job.pid != os.getpid()
  job.send_signal(signal.SIGKILL)
  assert job.wait(timeout=30) == -signal.SIGKILL
  assert forkserver.run([sys.executable, "-c", "pass"], env=env, preload=PRELOAD).returncode == 0   # serves on


def test_refuses_other_command_lines():
  with pytest.raises(ValueError, match="not"):
    forkserver.start([sys.executable, "-X", "importtime", "-c", "pass"], preload=PRELOAD)


def test_a_job_left_running_is_killed_before_the_next_one_starts():
  """A test that fails between start and wait leaves its job running; the server's next job still runs."""
  env = dict(os.environ, PYTHONPATH=REPO)
  left = forkserver.start([sys.executable, "-c", "import time; time.sleep(60)"], env=env, preload=PRELOAD)
  nxt = forkserver.run([sys.executable, "-c", "print('next')"], env=env, timeout=30, preload=PRELOAD)
  assert nxt.stdout == "next\n"
  assert left.returncode == -signal.SIGKILL


def test_at_most_max_servers_stay_up():
  """Each environment has its own server; beyond MAX_SERVERS the least recently used one is closed."""
  envs = [dict(os.environ, PYTHONPATH=REPO, FS_SERVER=str(i)) for i in range(forkserver.MAX_SERVERS + 1)]
  procs = []
  for env in envs:
    assert forkserver.run([sys.executable, "-c", "import os; print(os.environ['FS_SERVER'])"], env=env,
                          preload=PRELOAD).stdout == env["FS_SERVER"] + "\n"
    procs.append(next(reversed(forkserver._servers.values())).proc)
  assert len(forkserver._servers) == forkserver.MAX_SERVERS
  assert procs[0].wait(timeout=30) == 0 and all(p.poll() is None for p in procs[1:])


def test_jobs_of_one_server_draw_different_random_numbers():
  """numpy's legacy global RandomState (and Python's `random`) is fresh in each job, as in a fresh interpreter,
  not the server's state copied by the fork."""
  env = dict(os.environ, PYTHONPATH=REPO)
  code = "import random, numpy as np; print(np.random.random(), np.random.randint(1 << 30), random.random())"
  outs = [forkserver.run([sys.executable, "-c", code], env=env, timeout=60, preload=("numpy.random",)).stdout
          for _ in range(2)]
  assert outs[0] and all(a != b for a, b in zip(*(o.split() for o in outs))), outs


def _slow_first_fork_server(tmp_path, monkeypatch) -> dict:
  """The environment of a new server whose first fork takes 2 s (a preloaded module's before-fork hook), and a
  START_TIMEOUT of 0.5 s for the next start (the test restores it); job files go to tmp_path/jobs."""
  (tmp_path / "jobs").mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "jobs"))
  monkeypatch.setattr(forkserver, "START_TIMEOUT", 0.5)
  (tmp_path / "slow_first_fork.py").write_text(
      "import os, time\nforks = []\n"
      "os.register_at_fork(before=lambda: (forks.append(1), time.sleep(2 if len(forks) == 1 else 0)))\n")
  return dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")


def test_a_job_whose_start_timed_out_is_killed_and_its_replies_skipped(tmp_path, monkeypatch):
  """Each reply names its request: the next job gets its own pid, status and output, not the timed-out one's."""
  env = _slow_first_fork_server(tmp_path, monkeypatch)
  preload = ("json", "slow_first_fork")
  with pytest.raises(RuntimeError, match="did not start job .* within START_TIMEOUT=0.5 s"):
    forkserver.start([sys.executable, "-c", "import time; time.sleep(60)"], env=env, preload=preload)
  monkeypatch.setattr(forkserver, "START_TIMEOUT", 60)
  job = forkserver.start([sys.executable, "-c", "import os, sys; print(os.getpid()); sys.exit(4)"], env=env,
                         preload=preload)
  assert job.wait(timeout=30) == 4 and job.stdout == f"{job.pid}\n", (job.pid, job.returncode, job.stdout)
  assert not os.listdir(tmp_path / "jobs")             # the timed-out job's files too


def _procs_running(marker: str) -> list[int]:
  """Pids of the processes whose command line has marker (a forked job's is its server's)."""
  pids = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read().split(b"\0"):
          pids.append(int(pid))
    except OSError:
      pass
  return pids


def test_closing_a_server_kills_its_jobs_and_removes_their_files(tmp_path, monkeypatch):
  """Evicting a server (MAX_SERVERS) kills the job it runs (which then has its status and output), and the job
  whose start timed out; no job file stays."""
  env = _slow_first_fork_server(tmp_path, monkeypatch)
  monkeypatch.setattr(forkserver, "MAX_SERVERS", 1)
  preload = ("json", "slow_first_fork", f"fs_mark_{os.getpid()}_{id(tmp_path)}")
  (tmp_path / f"{preload[2]}.py").write_text("")
  with pytest.raises(RuntimeError, match="did not start job"):
    forkserver.start([sys.executable, "-c", "import time; time.sleep(60)"], env=env, preload=preload)
  assert _procs_running(preload[2])                     # the server, and the job once forked
  other = dict(env, FS_SERVER="other")
  assert forkserver.run([sys.executable, "-c", "pass"], env=other, timeout=60, preload=PRELOAD).returncode == 0
  assert not _procs_running(preload[2]) and not os.listdir(tmp_path / "jobs")

  monkeypatch.setattr(forkserver, "START_TIMEOUT", 60)
  job = forkserver.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], env=other,
                         preload=PRELOAD)
  deadline = time.time() + 30
  while not open(job.out_path).read() and time.time() < deadline:
    time.sleep(0.01)
  forkserver.run([sys.executable, "-c", "pass"], env=env, timeout=60, preload=preload)     # evicts job's server
  assert job.returncode == -signal.SIGKILL and job.stdout == "up\n", (job.returncode, job.stdout)
  with pytest.raises(ProcessLookupError):
    os.kill(job.pid, 0)
  assert not os.listdir(tmp_path / "jobs")
