"""Every Python example of README.md and docs/ runs as written, so an example cannot rot.

The ```python blocks of a page run in order in one namespace (a later block may use an earlier block's `engine`),
in a temporary working directory, on the CPU with the bundled SmolLM2. Names an example takes from its prose are
given by PROSE (a long document, a few prompts, a checkpoint directory, the report file a block opens). A block
that cannot run here is preceded in its page by `<!-- example: skip: REASON -->`, and the reason is checked to
be given; every other block runs.
"""
from __future__ import annotations

import os
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- example: skip: (?P<why>[^>]+?) -->\n+)?```python\n(?P<code>.*?)```", re.S)
DOC = ("The ferry ran twice an hour while the weather held. Remember this: the password is PELICAN-42. The mill "
       "stood by the river, and the children counted the boats from the bridge. ") * 8


def blocks(page: pathlib.Path) -> list[tuple[str, str | None]]:
  """(code, skip reason or None) of each python block of a page."""
  return [(m["code"], m["why"]) for m in BLOCK.finditer(page.read_text())]


EXAMPLES = [p for p in PAGES if blocks(p)]


@pytest.fixture
def prose(tmp_path, monkeypatch, smollm2_checkpoint):
  """The names the pages' prose gives their examples, and a working directory of the test's own."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "report.txt").write_text(DOC, encoding="utf-8")
  results = tmp_path / "benchmarks" / "results"        # the plots' example reads a committed result file
  results.mkdir(parents=True)
  (results / "longctx.json").write_bytes((REPO / "benchmarks" / "results" / "longctx.json").read_bytes())
  return dict(long_document=DOC, prompts=["Hi!", "What is the password?"], CKPT=str(smollm2_checkpoint))


@pytest.mark.optimized_xla            # the real model decodes hundreds of tokens: optimized code pays back
@pytest.mark.parametrize("page", EXAMPLES, ids=[str(p.relative_to(REPO)) for p in EXAMPLES])
def test_the_pages_examples_run(page, prose):
  namespace = dict(prose, __name__="__doc_example__")
  ran = 0
  try:
    for i, (code, why) in enumerate(blocks(page)):
      if why is not None:
        assert len(why.split()) >= 3, f"{page.name} block {i}: say why it is skipped"
        continue
      exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
      ran += 1
  finally:
    for value in list(namespace.values()):
      if hasattr(value, "close") and type(value).__name__ in ("Engine", "Context"):
        value.close()
  assert ran or all(why for _, why in blocks(page)), page


def test_every_skip_marks_a_block():
  """A skip marker stands right before the block it skips (a stray one would skip nothing)."""
  for page in PAGES:
    text = page.read_text()
    assert text.count("<!-- example: skip:") == sum(why is not None for _, why in blocks(page)), page
