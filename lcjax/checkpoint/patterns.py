"""Regular expressions that come from a checkpoint's config (quantization_config `ignore` entries "re:..."), matched
without backtracking: a config cannot hang the loader.

A pattern is parsed by Python's own parser (so it means what `re` makes of it, and an invalid one fails as `re`
would), compiled to a nondeterministic automaton (Thompson's construction) and run over a name as a set of states:
time linear in the name's length times the automaton's size, whatever the pattern. Both are bounded: a pattern
of more than MAX_STATES states or MAX_STEPS building steps (a repeat counts each of its repetitions), or whose
match of the given names would cost more than its `max_visits` (a state visited costs 1, a character tested
against a set costs the set's items), is refused. Constructs that no automaton has (back-references,
lookarounds, conditionals, atomic groups, possessive repeats) are refused by name. Every refusal is a ValueError
of one line.
"""
from __future__ import annotations

import re
from re import _constants as C
from re import _parser

MAX_PATTERN = 1000            # characters of a pattern
MAX_STATES = 4000             # states of its automaton (and steps of building it)
MAX_STEPS = MAX_STATES * 4    # steps of building an automaton
MAX_VISITS = 2_000_000        # the cost of matching all the names a config's patterns are given (~1 s)

_CHAR, _SPLIT, _AT, _MATCH = range(4)


def _category(cat, ascii_only: bool):
  ok = (lambda ch: ch < "\x80") if ascii_only else (lambda ch: True)
  word = lambda ch: ok(ch) and (ch.isalnum() or ch == "_")     # noqa: E731
  return {C.CATEGORY_DIGIT: lambda ch: ok(ch) and ch.isdecimal(),
          C.CATEGORY_NOT_DIGIT: lambda ch: not (ok(ch) and ch.isdecimal()),
          C.CATEGORY_SPACE: lambda ch: ok(ch) and ch.isspace(),
          C.CATEGORY_NOT_SPACE: lambda ch: not (ok(ch) and ch.isspace()),
          C.CATEGORY_WORD: word,
          C.CATEGORY_NOT_WORD: lambda ch: not word(ch)}[cat]


class Pattern:
  """A compiled pattern: `match(name)` is `re.match(pattern, name) is not None` (anchored at the start, as
  compressed-tensors matches its `re:` entries), `fullmatch(name)` is `re.fullmatch`'s."""

  def __init__(self, pattern: str, max_visits: int = MAX_VISITS):
    if len(pattern) > MAX_PATTERN:
      raise ValueError(f"is {len(pattern)} characters long, more than the {MAX_PATTERN} lcjax matches")
    try:
      tree = _parser.parse(pattern)
    except re.error as e:
      raise ValueError(f"is not a valid regular expression ({e})") from None
    self.kind: list[int] = []
    self.arg: list = []
    self.out: list[list[int]] = []
    self.cost: list[int] = []   # of testing a character at the state
    self.steps = 0            # building steps
    self.visits = 0           # the cost of every match so far
    self.max_visits = max_visits
    self.accept = self._new(_MATCH, None, [])
    self.start = self._seq(list(tree), self.accept, tree.state.flags)

  def _new(self, kind: int, arg, out: list[int], cost: int = 1) -> int:
    if len(self.kind) >= MAX_STATES:
      raise ValueError(f"compiles to more than {MAX_STATES} automaton states (a repeat count too large)")
    self.kind.append(kind)
    self.arg.append(arg)
    self.out.append(out)
    self.cost.append(cost)
    return len(self.kind) - 1

  def _step(self) -> None:
    self.steps += 1
    if self.steps > MAX_STEPS:
      raise ValueError(f"takes more than {MAX_STEPS} steps to compile (a repeat count too large)")

  def _seq(self, items, nxt: int, flags: int) -> int:
    for op, av in reversed(items):
      nxt = self._item(op, av, nxt, flags)
    return nxt

  def _char(self, positive, negate: bool, nxt: int, flags: int, cost: int = 1) -> int:
    if flags & C.SRE_FLAG_IGNORECASE:
      test = lambda ch: negate != any(positive(c) for c in (ch, ch.lower(), ch.upper()))   # noqa: E731
      cost *= 3
    else:
      test = lambda ch: negate != positive(ch)                                          # noqa: E731
    return self._new(_CHAR, test, [nxt], cost)

  def _item(self, op, av, nxt: int, flags: int) -> int:
    self._step()                       # bounded too: ((){65535}){65535} makes no states
    if op in (C.LITERAL, C.NOT_LITERAL):
      c = chr(av)
      return self._char(lambda ch: ch == c, op is C.NOT_LITERAL, nxt, flags)
    if op is C.ANY:
      return self._char(lambda ch: ch == "\n" and not flags & C.SRE_FLAG_DOTALL, True, nxt, 0)
    if op is C.IN:
      negate = bool(av) and av[0][0] is C.NEGATE
      tests = []
      for kind, v in av[negate:]:
        if kind is C.LITERAL:
          tests.append(lambda ch, c=chr(v): ch == c)
        elif kind is C.RANGE:
          tests.append(lambda ch, lo=chr(v[0]), hi=chr(v[1]): lo <= ch <= hi)
        elif kind is C.CATEGORY:
          tests.append(_category(v, bool(flags & C.SRE_FLAG_ASCII)))
        else:
          raise ValueError(f"uses {kind} in a character set, which lcjax's matcher does not support")
      return self._char(lambda ch: any(t(ch) for t in tests), negate, nxt, flags, cost=max(1, len(tests)))
    if op is C.BRANCH:
      return self._new(_SPLIT, None, [self._seq(alt, nxt, flags) for alt in av[1]])
    if op is C.SUBPATTERN:
      _, add, remove, items = av
      return self._seq(items, nxt, (flags | add) & ~remove)
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):     # lazy or greedy: the same set of names matches
      lo, hi, items = av
      if not items:                            # (?:){n}: matches the empty string, whatever n
        return nxt
      if hi is C.MAXREPEAT:
        loop = self._new(_SPLIT, None, [])
        self.out[loop] += [self._seq(items, loop, flags), nxt]
        cur = loop
      else:
        cur = nxt
        for _ in range(hi - lo):
          self._step()
          split = self._new(_SPLIT, None, [])
          self.out[split] += [self._seq(items, cur, flags), cur]
          cur = split
      for _ in range(lo):
        self._step()
        cur = self._seq(items, cur, flags)
      return cur
    if op is C.AT:
      return self._new(_AT, (av, bool(flags & C.SRE_FLAG_MULTILINE), bool(flags & C.SRE_FLAG_ASCII)), [nxt])
    raise ValueError(f"uses {str(op).lower()}, which lcjax's matcher does not support (it matches without "
                     "backtracking)")

  def _holds(self, arg, s: str, i: int) -> bool:
    at, multiline, ascii_only = arg
    n = len(s)
    if at is C.AT_BEGINNING_STRING or (at is C.AT_BEGINNING and not multiline):
      return i == 0
    if at is C.AT_BEGINNING:
      return i == 0 or s[i - 1] == "\n"
    if at is C.AT_END_STRING:
      return i == n
    if at is C.AT_END:
      return i == n or (i == n - 1 and s[i] == "\n") or (multiline and s[i] == "\n")
    word = _category(C.CATEGORY_WORD, ascii_only)
    boundary = (i > 0 and word(s[i - 1])) != (i < n and word(s[i]))
    if at is C.AT_BOUNDARY:
      return boundary
    if at is C.AT_NON_BOUNDARY:
      return not boundary
    raise ValueError(f"uses {str(at).lower()}, which lcjax's matcher does not support")

  def _closure(self, states, s: str, i: int) -> set[int]:
    """The states reachable from `states` at position i of s without reading a character."""
    seen, stack = set(), list(states)
    while stack:
      st = stack.pop()
      if st in seen:
        continue
      seen.add(st)
      self._visit(1)
      kind = self.kind[st]
      if kind == _SPLIT or (kind == _AT and self._holds(self.arg[st], s, i)):
        stack.extend(self.out[st])
    return seen

  def _visit(self, cost: int) -> None:
    self.visits += cost
    if self.visits > self.max_visits:
      raise ValueError(f"takes more than {self.max_visits:,} automaton steps to match the model's names")

  def _test(self, st: int, ch: str) -> bool:
    self._visit(self.cost[st])
    return self.arg[st](ch)

  def _run(self, s: str, full: bool) -> bool:
    cur = self._closure([self.start], s, 0)
    for i, ch in enumerate(s):
      if not full and self.accept in cur:
        return True
      cur = self._closure([self.out[st][0] for st in cur if self.kind[st] == _CHAR and self._test(st, ch)], s, i + 1)
      if not cur:
        return False
    return self.accept in cur

  def match(self, s: str) -> bool:
    return self._run(s, full=False)

  def fullmatch(self, s: str) -> bool:
    return self._run(s, full=True)
