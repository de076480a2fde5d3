"""README.md and docs/: a short README, links that resolve, result files that exist, no lab history.

Every relative link of README.md and docs/*.md names a file of the repository and, with `#anchor`, one of its
headings (GitHub's anchor rule); every benchmark result file they name (`benchmarks/results/...`, a bare topic
file `exact.md` or a bare `name-h200.md`, with `{a,b}` and `*` patterns) exists; history ("previous kernel",
"session 3", "other run") belongs in benchmarks/NOTES-*.md."""
from __future__ import annotations

import importlib.util
import itertools
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
HISTORY = re.compile(r"previous kernel|other run|earlier call|\bsession \d|\bsessions? \d+-\d+|fixed since", re.I)


def _anchor(heading: str) -> str:
  """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
  return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _expand(pattern: str) -> list[str]:
  """`a-{x,y}-b` -> [a-x-b, a-y-b]."""
  parts = re.split(r"\{([^}]*)\}", pattern)
  choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
  return ["".join(c) for c in itertools.product(*choices)]


def test_readme_is_short():
  lines = (REPO / "README.md").read_text().splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines; the details belong in docs/"


def test_links_resolve():
  bad = []
  for page in PAGES:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if re.match(r"[a-z]+://", target):
        continue
      file, _, anchor = target.partition("#")
      dest = (page.parent / file).resolve() if file else page
      if not dest.exists():
        bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        bad.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor} in {dest.name})")
  assert not bad, "\n".join(bad)


def _load(name: str, path: pathlib.Path):
  """A module of benchmarks/, loaded from its path (benchmarks/ is not a package)."""
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_named_result_files_exist():
  names = set(p.name for p in RESULTS.iterdir())
  topics = _load("lcjax_bench_merge_results", REPO / "benchmarks" / "merge_results.py").TOPICS
  bad = []
  for page in PAGES:
    for prefix, ref in re.findall(r"(?<![\w/{},*.-])(benchmarks/results/)?([\w{},*.-]+\.(?:md|json|png|txt))\b",
                                  page.read_text()):
      if not prefix and ref.rsplit(".", 1)[0] not in topics and not re.search(r"h200|-cpu|fp8-quality|predicted",
                                                                                ref):
        continue                     # a bare name that is not a result file's (README.md, NOTES-fp8.md, ...)
      for name in _expand(ref):
        if not any(pathlib.PurePath(n).match(name) for n in names):
          bad.append(f"{page.relative_to(REPO)}: {name}")
  assert not bad, "result files named but not in benchmarks/results:\n" + "\n".join(bad)


def test_no_lab_history_in_the_guide():
  bad = [f"{page.relative_to(REPO)}:{i + 1}: {m.group(0)!r}"
         for page in PAGES for i, line in enumerate(page.read_text().splitlines())
         for m in [HISTORY.search(line)] if m and "session3-tests" not in line]
  assert not bad, "history goes to benchmarks/NOTES-*.md:\n" + "\n".join(bad)


def _tables():
  return _load("lcjax_bench_tables", REPO / "benchmarks" / "tables.py")


def test_tables_match_their_json():
  tables = _tables()
  marked = {n for page in PAGES for n in re.findall(r"^<!-- table: ([\w-]+) -->$", page.read_text(), flags=re.M)}
  assert marked == set(tables.TABLES), \
    f"tables marked in the pages {sorted(marked)} != generators {sorted(tables.TABLES)}"
  stale = [f"{page.relative_to(REPO)}: {name}" for page in PAGES for name in tables.render(page.read_text())[1]]
  assert not stale, "tables differ from their JSON (`python benchmarks/tables.py` rewrites them):\n" + \
    "\n".join(stale)


def test_tables_check_catches_a_changed_number():
  tables = _tables()
  text = (REPO / "docs" / "performance.md").read_text()
  row = re.search(r"^\| 128K \| (\d+\.\d\d) s \(", text, re.M)       # the long-context table's 128K prefill
  assert row, "docs/performance.md has no 128K row in its long-context table"
  planted = text.replace(row.group(0), row.group(0).replace(row.group(1), f"{float(row.group(1)) + 0.01:.2f}"), 1)
  assert planted != text
  fixed, changed = tables.render(planted)
  assert changed == ["longctx-8b"] and fixed == text
