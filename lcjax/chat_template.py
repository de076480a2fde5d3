"""Chat templates rendered in a bounded jinja2 sandbox: a checkpoint's template can neither reach outside the
sandbox (jinja2's ImmutableSandboxedEnvironment) nor use unbounded memory or time.

Layer L0: stdlib and jinja2.

Bounds of one render (`Budget`), refused with a ChatTemplateError naming the bound:
  characters  every value an operation of the template makes (an operator's, a call's or a filter's result, a
              list, tuple or dict literal), every value given to a call or a filter or written out, and all text
              the template writes (its output and what macros, blocks and `set` blocks collect) are at most
              MAX_CHARS + CHARS_PER_INPUT x the characters of the variables. A value's characters (`measure`)
              follow its nesting: a string's length, an integer's decimal digits, 4 more for each element of a
              container (8 for a dict's item), shared elements counted each time they occur; the text a value
              turns into (str, repr, tojson, pprint, format, `~`, join, output) is at most a small constant
              times that (escapes), and is checked again once made. Values nest at most MAX_DEPTH levels.
              Operations that multiply a size (`*`, `**`, `%`, `replace`, `join`, `indent`, `wordwrap`,
              `tojson`'s indent and separators, `sum` of lists, and any call or filter given an integer past the
              bound, e.g. a width) are checked before they run.
  steps       at most MAX_STEPS steps: a step is an iteration of a `for` loop (filtered out or not, recursive
              or not) or a call (a macro's, a method's, a global's).
  seconds     at most MAX_SECONDS of wall time.
Errors of the template itself (syntax, undefined names, `raise_exception`, recursion, a sandbox refusal) are a
ChatTemplateError too.

The environment is built once and each template compiled once per source (`_compiled`); the budget of the
render under way is a contextvars.ContextVar, so that threads rendering at once each have their own.
"""
from __future__ import annotations

import contextvars
import datetime
import functools
import inspect
import itertools
import json
import pprint
import re
import time
from typing import Any

MAX_CHARS = 1 << 20
CHARS_PER_INPUT = 4
MAX_STEPS = 1_000_000
MAX_SECONDS = 10.0
MAX_DEPTH = 200
_UNKNOWN = 64                        # what an object of another type (a macro, a loop, a range) counts
_DIGITS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")     # width, precision of a `%` conversion
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")              # the spec of a str.format field
_NESTED_SPEC = re.compile(r"\{[^{}]*?:[^{}]*\{")                 # a spec with a field inside: {:{width}}
_WIDTH_METHODS = ("center", "ljust", "rjust", "zfill", "expandtabs")    # str methods whose integer sizes the result
_WIDTH_FILTERS = ("center", "batch", "slice")                              # filters whose integers size the result
_BOUND_FILTERS = _WIDTH_FILTERS + ("replace", "join", "indent", "wordwrap", "format")  # filters checked by argument
_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("lcjax_chat_template_budget", default=None)


class ChatTemplateError(ValueError):
  """A chat template that cannot be compiled or rendered, or passed a bound of its render; the message names it."""


def measure(x, limit: float = float("inf"), known: dict | None = None, indent: int = 0, sep: int = 0) -> int:
  """What a value costs, in characters (see the module doc), following its nesting; once past `limit` it returns
  at once a number past `limit`. `known`: costs by id of containers that outlive the call. `indent`, `sep`: each
  element costs that many more per level of nesting (an indented text's indentation), and `sep` more."""
  memo: dict = {}
  try:
    from jinja2.utils import Namespace
  except ImportError:        # jinja2 absent: no namespaces exist
    Namespace = ()

  def m(x, depth: int) -> int:
    t = type(x)
    if t is str:
      return len(x)
    if t is int:
      return x.bit_length() // 3 + 1
    if t is float:
      return 24
    if t is bool or x is None:
      return 5
    if isinstance(x, (str, bytes)):
      return len(x)
    if isinstance(x, int):
      return x.bit_length() // 3 + 1
    if not isinstance(x, (list, tuple, dict, set, frozenset, Namespace, _VIEWS)):
      return _UNKNOWN
    key = id(x) if not indent else (id(x), depth)
    if key in memo:
      return memo[key]
    if known is not None and not indent and key in known:
      return known[key]
    if depth >= MAX_DEPTH:
      raise ChatTemplateError(f"a value nested deeper than {MAX_DEPTH} levels")
    memo[key] = 5                     # a container inside itself: repr writes [...]
    per = 4 + sep + (1 + indent * (depth + 1) if indent else 0)
    n = 2 + _UNKNOWN * isinstance(x, (Namespace, _VIEWS))
    if isinstance(x, Namespace):
      x = object.__getattribute__(x, "_Namespace__attrs")
    if isinstance(x, dict):
      for k, v in x.items():
        n += ((len(k) if type(k) is str else m(k, depth + 1)) + (len(v) if type(v) is str else m(v, depth + 1))
              + per + 4)
        if n > limit:
          break
    else:
      for e in x:
        n += (len(e) if type(e) is str else m(e, depth + 1)) + per
        if n > limit:
          break
    memo[key] = n
    return n

  n = m(x, 0)
  if known is not None and not indent and limit == float("inf"):
    known.update(memo)
  return n


class Budget:
  """The bounds of one render (see the module doc) and what it has used. `known`: the costs of the containers
  of the render's variables, which outlive the render."""

  def __init__(self, input_chars: int, known: dict | None = None):
    self.chars = MAX_CHARS + CHARS_PER_INPUT * input_chars
    self.steps = 0
    self.written = 0
    self.deadline = time.monotonic() + MAX_SECONDS
    self.known = known

  def refuse(self, what: str) -> ChatTemplateError:
    return ChatTemplateError(f"{what} (the bound of a render is {self.chars} characters for these messages)")

  def check(self, n: int, what: str) -> None:
    if n > self.chars:
      raise self.refuse(f"{what} of {n} characters")

  def measure(self, x, indent: int = 0, sep: int = 0) -> int:
    if type(x) is str:
      return len(x)
    n = measure(x, self.chars, self.known, indent, sep)
    if n > 4096:
      self.clock()
    return n

  def value(self, x, what: str = "a value"):
    if (len(x) if type(x) is str else self.measure(x)) > self.chars:
      self.check(self.measure(x), what)
    return x

  def values(self, xs, what: str) -> None:
    """Refuse values, together past the bound (what a call or filter is given)."""
    n = 0
    for x in xs:
      n += self.measure(x)
    self.check(n, what)

  def write(self, n: int) -> None:
    self.written += n
    self.check(self.written, "output")

  def step(self) -> None:
    self.steps += 1
    if self.steps > MAX_STEPS:
      raise ChatTemplateError(f"the template ran past {MAX_STEPS} steps (loop iterations and calls)")
    if not self.steps & 63:
      self.clock()

  def clock(self) -> None:
    if time.monotonic() > self.deadline:
      raise ChatTemplateError(f"the template ran past {MAX_SECONDS:g} seconds")

  def ints(self, args, what: str) -> None:
    """Refuse integer arguments past the bound (widths, counts)."""
    for a in args:
      if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.chars:
        raise self.refuse(f"{what} given {a}")

  def format_string(self, fmt, args, what: str, percent: bool = False) -> None:
    """A format string (`%` if `percent`, else str.format) whose widths (in its specs, or given as arguments:
    `*`, nested fields) or arguments pass the bound."""
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
    self.values([fmt, *args], what)


def _budget() -> Budget:
  b = _BUDGET.get()
  if b is None:
    raise ChatTemplateError("a chat template ran outside lcjax.chat_template.render")
  return b


def _text(x) -> str:
  return x if isinstance(x, str) else str(x)


class _Printer(pprint.PrettyPrinter):
  """pprint's printer whose text counts against the budget as it is written (its indentation follows the
  lengths of dict keys, which `measure` does not bound)."""

  def pformat(self, obj) -> str:
    budget = _budget()
    parts: list[str] = []

    class Out:
      written = 0

      def write(self, s):
        self.written += len(s)
        budget.check(self.written, "the filter pprint")
        budget.clock()
        parts.append(s)

    self._format(obj, Out(), 0, 0, {}, 0)
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def _environment():
  """The jinja2 ImmutableSandboxedEnvironment (as HF transformers renders chat templates) whose loops, calls,
  operations, writes and filters are checked against the budget of the render under way."""
  import jinja2
  import jinja2.ext
  from jinja2 import nodes
  from jinja2.compiler import CodeGenerator
  from jinja2.runtime import LoopContext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class _Buffer(list):
    """A template's buffer (a macro's, a block's, `set`'s): every write counts against the budget."""

    def append(self, x):
      _budget().write(len(_text(x)))
      super().append(x)

    def extend(self, xs):
      xs = list(xs)
      _budget().write(sum(len(_text(x)) for x in xs))
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

    def _parse(self, source, name, filename):
      tree = super()._parse(source, name, filename)
      for loop in list(tree.find_all(nodes.For)):
        loop.iter = _wrap(loop.iter, "_counted")
      literals = [n for kind in (nodes.List, nodes.Dict, nodes.Tuple) for n in tree.find_all(kind)
                  if getattr(n, "ctx", "load") == "load"]
      if literals:
        ids = {id(n) for n in literals}
        for parent in list(tree.find_all(nodes.Node)) + [tree]:
          for field in parent.fields:
            value = getattr(parent, field, None)
            if id(value) in ids:
              setattr(parent, field, _wrap(value, "_made"))
            elif isinstance(value, list):
              value[:] = [_wrap(v, "_made") if id(v) in ids else v for v in value]
      return tree

    def new_buffer(self):
      return _Buffer()

    def counted(self, items):
      step = _budget().step
      for x in items:
        step()
        yield x

    def made(self, x):
      return _budget().value(x, "a literal")

    def concat(self, parts):
      budget = _budget()
      budget.values(parts, "a `~` concatenation")
      strs = [_text(p) for p in parts]
      budget.check(sum(map(len, strs)), "a `~` concatenation")
      return jinja2.runtime.str_join(strs)

    def call_binop(self, context, operator, left, right):
      budget = _budget()
      if operator == "+" and type(left) is str and type(right) is str:
        budget.check(len(left) + len(right), "a `+` result")
        return left + right
      if operator == "*":
        for a, b in ((left, right), (right, left)):
          if isinstance(b, int) and not isinstance(b, bool):
            if isinstance(a, (str, list, tuple)):
              one = budget.measure(a) + 4 * (not isinstance(a, str))
              budget.check(one * max(b, 0), "a `*` repetition")
            elif isinstance(a, int):
              budget.check((a.bit_length() + b.bit_length()) // 3, "a `*` product")
      elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        budget.check(left.bit_length() * right // 3, "a `**` power")
      elif operator == "%" and isinstance(left, str):
        budget.format_string(left, right if isinstance(right, tuple) else (right,), "a `%` format", percent=True)
      return budget.value(super().call_binop(context, operator, left, right), f"a `{operator}` result")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
      budget = _budget()
      budget.step()
      target = getattr(__obj, "__wrapped__", __obj)       # the sandbox wraps str.format
      owner = getattr(target, "__self__", None)
      name = getattr(target, "__name__", "")
      what = f"a call of {name or type(__obj).__name__}"
      budget.values(itertools.chain(args, kwargs.values()), what)
      if isinstance(owner, str):
        if name in _WIDTH_METHODS:
          budget.ints(list(args) + list(kwargs.values()), what)
        elif name == "replace" and len(args) >= 2:
          _check_replace(owner, args[0], args[1], what)
        elif name == "join" and args:
          args = (list(args[0]),) + args[1:]
          budget.check(len(owner) * len(args[0]) + budget.measure(args[0]), what)
        elif name in ("format", "format_map"):
          budget.format_string(owner, list(args) + list(kwargs.values()), what)
      elif isinstance(__obj, LoopContext) and args:                 # a recursive loop's next level
        args = (__self.counted(args[0]),) + args[1:]
      return budget.value(super().call(__context, __obj, *args, **kwargs), f"the result of {what}")

  def _wrap(node, name):
    """`node` given to the filter `name` (an expression jinja2 does not fold into a constant)."""
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

  def _check_replace(s, old, new, what) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
      count = s.count(old) if old else len(s) + 1
      _budget().check(len(s) + count * max(len(new) - len(old), 0), what)

  def finalize(value):
    """What `{{ }}` writes, checked before it is made text."""
    if type(value) is not str:
      budget = _BUDGET.get()
      if budget is not None:
        budget.value(value, "an output")
    return value

  def bounded(name, f):
    """Filter `f` with its arguments and result checked, and before it runs, the size it makes when it can
    multiply one."""
    sig = inspect.signature(f)
    passes = hasattr(f, "jinja_pass_arg")           # pass_context / pass_environment / pass_eval_context
    what = f"the filter {name}"

    def checked(*args, **kwargs):
      budget = _budget()
      if len(args) != 1 + passes or kwargs or type(args[passes]) is not str:
        budget.values(itertools.chain(args[passes:], kwargs.values()), what)
      if name not in _BOUND_FILTERS:
        return budget.value(f(*args, **kwargs), f"the result of {what}")
      bound = sig.bind(*args, **kwargs)
      bound.apply_defaults()
      a = bound.arguments
      value = list(a.values())[passes]
      if name in _WIDTH_FILTERS:
        budget.ints([a.get(k) for k in ("width", "linecount", "slices")], what)
      if name == "replace":
        _check_replace(_text(value), _text(a["old"]), _text(a["new"]), what)
      elif name == "join":
        a["value"] = items = list(value) if not isinstance(value, str) else value
        budget.check(budget.measure(a["d"]) * len(items) + budget.measure(items), what)
      elif name == "indent" and isinstance(value, str):
        width = a["width"]
        budget.check(len(value) + (value.count("\n") + 1) * (len(width) if isinstance(width, str) else
                                                              width if isinstance(width, int) else 0), what)
      elif name == "wordwrap" and isinstance(value, str):
        budget.check(len(value) * (1 + len(_text(a["wrapstring"] or "\n"))), what)
      elif name == "format" and isinstance(value, str):
        budget.format_string(value, list(a["args"]) + list(a["kwargs"].values()), what, percent=True)
      return budget.value(f(*bound.args, **bound.kwargs), f"the result of {what}")

    if passes:
      checked.jinja_pass_arg = f.jinja_pass_arg
    return checked

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    budget = _budget()
    budget.ints([indent], "the filter tojson")
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    sep = sum(len(s) for s in separators if isinstance(s, str)) if isinstance(separators, (tuple, list)) else 0
    budget.check(budget.measure(x, indent=max(width, 0), sep=sep), "the filter tojson")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  @jinja2.pass_environment
  def sum_(environment, iterable, attribute=None, start=0):
    """jinja2's sum; lists and tuples are joined in one pass, not one copy per item."""
    if attribute is not None:
      iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    if isinstance(start, (list, tuple)):
      items = list(iterable)
      kind = list if isinstance(start, list) else tuple
      if all(isinstance(i, kind) for i in items):
        return start + kind(itertools.chain.from_iterable(items))
      return sum(items, start)
    return sum(iterable, start)

  def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja2's signature
    _budget().check(n * max * 16 if isinstance(n, int) and isinstance(max, int) else 0, "a call of lipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)

  env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=finalize)
  env.filters["tojson"] = tojson
  env.filters["sum"] = sum_
  env.filters["pprint"] = lambda value: _Printer().pformat(value)
  env.filters = {name: bounded(name, f) for name, f in env.filters.items()}
  env.filters["_counted"] = jinja2.pass_context(lambda context, items: env.counted(items))
  env.filters["_made"] = jinja2.pass_context(lambda context, x: env.made(x))
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.globals["lipsum"] = lipsum
  return env


def _one_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [""])[0][:300]


@functools.lru_cache(maxsize=32)
def _compiled(source: str):
  """The template compiled; what jinja2 computes while compiling (constants it folds) is bounded as a render
  of no variables is."""
  token = _BUDGET.set(Budget(0))
  try:
    return _environment().from_string(source)
  finally:
    _BUDGET.reset(token)


def check(source: str, where: str) -> None:
  """Compile a chat template: ChatTemplateError naming `where` when it is not a template jinja2 compiles."""
  if not isinstance(source, str):
    raise ChatTemplateError(f"{where}: the chat template is a {type(source).__name__}, not text")
  try:
    _compiled(source)
  except Exception as e:  # noqa: BLE001 - whatever jinja2 raised compiling it
    raise ChatTemplateError(f"{where}: the chat template does not compile: {type(e).__name__}: "
                            f"{_one_line(e)}") from None


def render(source: str, where: str, **variables: Any) -> str:
  """The template rendered with `variables`, within the bounds of the module doc."""
  check(source, where)
  template = _compiled(source)
  known: dict = {}
  try:
    input_chars = measure(variables, known=known)
  except ChatTemplateError as e:
    raise ChatTemplateError(f"{where}: the variables: {e}") from None
  token = _BUDGET.set(Budget(input_chars, known))
  parts = []
  try:
    budget = _budget()
    for chunk in template.generate(**variables):
      budget.write(len(chunk))
      parts.append(chunk)
  except ChatTemplateError as e:
    raise ChatTemplateError(f"{where}: {e}") from None
  except Exception as e:  # noqa: BLE001 - the template's own errors, one line each
    raise ChatTemplateError(f"{where}: the chat template failed: {type(e).__name__}: {_one_line(e)}") from None
  finally:
    _BUDGET.reset(token)
  return "".join(parts)
