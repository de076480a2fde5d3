"""The context page mover: a pinned context's K/V pages between the device cache and the host, a block of one layer
per compiled call (lcjax.engine.context_file.block_size pages), with the model's own K KV heads (the engine's
repeated heads are dropped on the way out and repeated on the way in). fp8 pages travel with their scales
(lcjax.cache.kv), [n_pages, K] per layer.

Legend: Z page size, K KV heads, H head dim, b pages of a block.
"""
from __future__ import annotations

import logging
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lcjax.cache import kv as kvc
from lcjax.engine.context_file import ContextError, block_size
from lcjax.ops import fp8 as fp8_ops

_IN_FLIGHT = 8       # gathers to pinned host memory dispatched ahead of the one waited for


def _gather(cache, layer, pages, rep: int) -> tuple:
  """`cache.parts()` of `pages` of one layer, the model's own KV heads: K, V [b, Z, K, H] (and fp8 scales
  [b, K])."""
  k, v, *scales = (fp8_ops.take(x, (layer, pages)) for x in cache.parts())
  return (k[..., ::rep, :], v[..., ::rep, :], *(s[..., ::rep] for s in scales))


def _scatter(cache, layer, pages, parts, rep: int):
  """Write what _gather returned (the model's KV heads) into `pages` of one layer; rows aimed at the null page 0
  write nothing. Returns (cache, the count of written rows holding a value no computation leaves in a cache: a
  K or V that is not finite, or a page scale that is not finite and > 0)."""
  k, v, *scales = parts
  b = len(pages)
  ok = jnp.ones((b,), bool)                                           # [b]: every value of the row's page sane
  for x in (k, v):
    ok &= jnp.isfinite(x.astype(jnp.float32)).reshape(b, -1).all(axis=1)
  for x in scales:
    ok &= (jnp.isfinite(x) & (x > 0)).reshape(b, -1).all(axis=1)
  bad = jnp.sum((pages != 0) & ~ok).astype(jnp.int32)
  pages = kvc.drop_null(pages, cache.num_pages)
  # A page that fails is written as zeros, never as what it held: the caller refuses the context and frees it.
  clean = lambda y: jnp.where(ok.reshape((b,) + (1,) * (y.ndim - 1)), y, jnp.zeros((), y.dtype))
  parts = (jnp.repeat(k, rep, axis=-2), jnp.repeat(v, rep, axis=-2), *(jnp.repeat(s, rep, axis=-1) for s in scales))
  new = kvc.PagedKV(*(fp8_ops.set_at(x, (layer, pages), clean(y), mode="drop")
                      for x, y in zip(cache.parts(), parts)))
  return new, bad


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
                           out_shardings=(out, replicated))
    self.pinned = None
    if all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in mesh.devices.flat):
      host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
      self.pinned = jax.jit(gather, out_shardings=host)


def mover_of(engine) -> _Mover:
  if getattr(engine, "_context_mover", None) is None:
    engine._context_mover = _Mover(engine)
  return engine._context_mover


def _gather_jobs(engine, pages: list[int]):
  """(block size B, page-index array [blocks, B] padded with the null page, [(layer, block)] in order)."""
  n, B = len(pages), block_size(len(pages))
  blocks = -(-n // B)
  idx = np.zeros(blocks * B, np.int32)
  idx[:n] = pages
  return B, jnp.asarray(idx.reshape(blocks, B)), [(l, j) for l in range(engine.cfg.n_layers) for j in range(blocks)]


def blocks_out(engine, pages: list[int]):
  """Yield (layer, first page index, parts): numpy K, V [b, Z, K, H] (and fp8 scales [b, K]) of consecutive pages,
  layer by layer, in page order; the next block's device-to-host copy is under way while the current one is
  handed over."""
  mover, sched = mover_of(engine), engine.scheduler
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


def blocks_to_host(engine, pages: list[int]) -> tuple[list, str]:
  """The context's blocks in host memory: (blocks, "pinned_host" | "numpy"). Pinned blocks keep their padding
  (rows past the context are the null page's)."""
  mover, sched = mover_of(engine), engine.scheduler
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
  return list(blocks_out(engine, pages)), "numpy"


def write_blocks(engine, pages: list[int], blocks, first: int = 0) -> None:
  """Write host blocks (layer, first page index s, parts: K, V [b, Z, K, H] and fp8 scales [b, K]) into the
  context's pages[s:s + b]. Blocks wholly before page index `first` (shared from the prefix cache) are skipped;
  rows before it in a block, and rows past the context, are aimed at the null page and write nothing. A page
  holding a value no computation leaves in a cache (NaN, inf, a page scale not finite and > 0) is written as
  zeros and refused with a ContextError once all are written (the caller frees the pages): a freed page keeps
  its values, and attention masks unseen keys by a zero weight, which a NaN survives."""
  mover, sched = mover_of(engine), engine.scheduler
  n = len(pages)
  sent = 0
  bad = []
  for l, s, parts in blocks:
    b = len(parts[0])
    if s + b <= first:
      continue
    B = block_size(b)
    target = np.zeros(B, np.int32)
    for i in range(max(0, first - s), min(b, n - s)):
      target[i] = pages[s + i]
    if B != b:
      parts = [np.concatenate([np.asarray(x), np.zeros((B - b, *x.shape[1:]), x.dtype)]) for x in parts]
    parts = tuple(jax.device_put(x, mover.replicated) for x in parts)
    sched.cache, count = mover.scatter(sched.cache, jnp.int32(l), jnp.asarray(target), parts)
    bad.append((l, s, count))
    sent += 1
    if sent % _IN_FLIGHT == 0:    # each block waits on the device until its scatter runs: bound them
      jax.block_until_ready(sched.cache.k)
  jax.block_until_ready(sched.cache.k)
  for (l, s, _), count in zip(bad, jax.device_get([c for _, _, c in bad])):
    if count:
      raise ContextError(f"layer {l}, pages {s}.. of the context hold {int(count)} page(s) with a NaN or infinite "
                         "K/V value or a page scale that is not finite and > 0: no computation writes such a "
                         "cache (the context is damaged or forged)")


def prefetch(it, depth: int = 2):
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
