"""Where things live on devices: the mesh, each device's memory, and the shardings of the parameters.

The engine serves the checkpoint's model with its KV heads repeated when `tensor` does not divide them
(`lcjax.sharding.kv_head_replication`): the *serving model* (`serving_config`, `serving_model`) computes the same
function with K * rep KV heads, which split evenly over `tensor`, and its cache holds that many heads. A
checkpoint-shaped parameter state is first placed with `checkpoint_shardings` (wqkv split along D while its heads
are still to be repeated) and then turned into the serving model's layout by `place_params`.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lcjax import sharding as sh
from lcjax.config import ConfigError, ModelConfig, RunConfig, WeightFormat
from lcjax.model.llama import Llama, check_mesh, linear_shapes, product_dims, repeat_kv_heads
from lcjax.ops import hardware, kernels


def mesh_for(run: RunConfig, mesh=None) -> jax.sharding.Mesh:
  """The ("seq", "tensor") mesh of the run config (a given `mesh` must match its sizes)."""
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


def serving_config(model_cfg: ModelConfig, run: RunConfig) -> tuple[ModelConfig, int]:
  """(the serving model's config, KV-head repetition): KV heads repeated so they split over `tensor` (the same
  function of the same weights). ConfigError when the heads cannot split over the mesh."""
  rep = kv_replication_for(model_cfg, run.tensor)
  serving = dataclasses.replace(model_cfg, n_kv_heads=model_cfg.n_kv_heads * rep)
  try:
    check_mesh(serving, run.tensor, run.seq, run.sp_mode)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return serving, rep


def gemv_kernels_unsupported(cfg: ModelConfig, tensor: int = 1) -> dict[str, str | None]:
  """Why each compiled fp8 GEMV kernel (lcjax.ops.kernels.GEMV_KERNELS, not interpreted) cannot serve cfg's
  products on this machine (None: it can), by name, in the order "auto" prefers them: "mosaic"
  (lcjax.ops.mosaic_gpu.gemv, Hopper), "pallas" (lcjax.ops.triton.gemv, sm_89+). On a mesh of `tensor` devices
  each runs the kernel on its shard of every weight: the shapes checked are the shards'."""
  dims = {name.split("/")[-1]: product_dims(name, shape) for name, shape in linear_shapes(cfg, tensor).items()}
  return {name: k.why_not(dims) for name, k in kernels.GEMV_KERNELS.items() if not k.interpret}


def decode_linear(run: RunConfig, weights: WeightFormat, no_kernel: dict[str, str | None]) -> tuple[str, str]:
  """(the name of Llama's gemv_kernel for RunConfig.linear_kernel, a name of lcjax.config.GEMV_NAMES; why): what
  multiplies fp8 weights in decode-sized calls, on one device or on each device of a mesh (Llama._gemv_mesh).
  no_kernel: `gemv_kernels_unsupported()` for the run's tensor size. A kernel asked for by name that cannot serve
  raises ConfigError; "auto" takes the first kernel that can ("mosaic", then "pallas"), else "xla", and says why
  (each reason once)."""
  ask = run.linear_kernel
  if not weights.fp8:
    if ask not in ("auto", "xla"):
      raise ConfigError(f"linear_kernel={ask!r} multiplies fp8 weights, and these are {run.dtype} "
                        f"(weight_dtype={run.weight_dtype!r})")
    return "xla", "the weights are not fp8"
  if ask in kernels.GEMV_KERNELS and ask not in no_kernel:      # interpreted: any shape, but not without its lowering
    no_kernel = {**no_kernel, ask: kernels.GEMV_KERNELS[ask].why_not({})}
  if no_kernel.get(ask):
    raise ConfigError(f"linear_kernel={ask!r}: {no_kernel[ask]}{_interpreter_hint(ask)}")
  if ask == "auto":
    passed = []                       # why "auto" did not take the kernels it prefers to the one it takes
    for kernel, why_not in no_kernel.items():
      if not why_not:
        return kernel, "; ".join(["linear_kernel='auto'", *dict.fromkeys(passed)])
      passed.append(why_not)
    return "xla", "linear_kernel='auto': " + "; ".join(dict.fromkeys(passed))
  return ask, f"linear_kernel={ask!r}"


def _interpreter_hint(ask: str) -> str:
  """A refused 'pallas' kernel's pointer to its interpreted twin, where this JAX has the Triton lowering both need."""
  return " ('pallas-interpret' runs it in the Pallas interpreter)" if ask == "pallas" and \
      not hardware.pallas_triton_reason() else ""


# The page writers "auto" tries, in order (lcjax.ops.kernels.PAGE_WRITERS' names); then XLA. The Mosaic GPU
# writer first (Hopper, JAX 0.11+: 1.9 us a call against the Triton writer's 2.1 on an H100, bit for bit the same
# bytes; benchmarks/NOTES-attention), the Triton writer where it cannot serve (GPUs that are not Hopper).
AUTO_PAGE_WRITERS = ("mosaic", "pallas")


def page_write(run: RunConfig, head_dim: int) -> tuple[str, str]:
  """(the name of Llama's page_writer for RunConfig.page_write, a name of lcjax.config.PAGE_WRITER_NAMES; why):
  what writes a decode step's K and V into the cache's pages (lcjax.cache.kv.write_kv). A kernel asked for by name
  that cannot serve raises ConfigError; "auto" takes the first of AUTO_PAGE_WRITERS that can serve, else "xla", and
  says why it passed over the ones before."""
  ask = run.page_write
  cache = run.for_platform(jax.default_backend()).resolved_cache_dtype
  if cache != "float8_e4m3fn":
    if ask not in ("auto", "xla"):
      raise ConfigError(f"page_write={ask!r} writes fp8 pages, and the cache holds {cache} "
                        f"(cache_dtype={run.cache_dtype!r})")
    return "xla", f"{cache} pages take one XLA scatter"
  if ask == "xla":
    return ask, "page_write='xla'"
  if ask != "auto":
    no_kernel = kernels.PAGE_WRITERS[ask].why_not(run.page_size, head_dim)
    if no_kernel:
      raise ConfigError(f"page_write={ask!r}: {no_kernel}{_interpreter_hint(ask)}")
    return ask, f"page_write={ask!r}"
  passed = []
  for name in AUTO_PAGE_WRITERS:
    no_kernel = kernels.PAGE_WRITERS[name].why_not(run.page_size, head_dim)
    if not no_kernel:
      return name, "; ".join(["page_write='auto'", *passed])
    passed.append(f"not {name}: {no_kernel}")
  return "xla", "; ".join(["page_write='auto'", *passed])


def serving_model(model_cfg: ModelConfig, run: RunConfig, mesh, attention=None, rngs=None,
                  weights: WeightFormat = WeightFormat(), gemv_kernel=None, page_writer=None) -> Llama:
  """The serving model (abstract under nnx.eval_shape): replicated KV heads, the mesh, sp_mode, the kernel of
  decode-sized fp8 products and of fp8 page writes (Llama's gemv_kernel and page_writer, lcjax.ops.kernels; None:
  XLA's ops; lcjax.engine.serving.resolve chooses them)."""
  serving, _ = serving_config(model_cfg, run)
  run = run.for_platform(jax.default_backend())
  return Llama(serving, dtype=jnp.dtype(run.dtype), attention=attention, mesh=mesh, sp_mode=run.sp_mode,
               weights=weights, gemv_kernel=gemv_kernel, page_writer=page_writer, rngs=rngs or nnx.Rngs(0))


def serving_shardings(model_cfg: ModelConfig, run: RunConfig, mesh, attention=None,
                      weights: WeightFormat = WeightFormat(), gemv_kernel=None, page_writer=None):
  """(graphdef, NamedSharding of every parameter) of the serving model on `mesh`, allocating nothing."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: serving_model(model_cfg, run, mesh, attention,
                                                                      weights=weights, gemv_kernel=gemv_kernel,
                                                                      page_writer=page_writer)),
                                 nnx.Param)
  return graphdef, sh.param_shardings(abstract, mesh)


def checkpoint_shardings(model_cfg: ModelConfig, mesh, dtype,
                         weights: WeightFormat = WeightFormat()) -> tuple[object, object]:
  """(abstract state, shardings) of a checkpoint-shaped parameter state on `mesh`: the logical-axis table,
  except when its KV heads do not split over `tensor` (they are repeated after placement): then wqkv, whose only
  tensor-split axis is the KV heads, is split along D instead, so no device holds all of it (query heads
  included: 13 GB for a 70B at tensor=16) while the engine repeats its heads, and D stays whole where `tensor`
  does not divide it."""
  T = mesh.shape[sh.TENSOR]
  rep = kv_replication_for(model_cfg, T)
  abstract = nnx.state(nnx.eval_shape(lambda: Llama(model_cfg, dtype=jnp.dtype(dtype), weights=weights,
                                                    rngs=nnx.Rngs(0))), nnx.Param)
  shardings = sh.param_shardings(abstract, mesh, replicate={"kv_heads"} if rep > 1 else set())
  if rep > 1 and model_cfg.dim % T == 0:
    wqkv = abstract["layers"]["attn"]["wqkv"]                 # [L, D, K, G + 2, H], or fp8 K-major [L, K, G + 2, H, D]
    d = list(wqkv.get_metadata()["axes"]).index("embed")
    shardings["layers"]["attn"]["wqkv"] = NamedSharding(mesh, PartitionSpec(*[None] * d, sh.TENSOR))
  return abstract, shardings


def place_params(params, model_cfg: ModelConfig, run: RunConfig, mesh, serving_param_shardings,
                 weights: WeightFormat = WeightFormat()):
  """A checkpoint-shaped state (host, one device, or placed by `checkpoint_shardings`) -> the serving model's
  parameters on `mesh`, KV heads repeated where `tensor` needs it."""
  _, ckpt = checkpoint_shardings(model_cfg, mesh, run.dtype, weights)
  params = jax.device_put(params, ckpt)            # a no-op for arrays already placed so
  rep = kv_replication_for(model_cfg, run.tensor)
  if rep == 1:
    return params
  repeat = jax.jit(lambda p: repeat_kv_heads(p, rep), out_shardings=serving_param_shardings)
  return repeat(params)
