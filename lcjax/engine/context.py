"""Pinned contexts: a prefilled document whose KV pages stay on the device until it is closed, offloaded to host
memory, or saved to disk and restored in another process (onto any mesh).

A context is a sequence the scheduler does not free (`Scheduler.pin`). Its K/V leave the device page by page in
table order, one layer at a time, as `[n_pages, Z, K, H]` with the model's own K KV heads (the engine's repeated
heads are dropped), so a context saved at one mesh restores at another: restoring allocates fresh pages in the
target pool (each on the shard of its table slot) and writes them, after first sharing whatever full pages the
prefix cache still holds.

fp8 pages travel with their scales (lcjax.cache.kv), [n_pages, K] per layer.

On disk a context is a directory, written as `DST.tmp-<pid>-<token>`, flushed to disk and renamed when complete
(lcjax.checkpoint.atomic: a killed save leaves nothing that loads, a killed overwrite leaves the old context or the
new one, put back by the next load or save if the kill fell between its renames, and the next save to DST removes
what it left):
  context.json   format, the engine fingerprint (model config, weights digest, dtypes, page size), the token
                 count and layout, a chat context's continuation (lcjax.tokenizer.ChatContinuation), the checksums
                 of the other files, and `digest`, the checksum of its own other fields; written last
  tokens.npy     int32 token ids
  kv.bin         for each layer, K then V pages [n_pages, Z, K, H] in the cache dtype, raw (streamed in and out
                 at disk speed; one layer in host memory at a time), checksummed per block of `block_pages`
  scales.npy     fp8 caches: the pages' K and V scales [L, 2, n_pages, K] float32
Checksums are blake2b-128, computed from the bytes as they are written and checked as they are read back: a
context that fails a check, or whose context.json is not of this format's shape, is refused with a ContextError,
and nothing of it reaches the prefix cache (its pages join it only after every block was read and checked). The
checksums find damage and edits made without lcjax, not a forger who rewrites them too: against forgery a context
is signed (`signature`: HMAC-SHA256 of `digest` under the user's key, a random file KEY_FILE in the private user
cache, made on first use). A context whose signature verifies was saved by this user from a shared context; its
pages join the prefix cache, so later prompts that start with its tokens reuse them. Any other context (unsigned,
from another user or machine, or edited) loads for its own questions only: its pages, and those of requests that
continue it, stay out of the prefix cache (`Engine.load_context(share=True)` vouches for one), and saving it again
leaves it unsigned. Before anything is read, context.json's size and nesting are bounded (META_MAX_BYTES,
META_MAX_DEPTH), and each other file's size is checked against what context.json implies, its token count
against the engine's context. Formats lcjax-context-v1 and v2 carried no checksums: they are refused (save the
context again).

Legend: L layers, P pages, Z page size, K KV heads, H head dim, n the context's pages.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import hmac
import io
import json
import logging
import math
import os
import queue
import re
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lcjax.cache import kv as kvc
from lcjax.checkpoint.atomic import AtomicDirectory, recover
from lcjax.checkpoint.sources import make_private_dir, unsafe_dir, user_cache_dir
from lcjax.engine.requests import RequestError
from lcjax.tokenizer import ChatContinuation

FORMAT = "lcjax-context-v3"
UNCHECKED_FORMATS = ("lcjax-context-v1", "lcjax-context-v2")     # earlier formats, without checksums: refused
META_FILE = "context.json"
TOKENS_FILE = "tokens.npy"
KV_FILE = "kv.bin"
SCALES_FILE = "scales.npy"
ALGORITHM = "blake2b-128"
KEY_FILE = "context-key"    # in the user cache: the user's secret key that signs saved contexts
KEY_BYTES = 32
FP8 = "float8_e4m3fn"
META_MAX_BYTES = 64 << 20   # context.json of 4M tokens in pages of 16 at 80 layers: 6 MB of checksums
META_MAX_DEPTH = 32         # this format nests 7 levels, a context's `meta` notes the rest
_HEX64 = re.compile(r"[0-9a-f]{64}")
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
# context.json's fields and their types (int: an integer >= 1)
_FIELDS = dict(format=str, fingerprint=dict, tokens=int, pages=int, page_size=int, layers=int, kv_heads=int,
               head_dim=int, dtype=str, meta=dict, checksums=dict, digest=str)


class ContextError(ValueError):
  """A context that cannot be saved, restored or used here; the message names the values."""


BLOCK_PAGES = 256    # pages per gather / scatter call
_IN_FLIGHT = 8       # gathers to pinned host memory dispatched ahead of the one waited for
# Threads that checksum kv.bin's blocks beside its reads and writes (hashlib releases the GIL: one blake2b runs at
# about 1 GB/s a core, below a disk's rate), and the blocks a load reads ahead of the one it hands over.
HASH_THREADS = max(1, min(8, (os.cpu_count() or 2) - 1))


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
  new = kvc.PagedKV(*(x.at[layer, pages].set(clean(y).astype(x.dtype), mode="drop")
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
  rows before it in a block, and rows past the context, are aimed at the null page and write nothing. A page
  holding a value no computation leaves in a cache (NaN, inf, a page scale not finite and > 0) is written as
  zeros and refused with a ContextError once all are written (the caller frees the pages): a freed page keeps
  its values, and attention masks unseen keys by a zero weight, which a NaN survives."""
  mover, sched = _mover(engine), engine.scheduler
  n = len(pages)
  sent = 0
  bad = []
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
      self._check_usable()
      t0 = time.perf_counter()
      with self.engine.scheduler.lock:
        self._host, self.stats["host_memory"] = _blocks_to_host(self.engine, self.pages())
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
      _write_blocks(self.engine, pages, host, first)

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
    with AtomicDirectory(dst, META_FILE, overwrite=overwrite, error=ContextError, what="saved context",
                         exists_error=ContextError(f"{dst} already exists: pass overwrite=True to replace it")) as out:
      with eng.scheduler.lock:
        pages = self.pages()
        n, B, L = len(pages), _block(len(pages)), eng.cfg.n_layers
        files = {TOKENS_FILE: _write_npy(os.path.join(out.tmp, TOKENS_FILE), np.asarray(self.token_ids, np.int32))}
        cache = eng.scheduler.cache
        scales = np.zeros((L, 2, n, eng.cfg.n_kv_heads), np.float32)
        blocks = [[[], []] for _ in range(L)]        # [L][K, V][block]: blake2b of each block's bytes
        with open(os.path.join(out.tmp, KV_FILE), "wb") as f, \
             concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool:
          layer = []                                 # one layer's blocks: its K pages are written before its V
          for l, s, parts in _blocks_out(eng, pages):
            layer.append(parts)
            if cache.quantized:
              scales[l, :, s:s + len(parts[0])] = parts[2:]
            if len(layer) * B >= n:
              sums = [[], []]
              for part in (0, 1):
                for kv in layer:
                  data = np.ascontiguousarray(kv[part]).reshape(-1).view(np.uint8)
                  sums[part].append(pool.submit(_digest, data))     # checksummed while the bytes are written
                  f.write(data)
              blocks[l] = [[d.result() for d in part] for part in sums]
              layer = []
          _sync(f)
        files[KV_FILE] = dict(block_pages=B, blocks=blocks)
        if cache.quantized:
          files[SCALES_FILE] = _write_npy(os.path.join(out.tmp, SCALES_FILE), scales)
        meta = dict(format=FORMAT, fingerprint=eng.fingerprint, tokens=len(self), pages=n,
                    page_size=eng.run.page_size, layers=L, kv_heads=eng.cfg.n_kv_heads,
                    head_dim=eng.cfg.head_dim, dtype=str(cache.k.dtype), meta=self.meta,
                    chat=self.chat.to_dict() if self.chat is not None else None,
                    checksums=dict(algorithm=ALGORITHM, files=files))
      meta = json.loads(json.dumps(meta))      # as it reads back (tuples as lists): the digest below is of that
      meta["digest"] = _meta_digest(meta)
      signature = _signature(meta["digest"]) if self.shared else None
      if signature is not None:
        meta["signature"] = signature
      with open(os.path.join(out.tmp, META_FILE), "w") as f:   # the marker: written last
        json.dump(meta, f)
        _sync(f)
      out.commit()
    return time.perf_counter() - t0


# -- checksums ----------------------------------------------------------------------------------------------------

def _digest(data) -> str:
  """blake2b-128 of a bytes-like object (a C-contiguous uint8 array included), hex."""
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _meta_digest(meta: dict) -> str:
  """The digest of context.json's fields but `digest` and `signature` (keys sorted)."""
  body = {k: v for k, v in meta.items() if k not in ("digest", "signature")}
  return _digest(json.dumps(body, sort_keys=True).encode())


def user_key() -> bytes:
  """The user's context-signing key: KEY_FILE in the private user cache (0600), made from os.urandom on first use.
  It is written whole to a file of its own, then linked into place (a link fails where the key exists), so a
  process never reads a partly written key, and two first uses agree on one. A key in a directory others can
  write to, or a key file another user owns or others can read, signs nothing (they could sign too)."""
  try:
    folder = make_private_dir(user_cache_dir())
    path = os.path.join(folder, KEY_FILE)
    unsafe = unsafe_dir(folder)
    if unsafe:
      raise ContextError(f"the context-signing key's directory {folder} is unsafe: {unsafe}")
    if not os.path.lexists(path):
      tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
      try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
      finally:
        os.close(fd)
      try:
        os.link(tmp, path)
      except FileExistsError:
        pass
      finally:
        os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
  except OSError as e:
    raise ContextError(f"cannot make or read the context-signing key in {user_cache_dir()}: "
                       f"{e.strerror or e}") from None
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o077):
      raise ContextError(f"the context-signing key {path} is owned by uid {st.st_uid} with mode "
                         f"{st.st_mode & 0o777:o}: it must be this user's alone (0600)")
    key = f.read(KEY_BYTES + 1)
  if len(key) != KEY_BYTES:
    raise ContextError(f"the context-signing key {path} holds {len(key)} bytes, not {KEY_BYTES} (damaged): delete "
                       "it, and save shared contexts again")
  return key


def _signature(digest: str) -> str | None:
  """context.json's signature: HMAC-SHA256 of its digest under the user's key, hex; None (logged) where the key
  cannot be made or read: the context is then saved unsigned, or loaded unverified."""
  try:
    key = user_key()
  except ContextError as e:
    logging.getLogger(__name__).warning("contexts are neither signed nor verified: %s", e)
    return None
  return hmac.new(key, digest.encode(), hashlib.sha256).hexdigest()


def verified(meta: dict) -> bool:
  """Whether a context.json (its digest already checked) carries this user's signature of its digest."""
  sig = meta.get("signature")
  if not isinstance(sig, str):
    return False
  mine = _signature(meta["digest"])
  return mine is not None and hmac.compare_digest(sig, mine)


def _sync(f) -> None:
  f.flush()
  os.fsync(f.fileno())


def _write_npy(path: str, array: np.ndarray) -> str:
  """Save `array` as .npy (flushed to disk); returns the file's checksum."""
  buf = io.BytesIO()
  np.save(buf, array, allow_pickle=False)
  data = buf.getvalue()
  with open(path, "wb") as f:
    f.write(data)
    _sync(f)
  return _digest(data)


def _mismatch_line(path: str, got: str, want: str, what: str = "") -> ContextError:
  return ContextError(f"{path}{what} does not match its checksum (blake2b {got[:16]}, context.json says "
                      f"{want[:16]}): it was changed or damaged after the save; save the context again")


def _npy_bytes(shape: tuple, dtype) -> int:
  """The size of the .npy file np.save writes for a C-ordered array of `shape` and `dtype`."""
  buf = io.BytesIO()
  np.lib.format.write_array_header_1_0(buf, dict(descr=np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                 fortran_order=False, shape=tuple(shape)))
  return buf.tell() + math.prod(shape) * np.dtype(dtype).itemsize


def _read_npy(ctx_path: str, name: str, meta: dict, shape: tuple, dtype) -> np.ndarray:
  """A .npy file of a saved context: its size checked against the array context.json implies (`shape`, `dtype`)
  before it is read, then its checksum before it is parsed."""
  path = os.path.join(ctx_path, name)
  want = meta["checksums"]["files"][name]
  try:
    size, expect = os.path.getsize(path), _npy_bytes(shape, dtype)
    if size != expect:
      raise ContextError(f"{path} holds {size} bytes, context.json's {np.dtype(dtype)} {tuple(shape)} needs "
                         f"{expect}: save the context again")
    with open(path, "rb") as f:
      data = f.read(expect + 1)
  except FileNotFoundError:
    raise ContextError(f"{ctx_path} has no {name}: save the context again") from None
  got = _digest(data)
  if got != want:
    raise _mismatch_line(path, got, want, f" ({len(data)} bytes)")
  try:
    return np.load(io.BytesIO(data), allow_pickle=False)
  except (ValueError, EOFError, OSError) as e:
    raise ContextError(f"{path} is not a readable .npy file ({type(e).__name__}: {e}): save the context "
                       "again") from None


# -- reading ------------------------------------------------------------------------------------------------------

def fingerprint(model_cfg, run, weights, weights_digest: str | None) -> dict:
  """What a context's K/V depend on: the model config, the weights (their dtype, and the digest of their bits;
  None: not known yet, before they are read), the activation and cache dtypes, the page size, and FP8 attention
  (which changes every layer's output). Saved in context.json; a context loads only where it is the same."""
  fp = dict(model=model_cfg.to_dict(), weights=weights_digest, weight_dtype=weights.name or run.dtype,
            dtype=run.dtype, cache_dtype=run.resolved_cache_dtype, page_size=run.page_size)
  if run.attention_dtype != "auto":
    fp["attention_dtype"] = run.attention_dtype
  return fp


# Fingerprint fields that contexts saved by earlier versions lack (their weights digest covers them).
_LATER_FIELDS = ("weight_dtype",)


def mismatches(saved: dict, mine: dict, where: str = "") -> list[str]:
  """Every field where two fingerprints differ, as 'name: saved X, this engine Y', the weights digest last; a
  field `mine` holds as None (the weights digest before the weights are read) is not compared."""
  out = []
  for key in sorted(set(saved) | set(mine), key=lambda k: (k == "weights", k)):
    a, b = saved.get(key), mine.get(key)
    if b is None and key in mine or (not where and key in _LATER_FIELDS and key not in saved):
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      out += mismatches(a, b, f"{where}{key}.")
    elif a != b:
      out.append(f"{where}{key}: saved {a!r}, this engine {b!r}")
  return out


def check_fingerprint(path: str, meta: dict, mine: dict) -> None:
  """Refuse a saved context (its context.json `meta`) made by another model or run config, naming every field
  that differs."""
  diff = mismatches(meta["fingerprint"], mine)
  if diff:
    raise ContextError(f"the context at {path} was saved by another model or run config: {'; '.join(diff)}")


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _check_fields(meta_path: str, meta: dict) -> None:
  """context.json's fields of the types and shapes this format writes (checked after its digest)."""
  def bad(what):
    return ContextError(f"{meta_path}: {what}: save the context again")

  for key, kind in _FIELDS.items():
    if key not in meta:
      raise bad(f"no {key!r} field")
    ok = _is_int(meta[key]) and meta[key] >= 1 if kind is int else isinstance(meta[key], kind)
    if not ok:
      raise bad(f"{key}={repr(meta[key])[:60]} is not {'an integer >= 1' if kind is int else kind.__name__}")
  chat = meta.get("chat")
  if chat is not None and not (isinstance(chat, dict) and all(isinstance(chat.get(k), str)
                                                              for k in ("held", "tail", "separator"))):
    raise bad(f"chat={repr(chat)[:60]} is not a chat continuation (held, tail and separator texts)")
  sums = meta["checksums"]
  if sums.get("algorithm") != ALGORITHM or not isinstance(sums.get("files"), dict):
    raise bad(f"checksums of algorithm {str(sums.get('algorithm'))[:40]!r}, this lcjax writes {ALGORITHM!r}")
  files = sums["files"]
  names = [TOKENS_FILE] + ([SCALES_FILE] if meta["dtype"] == FP8 else [])
  for name in names:
    if not isinstance(files.get(name), str):
      raise bad(f"no checksum of {name}")
  kv = files.get(KV_FILE)
  n, L = meta["pages"], meta["layers"]
  B = _block(n)
  shape = (L, 2, -(-n // B))
  if (not isinstance(kv, dict) or kv.get("block_pages") != B or not isinstance(kv.get("blocks"), list)
      or len(kv["blocks"]) != L
      or not all(isinstance(x, list) and len(x) == 2 and all(isinstance(y, list) and len(y) == shape[2]
                                                             and all(isinstance(z, str) for z in y) for y in x)
                 for x in kv["blocks"])):
    raise bad(f"the checksums of {KV_FILE} are not {shape[0]} layers x 2 x {shape[2]} blocks of {B} pages")
  # The signature is outside the digest (it signs it): a damaged one is refused here, not taken for a stranger's.
  if "signature" in meta and not (isinstance(meta["signature"], str) and _HEX64.fullmatch(meta["signature"])):
    raise bad("its signature is not 64 hex digits")


def _json_depth(data: bytes) -> int:
  """How deep a JSON text nests its arrays and objects (brackets inside strings not counted)."""
  outside = np.frombuffer(_JSON_STRING.sub(b'""', data), np.uint8)
  steps = np.isin(outside, _OPEN).astype(np.int64) - np.isin(outside, _CLOSE)
  return int(np.cumsum(steps).max(initial=0))


def read_meta(path: str) -> dict:
  """context.json of a saved context, checked: of this format, matching its digest, every field of its type."""
  meta_path = os.path.join(path, META_FILE)
  recover(path, META_FILE)        # an overwrite killed between its renames
  if not os.path.isdir(path):
    raise ContextError(f"{path}: no such context directory")
  if not os.path.isfile(meta_path):
    raise ContextError(f"{path} is not a complete saved context (no {META_FILE}): save it again")
  size = os.path.getsize(meta_path)
  if size > META_MAX_BYTES:
    raise ContextError(f"{meta_path} holds {size} bytes, past the {META_MAX_BYTES} of any context.json: save the "
                       "context again")
  with open(meta_path, "rb") as f:
    data = f.read(size + 1)
  depth = _json_depth(data)
  if depth > META_MAX_DEPTH:
    raise ContextError(f"{meta_path} nests {depth} levels deep, past the {META_MAX_DEPTH} of any context.json: "
                       "save the context again")
  try:
    meta = json.loads(data.decode("utf-8"))
  except json.JSONDecodeError as e:
    raise ContextError(f"{meta_path} is corrupt ({e.msg} at line {e.lineno}): save the context again") from None
  except UnicodeDecodeError as e:
    raise ContextError(f"{meta_path} is corrupt (not UTF-8: byte {e.start}): save the context again") from None
  if not isinstance(meta, dict):
    raise ContextError(f"{meta_path} holds a JSON {type(meta).__name__}, not an object: save the context again")
  fmt = meta.get("format")
  if fmt in UNCHECKED_FORMATS:
    raise ContextError(f"{path} has format {fmt!r}, saved without checksums; this lcjax reads {FORMAT} only "
                       "(every file checksummed): save the context again")
  if fmt != FORMAT:
    raise ContextError(f"{path} has format {str(fmt)[:60]!r}, this lcjax reads {FORMAT}")
  got = _meta_digest(meta)
  if meta.get("digest") != got:
    raise _mismatch_line(meta_path, got, str(meta.get("digest")))
  _check_fields(meta_path, meta)
  return meta


def read_tokens(path: str, meta: dict, max_tokens: int) -> list[int]:
  """The token ids of a saved context of at most `max_tokens` tokens (its count and pages in context.json checked
  before tokens.npy is read, tokens.npy against its size and checksum, its shape against context.json)."""
  n, Z, T = meta["pages"], meta["page_size"], meta["tokens"]
  if n != -(-T // Z):
    raise ContextError(f"{os.path.join(path, META_FILE)} says {T} tokens in {n} pages of {Z}: save the context "
                       "again")
  if T > max_tokens:
    raise ContextError(f"the context at {path} holds {T} tokens, past the {max_tokens} this engine's context "
                       "leaves room for (max_context less one token to generate): raise max_context")
  ids = _read_npy(path, TOKENS_FILE, meta, (T,), np.int32)
  if ids.dtype != np.int32 or ids.ndim != 1 or len(ids) != meta["tokens"] or n != -(-len(ids) // Z):
    raise ContextError(f"{path}: {TOKENS_FILE} holds {ids.dtype} {ids.shape}, context.json says {meta['tokens']} "
                       f"int32 tokens in {n} pages of {Z}: save the context again")
  return ids.tolist()


def _saved_scales(path: str, meta: dict) -> np.ndarray:
  """The fp8 scales of a saved context's pages, [L, 2, n, K] float32."""
  L, n, K = meta["layers"], meta["pages"], meta["kv_heads"]
  scales = _read_npy(path, SCALES_FILE, meta, (L, 2, n, K), np.float32)
  if scales.shape != (L, 2, n, K) or scales.dtype != np.float32:
    raise ContextError(f"{os.path.join(path, SCALES_FILE)} holds {scales.dtype} {scales.shape}, {n} pages need "
                       f"float32 {(L, 2, n, K)}: save the context again")
  if not np.all(np.isfinite(scales) & (scales >= 0)):
    raise ContextError(f"{os.path.join(path, SCALES_FILE)} holds negative or non-finite scales: save the context "
                       "again")
  return scales


def _kv_blocks(path: str, meta: dict, dtype: np.dtype):
  """Yield (layer, first page index, (K, V)) of kv.bin, blocks of `block_pages` pages [b, Z, K, H], each checked
  against its checksum before it is handed over."""
  n, Z, K, H, L = meta["pages"], meta["page_size"], meta["kv_heads"], meta["head_dim"], meta["layers"]
  kv = meta["checksums"]["files"][KV_FILE]
  B, sums = kv["block_pages"], kv["blocks"]
  page_bytes = Z * K * H * dtype.itemsize
  kv_path = os.path.join(path, KV_FILE)

  def checked(l, j, s, b, reads):
    """The block's (K, V) once both parts' checksums match (`reads`: (bytes read, future of their digest))."""
    parts = []
    for part, (raw, digest) in enumerate(reads):
      got, digest = raw.size, digest.result()
      if got != b * page_bytes or digest != sums[l][part][j]:
        raise _mismatch_line(kv_path, digest, sums[l][part][j], f" (layer {l} {'KV'[part]} pages {s}..{s + b - 1})")
      parts.append(raw.view(dtype).reshape(b, Z, K, H))
    return l, s, tuple(parts)

  ahead = collections.deque()           # blocks read, their checksums running on the pool
  with open(kv_path, "rb") as f, concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool:
    for l in range(L):
      for j, s in enumerate(range(0, n, B)):
        b = min(B, n - s)
        reads = []
        for part in range(2):
          f.seek((2 * l + part) * n * page_bytes + s * page_bytes)
          raw = np.empty(b * page_bytes, np.uint8)
          raw = raw[:f.readinto(raw)]
          reads.append((raw, pool.submit(_digest, raw)))
        ahead.append((l, j, s, b, reads))
        if len(ahead) > HASH_THREADS:
          yield checked(*ahead.popleft())
    while ahead:
      yield checked(*ahead.popleft())


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
    _write_blocks(engine, pages, _prefetch(blocks()), first)

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
