"""The check and profiling tools run end to end on the CPU with a tiny model (their GPU runs are in
benchmarks/results): tools/check_exact.py's numbers against its float32 HF oracle, tools/profile_step.py's report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import forkserver
from tests.run_cache import with_test_xla_optimizations

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tools run as scripts in processes forked from a server that has imported what they import (check_exact's
# float32 oracle: torch and transformers' LLaMA), instead of importing it again in each (2-7 s a tool).
TOOL_PRELOAD = forkserver.PRELOAD + ("torch", "transformers.models.llama.modeling_llama", "transformers.masking_utils")


def _env():
  # One CPU device (the tools' own default); XLA's optimizations as in the test processes (tests/conftest.py: the
  # tiny models' compilation is most of each run, and what a tool computes and reports does not depend on them).
  return with_test_xla_optimizations(dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))


def _tool(tool, *args):
  return forkserver.run([sys.executable, os.path.join(REPO, "tools", tool), *args], env=_env(), cwd=REPO,
                        timeout=600, preload=TOOL_PRELOAD)


def _run(tool, *args):
  p = _tool(tool, *args)
  assert p.returncode == 0, p.stderr[-2000:]
  return p


def test_check_exact_against_the_float32_oracle(tmp_path):
  # float32 model; 300 tokens = 3 chunks of 128, so the cache (bf16, then fp8) is read; 96 tokens fit one chunk.
  _run("check_exact.py", "--preset=tiny", "--contexts=96,300", "--caches=bfloat16,float8_e4m3fn",
       "--dtype=float32", "--prefill_chunk=128", "--page_size=16", f"--out={tmp_path}", "--name=ex")
  res = json.load(open(tmp_path / "ex.json"))
  rows = {(r["S"], r["cache"]): r for r in res["rows"]}
  assert rows[96, "bfloat16"]["vs_oracle"]["rel_max"] < 1e-5              # no cache read: float32 all the way
  assert rows[96, "float8_e4m3fn"]["vs_bfloat16"]["max_abs"] == 0.0
  assert 1e-5 < rows[300, "bfloat16"]["vs_oracle"]["rel_max"] < 3e-3        # bf16 K/V read back from the cache
  fp8 = rows[300, "float8_e4m3fn"]
  assert 3e-4 < fp8["vs_bfloat16"]["rel_max"] < 3e-2 and fp8["vs_oracle"]["top1"]
  assert "| 300 | float8_e4m3fn | bfloat16 |" in (tmp_path / "ex.md").read_text()


def test_check_exact_top1_margin_measures_a_flip_on_the_reference():
  from tools.benchlib import logits_metrics as metrics, logits_metrics_over as metrics_over
  ref = [0.0, 3.0, 2.9, -1.0]
  assert metrics([0.0, 2.0, 1.0, 0.0], ref)["top1_margin"] == 0.0           # same top-1
  m = metrics([0.0, 2.9, 3.0, 0.0], ref)                                      # lcjax picks the oracle's second
  assert not m["top1"] and m["top1_margin"] == pytest.approx(0.1 / 3.0)
  assert metrics_over([[0.0, 2.9, 3.0, 0.0], [0.0, 9.0, 0.0, 0.0]], [ref, ref])["top1_margin"] == m["top1_margin"]


def test_profile_prefill_summarizes_the_step_phases():
  from tools.profile_prefill import summarize, table
  ev = lambda tid, name, ph, kcycles: dict(tid=tid, name=name, ph=ph, ts=kcycles)
  trace = []
  for tid in (1, 2):                                  # two compute warpgroups, two steps each
    t = 0.0
    for _ in range(2):
      trace += [ev(tid, "qk", "B", t), ev(tid, "turn", "B", t + 0.1), ev(tid, "turn", "E", t + 0.3),
                ev(tid, "qk", "E", t + 0.4), ev(tid, "softmax", "B", t + 0.4), ev(tid, "softmax", "E", t + 1.2),
                ev(tid, "softmax", "B", t + 1.2), ev(tid, "softmax", "E", t + 1.4),     # two ranges a step
                ev(tid, "pv", "B", t + 1.4), ev(tid, "pv", "E", t + 1.9)]
      t += 2.0
  trace += [ev(3, "Init", "B", 0.0), ev(3, "Init", "E", 0.05)]  # the memory warpgroup
  r = summarize(trace)
  assert r["steps"] == 4 and r["phases"]["turn"]["count"] == 4
  assert r["phases"]["qk"]["per_step"] == pytest.approx(400) and r["phases"]["turn"]["mean"] == pytest.approx(200)
  assert r["phases"]["softmax"]["count"] == 8 and r["phases"]["softmax"]["mean"] == pytest.approx(500)
  assert r["phases"]["softmax"]["per_step"] == pytest.approx(1000)
  assert r["step_cycles"] == pytest.approx(400 + 1000 + 500)          # 'turn' is inside 'qk', 'Init' is no phase
  assert "| fp8 | 2048 | 4 | 400 | 200 | 1000 | - | - | 500 | 1900 |" in table([dict(kernel="fp8", keys=2048, **r)])
  with pytest.raises(ValueError, match="does not close"):
    summarize([ev(1, "qk", "B", 0.0), ev(1, "pv", "E", 1.0)])
  with pytest.raises(ValueError, match="never ends"):
    summarize([ev(1, "qk", "B", 0.0)])


def test_check_exact_over_the_last_positions_and_with_fp8_weights(tmp_path):
  # One run of the tool for two claims (its start and the float32 oracle are most of the time).
  # 1. float32 weights and cache: each of the last 3 positions, reached through the prefix cache's pages, matches
  # the oracle's logits at the same position (a shift by one position would not).
  # 2. '+fp8w' quantizes the weights at load (prefill chunks of 96 and 128 rows, over lcjax.ops.linear's
  # WIDEN_MAX_ROWS: the fp8 x fp8 product); the oracle and the first entry keep them as drawn, so float32 still
  # matches the oracle and fp8 weights differ by e4m3's error.
  _run("check_exact.py", "--preset=tiny", "--contexts=96,200", "--caches=float32,float32+fp8w", "--positions=3",
       "--dtype=float32", "--prefill_chunk=128", "--page_size=16", f"--out={tmp_path}", "--name=ex")
  res = json.load(open(tmp_path / "ex.json"))
  rows = {(r["S"], r["cache"]): r for r in res["rows"]}
  assert sorted(rows) == [(S, c) for S in (96, 200) for c in ("float32", "float32+fp8w")]
  for S in (96, 200):
    r = rows[S, "float32"]
    m = r["vs_oracle"]
    assert m["positions"] == 3 and m["top1"] == 1.0 and m["rel_max"] < 1e-5 and m["kl_max"] < 1e-9, r
    assert r["weights"] == "float32"
    fp8 = rows[S, "float32+fp8w"]
    assert fp8["weights"].startswith("float8_e4m3fn") and fp8["vs_oracle"]["positions"] == 3
    assert 1e-3 < fp8["vs_oracle"]["rel_max"] < 0.1 and fp8["vs_oracle"]["kl"] < 1e-2, fp8
    assert fp8["vs_float32"]["rel_max"] == pytest.approx(fp8["vs_oracle"]["rel_max"], rel=0.05)
  assert "| 200 | float32 | oracle |" in (tmp_path / "ex.md").read_text()


# What every end-to-end row says ran, as a result's stats name it (lcjax.Engine.kernels).
KERNEL_KEYS = {"attention", "prefill_kernel", "decode_kernel", "page_write", "linear"}


def test_profile_step_counts_kernel_calls_a_layer():
  """profile_step's per-line report: device ms, kinds and kernel calls a token and a layer, over the traced tokens,
  from a trace line's {kernel: [total ns, count]} (on the CPU the trace has no device line to count)."""
  from tools.benchlib import line_report
  evs = {"gemv": [8e6, 64], "attention": [4e6, 16], "norm": [1e6, 48]}
  rep = line_report(evs, per=4, layers=2)
  assert (rep["events"], rep["calls_per_token"], rep["calls_per_layer"]) == (3, 32.0, 16.0), rep
  assert rep["total_ms_per_token"] == pytest.approx(3.25)
  assert [k["name"] for k in rep["kernels"]] == ["gemv", "attention", "norm"]
  assert rep["kernels"][0]["calls_per_token"] == 16.0 and rep["kernels"][0]["share"] == pytest.approx(8 / 13)


def test_profile_step_reports(tmp_path):
  p = _run("profile_step.py", "--preset=tiny", "--context=200", "--steps=4", "--page_size=16",
           "--prefill_chunk=128", "--weight_dtype=float8_e4m3fn", "--cache_dtype=float8_e4m3fn",
           "--page_write=pallas-interpret", f"--out={tmp_path}", "--name=prof")
  rep = json.load(open(tmp_path / "prof.json"))
  assert rep["context"] == 200 and rep["wall_ms_per_token"] > 0 and rep["attention"] == "reference"
  assert rep["weight_dtype"].startswith("float8_e4m3fn") and "widened" in rep["linear"], rep
  assert (rep["cache_dtype"], rep["page_write"]) == ("float8_e4m3fn", "pallas-interpret"), rep
  assert rep["decode_kernel"] == "reference" and KERNEL_KEYS <= set(rep), rep
  assert "decode at 200" in p.stdout
  p = _run("profile_step.py", "--preset=tiny", "--context=200", "--phase=prefill", "--page_size=16",
           "--prefill_chunk=128", f"--out={tmp_path}", "--name=pre")
  rep = json.load(open(tmp_path / "pre.json"))
  assert rep["phase"] == "prefill" and rep["wall_ms_per_token"] > 0 and "prefill at 200" in p.stdout
  assert rep["cached_tokens"] == 0
  # a question after a cached context: only the question's tokens (and the context's last partial page) prefilled
  p = _run("profile_step.py", "--preset=tiny", "--context=200", "--phase=question", "--question=40", "--page_size=16",
           "--prefill_chunk=128", f"--out={tmp_path}", "--name=q")
  rep = json.load(open(tmp_path / "q.json"))
  assert (rep["phase"], rep["per"], rep["question"], rep["cached_tokens"]) == ("question", "question", 40, 192), rep
  assert rep["wall_ms_per_token"] > 0 and "question of 40 after 200" in p.stdout
  # --decode_kernel and --prefill_kernel reach RunConfig: on the CPU's reference backend both are refused
  for flag, refusal in (("--decode_kernel=mosaic", "decode_kernel='mosaic' picks among the pallas backend's"),
                        ("--prefill_kernel=mosaic", "prefill_kernel='mosaic' picks what reads the pages")):
    p = _tool("profile_step.py", "--preset=tiny", "--context=200", "--page_size=16", flag, f"--out={tmp_path}")
    assert p.returncode != 0 and refusal in p.stderr, p.stderr[-2000:]


def test_bench_multigpu_extrapolates_measured_rows(tmp_path):
  """--measured: predictions from a one-device results file, labelled, never run; a file of another model is
  refused."""
  src = tmp_path / "one.json"
  src.write_text(json.dumps(dict(device="GPU X", versions={}, model=dict(preset="tiny", layers=None), rows=[
      dict(impl="lcjax", S=4096, prefill_s=2.0, decode_ms_per_token=4.0, peak_gib=1.0)])))
  _run("bench_multigpu.py", "--preset=tiny", f"--measured={src}", "--predict_meshes=2x1,1x2",
       "--predict_contexts=4096", "--contexts=4096", f"--out={tmp_path}", "--name=pred")
  res = json.load(open(tmp_path / "pred.json"))
  pred = [r for r in res["rows"] if r["predicted"]]
  assert sorted((r["tensor"], r["seq"]) for r in pred) == [(1, 2), (2, 1)]
  assert all(r["prefill_s"] < 2.0 and r["peak_gib"] is None for r in pred)
  assert "measured on GPU X" in res["device"]
  p = _tool("bench_multigpu.py", "--preset=llama3-8b", f"--measured={src}", f"--out={tmp_path}")
  assert p.returncode != 0 and "measured preset=tiny" in p.stderr


def test_bench_multigpu_refuses_meshes_larger_than_the_machine(tmp_path):
  """A mesh of more devices than the machine has is refused in one line before any worker runs (the 2- and 8-GPU
  steps of reproduce_h200.sh on a machine of one GPU); fp8 weights and an fp8 cache are flags of the rows."""
  p = _tool("bench_multigpu.py", "--preset=tiny", "--meshes=2x1,1x2", "--contexts=256", "--cache_dtype=float8_e4m3fn",
            "--weight_dtype=float8_e4m3fn", f"--out={tmp_path}", "--name=m")
  assert p.returncode != 0
  assert "the meshes 2x1,1x2 need 2 devices and this machine has 0 GPUs" in p.stderr, p.stderr[-1000:]
  assert not (tmp_path / "m.json").exists()


def test_is_oom_tells_memory_from_a_kernel_launch_limit():
  """Both come as RESOURCE_EXHAUSTED; a benchmark row must say OOM only for the first (a 2x H200 run recorded a
  Pallas kernel's shared-memory overflow as five OOM rows)."""
  sys.path.insert(0, REPO)
  from tools.benchlib import is_oom
  assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes."))
  assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 128.00 GiB"))
  assert not is_oom(RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 274452, "
                                 "available: 232448, context: []"))
  assert not is_oom(ValueError("page_size=100 must be a power of two"))


def test_bench_longctx_rows_and_plots(tmp_path):
  """The long-context benchmark end to end on the CPU (the HF peer needs CUDA): the results file's keys, a row per
  (impl, context) with the median of its --repeats runs, the planner beside lcjax rows only (it does not model the
  dense baseline), timed runs that made no program (the warm-up compiled the chunk that reads a prefix), and both
  plots."""
  _run("bench_longctx.py", "--preset=tiny", "--contexts=256", "--impls=lcjax,dense", "--decode_steps=4",
       "--prefill_chunk=128", "--page_size=16", "--repeats=2", f"--out={tmp_path}", "--name=lc")
  res = json.load(open(tmp_path / "lc.json"))
  assert {"device", "versions", "command", "date", "model", "rows"} <= set(res)
  rows = {r["impl"]: r for r in res["rows"]}
  assert len(res["rows"]) == 2 and set(rows) == {"lcjax", "dense"}
  assert all(r["S"] == 256 and r["oom"] is False for r in rows.values())
  assert all(r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0 for r in rows.values())
  for r in rows.values():   # --repeats=2: each row is the median (mean) of its two runs, both kept
    assert len(r["prefill_s_runs"]) == len(r["decode_ms_runs"]) == 2, r
    assert r["prefill_s"] == pytest.approx(sum(r["prefill_s_runs"]) / 2)
    assert r["decode_ms_per_token"] == pytest.approx(sum(r["decode_ms_runs"]) / 2)
  assert "median of 2: prefill" in (tmp_path / "lc.md").read_text()
  assert rows["lcjax"]["planned_gib"] > 0 and rows["dense"]["planned_gib"] is None
  assert rows["lcjax"]["timed_compile_s"] == 0 and "note" not in rows["lcjax"], rows["lcjax"]
  assert all(KERNEL_KEYS <= set(r) for r in rows.values()), rows
  assert (tmp_path / "lc-memory.png").stat().st_size > 0 and (tmp_path / "lc-prefill.png").stat().st_size > 0


def test_bench_context_times_no_compilation(tmp_path):
  """The context benchmark on the tiny preset, a document of three full chunks and a partial one (so its full
  chunks that read a prefix run a program its short warm-up prompt does not): the timed prefill and question make
  no program, and the answers after the host and disk round trips and a cold prefill equal the first."""
  _run("bench_context.py", "--preset=tiny", "--contexts=400", "--prefill_chunk=128", "--page_size=16",
       "--question=20", "--answer=4", "--dtype=float32", f"--tmp={tmp_path}", f"--out={tmp_path}", "--name=cx")
  (row,) = json.load(open(tmp_path / "cx.json"))["rows"]
  assert "error" not in row, row
  assert row["prefill_compile_s"] == 0 and row["ttft_compile_s"] == 0, row
  assert row["answers_match"] is True and row["prefill_s"] > 0 and row["ttft_s"] > 0
  assert "compilation" not in (tmp_path / "cx.md").read_text()


def test_bench_startup_cold_then_warm_cache(tmp_path):
  """Two fresh CLI starts on one cache directory: the first compiles every program and writes it, the second
  reads every one back (the CLI's own count, parsed from its stats table)."""
  # A named directory is used although the suite's processes name the run's cache in JAX_COMPILATION_CACHE_DIR.
  _run("bench_startup.py", "--preset=tiny", "--modes=on", "--prompt_tokens=40", "--max_new_tokens=2",
       f"--cache_dir={tmp_path / 'cache'}", f"--out={tmp_path}", "--name=st")
  rows = {r["mode"]: r for r in json.load(open(tmp_path / "st.json"))["rows"]}
  cold, warm = rows["on, cold"], rows["on, warm"]
  n = cold["programs_compiled_through_cache"]
  assert n > 0 and cold["programs_read"] == 0 and cold["cache_files"] >= n
  assert warm["programs_read"] == warm["programs_compiled_through_cache"] == n
  assert all(r["wall_s"] > 0 and r["warmup_s"] > 0 and r["decode_ms_per_token"] > 0 for r in rows.values())
  assert "| on, warm |" in (tmp_path / "st.md").read_text()


def test_bench_stream_rows(tmp_path):
  """Per-token decode cost of each number of decode steps per call, on a pinned context (every token generated:
  random weights have no EOS)."""
  _run("bench_stream.py", "--preset=tiny", "--contexts=100", "--tokens=9", "--steps=4,1", "--repeats=1",
       "--prefill_chunk=64", "--page_size=16", f"--out={tmp_path}", "--name=bs")
  rows = json.load(open(tmp_path / "bs.json"))["rows"]
  assert [(r["S"], r["steps"], r["tokens"]) for r in rows] == [(100, 1, 9), (100, 4, 9)]
  assert all(r["wall_ms_per_token"] > 0 and r["calls_ms_per_token"] > 0 for r in rows)
  assert rows[1]["vs_largest"] == 1.0 and rows[0]["stream_ms_per_token"] is None
  assert all(KERNEL_KEYS <= set(r) for r in rows), rows
  assert "| 100 | 1 |" in (tmp_path / "bs.md").read_text()


def test_result_files_name_the_source_revision(tmp_path, monkeypatch):
  """write_result records $LCJAX_SOURCE_REVISION when set, else the commit of the checkout (git), else "unknown"."""
  from tools import benchlib
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.delenv(benchlib.SOURCE_ENV, raising=False)
  if os.path.isdir(os.path.join(root, ".git")):
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = benchlib.write_result(str(tmp_path), "a", [], "", device="d", versions_={})
    assert res["source"] in (head, head + "+dirty")
  monkeypatch.setenv(benchlib.SOURCE_ENV, "abc123")              # wins over git: a shipped copy's .git may be stale
  res = benchlib.write_result(str(tmp_path), "b", [{"x": 1}], "| x |", device="d", versions_={})
  assert res["source"] == "abc123" and json.load(open(tmp_path / "b.json"))["source"] == "abc123"
  assert "source: abc123" in (tmp_path / "b.md").read_text()
  monkeypatch.delenv(benchlib.SOURCE_ENV)
  monkeypatch.setattr(benchlib.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
  assert benchlib.source_revision() == "unknown"


def test_versions_of_modules_a_run_did_not_import_come_from_their_metadata():
  """benchlib.versions() imports none of the modules it reports (a tool that never uses torch does not pay its
  start): the versions are those the modules report once imported (here, in this process), up to a local label
  that a wheel's metadata may leave out (torch's "+cu130" build of 2.13.0 installs as "2.13.0")."""
  import platform
  import flax
  import jax
  import jaxlib
  import torch
  import transformers
  code = ("import json, sys; from tools import benchlib; v = benchlib.versions(); "
          "print(json.dumps([v, [m for m in ('jax', 'jaxlib', 'flax', 'torch', 'transformers') if m in sys.modules]]))")
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  got, imported = json.loads(p.stdout)
  assert imported == []
  public = lambda v: {k: x.split("+")[0] for k, x in v.items()}
  assert public(got) == public({"python": platform.python_version(), "jax": jax.__version__,
                                "jaxlib": jaxlib.__version__, "flax": flax.__version__, "torch": torch.__version__,
                                "transformers": transformers.__version__})
  from tools import benchlib
  assert benchlib.versions(("jax", "no_such_module_here")) == {"python": platform.python_version(),
                                                               "jax": jax.__version__}


def test_variant_entries_name_cache_attention_and_weight_dtypes():
  from lcjax.config import RunConfig
  from tools import benchlib
  plain = dict(attention_dtype="auto", weight_dtype="auto", prefill_kernel="auto")
  assert benchlib.variant("float8_e4m3fn") == dict(plain, cache_dtype="float8_e4m3fn")
  assert benchlib.variant("bfloat16+fp8attn") == dict(plain, cache_dtype="bfloat16", attention_dtype="float8_e4m3fn")
  assert benchlib.variant("bfloat16+int8attn") == dict(plain, cache_dtype="bfloat16", attention_dtype="int8_fp8")
  assert benchlib.variant("auto+fp8w") == dict(plain, cache_dtype="auto", weight_dtype="float8_e4m3fn")
  assert benchlib.variant("float8_e4m3fn+fp8w+fp8attn") == dict(cache_dtype="float8_e4m3fn",
                                                                attention_dtype="float8_e4m3fn",
                                                                weight_dtype="float8_e4m3fn", prefill_kernel="auto")
  assert benchlib.variant("bfloat16+cudnnprefill") == dict(plain, cache_dtype="bfloat16", prefill_kernel="cudnn")
  for entry in ("bfloat16", "float8_e4m3fn+fp8attn", "float8_e4m3fn+int8attn", "bfloat16+int8attn+fp8w",
                "bfloat16+cudnnprefill"):
    RunConfig(**benchlib.variant(entry))                       # each one a valid config
  with pytest.raises(ValueError, match="'bfloat16\\+fp4attn'"):
    benchlib.variant("bfloat16+fp4attn")
  with pytest.raises(ValueError, match="\\+fp8attn and \\+int8attn both set attention_dtype"):
    benchlib.variant("bfloat16+fp8attn+int8attn")


def test_check_fp8_model_rows_on_the_outlier_test(tmp_path):
  """FA3's outlier test through the FP8 kernel's jnp model: every 8-bit row measured against float32, the
  rotation lowering e4m3's error and int8 Q K^T lowering it further (seeded inputs: deterministic)."""
  _run("check_fp8.py", "--model", "--contexts=256", f"--out={tmp_path}", "--name=q")
  rows = {r["impl"]: r["rmse"] for r in json.load(open(tmp_path / "q.json"))["rows"]}
  e4m3, plain, int8 = (rows[f"lcjax-pallas-{n} [jnp model]"]
                       for n in ("fp8 (rotation)", "fp8 (no rotation)", "int8-fp8 (rotation)"))
  assert 1e-3 < int8 < e4m3 < plain < 0.05, rows


def test_bench_lengths_rows_and_check(tmp_path):
  """The length sweep end to end on the CPU: a row per document and question length with its padded chunks, one
  check per sweep (CPU timings are noise, so the tolerance is wide here); and the check itself on planted times."""
  _run("bench_lengths.py", "--preset=tiny", "--variants=bfloat16", "--documents=100,128", "--questions=16,40",
       "--context=64", "--reps=1", "--document_reps=2", "--max_context=256", "--prefill_chunk=64", "--page_size=16",
       "--tolerance=1000", f"--out={tmp_path}", "--name=bl")
  res = json.load(open(tmp_path / "bl.json"))
  got = [(r["kind"], r["tokens"], r["chunks"]) for r in res["rows"]]
  assert got == [("document", 100, [64]), ("document", 128, [64]), ("question", 16, [16]), ("question", 40, [64])]
  # The engine is as long as --max_context says (its page table's width sets what a prefix read costs).
  assert [(r["max_context"], len(r["all_s"])) for r in res["rows"] if r["kind"] == "document"] == [(256, 2)] * 2
  assert all(r["seconds"] > 0 and KERNEL_KEYS <= set(r) for r in res["rows"])
  assert [(c["kind"], c["monotone"]) for c in res["checks"]] == [("document", True), ("question", True)]
  from tools.benchlib import monotone_violations
  assert monotone_violations([(100, 1.0), (200, 2.0), (300, 2.05)], 1.05) == []
  assert monotone_violations([(200, 2.2), (100, 1.0), (300, 2.0)], 1.05) == [
      dict(shorter=200, longer=300, shorter_s=2.2, longer_s=2.0)]


def test_bench_speculation_cost_rows(tmp_path):
  """The verify-step cost task end to end on the CPU: a row per (cache dtype, context, batch, k, drafts fed), k = 0
  the plain step through the same entry, then a step that fed no draft, then one that fed k; the plain step's
  ratio is 1 and the kernels that ran are named."""
  _run("bench_speculation.py", "--task=cost", "--preset=tiny", "--variants=float32,float8_e4m3fn", "--contexts=100",
       "--batches=1,2", "--draft_tokens=3", "--reps=2", "--page_size=16", f"--out={tmp_path}", "--name=sc")
  rows = json.load(open(tmp_path / "sc.json"))["rows"]
  assert [(r["variant"], r["batch"], r["k"], r["drafts_fed"]) for r in rows] == [
      (v, b, k, fed) for v in ("float32", "float8_e4m3fn") for b in (1, 2) for k, fed in ((0, 0), (3, 0), (3, 3))]
  assert all(r["step_ms"] > 0 and r["plain_decode_ms_per_token"] > 0 for r in rows)
  assert all(r["step_over_plain_step"] == 1.0 for r in rows if r["k"] == 0)
  assert {r["kernels"]["page_write"] for r in rows} == {"xla"} and all(r["kernels"]["attention"] for r in rows)


def test_bench_attention_pages_hold_a_length_that_is_no_multiple_of_the_page():
  """tools/bench_attention.py's decode pages for S keys: each sequence's table holds ceil(S / Z) distinct pages of
  the pool, so kv_len = S stays inside it (S // Z pages sent cuDNN past the table at S = 100,000). In a process
  of its own: the tool defines absl flags that other tools imported here define too."""
  code = ("import json, jax, numpy as np; from tools import bench_attention as b; "
          "q, kp, vp, t, ks, vs = b.pages(jax.random.key(0), 100, 64, True, B=3); "
          "print(json.dumps([t.shape, kp.shape[:2], ks.shape, sorted(np.asarray(t).ravel().tolist()), b.K]))")
  p = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  table, pool, scales, ids, K = json.loads(p.stdout.strip().splitlines()[-1])
  assert (table, pool, scales, ids) == ([3, 2], [6, 64], [6, K], list(range(6)))


def test_bench_attention_decode_rows_check_a_call_after_the_timed_ones(tmp_path):
  """tools/bench_attention.py's decode rows: the check before the timing sees an impl's first call only; the call
  after its timed ones is compared with the same impl's call before them (rel_err_after_timing) and with the first
  impl of the same page dtype (rel_err_vs_first_impl). An impl whose output drifts from call to call passes the
  check and is caught by both. On the CPU, with the jnp reference as both impls."""
  code = f"""
import json, jax, jax.numpy as jnp, numpy as np
from absl import flags
from jax.experimental import io_callback
from tools import bench_attention as b
from lcjax.ops import attention as ref
flags.FLAGS(["bench_attention", "--batch=1", "--pages=64"])
b.N, b.K = 8, 2                       # the module's heads (main() sets them from --heads): a small shape
calls = []
def count():
  calls.append(1)
  return np.float32(0.1 * (len(calls) - 1))
def reference(q, kp, vp, t, qp, kl, ks, vs):
  return ref.paged_attention_reference(q, kp, vp, t, q_pos=qp, kv_len=kl, k_scale=ks, v_scale=vs)
def drifts(*a):
  o, l = reference(*a)
  return o * (1 + io_callback(count, jax.ShapeDtypeStruct((), jnp.float32))), l
b.decode_impls = lambda: {{"reference": (True, True, reference), "drifts": (True, True, drifts)}}
res = b.Results({str(tmp_path)!r}, "attention-cpu")
b.bench_decode(res, b.Watchdog(300, res), [256], [64], 2, batches=(1,))
print(json.dumps([[r["impl"], r["rel_err"], r["rel_err_after_timing"], r["rel_err_vs_first_impl"]]
                  for r in res.rows]))
"""
  p = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  rows = {name: (err, again, agree) for name, err, again, agree in json.loads(p.stdout.strip().splitlines()[-1])}
  assert rows["reference"][0] < 1e-6 and rows["reference"][1] < 1e-6 and rows["reference"][2] is None
  err, again, agree = rows["drifts"]
  assert err < 1e-6                                     # its first call: the check before the timing passes
  assert again is not None and again > 0.05             # calls after the first scale the output by 1 + 0.1 each
  assert agree is not None and agree > 0.1


def test_chained_calls_run_in_one_program_in_order():
  """benchlib.chained(fn, n): n calls of fn in one compiled program, each after the one before (its first argument
  depends on the previous output, so XLA neither merges nor reorders them); every output."""
  import jax.numpy as jnp
  import numpy as np
  from tools import benchlib
  traced = []

  def fn(q, x):
    traced.append(q.shape)
    return q * 2.0 + x

  chain = benchlib.chained(fn, 3)
  q, x = jnp.ones(4), jnp.full(4, 0.5)
  outs = chain(q, x)
  assert len(outs) == 3 and all(np.array_equal(np.asarray(o), np.full(4, 2.5)) for o in outs)
  assert len(traced) == 3
  hlo = chain.lower(q, x).compile().as_text()
  assert hlo.count("multiply(") >= 3 and "copy(" not in hlo, hlo         # three products, none reused
  # an infinite first element leaves the next query as it was (no 0 * inf); an integer output still chains
  inf = jnp.ones(4).at[0].set(jnp.inf)
  outs = benchlib.chained(lambda q, x: (q * x, None), 3)(jnp.ones(4), inf)
  assert all(np.array_equal(np.asarray(o[0]), np.asarray(inf)) for o in outs)
  counts = benchlib.chained(lambda q, x: (q > x).sum(), 3)
  hlo = counts.lower(q, x).compile().as_text()
  assert "copy(" not in hlo and len(set(int(c) for c in counts(q, x))) == 1, hlo
  with pytest.raises(ValueError, match="n=0 must be at least 1"):
    benchlib.chained(fn, 0)
