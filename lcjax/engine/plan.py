"""The memory and communication plan: what each device holds and moves, before anything is allocated.

Numbers are per device of a mesh of `tensor` x `seq` devices, and exact for the state the engine allocates (the
tests compare them with the shards of the real arrays and with `jax.eval_shape` of full-size presets):
  weights      heads, KV heads, MLP and vocab split over `tensor` (norms replicated); weights are replicated over
               `seq`. KV projections count the replicated KV heads when there are fewer of them than `tensor`.
  KV cache     the page pool split over `seq` (P / seq pages, each shard with its own null page) and its KV heads
               over `tensor`: kv_heads * rep / tensor heads per device, rep = the minimal KV-head replication.
  activations  an estimate of the largest transient: one prefill chunk of one layer (the scan keeps one layer
               live), its gathered K/V and queries for the sequence-sharded cache, the block of prefix pages
               an fp8 cache dequantizes at a time for one layer (or, under 8-bit attention, the block it
               gathers and quantizes or whose V it transposes to read the pages in place), and the last logits.
The communication model counts, per layer of one prefill chunk, the bytes each device sends: the K/V block of
every ring step (`lax.ppermute`), against the attention FLOPs of that step; the ring hides its transfers when a
step computes longer than it sends, i.e. when a device's block is longer than about
  kv_heads_local * itemsize * peak_flops / (heads_local * link_bandwidth)   tokens
(a few hundred tokens for GQA at 8:1 on NVLink, a few thousand without GQA). Hardware numbers default to an
H100/H200 SXM class GPU: NVLink ~450 GB/s per direction per GPU, ~600 TFLOP/s bf16 achieved.
"""
from __future__ import annotations

import dataclasses
import math

from lcjax.config import ATTENTION_DTYPES, ConfigError, ModelConfig, RunConfig, WeightFormat, preset
from lcjax.ops.cudnn.backend import FP8_BLOCK_TOKENS
from lcjax.ops.pallas_backend import PREFIX_BLOCK_TOKENS, prefix_reason
from lcjax.engine.scheduler import chunk_bucket
from lcjax.ops.ring import zigzag_length

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Hardware:
  link_bytes_per_s: float = 450e9     # NVLink, per direction per GPU
  flops_per_s: float = 600e12         # dense bf16 attention, achieved


H200 = Hardware()


def kv_replication(n_kv_heads: int, tensor: int) -> int:
  """Minimal repetition of each KV head so that tensor | n_kv_heads * rep (as lcjax.sharding.kv_head_replication,
  without its head-count checks, so a plan can be printed for any layout)."""
  return tensor // math.gcd(n_kv_heads, tensor)


@dataclasses.dataclass(frozen=True)
class CommPlan:
  """Per device, per layer of one prefill chunk (bytes) and per ring step."""
  block_tokens: int           # queries (and keys per ring step) a device holds: the chunk padded to a multiple of
                              # 2 * seq (the model's split layout), / seq
  ring_steps: int             # seq - 1 transfers per layer
  ring_step_bytes: int        # one K/V block sent to the next device
  ring_step_flops: float      # causal attention work of one step (zigzag: half of a full block pair)
  ring_step_comm_s: float
  ring_step_compute_s: float
  overlap_block_tokens: int   # block length from which compute hides the transfer
  kv_gather_bytes: int        # the chunk's K/V all-gathered for the page owners' writes
  prefix_bytes: int           # queries all-gathered + float32 partials reduce-scattered (cached-prefix part)
  tensor_allreduce_bytes: int # the two per-layer all-reduces of the tensor-parallel projections

  @property
  def overlaps(self) -> bool:
    return self.ring_steps == 0 or self.ring_step_compute_s >= self.ring_step_comm_s


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  weights: int
  kv_cache: int
  activations: int
  workspace: int
  kv_replication: int
  num_pages: int              # P, all shards, null pages included
  tokens_capacity: int        # tokens of KV the pool holds (all shards)
  devices: int
  tensor: int = 1
  seq: int = 1
  pages_per_device: int = 0
  kv_heads_per_device: int = 0
  comm: CommPlan | None = None
  host_cache: int = 0         # host memory (whole process) for cached pages evicted from the devices
  host_cache_tokens: int = 0  # tokens of KV that fit in it
  weight_dtype: str = ""      # the linear weights' format (WeightFormat.describe)

  @property
  def total(self) -> int:
    return self.weights + self.kv_cache + self.activations + self.workspace

  def fits(self, device_bytes: float) -> bool:
    return self.total <= device_bytes

  def rows(self):
    return [("weights", self.weights), ("KV cache", self.kv_cache), ("activations", self.activations),
            ("workspace", self.workspace), ("total", self.total)]

  def table(self, measured_peak: int | None = None) -> str:
    head = (f"memory plan per device ({self.devices} device(s): tensor={self.tensor} x seq={self.seq}; "
            f"{self.num_pages} pages, {self.pages_per_device} per device, {self.tokens_capacity:,} tokens of KV, "
            f"{self.kv_heads_per_device} KV head(s) per device"
            + (f", KV heads replicated x{self.kv_replication}" if self.kv_replication > 1 else "") + ")")
    lines = [head]
    for name, b in self.rows():
      lines.append(f"  {name:<12} {b / GiB:9.3f} GiB" + (f" ({self.weight_dtype})" if name == "weights" and
                                                         self.weight_dtype else ""))
    if measured_peak is not None:
      lines.append(f"  {'measured':<12} {measured_peak / GiB:9.3f} GiB (peak)")
    if self.host_cache:
      lines.append(f"  {'host tier':<12} {self.host_cache / GiB:9.3f} GiB of host memory for evicted cached pages "
                   f"({self.host_cache_tokens:,} tokens of KV)")
    c = self.comm
    if c is not None and self.devices > 1:
      lines.append(f"  per layer of a chunk: ring {c.ring_steps} x {c.ring_step_bytes / 2**20:.2f} MiB "
                   f"({c.ring_step_comm_s * 1e6:.1f} us send vs {c.ring_step_compute_s * 1e6:.1f} us compute per "
                   f"step: {'hidden' if c.overlaps else 'NOT hidden'}; hides from {c.overlap_block_tokens:,}-token "
                   f"blocks), K/V gather {c.kv_gather_bytes / 2**20:.2f} MiB, prefix "
                   f"{c.prefix_bytes / 2**20:.2f} MiB, tensor all-reduce {c.tensor_allreduce_bytes / 2**20:.2f} MiB")
    return "\n".join(lines)


def pages_per_shard(model: ModelConfig, run: RunConfig) -> int:
  """Pages each seq shard holds, its null page included. By default every one of max_batch sequences of
  max_context tokens fits: slot m of a table lives on shard m % seq, so a shard holds ceil(M / seq) of a
  sequence's M pages."""
  S = run.seq
  if run.num_pages:
    return max(2, -(-run.num_pages // S))
  per_seq = -(-math.ceil(run.context_for(model) / run.page_size) // S)
  return run.max_batch * per_seq + 1


def weight_bytes_per_device(model: ModelConfig, tensor: int, itemsize: int,
                            weights: WeightFormat = WeightFormat()) -> int:
  """Parameters per device: everything with a heads / kv_heads / mlp / vocab axis split over tensor. fp8 linear
  weights take one byte an element plus a float32 scale per output channel (wo's and w_down's, along D,
  replicated) and, with static input scales, four float32 per layer."""
  D, F, V, L, H = model.dim, model.ffn_dim, model.vocab_size, model.n_layers, model.head_dim
  K = model.n_kv_heads * kv_replication(model.n_kv_heads, tensor)
  T = tensor
  linear = D * model.n_heads * H // T * 2 + D * K * H // T * 2 + 3 * D * F // T
  head = 0 if model.tie_embeddings else D * V // T
  other = (V * D // T + L * 2 * D + D + head) * itemsize
  if not weights.fp8:
    return other + L * linear * itemsize
  scales = (model.n_heads * H // T + 2 * K * H // T + 2 * F // T + 2 * D) * 4 + (16 if weights.static_inputs else 0)
  return other + L * (linear + scales)


def _chunk_tokens(model: ModelConfig, run: RunConfig) -> int:
  """Rows of the largest prefill chunk the model runs: a chunk of at most prefill_chunk tokens and the context,
  padded to its bucket (Scheduler.prefill's chunk_bucket) and then to the split layout over seq."""
  return zigzag_length(chunk_bucket(min(run.prefill_chunk, run.context_for(model)), run.prefill_chunk), run.seq)


def comm_plan(model: ModelConfig, run: RunConfig, hw: Hardware = H200, *, batch: int = 1) -> CommPlan:
  run = _concrete(run)
  T, S = run.tensor, run.seq
  item = _ITEMSIZE[run.dtype]
  H = model.head_dim
  N_l = model.n_heads // T if model.n_heads % T == 0 else -(-model.n_heads // T)
  K_l = model.n_kv_heads * kv_replication(model.n_kv_heads, T) // T
  C = _chunk_tokens(model, run)
  c = C // S                                        # a device's block
  step_bytes = batch * 2 * c * K_l * H * item
  # A zigzag ring step pairs two query half-blocks with two key half-blocks; two of the four pairs are live
  # (causal), each 4 * (c/2)^2 * N_l * H flops (scores and values): 2 * c^2 * N_l * H in all.
  step_flops = 2 * batch * c * c * N_l * H
  comm_s = step_bytes / hw.link_bytes_per_s
  compute_s = step_flops / hw.flops_per_s
  overlap = math.ceil(K_l * item * hw.flops_per_s / (N_l * hw.link_bytes_per_s))
  frac = (S - 1) / S
  gather = int(batch * 2 * C * K_l * H * item * frac)
  prefix = int(batch * C * N_l * H * (item + 4) * frac)
  allreduce = int(2 * batch * c * model.dim * item * 2 * (T - 1) / T)
  return CommPlan(c, S - 1, step_bytes, step_flops, comm_s, compute_s, overlap, gather if S > 1 else 0,
                  prefix if S > 1 else 0, allreduce)


def prefill_flops(model: ModelConfig, S: int) -> float:
  """Matmul FLOPs of a causal prefill of S tokens with the logits of the last position only: the projections
  and MLP (2 per multiply-add) plus QK^T and PV over the causal half of the score matrix."""
  per_layer = model.dim * model.head_dim * (2 * model.n_heads + 2 * model.n_kv_heads) + 3 * model.dim * model.ffn_dim
  linear = 2 * S * model.n_layers * per_layer + 2 * model.dim * model.vocab_size
  attention = 2 * S * S * model.n_heads * model.head_dim * model.n_layers
  return linear + attention


def _concrete(run: RunConfig) -> RunConfig:
  """dtype="auto" resolved for the platform JAX runs on."""
  if run.dtype != "auto":
    return run
  import jax
  return run.for_platform(jax.default_backend())


def plan(model: ModelConfig, run: RunConfig, *, batch: int = 1, hw: Hardware = H200,
         weights: WeightFormat | None = None) -> MemoryPlan:
  """weights: the format the linear weights are served in (default: what run.weight_dtype asks of a checkpoint
  in run.dtype)."""
  run = _concrete(run)
  T, S = run.tensor, run.seq
  w_item = _ITEMSIZE[run.dtype]
  rep = kv_replication(model.n_kv_heads, T)
  K_l = model.n_kv_heads * rep // T
  fmt = weights if weights is not None else WeightFormat().for_run(run.weight_dtype)
  weights = weight_bytes_per_device(model, T, w_item, fmt)
  Pl = pages_per_shard(model, run)
  c_item = _ITEMSIZE[run.resolved_cache_dtype]
  kv = 2 * model.n_layers * Pl * run.page_size * K_l * model.head_dim * c_item
  if run.resolved_cache_dtype == "float8_e4m3fn":
    kv += 2 * model.n_layers * Pl * K_l * 4         # per (layer, page, kv head) float32 scales
  # One prefill chunk of one layer, counted in elements per chunk token of this device's block:
  #   attention  x, h (2D); q, o (2 N_l H); k, v (2 K_l H); the float32 chunk-vs-itself and chunk-vs-prefix
  #              partials and their float32 merge (6 N_l H in w_item units)
  #   MLP        x, h, out (3D); gate, up, silu(gate) * up (3 F_l)
  #   scan carry the next layer's input (D)
  # XLA keeps both phases' buffers live at once: summing them matched the measured peak on the H200 (Llama-3-8B
  # shape: 6.25 GiB of activations at a 32K chunk; Llama-3.1-70B shape: 12.4 GiB) where the larger phase
  # alone was 35-45% short (benchmarks/NOTES-longctx.md). Plus, over seq, the chunk's K/V and queries gathered,
  # the float32 prefix partial and the ring's two K/V buffers; and the float32 logits of the last position.
  C = _chunk_tokens(model, run) * batch
  c = C // S
  D, F, H = model.dim, model.ffn_dim, model.head_dim
  N_l = -(-model.n_heads // T)
  per_token = (6 * D + 8 * N_l * H + 2 * K_l * H + 3 * -(-F // T)) * w_item
  gathered = 0 if S == 1 else C * (2 * K_l * H * w_item + N_l * H * (w_item + 4)) + 2 * 2 * c * K_l * H * w_item
  # An fp8 cache: a chunk (one sequence: the engine prefills one request at a time) reads its prefix through
  # one layer's table pages dequantized to the activation dtype (lcjax.ops.cudnn.backend.dequantize_pages), K and V of
  # up to FP8_BLOCK_TOKENS table slots on this device at a time; a longer prefix adds the float32 accumulator of
  # the blocks' merge. Counted for every backend: the reference needs less (an overestimate).
  dequant = 0
  if run.resolved_cache_dtype == "float8_e4m3fn":
    local = -(-run.context_for(model) // S)
    dequant = 2 * min(local, FP8_BLOCK_TOKENS) * K_l * H * w_item
    if local > FP8_BLOCK_TOKENS:
      dequant += C * N_l * (H + 1) * 4
  if run.attention_dtype != "auto":
    # 8-bit attention reads the prefix itself (lcjax.ops.pallas_backend.PallasFp8Backend), a block of up to
    # PREFIX_BLOCK_TOKENS table slots at a time: over fp8 pages it reads in place, V's bytes gathered and
    # transposed (two bytes an element); else K and V gathered in the activation dtype, K smoothed and rotated,
    # both quantized to one byte an element (e4m3, or int8 for K). The chunk's queries padded and quantized; a
    # longer prefix adds the blocks' float32 merge.
    local = -(-run.context_for(model) // S)
    W = min(local, PREFIX_BLOCK_TOKENS)
    in_place = prefix_reason(qk_dtype=ATTENTION_DTYPES[run.attention_dtype], head_dim=H, page_size=run.page_size,
                             page_dtype=run.resolved_cache_dtype) is None
    # The backend's other branch (PallasBackend's paged path) is compiled beside it: the larger of the two
    dequant = max(dequant, W * K_l * H * (2 if in_place else 3 * w_item + 2) + C * N_l * H * (w_item + 1))
    if local > W:
      dequant += C * N_l * (H + 1) * 4
  act = c * per_token + gathered + dequant + batch * model.vocab_size * 4
  workspace = 256 * 1024 ** 2
  return MemoryPlan(weights, kv, act, workspace, rep, S * Pl, S * (Pl - 1) * run.page_size, T * S, T, S, Pl,
                    K_l, comm_plan(model, run, hw, batch=batch),
                    *_host_tier(model, run, rep, c_item, run.resolved_cache_dtype == "float8_e4m3fn"),
                    weight_dtype=fmt.describe(run.dtype))


def _host_tier(model: ModelConfig, run: RunConfig, rep: int, item: int, fp8: bool) -> tuple[int, int]:
  """(bytes, tokens) of the host tier: whole pages of every layer and (repeated) KV head, fp8 pages with their
  float32 scales."""
  if not run.host_cache_gib:
    return 0, 0
  nbytes = int(run.host_cache_gib * GiB)
  Z = run.page_size
  page = 2 * model.n_layers * model.n_kv_heads * rep * (Z * model.head_dim * item + (4 if fp8 else 0))
  return nbytes, nbytes // page * Z


def require_fit(p: MemoryPlan, model: ModelConfig, run: RunConfig, device_bytes: int, device: str) -> None:
  """Refuse, before anything is allocated, a run whose plan needs more than `device_bytes` per device."""
  if p.total <= device_bytes:
    return
  what = (f"num_pages={run.num_pages}" if run.num_pages else
          f"max_context={run.context_for(model)} x max_batch={run.max_batch}")
  raise ConfigError(f"{what} does not fit: the memory plan needs {p.total / GiB:.2f} GiB per device (KV cache "
                    f"{p.kv_cache / GiB:.2f} GiB for {p.tokens_capacity:,} tokens, weights {p.weights / GiB:.2f} GiB) "
                    f"but {device} has {device_bytes / GiB:.2f} GiB: lower it, or use a float8 cache "
                    "(cache_dtype=float8_e4m3fn) or more devices (seq, tensor)")


def compare(model: ModelConfig, contexts, meshes, device_gib, *, base: RunConfig | None = None,
            hw: Hardware = H200, usable: float = 0.95) -> str:
  """A table of per-device plans of `model` for each context and (tensor, seq) mesh, and which fit on devices of
  each size in `device_gib` (GB as sold: 80 and 141 mean 80e9 and 141e9 bytes), of which `usable` is given to
  JAX (XLA_PYTHON_CLIENT_MEM_FRACTION; its default is 0.75)."""
  base = base or RunConfig(dtype="bfloat16", max_batch=1, page_size=256, prefill_chunk=16384)
  head = (f"{'context':>9} {'tensor x seq':>12} {'KV rep':>6} {'weights':>8} {'KV':>8} {'act':>7} {'total':>8}  "
          + "  ".join(f"{g:>4g} GB" for g in device_gib) + "   ring step: send / compute (us), hidden")
  lines = [f"{model.name}: per-device GiB; fits = total <= {usable:g} x device memory", head]
  for ctx in contexts:
    for T, S in meshes:
      p = plan(model, base.replace(max_context=ctx, tensor=T, seq=S), hw=hw)
      fit = "  ".join(f"{'fits' if p.fits(usable * g * 1e9) else 'no':>7}" for g in device_gib)
      c = p.comm
      ring = (f"{c.ring_step_comm_s * 1e6:7.1f} / {c.ring_step_compute_s * 1e6:7.1f}, "
              f"{'yes' if c.overlaps else 'no'}") if S > 1 else "   (no ring)"
      lines.append(f"{ctx:>9,} {f'{T} x {S}':>12} {p.kv_replication:>6} {p.weights / GiB:8.2f} "
                   f"{p.kv_cache / GiB:8.2f} {p.activations / GiB:7.2f} {p.total / GiB:8.2f}  {fit}   {ring}")
  return "\n".join(lines)


def main(argv) -> None:
  """python -m lcjax.engine.plan [--preset=...] [--contexts=...] [--meshes=TxS,...] [--device_gb=...]"""
  from absl import app, flags
  if len(argv) > 1:
    raise app.UsageError(f"unexpected argument(s) {argv[1:]}: flags are written --name=value")
  F = flags.FLAGS

  def numbers(flag, kind):
    try:
      return [kind(x) for x in F[flag].value]
    except ValueError:
      raise app.UsageError(f"--{flag}={','.join(F[flag].value)}: give {kind.__name__} values") from None

  try:
    meshes = [tuple(int(x) for x in m.split("x")) for m in F.meshes]
    if any(len(m) != 2 or min(m) < 1 for m in meshes):
      raise ValueError
  except ValueError:
    raise app.UsageError(f"--meshes={','.join(F.meshes)}: give tensor x seq sizes as 8x1,4x2") from None
  contexts, device_gb = numbers("contexts", int), numbers("device_gb", float)
  if not 0 < F.usable <= 1:
    raise app.UsageError(f"--usable={F.usable} must be in (0, 1]")
  try:
    model = preset(F.preset)
    base = RunConfig(dtype=F.dtype, cache_dtype=F.cache_dtype, weight_dtype=F.weight_dtype, max_batch=F.max_batch,
                     page_size=F.page_size, prefill_chunk=F.prefill_chunk, allow_beyond_trained_context=True)
    print(compare(model, contexts, meshes, device_gb, base=base, usable=F.usable))
  except ConfigError as e:
    raise app.UsageError(str(e)) from None


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("preset", "llama3.1-70b", "the model (lcjax.config.preset)")
  flags.DEFINE_list("contexts", ["524288", "1048576"], "max_context values, in tokens")
  flags.DEFINE_list("meshes", ["8x1", "4x2", "2x4"], "tensor x seq meshes")
  flags.DEFINE_list("device_gb", ["80", "141"], "device memory in GB as sold (80e9, 141e9 bytes)")
  flags.DEFINE_float("usable", 0.95, "the share of device memory given to JAX (XLA_PYTHON_CLIENT_MEM_FRACTION; "
                     "JAX's default is 0.75)")
  flags.DEFINE_string("dtype", "bfloat16", "activations (RunConfig.dtype)")
  flags.DEFINE_string("cache_dtype", "auto", "RunConfig.cache_dtype")
  flags.DEFINE_string("weight_dtype", "auto", "RunConfig.weight_dtype")
  flags.DEFINE_integer("max_batch", 1, "sequences of max_context tokens the cache holds")
  flags.DEFINE_integer("page_size", 256, "RunConfig.page_size")
  flags.DEFINE_integer("prefill_chunk", 16384, "RunConfig.prefill_chunk")
  app.run(main)
