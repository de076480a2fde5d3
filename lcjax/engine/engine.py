"""The Engine: a loaded model behind `generate`, `generate_stream`, `prefill` (contexts) and `logits`.

The Engine loads and places the weights (lcjax.engine.placement), digests them (lcjax.engine.digest), tokenizes
prompts into requests (lcjax.engine.prompts) checked against its limits (lcjax.engine.requests), and hands them as
token ids to its scheduler (lcjax.engine.scheduler), which owns the page pool, the device KV cache, the prefix cache
and the compiled steps; finished requests become results (lcjax.engine.results). Nothing below calls back up.

Every engine runs on a ("seq", "tensor") mesh of `run.seq` x `run.tensor` devices (one device: the plain
single-device model); the page pool is split over `seq` and KV heads over `tensor`.
"""
from __future__ import annotations

import functools
import json
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lcjax.cache import kv as kvc
from lcjax.cache.pages import PagePoolExhausted
from lcjax.config import ModelConfig, RunConfig
from lcjax.engine import compile_cache, placement, prompts as prompting
from lcjax.engine.context import Context, fingerprint as context_fingerprint, load_context as _load_context
from lcjax.engine.digest import weights_digest as _weights_digest
from lcjax.engine.prompts import check_callback as _check_callback, token_ids as _token_ids
from lcjax.engine.requests import RequestError
from lcjax.engine.results import GenerationResult, linear_kernels, result
from lcjax.engine.sampling import SamplingParams
from lcjax.engine.scheduler import Request, Scheduler, chunk_programs
from lcjax.engine.serving import Serving, resolve
from lcjax.engine.steps import Steps
from lcjax.model.llama import Llama, convert_weights, weight_format

__all__ = ["Engine", "GenerationResult", "RequestError", "Context"]


@functools.lru_cache(maxsize=8)
def _random_params(model_cfg: ModelConfig, mesh, dtype: str, weights):
  """Engine.random's program: make(jax.random.key(seed)) -> the parameters of (model, dtype, weight format, seed),
  each shard made on its device of `mesh`. Kept for the next engine of the same model, mesh, dtype and weight format,
  which calls it (any seed) without tracing, lowering or compiling it again; each call returns new arrays."""
  _, shardings = placement.checkpoint_shardings(model_cfg, mesh, dtype, weights)

  @functools.partial(jax.jit, out_shardings=shardings)
  def make(key):
    return nnx.state(Llama(model_cfg, dtype=jnp.dtype(dtype), weights=weights, rngs=nnx.Rngs(key)), nnx.Param)

  return make


class Engine:
  def __init__(self, model_cfg: ModelConfig, params, *, run: RunConfig | None = None, tokenizer=None,
               mesh: jax.sharding.Mesh | None = None, serving: Serving | None = None):
    """params: the checkpoint-shaped `nnx.State` of Llama(model_cfg) (on the host, one device, or already placed
    by `placement.checkpoint_shardings`); the engine places it on the mesh of `run.seq` x `run.tensor` devices
    (or `mesh`) and repeats KV heads when `tensor` needs it. serving: the run already resolved for these
    parameters (lcjax.engine.serving.resolve), instead of run and mesh."""
    if serving is None:
      serving = resolve(model_cfg, run or RunConfig(), weights=weight_format(params), mesh=mesh, check_fit=False)
    elif run is not None or mesh is not None:
      raise ValueError("give serving= or run= and mesh=, not both: the serving holds its run and mesh")
    elif serving.model != model_cfg or serving.weights != weight_format(params).for_run(serving.run.weight_dtype):
      raise ValueError(f"serving= was resolved for model {serving.model.name} with {serving.weights} weights, not "
                       f"{model_cfg.name} with these parameters' {weight_format(params)}")
    self.serving = serving
    self.cfg = model_cfg
    self.run = serving.run
    compile_cache.enable(self.run.compile_cache)      # before the first compile (a no-op after the first engine)
    self.tokenizer = tokenizer
    self.max_context = serving.max_context
    self.attention = serving.attention
    self.mesh = serving.mesh
    self.serving_cfg, self.kv_rep = serving.serving_cfg, serving.kv_rep
    # The linear weights as the run asks (RunConfig.weight_dtype): params in another format are converted here;
    # Engine.load and Engine.random hand them over converted already, a layer at a time.
    self.weights = serving.weights
    params = convert_weights(params, model_cfg, self.weights, self.run.dtype)
    self.decode_linear, self.page_write = serving.linear.name, serving.page_write.name
    serving.log_slow_paths()
    self.graphdef, self.param_shardings = placement.serving_shardings(
        model_cfg, self.run, self.mesh, self.attention, self.weights, gemv_kernel=serving.linear.kernel,
        page_writer=serving.page_write.kernel)
    self.fingerprint = context_fingerprint(model_cfg, self.run, self.weights, _weights_digest(params))
    self.params = placement.place_params(params, model_cfg, self.run, self.mesh, self.param_shardings,
                                         self.weights)
    self.plan, self.limits = serving.plan, serving.limits
    self.steps = Steps(self.graphdef, self.run.page_size, self.mesh,
                       kvc.cache_shardings(self.mesh, self.fp8_cache), sync_every=self.run.decode_sync_every,
                       fp8_weights=self.weights.fp8)
    salt = json.dumps(self.fingerprint, sort_keys=True).encode()
    self.scheduler = Scheduler(self.steps, self.params, self.run, self.plan.num_pages, self.max_context,
                               self._new_cache, model_cfg.eos_ids, salt=salt)
    self.last_results: list[GenerationResult] = []

  # -- what the scheduler holds ---------------------------------------------------------------------------------
  @property
  def pool(self):
    return self.scheduler.pool

  @property
  def cache(self) -> kvc.PagedKV:
    return self.scheduler.cache

  @property
  def prefix_cache(self):
    return self.scheduler.prefix_cache

  @property
  def peak_pages_used(self) -> int:
    return self.scheduler.peak_pages_used

  @property
  def fp8_cache(self) -> bool:
    return self.run.resolved_cache_dtype == "float8_e4m3fn"

  @property
  def decode_kernel(self) -> str:
    """The kernel decode steps run: the backend's name, or the kernel the backend picks for these pages ('mosaic',
    'triton', 'triton-interpret'; `serving.decode.why` says why)."""
    return self.serving.decode.name

  @property
  def kernels(self) -> dict[str, str]:
    """What runs, as every result's stats name it: attention, prefill_kernel (what reads a chunk's cached prefix),
    decode_kernel, page_write, linear."""
    return dict(attention=self.attention.name, prefill_kernel=self.serving.prefill.name,
                decode_kernel=self.decode_kernel, page_write=self.page_write, linear=self.linear_kernels)

  @property
  def linear_kernels(self) -> str:
    """How the projections and MLP multiply: by their dtype, or for fp8 weights which product prefill chunks and
    decode steps run (lcjax.ops.linear.dense, by a call's rows), and on a mesh that a GEMV runs on each shard."""
    return linear_kernels(self.weights, self.run, self.serving.linear.kernel, self.mesh.size)

  def close(self) -> None:
    """Free the engine's device memory (weights, cache, contexts); later calls are refused."""
    with self.scheduler.lock:
      self.scheduler.close()
      for x in jax.tree.leaves(self.params):
        if isinstance(x, jax.Array) and not x.is_deleted():
          x.delete()

  def __enter__(self) -> "Engine":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- construction -------------------------------------------------------------------------------------------
  def _new_cache(self) -> kvc.PagedKV:
    return kvc.init_cache(self.cfg.n_layers, self.plan.num_pages, self.run.page_size, self.serving_cfg.n_kv_heads,
                          self.cfg.head_dim, self.run.resolved_cache_dtype, mesh=self.mesh)

  @classmethod
  def random(cls, model_cfg: ModelConfig, *, run: RunConfig | None = None, seed: int = 0, tokenizer=None,
             mesh: jax.sharding.Mesh | None = None, serving: Serving | None = None):
    """Random weights made on the devices, each shard in place (benchmarks and tests; no checkpoint needed).
    The weights depend on `seed` only, never on the mesh. A run whose memory plan does not fit the devices is
    refused (ConfigError) before anything is allocated, as `load` and the CLI refuse it."""
    if serving is None:
      # fp8 weights are drawn in dtype and quantized a layer at a time: the same model as in dtype, quantized.
      serving = resolve(model_cfg, run or RunConfig(), mesh=mesh)
    elif run is not None or mesh is not None:
      raise ValueError("give serving= or run= and mesh=, not both: the serving holds its run and mesh")
    run, weights = serving.run, serving.weights
    compile_cache.enable(run.compile_cache)
    make = _random_params(model_cfg, serving.mesh, run.dtype, weights)
    return cls(model_cfg, make(jax.random.key(seed)), tokenizer=tokenizer, serving=serving)

  @classmethod
  def load(cls, ckpt_dir, *, tensor: int | None = None, seq: int | None = None, dtype: str | None = None,
           run: RunConfig | None = None, mesh: jax.sharding.Mesh | None = None, serving: Serving | None = None,
           **overrides):
    """Restore a checkpoint ready to generate: an lcjax checkpoint directory, or an HF model folder
    (config.json + safetensors) or a GGUF file, converted once into the user cache (~/.cache/lcjax).

    tensor, seq, dtype override the run config's fields (default: its own). Every parameter is read straight
    into its shards on the mesh: a process reads only what its devices hold (multi-host included). A run that
    cannot serve the model (its context, mesh, kernels or memory plan) is refused from the source's config alone,
    before an HF folder or GGUF file is converted.
    """
    from lcjax.checkpoint.restore import restore_params
    from lcjax.checkpoint.sources import resolve_checkpoint, source_config
    from lcjax.tokenizer import find_tokenizer
    model_cfg, stored = source_config(ckpt_dir)
    given = {k: v for k, v in dict(tensor=tensor, seq=seq, dtype=dtype).items() if v is not None}
    if serving is None:
      serving = resolve(model_cfg, (run or RunConfig()).replace(**given, **overrides), weights=stored, mesh=mesh)
    elif run is not None or mesh is not None or given or overrides:
      raise ValueError("give serving= or the run's fields, not both: the serving holds its run and mesh")
    elif serving.model != model_cfg:
      raise ValueError(f"serving= was resolved for model {serving.model.name}, and {ckpt_dir} holds {model_cfg.name}")
    run, weights, mesh = serving.run, serving.weights, serving.mesh
    compile_cache.enable(run.compile_cache)
    ckpt_dir = resolve_checkpoint(ckpt_dir)
    tokenizer = find_tokenizer(ckpt_dir)        # its files and chat template checked before any weight is read
    abstract, shardings = placement.checkpoint_shardings(model_cfg, mesh, run.dtype, weights)
    params = restore_params(ckpt_dir, abstract, shardings, dtype=run.dtype)
    return cls(model_cfg, params, tokenizer=tokenizer, serving=serving)

  # -- checks -------------------------------------------------------------------------------------------------
  def logits(self, token_ids) -> np.ndarray:
    """Full causal forward without cache: float32 logits [B, T, V] of a batch of B prompts of T token ids each
    (one prompt: [1, T, V]); T at most max_context (its cost grows as T^2)."""
    self.scheduler.check_open()
    rows = [_token_ids(r) for r in self._as_list(token_ids)[0]]
    if len({len(r) for r in rows}) != 1 or not rows[0]:
      raise RequestError(f"logits takes prompts of one length >= 1, not lengths {sorted({len(r) for r in rows})}")
    if len(rows[0]) > self.max_context:
      raise RequestError(f"logits of {len(rows[0])} tokens > max context {self.max_context}")
    self.limits.check_ids([t for r in rows for t in r])
    return np.asarray(self.steps.forward(self.params, jnp.asarray(np.asarray(rows, np.int32))))

  def prompt_logits(self, prompt, *, context: Context | None = None) -> np.ndarray:
    """float32 logits [V] of the last position of one prompt (text or ids) through the serving path: chunked
    prefill into the paged cache with this engine's attention backend and cache dtype, i.e. what the first
    generated token is sampled from (after `context`'s tokens when one is given, read from its pages). Its pages
    are released afterwards."""
    r = self._requests([prompt], 1, None, None, context)[0][0]
    sched = self.scheduler
    with sched.exclusive():
      sched.check_open()
      try:
        if not sched.admit(r):
          raise PagePoolExhausted(sched.blocked_message(r, "the prompt"))
        return np.asarray(sched.prefill(r, sample=False))[0]
      finally:
        sched.release(r)
        sched.recover_cache()

  # -- requests -----------------------------------------------------------------------------------------------
  def encode(self, prompt, add_bos: bool | None = None) -> list[int]:
    """Token ids of a prompt (text or ids); add_bos=None: the tokenizer's rule for text (ids are kept as
    given), False: no BOS (text that continues a context)."""
    return prompting.encode(self.tokenizer, self.limits, prompt, add_bos)

  def _check_chat_template(self) -> None:
    prompting.check_chat_template(self.tokenizer)

  def _chat_ids(self, prompt) -> list[int]:
    return prompting.chat_ids(self.tokenizer, self.limits, prompt)

  def _question_ids(self, question, chat) -> list[int]:
    return prompting.question_ids(self.tokenizer, self.limits, question, chat)

  def _make_requests(self, prompts, max_new_tokens, sampling, head: list[int] = (), chat: bool = False,
                     continuation=None) -> list[Request]:
    """lcjax.engine.prompts.make_requests with this engine's tokenizer and limits."""
    return prompting.make_requests(self.tokenizer, self.limits, prompts, max_new_tokens, sampling, head=head,
                                   chat=chat, continuation=continuation)

  _as_list = staticmethod(prompting.as_list)

  def _requests(self, prompts, max_new_tokens, sampling, prefix, context, chat=False):
    """(requests, single prompt?, prefix ids to pin for the call or None): lcjax.engine.prompts.requests."""
    return prompting.requests(self, prompts, max_new_tokens, sampling, prefix, context, chat)

  def generate(self, prompts, *, max_new_tokens: int = 64, sampling=None, prefix=None,
               context: Context | None = None, chat: bool = False, on_progress=None,
               decode_steps: int | None = None):
    """Generate for one prompt (str or token ids) or a list of them. Returns one result or a list.

    `context` (from `prefill` or `load_context`) continues a pinned context: each prompt follows its tokens
    (no second BOS). `prefix` (text or ids) is prepended to every prompt and prefilled once for this call: its
    prefill is in the stats of the first result (prefill_s, prefill_tokens, shared_prefix_prefill_s), the others
    count it as cached. Either way the context's pages are shared by all requests (copy-on-write of the last,
    partly filled page). sampling: None or "greedy", a SamplingParams, or a dict of its fields; prompt i draws
    with seed `seed + i`. chat=True: each prompt (text, or a list of {"role", "content"} messages) goes through
    the checkpoint's chat template; with a context prefilled with chat=True, each prompt is a question that
    continues the context's user turn (the tokens of the cold chat of document + "\n\n" + question).
    stats["time_to_first_token_s"]: from the call to the prompt's first token. on_progress(prompt index,
    tokens prefilled, tokens to prefill) is called after each prefill chunk (index -1: the prefix).
    decode_steps: tokens per decode call of the device loop (default: run.decode_steps); it never changes the
    tokens, only how often the host sees them."""
    t0, c0 = time.perf_counter(), compile_cache.compile_seconds()
    self.last_results = []
    _check_callback(on_progress)
    steps = self.limits.decode_steps(decode_steps, self.run.decode_steps)
    reqs, single, prefix_ids = self._requests(prompts, max_new_tokens, sampling, prefix, context, chat)
    for r in reqs:
      r.on_progress = on_progress
    for _ in self.scheduler.serve(reqs, prefix=prefix_ids, decode_steps=steps, on_progress=on_progress):
      pass
    compile_s = compile_cache.compile_seconds() - c0
    self.last_results = [self._result(r, t0, compile_s) for r in reqs]
    return self.last_results[0] if single else self.last_results

  def generate_stream(self, prompts, *, max_new_tokens: int = 64, sampling=None, prefix=None,
                      context: Context | None = None, chat: bool = False, on_progress=None,
                      decode_steps: int | None = None) -> Iterator[tuple[int, str]]:
    """Yield (prompt index, text delta) as tokens come back from the device: one decode call, of up to
    `decode_steps` tokens (default: run.stream_decode_steps, else run.decode_steps), at a time; decode_steps=1
    yields every token as soon as it is sampled (at the cost of a device call and a host sync per token).
    The other arguments are generate()'s. `last_results` then holds the results; a stream left unfinished (closed,
    broken off, an error) leaves its tokens so far, finish_reason "stopped" where a request had not finished."""
    t0, c0 = time.perf_counter(), compile_cache.compile_seconds()
    self.last_results = []
    _check_callback(on_progress)
    steps = self.limits.decode_steps(decode_steps, self.run.stream_steps)
    reqs, _, prefix_ids = self._requests(prompts, max_new_tokens, sampling, prefix, context, chat)
    for r in reqs:
      r.on_progress = on_progress
    sent = {r.index: "" for r in reqs}
    try:
      for r in self.scheduler.serve(reqs, prefix=prefix_ids, decode_steps=steps, on_progress=on_progress):
        text = self._text(r.out)
        if text != sent[r.index]:
          # Hold back a trailing replacement char: the next token may complete the UTF-8 sequence.
          stable = text.rstrip("\ufffd") if r.finish is None else text
          if stable.startswith(sent[r.index]) and len(stable) > len(sent[r.index]):
            yield r.index, stable[len(sent[r.index]):]
            sent[r.index] = stable
    finally:
      for r in reqs:
        r.finish = r.finish or "stopped"
      compile_s = compile_cache.compile_seconds() - c0
      self.last_results = [self._result(r, t0, compile_s) for r in reqs]

  def _text(self, ids) -> str:
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode([t for t in ids if t not in self.cfg.eos_ids], skip_special_tokens=True)

  def _result(self, r: Request, t_call: float | None = None, compile_s: float = 0.0) -> GenerationResult:
    """r's result (lcjax.engine.results.result) with this engine's kernels in its stats."""
    kernels = dict(self.kernels, attention_dtype=self.run.attention_dtype, dtype=self.run.dtype,
                   weight_dtype=self.weights.name or self.run.dtype, cache_dtype=self.run.resolved_cache_dtype)
    return result(r, self._text(r.out), kernels, self.run.draft, t_call, compile_s, devices=self.mesh.local_devices)

  def warm_up(self, prompt_tokens, *, context: Context | None = None, chat: bool = False, context_tokens: int = 0,
              prefill_context: bool = True, sampling=None, decode_steps: int | None = None, more_buckets=()) -> int:
    """Compile, without running anything, the programs a generate of one prompt uses: `prompt_tokens`, the
    prompt's token count, or the prompt itself as generate takes it (text, ids or messages, with `context` and
    `chat` as generate's: `warm_up("What does it conclude?", context=ctx, chat=True)` counts the tokens the
    question becomes); after a pinned context (`context`, or one of `context_tokens` tokens whose prefill's chunks
    are compiled too unless prefill_context=False): its prefill chunks, the first token, the decode loop of its
    sampling and decode_steps (default run.decode_steps), the copy of a context's partly filled last page, and
    prefill chunks of the padded lengths `more_buckets` (questions to come: after the context, or without one the
    first chunks of prompts). With a warm persistent compilation cache this is tracing and lowering only. Assumes
    no prefix cache hit for the prompt (a hit starts its chunks elsewhere). Returns the number of programs
    compiled."""
    try:
      sp = SamplingParams.make(sampling)
    except (TypeError, ValueError) as e:
      raise RequestError(str(e)) from None
    if context is not None:
      if context_tokens:
        raise RequestError(f"give context= or context_tokens={context_tokens}, not both")
      context._check_usable(self)
      context_tokens, prefill_context = len(context), False
    if prompt_tokens is not None and not isinstance(prompt_tokens, (int, np.integer)):     # the prompt itself
      (r,), _, _ = self._requests([prompt_tokens], 1, None, None, context, chat)
      prompt_tokens = len(r.prompt) - r.prefix_len
    C, Z = self.run.prefill_chunk, self.run.page_size
    self.limits.check_warm_up(prompt_tokens, context_tokens, more_buckets, C)
    chunks = {(b, context_tokens > 0) for b in more_buckets}
    if context_tokens and prefill_context:
      chunks |= chunk_programs(context_tokens, C)
    if prompt_tokens:
      chunks |= chunk_programs(prompt_tokens, C, cached=context_tokens)
    asks = bool(prompt_tokens or more_buckets)
    decode = ((self.limits.decode_steps(decode_steps, self.run.decode_steps), sp.temperature == 0),) if asks else ()
    with self.scheduler.lock:
      self.scheduler.check_open()
      return self.scheduler.compile_programs(chunks, decode, first_token=asks,
                                             copies=(1,) if context_tokens % Z and asks else ())

  # -- contexts -----------------------------------------------------------------------------------------------
  def prefill(self, document, *, chat: bool = False, system: str | None = None, on_progress=None) -> Context:
    """Prefill a document (text or ids) once and pin it: the returned Context holds its pages until
    `close()` (or the end of a `with` block); `generate(..., context=ctx)` continues it. Full pages already in
    the prefix cache are reused, not recomputed. Its prefill time is `ctx.stats["seconds"]`.

    chat=True (text): the context is the checkpoint's chat up to the end of the document in the user turn (after a
    system turn of `system`, or the template's default); `generate(question, context=ctx, chat=True)` continues
    it with "\n\n" + question, the end of the turn and the assistant's prompt, in the tokens of the cold chat of
    that whole user turn (lcjax.tokenizer.ChatDocument: the document's last few tokens are prefilled with each
    question, since a tokenizer may merge them with what follows)."""
    _check_callback(on_progress)
    ids, continuation = prompting.document_ids(self.tokenizer, self.limits, document, chat, system)
    self.limits.check(0, ids, 1, what="the context")
    t0 = time.perf_counter()
    seq, cached = self.scheduler.pin(ids, on_progress=on_progress)
    return Context(self, ids, seq, cached_tokens=cached, seconds=time.perf_counter() - t0, chat=continuation)

  def load_context(self, path, *, share: bool | None = None) -> Context:
    """Restore a context saved by `Context.save` onto this engine's devices (any mesh). A context saved by
    another model, dtype or page size is refused with a line naming both values.

    share: whether its pages join the prefix cache, where later prompts that start with its tokens reuse them.
    None (default): when it carries this user's signature (`ctx.stats["verified"]`: saved by this user, on this
    machine's user cache, from a context that was shared). A context from anyone else answers its own questions
    only; share=True vouches for it."""
    if share is not None and not isinstance(share, bool):
      raise RequestError(f"share={share!r} must be True, False or None")
    return _load_context(self, path, share)
