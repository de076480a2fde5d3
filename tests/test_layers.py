"""One import direction: a module imports only from lower layers.

L0 config, host allocator, prefix cache, tokenizer (stdlib, numpy) < L1 sharding < L2 ops (kernels) < L3 model,
device cache < L4 checkpoint, engine < L5 the package's API, the CLI; tools/ and configs/ sit above all of it."""
from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "lcjax"

LAYERS = {
    "lcjax.config": 0, "lcjax.cache.pages": 0, "lcjax.cache.prefix": 0, "lcjax.cache.host": 0, "lcjax.tokenizer": 0,
    "lcjax.sharding": 1,
    "lcjax.ops": 2,
    "lcjax.model": 3, "lcjax.cache.kv": 3, "lcjax.cache": 3,
    "lcjax.checkpoint": 4, "lcjax.engine": 4,
    "lcjax.cli": 5, "lcjax": 5,
}
# Third-party imports each low layer may use.
ALLOWED_THIRD_PARTY = {0: {"numpy", "sentencepiece", "tokenizers", "jinja2"}, 1: {"numpy", "jax", "flax"},
                       2: {"numpy", "jax", "einops"}}


def layer_of(module: str) -> int:
  best = None
  for prefix, layer in LAYERS.items():
    if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
      best = (prefix, layer)
  assert best is not None, module
  return best[1]


def _imports(path: pathlib.Path, module: str):
  tree = ast.parse(path.read_text())
  pkg = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([node.module] if node.module else []))
      else:
        base = node.module
      # `from lcjax import tokenizer` imports lcjax.tokenizer: judge each imported name.
      yield from (f"{base}.{a.name}" for a in node.names)


def test_imports_go_down_the_layers():
  bad = []
  for path in ROOT.rglob("*.py"):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    mine = layer_of(module)
    for imp in _imports(path, module):
      if imp.startswith("lcjax"):
        if layer_of(imp) > mine:
          bad.append(f"{module} (L{mine}) imports {imp} (L{layer_of(imp)})")
      elif mine in ALLOWED_THIRD_PARTY:
        top = imp.split(".")[0]
        if top not in sys.stdlib_module_names and top not in ALLOWED_THIRD_PARTY[mine] | {"__future__"}:
          bad.append(f"{module} (L{mine}) imports third-party {imp}")
  assert not bad, "\n".join(bad)


def test_tools_and_configs_sit_above_the_package():
  """lcjax never imports tools/, configs/ or tests/; configs import without editing sys.path; tools import
  lcjax and their own tools/benchlib only."""
  repo = ROOT.parent
  bad = []
  for path in ROOT.rglob("*.py"):
    rel = path.relative_to(repo).with_suffix("")
    for imp in _imports(path, ".".join(rel.parts)):
      if imp.split(".")[0] in ("tools", "configs", "tests"):
        bad.append(f"{rel} imports {imp}")
  for path in (repo / "configs").glob("*.py"):
    if "sys.path" in path.read_text():
      bad.append(f"{path.name} edits sys.path")
    for imp in _imports(path, f"configs.{path.stem}"):
      if imp.split(".")[0] not in ("lcjax", "ml_collections", "dataclasses", "__future__"):
        bad.append(f"configs/{path.name} imports {imp}")
  for path in (repo / "tools").glob("*.py"):
    for imp in _imports(path, f"tools.{path.stem}"):
      if imp.startswith(("tests", "configs")) or (imp.startswith("tools") and imp not in ("tools.benchlib",)):
        bad.append(f"tools/{path.name} imports {imp}")
  assert not bad, "\n".join(bad)
