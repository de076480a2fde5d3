"""One import direction: a module imports only from lower layers.

L0 config, host allocator, prefix cache, tokenizer, chat templates (stdlib, numpy, jinja2) < L1 sharding < L2 ops
(kernels) < L3 model, device cache < L4 checkpoint, engine < L5 the package's API, the CLI; tools/ and configs/ sit
above all of it."""
from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "lcjax"

LAYERS = {
    "lcjax.config": 0, "lcjax.cache.pages": 0, "lcjax.cache.prefix": 0, "lcjax.cache.host": 0, "lcjax.tokenizer": 0,
    "lcjax.chat_template": 0,
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


def _module_graph(package: pathlib.Path) -> dict[str, set[str]]:
  """{module: the modules of `package` it imports}, counting imports inside functions too (a deferred import
  still ties the two modules together)."""
  modules = {}
  for path in package.rglob("*.py"):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
  graph = {}
  for module, path in modules.items():
    deps = set()
    for imp in _imports(path, module):
      # `from lcjax.ops.fp8 import E4M3` names lcjax.ops.fp8.E4M3: the module is its longest known prefix.
      parts = imp.split(".")
      hit = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None)
      if hit is not None and hit != module and not module.startswith(hit + "."):
        deps.add(hit)
    graph[module] = deps
  return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph` as [a, b, ..., a], or None."""
  state = {}                         # module -> 1 while on the depth-first path, 2 once finished
  path = []

  def visit(m):
    state[m] = 1
    path.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == 1:
        return path[path.index(d):] + [d]
      if d not in state and (found := visit(d)):
        return found
    path.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_import_cycle_finder():
  assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
  """Modules import in one direction inside a layer too, deferred imports included: in lcjax.ops the kernels, the
  Mosaic GPU helpers they share (mosaic_gpu.common) and the backends that choose between kernels (pallas_backend,
  backends)."""
  graph = _module_graph(ROOT)
  assert {"lcjax.ops.mosaic_gpu.flash", "lcjax.ops.mosaic_gpu.common"} <= graph["lcjax.ops.pallas_backend"] | \
      graph["lcjax.ops.mosaic_gpu.flash"], sorted(graph)
  cycle = import_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The modules outside lcjax.ops.triton that import it (JAX has deprecated Pallas' Triton lowering): dropping it is
# that folder once each of these has another kernel. A new one is a decision; docs/architecture.md lists them.
TRITON_CALLERS = {"lcjax.ops.pallas_backend", "lcjax.ops.mosaic_gpu.paged",
                  "lcjax.ops.kernels"}
# The folders of kernel modules, one a lowering.
LOWERINGS = ("lcjax.ops.triton", "lcjax.ops.mosaic_gpu", "lcjax.ops.cudnn")


def test_kernels_sit_in_the_folder_of_their_lowering():
  """No kernel imports the backends that choose between kernels, and the Triton folder's callers are the known
  ones."""
  graph = _module_graph(ROOT)
  choosers = {"lcjax.ops.backends", "lcjax.ops.pallas_backend"}
  bad = [f"{m} imports {sorted(d & choosers)}" for m, d in graph.items() if m.startswith(LOWERINGS) and d & choosers]
  assert not bad, "\n".join(bad)
  callers = {m for m, d in graph.items() if not m.startswith("lcjax.ops.triton")
             and any(x.startswith("lcjax.ops.triton.") for x in d)}
  assert callers == TRITON_CALLERS, sorted(callers ^ TRITON_CALLERS)


def test_model_and_cache_receive_their_kernels():
  """No module of lcjax.model or lcjax.cache imports a kernel module (a module of lcjax.ops.triton, mosaic_gpu or
  cudnn), deferred imports included, nor the modules that import kernel modules to choose between them
  (lcjax.ops.kernels, lcjax.ops.pallas_backend): the model and the cache receive the attention backend, the GEMV
  kernel and the page writer as objects, which lcjax.engine.serving.resolve chooses."""
  banned = (*LOWERINGS, "lcjax.ops.kernels", "lcjax.ops.pallas_backend")
  bad = []
  for package in ("model", "cache"):
    for path in (ROOT / package).rglob("*.py"):
      rel = path.relative_to(ROOT.parent).with_suffix("")
      module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
      bad += [f"{module} imports {imp}" for imp in _imports(path, module)
              if any(imp == b or imp.startswith(b + ".") for b in banned)]
  assert not bad, "\n".join(bad)


# Import names of the distributions in pyproject's `dependencies` whose name differs from the distribution's.
_IMPORT_NAMES = {"orbax-checkpoint": "orbax", "absl-py": "absl"}


def _required_imports(repo: pathlib.Path) -> set[str]:
  import re
  import tomllib
  deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
  names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in deps}
  return {_IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names}


def _top_level_imports(path: pathlib.Path):
  """(line, top-level package) of the imports a module runs when it is imported, in order: statements at module
  level and in module-level if/with/try blocks, not those inside functions or classes. A package that a
  module-level pytest.importorskip("package") call has checked before is not listed: the module skips without it."""
  checked = set()

  def walk(body):
    for node in body:
      if isinstance(node, ast.Import):
        yield from ((node.lineno, a.name.split(".")[0]) for a in node.names)
      elif isinstance(node, ast.ImportFrom) and not node.level:
        yield node.lineno, node.module.split(".")[0]
      elif isinstance(node, (ast.If, ast.With, ast.Try)):
        for part in (node.body, getattr(node, "orelse", []), *(h.body for h in getattr(node, "handlers", [])),
                     getattr(node, "finalbody", [])):
          yield from walk(part)
      elif isinstance(node, (ast.Expr, ast.Assign)) and isinstance(node.value, ast.Call):
        f, args = node.value.func, node.value.args
        if isinstance(f, ast.Attribute) and f.attr == "importorskip" and args and isinstance(args[0], ast.Constant):
          checked.add(args[0].value.split(".")[0])

  yield from ((line, top) for line, top in walk(ast.parse(path.read_text()).body) if top not in checked)


def test_test_modules_import_without_optional_packages():
  """pytest collects every test module with only the required dependencies installed: an optional package (the
  `test`, `plot` extras: hypothesis, torch, transformers, matplotlib, nbclient, ...) is imported inside the tests
  that use it, or through pytest.importorskip, which skips the module with its reason."""
  repo = ROOT.parent
  allowed = _required_imports(repo) | set(sys.stdlib_module_names) | {"pytest", "lcjax", "tests", "tools"}
  assert {"jax", "orbax", "absl", "numpy"} <= allowed
  bad = []
  for path in sorted((repo / "tests").glob("*.py")):
    for line, top in _top_level_imports(path):
      if top not in allowed:
        bad.append(f"tests/{path.name}:{line} imports {top} at module level")
    # The tools a test module imports at module level must import without optional packages too.
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tools."):
        tool = repo / (node.module.replace(".", "/") + ".py")
        bad.extend(f"tools/{tool.name}:{line} imports {top} at module level (imported by tests/{path.name})"
                   for line, top in _top_level_imports(tool) if top not in allowed)
  assert not bad, "optional packages need pytest.importorskip(..., reason=...):\n" + "\n".join(bad)


def test_the_engine_module_stays_a_facade():
  """lcjax/engine/engine.py holds the Engine's public calls; the work lives in the modules it delegates to
  (serving, placement, scheduler, context, prompts, results): at most 400 lines."""
  lines = len((ROOT / "engine" / "engine.py").read_text().splitlines())
  assert lines <= 400, f"lcjax/engine/engine.py has {lines} lines: move work out of the facade"
