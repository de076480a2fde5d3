"""Check and time lcjax's attention backends beside the peers, on the shapes of the long-context workloads, in one
GPU run.

  python3 tools/bench_attention.py --out=$OUT

Prefill: causal, B=1, 32 query heads, 8 kv heads (--heads), head dim 128, bf16, S in --prefill (TFLOP/s with causal
flops 2 * S^2 * H * N). Chunk (--chunk=T:S,...): a prefill chunk of T rows over the S keys of its cached prefix in
pages (the engine's call: the chunk's own keys are a separate causal block), what reads them in place and the FP8
path over the gathered prefix, each with the flash kernel's key splits chosen per call and with one split
(`-split1`), against cuDNN's paged kernel; over fp8 pages (power-of-two page scales) the FP8 kernel reading them in
place and over them gathered, cuDNN over them dequantized, and the FP8 kernel alone on the same keys made
contiguous and quantized before the timing (`lcjax-fp8-kernel-contiguous`: the kernel the tests check, timed
only). Decode: batch --batch (8), one query token (--decode_tokens: as many as a speculative verify step feeds),
same heads, pages of --pages tokens shuffled in a pool, S in --decode (TB/s of K+V bytes read, the cache's own
dtype). Every other impl is first checked on fresh random
inputs against the jnp reference (rel_err: ||out - ref|| / ||ref||; lse_err: max |lse - ref| / max(1, |ref|)) at a
small size, then timed: median of --reps samples after a warm-up, a sample some back-to-back calls and one
synchronisation (decode: 4 dispatched calls, or with --chain=N N calls chained in one compiled program, the row's
`timing`); at 8K, where inputs are near the L2 size, calls rotate over two input sets. A decode row's call after
its timed ones is compared with its call before them (rel_err_after_timing) and with the first timed impl of the
same page dtype (rel_err_vs_first_impl). Results go to
<out>/attention-h200.json and .md, row by row, so a run cut short still leaves what it measured. A watchdog ends the
process if one measurement stalls (a hung kernel). Prefill rows `-positions` pass q_pos and k_start as the engine
does (the backend picks its kernel with a lax.cond on them); `-positions-quiet` is the same graph without the
reference branch's run-time announcement, so the pair shows what that callback costs when the kernel runs.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch peers share the GPU in this process

import dataclasses
import functools
import json
import math
import sys
import threading
import time
import traceback

from absl import app
from absl import flags

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lcjax.cache import kv as kvc  # noqa: E402
from lcjax.ops import attention as ref  # noqa: E402
from lcjax.ops.cudnn import backend as cudnn  # noqa: E402
from lcjax.ops.cudnn import calls as cudnn_calls  # noqa: E402
from lcjax.ops import fp8 as fp8_ops  # noqa: E402
from lcjax.ops.mosaic_gpu import paged as mgpu_paged  # noqa: E402
from lcjax.ops import pallas_backend  # noqa: E402
from lcjax.ops.mosaic_gpu import flash as mgpu_flash  # noqa: E402
from lcjax.ops.triton import paged as triton_paged  # noqa: E402
from tools import benchlib  # noqa: E402

FLAGS = flags.DEFINE_string("out", os.environ.get("OUT", "/tmp"), "directory for the json/md results")
_PREFILL = flags.DEFINE_list("prefill", ["8192", "32768", "131072"], "prefill lengths")
_DECODE = flags.DEFINE_list("decode", ["32768", "131072", "524288"], "decode context lengths")
_PAGES = flags.DEFINE_list("pages", ["64", "128"], "page sizes for decode")
_BATCH = flags.DEFINE_list("batch", ["8"], "decode batch sizes (sequences of the same length S)")
_REPS = flags.DEFINE_integer("reps", 7, "timed repeats (median)")
_ONLY = flags.DEFINE_list("only", [], "run only impls whose name contains one of these")
_SKIP = flags.DEFINE_list("skip", [], "skip impls whose name contains one of these")
_STALL = flags.DEFINE_integer("stall_s", 120, "watchdog: seconds one measurement may take")
_CHUNK = flags.DEFINE_list("chunk", [], "prefill chunks over a paged prefix, T:S pairs (a chunk of T rows at "
                           "positions S .. S + T - 1 over the S cached keys of one sequence), pages of --pages' "
                           "first size")
_HEADS = flags.DEFINE_string("heads", "32:8", "query heads:kv heads of every shape (32:8 Llama-3-8B, 64:8 "
                             "Llama-3.1-70B)")
_NAME = flags.DEFINE_string("name", "attention-h200", "result file stem")
_CHAIN = flags.DEFINE_integer("chain", 0, "decode rows: time N calls chained in one compiled program "
                              "(benchlib.chained: no host dispatch in the time, as in a model's layer loop); 0: "
                              "4 dispatched calls a sample", lower_bound=0)
_EXPLORE = flags.DEFINE_bool("explore", False, "also time tuning variants of lcjax's kernels")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 1, "decode rows: query tokens per sequence (a speculative "
                                      "verify step's k + 1), at the positions before kv_len", lower_bound=1)

B_PF, N, K, H = 1, 32, 8, 128
B_DEC = 8
DT = jnp.bfloat16


class Results:
  """Rows written after every measurement (benchlib.write_result), so a run cut short leaves what it measured."""

  def __init__(self, out_dir, stem):
    self.out_dir, self.stem = out_dir, stem
    self.path = os.path.join(out_dir, stem)
    self.rows, self.errors = [], []
    self.versions = _versions()

  def add(self, **row):
    row.setdefault("heads", f"{N}:{K}")
    self.rows.append(row)
    print(json.dumps(row), flush=True)
    self.flush()

  def error(self, what, e):
    msg = f"{what}: {type(e).__name__}: {str(e)[:1500]}"
    self.errors.append(msg)
    print("ERROR", msg, flush=True)
    traceback.print_exc()
    self.flush()

  def flush(self):
    _ratios(self.rows)
    benchlib.write_result(self.out_dir, self.stem, self.rows, _markdown(self.rows, self.errors),
                          versions_=self.versions, errors=self.errors)


def _versions():
  v = dict(jax=jax.__version__, python=sys.version.split()[0])
  try:
    from jax._src.lib import cuda_versions
    v["cudnn"] = cuda_versions.cudnn_get_version()
    v["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
  except Exception:  # noqa: BLE001 - versions are informational
    pass
  for mod in ("torch", "flash_attn3_jax"):
    try:
      v[mod] = __import__(mod).__version__
    except Exception:  # noqa: BLE001
      v[mod] = None
  return v


def _ratios(rows):
  """ratio_to_best_peer on lcjax rows: metric / best peer metric of the same (op, S, batch, page, dtype)."""
  best = {}
  for r in rows:
    if not r["lcjax"] and r.get("metric") is not None:
      key = (r["op"], r["S"], r.get("batch"), r.get("page"), r["dtype"])
      best[key] = max(best.get(key, 0.0), r["metric"])
  for r in rows:
    key = (r["op"], r["S"], r.get("batch"), r.get("page"), r["dtype"])
    if r["lcjax"] and r.get("metric") is not None and key in best:
      r["ratio_to_best_peer"] = round(r["metric"] / best[key], 3)


def _markdown(rows, errors):
  lines = ["| op | heads | S | batch | page | impl | lcjax | dtype | ms | TFLOP/s or TB/s | ratio to best peer | "
           "rel_err | lse_err |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["op"], r["S"], r.get("batch") or 0, r.get("page") or 0, not r["lcjax"],
                                       r["impl"])):
    metric = r.get("tflops", r.get("tbps"))
    unit = "TF" if "tflops" in r else "TB/s"
    fmt = lambda x, f: "-" if x is None else format(x, f)
    lines.append(f"| {r['op']} | {r.get('heads', '32:8')} | {r['S']} | {r.get('batch') or '-'} | "
                 f"{r.get('page') or '-'} | {r['impl']} | "
                 f"{r['lcjax']} | {r['dtype']} | {fmt(r.get('ms'), '.3f')} | {fmt(metric, '.3f')} {unit} | "
                 f"{fmt(r.get('ratio_to_best_peer'), '.3f')} | {fmt(r.get('rel_err'), '.1e')} | "
                 f"{fmt(r.get('lse_err'), '.1e')} |")
  if errors:
    lines += ["", "Errors:", ""] + [f"- {e[:300]}" for e in errors]
  return "\n".join(lines)


class Watchdog:
  """Ends the process if a measurement stalls: a deadlocked kernel would otherwise eat the whole GPU lease."""

  def __init__(self, seconds, results):
    self.seconds, self.results, self.deadline = seconds, results, None
    threading.Thread(target=self._run, daemon=True).start()

  def arm(self, what):
    self.what, self.deadline = what, time.monotonic() + self.seconds

  def disarm(self):
    self.deadline = None

  def _run(self):
    while True:
      time.sleep(2)
      if self.deadline is not None and time.monotonic() > self.deadline:
        self.results.errors.append(f"watchdog: {self.what} stalled > {self.seconds}s; process ended")
        self.results.flush()
        print(f"WATCHDOG: {self.what} stalled", flush=True)
        os._exit(3)


def _sync(x):
  jax.block_until_ready(x)
  return x


def time_jax(fn, arg_sets, reps, inner=1):
  """Median seconds per call: each of `reps` samples times `inner` back-to-back calls (rotating over arg_sets)
  and one synchronisation, so host dispatch and the synchronisation (tens to hundreds of us) are amortised for
  the ~1 ms calls, as in a model."""
  for args in arg_sets:
    _sync(fn(*args))
  ts = []
  for i in range(reps):
    t = time.perf_counter()
    out = [fn(*arg_sets[(i * inner + j) % len(arg_sets)]) for j in range(inner)]
    _sync(out)
    ts.append((time.perf_counter() - t) / inner)
  return float(np.median(ts))


def time_torch(fn, reps):
  import torch
  fn()
  torch.cuda.synchronize()
  ts = []
  for _ in range(reps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    ts.append(s.elapsed_time(e) / 1e3)
  return float(np.median(ts))


def rel_err(out, want):
  o, w = np.asarray(out, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(o - w) / np.linalg.norm(w))


def lse_err(lse, want):
  a, w = np.asarray(lse, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(a - w) / np.maximum(1.0, np.abs(w))))


def selected(name):
  if _ONLY.value and not any(s in name for s in _ONLY.value):
    return False
  return not any(s in name for s in _SKIP.value)


# ------------------------------------------------------------------------------------------------ prefill
def prefill_impls():
  """name -> (lcjax?, fn(*operands) -> out or (out, lse [B, T, N]), prep, dtype)."""
  scale = 1.0 / math.sqrt(H)
  impls = {
      "lcjax-cudnn": (True, lambda q, k, v: cudnn.CudnnBackend().attend(q, k, v, causal=True)),
      "lcjax-pallas": (True, lambda q, k, v: pallas_backend.PallasBackend().attend(q, k, v, causal=True)),
      "lcjax-pallas-nolse": (True, lambda q, k, v: mgpu_flash.flash_attention(q, k, v, causal=True,
                                                                               save_lse=False)[0]),
      # The engine's call: explicit positions, so the backend picks its kernel with a lax.cond on them (whose
      # reference branch holds the run-time announcement); "-quiet" is the same graph without that callback.
      "lcjax-cudnn-positions": (True, _positioned(cudnn.CudnnBackend())),
      "lcjax-cudnn-positions-quiet": (True, _quiet(_positioned(cudnn.CudnnBackend()))),
      "lcjax-pallas-positions": (True, _positioned(pallas_backend.PallasBackend())),
      "lcjax-pallas-positions-quiet": (True, _quiet(_positioned(pallas_backend.PallasBackend()))),
      "cudnn-public": (False, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                           implementation="cudnn")),
      "cudnn-public-lse": (False, lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn", return_residual=True)),
  }
  if _EXPLORE.value:
    for name, tuning in (("mcs3", mgpu_flash.FlashTuning(max_concurrent_steps=3)),
                         ("fwd-order", mgpu_flash.FlashTuning(reverse_q=False)),
                         ("regs240", mgpu_flash.FlashTuning(compute_regs=240, memory_regs=24))):
      impls["lcjax-pallas-" + name] = (True, functools.partial(_flash, tuning=tuning))
  fp8_tunings = {"": mgpu_flash.FP8_TUNING}
  if _EXPLORE.value:
    fp8_tunings.update(mcs2=mgpu_flash.FlashTuning(max_concurrent_steps=2),
                       mcs3=mgpu_flash.FlashTuning(max_concurrent_steps=3))
  for suffix, tuning in fp8_tunings.items():
    tag = "-" + suffix if suffix else ""
    impls["lcjax-pallas-fp8" + tag] = (True, functools.partial(_fp8_attend, tuning=tuning), None, FP8)
    impls["lcjax-pallas-fp8-kernel" + tag] = (True, functools.partial(_fp8_kernel, tuning=tuning),
                                              functools.partial(_fp8_operands, tuning=tuning), FP8)
  if _EXPLORE.value:
    # One key block a 64-token page (per-page K and V scales would be per block): the kernel alone, as
    # flash_attention_fp8 asks block_kv % 128 == 0.
    bkv64 = mgpu_flash.FlashTuning(block_kv=64, max_concurrent_steps=4)
    impls["lcjax-pallas-fp8-kernel-bkv64"] = (True, functools.partial(_fp8_kernel, tuning=bkv64),
                                              functools.partial(_fp8_operands, tuning=bkv64), FP8)
  impls["lcjax-pallas-fp8-norotation"] = (True, functools.partial(_fp8_attend, incoherent=False), None, FP8)
  # int8 Q K^T, e4m3 P and V (SageAttention's split): quantization included, and the kernel alone.
  impls["lcjax-pallas-fp8-int8qk"] = (True, functools.partial(_fp8_attend, qk_dtype="int8"), None, INT8_FP8)
  impls["lcjax-pallas-fp8-int8qk-kernel"] = (True, functools.partial(_fp8_kernel, tuning=mgpu_flash.FP8_TUNING),
                                             functools.partial(_fp8_operands, tuning=mgpu_flash.FP8_TUNING,
                                                               qk_dtype="int8"), INT8_FP8)
  impls["cudnn-fp8"] = (False, _cudnn_fp8, _cudnn_fp8_operands, FP8)
  try:
    import flash_attn3_jax as fa3
    from flash_attn3_jax import flash as fa3_flash
    impls["fa3"] = (False, lambda q, k, v: fa3.flash_mha(q, k, v, is_causal=True))
    impls["fa3-lse"] = (False, lambda q, k, v: _fa3_lse(fa3_flash, q, k, v, scale))
  except Exception as e:  # noqa: BLE001 - an optional peer
    print("no flash_attn3_jax:", e, flush=True)
  # name -> (lcjax?, fn, prep (untimed: makes fn's operands from q, k, v) or None, operand dtype)
  return {name: (*v, None, "bfloat16") if len(v) == 2 else v for name, v in impls.items()}


def _positioned(backend):
  """attend with q_pos = 0 .. S-1 and k_start = 0 given as arrays, as the model's prefill passes them."""
  def fn(q, k, v):
    B, S = q.shape[:2]
    q_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    return backend.attend(q, k, v, q_pos=q_pos, k_start=jnp.zeros((B,), jnp.int32), causal=True)
  return fn


def _quiet(fn):
  """fn traced with the reference branch's run-time announcement left out (its cost is the difference)."""
  def quiet(*args):
    announce = ref.reference_branch_ran
    ref.reference_branch_ran = lambda *a, **kw: None
    try:
      return fn(*args)
    finally:
      ref.reference_branch_ran = announce
  return quiet


def _flash(q, k, v, *, tuning):
  return mgpu_flash.flash_attention(q, k, v, causal=True, tuning=tuning)


FP8 = "float8_e4m3fn"
INT8_FP8 = "int8_fp8"            # int8 Q and K, e4m3 P and V (RunConfig.attention_dtype's name for it)


def _fp8_attend(q, k, v, *, tuning=mgpu_flash.FP8_TUNING, incoherent=True, qk_dtype="float8_e4m3fn"):
  """Quantization (and the incoherence rotation) included: what the engine pays per call."""
  return mgpu_flash.flash_attention_fp8(q, k, v, causal=True, tuning=tuning, incoherent=incoherent,
                                          qk_dtype=qk_dtype)


def _fp8_operands(q, k, v, *, tuning, qk_dtype="float8_e4m3fn"):
  (q8, qs), (k8, ks), (v8, vs) = fp8_ops.quantize_operands(q, k, v, block_q=tuning.block_q,
                                                            block_kv=tuning.block_kv, incoherent=True,
                                                            qk_dtype=qk_dtype)
  B, S = k.shape[:2]
  d, kvl = jnp.zeros((B,), jnp.int32) + (S - q.shape[1]), jnp.full((B,), S, jnp.int32)
  return q8, qs, k8, ks, mgpu_flash.v_operand(v8), vs, d, kvl


def _fp8_kernel(*ops, tuning):
  """The kernel alone on quantized operands: the comparison with cuDNN's fp8 attention, which takes fp8 inputs."""
  return mgpu_flash.flash_fp8_kernel(*ops, causal=True, tuning=tuning)


def _cudnn_fp8_operands(q, k, v):
  # N(0, 1) inputs fit e4m3 with unit scales.
  return tuple(x.astype(jnp.float8_e4m3fn) for x in (q, k, v))


def _cudnn_fp8(q8, k8, v8):
  """cuDNN's fp8 flash attention (JAX's private entry): per-tensor scales, fp8 output, no LSE."""
  from jax._src.cudnn import fused_attention_stablehlo as fas
  params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in fas.fp8_params_keys}
  out, _, _ = fas.dot_product_attention(q8, k8, v8, fp8_params=params, scale=1.0 / math.sqrt(H),
                                        mask_type=fas.MaskType.CAUSAL, use_fp8=True)
  return out


def _fa3_lse(fa3_flash, q, k, v, scale):
  out, lse = fa3_flash._flash_mha_fwd(q, k, v, softmax_scale=scale, is_causal=True, window_size=(-1, -1))
  return out, jnp.transpose(lse, (0, 2, 1))


def qkv(key, S, B=B_PF):
  ks = jax.random.split(key, 3)
  return (jax.random.normal(ks[0], (B, S, N, H), DT), jax.random.normal(ks[1], (B, S, K, H), DT),
          jax.random.normal(ks[2], (B, S, K, H), DT))


def bench_prefill(res, dog, sizes, reps):
  impls = {n: v for n, v in prefill_impls().items() if selected(n)}
  # Correctness at a size the reference handles, on inputs no timing run uses.
  q, k, v = qkv(jax.random.key(101), 2048)
  want_o, want_l = jax.jit(lambda q, k, v: ref.attention_reference(q, k, v, causal=True))(q, k, v)
  checks = {}
  for name, (_, fn, prep, _) in impls.items():
    try:
      dog.arm(f"check {name}")
      got = _sync(jax.jit(fn)(*(jax.jit(prep)(q, k, v) if prep else (q, k, v))))
      o, l = got if isinstance(got, tuple) else (got, None)
      checks[name] = (rel_err(o, want_o), None if l is None else lse_err(l, want_l))
    except Exception as e:  # noqa: BLE001 - one impl failing must not end the run
      res.error(f"prefill check {name}", e)
    dog.disarm()
  del q, k, v, want_o, want_l
  for S in sizes:
    sets = [qkv(jax.random.key(S + i), S) for i in range(2 if S <= 8192 else 1)]
    flops = 4.0 * S * S * H * N * B_PF / 2
    first = None
    for name, (mine, fn, prep, dtype) in impls.items():
      if name not in checks:
        continue
      try:
        dog.arm(f"prefill {name} S={S}")
        f = jax.jit(fn)
        args = [jax.jit(prep)(*x) for x in sets] if prep else sets
        t = time_jax(f, args, reps if S < 131072 else max(3, reps // 2), inner=8 if S <= 8192 else 1)
        o = f(*args[0])
        del args
        o = o[0] if isinstance(o, tuple) else o
        agree = None
        if first is None:
          first = o
        else:
          agree = rel_err(o, first)
        res.add(op="prefill", impl=name, lcjax=mine, S=S, batch=B_PF, dtype=dtype, ms=t * 1e3,
                tflops=flops / t / 1e12, metric=flops / t / 1e12, rel_err=checks[name][0], lse_err=checks[name][1],
                rel_err_vs_first_impl=agree)
      except Exception as e:  # noqa: BLE001
        res.error(f"prefill {name} S={S}", e)
      dog.disarm()
    del sets, first
  bench_torch_prefill(res, dog, sizes, reps)


def bench_torch_prefill(res, dog, sizes, reps):
  if not any(selected("torch-sdpa-" + be) for be in ("cudnn", "flash")):
    return
  try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
  except Exception as e:  # noqa: BLE001
    res.error("torch import", e)
    return
  for S in sizes:
    q = torch.randn(B_PF, N, S, H, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B_PF, K, S, H, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B_PF, K, S, H, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * S * S * H * N * B_PF / 2
    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
      name = "torch-sdpa-" + be.split("_")[0].lower()
      if not selected(name):
        continue
      try:
        dog.arm(f"{name} S={S}")
        with sdpa_kernel(getattr(SDPBackend, be)):
          try:
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            fn()
          except RuntimeError:
            kr, vr = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
            fn = lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
          t = time_torch(fn, reps if S < 131072 else max(3, reps // 2))
        res.add(op="prefill", impl=name, lcjax=False, S=S, batch=B_PF, dtype="bfloat16", ms=t * 1e3,
                tflops=flops / t / 1e12, metric=flops / t / 1e12, rel_err=None, lse_err=None)
      except Exception as e:  # noqa: BLE001
        res.error(f"{name} S={S}", e)
      dog.disarm()
    q = k = v = None                                   # free the inputs before the next size
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ decode
def decode_impls():
  """name -> (lcjax?, fp8?, fn(q, kp, vp, table, q_pos, kv_len, ks, vs) -> (out, lse))."""
  pal = lambda tuning: (lambda q, kp, vp, t, qp, kl, ks, vs: triton_paged.paged_decode(
      q, kp, vp, t, q_pos=qp, kv_len=kl, k_scale=ks, v_scale=vs, tuning=tuning))
  mgpu = lambda tuning: (lambda q, kp, vp, t, qp, kl, ks, vs: mgpu_paged.paged_decode_fp8(
      q, kp, vp, t, q_pos=qp, kv_len=kl, k_scale=ks, v_scale=vs, tuning=tuning))
  mgpu_bf16 = lambda tuning: (lambda q, kp, vp, t, qp, kl, ks, vs: mgpu_paged.paged_decode_bf16(
      q, kp, vp, t, q_pos=qp, kv_len=kl, tuning=tuning))
  D = mgpu_paged.DecodeTuning
  # Names without "-mcombine" / "-fcombine" join their splits with Triton's combine.
  T3 = functools.partial(D, combine="triton")
  impls = {
      "lcjax-pallas": (True, False, pal(triton_paged.PagedTuning())),
      "lcjax-mgpu-bf16": (True, False, mgpu_bf16(T3())),
      "lcjax-mgpu-bf16-mcombine": (True, False, mgpu_bf16(D(combine="mosaic"))),
      "lcjax-mgpu-bf16-mcs3-mcombine": (True, False, mgpu_bf16(D(max_concurrent_steps=3, combine="mosaic"))),
      "lcjax-mgpu-bf16-mcs2-mcombine": (True, False, mgpu_bf16(D(max_concurrent_steps=2, combine="mosaic"))),
      "lcjax-pallas-fp8": (True, True, pal(triton_paged.PagedTuning())),
      "lcjax-mgpu-fp8": (True, True, mgpu(T3())),
      "lcjax-mgpu-fp8-mcombine": (True, True, mgpu(D(combine="mosaic"))),
      "lcjax-mgpu-bf16-mcs2-fcombine": (True, False, mgpu_bf16(D(max_concurrent_steps=2, combine="mosaic-flat"))),
      "lcjax-mgpu-fp8-fcombine": (True, True, mgpu(D(combine="mosaic-flat"))),
  }
  if _EXPLORE.value:
    T = triton_paged.PagedTuning
    for name, tuning in (("st2", T(num_stages=2)), ("st4-pps1", T(num_stages=4, pages_per_step=1)),
                         ("st3-pps1", T(pages_per_step=1)), ("pps4", T(pages_per_step=4)),
                         ("tp2112", T(target_programs=2112)), ("tp528", T(target_programs=528)),
                         ("tp2112-st4-pps1", T(target_programs=2112, num_stages=4, pages_per_step=1))):
      impls["lcjax-pallas-" + name] = (True, False, pal(tuning))
    F = T3
    # mcs4 / mcs3 / mcs2: K/V rings of a set depth beside the default's `ring_depth` (shallower from 17 rows a
    # kv head, so that two CTAs fit an SM: --decode_tokens).
    for name, tuning in (("mcs4", F(max_concurrent_steps=4)),
                         ("mcs3-ctas396", F(max_concurrent_steps=3, target_ctas=396)),
                         ("mcs2-ctas396", F(max_concurrent_steps=2, target_ctas=396)),
                         ("mcs2-ctas528", F(max_concurrent_steps=2, target_ctas=528)),
                         ("mcs3", F(max_concurrent_steps=3)), ("mcs2", F(max_concurrent_steps=2))):
      impls["lcjax-mgpu-fp8-" + name] = (True, True, mgpu(tuning))
    impls["lcjax-pallas-fp8-st2"] = (True, True, pal(T(num_stages=2)))
    impls["lcjax-pallas-fp8-st4-pps1"] = (True, True, pal(T(num_stages=4, pages_per_step=1)))
  impls |= {
      "lcjax-cudnn": (True, False, lambda q, kp, vp, t, qp, kl, ks, vs: cudnn.CudnnBackend().paged(
          q, kp, vp, t, q_pos=qp, kv_len=kl)),
  }
  try:
    import flash_attn3_jax as fa3
    for splits in (1, 8):
      impls[f"fa3-paged-split{splits}"] = (False, False, functools_partial_fa3(fa3, splits))
  except Exception as e:  # noqa: BLE001
    print("no flash_attn3_jax:", e, flush=True)
  impls["cudnn-private-paged"] = (False, False, lambda q, kp, vp, t, qp, kl, ks, vs: cudnn_calls.paged(
      q, kp, vp, t, kl, 1.0 / math.sqrt(H)))
  return impls


def functools_partial_fa3(fa3, splits):
  def fn(q, kp, vp, t, qp, kl, ks, vs):
    out, lse = fa3.flash_mha_with_kvcache(q, kp, vp, cache_seqlens=kl, page_table=t, num_splits=splits,
                                          return_softmax_lse=True)
    return out, jnp.transpose(lse, (0, 2, 1))
  return fn


def pages(key, S, Z, fp8, B=B_DEC, T=1):
  """q [B, T, N, H] and B sequences' pages [P, Z, K, H] (fp8: with page scales [P, K]) in a shuffled pool, each
  sequence's table [B, M] holding its S keys: M = ceil(S / Z), so a kv_len of S stays inside the table."""
  M = -(-S // Z)
  P = B * M
  ks = jax.random.split(key, 6)
  q = jax.random.normal(ks[0], (B, T, N, H), DT)
  table = jax.random.permutation(ks[3], P).reshape(B, M).astype(jnp.int32)
  if fp8:
    kp = jax.random.normal(ks[1], (P, Z, K, H), DT).astype(jnp.float8_e4m3fn)
    vp = jax.random.normal(ks[2], (P, Z, K, H), DT).astype(jnp.float8_e4m3fn)
    sc = jax.random.uniform(ks[4], (P, K), minval=0.5, maxval=2.0)
    return q, kp, vp, table, sc, sc * 0.75
  kp = jax.random.normal(ks[1], (P, Z, K, H), DT)
  vp = jax.random.normal(ks[2], (P, Z, K, H), DT)
  return q, kp, vp, table, None, None


# Tuning variants and FA3's single split run at the first page size only (compiles cost device time).
MAIN_DECODE = ("lcjax-pallas", "lcjax-pallas-fp8", "lcjax-mgpu-fp8", "lcjax-mgpu-bf16", "lcjax-mgpu-bf16-mcombine",
               "lcjax-mgpu-bf16-mcs2-mcombine",
               "lcjax-mgpu-fp8-mcombine", "lcjax-cudnn", "fa3-paged-split8",
               "cudnn-private-paged", "lcjax-pallas-st2", "lcjax-pallas-fp8-st2", "lcjax-pallas-st3-pps1")


def decode_positions(kv_len, T):
  """q_pos [B, T] of T decode tokens a sequence: the last T positions before kv_len (from 0 where it is shorter)."""
  return jnp.maximum(kv_len[:, None] - T, 0) + jnp.arange(T, dtype=jnp.int32)[None, :]


def bench_decode(res, dog, sizes, page_sizes, reps, batches=(B_DEC,)):
  impls = {n: v for n, v in decode_impls().items() if selected(n)}
  T = _DECODE_TOKENS.value
  for Z in page_sizes:
    checks = {}
    for fp8 in sorted({is8 for _, is8, _ in impls.values()}):      # the page dtypes the selected impls read
      q, kp, vp, table, ks, vs = pages(jax.random.key(7 + Z + fp8), 4096, Z, fp8, T=T)
      kv_len = jnp.array([4096, 4000, 1, 2500, 77, 4095, 3000, 1024], jnp.int32)
      q_pos = decode_positions(kv_len, T)
      want_o, want_l = jax.jit(lambda *a: ref.paged_attention_reference(
          a[0], a[1], a[2], a[3], q_pos=a[4], kv_len=a[5], k_scale=a[6], v_scale=a[7]))(
              q, kp, vp, table, q_pos, kv_len, ks, vs)
      for name, (_, is8, fn) in impls.items():
        if is8 != fp8 or (Z != page_sizes[0] and name not in MAIN_DECODE):
          continue
        try:
          dog.arm(f"check {name} Z={Z}")
          o, l = _sync(jax.jit(fn)(q, kp, vp, table, q_pos, kv_len, ks, vs))
          checks[name] = (rel_err(o, want_o), lse_err(l, want_l))
        except Exception as e:  # noqa: BLE001
          res.error(f"decode check {name} Z={Z}", e)
        dog.disarm()
    for B, S in ((B, S) for B in batches for S in sizes):
      data = {fp8: pages(jax.random.key(S + Z + fp8), S, Z, fp8, B=B, T=T) for fp8 in (False, True)
              if any(v[1] == fp8 and n in checks for n, v in impls.items())}
      kv_len = jnp.full((B,), S, jnp.int32)
      q_pos = decode_positions(kv_len, T)
      first = {}                   # page dtype -> the first impl's output after its timed calls
      for name, (mine, fp8, fn) in impls.items():
        if name not in checks:
          continue
        q, kp, vp, table, ks, vs = data[fp8]
        nbytes = kp.nbytes + vp.nbytes
        try:
          dog.arm(f"decode {name} B={B} S={S} Z={Z}")
          f = jax.jit(fn)
          args = (q, kp, vp, table, q_pos, kv_len, ks, vs)
          before = _sync(f(*args)[0])
          if _CHAIN.value:
            t = time_jax(benchlib.chained(fn, _CHAIN.value), [args], reps) / _CHAIN.value
          else:
            t = time_jax(f, [args], reps, inner=4)
          # A call after the timed ones, against the same impl's call before them (a kernel whose output changes
          # from call to call: a race, or state left between calls) and against the first impl of the same page
          # dtype: the check above saw one call at another size.
          o = f(*args)[0]
          again = rel_err(o, before)
          agree = rel_err(o, first[fp8]) if fp8 in first else None
          first.setdefault(fp8, o)
          res.add(op="decode" if T == 1 else f"decode-{T}-tokens", impl=name, lcjax=mine, S=S, batch=B, page=Z,
                  dtype="float8_e4m3fn" if fp8 else "bfloat16", ms=t * 1e3, tbps=nbytes / t / 1e12,
                  metric=nbytes / t / 1e12, tokens_per_s=B / t, rel_err=checks[name][0],
                  timing=f"chained-{_CHAIN.value}" if _CHAIN.value else "dispatched-4", tokens=T,
                  lse_err=checks[name][1], rel_err_after_timing=again, rel_err_vs_first_impl=agree)
        except Exception as e:  # noqa: BLE001
          res.error(f"decode {name} B={B} S={S} Z={Z}", e)
        dog.disarm()
      del data, first


def chunk_impls():
  """name -> (lcjax?, fp8 pages?, fn(q, kp, vp, table, q_pos, kv_len, k_scale, v_scale) -> (out, lse)): what reads
  a prefill chunk's cached prefix from the pages (bf16 pages, or fp8 pages with page scales), each called as the
  model calls it (`past=True`: no check of the positions on the device). cuDNN's paged kernel (CudnnBackend's
  padding-only call, the pallas backend's prefill_kernel="cudnn"; over fp8 pages dequantized in blocks) is the
  peer."""
  def paged_flash(kv_splits=None):
    be = pallas_backend.PallasBackend(prefill_route="mosaic", flash=mgpu_flash.FlashTuning(kv_splits=kv_splits))
    return lambda q, kp, vp, t, qp, kl: be.paged(q, kp, vp, t, q_pos=qp, kv_len=kl, past=True)

  def fp8_prefix(kv_splits=None, route="auto"):
    be = pallas_backend.PallasFp8Backend(flash=dataclasses.replace(mgpu_flash.FP8_TUNING, kv_splits=kv_splits),
                                         prefix_route=route)
    return lambda q, kp, vp, t, qp, kl, ks, vs: be.paged(q, kp, vp, t, q_pos=qp, kv_len=kl, k_scale=ks, v_scale=vs,
                                                         past=True)

  def cudnn_paged(q, kp, vp, t, qp, kl, ks, vs):
    return cudnn.CudnnBackend().paged(q, kp, vp, t, q_pos=qp, kv_len=kl, k_scale=ks, v_scale=vs, past=True)

  # "-split1": each tile's keys in one CTA, beside the key splits chosen per call (FlashTuning.kv_splits).
  return {
      "lcjax-mosaic-paged": (True, False, lambda *a: paged_flash()(*a[:6])),
      "lcjax-mosaic-paged-split1": (True, False, lambda *a: paged_flash(1)(*a[:6])),
      # The FP8 kernel over bf16 pages gathered and quantized (PallasFp8Backend's chunk path over bf16 pages).
      "lcjax-fp8-prefix": (True, False, fp8_prefix()),
      "lcjax-fp8-prefix-split1": (True, False, fp8_prefix(1)),
      # Over fp8 pages: read in place (K where it lies, V's bytes transposed), or gathered, dequantized and
      # quantized again (prefix_route="gather").
      "lcjax-fp8-pages-in-place": (True, True, fp8_prefix(route="in-place")),
      "lcjax-fp8-pages-gather": (True, True, fp8_prefix(route="gather")),
      "cudnn-paged": (False, False, cudnn_paged),
      "cudnn-paged-fp8pages": (False, True, cudnn_paged),
  }


# The FP8 kernel alone on the same keys made contiguous and quantized before the timing (no pages, no
# quantization in the row): what the in-place read is measured against.
CONTIGUOUS_FP8 = "lcjax-fp8-kernel-contiguous"


def contiguous_fp8_operands(q, kp, vp, table, q_pos, kv_len, ks, vs):
  """flash_fp8_kernel's operands for a chunk's rows over its fp8 pages' keys made contiguous: the pages
  dequantized, then quantized as fresh operands (per 128-key block, no smoothing or rotation)."""
  T = q.shape[1]
  Tp = -(-T // 128) * 128
  k, v = (ref.gather_pages(p, sc, table, DT).reshape(1, -1, K, H) for p, sc in ((kp, ks), (vp, vs)))
  (q8, qs), (k8, ks8), (v8, vs8) = fp8_ops.quantize_operands(
      jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))), k, v, block_q=64, block_kv=128, incoherent=False)
  return q8, qs, k8, ks8, mgpu_flash.v_operand(v8), vs8, jnp.zeros((1,), jnp.int32), kv_len


def fp8_chunk_pages(kp, vp):
  """bf16 pages -> (fp8 pages, k_scale, v_scale [P, K]) as lcjax.cache.kv holds them: one power-of-two scale per
  (page, kv head), the smallest that keeps the page's values within e4m3's range (kv.scale_for)."""
  def one(x):
    scale = kvc.scale_for(jnp.abs(x.astype(jnp.float32)).max(axis=(1, 3)))
    return (x.astype(jnp.float32) / scale[:, None, :, None]).astype(fp8_ops.E4M3), scale
  (kp8, ks), (vp8, vs) = one(kp), one(vp)
  return kp8, vp8, ks, vs


def chunk_pages(key, T, S, Z, fp8=False):
  """q [1, T, N, H] and one sequence's S keys in pages of Z shuffled in a pool (fp8: as fp8_chunk_pages makes them,
  else bf16 and scales None); rows at S .. S + T - 1: (q, kp, vp, table, q_pos, kv_len, k_scale, v_scale)."""
  q, kp, vp, table, _, _ = pages(key, S, Z, False, B=1)
  q = jax.random.normal(jax.random.fold_in(key, 1), (1, T, N, H), DT)
  kv_len = jnp.full((1,), S, jnp.int32)
  ks = vs = None
  if fp8:
    kp, vp, ks, vs = fp8_chunk_pages(kp, vp)
  return q, kp, vp, table, (S + jnp.arange(T, dtype=jnp.int32))[None], kv_len, ks, vs


# Chunk rows time 4 calls a sample: one host synchronisation a call (~0.3 ms on an H100) would be ~10% of a
# 1,024-row chunk over 128K keys, which a model's jitted step does not pay.
CHUNK_INNER = 4


def bench_chunk(res, dog, pairs, Z, reps):
  """Prefill chunks over a paged prefix: each impl checked against the jnp reference on a 1,000-row chunk over a
  4,000-key prefix, then timed on each T:S pair (TFLOP/s of T * S visible pairs at 4 N H flops each)."""
  impls = {n: v for n, v in chunk_impls().items() if selected(n)}
  q, kp, vp, table, q_pos, _, _, _ = chunk_pages(jax.random.key(11 + Z), 1000, 4096, Z)
  kv_len = jnp.full((1,), 4000, jnp.int32)
  want = {}
  checks = {}
  kp8, vp8, ks, vs = fp8_chunk_pages(kp, vp)
  for name, (_, fp8, fn) in impls.items():
    try:
      dog.arm(f"check chunk {name} Z={Z}")
      # fp8 impls are checked against the reference over the same fp8 pages dequantized
      args = (q, kp8, vp8, table, q_pos, kv_len, ks, vs) if fp8 else (q, kp, vp, table, q_pos, kv_len, None, None)
      if fp8 not in want:
        want[fp8] = _sync(jax.jit(lambda *a: ref.paged_attention_reference(
            *a[:4], q_pos=a[4], kv_len=a[5], k_scale=a[6], v_scale=a[7]))(*args))
      o, l = _sync(jax.jit(fn)(*args))
      checks[name] = (rel_err(o, want[fp8][0]), lse_err(l, want[fp8][1]))
    except Exception as e:  # noqa: BLE001
      res.error(f"chunk check {name} Z={Z}", e)
    dog.disarm()
  contiguous = selected(CONTIGUOUS_FP8)
  for T, S in pairs:
    data = {fp8: chunk_pages(jax.random.key(T + S + Z), T, S, Z, fp8) for fp8 in {v[1] for v in impls.values()}}
    flops = 4.0 * N * H * T * S
    if contiguous:
      try:
        dog.arm(f"chunk {CONTIGUOUS_FP8} T={T} S={S} Z={Z}")
        ops = contiguous_fp8_operands(*chunk_pages(jax.random.key(T + S + Z), T, S, Z, True))
        t = time_jax(jax.jit(functools.partial(mgpu_flash.flash_fp8_kernel, causal=False)), [ops], reps,
                     inner=CHUNK_INNER)
        res.add(op=f"chunk-{T}", impl=CONTIGUOUS_FP8, lcjax=True, S=S, batch=1, page=Z, dtype="float8_e4m3fn",
                ms=t * 1e3, tflops=flops / t / 1e12, metric=flops / t / 1e12)
        del ops
      except Exception as e:  # noqa: BLE001
        res.error(f"chunk {CONTIGUOUS_FP8} T={T} S={S} Z={Z}", e)
      dog.disarm()
    for name, (mine, fp8, fn) in impls.items():
      if name not in checks:
        continue
      try:
        dog.arm(f"chunk {name} T={T} S={S} Z={Z}")
        t = time_jax(jax.jit(fn), [data[fp8]], reps, inner=CHUNK_INNER)
        res.add(op=f"chunk-{T}", impl=name, lcjax=mine, S=S, batch=1, page=Z,
                dtype="float8_e4m3fn" if fp8 else "bfloat16", ms=t * 1e3,
                tflops=flops / t / 1e12, metric=flops / t / 1e12, rel_err=checks[name][0], lse_err=checks[name][1])
      except Exception as e:  # noqa: BLE001
        res.error(f"chunk {name} T={T} S={S} Z={Z}", e)
      dog.disarm()
    del data


def probe_cudnn_any_pool(res, dog):
  """Does cuDNN's paged kernel accept a pool whose size is not B * M when JAX's Python check is skipped?"""
  try:
    dog.arm("probe any_pool")
    B, Z, M, P = 3, 64, 8, 29
    ks = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(ks[0], (B, 1, N, H), DT)
    kp = jax.random.normal(ks[1], (P, Z, K, H), DT)
    vp = jax.random.normal(ks[2], (P, Z, K, H), DT)
    table = jax.random.permutation(ks[3], P)[:B * M].reshape(B, M).astype(jnp.int32)
    kv_len = jnp.array([M * Z, 300, 5], jnp.int32)
    o, l = jax.jit(lambda *a: cudnn_calls.paged(*a, 1.0 / math.sqrt(H)))(q, kp, vp, table, kv_len)
    wo, wl = ref.paged_attention_reference(q, kp, vp, table, q_pos=kv_len[:, None] - 1, kv_len=kv_len)
    res.add(op="probe", impl="cudnn-paged-any-pool", lcjax=True, S=M * Z, batch=B, dtype="bfloat16",
            rel_err=rel_err(o, wo), lse_err=lse_err(l, wl))
  except Exception as e:  # noqa: BLE001
    res.error("probe cudnn any_pool", e)
  dog.disarm()


def main(argv):
  del argv
  global N, K
  heads = _HEADS.value.split(":")
  if len(heads) != 2 or not all(h.isdigit() for h in heads) or int(heads[1]) < 1 or int(heads[0]) % int(heads[1]):
    raise app.UsageError(f"--heads={_HEADS.value!r} must be N:K, query heads a multiple of kv heads (e.g. 64:8)")
  N, K = int(heads[0]), int(heads[1])
  os.makedirs(FLAGS.value, exist_ok=True)
  res = Results(FLAGS.value, _NAME.value)
  dog = Watchdog(_STALL.value, res)
  print(json.dumps(res.versions), jax.devices(), flush=True)
  if selected("probe"):
    probe_cudnn_any_pool(res, dog)
  if _PREFILL.value:
    bench_prefill(res, dog, [int(s) for s in _PREFILL.value], _REPS.value)
  if _DECODE.value:
    bench_decode(res, dog, [int(s) for s in _DECODE.value], [int(z) for z in _PAGES.value], _REPS.value,
                 [int(b) for b in _BATCH.value])
  if _CHUNK.value:
    pairs = [tuple(int(x) for x in p.split(":")) for p in _CHUNK.value]
    bench_chunk(res, dog, pairs, int(_PAGES.value[0]), _REPS.value)
  res.flush()
  print(open(res.path + ".md").read())


if __name__ == "__main__":
  app.run(main)
