"""What the command lines (lcjax.cli.generate, tools/) share about their flags: asking for help is no error, and a
word that is no flag is refused with one message."""
from __future__ import annotations

from absl import app

HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def help_if_asked(argv: list[str]) -> None:
  """Print the usage text to stdout and exit 0 when argv asks for help (absl itself prints it and exits 1)."""
  for a in argv[1:]:
    if a in HELP_FLAGS:
      app.usage(shorthelp=a != "--helpfull", writeto_stdout=True, exitcode=0)


def unexpected_arguments(rest: list[str]) -> str | None:
  """The refusal of the words absl's parser left (`rest`, after the program name), or None when there are none."""
  return f"unexpected argument(s) {rest[1:]}: flags are written --name=value" if len(rest) > 1 else None
