"""Faults: conversions killed with SIGKILL at many points, and generations interrupted with KeyboardInterrupt.

Conversions (tools/convert_hf.py and convert_hf in a process of their own, forked by tests.forkserver; slow): after a
kill the destination holds no checkpoint, the complete previous one (a kill while overwriting), or the complete new
one, never a partial one; leftovers are refused by load_config; and a rerun writes a checkpoint identical to an
uninterrupted conversion, compared array by array (values and dtypes, read back with orbax), with equal config,
manifest and tokenizer files.
Kill points: after a random number of stored items and after a random time (seeded), fresh and overwriting, and
exactly at the commit (manifest written, before the rename; between the two renames of an overwrite; while the
replaced checkpoint is being removed) through a patched os.rename/shutil.rmtree in the conversion's process.

Generations (fast): a KeyboardInterrupt inside the donated prefill or decode step, a real SIGINT during a decode
step, and one in the code that consumes a stream; each time the engine's pages all come back (the allocator's
invariants hold) and the next requests give the tokens they gave before the fault.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from lcjax.checkpoint import CheckpointError, convert_hf, load_config
from lcjax.checkpoint import layout
from lcjax.config import ModelConfig, RunConfig, preset
from lcjax.engine.engine import Engine
from tests import fixtures_ckpt as fx
from tests import forkserver
from tests.run_cache import REPO, cpu_env
from tests.test_atomic import tmp_of

# Four layers: 39 stored items, so that kill points land all through the writes.
CFG = ModelConfig("fault-test", vocab_size=320, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=128, max_position=512, bos_id=0, eos_ids=(1,))
_PART = re.compile(r"^\d{3}$")


def snapshot(ckpt: str) -> dict:
  """Everything a checkpoint holds: every stored array (orbax, as written), the JSON files and other files."""
  out = {}
  for root, dirs, files in os.walk(ckpt):
    rel = os.path.relpath(root, ckpt)
    if _PART.match(os.path.basename(root)) and rel.startswith(layout.PARAMS_DIR):
      out[rel] = ocp.PyTreeCheckpointer().restore(os.path.abspath(root))["value"]
      dirs[:] = []
    elif rel == ".":
      for f in files:
        data = open(os.path.join(root, f), "rb").read()
        out[f] = json.loads(data) if f.endswith(".json") else data
  return out


def assert_same(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k, w in want.items():
    g = got[k]
    if isinstance(w, np.ndarray):
      assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), k
    else:
      assert g == w, k


def _items(tmp: str) -> int:
  return sum(1 for root, _, _ in os.walk(tmp) if _PART.match(os.path.basename(root)))


def _wait_items(p, tmp, k, deadline):
  """Until process p's temporary directory (the path tmp() names) holds k items."""
  while p.poll() is None and time.time() < deadline and _items(tmp()) < k:
    time.sleep(0.002)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Two random HF folders (sharded safetensors with an index, tokenizer files) and their uninterrupted
  conversions: `new` is what every conversion here writes, `old` what an overwrite replaces."""
  root = tmp_path_factory.mktemp("faults")
  s = {}
  for name, seed in (("new", 1), ("old", 2)):
    src = str(root / f"hf_{name}")
    fx.make_hf_folder(src, CFG, seed=seed, max_shard_size="60KB")
    ref = str(root / f"ref_{name}")
    t0 = time.time()
    convert_hf(src, ref, progress=False)
    s["seconds"] = time.time() - t0
    s[f"src_{name}"], s[f"ref_{name}"] = src, ref
    s[name] = snapshot(ref)
  assert os.path.exists(os.path.join(s["src_new"], "model.safetensors.index.json"))
  s["items"] = _items(s["ref_new"])
  return s


def _kill_points(s) -> list[tuple[str, str, float]]:
  """(how, overwrite?, where): seeded random points, then the exact commit points."""
  rng = np.random.default_rng(8)
  pts = [("items", "fresh" if i % 2 == 0 else "overwrite", int(k))
         for i, k in enumerate(rng.integers(1, s["items"] + 1, 3))]
  pts += [("seconds", "fresh" if i % 2 == 0 else "overwrite", round(float(t), 3))
          for i, t in enumerate(rng.uniform(0.0, 1.2, 2) * s["seconds"])]
  pts += [("hook", "fresh", "before-rename"), ("hook", "overwrite", "before-rename"),
          ("hook", "overwrite", "between-renames"), ("hook", "overwrite", "removing-old")]
  return pts


def _kill(s, parent, how, mode, where):
  """Start a conversion into parent/out (a process forked by tests.forkserver), SIGKILL it at the point; return
  it, ended (returncode -9 when killed)."""
  dst = os.path.join(parent, "out")
  if mode == "overwrite":
    shutil.copytree(s["ref_old"], dst)
  if how == "hook":
    p = forkserver.start([sys.executable, "-m", "tests.fault_jobs", s["src_new"], dst, where], env=cpu_env(), cwd=REPO)
  else:
    p = forkserver.start([sys.executable, os.path.join(REPO, "tools", "convert_hf.py"), f"--src={s['src_new']}",
                          f"--dst={dst}"] + (["--overwrite"] if mode == "overwrite" else []), env=cpu_env(), cwd=REPO)
    if how == "items":
      _wait_items(p, lambda: tmp_of(dst, p.pid), where, time.time() + 120)
    else:                        # seconds after the writer starts
      while p.poll() is None and not os.path.exists(tmp_of(dst, p.pid)):
        time.sleep(0.002)
      time.sleep(where)
    p.send_signal(signal.SIGKILL)
  p.wait(timeout=120)
  return p


@pytest.mark.slow
def test_killed_conversions_leave_no_partial_checkpoint_and_rerun_identically(sources, tmp_path):
  outcomes = []
  for i, (how, mode, where) in enumerate(_kill_points(sources)):
    parent = str(tmp_path / f"kill{i}")
    os.makedirs(parent)
    dst = os.path.join(parent, "out")
    p = _kill(sources, parent, how, mode, where)
    label = f"{how}={where} ({mode})"
    assert p.returncode in (-signal.SIGKILL, 0), (label, p.returncode, (p.stdout + p.stderr)[-2000:])
    # What the kill left at the destination: nothing, or a complete checkpoint (the old one or the new one).
    state = "none"
    if os.path.exists(dst):
      got = snapshot(dst)
      state = "new" if _same(got, sources["new"]) else "old"
      assert_same(got, sources[state])
      assert load_config(dst).n_layers == CFG.n_layers
    # A leftover temporary directory is refused as a checkpoint unless it is complete (killed at the commit).
    for entry in os.listdir(parent):
      if entry.startswith("out.tmp-"):
        try:
          load_config(os.path.join(parent, entry))
        except CheckpointError as e:
          assert "incomplete" in str(e), (label, str(e))
        else:
          assert_same(snapshot(os.path.join(parent, entry)), sources["new"])
    if mode == "fresh":
      assert state in ("none", "new"), label
    if how == "hook":
      want = {"before-rename": "none" if mode == "fresh" else "old", "between-renames": "none",
              "removing-old": "new"}[where]
      assert state == want, (label, state)
    # The rerun, as a user would run it, writes exactly the uninterrupted conversion.
    convert_hf(sources["src_new"], dst, overwrite=True, progress=False)
    assert_same(snapshot(dst), sources["new"])
    # Dead runs' temporary directories are gone (DST.old-<pid>: see the xfail test below).
    leftovers = [e for e in os.listdir(parent) if e != "out" and not e.startswith("out.old-")]
    assert leftovers == [], (label, leftovers)
    outcomes.append((label, state))
  print("\nkill point -> what the destination held:", *outcomes, sep="\n  ")
  states = {st for _, st in outcomes}
  assert {"none", "old", "new"} <= states, outcomes   # the points really spread over the conversion


def _same(a, b) -> bool:
  try:
    assert_same(a, b)
    return True
  except AssertionError:
    return False


@pytest.mark.slow
def test_rerun_removes_what_a_killed_overwrite_left(sources, tmp_path):
  """The state the hooked kills above leave (checked there): the replaced checkpoint renamed
  DST.old-<pid>-<token> and the new one complete in DST.tmp-<pid>-<token>, of a process that is dead. The next
  open puts the new one back at DST (lcjax.checkpoint.atomic.recover); the rerun removes the old."""
  dead = subprocess.Popen(["true"])
  dead.wait()
  dst = str(tmp_path / "out")
  shutil.copytree(sources["ref_old"], f"{dst}.old-{dead.pid}-{'0' * 16}")     # both carry OWNER_FILE
  shutil.copytree(sources["ref_new"], f"{dst}.tmp-{dead.pid}-{'0' * 16}")
  assert load_config(dst).n_layers == CFG.n_layers
  assert_same(snapshot(dst), sources["new"])
  convert_hf(sources["src_new"], dst, overwrite=True, progress=False)
  assert_same(snapshot(dst), sources["new"])
  assert os.listdir(tmp_path) == ["out"], os.listdir(tmp_path)


# -- interrupted generation ---------------------------------------------------------------------------------------

RUN = RunConfig(dtype="float32", page_size=8, num_pages=40, max_context=256, max_batch=3, prefill_chunk=32,
                decode_steps=4)
PROMPTS = [[int(t) for t in np.random.default_rng(k).integers(3, 256, n)] for k, n in enumerate((7, 40, 23, 61))]
SAMPLING = dict(temperature=0.8, top_k=30, top_p=0.9, seed=3)


@pytest.fixture(scope="module")
def eng():
  e = Engine.random(preset("tiny"), run=RUN, seed=2)
  e.expected = [r.token_ids for r in e.generate(PROMPTS, max_new_tokens=20, sampling=SAMPLING)]
  return e


def _healthy(e):
  assert e.pool.pages_used == 0 and e.pool.sequences == ()
  e.pool.check()
  assert not e.cache.k.is_deleted()
  assert [r.token_ids for r in e.generate(PROMPTS, max_new_tokens=20, sampling=SAMPLING)] == e.expected


def _interrupt_on(e, monkeypatch, step, call, after=True, sigint=False):
  """Make the `call`-th call of e.steps.<step> raise KeyboardInterrupt, after (the cache already donated to the
  device call) or before the real call."""
  real, calls = getattr(e.steps, step), []

  def hooked(*a, **kw):
    calls.append(1)
    if len(calls) == call and not after:
      raise KeyboardInterrupt
    out = real(*a, **kw)
    if len(calls) == call:
      if sigint:
        signal.raise_signal(signal.SIGINT)   # Python's handler raises KeyboardInterrupt right here
      raise KeyboardInterrupt
    return out
  monkeypatch.setattr(e.steps, step, hooked)
  return calls


@pytest.mark.parametrize("step, call", [("prefill", 1), ("prefill", 4), ("decode", 1), ("decode", 3),
                                        ("decode", 6)])
def test_keyboard_interrupt_inside_a_donated_step(eng, monkeypatch, step, call):
  """The interrupt arrives after the step's device call consumed the cache: the engine frees every page and
  starts a fresh cache; later requests are right."""
  calls = _interrupt_on(eng, monkeypatch, step, call)
  with pytest.raises(KeyboardInterrupt):
    eng.generate(PROMPTS, max_new_tokens=20, sampling=SAMPLING)
  assert len(calls) == call
  monkeypatch.undo()
  _healthy(eng)


def test_real_sigint_during_decode(eng, monkeypatch):
  if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    pytest.skip("SIGINT is not Python's default handler in this process")
  _interrupt_on(eng, monkeypatch, "decode", 2, sigint=True)
  with pytest.raises(KeyboardInterrupt):
    eng.generate(PROMPTS, max_new_tokens=20, sampling=SAMPLING)
  monkeypatch.undo()
  _healthy(eng)


def test_keyboard_interrupt_during_a_shared_prefix(eng, monkeypatch):
  _interrupt_on(eng, monkeypatch, "prefill", 1)
  with pytest.raises(KeyboardInterrupt):
    eng.generate(PROMPTS[1:], max_new_tokens=20, sampling=SAMPLING, prefix=PROMPTS[0])
  monkeypatch.undo()
  _healthy(eng)


def test_keyboard_interrupt_in_the_consumer_of_a_stream(eng, monkeypatch):
  """A stream interrupted in the caller's code keeps its pages until it is closed (or collected): the
  generator may still be resumed. Closing it frees them."""
  e = eng
  monkeypatch.setattr(e, "tokenizer", _ByteTokenizer())
  stream = e.generate_stream(PROMPTS, max_new_tokens=20, sampling=SAMPLING)
  with pytest.raises(KeyboardInterrupt):
    for n, _ in enumerate(stream):
      if n == 3:
        raise KeyboardInterrupt
  assert e.pool.pages_used > 0            # suspended, not abandoned: the caller may still resume it
  stream.close()
  assert e.pool.pages_used == 0
  monkeypatch.undo()
  _healthy(e)


class _ByteTokenizer:
  """Token t decodes to chr(t): enough for generate_stream to yield a delta at every decode call."""
  eos_ids = (2,)

  def decode(self, ids, skip_special_tokens=False):
    return "".join(chr(65 + t % 26) for t in ids)


def test_cli_interrupted_prints_one_line_and_exits_130():
  """SIGINT (Ctrl-C) to the CLI once it has printed its plan: `interrupted`, status 130, no traceback."""
  # The tiny preset's random weights (the CLI's seed) continue 3,4 greedily for 4,000 tokens without their EOS:
  # seconds of one-token decode calls even with every program in the run's cache. (From 5,6,7 they reach the EOS
  # after 36 tokens: with a warm cache the CLI exited 0 before the SIGINT.)
  args = ["--preset=tiny", "--prompt_ids=3,4", "--max_new_tokens=4000", "--nowarmup",
          f"--config={os.path.join(REPO, 'configs', 'default.py')}", "--config.max_context=4096",
          "--config.max_batch=1", "--config.decode_steps=1", "--config.prefill_chunk=64"]
  # The CLI in a process of its own (forked by tests.forkserver), its stderr read from its file while it runs.
  p = forkserver.start([sys.executable, "-m", "lcjax.cli.generate", *args], env=cpu_env(), cwd=REPO)
  read = lambda: open(p.err_path).read() if p.returncode is None else p.stderr
  deadline = time.time() + 120
  while "memory plan" not in read() and time.time() < deadline and p.poll() is None:
    time.sleep(0.05)
  time.sleep(1.0)
  assert p.poll() is None, read()    # 4000 one-token decode calls: still running
  p.send_signal(signal.SIGINT)
  p.wait(timeout=120)
  err = p.stderr
  assert p.returncode == 130, err[-2000:]
  assert err.rstrip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err[-2000:]
