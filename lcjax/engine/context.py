"""Pinned contexts: a prefilled document whose KV pages stay on the device until it is closed, offloaded to host
memory, or saved to disk and restored in another process (onto any mesh).

A context is a sequence the scheduler does not free (`Scheduler.pin`). Its K/V leave the device page by page in
table order, one layer at a time, as `[n_pages, Z, K, H]` with the model's own K KV heads (the engine's repeated
heads are dropped), so a context saved at one mesh restores at another: restoring allocates fresh pages in the
target pool (each on the shard of its table slot) and writes them, after first sharing whatever full pages the
prefix cache still holds.

This module is the Context handle and the restore of a saved one. The pages move between the device and the host
in lcjax.engine.context_mover; on disk a context is a directory of the format in lcjax.engine.context_file
(checksummed, and signed with the user's key).

Legend: Z page size, K KV heads, H head dim.
"""
from __future__ import annotations

import os
import threading
import time
import weakref

import numpy as np

from lcjax.engine import context_file
from lcjax.engine.context_file import (KV_FILE, META_FILE, ContextError, _kv_blocks, _saved_scales,
                                       check_fingerprint, read_meta, read_tokens, verified)
from lcjax.engine.context_mover import blocks_out as _blocks_out, blocks_to_host, prefetch, write_blocks
# Names callers (the engine, the CLI, tests and tools) import from here.
from lcjax.engine.context_file import (BLOCK_PAGES, FORMAT, KEY_BYTES, KEY_FILE, _digest,  # noqa: F401
                                       _meta_digest, _npy_bytes, fingerprint, mismatches, user_key)
from lcjax.engine.context_mover import mover_of as _mover  # noqa: F401
from lcjax.engine.requests import RequestError
from lcjax.tokenizer import ChatContinuation


class Context:
  """A prefilled, pinned context (see `Engine.prefill`). Holds its pages until `close()`; usable as a context
  manager. `len(ctx)` is its token count; `ctx.stats` says how it was made (`seconds`: the prefill or restore
  time it paid, reported here and in no generation's stats); `ctx.chat` is set for a chat context
  (`Engine.prefill(..., chat=True)`)."""

  def __init__(self, engine, token_ids: list[int], seq: int, *, cached_tokens: int = 0, source: str = "prefill",
               seconds: float = 0.0, chat: ChatContinuation | None = None, shared: bool = True):
    self.engine = engine
    self.shared = shared          # its pages may join the prefix cache (False: restored from an unverified file)
    self.token_ids = list(token_ids)
    self.chat = chat              # set: the context is a chat's open user turn, continued by questions (chat=True)
    self.seq: int | None = None
    self._finalizer = None
    self._hold(seq)
    self._host = None             # [(layer, first page index, parts)] host blocks while offloaded
    # Guards seq and _host between threads: held through offload, save and close; restore takes the host blocks
    # under it, then pins without it (a pin waits for other threads' runs, whose consumers may close the context).
    self._lock = threading.RLock()
    self._restoring = False       # a restore has taken the host blocks and waits for its pages
    self._close_asked = False     # close() during that restore: the restore gives its pages back
    self.meta: dict = {}          # the caller's JSON-serializable notes, saved and restored with the context
    self.stats = dict(source=source, tokens=len(token_ids), cached_tokens=cached_tokens, seconds=seconds,
                      shared=shared)

  def __len__(self) -> int:
    return len(self.token_ids)

  def _hold(self, seq: int) -> None:
    """Own pinned sequence `seq`; a Context dropped without close() hands it back to the scheduler."""
    # The epoch its pages were written in (a step of another thread may have lost them since pin() returned).
    self.seq, self.epoch = seq, self.engine.scheduler.pinned.get(seq)
    self._finalizer = weakref.finalize(self, self.engine.scheduler.orphans.append, seq)

  def _let_go(self) -> None:
    if self.seq is not None:
      self._finalizer.detach()
      self.engine.scheduler.unpin(self.seq)
    self.seq = None

  def __repr__(self) -> str:
    where = "closed" if self.closed else "host" if self._host is not None else "device"
    return f"Context({len(self)} tokens on {where})"

  @property
  def closed(self) -> bool:
    return self.seq is None and self._host is None and not self._restoring

  @property
  def on_device(self) -> bool:
    return self.seq is not None

  def pages(self) -> list[int]:
    return self.engine.scheduler.pool.page_table(self.seq)

  def _check_usable(self, engine=None) -> None:
    if engine is not None and engine is not self.engine:
      raise RequestError("this context belongs to another engine: prefill or load it on this one")
    self.engine.scheduler.check_open()
    if self._restoring:
      raise RequestError("this context is being restored by another thread")
    if self.closed:
      raise RequestError("this context is closed")
    if self._host is not None:
      raise RequestError("this context is offloaded to host memory: call ctx.restore() first")
    if self.epoch != self.engine.scheduler.epoch:
      raise RequestError("this context's pages were lost when a device step was interrupted: prefill it again")

  def close(self) -> None:
    """Return the context's pages (its full pages stay in the prefix cache until the pool needs them)."""
    with self._lock:
      self._close_asked = self._restoring
      self._let_go()
      self._host = None

  def __enter__(self) -> "Context":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- host tier ----------------------------------------------------------------------------------------------
  def offload(self) -> float:
    """Copy the context's K/V to host memory and return its pages to the pool; returns the seconds taken."""
    with self._lock:
      t0 = time.perf_counter()
      with self.engine.scheduler.lock:
        self._check_usable()                     # under the lock that an interrupted step's recovery takes
        self._host, self.stats["host_memory"] = blocks_to_host(self.engine, self.pages())
        self._let_go()
      return time.perf_counter() - t0

  def restore(self) -> float:
    """Bring an offloaded context back onto the device (sharing pages the prefix cache still holds); returns
    the seconds taken. One restore at a time: another thread's is refused while this one runs."""
    with self._lock:
      if self._host is None:
        raise RequestError("this context is being restored by another thread" if self._restoring else
                           "this context is not offloaded" if not self.closed else "this context is closed")
      host, self._host, self._restoring, self._close_asked = self._host, None, True, False
    t0 = time.perf_counter()

    def fill(pages, first):
      write_blocks(self.engine, pages, host, first)

    try:
      # waits for other threads' runs
      seq, cached = self.engine.scheduler.pin(self.token_ids, fill=fill, share=self.shared)
    except BaseException:
      with self._lock:
        self._restoring = False
        if not self._close_asked:
          self._host = host
      raise
    with self._lock:
      self._restoring = False
      if self._close_asked:
        self.engine.scheduler.unpin(seq)
        raise RequestError("this context was closed while it was being restored")
      self._hold(seq)
      self.stats.update(cached_tokens=cached)
    return time.perf_counter() - t0

  # -- disk ---------------------------------------------------------------------------------------------------
  def save(self, path, *, overwrite: bool = False) -> float:
    """Write the context to directory `path` (atomic: a killed save leaves nothing that loads) with a checksum of
    every file and of every block of kv.bin. overwrite=True replaces a saved context at `path`, never anything
    else. Returns the seconds taken."""
    with self._lock:
      return self._save(path, overwrite)

  def _save(self, path, overwrite: bool) -> float:
    self._check_usable()
    eng = self.engine
    dst = os.path.abspath(os.fspath(path))
    t0 = time.perf_counter()

    def contents():
      self._check_usable()                       # again, under the scheduler's lock (context_file.write holds it)
      pages, cache = self.pages(), eng.scheduler.cache
      header = dict(fingerprint=eng.fingerprint, tokens=len(self), pages=len(pages), page_size=eng.run.page_size,
                    layers=eng.cfg.n_layers, kv_heads=eng.cfg.n_kv_heads, head_dim=eng.cfg.head_dim,
                    dtype=str(cache.k.dtype), meta=self.meta,
                    chat=self.chat.to_dict() if self.chat is not None else None)
      return header, self.token_ids, cache.quantized, _blocks_out(eng, pages)

    context_file.write(dst, overwrite, eng.scheduler.lock, contents, sign=self.shared)
    return time.perf_counter() - t0


def load_context(engine, path, share: bool | None = None) -> Context:
  """Restore a saved context: every file and block is checked against its checksum as it is read, and a context
  that fails any check leaves nothing behind (its pages join the prefix cache only once all of it was written).
  share: whether its pages join the prefix cache (None: when its signature verifies, see the module doc)."""
  path = os.path.abspath(os.fspath(path))
  meta = read_meta(path)
  check_fingerprint(path, meta, engine.fingerprint)
  cache = engine.scheduler.cache
  mine = dict(page_size=engine.run.page_size, layers=engine.cfg.n_layers, kv_heads=engine.cfg.n_kv_heads,
              head_dim=engine.cfg.head_dim, dtype=str(cache.k.dtype))
  for key, value in mine.items():
    if meta[key] != value:
      raise ContextError(f"{os.path.join(path, META_FILE)} says {key}={meta[key]!r}, this engine has {value!r}: "
                         "save the context again")
  ids = read_tokens(path, meta, engine.max_context - 1)
  scales = _saved_scales(path, meta) if cache.quantized else None        # [L, 2, n, K]
  engine.limits.check(0, ids, 1, what="the context")
  n, Z, K, H, L = meta["pages"], meta["page_size"], meta["kv_heads"], meta["head_dim"], meta["layers"]
  dtype = np.dtype(cache.k.dtype)
  kv_path = os.path.join(path, KV_FILE)
  if not os.path.isfile(kv_path):
    raise ContextError(f"{path} has no {KV_FILE}: save the context again")
  size = os.path.getsize(kv_path)
  if size != 2 * L * n * Z * K * H * dtype.itemsize:
    raise ContextError(f"{kv_path} holds {size} bytes, {L} layers of {n} pages need "
                       f"{2 * L * n * Z * K * H * dtype.itemsize}: save the context again")

  def blocks():
    for l, s, parts in _kv_blocks(path, meta, dtype):
      if scales is not None:
        parts += (scales[l, 0, s:s + len(parts[0])], scales[l, 1, s:s + len(parts[0])])
      yield l, s, parts

  def fill(pages, first):
    write_blocks(engine, pages, prefetch(blocks()), first)

  t0 = time.perf_counter()
  signed = verified(meta)
  shared = signed if share is None else bool(share)
  seq, cached = engine.scheduler.pin(ids, fill=fill, share=shared)
  chat = ChatContinuation.from_dict(meta["chat"]) if meta.get("chat") else None
  ctx = Context(engine, ids, seq, cached_tokens=cached, source=path, seconds=time.perf_counter() - t0, chat=chat,
                shared=shared)
  ctx.stats["verified"] = signed
  ctx.meta = dict(meta["meta"])
  return ctx
