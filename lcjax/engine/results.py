"""A finished request as the caller sees it: its text, ids and stats (times, cache use, kernels, peak memory), and
the words its stats use for the engine's linear kernels."""
from __future__ import annotations

import dataclasses
import resource

from lcjax.engine.scheduler import Request
from lcjax.ops.linear import WIDEN_MAX_ROWS


@dataclasses.dataclass
class GenerationResult:
  text: str
  token_ids: list[int]
  prompt_tokens: int
  finish_reason: str           # "eos", "length", "nonfinite" (stopped: the model's logits held NaN or inf), or
                               # "stopped" (a generate_stream left unfinished)
  stats: dict


def peak_device_bytes(devices) -> int | None:
  """The largest peak of bytes in use over `devices` (addressable ones), as the memory plan counts a device; None
  where no device reports memory (the CPU)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


def peak_host_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def result(r: Request, text: str, kernels: dict, draft, t_call: float | None = None,
           compile_s: float = 0.0, *, devices) -> GenerationResult:
  """r's result (`text`: its output ids decoded); its prefill stats include the shared prefix's prefill when r
  paid it (Scheduler.serve). kernels: the engine's attention, dtypes and kernels, the stats' first fields; draft:
  the run's draft model. compile_s: the call's seconds of making programs (compile_cache.compile_seconds), in its
  times. devices: the engine's in this process, whose largest peak is stats["peak_device_bytes"]."""
  n_dec = max(len(r.out) - 1, 0)
  prefilled = len(r.prompt) - r.cached + r.shared_prefill_tokens
  ttft = r.first_token_at - t_call if None not in (r.first_token_at, t_call) else float("nan")
  stats = dict(**kernels,
               prompt_tokens=len(r.prompt), new_tokens=len(r.out), cached_tokens=len(r.prompt) - prefilled,
               host_cached_tokens=r.from_host, prefill_tokens=prefilled,
               prefill_s=r.prefill_s + r.shared_prefill_s, shared_prefix_prefill_s=r.shared_prefill_s,
               time_to_first_token_s=ttft, compile_s=compile_s,
               decode_ms_per_token=(1000 * r.decode_s / n_dec) if n_dec else float("nan"),
               draft=draft, decode_calls=r.decode_calls,
               tokens_per_decode_call=(n_dec / r.decode_calls) if r.decode_calls else float("nan"),
               drafts_proposed=r.drafts_proposed, drafts_accepted=r.drafts_accepted,
               peak_device_bytes=peak_device_bytes(devices), peak_host_bytes=peak_host_bytes())
  return GenerationResult(text, list(r.out), len(r.prompt), r.finish or "length", stats)


def linear_kernels(weights, run, gemv_kernel, devices: int) -> str:
  """How the projections and MLP multiply: by their dtype, or for fp8 weights which product prefill chunks
  and decode steps run (lcjax.ops.linear.dense: chosen by the rows of a call; `gemv_kernel` the decode-sized
  one, lcjax.ops.kernels, None: XLA's widened product), and on a mesh of more than one device that a GEMV kernel
  runs on each device's shards."""
  if not weights.fp8:
    return run.dtype
  acts = "static" if weights.static_inputs else "per-token"
  small = f"fp8 widened to {run.dtype} by XLA" if gemv_kernel is None else gemv_kernel.description
  if gemv_kernel is not None and devices > 1:
    small += f" on each device's shards (seq={run.seq} x tensor={run.tensor})"
  return f"fp8 x fp8 ({acts} activation scales) over {WIDEN_MAX_ROWS} rows, else {small}"
