"""CPU-friendly defaults: the bundled SmolLM2-135M, float32, 2K prefill chunks.

Every field is a RunConfig field (lcjax/config.py); override any on the command line, e.g.
`--config=configs/default.py --config.page_size=128`.
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.dtype = "float32"
  c.cache_dtype = "auto"
  c.page_size = 64
  c.num_pages = 0
  c.max_context = 8192
  c.max_batch = 4
  c.prefill_chunk = 2048
  c.decode_steps = 32
  c.decode_sync_every = 1
  c.attention = "auto"
  c.tensor = 1
  c.seq = 1
  c.sp_mode = "ring"
  return c
