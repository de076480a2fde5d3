"""lcjax.chat_template: a checkpoint's template that would take unbounded memory or time is refused within its
bounds, in one line; real templates render as before.

Each bomb runs under tracemalloc (the peak of Python's allocations) and a clock: each was a bomb of gigabytes or
minutes before the bounds.
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
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_bomb_is_refused_within_the_bounds(name):
  measure = name != "nested-loops"     # tracemalloc slows the step-bound loop; it allocates nothing
  if measure:
    tracemalloc.start()
  t0 = time.monotonic()
  try:
    with pytest.raises(ChatTemplateError, match=r"^T: .*(characters|steps)") as e:
      chat_template.render(BOMBS[name], "T", messages=MESSAGES)
    peak = tracemalloc.get_traced_memory()[1] if measure else 0
  finally:
    if measure:
      tracemalloc.stop()
  assert time.monotonic() - t0 < 5
  assert peak < 64 * 2**20
  assert "\n" not in str(e.value)


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
