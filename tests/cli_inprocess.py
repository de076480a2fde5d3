"""The generate CLI run in the calling process: what `python -m lcjax.cli.generate ARGS` prints and its exit
status, without the Python and JAX start-up a subprocess pays (the tests run dozens of refusals).

The path is the script's: absl parses the flags with the CLI's own parser, then `main` runs; a refusal is
`sys.exit(2)`. sys.argv is the CLI's for the run (ml_collections reads the --config.NAME overrides from it), and
the override flags it defines are removed afterwards, as a new process would not have them. A `--verbose`
failure raises its exception here instead of printing a traceback.
"""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys


def run(argv: list[str]) -> subprocess.CompletedProcess:
  """Run the CLI with argv (without the program name); its stdout and stderr are captured."""
  from lcjax.cli import generate as cli
  out, err = io.StringIO(), io.StringIO()
  code = 0
  argv = ["generate", *argv]
  sys_argv, sys.argv = sys.argv, argv
  cli.FLAGS.unparse_flags()
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      cli._parse_flags(argv)
      cli.main(None)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
  finally:
    cli.FLAGS.unparse_flags()
    for name in [n for n in cli.FLAGS if n.startswith("config.")]:
      delattr(cli.FLAGS, name)
    sys.argv = sys_argv
  return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
