"""One H200: bfloat16, 16K prefill chunks, the fastest measured attention backend."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import default  # noqa: E402


def get_config():
  c = default.get_config()
  c.dtype = "bfloat16"
  c.max_context = 0          # the model's trained context
  c.prefill_chunk = 16384
  c.decode_steps = 128
  c.decode_sync_every = 1
  return c
