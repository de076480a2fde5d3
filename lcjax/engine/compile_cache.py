"""JAX's persistent compilation cache, set up once per process before the first compile (RunConfig.compile_cache).

Compiling the engine's steps takes seconds (minutes for long contexts on a GPU); with the cache, a later process
that compiles the same programs (same model shapes, run config, jax version and devices) reads them from disk.
Every program is written, the smallest included: JAX's default thresholds skip programs that compiled in under a
second, while reading one back takes milliseconds. Where the user set JAX's own thresholds
(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES) they are kept.

The cache is trusted code: a directory others can write to lets them run code in this process (JAX's warning).
lcjax makes its cache directory private (0700); a directory that is owned by another user or writable by its group
or all users is not used under "auto" (logged), and used with a warning that says why when it is named.

Several processes (jax.distributed): "auto" turns the cache off. JAX writes entries from process 0 only, and the
other processes' cache keys differ from process 0's (checked on CPUs with gloo collectives: 25 of 25 programs
missed on process 1 while process 0 read all of its own), so with a warm cache process 0 runs executables read
from disk and the others freshly compiled ones, and their first collective hung (tests/test_multihost.py's engines,
second run). A directory given by name is used anyway, with a warning.

`compile_seconds()` is the time this thread has spent making programs (tracing, lowering, compiling or reading
them from the cache), from JAX's monitoring events: a call's stats report what it spent there.
"""
from __future__ import annotations

import logging
import os
import threading

import jax

from lcjax.config import ConfigError

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_applied: dict | None = None          # {"setting": RunConfig.compile_cache, "dir": directory or None (off)}
_counts = {"requests": 0, "hits": 0}  # programs compiled through the cache, and those read from it
_warned: set = set()

SUBDIR = "jax-compile"
# JAX's duration events of making a program: tracing, lowering to MLIR, and the backend's compile (or cache read).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_thread = threading.local()


def _add_compile_time(event: str, seconds: float, **kwargs) -> None:
  if event in _COMPILE_EVENTS:
    _thread.seconds = getattr(_thread, "seconds", 0.0) + seconds


jax.monitoring.register_event_duration_secs_listener(_add_compile_time)


def compile_seconds() -> float:
  """Seconds this thread has spent making JAX programs since the process started: the difference across a call
  is the call's compilation."""
  return getattr(_thread, "seconds", 0.0)


def resolve(setting: str, *, jax_dir: str | None, jax_enabled: bool, user_cache: str,
            processes: int = 1) -> str | None:
  """The cache directory of a RunConfig.compile_cache value, None for off. "auto" defers to JAX's own settings
  (JAX_COMPILATION_CACHE_DIR, JAX_ENABLE_COMPILATION_CACHE=false) where they are set, else <user_cache>/jax-compile,
  and is off when `processes` > 1 (module docstring); a directory given by name is used whatever JAX's settings
  say."""
  if setting == "off":
    return None
  if setting != "auto":
    return os.path.abspath(os.path.expanduser(setting))
  if not jax_enabled or processes > 1:
    return None
  return jax_dir or os.path.join(user_cache, SUBDIR)


def _count(event: str, **kwargs) -> None:
  if event == "/jax/compilation_cache/compile_requests_use_cache":
    _counts["requests"] += 1
  elif event == "/jax/compilation_cache/cache_hits":
    _counts["hits"] += 1


def enable(setting: str) -> str | None:
  """Set up JAX's persistent compilation cache for `setting` (RunConfig.compile_cache), once per process: JAX reads
  its cache directory at the first compile that uses it, so the first engine's setting holds for the process and a
  later, different one is logged and ignored. Returns the directory in use, None when off."""
  global _applied
  from lcjax.checkpoint.sources import make_private_dir, unsafe_dir, user_cache_dir
  with _lock:
    processes = jax.process_count()
    path = resolve(setting, jax_dir=jax.config.jax_compilation_cache_dir,
                   jax_enabled=jax.config.jax_enable_compilation_cache, user_cache=user_cache_dir(),
                   processes=processes)
    if processes > 1 and _applied is None:
      if setting == "auto":
        _log.warning("the JAX compilation cache is off: %d processes (a warm cache hangs them: process 0 reads "
                     "programs the others compile afresh); --config.compile_cache=DIR uses one anyway", processes)
      elif path is not None:
        _log.warning("compile_cache=%s with %d processes: a warm cache has hung multi-process runs (process 0 reads "
                     "programs the others compile afresh; lcjax.engine.compile_cache)", path, processes)
    if _applied is not None:
      if path != _applied["dir"] and setting not in _warned:
        _warned.add(setting)
        _log.warning("compile_cache=%r is ignored: this process's JAX compilation cache was set up by an earlier "
                     "engine (compile_cache=%r: %s)", setting, _applied["setting"], _applied["dir"] or "off")
      return _applied["dir"]
    if path is not None:
      reason = unsafe_dir(path)
      if reason and setting == "auto":
        _log.warning("the JAX compilation cache is off: %s is unsafe to run programs from, %s; "
                     "--config.compile_cache=DIR names a directory to use anyway", path, reason)
        path = None
      elif reason:
        _log.warning("compile_cache=%s is used as named, but it is unsafe: %s, so others can plant programs this "
                     "process runs", path, reason)
    if path is not None:
      try:
        make_private_dir(path)
      except OSError as e:
        if setting != "auto":
          raise ConfigError(f"compile_cache={setting!r}: cannot create the directory {path}: {e.strerror}") from None
        _log.warning("the JAX compilation cache is off: cannot create %s (%s); set "
                     "--config.compile_cache=DIR or LCJAX_CACHE_DIR", path, e.strerror)
        path = None
    if path is None:
      jax.config.update("jax_enable_compilation_cache", False)
    else:
      jax.config.update("jax_enable_compilation_cache", True)
      jax.config.update("jax_compilation_cache_dir", path)
      if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)   # -1: no size limit, no override
      jax.monitoring.register_event_listener(_count)
      _log.info("JAX compilation cache: %s", path)
    _applied = dict(setting=setting, dir=path)
    return path


def stats() -> dict:
  """{"dir": the cache directory or None (off, or not set up yet), "requests": programs compiled through the cache
  in this process, "hits": of those, read from it}."""
  return dict(dir=_applied["dir"] if _applied else None, **_counts)
