"""tools/mutation_check.py: each planted bug fails every test it lists (slow: a pytest process per mutant, on a
copy of the package), and each mutant still applies to the code as it is (fast, on every run).

The mutants' pytest processes are forked from a server that has imported jax, flax, torch, pytest and pytest's
plugins (not lcjax: each copy's must be the one imported), instead of started afresh: a fresh interpreter spends
seconds importing them on a 2-core machine. The plugins' modules (pytest11 entry points: hypothesis's, xdist's,
anyio's, platformdirs') are imported by the server because pytest rewrites the asserts of every module of a
plugin's package that it imports itself, about 100 modules (73 of them hypothesis's) compiled from source in each
process: 1.5 to 2.5 s of each mutant's run. A module the server imported is not rewritten in the job (pytest warns
that it cannot); rewriting changes the messages of those packages' own asserts only, never a test's. The server
imports hypothesis itself too: its plugin imports it at the end of every session (pytest_terminal_summary), 1.5 s
of a mutant's job with its modules rewritten."""
from __future__ import annotations

import importlib.metadata
import os
import re

import pytest

from tests import forkserver
from tools.mutation_check import MUTANTS, REPO, check_text, run

# pytest's plugins: the modules of the installed distributions' pytest11 entry points.
_PLUGINS = tuple(sorted({ep.module for ep in importlib.metadata.entry_points(group="pytest11")}))
_PRELOAD = ("jax", "numpy", "flax.nnx", "torch", "transformers", "pytest", "hypothesis", *_PLUGINS)


def _forked(argv, *, env, cwd, timeout):
  return forkserver.run(argv, env=env, cwd=cwd, timeout=timeout, preload=_PRELOAD)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_and_names_existing_tests(mutant):
  check_text(mutant)
  assert mutant.new != mutant.old and mutant.tests
  for test in mutant.tests:
    path, name = re.fullmatch(r"([\w/]+\.py)::(\w+)(?:\[.+\])?", test).groups()
    with open(os.path.join(REPO, path)) as f:
      assert f"\ndef {name}(" in f.read(), f"{test}: no such test function"


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_planted_bug_fails_its_tests(mutant):
  out = run(mutant, spawn=_forked)
  assert out.caught, f"{mutant.name} ({mutant.bug}) survived: {out.passed} passed with it\n{out.output}"
