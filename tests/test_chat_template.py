"""lcjax.chat_template: a checkpoint's template that would take unbounded memory or time is refused within its
bounds, in one line; real templates render as before.

Each bomb runs against a clock, then again under tracemalloc (the peak of Python's allocations): each was a bomb of
gigabytes or minutes before the bounds.
"""
from __future__ import annotations

import time
import tracemalloc

import pytest

from lcjax import chat_template
from lcjax.chat_template import ChatTemplateError

LLAMA3 = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if "
          "add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
DOC = "word " * 1000
MESSAGES = [{"role": "user", "content": DOC}]
A1000 = "{% set a = ['x'*1000] * 100 %}"

BOMBS = {
    "doubling-concat": "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling-plus": "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "doubling-list": "{% set ns = namespace(s=[1]) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "repeat": "{{ ('a' * 10**10)|length }}",
    "set-block": "{% set x %}{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}{% endset %}"
                 "{{ x|length }}",
    "output": "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
    "replace-filter": "{% set ns = namespace(s='aa') %}{% for i in range(6) %}{% set ns.s = ns.s|replace('a', ns.s) %}"
                      "{% endfor %}{{ ns.s|length }}",
    "replace-method": "{% set ns = namespace(s='aa') %}{% for i in range(6) %}"
                      "{% set ns.s = ns.s.replace('a', ns.s) %}{% endfor %}{{ ns.s|length }}",
    "center": "{{ 'a'.center(10**10)|length }}",
    "center-filter": "{{ 'a'|center(10**10)|length }}",
    "join": "{% set l = [messages[0].content] * 100000 %}{{ l|join|length }}",
    "join-method": "{% set l = [messages[0].content] * 1000 %}{{ ''.join(l)|length }}",
    "percent-width": "{{ '%010000000000d' % 1 }}",
    "format-width": "{{ '{:>10000000000}'.format(1) }}",
    "percent-star": "{{ '%*d' % (10**10, 1) }}",
    "indent": "{% set s = '\n' * 500000 %}{{ s|indent(1000000)|length }}",
    "squaring": "{% set ns = namespace(n=3) %}{% for i in range(60) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "macro-doubling": "{% macro d(n) %}{% if n %}{% set x = d(n-1) %}{{ x }}{{ x }}{% else %}a{% endif %}"
                      "{% endmacro %}{{ d(60)|length }}",
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "filtered-loops": "{% for i in range(100000) %}{% for j in range(100000) if false %}{% endfor %}{% endfor %}",
    # nested containers, whose text is made in C (str, repr, json) where no step is counted
    "nested-output": "{% set a = [0]*1000000 %}{% set b = [a]*1000000 %}{{ b }}",
    "nested-strings": "{% set a = ['x'*100000]*10 %}{% set b = [a]*1000 %}{{ b }}",
    "nested-tojson": "{{ (['x'*1000000]*1000) | tojson }}",
    "nested-string": "{{ (['x'*1000000]*1000) | string }}",
    "nested-pprint": "{{ (['x'*1000000]*1000) | pprint }}",
    "nested-format": A1000 + "{{ '%s'|format([a]*300) }}",
    "nested-concat": A1000 + "{% set b = [a]*300 %}{{ (b|first) ~ b }}",
    "nested-join": A1000 + "{{ ([a]*300)|join }}",
    "shared-literal": "{% set ns = namespace(x=0) %}{% for i in range(60) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
                      "{{ ns.x }}",
    "shared-compare": "{% set ns = namespace(x=0, y=0) %}{% for i in range(60) %}{% set ns.x = [ns.x, ns.x] %}"
                      "{% set ns.y = [ns.y, ns.y] %}{% endfor %}{{ ns.x == ns.y }}",
    "pprint-keys": "{% set d = {('k'*100000): range(50000)|list} %}{{ d|pprint|length }}",
    "tojson-indent": "{{ (range(100000)|list)|tojson(indent=1000) }}",
    "tojson-separators": "{{ (range(100000)|list)|tojson(separators=(' '*1000, ':')) }}",
    "lipsum": "{{ lipsum(100000, min=100, max=100)|length }}",
}


def _refused(name: str) -> ChatTemplateError:
  with pytest.raises(ChatTemplateError, match=r"^T: .*(characters|steps)") as e:
    chat_template.render(BOMBS[name], "T", messages=MESSAGES)
  return e.value


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_bomb_is_refused_within_the_bounds(name):
  """Refused by the characters or steps bound, in one line, within 5 s of plain rendering (timed without tracemalloc,
  which slows the bounds' own measuring about tenfold) and within 64 MiB of Python's allocations."""
  t0 = time.monotonic()
  err = _refused(name)
  assert time.monotonic() - t0 < 5
  assert "\n" not in str(err)
  if not name.endswith("-loops"):          # the step-bound loops allocate nothing
    tracemalloc.start()
    try:
      _refused(name)
      peak = tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()
    assert peak < 64 * 2**20


def test_the_step_bound_is_the_constant(monkeypatch):
  monkeypatch.setattr(chat_template, "MAX_STEPS", 500)
  with pytest.raises(ChatTemplateError, match="ran past 500 steps"):
    chat_template.render("{% for i in range(1000) %}{% endfor %}", "T", messages=[])
  chat_template.render("{% for i in range(100) %}{% endfor %}", "T", messages=[])


def test_the_time_bound(monkeypatch):
  monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.0)
  with pytest.raises(ChatTemplateError, match="ran past 0 seconds"):
    chat_template.render("{% for i in range(5000) %}{% endfor %}", "T", messages=[])


def test_the_character_bound_grows_with_the_messages():
  """A template that writes a long document twice renders; the bound is MAX_CHARS + 4 x the input."""
  long = [{"role": "user", "content": "x" * (2 * chat_template.MAX_CHARS)}]
  out = chat_template.render("{{ messages[0].content ~ messages[0].content }}", "T", messages=long)
  assert len(out) == 4 * chat_template.MAX_CHARS


@pytest.mark.parametrize("source, names", [
    ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate$"),
    ("{% macro d(n) %}{{ d(n+1) }}{% endmacro %}{{ d(0) }}", "RecursionError"),
    ("{{ foo.bar }}", "UndefinedError: 'foo' is undefined$"),
    ("{{ messages.append(1) }}", "SecurityError"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{% for %}", "does not compile: TemplateSyntaxError"),
])
def test_the_templates_own_errors_are_one_line(source, names):
  with pytest.raises(ChatTemplateError, match=f"^T: .*{names}") as e:
    chat_template.render(source, "T", messages=MESSAGES)
  assert "\n" not in str(e.value)


def test_a_real_template_renders_as_jinja2_renders_it():
  import jinja2.sandbox
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  kw = dict(messages=MESSAGES * 3, add_generation_prompt=True, bos_token="<s>")
  assert chat_template.render(LLAMA3, "T", **kw) == env.from_string(LLAMA3).render(**kw)
  fmt = ("{{ '%s|%5d|' % ('a', 3) }}{{ '{}-{:>4}'.format('b', 7) }}{{ 'x'|center(5) }}{{ ['a', 'b']|join(',') }}"
         "{{ 'a b'|replace(' ', '__') }}{{ 'l1\nl2'|indent(2) }}{{ 2 ** 10 }}{{ [1] * 3 }}")
  assert chat_template.render(fmt, "T", messages=[]) == env.from_string(fmt).render()


def test_numbers_in_a_format_strings_text_are_not_widths():
  out = chat_template.render("{{ '%s of 10000000000 at 5%%' % 'x' }}{{ 'y {} of 10000000000'.format(1) }}", "T",
                             messages=[])
  assert out == "x of 10000000000 at 5%y 1 of 10000000000"
  with pytest.raises(ChatTemplateError, match="given 10000000000"):
    chat_template.render("{{ '{:{w}}'.format(1, w=10**10) }}", "T", messages=[])
  with pytest.raises(ChatTemplateError, match="width of 10000000000"):
    chat_template.render("{{ '%10000000000d'|format(1) }}", "T", messages=[])


def test_a_value_made_is_measured_through_its_nesting():
  """A value counts its nested elements and strings, shared ones each time they occur, and stops counting once
  past the limit."""
  a = ["x" * 1000] * 1000
  assert chat_template.measure(a) == 2 + 1000 * 1004
  b = [a] * 10**6
  t0 = time.monotonic()
  assert 10**7 < chat_template.measure(b, limit=10**7) < 10**8
  assert time.monotonic() - t0 < 0.5
  assert chat_template.measure({"k": [1, None]}) == 2 + 1 + (2 + 1 + 5 + 8) + 8
  with pytest.raises(ChatTemplateError, match="the variables: a value nested deeper than 200 levels"):
    deep = []
    for _ in range(300):
      deep = [deep]
    chat_template.render("{{ x|length }}", "T", x=deep)


def test_a_namespace_inside_itself_renders():
  out = chat_template.render("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}", "T", messages=[])
  assert out.startswith("<Namespace {'a': 1, 'me': <Namespace")


def test_compiling_folds_no_bomb():
  """jinja2 folds filters of constants while compiling; that is bounded as a render is."""
  tracemalloc.start()
  try:
    chat_template.check(BOMBS["center-filter"], "T")
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 64 * 2**20


def test_threads_rendering_at_once_each_have_their_budget():
  """A render of long messages (a large bound) and one of short messages (a small bound) at once, in threads."""
  from concurrent.futures import ThreadPoolExecutor
  long = [{"role": "user", "content": "x" * (2 * chat_template.MAX_CHARS)}]
  twice = "{{ messages[0].content ~ messages[0].content }}"

  def one(i):
    if i % 2:
      return len(chat_template.render(twice, "T", messages=long))
    with pytest.raises(ChatTemplateError, match="characters"):
      chat_template.render(twice + "{{ 'y' * 2000000 }}", "T", messages=MESSAGES)
    return 0

  with ThreadPoolExecutor(4) as pool:
    assert list(pool.map(one, range(8))) == [0, 4 * chat_template.MAX_CHARS] * 4


def test_real_templates_with_loops_literals_and_macros_render_as_jinja2_renders_them():
  import jinja2.sandbox
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  source = ("{% macro m(x) %}[{{ x }}]{% endmacro %}{% set d = {'a': [1, 2], 'b': (3, 'c')} %}"
            "{% for k, v in d|dictsort %}{{ k }}={{ v|tojson }} {{ loop.index }}/{{ loop.length }}{% endfor %}"
            "{% for m_ in messages if m_.role == 'user' %}{{ m(m_.role) }}{% else %}none{% endfor %}"
            "{{ d|pprint }}{{ [[1], [2]]|sum(start=[]) }}{{ messages|map(attribute='role')|join(',') }}"
            "{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}"
            "{% endfor %}{{ {'t': [1, {'u': 2}]}|tojson(indent=2) }}")
  kw = dict(messages=MESSAGES + [{"role": "assistant", "content": "ok"}])
  assert chat_template.render(source, "T", **kw) == env.from_string(source).render(**kw)


def test_sum_of_lists_takes_one_pass():
  """Python's sum copies the total so far once per list (quadratic); the sum filter joins them in one pass."""
  t0 = time.monotonic()
  assert chat_template.render("{{ ([[1]]*50000)|sum(start=[])|length }}", "T", messages=MESSAGES) == "50000"
  assert time.monotonic() - t0 < 1
