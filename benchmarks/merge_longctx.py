"""Merge the H200 long-context calls into benchmarks/results/longctx-h200.{json,md} and its plots.

  python benchmarks/merge_longctx.py [DIR]      # DIR: where the runs are and the merge goes (default: benchmarks/results)

Each row keeps the call that measured it (`call`, the per-call file beside it holds that call's command, device
and versions, and its peer measured in the same call). `planned_gib` is recomputed by the planner at HEAD (every
merged call ran code whose memory the planner at HEAD models). The one predicted row (Llama-3-8B with all 32 layers
at 1M tokens, fp8 KV) is labelled `predicted: true` and says how it was extrapolated from the measured 8-layer run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from lcjax.config import preset  # noqa: E402
from lcjax.engine import plan as planlib  # noqa: E402
from lcjax import plot  # noqa: E402
from tools.bench_longctx import IMPLIED_OOM, markdown, run_config  # noqa: E402

RES = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "benchmarks", "results")
GiB = 1024 ** 3
# (call, file, implementations taken from it or None for all, contexts taken from it or None for all).
# Session 5 (one Pallas kernel joins the split partials, the page offset read in the kernel, greedy batches decode
# without the sampler's sort): call W is the 8K-128K sweep with HF, call V's 256K row with HF (V ran on a machine
# ~3% slow on everything, HF included). Session 4 (fused projections, grouped decode loop): call Q 512K with HF,
# call O the 1M fp8 run with 8 of the 32 layers (fp8 prefix read in 128K-key blocks). The dense baseline's rows
# come from session 3's call J (8K ran, OOM from 32K: the dense path did not change since). Older calls stay in
# their own files and benchmarks/NOTES-longctx.md.
SOURCES = [("W", "longctx-h200-w.json", None, None), ("V", "longctx-h200-v.json", None, {262144}),
           ("Q", "longctx-h200-q.json", None, None), ("O", "longctx-h200-o-8layers.json", None, None),
           ("J", "longctx-h200-j.json", {"dense"}, None)]
# The issue's goals (one H200, Llama-3-8B shape, batch 1, peers in the same call).
GOALS = dict(prefill_over_hf={131072: 0.85, 262144: 0.85, 524288: 0.75}, decode_ms={131072: 9.0, 524288: 22.0},
             overhead_gib=4.0)


def planned(impl: str, S: int, model: dict) -> float:
  """The planner at HEAD for a row of a call whose `model` settings (layers, page, chunk, decode steps) it ran."""
  cfg = preset("llama3-8b")
  cfg = dataclasses.replace(cfg, n_layers=model.get("layers") or cfg.n_layers,
                            max_position=max(cfg.max_position, S))
  return planlib.plan(cfg, _run(impl, S, model)).total / GiB


def _run(impl: str, S: int, model: dict):
  return run_config(impl, S, page_size=model["page_size"], decode_steps=model["decode_steps"],
                    prefill_chunk=model["prefill_chunk"])


def _predicted_1m(rows, model_o) -> dict:
  """Llama-3-8B, 32 layers, 1M tokens, fp8 KV: extrapolated from the 8-layer run of call O."""
  o = next(r for r in rows if r["call"] == "O")
  cfg32 = dataclasses.replace(preset("llama3-8b"), max_position=1 << 21)
  cfg8 = dataclasses.replace(cfg32, n_layers=8)
  S = o["S"]
  flops = planlib.prefill_flops(cfg32, S) / planlib.prefill_flops(cfg8, S)
  o_run = _run("lcjax-fp8kv", S, model_o)
  p8, p32 = planlib.plan(cfg8, o_run), planlib.plan(cfg32, o_run)
  bytes_ratio = (p32.weights + p32.kv_cache) / (p8.weights + p8.kv_cache)
  return dict(impl="lcjax-fp8kv (predicted)", S=S, predicted=True, oom=False, call="O", note="predicted",
              prefill_s=o["prefill_s"] * flops, prefill_tflops=o["prefill_tflops"],
              decode_ms_per_token=o["decode_ms_per_token"] * bytes_ratio, peak_gib=None, planned_gib=p32.total / GiB,
              method=(f"prefill: the 8-layer run's time x its FLOP ratio ({flops:.2f}) at its measured "
                      f"{o['prefill_tflops']:.0f} TFLOP/s; decode: x the ratio of bytes read per token "
                      f"(weights + KV, {bytes_ratio:.2f}); memory: the planner at HEAD (16K chunks as call O "
                      f"ran), {(o['planned_gib'] - o['peak_gib']) / o['peak_gib']:+.1%} off that run's "
                      f"measured peak"))


def _goals(rows) -> list[dict]:
  """Each lcjax row against the issue's goals; HF from the same call."""
  out = []
  for r in rows:
    if not r["impl"].startswith("lcjax") or r.get("predicted") or not r.get("prefill_s"):
      continue
    h = next((x for x in rows if x["impl"] == "hf" and x["S"] == r["S"] and x["call"] == r["call"]
              and x.get("prefill_s")), None)
    div = lambda k: r[k] / h[k] if h and r.get(k) and h.get(k) else None
    out.append(dict(impl=r["impl"], S=r["S"], call=r["call"], prefill_over_hf=div("prefill_s"),
                    decode_over_hf=div("decode_ms_per_token"), peak_over_hf=div("peak_gib"),
                    decode_ms=r["decode_ms_per_token"],
                    overhead_gib=r["peak_gib"] - r["weights_gib"] - r["kv_gib"],
                    goal_prefill_over_hf=GOALS["prefill_over_hf"].get(r["S"]),
                    goal_decode_ms=GOALS["decode_ms"].get(r["S"]), goal_overhead_gib=GOALS["overhead_gib"]))
  return out


def main():
  rows, calls, models = [], {}, {}
  for call, fname, impls, contexts in SOURCES:
    d = json.load(open(os.path.join(RES, fname)))
    models[call] = d["model"]
    calls[call] = dict(file=fname, command=d["command"], date=d["date"], device=d["device"], versions=d["versions"])
    layers = d["model"].get("layers")
    oomed = set()
    for r in sorted(d["rows"], key=lambda r: r["S"]):
      if (impls is not None and r["impl"] not in impls) or (contexts is not None and r["S"] not in contexts):
        continue
      r = dict(r, call=call)
      if r.get("oom") and r["impl"] in oomed and not r.get("skipped"):
        r["skipped"] = IMPLIED_OOM          # the bench's rule, for rows of calls made before it labelled them
      if r.get("oom"):
        oomed.add(r["impl"])
      if layers:
        r["layers"] = layers
        r["impl"] = f"{r['impl']} ({layers} of 32 layers)"
      if r["impl"].startswith("lcjax") and not r.get("oom"):
        r["planned_gib"] = planned(r["impl"].split()[0], r["S"], d["model"])
      elif r["impl"] == "dense":
        r.pop("planned_gib", None)   # the planner models lcjax, not the dense baseline's O(S^2) scores
      rows.append(r)
  rows.append(_predicted_1m(rows, models["O"]))
  rows.sort(key=lambda r: (r["impl"], r["S"]))
  goals = _goals(rows)
  first = calls[SOURCES[0][0]]
  result = dict(device=first["device"], versions=first["versions"],
                command="python benchmarks/merge_longctx.py (merging the calls below)", calls=calls,
                date=max(c["date"] for c in calls.values()),
                model=dict(preset="llama3-8b", dtype="bfloat16", weights="random", batch=1, page_size=64,
                           decode_steps={c: m["decode_steps"] for c, m in models.items()},
                           prefill_chunk={c: m["prefill_chunk"] for c, m in models.items()}),
                rows=rows, goals=goals)
  with open(os.path.join(RES, "longctx-h200.json"), "w") as f:
    json.dump(result, f, indent=1)

  fmt = lambda x, spec="{:.2f}": "-" if x is None else spec.format(x)
  lines = ["# longctx-h200: Llama-3-8B shape, random bf16 weights, batch 1, one H200", "",
           "Merged from the calls below by `python benchmarks/merge_longctx.py`; each row's `call` names the "
           "run that measured it, with its peer (HF) measured in the same call. planned GiB: the planner at HEAD.",
           ""]
  for c, v in calls.items():
    lines.append(f"- call {c} ({v['date']}): `{v['command']}` ({v['file']})")
  lines += ["", markdown(rows), "",
            "Against the goals (lcjax / HF from the same call; overhead = peak - weights - KV cache):", "",
            "| impl | S | call | prefill / HF (goal) | decode ms/token (goal) | decode / HF | peak / HF | "
            "overhead GiB (goal) |", "|---|---|---|---|---|---|---|---|"]
  for q in goals:
    lines.append(f"| {q['impl']} | {q['S']:,} | {q['call']} | "
                 f"{fmt(q['prefill_over_hf'])} ({fmt(q['goal_prefill_over_hf'])}) | "
                 f"{fmt(q['decode_ms'], '{:.2f}')} ({fmt(q['goal_decode_ms'], '{:.0f}')}) | "
                 f"{fmt(q['decode_over_hf'])} | {fmt(q['peak_over_hf'])} | "
                 f"{fmt(q['overhead_gib'], '{:.1f}')} ({q['goal_overhead_gib']:.0f}) |")
  lines += ["", "Predicted row: " + next(r for r in rows if r.get("predicted"))["method"] + "."]
  with open(os.path.join(RES, "longctx-h200.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  plot.save_figures(result, os.path.join(RES, "longctx-h200"))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
