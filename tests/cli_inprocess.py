"""The generate CLI run in the calling process: what `python -m lcjax.cli.generate ARGS` prints and its exit
status, without the Python and JAX start-up a subprocess pays (the tests run dozens of refusals).

The path is the script's: absl parses the flags with the CLI's own parser, then `main` runs; a refusal is
`sys.exit(2)`. A `--verbose` failure raises its exception here instead of printing a traceback.
"""
from __future__ import annotations

import contextlib
import io
import subprocess


def run(argv: list[str]) -> subprocess.CompletedProcess:
  """Run the CLI with argv (without the program name); its stdout and stderr are captured."""
  from lcjax.cli import generate as cli
  out, err = io.StringIO(), io.StringIO()
  code = 0
  cli.FLAGS.unparse_flags()
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      cli._parse_flags(["generate", *argv])
      cli.main(None)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
  finally:
    cli.FLAGS.unparse_flags()
  return subprocess.CompletedProcess(["generate", *argv], code, out.getvalue(), err.getvalue())
