"""Multi-host: the same engine code on 2 processes x 4 CPU devices (JAX's distributed runtime on loopback, CPU
collectives through gloo) gives the logits and greedy tokens of the single-process run.

Each process runs this file as a script (`python -m tests.test_multihost PROCESS_ID PORT OUT CKPT`): it
initializes jax.distributed, builds the global (seq, tensor) mesh over all 8 devices and engines whose parameters
and pages are split over both processes, made from the seed and restored from a checkpoint (each process reading
only its devices' shards), and process 0 writes what the host read back. The oracle is the same model on one
device in this (pytest) process, which also writes the checkpoint.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.run_cache import with_test_xla_optimizations, without_run_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = [(2, 4), (4, 2)]        # (tensor, seq): each spans both processes on both axes' product


def _setup():
  from lcjax.config import ModelConfig, RunConfig
  cfg = ModelConfig("tiny-gqa8", vocab_size=128, dim=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, max_position=512, bos_id=None, eos_ids=())
  run = RunConfig(dtype="float32", page_size=4, prefill_chunk=32, max_context=256, max_batch=2, decode_steps=16,
                  attention="reference")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (70, 9)]
  return cfg, run, prompts


def _results(eng, prompts, generate=True) -> dict:
  res = {"logits": eng.logits([prompts[0]]).tolist()}
  if generate:
    res["tokens"] = [r.token_ids for r in eng.generate(prompts, max_new_tokens=32)]
  return res


def _worker(process_id: int, port: int, out: str, ckpt: str) -> None:
  import jax
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  from lcjax.engine.engine import Engine
  assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
  from lcjax.engine import compile_cache
  cfg, run, prompts = _setup()
  res = {}
  for tensor, seq in MESHES:
    eng = Engine.random(cfg, run=run.replace(tensor=tensor, seq=seq), seed=1)
    # auto: off for several processes
    assert compile_cache.stats()["dir"] is None and not jax.config.jax_enable_compilation_cache
    # Each process holds only its devices' shards of the parameters and of the page pool.
    assert not eng.params["layers"]["attn"]["wqkv"].get_value().is_fully_addressable
    assert not eng.cache.k.is_fully_addressable
    # Its logits show the parameters made from the seed over both processes are the one-device ones; prefill and
    # decode on this mesh run below, with the checkpoint engine's parameters of the same shapes and shardings.
    res[f"{tensor}x{seq}"] = _results(eng, prompts, generate=False)
    # tensor=4 repeats the 2 KV heads: wqkv is restored split along D, then its heads repeated into their shards.
    eng = Engine.load(ckpt, run=run, tensor=tensor, seq=seq)
    assert eng.kv_rep == tensor // 2 and not eng.params["embed"]["embedding"].get_value().is_fully_addressable
    res[f"{tensor}x{seq} from checkpoint"] = _results(eng, prompts)
  if process_id == 0:
    with open(out, "w") as f:
      json.dump(res, f)
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _write_checkpoint(eng, dst: str) -> None:
  from lcjax.checkpoint.layout import flatten as _flatten, param_shapes, stored_tensor, unwrap as _unwrap
  from lcjax.checkpoint.writer import CheckpointWriter
  flat = {name: _unwrap(leaf) for name, leaf in _flatten(eng.params)}
  with CheckpointWriter(dst, eng.cfg) as w:
    for name, (_, stacked) in param_shapes(eng.cfg).items():
      value = np.asarray(stored_tensor(flat, name))     # the stored tensor (wq, w_up, ...) of the fused layout
      for layer in (range(value.shape[0]) if stacked else [None]):
        w.write(name, value if layer is None else value[layer], layer=layer)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  from lcjax.engine.engine import Engine
  out, ckpt = str(tmp_path / "res.json"), str(tmp_path / "ckpt")
  cfg, run, prompts = _setup()
  one = Engine.random(cfg, run=run, seed=1)
  want = _results(one, prompts)
  _write_checkpoint(one, ckpt)
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  # The two processes run with lcjax's default compile_cache="auto", not the run's cache (tests/conftest.py), under
  # a cache directory of their own: auto must turn the cache off for several processes (the worker checks it).
  # With it on, the second run of this test hung (process 0 read every program from the cache, process 1 compiled
  # them afresh).
  without_run_cache(env)["LCJAX_CACHE_DIR"] = str(tmp_path / "user-cache")
  with_test_xla_optimizations(env)      # they compile as this process's oracle does (tests/conftest.py)
  procs = [subprocess.Popen([sys.executable, "-m", "tests.test_multihost", str(i), str(port), out, ckpt], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=300)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  assert all(p.returncode == 0 for p in procs), "\n\n".join(log[-3000:] for log in logs)
  got = json.loads(open(out).read())
  assert len(got) == 2 * len(MESHES)
  for key, res in got.items():
    a, b = np.asarray(res["logits"]), np.asarray(want["logits"])
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), key
    assert res.get("tokens", want["tokens"]) == want["tokens"], key
  assert all("tokens" in res for key, res in got.items() if key.endswith("from checkpoint")), list(got)


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
