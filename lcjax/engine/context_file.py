"""Saved contexts on disk: the directory format, its checksums and signature, and the checks of what is read back.

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
import re
import threading

import numpy as np

from lcjax.cache import kv as kvc
from lcjax.checkpoint.atomic import AtomicDirectory, recover
from lcjax.checkpoint.sources import make_private_dir, unsafe_dir, user_cache_dir

FORMAT = "lcjax-context-v3"
KEY_LAYOUT = "rotated"       # how fp8 pages hold the keys: rotated by lcjax.ops.fp8.rotate (lcjax.model.llama)
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


BLOCK_PAGES = 256    # pages per gather / scatter call, and per checksum of kv.bin
# Threads that checksum kv.bin's blocks beside its reads and writes (hashlib releases the GIL: one blake2b runs at
# about 1 GB/s a core, below a disk's rate), and the blocks a load reads ahead of the one it hands over.
HASH_THREADS = max(1, min(8, (os.cpu_count() or 2) - 1))


def block_size(n: int) -> int:
  """Pages a call moves for n pages, and pages per checksum of kv.bin: BLOCK_PAGES from a quarter of it up (one
  compiled shape for every long context), else the next power of two."""
  return BLOCK_PAGES if n > BLOCK_PAGES // 4 else 1 << max(0, n - 1).bit_length()


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
  if run.resolved_cache_dtype == "float8_e4m3fn" and kvc.rotates_keys(model_cfg.head_dim):
    fp["key_layout"] = KEY_LAYOUT          # fp8 pages hold rotated keys; contexts saved without it hold them as is
  return fp


# Fingerprint fields that contexts saved by earlier versions lack (their weights digest covers them).
_LATER_FIELDS = ("weight_dtype",)
# Fingerprint fields that contexts saved by earlier versions lack, with what their pages hold instead.
_BEFORE = {"key_layout": "unrotated"}


def mismatches(saved: dict, mine: dict, where: str = "") -> list[str]:
  """Every field where two fingerprints differ, as 'name: saved X, this engine Y', the weights digest last; a
  field `mine` holds as None (the weights digest before the weights are read) is not compared."""
  out = []
  for key in sorted(set(saved) | set(mine), key=lambda k: (k == "weights", k)):
    a, b = saved.get(key, None if where else _BEFORE.get(key)), mine.get(key)
    if b is None and key in mine or (not where and key in _LATER_FIELDS and key not in saved):
      continue
    if not where and key == "key_layout" and saved.get("cache_dtype") != mine.get("cache_dtype"):
      continue                             # the layout of fp8 pages: the cache dtypes' difference says it
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
  B = block_size(n)
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


# -- writing ------------------------------------------------------------------------------------------------------

def write(dst: str, overwrite: bool, hold, contents, *, sign: bool) -> None:
  """Write a context to directory `dst` in this format (atomic: a killed save leaves nothing that loads), with a
  checksum of every file and of every block of kv.bin; overwrite=True replaces a saved context at `dst`, never
  anything else. Under `hold` (a lock), `contents()` returns (header, token ids, quantized, blocks): header,
  context.json's fields from `fingerprint` to `chat`; blocks, (layer, first page index, parts) as
  lcjax.engine.context_mover.blocks_out yields them, layer by layer in page order. sign: sign it with the user's
  key (a context that may be shared)."""
  with AtomicDirectory(dst, META_FILE, overwrite=overwrite, error=ContextError, what="saved context",
                       exists_error=ContextError(f"{dst} already exists: pass overwrite=True to replace it")) as out:
    with hold:
      header, token_ids, quantized, blocks_in = contents()
      n, L, B = header["pages"], header["layers"], block_size(header["pages"])
      files = {TOKENS_FILE: _write_npy(os.path.join(out.tmp, TOKENS_FILE), np.asarray(token_ids, np.int32))}
      scales = np.zeros((L, 2, n, header["kv_heads"]), np.float32)
      blocks = [[[], []] for _ in range(L)]        # [L][K, V][block]: blake2b of each block's bytes
      with open(os.path.join(out.tmp, KV_FILE), "wb") as f, \
           concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool:
        layer = []                                 # one layer's blocks: its K pages are written before its V
        for l, s, parts in blocks_in:
          layer.append(parts)
          if quantized:
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
      if quantized:
        files[SCALES_FILE] = _write_npy(os.path.join(out.tmp, SCALES_FILE), scales)
      meta = dict(format=FORMAT, **header, checksums=dict(algorithm=ALGORITHM, files=files))
    meta = json.loads(json.dumps(meta))      # as it reads back (tuples as lists): the digest below is of that
    meta["digest"] = _meta_digest(meta)
    signature = _signature(meta["digest"]) if sign else None
    if signature is not None:
      meta["signature"] = signature
    with open(os.path.join(out.tmp, META_FILE), "w") as f:   # the marker: written last
      json.dump(meta, f)
      _sync(f)
    out.commit()
