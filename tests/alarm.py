"""A guard that turns a runaway loop into a test failure: TimeoutError in the test's thread after `seconds` of wall
time (SIGALRM; Python's loops and re's matching loop check for signals between steps). A bound on what code costs
is checked by what it counts; this only keeps a loop that never ends from stalling the suite."""
from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def alarm(seconds: float):
  def stop(*_):
    raise TimeoutError(f"still running after {seconds} s")
  before = signal.signal(signal.SIGALRM, stop)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, before)
