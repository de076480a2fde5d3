"""The defaults of lcjax.config.RunConfig as a config file: dtype "auto" (bfloat16 on a GPU, float32 on a CPU),
the checkpoint's trained context, 2K prefill chunks, the prefix cache on.

Every field is a RunConfig field (lcjax/config.py); override any on the command line, e.g.
`--config=configs/default.py --config.page_size=128`.
"""
import dataclasses

import ml_collections

from lcjax.config import RunConfig


def get_config():
  return ml_collections.ConfigDict(dataclasses.asdict(RunConfig()))
