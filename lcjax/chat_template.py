"""Chat templates rendered in a bounded jinja2 sandbox: a checkpoint's template can neither reach outside the
sandbox (jinja2's ImmutableSandboxedEnvironment) nor use unbounded memory or time.

Layer L0: stdlib and jinja2.

Bounds of one render (`Budget`), refused with a ChatTemplateError naming the bound:
  characters  every value an operation of the template makes (a string, a list's length, an integer's bytes) and
              all text it writes (its output and what macros, blocks and `set` blocks collect) are at most
              MAX_CHARS + CHARS_PER_INPUT x the characters of the messages. Operations that multiply a size (`*`,
              `**`, `%`, `replace`, `join`, `indent`, `wordwrap`, and any call or filter given an integer past the
              bound, e.g. a width) are checked before they run, the others after (a template line grows a value by
              at most its own size before the check).
  steps       at most MAX_STEPS lines of template code executed (loops and macro calls count each line they run).
  seconds     at most MAX_SECONDS of wall time.
Errors of the template itself (syntax, undefined names, `raise_exception`, recursion, a sandbox refusal) are a
ChatTemplateError too.
"""
from __future__ import annotations

import datetime
import inspect
import json
import re
import sys
import time
from typing import Any

MAX_CHARS = 1 << 20
CHARS_PER_INPUT = 4
MAX_STEPS = 1_000_000
MAX_SECONDS = 10.0
_TEMPLATE_FILE = "<template>"        # the file name of the code jinja2 compiles a template string to
_DIGITS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")     # width, precision of a `%` conversion
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")              # the spec of a str.format field
_NESTED_SPEC = re.compile(r"\{[^{}]*?:[^{}]*\{")                 # a spec with a field inside: {:{width}}
_WIDTH_METHODS = ("center", "ljust", "rjust", "zfill", "expandtabs")    # str methods whose integer sizes the result
_WIDTH_FILTERS = ("center", "batch", "slice")                              # filters whose integers size the result


class ChatTemplateError(ValueError):
  """A chat template that cannot be compiled or rendered, or passed a bound of its render; the message names it."""


def _size(x) -> int:
  """What a value costs, in characters: a string's or container's length, an integer's bytes."""
  if isinstance(x, (str, bytes, list, tuple, dict, set, frozenset)):
    return len(x)
  if isinstance(x, int):
    return x.bit_length() // 8
  return 0


class Budget:
  """The bounds of one render (see the module doc) and what it has used."""

  def __init__(self, input_chars: int):
    self.chars = MAX_CHARS + CHARS_PER_INPUT * input_chars
    self.steps = 0
    self.written = 0
    self.deadline = time.monotonic() + MAX_SECONDS

  def refuse(self, what: str) -> ChatTemplateError:
    return ChatTemplateError(f"{what} (the bound of a render is {self.chars} characters for these messages)")

  def check(self, n: int, what: str) -> None:
    if n > self.chars:
      raise self.refuse(f"{what} of {n} characters")

  def value(self, x, what: str = "a value"):
    self.check(_size(x), what)
    return x

  def write(self, n: int) -> None:
    self.written += n
    self.check(self.written, "output")

  def step(self) -> None:
    self.steps += 1
    if self.steps > MAX_STEPS:
      raise ChatTemplateError(f"the template ran past {MAX_STEPS} steps (lines of template code)")
    if not self.steps % 1024 and time.monotonic() > self.deadline:
      raise ChatTemplateError(f"the template ran past {MAX_SECONDS:g} seconds")

  def ints(self, args, what: str) -> None:
    """Refuse integer arguments past the bound (widths, counts)."""
    for a in args:
      if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.chars:
        raise self.refuse(f"{what} given {a}")

  def format_string(self, fmt, args, what: str, percent: bool = False) -> None:
    """A format string (`%` if `percent`, else str.format) whose widths (in its specs, or given as arguments:
    `*`, nested fields) or string arguments pass the bound."""
    if not isinstance(fmt, str):
      return
    if percent:
      widths = [g for m in _PERCENT_SPEC.finditer(fmt) for g in m.groups() if g]
      nested = "*" in fmt
    else:
      widths = [d for m in _FORMAT_SPEC.finditer(fmt) for d in _DIGITS.findall(m[1])]
      nested = _NESTED_SPEC.search(fmt) is not None
    if any(len(d) > 18 or int(d) > self.chars for d in widths):
      raise self.refuse(f"{what} with a width of {max(widths, key=len)[:40]}")
    if nested:
      self.ints(args, what)
    self.check(len(fmt) + sum(len(a) for a in args if isinstance(a, str)), what)


def _text(x) -> str:
  return x if isinstance(x, str) else str(x)


def _make_environment(budget: Budget | None):
  """A jinja2 ImmutableSandboxedEnvironment (as HF transformers renders chat templates) whose operations, writes
  and filters are checked against `budget` (None: compile only)."""
  import jinja2
  import jinja2.ext
  from jinja2.compiler import CodeGenerator
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class _Buffer(list):
    """A template's buffer (a macro's, a block's, `set`'s): every write counts against the budget."""

    def append(self, x):
      budget.write(len(_text(x)))
      super().append(x)

    def extend(self, xs):
      xs = list(xs)
      budget.write(sum(len(_text(x)) for x in xs))
      super().extend(xs)

  class _Generator(CodeGenerator):
    def buffer(self, frame) -> None:
      frame.buffer = self.temporary_identifier()
      self.writeline(f"{frame.buffer} = environment.new_buffer()")

    def visit_Concat(self, node, frame) -> None:
      self.write("environment.concat((")
      for arg in node.nodes:
        self.visit(arg, frame)
        self.write(", ")
      self.write("))")

  class _Environment(ImmutableSandboxedEnvironment):
    code_generator_class = _Generator
    intercepted_binops = frozenset({"+", "*", "**", "%", "//", "/", "-"})

    def new_buffer(self):
      return _Buffer()

    def concat(self, parts):
      strs = [_text(p) for p in parts]
      budget.check(sum(map(len, strs)), "a `~` concatenation")
      return jinja2.runtime.str_join(strs)

    def call_binop(self, context, operator, left, right):
      if operator == "*":
        for a, b in ((left, right), (right, left)):
          if isinstance(b, int) and not isinstance(b, bool):
            if isinstance(a, (str, list, tuple)):
              budget.check(len(a) * max(b, 0), "a `*` repetition")
            elif isinstance(a, int):
              budget.check((a.bit_length() + b.bit_length()) // 8, "a `*` product")
      elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        budget.check(left.bit_length() * right // 8, "a `**` power")
      elif operator == "%" and isinstance(left, str):
        budget.format_string(left, right if isinstance(right, tuple) else (right,), "a `%` format", percent=True)
      return budget.value(super().call_binop(context, operator, left, right), f"a `{operator}` result")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
      target = getattr(__obj, "__wrapped__", __obj)       # the sandbox wraps str.format
      owner = getattr(target, "__self__", None)
      name = getattr(target, "__name__", "")
      what = f"a call of {name or type(__obj).__name__}"
      if isinstance(owner, str):
        if name in _WIDTH_METHODS:
          budget.ints(list(args) + list(kwargs.values()), what)
        elif name == "replace" and len(args) >= 2:
          _check_replace(owner, args[0], args[1], what)
        elif name == "join" and args:
          args = (list(args[0]),) + args[1:]
          budget.check(len(owner) * len(args[0]) + sum(len(_text(x)) for x in args[0]), what)
        elif name in ("format", "format_map"):
          budget.format_string(owner, list(args) + list(kwargs.values()), what)
      return budget.value(super().call(__context, __obj, *args, **kwargs), f"the result of {what}")

  def _check_replace(s, old, new, what) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
      count = s.count(old) if old else len(s) + 1
      budget.check(len(s) + count * max(len(new) - len(old), 0), what)

  def bounded(name, f):
    """Filter `f` with its result checked, and before it runs, the size it makes when it can multiply one."""
    sig = inspect.signature(f)

    def filter_(*args, **kwargs):
      what = f"the filter {name}"
      bound = sig.bind(*args, **kwargs)
      bound.apply_defaults()
      a = bound.arguments
      value = next(iter(a.values())) if not hasattr(f, "jinja_pass_arg") else list(a.values())[1]
      if name in _WIDTH_FILTERS:
        budget.ints([a.get(k) for k in ("width", "linecount", "slices")], what)
      if name == "replace":
        _check_replace(_text(value), _text(a["old"]), _text(a["new"]), what)
      elif name == "join":
        a["value"] = items = list(value) if not isinstance(value, str) else value
        budget.check(len(_text(a["d"])) * len(items) + sum(len(_text(x)) for x in items), what)
      elif name == "indent" and isinstance(value, str):
        width = a["width"]
        budget.check(len(value) + (value.count("\n") + 1) * (len(width) if isinstance(width, str) else
                                                              width if isinstance(width, int) else 0), what)
      elif name == "wordwrap" and isinstance(value, str):
        budget.check(len(value) * (1 + len(_text(a["wrapstring"] or "\n"))), what)
      elif name == "format" and isinstance(value, str):
        budget.format_string(value, list(a["args"]) + list(a["kwargs"].values()), what, percent=True)
      return budget.value(f(*bound.args, **bound.kwargs), f"the result of {what}")

    if hasattr(f, "jinja_pass_arg"):          # pass_context / pass_environment / pass_eval_context
      filter_.jinja_pass_arg = f.jinja_pass_arg
    return filter_

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = (_Environment if budget is not None else ImmutableSandboxedEnvironment)(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  if budget is not None:
    env.filters = {name: bounded(name, f) for name, f in env.filters.items()}
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _one_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [""])[0][:300]


def check(source: str, where: str) -> None:
  """Compile a chat template: ChatTemplateError naming `where` when it is not a template jinja2 compiles."""
  import jinja2
  if not isinstance(source, str):
    raise ChatTemplateError(f"{where}: the chat template is a {type(source).__name__}, not text")
  try:
    _make_environment(None).from_string(source)
  except (jinja2.TemplateError, RecursionError, MemoryError) as e:
    raise ChatTemplateError(f"{where}: the chat template does not compile: {type(e).__name__}: "
                            f"{_one_line(e)}") from None


def render(source: str, where: str, **variables: Any) -> str:
  """The template rendered with `variables`, within the bounds of the module doc."""
  budget = Budget(len(json.dumps(variables, default=str, ensure_ascii=False)))
  env = _make_environment(budget)
  try:
    template = env.from_string(source)
  except Exception as e:  # noqa: BLE001 - whatever jinja2 raised compiling it
    raise ChatTemplateError(f"{where}: the chat template does not compile: {type(e).__name__}: "
                            f"{_one_line(e)}") from None

  def trace(frame, event, arg):
    if frame.f_code.co_filename != _TEMPLATE_FILE:
      return None
    budget.step()
    return line

  def line(frame, event, arg):
    if event == "line":
      budget.step()
    return line

  parts = []
  previous = sys.gettrace()
  sys.settrace(trace)
  try:
    for chunk in template.generate(**variables):
      budget.write(len(chunk))
      parts.append(chunk)
  except ChatTemplateError as e:
    raise ChatTemplateError(f"{where}: {e}") from None
  except Exception as e:  # noqa: BLE001 - the template's own errors, one line each
    raise ChatTemplateError(f"{where}: the chat template failed: {type(e).__name__}: {_one_line(e)}") from None
  finally:
    sys.settrace(previous)
  return "".join(parts)
