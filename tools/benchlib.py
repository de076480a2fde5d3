"""What every benchmark shares: the device and versions it records beside its rows, the worker subprocess that
measures rows in a process of its own (so its peak memory is its own) and how it reports them, the writer of the
JSON + markdown result files, and the long-context table (tools/bench_longctx.py's, benchmarks/merge_results.py's)."""
from __future__ import annotations

import json
import platform
import subprocess


def gpu_names() -> list[str]:
  """One "name, memory" line per NVIDIA GPU (empty without nvidia-smi)."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return []
  return out.stdout.strip().splitlines() if out.returncode == 0 else []


def device_name(cpu_devices: int = 1) -> str:
  gpus = gpu_names()
  if gpus:
    return gpus[0] if len(gpus) == 1 else f"{len(gpus)} x {gpus[0]}"
  return f"cpu ({platform.processor() or platform.machine()}, {cpu_devices} device(s))"


def versions(modules=("jax", "jaxlib", "flax", "torch", "transformers")) -> dict:
  """{"python": ..., module: version}: an imported module's __version__, else its installed distribution's version
  (read from its metadata: importing torch and transformers costs a run that never uses them about 2.5 s)."""
  import importlib.metadata
  import sys
  v = {"python": platform.python_version()}
  for mod in modules:
    try:
      v[mod] = sys.modules[mod].__version__ if mod in sys.modules else importlib.metadata.version(mod)
    except Exception:  # noqa: BLE001 - a module that is not installed is simply not listed
      pass
  return v


SOURCE_ENV = "LCJAX_SOURCE_REVISION"


def source_revision() -> str:
  """The commit the benchmark's code came from: $LCJAX_SOURCE_REVISION when set (a copy of the tree shipped to a
  GPU machine, whose .git, if any, need not match the files), else `git rev-parse HEAD` of this checkout (with
  "+dirty" when tracked files differ from it), else "unknown"."""
  import os
  if os.environ.get(SOURCE_ENV):
    return os.environ[SOURCE_ENV]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    if head.returncode == 0:
      dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
      return head.stdout.strip() + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    pass
  return "unknown"


def logits_metrics_over(got, ref) -> dict:
  """got, ref: float logits [P, V] of P positions -> logits_metrics() of each, summarised: the mean KL, RMS diff
  and top-10 overlap, the largest KL and max diff, top1 as the fraction of positions whose top-1 agrees (a bool for
  one position), and the largest top1_margin."""
  each = [logits_metrics(g, r) for g, r in zip(got, ref)]
  if len(each) == 1:
    return each[0]
  mean = lambda key: float(sum(m[key] for m in each) / len(each))
  worst = max(each, key=lambda m: m["rel_max"])
  return dict(max_abs=worst["max_abs"], scale=worst["scale"], rel_max=worst["rel_max"], rel_rms=mean("rel_rms"),
              kl=mean("kl"), kl_max=max(m["kl"] for m in each), top1=mean("top1"), top10=mean("top10"),
              top1_margin=max(m["top1_margin"] for m in each), positions=len(each))


def logits_metrics(got, ref) -> dict:
  """Float logits got, ref [V] (tools/check_exact.py: lcjax's against the oracle's or the first cache's): max |diff|
  and RMS diff relative to ref, KL(ref || got) in nats, top-1 agreement, top-10 overlap, and top1_margin: how far
  below its own top-1 ref puts got's top-1, over the logit scale (0 where they agree, an exact tie included; a
  near-tie flips at a margin within the logits' error)."""
  import numpy as np
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  logp = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
  logq = got - got.max() - np.log(np.exp(got - got.max()).sum())
  top = lambda x, k: set(np.argsort(-x)[:k].tolist())
  scale, max_abs = float(np.abs(ref).max()), float(np.abs(got - ref).max())
  return dict(top1_margin=float((ref.max() - ref[got.argmax()]) / scale), max_abs=max_abs, scale=scale,
              rel_max=max_abs / scale,
              rel_rms=float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))),
              kl=float(np.sum(np.exp(logp) * (logp - logq))), top1=bool(got.argmax() == ref.argmax()),
              top10=len(top(got, 10) & top(ref, 10)) / 10)


def random_model_cfg(preset_name: str, longest: int, layers: int = 0):
  """The ModelConfig a benchmark of random weights runs: the preset's, with no token that ends a generation (every
  run generates all its tokens), max_position at least `longest` (no context was trained, so the longest run sets
  it), and only the first `layers` layers when given."""
  import dataclasses
  from lcjax.config import preset
  cfg = preset(preset_name)
  cfg = dataclasses.replace(cfg, eos_ids=(), max_position=max(cfg.max_position, longest))
  return dataclasses.replace(cfg, n_layers=layers) if layers else cfg


def monotone_violations(points: list[tuple[int, float]], tolerance: float) -> list[dict]:
  """The pairs (n, m), n < m, of a sweep's (length, seconds) points whose time(n) > tolerance * time(m)
  (tools/bench_lengths.py's check that time grows with length)."""
  pts = sorted(points)
  return [dict(shorter=n, longer=m, shorter_s=tn, longer_s=tm)
          for i, (n, tn) in enumerate(pts) for m, tm in pts[i + 1:] if n < m and tn > tolerance * tm]


def chained(fn, n: int):
  """A compiled function of fn's arguments that calls fn(*args) n times in a row inside one program, each call's
  first argument made to depend on the previous call's output (plus 0 times its first element, made a finite
  float32: one tiny fused kernel a call, which XLA cannot fold, a float product by 0 not being 0 for every float;
  an integer one would be folded and the calls merged): the calls run back to back in order, as a model's layers
  do, and a timing of it divided by n is fn's device time with no host dispatch in it (a jitted call of ~0.1 ms
  can be bound by its dispatch), plus that small kernel. Returns every call's output."""
  import jax
  import jax.numpy as jnp
  if n < 1:
    raise ValueError(f"chained calls n={n} must be at least 1")

  def run(*args):
    first, rest = args[0], args[1:]
    outs = []
    for _ in range(n):
      out = fn(first, *rest)
      x = jnp.nan_to_num(jax.tree_util.tree_leaves(out)[0].ravel()[0].astype(jnp.float32))
      first = first + (x * 0).astype(first.dtype)
      outs.append(out)
    return outs

  return jax.jit(run)


def memory_stat(dev, key: str):
  """A device memory counter in bytes (`peak_bytes_in_use`, `bytes_in_use`), or None where the backend keeps none
  (CPU)."""
  return (dev.memory_stats() or {}).get(key)


def compilation_note(seconds: float) -> str:
  """A row's note when its timed calls made programs (compile_s of their stats: the warm-up missed one, so the
  times hold compilation); "" when they made none."""
  return f"{seconds:.1f} s of compilation timed" if seconds > 0.05 else ""


def emit_row(**row) -> None:
  """A result row from a benchmark worker process, for its orchestrator to collect from stdout."""
  print("ROW " + json.dumps(row), flush=True)


def is_oom(e: BaseException) -> bool:
  """Whether an exception is the device running out of memory (XLA's or torch's wording)."""
  s = repr(e)
  if "Shared memory size limit" in s:   # RESOURCE_EXHAUSTED too, but a kernel's launch config, not the memory
    return False
  return any(m in s for m in ("RESOURCE_EXHAUSTED", "Out of memory", "OutOfMemory", "out of memory"))


def run_worker(argv: list[str], label: str, env=None) -> tuple[list[dict], int]:
  """Run a worker process (`argv`), echoing its errors; returns (the rows it emitted with `emit_row`, its exit
  status). A worker killed outside Python (e.g. for memory) returns the rows it had sent."""
  rows = []
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  for line in proc.stdout:
    if line.startswith("ROW "):
      rows.append(json.loads(line[4:]))
      print(line[4:].rstrip(), flush=True)
    elif "Traceback" in line or "Error" in line:
      print(f"  [{label}] {line.rstrip()}", flush=True)
  return rows, proc.wait()


def write_result(out_dir: str, name: str, rows: list[dict], table: str, *, device: str | None = None,
                 versions_: dict | None = None, note: str = "", **meta) -> dict:
  """Write `name`.json (device, versions, command, date, source revision, `meta`, rows) and `name`.md (the same
  header, `note` and the markdown `table`) under out_dir. Returns the JSON object."""
  import datetime
  import os
  import sys
  result = dict(device=device or device_name(), versions=versions_ or versions(),
                command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                source=source_revision(), **meta, rows=rows)
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, name)
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write(f"# {name}\n\ndevice: {result['device']}\n\ncommand: `{result['command']}`\n\n"
            f"source: {result['source']}\n\nversions: {json.dumps(result['versions'])}\n\n"
            f"{note + chr(10) * 2 if note else ''}{table}\n")
  return result


# A --caches entry's suffixes -> the RunConfig field each sets.
VARIANT_SUFFIXES = {"fp8attn": ("attention_dtype", "float8_e4m3fn"), "int8attn": ("attention_dtype", "int8_fp8"),
                    "fp8w": ("weight_dtype", "float8_e4m3fn"), "cudnnprefill": ("prefill_kernel", "cudnn")}


def variant(entry: str) -> dict:
  """A --caches entry as RunConfig fields: 'float8_e4m3fn' -> cache_dtype; suffixes pick low-precision attention,
  '+fp8attn' (attention_dtype float8_e4m3fn) or '+int8attn' (int8_fp8), fp8 weights, '+fp8w' (weight_dtype
  float8_e4m3fn: the checkpoint's linear weights quantized at load), and cuDNN's paged kernel for the cached
  prefix of prefill chunks, '+cudnnprefill' (prefill_kernel cudnn: beside the default's paged flash kernel in one
  call), e.g. 'bfloat16+fp8attn+fp8w'."""
  cache, *extras = entry.split("+")
  fields = dict(cache_dtype=cache, attention_dtype="auto", weight_dtype="auto", prefill_kernel="auto")
  set_by = {}
  for extra in extras:
    if extra not in VARIANT_SUFFIXES:
      raise ValueError(f"cache entry {entry!r}: {extra!r} is not a suffix; the suffixes are "
                       + ", ".join("+" + s for s in VARIANT_SUFFIXES))
    field, value = VARIANT_SUFFIXES[extra]
    if field in set_by:
      raise ValueError(f"cache entry {entry!r}: +{set_by[field]} and +{extra} both set {field}")
    set_by[field] = extra
    fields[field] = value
  return fields


# A long-context row (tools/bench_longctx.py) not run because a shorter context of its implementation ran out
# of memory.
IMPLIED_OOM = "not run: a shorter context ran out of memory"


def cell(row: dict, key: str, spec: str) -> str:
  """A table cell: row[key] formatted by `spec`, "-" where the row has no value."""
  return spec.format(row[key]) if row.get(key) is not None else "-"


def _runs_note(r) -> str:
  """'median of N: prefill a-b s, decode c-d ms' for a row timed N > 1 times, else ''."""
  tp, td = r.get("prefill_s_runs") or [], r.get("decode_ms_runs") or []
  if len(tp) < 2:
    return ""
  return f"median of {len(tp)}: prefill {min(tp):.2f}-{max(tp):.2f} s, decode {min(td):.1f}-{max(td):.1f} ms"


def longctx_markdown(rows) -> str:
  """The table of tools/bench_longctx.py's rows (and of the combined rows of benchmarks/merge_results.py)."""
  lines = ["| impl | S | prefill s | prefill tok/s | TFLOP/s | decode ms/token | peak GiB | planned GiB | note |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    note = (("OOM (implied)" if r.get("skipped") else "OOM") if r.get("oom") else
            (r.get("note") or r.get("skipped") or (r.get("error") or "")[:60] or _runs_note(r)))
    lines.append(f"| {r['impl']} | {r['S']:,} | {cell(r, 'prefill_s', '{:.2f}')} | "
                 f"{cell(r, 'prefill_tok_s', '{:,.0f}')} | {cell(r, 'prefill_tflops', '{:.0f}')} | "
                 f"{cell(r, 'decode_ms_per_token', '{:.1f}')} | {cell(r, 'peak_gib', '{:.1f}')} | "
                 f"{cell(r, 'planned_gib', '{:.1f}')} | {note} |")
  return "\n".join(lines)


def line_report(evs: dict[str, list[float]], per: int, layers: int) -> dict:
  """tools/profile_step.py's summary of one trace line's kernels ({event name: [total ns, count]}) per token (`per`
  tokens traced; per model call with speculation): their device ms, their kinds, their calls a token and a layer
  (all of a token's calls over its `layers` layers, the lm head's and the loop's few included: what a fusion
  changes), each kernel ranked by time."""
  total = sum(v[0] for v in evs.values())
  calls = sum(v[1] for v in evs.values()) / per
  ranked = sorted(evs.items(), key=lambda kv: -kv[1][0])
  return dict(total_ms_per_token=total / 1e6 / per, events=len(evs), calls_per_token=calls,
              calls_per_layer=calls / layers, kernels=[
                  dict(name=n[:160], ms_per_token=v[0] / 1e6 / per, calls_per_token=v[1] / per,
                       share=v[0] / total if total else 0.0)
                  for n, v in ranked])
