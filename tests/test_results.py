"""benchmarks/merge_results.py and benchmarks/results: parts merge into one topic file with every part's JSON and
table kept; bad parts are one line naming them and write nothing; each committed topic file is what the merger
makes of its own parts; every file under benchmarks/results is one that reproduce_h200.sh's header names."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SCRIPT = REPO / "benchmarks" / "reproduce_h200.sh"


def _merger():
  """benchmarks/merge_results.py, loaded from its path (benchmarks/ is not a package)."""
  spec = importlib.util.spec_from_file_location("lcjax_bench_merge_results", REPO / "benchmarks" / "merge_results.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _write_part(folder: pathlib.Path, name: str, d: dict, md: str | None = None) -> pathlib.Path:
  folder.mkdir(parents=True, exist_ok=True)
  (folder / f"{name}.json").write_text(json.dumps(d))
  (folder / f"{name}.md").write_text(md if md is not None else f"# {name}\n\ncommand: `{d.get('command')}`\n")
  return folder / f"{name}.json"


BENCH = dict(command="bench_x.py --n=2 --name=b-part", device="GPU X", versions={"jax": "0"}, source="abc123",
             date="2026-01-02", rows=[dict(impl="lcjax", S=8, ms=1.5), dict(impl="peer", S=8, ms=2.25)])
PROBE = dict(command="probe.py --name=a-part", source="def456", rows=[dict(op="gemv", tb_per_s=3.1)],
             extra={"k": [1, 2]})
B_MD = ("# b-part\n\ndevice: GPU X\n\ncommand: `bench_x.py --n=2 --name=b-part`\n\n### detail\n\n"
        "| impl | S | ms |\n|---|---|---|\n| lcjax | 8 | 1.5 |\n| peer | 8 | 2.25 |\n")
A_MD = "# a-part\n\n| op | TB/s |\n|---|---|\n| gemv | 3.1 |\n"


def test_parts_merge_into_one_topic_with_every_row_kept(tmp_path):
  m = _merger()
  _write_part(tmp_path / "parts", "b-part", BENCH, B_MD)
  _write_part(tmp_path / "parts", "a-part", PROBE, A_MD)
  assert m.main(["stream", str(tmp_path / "out"), str(tmp_path / "parts")]) == 0
  topic = json.loads((tmp_path / "out" / "stream.json").read_text())
  assert topic["topic"] == "stream" and topic["title"] == m.TOPICS["stream"]
  a, b = topic["parts"]                               # in name order
  assert a["name"] == "a-part" and b["name"] == "b-part"
  # Each part is its own JSON, every key and row as written, with its name and commit beside them.
  assert {k: b[k] for k in BENCH} == BENCH and b["commit"] == "abc123"
  assert {k: a[k] for k in PROBE} == PROBE and a["commit"] == "def456" and a["device"] is None
  assert list(b)[:5] == ["name", "command", "device", "versions", "commit"]
  md = (tmp_path / "out" / "stream.md").read_text()
  assert md.startswith(f"# stream: {m.TOPICS['stream']}\n")
  # Each part's table under a heading of its name; its command first (from its JSON where its markdown has none).
  a_at, b_at = md.index("\n## a-part\n"), md.index("\n## b-part\n")
  assert a_at < md.index("command: `probe.py --name=a-part`") < md.index("| gemv | 3.1 |") < b_at
  assert md.index("command: `bench_x.py --n=2 --name=b-part`", b_at) < md.index("| peer | 8 | 2.25 |", b_at)
  assert "\n#### detail\n" in md and "\n# b-part" not in md          # its own headings one level down
  for line in (A_MD + B_MD).splitlines():
    if line.startswith("|"):
      assert line in md
  # Files are named as parts too.
  assert m.main(["stream", str(tmp_path / "out2"), str(tmp_path / "parts" / "b-part.json")]) == 0
  assert [p["name"] for p in json.loads((tmp_path / "out2" / "stream.json").read_text())["parts"]] == ["b-part"]


def _one_line_error(m, argv, match, out):
  with pytest.raises(SystemExit) as e:
    m.main(argv)
  msg = str(e.value)
  assert re.search(match, msg) and "\n" not in msg and msg.startswith("merge_results: "), msg
  assert not out.exists() or not list(out.iterdir()), "a failed merge wrote files"
  return msg


def test_bad_parts_are_one_line_and_write_nothing(tmp_path):
  m = _merger()
  out = tmp_path / "out"
  good = _write_part(tmp_path / "p1", "b-part", BENCH, B_MD)
  no_cmd = _write_part(tmp_path / "p2", "c-part", {k: v for k, v in BENCH.items() if k != "command"})
  msg = _one_line_error(m, ["stream", str(out), str(good), str(no_cmd)], r"c-part\.json has no 'command'", out)
  assert "'rows'" in msg                               # the keys it has
  twin = _write_part(tmp_path / "p3", "b-part", PROBE, A_MD)
  msg = _one_line_error(m, ["stream", str(out), str(tmp_path / "p1"), str(twin)], r"two parts named 'b-part'", out)
  assert str(good) in msg and str(twin) in msg
  no_md = _write_part(tmp_path / "p4", "d-part", PROBE)
  no_md.with_suffix(".md").unlink()
  _one_line_error(m, ["stream", str(out), str(no_md)], r"d-part\.json has no markdown beside it", out)
  named = _write_part(tmp_path / "p5", "e-part", dict(PROBE, name="other"))
  _one_line_error(m, ["stream", str(out), str(named)], r"e-part\.json has its own 'name' \('other'\)", out)
  listed = tmp_path / "p6" / "f-part.json"
  listed.parent.mkdir()
  listed.write_text("[1, 2]")
  _one_line_error(m, ["stream", str(out), str(listed)], r"f-part\.json holds a list", out)
  for source in (None, "unknown"):          # unknown: what benchlib records when neither the variable nor git gave one
    bare = _write_part(tmp_path / f"p7-{source}", "g-part", {k: v for k, v in BENCH.items() if k != "source"} |
                       ({"source": source} if source else {}))
    _one_line_error(m, ["stream", str(out), str(good), str(bare)],
                    rf"g-part\.json has no commit \(source={source!r}\): measure it again with \$LCJAX_SOURCE_REVISION",
                    out)
  _one_line_error(m, ["nosuch", str(out), str(good)], r"unknown topic 'nosuch'; known: attention, longctx", out)
  (tmp_path / "empty").mkdir()
  _one_line_error(m, ["stream", str(out), str(tmp_path / "empty")], r"no part files", out)
  # The long-context topic's combined table needs its parts.
  _one_line_error(m, ["longctx", str(out), str(good)], r"topic longctx: its table needs the parts \['longctx-h200-w'",
                  out)


def _topics() -> dict[str, dict]:
  out = {}
  for path in sorted(RESULTS.glob("*.json")):
    d = json.loads(path.read_text())
    assert "topic" in d and "parts" in d, f"{path.name} is not a topic file of benchmarks/merge_results.py"
    assert path.stem == d["topic"], f"{path.name} holds topic {d['topic']!r}"
    out[d["topic"]] = d
  return out


def test_each_committed_topic_file_is_the_merge_of_its_parts(tmp_path):
  """The parts of every committed topic file, written back out and merged again, give the same JSON: no row or
  combined figure of a topic file was edited by hand (and the long-context view is computed as committed)."""
  m = _merger()
  topics = _topics()
  assert set(topics) == set(m.TOPICS)
  for name, committed in topics.items():
    folder = tmp_path / name
    for p in committed["parts"]:
      _write_part(folder, p["name"], {k: v for k, v in p.items() if k not in ("name", "commit")})
    result, markdown, _ = m.merge(name, [str(folder)])
    assert result == committed, f"{name}.json differs from the merge of its own parts"
    text = (RESULTS / f"{name}.md").read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("- `")] == \
      [ln for ln in markdown.splitlines() if ln.startswith("- `")], f"{name}.md lists other parts than its JSON"


def test_every_committed_part_names_its_commit_or_awaits_remeasurement():
  """A committed part without a commit is one merge_results.WITHOUT_COMMIT lists (measured before parts recorded
  their commit, with the reason); a listed part that has a commit now, or that no topic holds, leaves the list."""
  m = _merger()
  parts = {p["name"]: p for d in _topics().values() for p in d["parts"]}
  bare = sorted(name for name, p in parts.items() if p["commit"] in m.NO_SOURCE)
  unlisted = [name for name in bare if name not in m.WITHOUT_COMMIT]
  assert not unlisted, f"committed parts without a commit that merge_results.WITHOUT_COMMIT does not list: {unlisted}"
  stale = sorted(set(m.WITHOUT_COMMIT) - set(bare))
  assert not stale, ("parts merge_results.WITHOUT_COMMIT lists that have a commit or are no longer committed "
                     f"(take them off the list): {stale}")
  assert all(isinstance(why, str) and why for why in m.WITHOUT_COMMIT.values())


def _expand(token: str) -> list[str]:
  """`a-{x,y}.{json,md}` -> [a-x.json, a-x.md, a-y.json, a-y.md]."""
  parts = re.split(r"\{([^}]*)\}", token)
  return ["".join(c) for c in itertools.product(*[[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)])]


def test_every_result_file_is_named_by_the_reproduce_script():
  """An orphan (a file under benchmarks/results that no step of reproduce_h200.sh writes or names) fails, and so
  does a topic part the header does not list."""
  lines = SCRIPT.read_text().splitlines()
  header = "\n".join(ln for ln in itertools.takewhile(lambda ln: ln.startswith("#"), lines))
  named = {w.strip(",.:;") for tok in re.findall(r"[\w.{},-]+", header) for w in _expand(tok)}
  files = sorted(p.name for p in RESULTS.rglob("*") if p.is_file())
  orphans = [f for f in files if f not in named]
  assert not orphans, f"files under benchmarks/results that reproduce_h200.sh's header does not name: {orphans}"
  unlisted = [f"{t}: {p['name']}" for t, d in _topics().items() for p in d["parts"] if p["name"] not in named]
  assert not unlisted, f"topic parts reproduce_h200.sh's header does not list: {unlisted}"
  (steps,) = re.findall(r"^all=\(([^)]*)\)", SCRIPT.read_text(), flags=re.M)
  assert set(steps.split()) - {"tables"} == set(_merger().TOPICS), "one step per topic of merge_results.TOPICS"


def test_keep_merges_new_parts_into_the_committed_topic(tmp_path):
  """--keep: every committed topic merged with no new part is itself, byte for byte (JSON and markdown); a new part
  replaces the one of its name and leaves the others' JSON and sections as they were."""
  m = _merger()
  for name in m.TOPICS:
    result, markdown, _ = m.merge(name, [], keep=str(RESULTS))
    assert result == json.loads((RESULTS / f"{name}.json").read_text()), name
    assert markdown == (RESULTS / f"{name}.md").read_text(), name
  out = tmp_path / "out"
  _write_part(tmp_path / "old", "b-part", BENCH, B_MD)
  _write_part(tmp_path / "old", "a-part", PROBE, A_MD)
  assert m.main(["stream", str(out), str(tmp_path / "old")]) == 0
  before = (out / "stream.md").read_text()
  new_b = dict(BENCH, source="fff999", rows=[dict(impl="lcjax", S=8, ms=1.25)])
  _write_part(tmp_path / "new", "b-part", new_b, B_MD.replace("| lcjax | 8 | 1.5 |", "| lcjax | 8 | 1.25 |"))
  _write_part(tmp_path / "new", "c-part", dict(PROBE, command="probe.py --name=c-part"))
  assert m.main(["--keep", "stream", str(out), str(tmp_path / "new")]) == 0
  topic = json.loads((out / "stream.json").read_text())
  a, b, c = topic["parts"]
  assert (a["name"], b["name"], c["name"]) == ("a-part", "b-part", "c-part")
  assert {k: a[k] for k in PROBE} == PROBE and a["commit"] == "def456"
  assert b["rows"] == new_b["rows"] and b["commit"] == "fff999"
  md = (out / "stream.md").read_text()
  a_section = before[before.index("\n## a-part\n"):before.index("\n## b-part\n")]
  assert a_section in md and "| lcjax | 8 | 1.25 |" in md and "| lcjax | 8 | 1.5 |" not in md
  assert md.index("\n## b-part\n") < md.index("\n## c-part\n")
  # An H200 part drops its H100 twin (merge_results.twins_replaced; REPLACED_BY's names: the test below).
  _write_part(tmp_path / "h100", "stream-h100", dict(PROBE, command="bench_stream.py --name=stream-h100"))
  assert m.main(["--keep", "stream", str(out), str(tmp_path / "h100")]) == 0
  _write_part(tmp_path / "h200", "stream-h200", dict(PROBE, command="bench_stream.py --name=stream-h200"))
  assert m.main(["--keep", "stream", str(out), str(tmp_path / "h200")]) == 0
  names = [p["name"] for p in json.loads((out / "stream.json").read_text())["parts"]]
  assert names == ["a-part", "b-part", "c-part", "stream-h200"], names
  script = SCRIPT.read_text()
  for old, by in m.REPLACED_BY.items():
    assert f"--name={by}" in script and old in script, (old, by)
  _one_line_error(m, ["--keep", "stream", str(tmp_path / "none"), str(tmp_path / "new")], r"--keep: no .*stream\.json",
                  tmp_path / "none")
  _one_line_error(m, ["stream", str(tmp_path / "none")], r"no parts given", tmp_path / "none")
  # A part whose markdown holds a line that reads as another part's heading would cut --keep's sections wrong.
  _write_part(tmp_path / "clash", "d-part", PROBE, "# d-part\n\n# b-part\n")
  _one_line_error(m, ["stream", str(tmp_path / "out3"), str(tmp_path / "old"), str(tmp_path / "clash")],
                  r"part d-part's markdown has the line '## b-part'", tmp_path / "out3")


_FAKE_PYTHON = """#!/usr/bin/env bash
# python3 for reproduce_h200.sh in a test: the merge runs; a part's command logs its name and writes a stand-in part.
if [ "$1" = benchmarks/merge_results.py ]; then exec "$REAL_PYTHON" "$@"; fi
for a in "$@"; do case $a in --name=*) name=${a#--name=} ;; --out=*) out=${a#--out=} ;; esac; done
echo "$name" >> "$RAN"
printf '{"command": "%s", "source": "fake123", "rows": []}' "$name" > "$out/$name.json"
printf '# %s\\n\\nstand-in\\n' "$name" > "$out/$name.md"
"""


def _reproduce(tmp_path, *args, gpu="NVIDIA H200", as_gpu=None):
  """reproduce_h200.sh ARGS with a stand-in python3 (its parts' commands write stand-in parts), a stand-in
  nvidia-smi naming `gpu`, AS_GPU=as_gpu if given, and OUT a copy of benchmarks/results: (returncode, stderr, the
  part names it ran)."""
  bin_dir, out, ran = tmp_path / "bin", tmp_path / "results", tmp_path / "ran"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "python3").write_text(_FAKE_PYTHON)
  (bin_dir / "nvidia-smi").write_text('#!/usr/bin/env bash\necho "$FAKE_GPU"\n')
  for tool in ("python3", "nvidia-smi"):
    (bin_dir / tool).chmod(0o755)
  if not out.exists():
    shutil.copytree(RESULTS, out)
  ran.write_text("")
  env = dict({k: v for k, v in os.environ.items() if k not in ("LLMCOMPRESSOR_PYTHON", "AS_GPU")},
             PATH=f"{bin_dir}:{os.environ['PATH']}", REAL_PYTHON=sys.executable, RAN=str(ran), FAKE_GPU=gpu,
             OUT=str(out), PARTS=str(tmp_path / "parts"), **({} if as_gpu is None else {"AS_GPU": as_gpu}))
  p = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)
  return p.returncode, p.stderr, ran.read_text().split()


def test_reproduce_step_part_measures_only_the_named_parts(tmp_path):
  """STEP:PART runs only the parts named and merges them into the committed topic file beside the rest; a part
  that a step does not have fails in one line before any part runs."""
  rc, err, ran = _reproduce(tmp_path, "needle:needle-int8-smollm2-h200,needle-fp8-smollm2-h200", "stream")
  assert rc == 0, err
  assert ran == ["needle-fp8-smollm2-h200", "needle-int8-smollm2-h200", "stream-h200"]
  needle = json.loads((tmp_path / "results" / "needle.json").read_text())
  committed = {p["name"]: p for p in json.loads((RESULTS / "needle.json").read_text())["parts"]}
  for p in needle["parts"]:
    if p["name"] in ran:
      assert p["commit"] == "fake123" and p["rows"] == []
    else:
      assert p == committed[p["name"]]
  assert {p["name"] for p in needle["parts"]} == set(committed)
  assert [p["name"] for p in json.loads((tmp_path / "results" / "stream.json").read_text())["parts"]] == \
    ["stream-h200"]
  bad = {("stream", "needle:needle-nosuch"): "step needle has no part 'needle-nosuch' (its parts: needle-smollm2 "
                                             "needle-fp8-smollm2-h200",
         ("stream", "needle:"): "step needle has no part ''",
         ("stream", "multigpu:8xh200-predicted"): "8xh200-predicted extrapolates l70b-8layers-h200 of the same run",
         ("stream", "quality"): "LLMCOMPRESSOR_PYTHON: set it to a Python with llm-compressor"}
  for args, want in bad.items():
    rc, err, ran = _reproduce(tmp_path, *args)
    assert rc != 0 and ran == [] and err.strip().count("\n") == 0 and want in err, (args, err)
  rc, err, ran = _reproduce(tmp_path, "quality:fp8-quality-h200")      # a part that needs no llm-compressor
  assert rc == 0 and ran == ["fp8-quality-h200"], err
  # A part named for an H200 refuses another GPU before anything runs; a CPU part runs anywhere.
  rc, err, ran = _reproduce(tmp_path, "needle:needle-smollm2", "stream", gpu="NVIDIA H100 80GB HBM3")
  assert rc == 2 and ran == [] and "stream: part stream-h200 is named for an H200, and this machine's GPU is " \
    "'NVIDIA H100 80GB HBM3'" in err, err
  rc, err, ran = _reproduce(tmp_path, "needle:needle-smollm2", gpu="")
  assert rc == 0 and ran == ["needle-smollm2"], err


def test_reproduce_as_h100_runs_the_h200_parts_under_their_h100_names(tmp_path):
  """AS_GPU=h100 runs a step's H200 parts on an H100 as their H100 twins (CPU parts as they are), merged beside
  the committed parts even for a whole step; a later H200 run of a part replaces its twin, and an H200 part the
  H100 parts REPLACED_BY names for it. It refuses another GPU, the multigpu parts (H200s measured or predicted)
  and an unknown AS_GPU, each in one line before anything runs. Only the part's name changes: paths holding
  "-h200" (this test's folder) stay as they are."""
  tmp_path = tmp_path / "run-h200"
  tmp_path.mkdir()
  h100 = "NVIDIA H100 80GB HBM3"
  committed = {t: {p["name"] for p in d["parts"]} for t, d in _topics().items()}
  names = lambda topic: [p["name"] for p in json.loads((tmp_path / "results" / f"{topic}.json").read_text())["parts"]]
  rc, err, ran = _reproduce(tmp_path, "needle", "stream", "attention:attention-fp8-h200-c", gpu=h100, as_gpu="h100")
  assert rc == 0, err
  assert ran == ["needle-smollm2", "needle-fp8-smollm2-h100", "needle-int8-smollm2-h100",
                 "needle-fp8decode-smollm2-h100", "stream-h100", "attention-fp8-h100-c"], ran
  assert set(names("needle")) == committed["needle"] | {"needle-fp8-smollm2-h100", "needle-int8-smollm2-h100",
                                                        "needle-fp8decode-smollm2-h100"}
  assert set(names("attention")) == committed["attention"] | {"attention-fp8-h100-c"}
  assert set(names("stream")) == committed["stream"] | {"stream-h100"}
  rc, err, ran = _reproduce(tmp_path, "stream:stream-h200", "attention:attention-chunk-paged-h200")
  assert rc == 0 and ran == ["stream-h200", "attention-chunk-paged-h200"], err
  assert "stream-h100" not in names("stream") and "stream-h200" in names("stream")
  assert "attention-chunk-fp8pages-h100" not in names("attention") and "attention-fp8-h100-c" in names("attention")
  for args, gpu, as_gpu, want in (
      (("stream",), "NVIDIA H200", "h100", "AS_GPU=h100 runs part stream-h200 on an H100, and this machine's GPU is "
                                           "'NVIDIA H200'"),
      (("multigpu",), h100, "h100", "does not run as AS_GPU=h100"),
      (("multigpu:l70b-8layers-h200,8xh200-predicted",), h100, "h100", "does not run as AS_GPU=h100"),
      (("multigpu-2",), h100, "h100", "does not run as AS_GPU=h100"),
      (("stream",), h100, "a100", "AS_GPU=a100: the only value is h100")):
    rc, err, ran = _reproduce(tmp_path, *args, gpu=gpu, as_gpu=as_gpu)
    assert rc == 2 and ran == [] and err.strip().count("\n") == 0 and want in err, (args, err)