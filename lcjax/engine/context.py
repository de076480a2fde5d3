"""Pinned contexts: a prefilled document whose KV pages stay on the device until it is closed, offloaded to host
memory, or saved to disk and restored in another process (onto any mesh).

A context is a sequence the scheduler does not free (`Scheduler.pin`). Its K/V leave the device page by page in
table order, one layer at a time, as `[n_pages, Z, K, H]` with the model's own K KV heads (the engine's repeated
heads are dropped), so a context saved at one mesh restores at another: restoring allocates fresh pages in the
target pool (each on the shard of its table slot) and writes them, after first sharing whatever full pages the
prefix cache still holds.

fp8 pages travel with their scales (lcjax.cache.kv), [n_pages, K] per layer.

On disk a context is a directory, written as `DST.tmp-<pid>` and renamed when complete (lcjax.checkpoint.atomic:
a killed save leaves nothing that loads, and the next save to DST removes what it left):
  context.json   format, the engine fingerprint (model config, weights digest, dtypes, page size), the token
                 count and layout, a chat context's continuation (lcjax.tokenizer.ChatContinuation); written last
  tokens.npy     int32 token ids
  kv.bin         for each layer, K then V pages [n_pages, Z, K, H] in the cache dtype, raw (streamed in and out
                 at disk speed; one layer in host memory at a time)
  scales.npy     fp8 caches: the pages' K and V scales [L, 2, n_pages, K] float32
Format lcjax-context-v1 (before per-page scales) is read too: its fp8 pages were stored with one scale per
(layer, kv head), context.json's k_scale / v_scale [L, K], which every page of the layer takes.

Legend: L layers, P pages, Z page size, K KV heads, H head dim, n the context's pages.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lcjax.cache import kv as kvc
from lcjax.checkpoint.atomic import AtomicDirectory
from lcjax.engine.requests import RequestError
from lcjax.tokenizer import ChatContinuation

FORMAT = "lcjax-context-v2"
FORMATS = ("lcjax-context-v1", FORMAT)      # read
META_FILE = "context.json"
SCALES_FILE = "scales.npy"


class ContextError(ValueError):
  """A context that cannot be saved, restored or used here; the message names the values."""


BLOCK_PAGES = 256    # pages per gather / scatter call
_IN_FLIGHT = 8       # gathers to pinned host memory dispatched ahead of the one waited for


def _block(n: int) -> int:
  """Pages a call moves for n pages: BLOCK_PAGES from a quarter of it up (one compiled shape for every long
  context), else the next power of two."""
  return BLOCK_PAGES if n > BLOCK_PAGES // 4 else 1 << max(0, n - 1).bit_length()


def _gather(cache, layer, pages, rep: int) -> tuple:
  """`cache.parts()` of `pages` of one layer, the model's own KV heads: K, V [b, Z, K, H] (and fp8 scales
  [b, K])."""
  k, v, *scales = (x[layer, pages] for x in cache.parts())
  return (k[..., ::rep, :], v[..., ::rep, :], *(s[..., ::rep] for s in scales))


def _scatter(cache, layer, pages, parts, rep: int):
  """Write what _gather returned (the model's KV heads) into `pages` of one layer."""
  k, v, *scales = parts
  parts = (jnp.repeat(k, rep, axis=-2), jnp.repeat(v, rep, axis=-2), *(jnp.repeat(s, rep, axis=-1) for s in scales))
  return kvc.PagedKV(*(x.at[layer, pages].set(y.astype(x.dtype)) for x, y in zip(cache.parts(), parts)))


class _Mover:
  """The engine's compiled page gather / scatter (one block of one layer per call). `pinned`: the gather that
  lands its blocks in pinned host memory (None where the devices offer none), which the host tier keeps: the
  way back to the device then runs at the link's full speed, not through a pageable staging copy."""

  def __init__(self, engine):
    mesh, rep = engine.mesh, engine.kv_rep
    replicated = NamedSharding(mesh, PartitionSpec())
    self.replicated = replicated
    gather = lambda c, l, p: _gather(c, l, p, rep)
    self.gather = jax.jit(gather, out_shardings=replicated)
    out = kvc.cache_shardings(mesh, engine.fp8_cache)
    self.scatter = jax.jit(lambda c, l, p, parts: _scatter(c, l, p, parts, rep), donate_argnums=0,
                           out_shardings=out)
    self.pinned = None
    if all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in mesh.devices.flat):
      host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
      self.pinned = jax.jit(gather, out_shardings=host)


def _mover(engine) -> _Mover:
  if getattr(engine, "_context_mover", None) is None:
    engine._context_mover = _Mover(engine)
  return engine._context_mover


def _gather_jobs(engine, pages: list[int]):
  """(block size B, page-index array [blocks, B] padded with the null page, [(layer, block)] in order)."""
  n, B = len(pages), _block(len(pages))
  blocks = -(-n // B)
  idx = np.zeros(blocks * B, np.int32)
  idx[:n] = pages
  return B, jnp.asarray(idx.reshape(blocks, B)), [(l, j) for l in range(engine.cfg.n_layers) for j in range(blocks)]


def _blocks_out(engine, pages: list[int]):
  """Yield (layer, first page index, parts): numpy K, V [b, Z, K, H] (and fp8 scales [b, K]) of consecutive pages,
  layer by layer, in page order; the next block's device-to-host copy is under way while the current one is
  handed over."""
  mover, sched = _mover(engine), engine.scheduler
  B, idx, jobs = _gather_jobs(engine, pages)

  def start(job):
    l, j = job
    parts = mover.gather(sched.cache, jnp.int32(l), idx[j])
    for x in parts:
      x.copy_to_host_async()
    return parts

  nxt = start(jobs[0])
  for i, (l, j) in enumerate(jobs):
    cur, nxt = nxt, (start(jobs[i + 1]) if i + 1 < len(jobs) else None)
    b = min(B, len(pages) - j * B)
    yield l, j * B, tuple(np.asarray(x)[:b] for x in cur)


def _blocks_to_host(engine, pages: list[int]) -> tuple[list, str]:
  """The context's blocks in host memory: (blocks, "pinned_host" | "numpy"). Pinned blocks keep their padding
  (rows past the context are the null page's)."""
  mover, sched = _mover(engine), engine.scheduler
  if mover.pinned is not None:
    try:
      B, idx, jobs = _gather_jobs(engine, pages)
      out = []
      for i, (l, j) in enumerate(jobs):
        out.append((l, j * B, mover.pinned(sched.cache, jnp.int32(l), idx[j])))
        if i >= _IN_FLIGHT:     # each call holds its block on the device until its copy lands: bound them
          jax.block_until_ready(out[i - _IN_FLIGHT][2])
      jax.block_until_ready(out)
      return out, "pinned_host"
    except Exception as e:  # noqa: BLE001 - a backend that lists pinned memory but cannot place outputs there
      logging.warning("offload to pinned host memory failed (%s): using numpy host arrays", repr(e)[:200])
      mover.pinned = None
  return list(_blocks_out(engine, pages)), "numpy"


def _write_blocks(engine, pages: list[int], blocks, first: int = 0) -> None:
  """Write host blocks (layer, first page index s, parts: K, V [b, Z, K, H] and fp8 scales [b, K]) into the
  context's pages[s:s + b]. Blocks wholly before page index `first` (shared from the prefix cache) are skipped;
  rows before it in a block, and rows past the context, go to the null page, which is never read."""
  mover, sched = _mover(engine), engine.scheduler
  n = len(pages)
  sent = 0
  for l, s, parts in blocks:
    b = len(parts[0])
    if s + b <= first:
      continue
    B = _block(b)
    target = np.zeros(B, np.int32)
    for i in range(max(0, first - s), min(b, n - s)):
      target[i] = pages[s + i]
    if B != b:
      parts = [np.concatenate([np.asarray(x), np.zeros((B - b, *x.shape[1:]), x.dtype)]) for x in parts]
    parts = tuple(jax.device_put(x, mover.replicated) for x in parts)
    sched.cache = mover.scatter(sched.cache, jnp.int32(l), jnp.asarray(target), parts)
    sent += 1
    if sent % _IN_FLIGHT == 0:    # each block waits on the device until its scatter runs: bound them
      jax.block_until_ready(sched.cache.k)
  jax.block_until_ready(sched.cache.k)


def _prefetch(it, depth: int = 2):
  """Run iterator `it` (file reads, which release the GIL) up to `depth` items ahead in a thread; the thread ends
  when the consumer stops early too."""
  q: queue.Queue = queue.Queue(depth)
  done, stop = object(), threading.Event()

  def put(x) -> bool:
    while not stop.is_set():
      try:
        q.put(x, timeout=0.1)
        return True
      except queue.Full:
        pass
    return False

  def work():
    try:
      for x in it:
        if not put(x):
          return
      put(done)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
      put(e)

  worker = threading.Thread(target=work, daemon=True)
  worker.start()
  try:
    while (x := q.get()) is not done:
      if isinstance(x, BaseException):
        raise x
      yield x
  finally:
    stop.set()
    worker.join()


class Context:
  """A prefilled, pinned context (see `Engine.prefill`). Holds its pages until `close()`; usable as a context
  manager. `len(ctx)` is its token count; `ctx.stats` says how it was made (`seconds`: the prefill or restore
  time it paid, reported here and in no generation's stats); `ctx.chat` is set for a chat context
  (`Engine.prefill(..., chat=True)`)."""

  def __init__(self, engine, token_ids: list[int], seq: int, *, cached_tokens: int = 0, source: str = "prefill",
               seconds: float = 0.0, chat: ChatContinuation | None = None):
    self.engine = engine
    self.token_ids = list(token_ids)
    self.chat = chat              # set: the context is a chat's open user turn, continued by questions (chat=True)
    self.seq: int | None = None
    self._finalizer = None
    self._hold(seq)
    self._host = None             # [(layer, first page index, parts)] host blocks while offloaded
    self.meta: dict = {}          # the caller's JSON-serializable notes, saved and restored with the context
    self.stats = dict(source=source, tokens=len(token_ids), cached_tokens=cached_tokens, seconds=seconds)

  def __len__(self) -> int:
    return len(self.token_ids)

  def _hold(self, seq: int) -> None:
    """Own pinned sequence `seq`; a Context dropped without close() hands it back to the scheduler."""
    self.seq, self.epoch = seq, self.engine.scheduler.epoch
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
    return self.seq is None and self._host is None

  @property
  def on_device(self) -> bool:
    return self.seq is not None

  def pages(self) -> list[int]:
    return self.engine.scheduler.pool.page_table(self.seq)

  def _check_usable(self, engine=None) -> None:
    if engine is not None and engine is not self.engine:
      raise RequestError("this context belongs to another engine: prefill or load it on this one")
    self.engine.scheduler.check_open()
    if self.closed:
      raise RequestError("this context is closed")
    if self._host is not None:
      raise RequestError("this context is offloaded to host memory: call ctx.restore() first")
    if self.epoch != self.engine.scheduler.epoch:
      raise RequestError("this context's pages were lost when a device step was interrupted: prefill it again")

  def close(self) -> None:
    """Return the context's pages (its full pages stay in the prefix cache until the pool needs them)."""
    self._let_go()
    self._host = None

  def __enter__(self) -> "Context":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- host tier ----------------------------------------------------------------------------------------------
  def offload(self) -> float:
    """Copy the context's K/V to host memory and return its pages to the pool; returns the seconds taken."""
    self._check_usable()
    t0 = time.perf_counter()
    with self.engine.scheduler.lock:
      self._host, self.stats["host_memory"] = _blocks_to_host(self.engine, self.pages())
      self._let_go()
    return time.perf_counter() - t0

  def restore(self) -> float:
    """Bring an offloaded context back onto the device (sharing pages the prefix cache still holds); returns
    the seconds taken."""
    if self._host is None:
      raise RequestError("this context is not offloaded" if not self.closed else "this context is closed")
    t0 = time.perf_counter()
    host = self._host

    def fill(pages, first):
      _write_blocks(self.engine, pages, host, first)

    seq, cached = self.engine.scheduler.pin(self.token_ids, fill=fill)
    self._hold(seq)
    self._host = None
    self.stats.update(cached_tokens=cached)
    return time.perf_counter() - t0

  # -- disk ---------------------------------------------------------------------------------------------------
  def save(self, path, *, overwrite: bool = False) -> float:
    """Write the context to directory `path` (atomic: a killed save leaves nothing that loads). Returns the
    seconds taken."""
    self._check_usable()
    eng = self.engine
    dst = os.path.abspath(path)
    t0 = time.perf_counter()
    with AtomicDirectory(dst, META_FILE, overwrite=overwrite, exists_error=ContextError(
        f"{dst} already exists: pass overwrite=True to replace it")) as out:
      with eng.scheduler.lock:
        pages = self.pages()
        np.save(os.path.join(out.tmp, "tokens.npy"), np.asarray(self.token_ids, np.int32))
        cache = eng.scheduler.cache
        scales = np.zeros((eng.cfg.n_layers, 2, len(pages), eng.cfg.n_kv_heads), np.float32)
        with open(os.path.join(out.tmp, "kv.bin"), "wb") as f:
          layer = []                                 # one layer's blocks: its K pages are written before its V
          for l, s, parts in _blocks_out(eng, pages):
            layer.append(parts)
            if cache.quantized:
              scales[l, :, s:s + len(parts[0])] = parts[2:]
            if len(layer) * _block(len(pages)) >= len(pages):
              for part in (0, 1):
                for kv in layer:
                  f.write(np.ascontiguousarray(kv[part]).view(np.uint8))
              layer = []
        if cache.quantized:
          np.save(os.path.join(out.tmp, SCALES_FILE), scales)
        meta = dict(format=FORMAT, fingerprint=eng.fingerprint, tokens=len(self), pages=len(pages),
                    page_size=eng.run.page_size, layers=eng.cfg.n_layers, kv_heads=eng.cfg.n_kv_heads,
                    head_dim=eng.cfg.head_dim, dtype=str(cache.k.dtype), meta=self.meta,
                    chat=self.chat.to_dict() if self.chat is not None else None)
      with open(os.path.join(out.tmp, META_FILE), "w") as f:   # the marker: written last
        json.dump(meta, f)
      out.commit()
    return time.perf_counter() - t0


def _mismatch(saved: dict, mine: dict, where: str = "") -> str | None:
  """The first field where two fingerprints differ, as 'name: saved X, this engine Y'."""
  for key in sorted(set(saved) | set(mine)):
    a, b = saved.get(key), mine.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      found = _mismatch(a, b, f"{where}{key}.")
      if found:
        return found
    elif a != b:
      return f"{where}{key}: saved {a!r}, this engine {b!r}"
  return None


def read_meta(path: str) -> dict:
  meta_path = os.path.join(path, META_FILE)
  if not os.path.isdir(path):
    raise ContextError(f"{path}: no such context directory")
  if not os.path.isfile(meta_path):
    raise ContextError(f"{path} is not a complete saved context (no {META_FILE}): save it again")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except json.JSONDecodeError as e:
    raise ContextError(f"{meta_path} is corrupt ({e.msg} at line {e.lineno}): save the context again") from None
  if meta.get("format") not in FORMATS:
    raise ContextError(f"{path} has format {meta.get('format')!r}, this lcjax reads {' and '.join(FORMATS)}")
  return meta


def _saved_scales(path: str, meta: dict) -> np.ndarray:
  """The fp8 scales of a saved context's pages, [L, 2, n, K] float32 (v1: its per-layer scales on every page)."""
  L, n, K = meta["layers"], meta["pages"], meta["kv_heads"]
  if meta["format"] == "lcjax-context-v1":
    per_layer = np.stack([np.asarray(meta["k_scale"]), np.asarray(meta["v_scale"])], 1).astype(np.float32)
    if per_layer.shape != (L, 2, K):
      raise ContextError(f"{path}: fp8 scales of shape {per_layer.shape}, expected {(L, 2, K)}: save it again")
    return np.broadcast_to(per_layer[:, :, None], (L, 2, n, K))
  scales_path = os.path.join(path, SCALES_FILE)
  if not os.path.isfile(scales_path):
    raise ContextError(f"{path} holds fp8 pages but no {SCALES_FILE}: save the context again")
  scales = np.load(scales_path)
  if scales.shape != (L, 2, n, K) or scales.dtype != np.float32:
    raise ContextError(f"{scales_path} holds {scales.dtype} {scales.shape}, {n} pages need float32 "
                       f"{(L, 2, n, K)}: save the context again")
  return scales


def load_context(engine, path) -> Context:
  path = os.path.abspath(os.fspath(path))
  meta = read_meta(path)
  diff = _mismatch(meta["fingerprint"], engine.fingerprint)
  if diff:
    raise ContextError(f"the context at {path} was saved by another model or run config ({diff})")
  cache = engine.scheduler.cache
  ids = np.load(os.path.join(path, "tokens.npy")).tolist()
  n, Z, K, H = meta["pages"], meta["page_size"], meta["kv_heads"], meta["head_dim"]
  if len(ids) != meta["tokens"] or n != -(-len(ids) // Z):
    raise ContextError(f"{path}: tokens.npy holds {len(ids)} tokens, context.json says {meta['tokens']} in {n} "
                       "pages: save the context again")
  scales = _saved_scales(path, meta) if cache.quantized else None        # [L, 2, n, K]
  engine.limits.check(0, ids, 1)
  dtype = np.dtype(cache.k.dtype)
  layer_bytes = n * Z * K * H * dtype.itemsize
  kv_path = os.path.join(path, "kv.bin")
  size = os.path.getsize(kv_path) if os.path.exists(kv_path) else -1
  if size != 2 * meta["layers"] * layer_bytes:
    raise ContextError(f"{kv_path} holds {size} bytes, {meta['layers']} layers of {n} pages need "
                       f"{2 * meta['layers'] * layer_bytes}: save the context again")

  page_bytes = Z * K * H * dtype.itemsize

  def fill(pages, first):
    def blocks():
      B = _block(n)
      with open(kv_path, "rb") as f:
        for l in range(meta["layers"]):
          for s in range(first, n, B):
            b = min(B, n - s)
            parts = []
            for part in range(2):
              f.seek((2 * l + part) * layer_bytes + s * page_bytes)
              parts.append(np.fromfile(f, dtype, b * Z * K * H).reshape(b, Z, K, H))
            if scales is not None:
              parts += [scales[l, 0, s:s + b], scales[l, 1, s:s + b]]
            yield l, s, tuple(parts)
    _write_blocks(engine, pages, _prefetch(blocks()), first)

  t0 = time.perf_counter()
  seq, cached = engine.scheduler.pin(ids, fill=fill)
  chat = ChatContinuation.from_dict(meta["chat"]) if meta.get("chat") else None
  ctx = Context(engine, ids, seq, cached_tokens=cached, source=path, seconds=time.perf_counter() - t0, chat=chat)
  ctx.meta = dict(meta.get("meta") or {})
  return ctx
