"""The Engine: a loaded model, its paged KV cache and a scheduler, behind `generate` and `logits`.

Requests are admitted while the page pool can hold their whole prompt + max_new_tokens (so a running request
never runs out of pages); a request that could never fit is refused before anything is allocated. Prompts are
prefilled chunk by chunk, then every live request decodes together in one on-device loop of up to
`run.decode_steps` tokens per call; between calls finished requests free their pages and waiting ones join.

Every engine runs on a ("seq", "tensor") mesh of `run.seq` x `run.tensor` devices (one device: the plain
single-device model). Parameters are placed with their logical-axis shardings; when the model has fewer KV heads
than `tensor` devices (or `tensor` does not divide them), wqkv is restored split along D and each KV head is
repeated the minimal number of times (lcjax.sharding.kv_head_replication), so the model the engine runs, and its
cache, hold K * rep KV heads split evenly over `tensor`. The page pool is split over `seq` (a null page per shard,
page-table slot m on shard m % seq) and the device cache with it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import resource
import threading
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lcjax import sharding as sh
from lcjax.cache import kv as kvc
from lcjax.cache.pages import PagePool, PagePoolExhausted
from lcjax.config import ConfigError, ModelConfig, RunConfig
from lcjax.engine import plan as planlib
from lcjax.engine.sampling import SamplingParams, all_greedy, stack as stack_sampling
from lcjax.engine.steps import DecodeState, Steps
from lcjax.model.llama import Llama, check_mesh, repeat_kv_heads
from lcjax.ops.backends import get_backend


# fp8 scales cover this multiple of the calibration forward's largest |k|, |v|: larger values are clipped. Real
# text went up to 2.1x the calibration sentence's |v| on SmolLM2, yet headroom 4 gave the same logit error at 8K
# (4.82e-2 of the scale, KL 4.7e-4): the cost is e4m3's 3-bit mantissa, not clipping.
FP8_HEADROOM = 2.0


class RequestError(ValueError):
  """A request lcjax refuses (bad prompt, limits); the engine stays usable."""


@dataclasses.dataclass
class GenerationResult:
  text: str
  token_ids: list[int]
  prompt_tokens: int
  finish_reason: str           # "eos" or "length"
  stats: dict


@dataclasses.dataclass
class _Request:
  index: int
  prompt: list[int]
  max_new: int
  sampling: SamplingParams
  shared: int = 0              # leading prompt tokens already cached in a shared prefix sequence
  base: int | None = None      # that prefix sequence
  seq: int | None = None
  out: list[int] = dataclasses.field(default_factory=list)
  prefill_s: float = 0.0
  decode_s: float = 0.0
  finish: str | None = None


def _bucket(n: int, lo: int, hi: int | None = None) -> int:
  b = max(lo, 1 << max(0, n - 1).bit_length())
  return min(b, hi) if hi else b


def _peak_device_bytes() -> int | None:
  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def _peak_host_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mesh_for(run: RunConfig, mesh=None) -> jax.sharding.Mesh:
  if mesh is None:
    try:
      return sh.make_mesh(tensor=run.tensor, seq=run.seq)
    except ValueError as e:     # more devices than exist
      raise ConfigError(str(e)) from None
  got = (mesh.shape[sh.SEQ], mesh.shape[sh.TENSOR])
  if got != (run.seq, run.tensor):
    raise ConfigError(f"mesh of (seq, tensor) = {got} does not match the run config's seq={run.seq} "
                      f"tensor={run.tensor}")
  return mesh


def _host_available_bytes() -> int:
  try:
    with open("/proc/meminfo") as f:
      return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
  except (OSError, StopIteration):
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory(mesh: jax.sharding.Mesh) -> tuple[int, str]:
  """(bytes, what they are) that each device of this process in `mesh` offers: XLA's bytes_limit on accelerators
  (XLA_PYTHON_CLIENT_MEM_FRACTION of the memory); CPU devices share the host, so its available RAM split."""
  devs = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devs]
  if all(limits):
    return min(limits), f"each {devs[0].device_kind} (XLA_PYTHON_CLIENT_MEM_FRACTION sets the share JAX gets)"
  return _host_available_bytes() // len(devs), f"each of {len(devs)} CPU device(s) (available host memory)"


def kv_replication_for(model_cfg: ModelConfig, tensor: int) -> int:
  """KV-head repetition on `tensor` devices; a ConfigError naming the numbers when heads cannot split."""
  try:
    return sh.kv_head_replication(model_cfg.n_kv_heads, tensor, n_heads=model_cfg.n_heads)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def net_config(model_cfg: ModelConfig, run: RunConfig) -> tuple[ModelConfig, int]:
  """(the model as the engine runs it, KV-head repetition): KV heads repeated so they split over `tensor`
  (the same function of the same weights). ConfigError when the heads cannot split over the mesh."""
  rep = kv_replication_for(model_cfg, run.tensor)
  net = dataclasses.replace(model_cfg, n_kv_heads=model_cfg.n_kv_heads * rep)
  try:
    check_mesh(net, run.tensor, run.seq, run.sp_mode)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return net, rep


def net_model(model_cfg: ModelConfig, run: RunConfig, mesh, attention=None, rngs=None) -> Llama:
  """The engine's model (abstract under nnx.eval_shape): replicated KV heads, the mesh and sp_mode."""
  net, _ = net_config(model_cfg, run)
  return Llama(net, dtype=jnp.dtype(run.dtype), attention=attention, mesh=mesh, sp_mode=run.sp_mode,
               rngs=rngs or nnx.Rngs(0))


def net_shardings(model_cfg: ModelConfig, run: RunConfig, mesh, attention=None):
  """(graphdef, NamedSharding of every parameter) of the engine's model on `mesh`, allocating nothing."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: net_model(model_cfg, run, mesh, attention)), nnx.Param)
  return graphdef, sh.param_shardings(abstract, mesh)


def checkpoint_shardings(model_cfg: ModelConfig, mesh, dtype) -> object:
  """Shardings of a checkpoint-shaped parameter state on `mesh`: the logical-axis table, except when its KV heads
  do not split over `tensor` (they are repeated after placement): then wqkv, whose only tensor-split axis is
  the KV heads, is split along D instead, so no device holds all of it (query heads included: 13 GB for a 70B at
  tensor=16) while the engine repeats its heads, and D stays whole where `tensor` does not divide it."""
  T = mesh.shape[sh.TENSOR]
  rep = kv_replication_for(model_cfg, T)
  abstract = nnx.state(nnx.eval_shape(lambda: Llama(model_cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))),
                       nnx.Param)
  shardings = sh.param_shardings(abstract, mesh, replicate={"kv_heads"} if rep > 1 else set())
  if rep > 1 and model_cfg.dim % T == 0:
    by_d = NamedSharding(mesh, PartitionSpec(None, sh.TENSOR))                     # [L, D, K, G + 2, H]
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, leaf: by_d if [getattr(k, "key", None) for k in path][-2:] == ["attn", "wqkv"] else leaf,
        shardings)
  return abstract, shardings


class Engine:
  def __init__(self, model_cfg: ModelConfig, params, *, run: RunConfig | None = None, tokenizer=None,
               mesh: jax.sharding.Mesh | None = None):
    """params: the checkpoint-shaped `nnx.State` of Llama(model_cfg) (on the host, one device, or already placed
    by `checkpoint_shardings`); the engine places it on the mesh of `run.seq` x `run.tensor` devices (or
    `mesh`) and repeats KV heads when `tensor` needs it."""
    self.cfg = model_cfg
    self.run = run or RunConfig()
    self.tokenizer = tokenizer
    self.max_context = self.run.context_for(model_cfg)
    self.attention = get_backend(self.run.attention, head_dim=model_cfg.head_dim, dtype=self.run.dtype)
    self.mesh = _mesh_for(self.run, mesh)
    self.net_cfg, self.kv_rep = net_config(model_cfg, self.run)
    self.graphdef, self.param_shardings = net_shardings(model_cfg, self.run, self.mesh, self.attention)
    self.params = self._place(params)
    self.plan = planlib.plan(model_cfg, self.run)
    self.pool = PagePool(self.plan.num_pages, self.run.page_size, shards=self.run.seq)
    self.steps = Steps(self.graphdef, self.run.page_size, self.mesh,
                       kvc.cache_shardings(self.mesh, self.fp8_cache), sync_every=self.run.decode_sync_every)
    self.cache = self._new_cache()
    self.eos = jnp.asarray(model_cfg.eos_ids or (-1,), jnp.int32)
    self.peak_pages_used = 0
    self.last_results: list[GenerationResult] = []
    self._lock = threading.RLock()

  # -- construction -------------------------------------------------------------------------------
  def _place(self, params):
    _, ckpt = checkpoint_shardings(self.cfg, self.mesh, self.run.dtype)
    params = jax.device_put(params, ckpt)            # a no-op for arrays already placed so
    if self.kv_rep == 1:
      return params
    repeat = jax.jit(lambda p: repeat_kv_heads(p, self.kv_rep), out_shardings=self.param_shardings)
    return repeat(params)

  @property
  def fp8_cache(self) -> bool:
    return self.run.resolved_cache_dtype == "float8_e4m3fn"

  def _new_cache(self) -> kvc.PagedKV:
    return kvc.init_cache(self.cfg.n_layers, self.plan.num_pages, self.run.page_size, self.net_cfg.n_kv_heads,
                          self.cfg.head_dim, self.run.resolved_cache_dtype,
                          fp8_scale=self._calibrate_fp8() if self.fp8_cache else None, mesh=self.mesh)

  def _calibrate_fp8(self, n_tokens: int = 512, headroom: float | None = None):
    """Per (layer, kv head) fp8 scales: `headroom` x the largest |k|, |v| seen on a calibration forward
    (the tokenizer's text when there is one, else seeded random ids). Returns absmax [L, K] per K and V."""
    if self.tokenizer is not None:
      text = " ".join(["The quick brown fox jumps over the lazy dog; 0123456789 = 42."] * 64)
      ids = self.tokenizer.encode(text)[:n_tokens]
    else:
      ids = np.random.default_rng(0).integers(0, self.cfg.vocab_size, n_tokens).tolist()
    absmax = self.steps.kv_absmax(self.params, jnp.asarray([ids], jnp.int32))     # [L, 2, K]
    return jnp.maximum(absmax * (FP8_HEADROOM if headroom is None else headroom), 1e-3)

  @classmethod
  def random(cls, model_cfg: ModelConfig, *, run: RunConfig | None = None, seed: int = 0, tokenizer=None,
             mesh: jax.sharding.Mesh | None = None):
    """Random weights made on the devices, each shard in place (benchmarks and tests; no checkpoint needed).
    The weights depend on `seed` only, never on the mesh."""
    run = run or RunConfig()
    mesh = _mesh_for(run, mesh)
    net_config(model_cfg, run)                   # refuse a mesh the heads cannot split over before any work
    _, shardings = checkpoint_shardings(model_cfg, mesh, run.dtype)

    @functools.partial(jax.jit, out_shardings=shardings)
    def make():
      return nnx.state(Llama(model_cfg, dtype=jnp.dtype(run.dtype), rngs=nnx.Rngs(seed)), nnx.Param)

    return cls(model_cfg, make(), run=run, tokenizer=tokenizer, mesh=mesh)

  @classmethod
  def load(cls, ckpt_dir, *, tensor: int | None = None, seq: int | None = None, dtype: str | None = None,
           run: RunConfig | None = None, mesh: jax.sharding.Mesh | None = None, **overrides):
    """Restore a converted checkpoint (tools/convert_hf.py, tools/convert_gguf.py) ready to generate.

    tensor, seq, dtype override the run config's fields (default: its own). Every parameter is read straight
    into its shards on the mesh: a process reads only what its devices hold (multi-host included).
    """
    from lcjax.checkpoint import load_config
    from lcjax.checkpoint.store import restore_params
    from lcjax.tokenizer import find_tokenizer
    given = {k: v for k, v in dict(tensor=tensor, seq=seq, dtype=dtype).items() if v is not None}
    run = (run or RunConfig()).replace(**given, **overrides)
    mesh = _mesh_for(run, mesh)
    model_cfg = load_config(ckpt_dir)
    net_config(model_cfg, run)                  # refuse a mesh the heads cannot split over before reading
    planlib.require_fit(planlib.plan(model_cfg, run), model_cfg, run, *device_memory(mesh))
    # The logical-axis shardings, or wqkv split along D when its KV heads are repeated after placement.
    abstract, shardings = checkpoint_shardings(model_cfg, mesh, run.dtype)
    params = restore_params(ckpt_dir, abstract, shardings, dtype=run.dtype)
    return cls(model_cfg, params, run=run, tokenizer=find_tokenizer(ckpt_dir), mesh=mesh)

  # -- checks -------------------------------------------------------------------------------------
  def logits(self, token_ids) -> np.ndarray:
    """Full causal forward without cache: float32 logits [B, T, V]."""
    tokens = np.atleast_2d(np.asarray(token_ids, np.int32))
    self._check_ids(tokens.ravel().tolist())
    return np.asarray(self.steps.forward(self.params, jnp.asarray(tokens)))

  def prompt_logits(self, prompt) -> np.ndarray:
    """float32 logits [V] of the last position of one prompt (text or ids) through the serving path: chunked
    prefill into the paged cache with this engine's attention backend and cache dtype, i.e. what the first
    generated token is sampled from. Its pages are freed afterwards."""
    r = self._make_requests([prompt], 1, None)[0]
    with self._lock:
      if not self._admit(r):
        raise PagePoolExhausted(f"the prompt needs {len(r.prompt) + 1} tokens of pages; {self.pool.pages_free} of "
                                f"{self.pool.pages_allocatable} pages are free")
      try:
        return np.asarray(self._prefill(r, sample=False))[0]
      finally:
        self._release(r)
        self._recover_cache()

  def _check_ids(self, ids):
    bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
    if bad:
      raise RequestError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.cfg.vocab_size})")

  # -- requests -----------------------------------------------------------------------------------
  def encode(self, prompt) -> list[int]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError("this engine has no tokenizer: pass token ids instead of text")
      if not prompt:
        raise RequestError("empty prompt: give at least one token")
      try:
        prompt.encode("utf-8")
      except UnicodeEncodeError as e:   # lone surrogates: the tokenizer would fail with a TypeError
        raise RequestError(f"the prompt is not valid Unicode: {e.reason} {prompt[e.start:e.end]!r} at index "
                           f"{e.start}") from None
      ids = self.tokenizer.encode(prompt)
      if not ids:   # e.g. SmolLM2's vocabulary drops "\x16": prefill would have nothing to start from
        raise RequestError(f"the prompt {prompt[:40]!r} encodes to no tokens: its characters are not in the "
                           "tokenizer's vocabulary")
      self._check_ids(ids)              # a tokenizer larger than the model's vocabulary
      return ids
    ids = [int(t) for t in prompt]
    if not ids:
      raise RequestError("empty prompt: give at least one token")
    self._check_ids(ids)
    return ids

  def _make_requests(self, prompts, max_new_tokens, sampling, prefix=None) -> list[_Request]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
      raise RequestError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    try:
      sp = SamplingParams.make(sampling)
    except (TypeError, ValueError) as e:
      raise RequestError(str(e)) from None
    head = self.encode(prefix) if prefix is not None else []
    reqs = []
    for i, p in enumerate(prompts):
      ids = head + self.encode(p)
      if len(ids) + max_new_tokens > self.max_context:
        raise RequestError(f"prompt {i} has {len(ids)} tokens + max_new_tokens={max_new_tokens} = "
                           f"{len(ids) + max_new_tokens} > max context {self.max_context}")
      n = len(ids) + max_new_tokens
      per_shard = self._pages_held(n, len(head))
      need = sum(per_shard)
      if max(per_shard) > self.pool.pages_per_shard - 1:
        S = self.pool.shards
        what = f"{n} tokens" + (", with the shared prefix's pages held beside them" if head else "")
        if S == 1:
          usable = self.pool.pages_allocatable
          raise RequestError(f"prompt {i} needs {need} pages ({what}) but the pool has only {usable} pages "
                             f"({usable * self.run.page_size} tokens): raise num_pages or lower max_new_tokens")
        per = self.pool.pages_per_shard - 1
        raise RequestError(f"prompt {i} needs {need} pages ({what}), {max(per_shard)} of them on seq shard "
                           f"{per_shard.index(max(per_shard))}, "
                           f"but each of the {S} seq shards has only {per} pages: raise num_pages or lower "
                           "max_new_tokens")
      reqs.append(_Request(i, ids, int(max_new_tokens), sp, shared=len(head)))
    return reqs

  def _pages_held(self, n: int, shared: int) -> list[int]:
    """Pages per seq shard held while a request of n tokens runs: with a shared prefix of `shared` tokens, the
    prefix sequence's pages too, and the request's copy of the prefix's partly filled last page."""
    Z, S = self.run.page_size, self.pool.shards
    slots = list(range(-(-shared // Z))) + list(range(shared // Z, -(-n // Z)))   # table slot m is on shard m % S
    return [sum(1 for m in slots if m % S == d) for d in range(S)]

  @staticmethod
  def _as_list(prompts) -> tuple[list, bool]:
    """A str or a flat sequence of ints is one prompt; anything else is a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and all(isinstance(t, (int, np.integer)) for t in prompts)):
      return [prompts], True
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
      return [prompts.tolist()], True
    prompts = list(prompts)
    if not prompts:
      raise RequestError("no prompts given")
    return prompts, False

  def generate(self, prompts, *, max_new_tokens: int = 64, sampling=None, prefix=None):
    """Generate for one prompt (str or token ids) or a list of them. Returns one result or a list.

    `prefix` (text or ids) is prepended to every prompt and prefilled once: its pages are shared by all
    requests (copy-on-write of the last, partly filled page) instead of being stored once per request.
    """
    plist, single = self._as_list(prompts)
    reqs = self._make_requests(plist, max_new_tokens, sampling, prefix)
    for _ in self._run(reqs):
      pass
    self.last_results = [self._result(r) for r in reqs]
    return self.last_results[0] if single else self.last_results

  def generate_stream(self, prompts, *, max_new_tokens: int = 64, sampling=None,
                      prefix=None) -> Iterator[tuple[int, str]]:
    """Yield (prompt index, text delta) as tokens come back from the device (one decode call at a time)."""
    plist, _ = self._as_list(prompts)
    reqs = self._make_requests(plist, max_new_tokens, sampling, prefix)
    sent = {r.index: "" for r in reqs}
    for r in self._run(reqs):
      text = self._text(r.out)
      if text != sent[r.index]:
        # Hold back a trailing replacement char: the next token may complete the UTF-8 sequence.
        stable = text.rstrip("\ufffd") if r.finish is None else text
        if stable.startswith(sent[r.index]) and len(stable) > len(sent[r.index]):
          yield r.index, stable[len(sent[r.index]):]
          sent[r.index] = stable
    self.last_results = [self._result(r) for r in reqs]

  def _text(self, ids) -> str:
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode([t for t in ids if t not in self.cfg.eos_ids], skip_special_tokens=True)

  def _result(self, r: _Request) -> GenerationResult:
    n_dec = max(len(r.out) - 1, 0)
    stats = dict(prompt_tokens=len(r.prompt), new_tokens=len(r.out), prefill_s=r.prefill_s,
                 decode_ms_per_token=(1000 * r.decode_s / n_dec) if n_dec else float("nan"),
                 peak_device_bytes=_peak_device_bytes(), peak_host_bytes=_peak_host_bytes())
    return GenerationResult(self._text(r.out), list(r.out), len(r.prompt), r.finish or "length", stats)

  # -- scheduling ---------------------------------------------------------------------------------
  def _admit(self, r: _Request) -> bool:
    """Reserve every page the request will need, sharing the prefix pages when there is one."""
    r.seq = self.pool.fork(r.base) if r.base is not None else self.pool.new_sequence()
    try:
      copies = self.pool.extend(r.seq, len(r.prompt) - r.shared + r.max_new)
    except PagePoolExhausted:
      self.pool.free(r.seq)
      r.seq = None
      return False
    if copies:
      src, dst = (jnp.asarray(c, jnp.int32) for c in zip(*copies))
      self.cache = self.steps.copy_pages(self.cache, src, dst)
    self.peak_pages_used = max(self.peak_pages_used, self.pool.pages_used)
    return True

  def _prefill_prefix(self, reqs: list[_Request]):
    """Prefill the shared prefix once into a sequence of its own that the requests fork."""
    n = reqs[0].shared
    base = _Request(-1, reqs[0].prompt[:n], 0, SamplingParams())
    base.seq = self.pool.new_sequence()
    try:
      self.pool.extend(base.seq, n)
      self._prefill(base, sample=False)
    except BaseException:
      self._release(base)
      raise
    for r in reqs:
      r.base = base.seq
    return base

  def _recover_cache(self):
    """After an interruption inside a donated call the pools are gone: start afresh (no pages are held then)."""
    if self.cache.k.is_deleted():
      self.cache = self._new_cache()

  def _release(self, r: _Request):
    if r.seq is not None:
      self.pool.free(r.seq)
      r.seq = None

  def _run(self, reqs: list[_Request]) -> Iterator[_Request]:
    """One run at a time per engine: the cache is donated through every step, so another thread's run waits
    here (a run of this thread, e.g. a second stream, interleaves: its pages are its own)."""
    with self._lock:
      yield from self._drive(reqs)

  def _drive(self, reqs: list[_Request]) -> Iterator[_Request]:
    """Drive requests to completion, yielding a request each time it gains tokens."""
    waiting = list(reqs)
    live: list[_Request | None] = [None] * self.run.max_batch
    base = None
    try:
      if reqs and reqs[0].shared:
        base = self._prefill_prefix(reqs)
      while waiting or any(live):
        for b in range(len(live)):
          if live[b] is None and waiting and self._admit(waiting[0]):
            r = waiting.pop(0)
            self._prefill(r)
            yield r
            live[b] = None if r.finish else r
        if not any(live):
          if waiting:   # after the checks above, only another run of this thread (a stream) can hold the pages
            raise PagePoolExhausted(f"request {waiting[0].index} cannot be admitted: {self.pool.pages_free} of "
                                    f"{self.pool.pages_allocatable} pages free, the rest held by another "
                                    "generation on this engine (an unfinished generate_stream)")
          break
        for r in self._decode_call(live):
          yield r
        for b, r in enumerate(live):
          if r is not None and r.finish:
            self._release(r)
            live[b] = None
    finally:
      for r in reqs + ([base] if base else []):
        self._release(r)
      self._recover_cache()

  @property
  def table_width(self) -> int:
    """Page-table slots per sequence: one width for every call, so each step compiles once per chunk size; a
    multiple of seq, so every seq shard reads an equal slice of it."""
    # Rounded to 16, not to a power of two: kernels that read B * M pages must not see twice the context.
    w = -(-math.ceil(self.max_context / self.run.page_size) // 16) * 16
    return -(-w // self.run.seq) * self.run.seq

  def _prefill(self, r: _Request, sample: bool = True):
    """Prefill r.prompt[r.shared:] in chunks (the shared prefix is cached already), then sample a token (or,
    with sample=False, return the last chunk's logits [1, V])."""
    t0 = time.perf_counter()
    C = self.run.prefill_chunk
    n = len(r.prompt)
    logits = None
    table = jnp.asarray(self.pool.page_table_array([r.seq], self.table_width))   # pages are reserved up front
    for c0 in range(r.shared, n, C):
      piece = r.prompt[c0:c0 + C]
      Tb = _bucket(len(piece), 16, C)
      tokens = np.zeros((1, Tb), np.int32)
      tokens[0, :len(piece)] = piece
      slots = np.zeros((1, Tb), np.int32)
      slots[0, :len(piece)] = self.pool.slot_mapping(r.seq, c0, len(piece))
      positions = (c0 + np.arange(Tb, dtype=np.int32))[None]
      logits, self.cache = self.steps.prefill(
          self.params, self.cache, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(slots),
          table, jnp.asarray([c0], jnp.int32), jnp.asarray([len(piece)], jnp.int32))
    if not sample:
      return logits
    tok = self.steps.first_token(logits, stack_sampling([r.sampling]), jnp.asarray([n], jnp.int32))
    tok = int(tok[0])
    r.prefill_s = time.perf_counter() - t0
    r.out.append(tok)
    if tok in self.cfg.eos_ids:
      r.finish = "eos"
    elif r.max_new <= 1:
      r.finish = "length"

  def _decode_call(self, live: list[_Request | None]) -> list[_Request]:
    B = len(live)
    alive = [r for r in live if r is not None]
    seqs = [r.seq if r is not None else None for r in live]
    tokens = np.zeros(B, np.int32)
    pos = np.zeros(B, np.int32)
    done = np.ones(B, bool)
    remaining = np.zeros(B, np.int32)
    for b, r in enumerate(live):
      if r is not None:
        tokens[b], pos[b], done[b] = r.out[-1], len(r.prompt) + len(r.out) - 1, False
        remaining[b] = r.max_new - len(r.out)
    table = np.zeros((B, self.table_width), np.int32)
    for b, s in enumerate(seqs):
      if s is not None:
        table[b] = self.pool.page_table_array([s], self.table_width)[0]
    sampling = [r.sampling if r is not None else SamplingParams() for r in live]
    sp = stack_sampling(sampling)
    state = DecodeState(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(done), jnp.asarray(remaining))
    t0 = time.perf_counter()
    out, state, self.cache = self.steps.decode(self.params, self.cache, state, sp, jnp.asarray(table), self.eos,
                                               steps=self.run.decode_steps, greedy=all_greedy(sampling))
    out = np.asarray(out)
    dt = time.perf_counter() - t0
    final_done = np.asarray(state.done)
    for b, r in enumerate(live):
      if r is None:
        continue
      new = [int(t) for t in out[b] if t >= 0]
      r.out.extend(new)
      r.decode_s += dt
      if final_done[b]:
        r.finish = "eos" if r.out[-1] in self.cfg.eos_ids else "length"
    return alive
