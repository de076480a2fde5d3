"""Convert an HF LLaMA folder (config.json, safetensors shards, tokenizer files) to an lcjax checkpoint.

  python tools/convert_hf.py --src=HF_DIR --dst=CKPT_DIR [--dtype=bfloat16] [--overwrite]
"""
from __future__ import annotations

import resource
import sys

from absl import app, flags, logging

from lcjax.checkpoint import CheckpointError, convert_hf
from lcjax.cli.usage import help_if_asked, unexpected_arguments

FLAGS = flags.FLAGS
flags.DEFINE_string("src", None, "HF model folder (config.json + *.safetensors).", required=True)
flags.DEFINE_string("dst", None, "lcjax checkpoint directory to create.", required=True)
flags.DEFINE_enum("dtype", None, ["bfloat16", "float16", "float32"], "Cast tensors to this dtype "
                  "(default: keep the stored dtype).")
flags.DEFINE_bool("overwrite", False, "Replace an existing DST.")


def _peak_rss_bytes() -> int:
  """This process's peak RSS. VmHWM where there is /proc: getrusage's ru_maxrss survives exec, so a converter
  started from a large parent process would report the parent's peak."""
  try:
    with open("/proc/self/status") as f:
      return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
  except (OSError, StopIteration):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with its failures (a missing --src or --dst, an unknown --dtype or flag) refused as the
  converter's other errors are: one line and status 2, not absl's usage text and status 1; help is no error."""
  help_if_asked(argv)
  try:
    rest = FLAGS(argv)
  except flags.Error as e:
    print(f"convert_hf: error: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
  if refusal := unexpected_arguments(rest):
    print(f"convert_hf: error: {refusal}", file=sys.stderr)
    sys.exit(2)
  return rest


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every item it writes at INFO
  try:
    stats = convert_hf(FLAGS.src, FLAGS.dst, dtype=FLAGS.dtype, overwrite=FLAGS.overwrite)
  except (CheckpointError, FileNotFoundError) as e:
    print(f"convert_hf: error: {e}", file=sys.stderr)
    return 2
  peak = _peak_rss_bytes() / 2**30
  print(f"wrote {FLAGS.dst}: {stats['tensors']} tensors, {stats['bytes'] / 2**30:.2f} GiB in "
        f"{stats['seconds']:.1f} s, peak RSS {peak:.2f} GiB")
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
