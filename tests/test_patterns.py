"""lcjax.checkpoint.patterns, the matcher of config-given regular expressions, against Python's `re` (the oracle) on
patterns that `re` matches quickly, and its bounds on patterns that `re` would take minutes over."""
from __future__ import annotations

import re

import pytest

from lcjax.checkpoint.patterns import Pattern
from tests.alarm import alarm

HANG_S = 30.0                 # tests.alarm's guard: the bounds themselves are checked by the steps counted

NAMES = [f"model.layers.{i}.{m}" for i in (0, 1, 7, 12, 95) for m in (
    "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")] + [
    "", "lm_head", "x", "MODEL.LAYERS.1.Q_PROJ", "a\n", "model\n", "é_1"]
SAME_AS_RE = [
    r".*lm_head", r"model\.layers\.1\..*", r".*layers\.\d+\.mlp\.down_proj$", r"re", r"(?i)MODEL.*Q_PROJ",
    r"model\.layers\.(1|2|3)\.self_attn\.[qkv]_proj", r".*\bmlp\b.*", r"[^m].*", r"model\.layers\.\d{1,2}\.",
    r"a*?", r"(a*)*b", r".*proj\Z", r"\Amodel", r"x|model", r"(?i:M)odel", r"model\.layers\.1[^0-9]",
    r".*(up|gate)_proj", r"^$", r"", r".*\Bproj", r"\w+\.\w+\.\d\.\S+", r"[\W]", r"[a-z.]{6}layers", r"(?s).\n",
    r"(?m)a$", r"\w_\d", r"(?a)\w_\d", r"[\d\s]", r"model\.layers\.(?:0|12)\.mlp\.(gate|down)_proj",
    r"(ab|a)(c|bcd)?", r"m{1,3}o?d{0,2}e+l\.l", r".{20,}", r"[^\w.]",
]


@pytest.mark.parametrize("pattern", SAME_AS_RE)
def test_matches_as_re(pattern):
  p = Pattern(pattern)
  for name in NAMES:
    assert p.match(name) == (re.match(pattern, name) is not None), (pattern, name)
    assert p.fullmatch(name) == (re.fullmatch(pattern, name) is not None), (pattern, name)


def test_a_pattern_that_backtracks_under_re_is_matched_in_linear_time():
  """(.|.)*X and (a|aa)*b take 2^n steps under `re` on names of n characters; here, a few states a character:
  the automaton steps counted are at most twice its states per character read (the wall-clock bound only turns a
  hang into a failure)."""
  names = [f"model.layers.{i}.mlp.down_proj" for i in range(126)] * 7
  chars = sum(len(n) + 1 for n in names + ["a" * 60])
  for pattern in (r"(.|.)*X", r"(a|aa)*b", r"(x+x+)+y"):
    with alarm(HANG_S):
      p = Pattern(pattern)
      assert not any(p.match(n) for n in names + ["a" * 60])
    assert p.visits <= 2 * len(p.kind) * chars, (pattern, p.visits)


@pytest.mark.parametrize("pattern,why", [
    ("(", "not a valid regular expression (missing ), unterminated subpattern at position 0)"),
    (r"(a)\1", "uses groupref"), ("(?=a)", "uses assert"), ("(?!a)", "uses assert_not"), ("(?<=a)b", "uses assert"),
    ("(?>a)", "uses atomic_group"), ("a*+", "uses possessive_repeat"), ("(a)?(?(1)b|c)", "uses groupref_exists"),
    ("a{70000}", "more than 4000 automaton states"), ("(a{100}){100}", "more than 4000 automaton states"),
    ("((){65535}){65535}", "steps to compile"), ("x" * 1001, "1001 characters long"),
])
def test_refusals(pattern, why):
  with pytest.raises(ValueError) as e:
    Pattern(pattern)
  assert why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_work_of_one_pattern_is_bounded():
  """A pattern small enough to build whose matches would visit too many states is stopped at its max_visits."""
  p = Pattern("(.?){300}Z", max_visits=20_000)
  with pytest.raises(ValueError, match="more than 20,000 automaton steps"):
    for _ in range(100):
      p.match("model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("pattern", ["(?:){4294967294}x", "(?:)*x", "(?:){4294967294}(?:){4294967294}x"])
def test_empty_repeats_cost_nothing(pattern):
  """A repeat of nothing matches the empty string whatever its count: built in no steps (its count once cost a
  loop of that many turns). Each pattern matches as `x` does (Python's re itself spins on the huge counts, so the
  answers are `x`'s)."""
  with alarm(HANG_S):
    p = Pattern(pattern)
  assert p.steps <= 4                                     # built in a few steps, whatever the count
  names = ("", "x", "xa", "ax")
  assert [p.match(n) for n in names] == [re.match("x", n) is not None for n in names]


def test_a_repeat_of_a_repeat_of_nothing_is_refused_at_once():
  """Each turn of a repeat is a building step: a repeat of a huge repeat of nothing is refused within the step
  bound instead of turning 4294967294 times (Python's re itself loops on it)."""
  with pytest.raises(ValueError, match="steps to compile"), alarm(HANG_S):
    Pattern("(?:(?:){4294967294}){4294967294}x")


def test_a_large_set_costs_its_items():
  """A character set of hundreds of ranges tested at every position counts each range tested against the bound,
  so a pattern that would run for tens of seconds is refused within the bound: a test of the set costs its
  ranges, and a two-character name already runs past 200,000 steps (charged one step a test, it takes ~11,400)."""
  ranges = "".join(f"{chr(0x100 + 2 * i)}-{chr(0x101 + 2 * i)}" for i in range(320))
  pattern = f"(?:[{ranges}]|a){{0,1900}}$"
  assert max(Pattern(pattern).cost) >= 320
  p = Pattern(pattern, max_visits=200_000)
  with pytest.raises(ValueError, match="automaton steps"), alarm(HANG_S):
    p.match("ab")
  assert p.visits <= 200_000 + max(p.cost)               # refused at the first test past the bound
