"""The memory plan: weights, KV cache, activations and workspace per device, before anything is allocated.

Numbers are per device for a mesh of `tensor` x `seq` devices: weights shard on `tensor` (attention heads, MLP,
vocab), KV pages shard on `seq` (page pool) and `tensor` (KV heads, replicated when there are fewer KV heads than
`tensor`). Activations are those of one prefill chunk, the largest transient of a run.
"""
from __future__ import annotations

import dataclasses
import math

from lcjax.config import ModelConfig, RunConfig

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  weights: int
  kv_cache: int
  activations: int
  workspace: int
  kv_replication: int
  num_pages: int
  tokens_capacity: int
  devices: int

  @property
  def total(self) -> int:
    return self.weights + self.kv_cache + self.activations + self.workspace

  def rows(self):
    return [("weights", self.weights), ("KV cache", self.kv_cache), ("activations", self.activations),
            ("workspace", self.workspace), ("total", self.total)]

  def table(self, measured_peak: int | None = None) -> str:
    lines = [f"memory plan per device ({self.devices} device(s); {self.num_pages} pages, "
             f"{self.tokens_capacity:,} tokens of KV"
             + (f", KV heads replicated x{self.kv_replication}" if self.kv_replication > 1 else "") + ")"]
    for name, b in self.rows():
      lines.append(f"  {name:<12} {b / GiB:9.3f} GiB")
    if measured_peak is not None:
      lines.append(f"  {'measured':<12} {measured_peak / GiB:9.3f} GiB (peak)")
    return "\n".join(lines)


def kv_replication(n_kv_heads: int, tensor: int) -> int:
  if n_kv_heads >= tensor:
    return 1
  return tensor // math.gcd(n_kv_heads, tensor)


def plan(model: ModelConfig, run: RunConfig, *, batch: int = 1) -> MemoryPlan:
  T, S = run.tensor, run.seq
  w_item = _ITEMSIZE[run.dtype]
  weights = math.ceil(model.param_count() / T) * w_item
  rep = kv_replication(model.n_kv_heads, T)
  kv_heads_per_dev = max(1, model.n_kv_heads * rep // T)
  pages = run.pages_for(model)
  pages_per_dev = math.ceil(pages / S)
  c_item = _ITEMSIZE[run.resolved_cache_dtype]
  kv = 2 * model.n_layers * pages_per_dev * run.page_size * kv_heads_per_dev * model.head_dim * c_item
  # One prefill chunk of one layer at a time (the scan keeps one layer live): residual, q/k/v/o, the MLP's
  # gate/up/product, plus the float32 logits of the last position.
  C = min(run.prefill_chunk, run.context_for(model)) // S * batch
  D, F, H = model.dim, model.ffn_dim, model.head_dim
  per_token = (3 * D + (model.n_heads + 2 * model.n_kv_heads) * H * 2 // T + 3 * F // T) * w_item
  act = C * per_token + batch * model.vocab_size * 4
  workspace = 256 * 1024 ** 2
  return MemoryPlan(weights, kv, act, workspace, rep, pages, (pages - 1) * run.page_size, T * S)
