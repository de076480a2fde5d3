"""Merge the H200 long-context calls into benchmarks/results/longctx-h200.{json,md} and its plots.

  python benchmarks/runs/merge_longctx.py

Each row keeps the call that measured it (`call`, the per-call file beside it holds that call's command, device
and versions, and its peer measured in the same call). `planned_gib` is recomputed by the planner at HEAD (the
calls' own values predate its calibration). The one predicted row (Llama-3-8B with all 32 layers at 1M tokens,
fp8 KV) is labelled `predicted: true` and says how it was extrapolated from the measured 8-layer run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from lcjax.config import preset  # noqa: E402
from lcjax.engine import plan as planlib  # noqa: E402
from tools.bench_longctx import markdown, plot, run_config  # noqa: E402

RES = os.path.join(REPO, "benchmarks", "results")
GiB = 1024 ** 3
# (call, file, rows taken from it): call B is the newest full-model call; call A adds 8K, 256K and the dense
# baseline; call G the 1M fp8 run with 8 of the 32 layers.
SOURCES = [("B", "longctx-h200-b.json", None),
           ("A", "longctx-h200-a.json", lambda r: r["S"] in (8192, 262144) or r["impl"] == "dense"),
           ("G", "longctx-h200-g-8layers.json", None)]


def planned(impl: str, S: int, model: dict) -> float:
  """The planner at HEAD for a row of a call whose `model` settings (layers, page, chunk, decode steps) it ran."""
  cfg = preset("llama3-8b")
  cfg = dataclasses.replace(cfg, n_layers=model.get("layers") or cfg.n_layers,
                            max_position=max(cfg.max_position, S))
  return planlib.plan(cfg, _run(impl, S, model)).total / GiB


def _run(impl: str, S: int, model: dict):
  return run_config(impl, S, page_size=model["page_size"], decode_steps=model["decode_steps"],
                    prefill_chunk=model["prefill_chunk"])


def main():
  rows, calls, models = [], {}, {}
  for call, fname, keep in SOURCES:
    d = json.load(open(os.path.join(RES, fname)))
    models[call] = d["model"]
    calls[call] = dict(file=fname, command=d["command"], date=d["date"], device=d["device"], versions=d["versions"])
    layers = d["model"].get("layers")
    for r in d["rows"]:
      if keep is not None and not keep(r):
        continue
      r = dict(r, call=call)
      if layers:
        r["layers"] = layers
        r["impl"] = f"{r['impl']} ({layers} of 32 layers)"
      if call == "A" and r["impl"] == "lcjax":
        r["note"] = "call A: decode before call B's pool-view fix"
      if r["impl"].startswith("lcjax") and not r.get("oom"):
        r["planned_gib"] = planned(r["impl"].split()[0], r["S"], d["model"])
      rows.append(r)

  # Llama-3-8B, 32 layers, 1M tokens, fp8 KV: extrapolated from the 8-layer run of call G.
  g = next(r for r in rows if r["call"] == "G")
  cfg32 = dataclasses.replace(preset("llama3-8b"), max_position=1 << 21)
  cfg8 = dataclasses.replace(cfg32, n_layers=8)
  S = g["S"]
  flops = planlib.prefill_flops(cfg32, S) / planlib.prefill_flops(cfg8, S)
  g_run = _run("lcjax-fp8kv", S, models["G"])
  p8, p32 = planlib.plan(cfg8, g_run), planlib.plan(cfg32, g_run)
  bytes_ratio = (p32.weights + p32.kv_cache) / (p8.weights + p8.kv_cache)
  rows.append(dict(impl="lcjax-fp8kv (predicted)", S=S, predicted=True, oom=False, call="G", note="predicted",
                   prefill_s=g["prefill_s"] * flops, prefill_tflops=g["prefill_tflops"],
                   decode_ms_per_token=g["decode_ms_per_token"] * bytes_ratio, peak_gib=None,
                   planned_gib=p32.total / GiB,
                   method=(f"prefill: the 8-layer run's time x its FLOP ratio ({flops:.2f}) at its measured "
                           f"{g['prefill_tflops']:.0f} TFLOP/s; decode: x the ratio of bytes read per token "
                           f"(weights + KV, {bytes_ratio:.2f}); memory: the planner, which matched the 8-layer "
                           f"run's peak within {abs(g['peak_gib'] - g['planned_gib']) / g['peak_gib']:.1%}")))
  # Decode after the cuBLAS + dynamic-slice-fusion change (commit of call F), measured by tools/profile_step.py.
  prof = json.load(open(os.path.join(RES, "decode-profile", "dec-128k-cublas.json")))
  updates = [dict(S=prof["context"], decode_ms_per_token=prof["wall_ms_per_token"], call="F",
                  floor_ms_per_token=prof["floor_ms_per_token"],
                  command="tools/profile_step.py --context=131072 --steps=16 --top=8",
                  note="decode loop compiled with xla_gpu_enable_dynamic_slice_fusion + cuBLAS; was 16.36 ms "
                       "(call B)")]
  rows.sort(key=lambda r: (r["impl"], r["S"]))
  result = dict(device=calls["B"]["device"], versions=calls["B"]["versions"],
                command="python benchmarks/runs/merge_longctx.py (merging the calls below)", calls=calls,
                date=calls["G"]["date"],
                model=dict(preset="llama3-8b", dtype="bfloat16", weights="random", batch=1, decode_steps=32,
                           prefill_chunk=32768, page_size=64),
                rows=rows, decode_after_fix=updates,
                baselines_md=dict(hf_512k_prefill_s=161.9, hf_512k_decode_ms=111, hf_512k_peak_gib=137,
                                  source="../shared/BASELINES.md (HF at 512K was not run in these calls)"))
  table = markdown(rows)
  # lcjax / HF per length, both from the same call.
  ratios = []
  for r in rows:
    h = next((x for x in rows if x["impl"] == "hf" and x["S"] == r["S"] and x["call"] == r["call"]
              and x.get("prefill_s")), None)
    if r["impl"] == "lcjax" and r.get("prefill_s") and h:
      div = lambda k: r[k] / h[k] if r.get(k) and h.get(k) else None
      ratios.append(dict(S=r["S"], call=r["call"], prefill=div("prefill_s"), decode=div("decode_ms_per_token"),
                         peak=div("peak_gib"), note=r.get("note")))
  result["ratios_lcjax_over_hf"] = ratios
  with open(os.path.join(RES, "longctx-h200.json"), "w") as f:
    json.dump(result, f, indent=1)
  fmt = lambda x: "-" if x is None else f"{x:.2f}"
  table += ("\n\nlcjax / HF, same call:\n\n| S | call | prefill | decode | peak | note |\n|---|---|---|---|---|---|\n"
            + "\n".join(f"| {q['S']:,} | {q['call']} | {fmt(q['prefill'])} | {fmt(q['decode'])} | {fmt(q['peak'])} "
                        f"| {q['note'] or ''} |" for q in ratios))
  lines = ["# longctx-h200: Llama-3-8B shape, random bf16 weights, batch 1, one H200", "",
           "Merged from the calls below by `python benchmarks/runs/merge_longctx.py`; each row's `call` names the "
           "run that measured it, with its peer (HF) measured in the same call. planned GiB: the planner at HEAD.",
           ""]
  for c, v in calls.items():
    lines.append(f"- call {c} ({v['date']}): `{v['command']}` ({v['file']})")
  lines += ["", table, "",
            f"Decode after the change of call F (cuBLAS with dynamic-slice fusion in the decode loop): "
            f"{updates[0]['decode_ms_per_token']:.2f} ms/token at 128K (floor {updates[0]['floor_ms_per_token']:.2f};"
            " call B: 16.36).", "",
            "Predicted row: " + rows[[r.get('predicted') for r in rows].index(True)]["method"] + "."]
  with open(os.path.join(RES, "longctx-h200.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  device_gib = float(calls["B"]["device"].split(",")[1].split()[0]) / 1024
  plot([r for r in rows], os.path.join(RES, "longctx-h200"), device_gib)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
