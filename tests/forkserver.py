"""Python command lines (`-m MODULE`, `-c CODE`, `SCRIPT`, with their arguments) run in processes forked from a
server that has already imported the modules they need (jax, lcjax's engine and checkpoint code, torch ...), instead
of in a fresh `python` that imports them again (2-7 s a process on a 2-core machine). Linux only (fork, pidfd).

Each job is a process of its own with the job's argv, environment, working directory, sys.path[0] and pid, its
stdin from /dev/null, stdout and stderr captured, and its exit status as a fresh interpreter's: 0 at the end, the
code of SystemExit, 1 with Python's traceback for an uncaught exception, minus the signal when killed (a job can be
killed: `Job.pid` is its own process). It ends as the interpreter ends a program (threads joined, atexit handlers,
streams flushed), without tearing its modules down. One job at a time per server: a job whose start timed out is
killed at the server's next request, a job still running when its server is closed (evicted, or at exit) is killed,
and their output files are removed.
Each job's random state is its own, as a fresh interpreter's: numpy's legacy global RandomState is reseeded from the
OS's entropy in each job (Python's `random` reseeds itself at fork).
A job does not see the server's own `tests` package: it imports `tests` from its own sys.path (a job in a copy of
the repository, the copy's).
What it does not get afresh: the server's hash seed (str hashes, so the order of a set of strings, are the same in
every job of a server), and the modules the server imported, in the state importing left them. So:
- no preloaded module may start a JAX backend (the server checks; each job chooses its platforms and devices);
- environment variables read at import time must be the job's: a server is started with the job's environment
  and serves only jobs with the same one, apart from FREE_ENV (read at call time only);
- a module a job runs (`-m`, a script) or that defines absl flags must not be preloaded (it would run twice);
- the interpreter's teardown (module cleanup, C++ static destructors) is skipped, so an error or a crash there
  does not show: each entry point keeps one test run in a fresh interpreter (convert_hf's rerun in
  tests/test_convert_hf.py, the CLI in tests/test_compile_cache.py).
A test whose point is a fresh interpreter (a cache across processes, several hosts, an exec's limits) starts one.

  from tests import forkserver
  p = forkserver.run([sys.executable, "-m", "lcjax.cli.generate", ...], env=env, cwd=REPO, timeout=300)
  job = forkserver.start([...], env=env); os.kill(job.pid, signal.SIGKILL); job.wait()
"""
from __future__ import annotations

import atexit
import collections
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Read when called, never at import (by lcjax; pytest names the running test): a job may set them differently
# from its server.
FREE_ENV = ("LCJAX_CACHE_DIR", "PYTEST_CURRENT_TEST")
# What the servers import, unless a caller names its own list.
PRELOAD = ("jax", "numpy", "lcjax.checkpoint", "lcjax.engine.engine")

# Servers kept per process (the least recently used is closed for a new one): each holds its imports' memory
# (jax and lcjax about 0.2 GB, with torch and transformers about 0.5 GB), and a module's jobs share one environment.
MAX_SERVERS = 2
# Seconds start() waits for the server to report the job's pid (the fork follows the previous job's end at once).
START_TIMEOUT = 60.0

_servers: collections.OrderedDict = collections.OrderedDict()


class Job:
  """A running job: its request id, its pid, the files its stdout and stderr go to while it runs (out_path,
  err_path), and after wait its exit status, stdout and stderr (the files are then removed)."""

  def __init__(self, server: "_Server", argv: list[str], rid: int, pid: int, out: str, err: str):
    self.args, self.id, self.pid, self.returncode = argv, rid, pid, None
    self._server, self.out_path, self.err_path = server, out, err
    self.stdout = self.stderr = None

  def poll(self):
    if self.returncode is None:
      self._collect(0.0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None and not self._collect(timeout):
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, sig: int) -> None:
    """Signal the job unless it has ended (as Popen.send_signal)."""
    if self.poll() is None:
      try:
        os.kill(self.pid, sig)
      except ProcessLookupError:       # ended since the poll
        pass

  def _collect(self, timeout) -> bool:
    status = self._server.reply("exit", self.id, timeout)
    if status is None:
      return False
    self.returncode = status
    for name, path in (("stdout", self.out_path), ("stderr", self.err_path)):
      with open(path, encoding="utf-8", errors="replace") as f:
        setattr(self, name, f.read())
    self._server.remove_files(self.id)
    return True


class _Server:
  def __init__(self, env: dict, preload: tuple[str, ...]):
    self.log = tempfile.TemporaryFile()          # the server's own stderr (its imports' warnings)
    self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", *preload], env=env, cwd=REPO,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
    self.job = None
    self._buf = b""
    self._ids = itertools.count(1)
    self._files: dict[int, tuple[str, str]] = {}     # request id -> its job's (stdout, stderr) files, until collected
    line = self._line(300)
    if line != "ready":
      self.proc.kill()
      self.log.seek(0)
      raise RuntimeError(f"forkserver did not start ({line!r}): {self.log.read().decode()[-3000:]}")

  def _line(self, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    fd = self.proc.stdout.fileno()
    while b"\n" not in self._buf:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not select.select([fd], [], [], left)[0]:
        return None
      chunk = os.read(fd, 4096)
      if not chunk:
        return ""
      self._buf += chunk
    line, self._buf = self._buf.split(b"\n", 1)
    return line.decode()

  def start(self, argv, env, cwd) -> Job:
    if self.job is not None and self.job.returncode is None:     # left running by a test that failed: one at a time
      self.job.send_signal(9)
      self.job.wait(60)
    rid = next(self._ids)
    files = []
    for stream in ("out", "err"):
      fd, path = tempfile.mkstemp(prefix=f"forkjob-{stream}-")
      os.close(fd)
      files.append(path)
    out, err = self._files[rid] = tuple(files)
    req = dict(id=rid, argv=list(argv[1:]), env=env, cwd=os.path.abspath(cwd or os.getcwd()), stdout=out, stderr=err)
    self.proc.stdin.write((json.dumps(req) + "\n").encode())
    self.proc.stdin.flush()
    pid = self.reply("pid", rid, START_TIMEOUT)
    if pid is None:        # the server kills this job when the next request (or the end of its input) comes
      raise RuntimeError(f"forkserver did not start job {rid} ({argv[1:3]}) within START_TIMEOUT={START_TIMEOUT} s")
    self.job = Job(self, list(argv), rid, pid, out, err)
    return self.job

  def reply(self, kind: str, rid: int, timeout):
    """The value of the server's reply `KIND RID VALUE` ("pid" or "exit"), or None after timeout seconds. Replies
    for other requests are about jobs no Job holds (their start timed out, and the server killed them when the next
    request came): they are skipped, and such a job's files are removed at its exit."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      line = self._line(None if deadline is None else max(0.0, deadline - time.monotonic()))
      if line is None:
        return None
      words = line.split()
      if len(words) != 3 or words[0] not in ("pid", "exit") or not all(w.lstrip("-").isdigit() for w in words[1:]):
        self.log.seek(0)
        raise RuntimeError(f"forkserver sent {line!r} while job {rid} waited for its {kind}: "
                           f"{self.log.read().decode(errors='replace')[-3000:]}")
      got, got_id, value = words[0], int(words[1]), int(words[2])
      if got_id == rid:
        if got != kind:
          raise RuntimeError(f"forkserver sent {line!r} while job {rid} waited for its {kind}")
        return value
      if got == "exit":
        self.remove_files(got_id)

  def remove_files(self, rid: int) -> None:
    for path in self._files.pop(rid, ()):
      try:
        os.unlink(path)
      except FileNotFoundError:
        pass

  def close(self):
    """End the server (it kills the job it runs when its input ends); the held job collects its status and output,
    and the files of every job not collected are removed."""
    self.proc.stdin.close()
    try:
      if self.job is not None and self.job.returncode is None:
        self.job.wait(60)
      self.proc.wait(timeout=60)
    finally:
      for rid in list(self._files):
        self.remove_files(rid)


def _server(env: dict, preload) -> _Server:
  key = (tuple(preload), frozenset((k, v) for k, v in env.items() if k not in FREE_ENV))
  s = _servers.get(key)
  if s is not None and s.proc.poll() is not None:     # ended (killed): its jobs' files go
    _close(_servers.pop(key))
    s = None
  if s is None:
    while len(_servers) >= MAX_SERVERS:
      _close(_servers.popitem(last=False)[1])
    s = _servers[key] = _Server(env, tuple(preload))
  _servers.move_to_end(key)
  return s


def _close(s: _Server) -> None:
  try:
    s.close()
  except Exception:                    # noqa: BLE001  (a server already gone or stuck)
    s.proc.kill()
    s.proc.wait()
    if s.job is not None and s.job.returncode is None:    # its server cannot kill it any more
      try:
        os.kill(s.job.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


@atexit.register
def _close_all():
  while _servers:
    _close(_servers.popitem()[1])


def start(argv: list[str], env: dict | None = None, cwd: str | None = None, preload=PRELOAD) -> Job:
  """Start argv ([sys.executable, '-m' MODULE | '-c' CODE | SCRIPT, ARGS...]) as a forked job."""
  if argv[0] != sys.executable or len(argv) < 2 or (argv[1].startswith("-") and argv[1] not in ("-m", "-c")):
    raise ValueError(f"forkserver runs `{sys.executable} -m|-c|SCRIPT ...` command lines, not {argv[:3]}")
  if cwd is not None and not os.path.isdir(cwd):
    raise FileNotFoundError(f"forkserver job's cwd {cwd!r} is not a directory")
  env = dict(os.environ if env is None else env)
  return _server(env, preload).start(argv, env, cwd)


def run(argv: list[str], env: dict | None = None, cwd: str | None = None, timeout: float | None = None,
        preload=PRELOAD) -> subprocess.CompletedProcess:
  """subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout), forked."""
  job = start(argv, env, cwd, preload)
  try:
    job.wait(timeout)
  except subprocess.TimeoutExpired:
    job.send_signal(9)
    job.wait()
    raise
  return subprocess.CompletedProcess(job.args, job.returncode, job.stdout, job.stderr)


# -- the server (`python -m tests.forkserver MODULE...`) ------------------------------------------------------------

def _child(req: dict) -> None:
  """In the forked process: become the job, run it and end as the interpreter ends a program (never returns)."""
  import runpy
  import types
  if "numpy.random" in sys.modules:          # the server's legacy global RandomState, copied by the fork
    sys.modules["numpy.random"].seed()       # from the OS's entropy, as at import in a fresh interpreter
  for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_TRUNC),
                          (2, req["stderr"], os.O_WRONLY | os.O_TRUNC)):
    f = os.open(path, flags)
    os.dup2(f, fd)
    os.close(f)
  argv, code = req["argv"], 0
  for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
    del sys.modules[name]      # the server's own package (a job in a copy of the repository imports the copy's)
  try:
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if argv[0] == "-m":
      sys.argv, sys.path[0] = [argv[1], *argv[2:]], req["cwd"]
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
      sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
      main = types.ModuleType("__main__")
      sys.modules["__main__"] = main
      exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
      sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
      runpy.run_path(argv[0], run_name="__main__")
  except SystemExit as e:
    code = _exit_code(e.code)
  except BaseException as e:                                   # noqa: BLE001  (what the interpreter does with it)
    sys.excepthook(type(e), e, e.__traceback__)
    code = "SIGINT" if isinstance(e, KeyboardInterrupt) else 1
  _end(code)


def _exit_code(c) -> int:
  if c is None or isinstance(c, int):
    return c or 0
  print(c, file=sys.stderr)
  return 1


def _end(code) -> None:
  """The interpreter's end of a program (Py_FinalizeEx): non-daemon threads joined, atexit handlers, the standard
  streams flushed; then the process exits without tearing its modules down (0.6 s with jax loaded, and nothing a
  job shows). An uncaught KeyboardInterrupt ends it by SIGINT, as CPython does."""
  import atexit
  import signal
  import threading
  threading._shutdown()
  atexit._run_exitfuncs()
  for f in (sys.stdout, sys.stderr):
    try:
      f.flush()
    except (OSError, ValueError):
      pass
  if code == "SIGINT":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  os._exit(code if isinstance(code, int) else 1)


def _serve(preload: list[str]) -> None:
  import importlib
  import gc
  for name in preload:
    importlib.import_module(name)
  # The imports' objects go to the collector's permanent generation: a job's collections never traverse them (a
  # gc.collect() in a job with jax, torch and transformers imported took 0.15 s, and each collection's writes to
  # their headers copied the pages the fork shares).
  gc.freeze()
  if "jax" in sys.modules:
    from jax._src import xla_bridge
    if xla_bridge._backends:
      raise RuntimeError(f"importing {preload} started a JAX backend: jobs could not choose their own")
  os.write(1, b"ready\n")
  buf, eof = b"", False
  while not eof:
    while b"\n" not in buf:
      chunk = os.read(0, 1 << 16)
      if not chunk:
        return
      buf += chunk
    line, buf = buf.split(b"\n", 1)
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      try:
        _child(req)
      finally:                         # _child ends the process; anything that escapes it ends the job, not a server
        os._exit(70)
    os.write(1, f"pid {req['id']} {pid}\n".encode())
    status, buf, eof = _wait_job(pid, buf)
    os.write(1, f"exit {req['id']} {status}\n".encode())


def _wait_job(pid: int, buf: bytes) -> tuple[int, bytes, bool]:
  """Wait for the job pid to end, reading the server's input meanwhile: a new request or the end of the input means
  the client has given up on the job (it kills a job it holds before its next request), so the job is killed.
  Returns its exit status, the input read and whether the input ended."""
  pidfd, ended, eof = os.pidfd_open(pid), False, False
  try:
    while not (ended or eof or b"\n" in buf):
      ended = pidfd in select.select([pidfd, 0], [], [])[0]
      if not ended:
        chunk = os.read(0, 1 << 16)
        buf, eof = buf + chunk, not chunk
  finally:
    os.close(pidfd)
  if not ended:
    os.kill(pid, signal.SIGKILL)
  _, status = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(status), buf, eof


if __name__ == "__main__":
  _serve(sys.argv[1:])
