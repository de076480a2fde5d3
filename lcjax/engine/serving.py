"""What runs, decided once: `resolve(model_cfg, run, weights=...)` turns a model and a RunConfig into a `Serving`.

A Serving is the concrete run (every "auto" made concrete), its mesh, the serving model's config (KV heads
repeated for `tensor`), the memory plan and request limits, and each kernel choice with the reason it was made:
the attention backend, the decode kernel that backend runs over this cache's pages, the product of fp8 weights in
decode-sized calls, the fp8 page write, and speculative decoding. `Serving.table()` prints them. It reads no
weights, so the CLI and `Engine.load` refuse a run that cannot serve (its context, mesh, kernels or memory) before
a checkpoint is read; `Engine`, `Engine.load`, `Engine.random` and the CLI take the Serving and never resolve
again.
"""
from __future__ import annotations

import dataclasses
import logging

import jax

from lcjax.config import ConfigError, ModelConfig, RunConfig, WeightFormat
from lcjax.engine import placement
from lcjax.engine import plan as planlib
from lcjax.engine.requests import Limits, check_context_length
from lcjax.ops import kernels
from lcjax.ops.backends import get_backend
from lcjax.ops.linear import WIDEN_MAX_ROWS

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Choice:
  """A kernel or mode that runs, and why it was chosen."""
  name: str
  why: str
  kernel: object = None              # the object the model receives to run it (lcjax.ops.kernels); None: XLA's ops


@dataclasses.dataclass(frozen=True)
class Serving:
  model: ModelConfig                 # the checkpoint's model
  run: RunConfig                     # for_platform: dtype concrete
  mesh: jax.sharding.Mesh            # ("seq", "tensor")
  serving_cfg: ModelConfig           # model with KV heads repeated kv_rep times (placement.serving_config)
  kv_rep: int
  weights: WeightFormat              # how the linear weights are held while serving
  attention: object                  # the backend (lcjax.ops.backends), `name` says which
  decode: Choice                     # the kernel decode steps run over this cache's pages
  prefill: Choice                    # what reads a prefill chunk's keys (its cached prefix) from the pages
  linear: Choice                     # Llama's gemv_kernel: the product of fp8 weights in decode-sized calls
  page_write: Choice                 # Llama's page_writer: what writes a decode step's token into fp8 pages
  draft: Choice                      # speculative decoding (RunConfig.draft)
  plan: planlib.MemoryPlan
  limits: Limits

  @property
  def max_context(self) -> int:
    return self.run.context_for(self.model)

  @property
  def cache_dtype(self) -> str:
    return self.run.resolved_cache_dtype

  def require_fit(self) -> None:
    """Refuse (ConfigError, one line) a memory plan the mesh's devices cannot hold."""
    planlib.require_fit(self.plan, self.model, self.run, *placement.device_memory(self.mesh))

  def log_slow_paths(self) -> None:
    """Log each decode-time product or page write that runs in XLA where a kernel could not, and a cached prefix
    in fp8 pages that is gathered instead of read in place (a warning on a GPU, where it is the slow path;
    elsewhere it is the only one), and the Triton GEMV where `auto` took it."""
    level = logging.WARNING if jax.default_backend() == "gpu" else logging.INFO
    if self.weights.fp8 and self.linear.kernel is None:
      _log.log(level, "decode-sized fp8 products run in XLA (fp8 widened to %s): %s", self.run.dtype,
               self.linear.why)
    elif self.weights.fp8 and self.linear.name == "pallas" and self.run.linear_kernel == "auto":
      _log.info("decode-sized fp8 products run the Triton GEMV kernel (lcjax.ops.triton.gemv): %s", self.linear.why)
    if self.cache_dtype == "float8_e4m3fn" and self.prefill.name.endswith("-gather"):
      _log.log(level, "prefill chunks gather their cached prefix: %s", self.prefill.why)
    if self.cache_dtype == "float8_e4m3fn" and self.page_write.kernel is None:
      _log.log(level, "decode steps write fp8 pages in XLA (nine small kernels a layer): %s", self.page_write.why)

  def table(self) -> str:
    """What runs and why, one row each."""
    mesh = f"seq={self.run.seq} x tensor={self.run.tensor}" + (f", KV heads repeated x{self.kv_rep}"
                                                               if self.kv_rep > 1 else "")
    rows = [("devices", f"{mesh} ({self.mesh.devices.flat[0].platform})"),
            ("dtypes", f"{self.run.dtype} activations, {self.weights.name or self.run.dtype} weights, "
                       f"{self.cache_dtype} KV cache"),
            ("attention", f"{self.attention.name} (attention={self.run.attention!r}, "
                          f"attention_dtype={self.run.attention_dtype!r})"),
            ("prefill over pages", f"{self.prefill.name}: {self.prefill.why}"),
            ("decode attention", f"{self.decode.name}: {self.decode.why}"),
            ("fp8 products, decode", f"{self.linear.name}: {self.linear.why}"),
            ("fp8 page write", f"{self.page_write.name}: {self.page_write.why}"),
            ("speculation", f"{self.draft.name}: {self.draft.why}")]
    w = max(len(k) for k, _ in rows)
    return "what runs\n" + "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _decode_choice(attention, serving_cfg: ModelConfig, run: RunConfig) -> Choice:
  pick = getattr(attention, "decode_kernel", None)
  if pick is None:
    return Choice(attention.name, f"the {attention.name} backend's own paged attention")
  rows = serving_cfg.n_heads // serving_cfg.n_kv_heads
  name = pick(head_dim=serving_cfg.head_dim, page_size=run.page_size, rows=rows,
              page_dtype=run.resolved_cache_dtype, dtype=run.dtype)
  if name == "mosaic":
    asked = "asked for by decode_kernel='mosaic'" if run.decode_kernel == "mosaic" else "decode_kernel='auto' on Hopper"
    return Choice(name, f"the Mosaic GPU paged decode kernel and split combine (lcjax.ops.mosaic_gpu.paged, "
                        f".combine), {asked}")
  if name == "triton-interpret":
    return Choice(name, "the Triton paged decode kernel (lcjax.ops.triton.paged) in the Pallas interpreter: its "
                        "arithmetic, none of its speed")
  if name == "triton" and run.decode_kernel == "triton":
    return Choice(name, "the Triton paged decode kernel (lcjax.ops.triton.paged), asked for by "
                        "decode_kernel='triton'")
  if name == "triton" and getattr(attention, "fp8_decode", None):
    return Choice(name, f"the Triton fp8 paged decode kernel (lcjax.ops.triton.paged; K and V widened to float16 in "
                        f"the kernel): the {attention.name} backend reads no fp8 pages in a decode row")
  if name == "triton":
    reason = attention.mosaic_decode_reason(head_dim=serving_cfg.head_dim, page_size=run.page_size, rows=rows,
                                            page_dtype=run.resolved_cache_dtype, dtype=run.dtype)
    return Choice(name, f"the Triton paged decode kernel (lcjax.ops.triton.paged): {reason}")
  if name == "reference":
    why = attention.decode_reason(page_dtype=run.resolved_cache_dtype)
    if hasattr(attention, "fp8_decode") and run.resolved_cache_dtype == "float8_e4m3fn":
      why += f", and {kernels.TritonFp8Decode().why_not(run.page_size, serving_cfg.head_dim)}"
    return Choice(name, f"the jnp reference, slow: {why}")
  return Choice(name, f"the {name} backend's paged decode")


def _decode_route(attention, serving_cfg: ModelConfig, run: RunConfig):
  """The attention backend with RunConfig.decode_kernel's route, or a one-line ConfigError where the route cannot
  serve: a backend with no choice of decode kernels, or Mosaic GPU kernels that cannot read these decode rows
  (a verify step's k + 1 tokens included). Under "auto", pages that neither decode kernel reads are refused too."""
  ask = run.decode_kernel
  G = serving_cfg.n_heads // serving_cfg.n_kv_heads
  tokens = run.draft_tokens + 1 if run.draft != "off" else 1
  if ask == "auto":
    # Steps of more rows than the decode kernels take run as prefill chunks: no decode kernel reads their pages.
    if hasattr(attention, "decode_route") and tokens * G <= attention.max_decode_rows:
      shape = dict(head_dim=serving_cfg.head_dim, page_size=run.page_size, rows=tokens * G,
                   page_dtype=run.resolved_cache_dtype, dtype=run.dtype)
      no_triton = attention.route_reason("triton", **shape)
      if attention.decode_kernel(**shape) in ("triton", "triton-interpret") and no_triton:
        raise ConfigError(f"page_size={run.page_size}: neither decode kernel of the {attention.name} backend reads "
                          f"these pages (Mosaic GPU: {attention.mosaic_decode_reason(**shape)}; Triton: {no_triton})")
    return attention
  if not hasattr(attention, "decode_route"):
    chosen = f"attention={run.attention!r} runs the {attention.name} backend" if run.attention == "auto" else \
        f"attention={attention.name!r}"
    raise ConfigError(f"decode_kernel={ask!r} picks among the pallas backend's decode kernels, and {chosen}, "
                      "which decodes with its own kernel: leave decode_kernel='auto'")
  top = attention.max_decode_rows
  if tokens * G > top:
    raise ConfigError(f"decode_kernel={ask!r}: a verify step's {tokens} tokens x {G} query heads a kv head are "
                      f"{tokens * G} rows, past the decode kernels' {top} (more run as a prefill chunk): lower "
                      f"draft_tokens={run.draft_tokens}")
  reason = attention.route_reason(ask, head_dim=serving_cfg.head_dim, page_size=run.page_size, rows=tokens * G,
                                  page_dtype=run.resolved_cache_dtype, dtype=run.dtype)
  if reason:
    raise ConfigError(f"decode_kernel={ask!r}: {reason}")
  return dataclasses.replace(attention, decode_route=ask)


def _fp8_decode_kernel(attention, serving_cfg: ModelConfig, run: RunConfig):
  """The attention backend with the Triton fp8 decode kernel for decode rows over fp8 pages where the backend
  reads none itself (cuDNN: `auto` on GPUs without the Mosaic GPU kernels) and the kernel serves; else as given
  (the table then names the jnp reference and why)."""
  if not hasattr(attention, "fp8_decode") or run.resolved_cache_dtype != "float8_e4m3fn":
    return attention
  kernel = kernels.TritonFp8Decode()
  if kernel.why_not(run.page_size, serving_cfg.head_dim):
    return attention
  return dataclasses.replace(attention, fp8_decode=kernel)


def _prefill_route(attention, serving_cfg: ModelConfig, run: RunConfig):
  """The attention backend with RunConfig.prefill_kernel's route, or a one-line ConfigError where the route cannot
  serve: FP8 attention (its own kernel reads the prefix), a backend that reads the pages with another kernel,
  pages the Mosaic GPU kernel cannot read here. "auto" takes "mosaic" on the pallas backend where
  `_prefill_auto_reason` allows, else keeps what the backend reads the pages with."""
  ask = run.prefill_kernel
  if ask == "auto":
    if attention.name != "pallas" or _prefill_auto_reason(attention, serving_cfg, run):
      return attention
    return dataclasses.replace(attention, prefill_route="mosaic")
  if run.attention_dtype != "auto":
    raise ConfigError(f"prefill_kernel={ask!r}: attention_dtype={run.attention_dtype!r} reads the cached prefix with "
                      "the FP8 flash kernel: leave prefill_kernel='auto'")
  if ask == "cudnn" and attention.name == "cudnn":
    return attention
  if not hasattr(attention, "prefill_route"):
    raise ConfigError(f"prefill_kernel={ask!r} picks what reads the pages on the pallas and cudnn backends, and the "
                      f"{attention.name} backend reads them with its own: leave prefill_kernel='auto'")
  if ask == "mosaic":
    reason = _prefill_reason(attention, serving_cfg, run)
    if reason:
      raise ConfigError(f"prefill_kernel='mosaic': {reason}")
  return dataclasses.replace(attention, prefill_route=ask)


def _prefill_reason(attention, serving_cfg: ModelConfig, run: RunConfig) -> str | None:
  """Why the pallas backend's paged flash kernel cannot read this run's pages (None: it can)."""
  return attention.prefill_reason(head_dim=serving_cfg.head_dim, page_size=run.page_size,
                                  page_dtype=run.resolved_cache_dtype, dtype=run.dtype)


# The smallest page prefill_kernel="auto" reads with the paged flash kernel: pages of 64 tokens were timed (8-19%
# faster than cuDNN's paged kernel on the H200, benchmarks/results/attention.md, part attention-chunk-paged-h200),
# two TMA copies a 128-key block; larger pages take one, smaller ones four or more and were not timed.
PAGED_FLASH_AUTO_MIN_PAGE = 64


def _prefill_auto_reason(attention, serving_cfg: ModelConfig, run: RunConfig) -> str | None:
  """Why prefill_kernel="auto" does not take the pallas backend's paged flash kernel for this run (None: it
  does): the kernel cannot read the pages, or they are of a kind it was not timed on (float16, small pages)."""
  reason = _prefill_reason(attention, serving_cfg, run)
  if reason:
    return reason
  if run.resolved_cache_dtype != "bfloat16":
    return f"'auto' takes it over bfloat16 pages, which it was timed on, not {run.resolved_cache_dtype}"
  if run.page_size < PAGED_FLASH_AUTO_MIN_PAGE:
    return (f"'auto' takes it at pages of {PAGED_FLASH_AUTO_MIN_PAGE} tokens or more, which it was timed on; "
            f"page_size={run.page_size}")
  return None


def _prefill_choice(attention, serving_cfg: ModelConfig, run: RunConfig) -> Choice:
  """What reads a prefill chunk's keys from the pages, and why."""
  fp8_pages = run.resolved_cache_dtype == "float8_e4m3fn"
  if getattr(attention, "prefill_route", None) == "mosaic":
    asked = "asked for by prefill_kernel='mosaic'" if run.prefill_kernel == "mosaic" else \
        "prefill_kernel='auto' on Hopper over bf16 pages of 64 tokens or more"
    return Choice("mosaic", "the Mosaic GPU flash kernel reading K and V where they lie "
                            f"(lcjax.ops.mosaic_gpu.flash.flash_attention_paged), {asked}")
  if hasattr(attention, "prefix_kernel"):
    how, reason = attention.prefix_kernel(head_dim=serving_cfg.head_dim, page_size=run.page_size,
                                          page_dtype=run.resolved_cache_dtype)
    if how == "in-place":
      return Choice(f"{attention.name}-in-place", "the FP8 flash kernel reading the fp8 K pages where they lie, with "
                                                  "their page scales (V's bytes copied transposed per call; "
                                                  "lcjax.ops.mosaic_gpu.flash.flash_attention_fp8_paged)")
    return Choice(f"{attention.name}-gather", "the FP8 flash kernel over the cached prefix gathered, dequantized and "
                                              f"quantized again in blocks of PREFIX_BLOCK_TOKENS keys ({reason})")
  if attention.name in ("pallas", "cudnn"):
    over = " over the pages dequantized to bf16 in blocks" if fp8_pages else ""
    why = ""
    if attention.name == "pallas" and run.prefill_kernel == "auto":
      why = f" (not the Mosaic GPU paged flash kernel: {_prefill_auto_reason(attention, serving_cfg, run)})"
    return Choice("cudnn", f"cuDNN's paged flash kernel{over}{why}")
  return Choice(attention.name, f"the {attention.name} backend's own paged attention")


def _draft_choice(run: RunConfig) -> Choice:
  if run.draft == "off":
    return Choice("off", "draft='off' (one token a decode step)")
  return Choice(run.draft, f"up to {run.draft_tokens} drafts a step after the last {run.draft_ngram} tokens' most "
                           "recent earlier occurrence in the sequence (lcjax.engine.speculate)")


def resolve(model_cfg: ModelConfig, run: RunConfig, *, weights: WeightFormat = WeightFormat(), mesh=None,
            check_fit: bool = True) -> Serving:
  """The Serving of `model_cfg` under `run`, its linear weights stored as `weights` (WeightFormat() for the
  parameter dtype; RunConfig.weight_dtype converts them). mesh: the devices (default: the first seq x tensor).
  check_fit: refuse (ConfigError) a memory plan the devices cannot hold. Raises a one-line ConfigError for a run
  that cannot serve the model."""
  run = run.for_platform(jax.default_backend())
  mesh = placement.mesh_for(run, mesh)
  check_context_length(model_cfg, run)
  serving_cfg, rep = placement.serving_config(model_cfg, run)
  weights = weights.for_run(run.weight_dtype)
  try:
    attention = get_backend(run.attention, head_dim=model_cfg.head_dim, dtype=run.dtype,
                            attention_dtype=run.attention_dtype)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  attention = _fp8_decode_kernel(_decode_route(attention, serving_cfg, run), serving_cfg, run)
  attention = _prefill_route(attention, serving_cfg, run)
  name, why = placement.decode_linear(run, weights, placement.gemv_kernels_unsupported(serving_cfg, run.tensor))
  linear = Choice(name, why, kernels.gemv_kernel(name))
  name, why = placement.page_write(run, serving_cfg.head_dim)
  page_write = Choice(name, why, kernels.page_writer(name))
  rows = run.max_batch * (run.draft_tokens + 1)
  if run.draft != "off" and weights.fp8 and rows > WIDEN_MAX_ROWS:
    raise ConfigError(f"draft_tokens={run.draft_tokens} with max_batch={run.max_batch} feeds {rows} rows a verify "
                      f"step, past the {WIDEN_MAX_ROWS} rows fp8 weights multiply as decode does (more quantize the "
                      f"activations and change the tokens): lower draft_tokens or max_batch")
  plan = planlib.plan(model_cfg, run, weights=weights)
  serving = Serving(model_cfg, run, mesh, serving_cfg, rep, weights, attention,
                    _decode_choice(attention, serving_cfg, run), _prefill_choice(attention, serving_cfg, run), linear,
                    page_write, _draft_choice(run), plan, Limits.of(model_cfg, run, plan.num_pages))
  if check_fit:
    serving.require_fit()
  return serving
