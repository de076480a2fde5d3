"""An FP8-Dynamic compressed-tensors folder made by llm-compressor from an HF LLaMA folder:

  python tools/quantize_fp8_dynamic.py SRC DST

llm-compressor's `oneshot` with QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]):
e4m3 weights with one scale per output channel, activations quantized per token at run time (no calibration
data). Run it with a Python that has `llmcompressor` installed; its transformers pin may differ from the one
lcjax's tests use (tools/eval_fp8_weights.py runs it as a subprocess for that reason). Imports nothing of lcjax.
"""
from __future__ import annotations

import os
import shutil
import sys

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def quantize(src: str, dst: str) -> None:
  import torch
  import transformers
  from llmcompressor import oneshot
  from llmcompressor.modifiers.quantization import QuantizationModifier
  if os.path.exists(dst):
    raise SystemExit(f"error: {dst} exists; give a new folder")
  model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
  oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
  model.save_pretrained(dst, save_compressed=True)
  for name in TOKENIZER_FILES:              # not read by llm-compressor; copied so the folder is complete
    if os.path.exists(os.path.join(src, name)):
      shutil.copy(os.path.join(src, name), os.path.join(dst, name))
  import llmcompressor
  print(f"llmcompressor {llmcompressor.__version__}, transformers {transformers.__version__}: wrote {dst}")


if __name__ == "__main__":
  if len(sys.argv) != 3:
    raise SystemExit(f"usage: {sys.argv[0]} SRC DST (got {sys.argv[1:]})")
  quantize(sys.argv[1], sys.argv[2])
