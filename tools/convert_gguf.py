"""Convert a llama-architecture GGUF file (any quantization) to an lcjax checkpoint with its tokenizer.

  python tools/convert_gguf.py --src=FILE.gguf --dst=CKPT_DIR [--dtype=float32] [--overwrite]
"""
from __future__ import annotations

import sys

from absl import app, flags, logging

from lcjax.checkpoint import CheckpointError, convert_gguf

FLAGS = flags.FLAGS
flags.DEFINE_string("src", None, "GGUF file.", required=True)
flags.DEFINE_string("dst", None, "lcjax checkpoint directory to create.", required=True)
flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float16", "float32"], "Dtype of the dequantized tensors.")
flags.DEFINE_bool("overwrite", False, "Replace an existing DST.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every item it writes at INFO
  try:
    stats = convert_gguf(FLAGS.src, FLAGS.dst, dtype=FLAGS.dtype, overwrite=FLAGS.overwrite)
  except CheckpointError as e:
    print(f"convert_gguf: error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {FLAGS.dst}: {stats['tensors']} tensors in {stats['seconds']:.1f} s")
  return 0


if __name__ == "__main__":
  app.run(main)
