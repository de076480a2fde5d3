"""Bad inputs end in one clear line, before anything is allocated: a table of them through the CLI and a table
through the Python API.

CLI (its flag parser and `main`, run in this process by tests.cli_inprocess; a good run and --verbose go through
`python -m lcjax.cli.generate` in a process of their own, forked by tests.forkserver): exit status 2, the last stderr
line is the only one that starts with `error: `, it names the offending value and the limit, and there is no
traceback unless --verbose.
Python API: the documented exception type (every lcjax refusal is a ValueError) with a one-line message naming
the value and the limit; an engine that refused a request keeps no page and still answers as before.

Refusals already tested elsewhere are not repeated (tests/test_engine.py: empty list, max_new_tokens 0 and -2,
id 999, 250 + 10 tokens, an unknown sampling option, top_p=0.0; tests/test_convert_hf.py and
tests/test_convert_gguf.py: converter refusals through the Python API and convert_gguf's CLI). Every fixture
here is built on the fly: a tiny lcjax checkpoint written with CheckpointWriter and a trained byte-level BPE
tokenizer, its broken copies, an HF folder written with safetensors, and GGUF files.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import lcjax.checkpoint
from lcjax.cache.pages import PagePoolExhausted
from lcjax.checkpoint import CheckpointError, convert_gguf, layout, restore, writer
from lcjax.checkpoint.hf import HF_NAMES, hf_shape
from lcjax.config import ConfigError, ModelConfig, RunConfig, preset
from lcjax.engine.engine import Engine, RequestError
from lcjax.chat_template import ChatTemplateError
from lcjax.tokenizer import TokenizerError
from tests import cli_inprocess, forkserver
from tests import fixtures_ckpt as fx
from tests.run_cache import REPO, cpu_env

DEFAULT_CONFIG = os.path.join(REPO, "configs", "default.py")
# The tiny model: 4 query heads (tensor=3 cannot split them), a 256-token trained context.
CFG = ModelConfig("err-tiny", vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                  max_position=256, bos_id=0, eos_ids=(1,))
RUN = RunConfig(dtype="float32", page_size=16, prefill_chunk=64, max_context=256, max_batch=2, decode_steps=8)
CLI_RUN = ["--config=" + DEFAULT_CONFIG, "--config.max_context=256", "--config.page_size=16",
           "--config.prefill_chunk=64", "--config.max_batch=2", "--nowarmup"]


def write_checkpoint(dst: str, cfg: ModelConfig, seed: int = 0, tokenizer_dir: str | None = None) -> None:
  """Random float32 weights of cfg through the converters' own writer (so the layout is the real one)."""
  rng = np.random.default_rng(seed)
  with writer.CheckpointWriter(dst, cfg, overwrite=True) as w:
    for name, (shape, stacked) in layout.param_shapes(cfg).items():
      for layer in (range(shape[0]) if stacked else [None]):
        w.write(name, (0.2 * rng.standard_normal(shape[1:] if stacked else shape)).astype(np.float32), layer)
    if tokenizer_dir:
      w.copy_file(os.path.join(tokenizer_dir, "tokenizer.json"))


def write_hf_folder(dst: str, cfg: ModelConfig, shards: int = 2, seed: int = 0) -> list[str]:
  """An HF LLaMA folder (config.json, safetensors shards and their index) written directly; returns the shards."""
  from safetensors.numpy import save_file
  rng = np.random.default_rng(seed)
  tensors = {}
  for hf_name, (name, in_dims) in HF_NAMES.items():
    shapes = layout.param_shapes(cfg)
    if name not in shapes:
      continue
    full, stacked = shapes[name]
    for layer in (range(full[0]) if stacked else [None]):
      key = hf_name.replace("{i}", str(layer)) if stacked else hf_name
      tensors[key] = rng.standard_normal(hf_shape(full[1:] if stacked else full, in_dims)).astype(np.float32)
  os.makedirs(dst)
  names = sorted(tensors)
  files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
  weight_map = {}
  for i, f in enumerate(files):
    part = names[i::shards]
    save_file({n: tensors[n] for n in part}, os.path.join(dst, f))
    weight_map.update({n: f for n in part})
  with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg.to_hf(), f)
  return files


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  """Every file the tables refer to, by name: a good checkpoint and its broken copies, HF and GGUF sources."""
  root = tmp_path_factory.mktemp("errors")
  p = {"default_cfg": DEFAULT_CONFIG, "root": str(root)}
  tok = root / "tok"
  tok.mkdir()
  assert fx.byte_level_tokenizer_json(str(tok / "tokenizer.json"))["vocab_size"] == CFG.vocab_size
  p["good"] = str(root / "good")
  write_checkpoint(p["good"], CFG, tokenizer_dir=str(tok))

  def variant(name, edit):
    p[name] = str(root / name)
    shutil.copytree(p["good"], p[name])
    edit(p[name])

  def truncate_layer(d):   # every data file of layer 1 of w_up cut in half, as a full disk would leave it
    for r, _, files in os.walk(os.path.join(d, "params", "layers", "mlp", "w_up", "00001")):
      for f in files:
        if os.path.basename(r) == "d":
          os.truncate(os.path.join(r, f), os.path.getsize(os.path.join(r, f)) // 2)

  def reshape_layer(d):    # layer 1 of wq stored as [D, N, H/2]: an array of another model in its place
    item = os.path.join(d, "params", "layers", "attn", "wq", "00001", "000")
    shutil.rmtree(item)
    ocp.PyTreeCheckpointer().save(item, args=ocp.args.PyTreeSave({"value": np.ones((32, 4, 4), np.float32)}))

  def corrupt_tokenizer(d):
    path = os.path.join(d, "tokenizer.json")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
      f.write(data[:len(data) // 2])

  variant("missing_array", lambda d: shutil.rmtree(os.path.join(d, "params", "layers", "attn", "wk", "00001")))
  variant("truncated_array", truncate_layer)
  variant("reshaped_array", reshape_layer)
  variant("no_tokenizer", lambda d: os.unlink(os.path.join(d, "tokenizer.json")))
  variant("corrupt_tokenizer", corrupt_tokenizer)
  variant("incomplete", lambda d: os.unlink(os.path.join(d, layout.MANIFEST_FILE)))   # a killed conversion

  def template(text):
    return lambda d: open(os.path.join(d, "chat_template.jinja"), "w").write(text)

  variant("bomb_template", template("{% set ns = namespace(s='a') %}{% for i in range(60) %}"
                                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"))
  variant("broken_template", template("{% for m in messages %}"))
  variant("chat", template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant: {% endif %}"))
  variant("list_tokenizer_config", lambda d: open(os.path.join(d, "tokenizer_config.json"), "w").write("[1]"))
  p["hf"] = str(root / "hf")
  shard = write_hf_folder(p["hf"], CFG)[1]
  os.unlink(os.path.join(p["hf"], shard))
  p["hf_shard"] = shard
  p["hf_huge"] = str(root / "hf_huge")          # config.json alone: a model no machine's memory holds
  os.makedirs(p["hf_huge"])
  json.dump({**preset("llama3.1-70b").to_hf(), "num_hidden_layers": 800}, open(os.path.join(p["hf_huge"],
                                                                                            "config.json"), "w"))
  p["hf_bad_quant"] = str(root / "hf_bad_quant")  # config.json alone, its quantization_config malformed
  os.makedirs(p["hf_bad_quant"])
  json.dump({**CFG.to_hf(), "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                    "config_groups": [{"weights": {}}]}},
            open(os.path.join(p["hf_bad_quant"], "config.json"), "w"))
  p["qwen_gguf"] = str(root / "qwen.gguf")
  fx.write_gguf(p["qwen_gguf"], arch="qwen2")
  p["moe_gguf"] = str(root / "moe.gguf")
  fx.write_gguf(p["moe_gguf"], cfg=preset("tiny"), extra={"llama.expert_count": 8})
  p["empty_file"] = str(root / "empty.txt")
  open(p["empty_file"], "w").close()
  p["doc_file"] = str(root / "doc.txt")
  open(p["doc_file"], "w").write("hello world")
  p["latin1_file"] = str(root / "latin1.txt")
  open(p["latin1_file"], "wb").write("café".encode("latin-1"))
  p["unknown_key_cfg"] = str(root / "unknown_key.py")
  open(p["unknown_key_cfg"], "w").write("import ml_collections\n\ndef get_config():\n"
                                        "  c = ml_collections.ConfigDict()\n  c.pagesize = 64\n  return c\n")
  p["broken_cfg"] = str(root / "broken.py")
  open(p["broken_cfg"], "w").write("def get_config(:\n")
  p["dict_cfg"] = str(root / "as_dict.py")
  open(p["dict_cfg"], "w").write("def get_config():\n  return {'page_size': 64}\n")
  p["none_cfg"] = str(root / "returns_none.py")
  open(p["none_cfg"], "w").write("def get_config():\n  pass\n")
  return p


# -- the CLI ------------------------------------------------------------------------------------------------------

# (case, argv, what the error line must name); {name} is a path of the `paths` fixture. `ckpt` cases run against
# a checkpoint with the small run config of CLI_RUN.
CLI_CASES = [
    # flags and configs
    ("unknown config key", ["--prompt=hi", "--config={default_cfg}", "--config.pagesize=64"],
     ["'pagesize'", "known keys", "'page_size'"]),
    ("unknown key in a config file", ["--prompt=hi", "--config={unknown_key_cfg}"], ["['pagesize']", "'page_size'"]),
    ("override of the defaults checked without a config file", ["--prompt=hi", "--config.page_size=0"],
     ["page_size=0", ">= 1"]),
    ("unknown key without a config file", ["--prompt=hi", "--config.pagesize=64"], ["'pagesize'", "known keys"]),
    ("missing config file", ["--prompt=hi", "--config={root}/nope.py"], ["nope.py", "No such file"]),
    ("config file that does not parse", ["--prompt=hi", "--config={broken_cfg}"], ["broken.py", "line 1"]),
    ("config file returning a dict", ["--prompt=hi", "--config={dict_cfg}"], ["returned a dict", "ConfigDict"]),
    ("config file returning None", ["--prompt=hi", "--config={none_cfg}"], ["returned None", "ConfigDict"]),
    ("config value of the wrong type", ["--prompt=hi", "--config={default_cfg}", "--config.page_size=abc"],
     ["--config.page_size=abc", "int()"]),
    ("page_size of 0", ["--prompt=hi", "--config={default_cfg}", "--config.page_size=0"], ["page_size=0", ">= 1"]),
    ("prefill_chunk not a multiple of page_size", ["--prompt=hi", "--config={default_cfg}",
                                                   "--config.prefill_chunk=100"],
     ["prefill_chunk=100", "page_size=64"]),
    ("unknown dtype", ["--prompt=hi", "--config={default_cfg}", "--config.dtype=float64"],
     ["dtype='float64'", "bfloat16"]),
    ("unknown attention backend", ["--prompt=hi", "--config={default_cfg}", "--config.attention=flash"],
     ["attention='flash'", "pallas"]),
    ("unknown flag", ["--prompt=hi", "--max_tokens=5"], ["max_tokens"]),
    ("flag value of the wrong type", ["--prompt=hi", "--max_new_tokens=many"], ["--max_new_tokens=many"]),
    ("stray argument", ["--prompt", "hi", "there"], ["['there']"]),
    ("unknown preset", ["--preset=llama9", "--prompt_ids=1"], ["'llama9'", "llama3.1-70b", "tiny"]),
    ("preset and checkpoint", ["--preset=tiny", "--checkpoint={good}", "--prompt_ids=1"],
     ["--checkpoint or --preset", "tiny"]),
    # the prompt
    ("no prompt", [], ["exactly one of", "none"]),
    ("two prompts", ["--prompt=hi", "--demo"], ["exactly one of", "--prompt", "--demo"]),
    ("empty prompt", ["--prompt="], ["empty prompt", "at least one token"]),
    ("empty prompt file", ["--prompt_file={empty_file}"], ["empty prompt", "empty.txt"]),
    ("missing prompt file", ["--prompt_file={root}/none.txt"], ["--prompt_file={root}/none.txt", "No such file"]),
    ("prompt file that is a directory", ["--prompt_file={root}"], ["--prompt_file={root}", "Is a directory"]),
    ("prompt file that is not UTF-8", ["--prompt_file={latin1_file}"], ["latin1.txt", "not UTF-8", "byte 3"]),
    ("command-line bytes that are not UTF-8", [os.fsdecode(b"--prompt=caf\xe9"), "--checkpoint={good}"],
     ["not valid UTF-8", "\\udce9", "index 3"]),
    ("prompt ids that are not integers", ["--prompt_ids=1,two,3"], ["'two'", "integer"]),
    ("prompt ids with none in them", ["--prompt_ids= "], ["empty prompt"]),
    ("prompt ids with an empty field", ["--prompt_ids=1,,2"], ["'1,,2'", "empty field"]),
    ("demo of no words", ["--demo", "--demo_words=0"], ["--demo_words=0", ">= 1"]),
    # generation options
    ("zero max_new_tokens", ["--prompt=hi", "--max_new_tokens=0"], ["max_new_tokens=0", ">= 1"]),
    ("negative max_new_tokens", ["--prompt=hi", "--max_new_tokens=-3"], ["max_new_tokens=-3", ">= 1"]),
    ("top_p of 0", ["--prompt=hi", "--top_p=0"], ["top_p=0.0", "(0, 1]"]),
    ("top_p above 1", ["--prompt=hi", "--top_p=1.5"], ["top_p=1.5", "(0, 1]"]),
    ("negative top_p", ["--prompt=hi", "--top_p=-0.1"], ["top_p=-0.1", "(0, 1]"]),
    ("negative top_k", ["--prompt=hi", "--top_k=-1"], ["top_k=-1", ">= 0"]),
    ("negative temperature", ["--prompt=hi", "--temperature=-0.5"], ["temperature=-0.5", "from 0 to 1e+06"]),
    ("seed outside uint32", ["--prompt=hi", "--seed=-1"], ["seed=-1", "[0, 2**32)"]),
    ("top_k past the vocabulary", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--top_k=1000"],
     ["--top_k=1000", "vocabulary of 300 tokens"]),
    # checkpoints and sources
    ("missing checkpoint dir", ["--prompt=hi", "--checkpoint={root}/nowhere"],
     ["--checkpoint={root}/nowhere", "no such checkpoint"]),
    ("incomplete checkpoint", ["ckpt", "--prompt=hi", "--checkpoint={incomplete}"],
     ["incomplete", "lcjax_manifest.json", "rerun the conversion"]),
    ("checkpoint with a missing array", ["ckpt", "--prompt=hi", "--checkpoint={missing_array}"],
     ["layers/attn/wk layer 1", "missing"]),
    ("checkpoint with a truncated array", ["ckpt", "--prompt=hi", "--checkpoint={truncated_array}"],
     ["truncated_array", "cannot read tensor layers/mlp/w_up layer 1"]),
    ("checkpoint with an array of another shape", ["ckpt", "--prompt=hi", "--checkpoint={reshaped_array}"],
     ["layers/attn/wq layer 1", "(32, 4, 8)", "(32, 4, 4)"]),
    ("checkpoint without a tokenizer, text prompt", ["ckpt", "--prompt=hi", "--checkpoint={no_tokenizer}"],
     ["no_tokenizer", "no tokenizer", "--prompt_ids"]),
    ("corrupt tokenizer", ["ckpt", "--prompt=hi", "--checkpoint={corrupt_tokenizer}"],
     ["corrupt_tokenizer/tokenizer.json", "not a readable tokenizer file"]),
    ("chat template past its bounds", ["ckpt", "--prompt=hi", "--checkpoint={bomb_template}"],
     ["bomb_template/chat_template.jinja", "concatenation of", "characters"]),
    ("chat template that does not compile", ["ckpt", "--prompt=hi", "--checkpoint={broken_template}"],
     ["broken_template/chat_template.jinja", "does not compile", "TemplateSyntaxError"]),
    ("tokenizer config that is not an object", ["ckpt", "--prompt=hi", "--checkpoint={list_tokenizer_config}"],
     ["list_tokenizer_config/tokenizer_config.json", "holds a JSON list"]),
    # an HF folder or a GGUF file is converted on first use: a bad one is refused by its converter
    ("GGUF file of another architecture as a checkpoint", ["--prompt=hi", "--checkpoint={qwen_gguf}"],
     ["qwen.gguf", "general.architecture='qwen2'"]),
    ("HF folder with a missing shard as a checkpoint", ["--prompt=hi", "--checkpoint={hf}"],
     ["shard {hf_shard}", "is missing"]),
    ("a file that is not GGUF as a checkpoint", ["--prompt=hi", "--checkpoint={latin1_file}"],
     ["latin1.txt is a file but not a GGUF file"]),
    ("HF folder with a malformed quantization_config", ["--prompt=hi", "--checkpoint={hf_bad_quant}"],
     ["--checkpoint={hf_bad_quant}", "config.json: quantization_config config_groups is a list"]),
    # the memory plan is checked from the source's config.json, before anything is converted (there are no weights)
    ("HF folder of a model past the machine", ["--prompt_ids=1", "--config={default_cfg}", "--checkpoint={hf_huge}"],
     ["does not fit", "weights 2"]),
    # limits of the run
    ("mesh needing more devices than exist", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--config.tensor=16"],
     ["needs 16 devices", "only 8"]),
    ("tensor not dividing the heads", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--config.tensor=3"],
     ["n_heads=4", "tensor=3"]),
    ("Ulysses with more seq devices than KV heads", ["ckpt", "--prompt=hi", "--checkpoint={good}",
                                                     "--config.seq=4", "--config.sp_mode=ulysses"],
     ["n_kv_heads=2", "seq=4", "sp_mode='ring'"]),
    ("token id outside the vocabulary", ["ckpt", "--prompt_ids=5,300,7", "--checkpoint={good}"],
     ["[300]", "[0, 300)"]),
    ("negative token id", ["ckpt", "--prompt_ids=-1", "--checkpoint={good}"], ["[-1]", "[0, 300)"]),
    ("prompt longer than the context", ["ckpt", "--prompt=" + "a" * 300, "--checkpoint={good}"],
     ["301 tokens", "max_new_tokens=64", "365 > max context 256"]),
    ("max_new_tokens past the context", ["ckpt", "--prompt=hi", "--max_new_tokens=1000", "--checkpoint={good}"],
     ["max_new_tokens=1000", "> max context 256"]),
    ("request larger than the page pool", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--config.num_pages=4"],
     ["needs 5 pages", "num_pages=4", "only 3 pages"]),
    ("page pool larger than memory", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--config.num_pages=100000000"],
     # KV cache: 2 (K, V) x 2 layers x 1e8 pages x 16 tokens x 2 heads x 8 x 4 bytes = 381.47 GiB
     ["num_pages=100000000 does not fit", "GiB per device (KV cache 381.47 GiB", "GiB: lower"]),
    ("context larger than memory", ["--preset=llama3.1-8b", "--prompt_ids=1", "--config={default_cfg}",
                                    "--config.max_context=1048576", "--config.allow_beyond_trained_context=true"],
     ["max_context=1048576 x max_batch=4 does not fit", "GiB per device (KV cache 1024.02 GiB"]),
    ("context past the trained one", ["--preset=llama3-8b", "--prompt_ids=1", "--config={default_cfg}",
                                      "--config.max_context=16384"],
     ["max_context=16384", "trained context of 8192", "no rope scaling", "allow_beyond_trained_context"]),
    ("text prompt for a preset", ["--preset=tiny", "--prompt=hi"], ["--preset=tiny has no tokenizer", "--prompt_ids"]),
    # contexts
    ("saving a context without one", ["--prompt=hi", "--save_context={root}/ctx"],
     ["--save_context needs a context", "--context_file"]),
    ("context file and saved context together", ["--prompt=hi", "--context_file={latin1_file}",
                                                 "--load_context={root}/ctx"], ["--context_file or --load_context"]),
    ("context file that is not UTF-8", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--context_file={latin1_file}"],
     ["--context_file=", "not UTF-8"]),
    ("missing saved context", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--load_context={root}/nowhere"],
     ["--load_context={root}/nowhere", "no such directory"]),
    ("saved context that is a file", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--load_context={doc_file}"],
     ["--load_context={doc_file}", "a file, not a saved context's directory"]),
    ("missing context file", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--context_file={root}/nowhere.txt"],
     ["--context_file={root}/nowhere.txt", "no such file"]),
    ("context file that is a directory", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--context_file={root}"],
     ["--context_file={root}", "a directory"]),
    ("context saved where no directory can be made", ["ckpt", "--prompt=hi", "--checkpoint={good}",
                                                       "--context_file={doc_file}", "--nochat",
                                                       "--save_context={empty_file}/ctx"],
     ["--save_context={empty_file}/ctx", "{empty_file} is not a directory"]),
    ("context saved over a file", ["ckpt", "--prompt=hi", "--checkpoint={good}", "--context_file={doc_file}",
                                   "--nochat", "--save_context={doc_file}"],
     ["--save_context={doc_file} is a file but not a saved context"]),
    ("prompt ids asking a chat context", ["ckpt", "--prompt_ids=1,2", "--checkpoint={chat}",
                                          "--context_file={doc_file}"],
     ["--prompt_ids cannot ask a chat context", "--nochat"]),
]
PLAN_PRINTED = {"page pool larger than memory", "context larger than memory", "HF folder of a model past the machine"}
# Refused from the flags alone, before JAX starts and the memory plan is printed.
BEFORE_JAX = {"missing saved context", "saved context that is a file", "missing context file",
              "context file that is a directory"}


def _cli_env():
  return cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")


def _argv(args, paths):
  if args and args[0] == "ckpt":
    args = CLI_RUN + args[1:]
  return [a.format(**paths) for a in args]


def _run_cli(argv):
  return forkserver.run([sys.executable, "-m", "lcjax.cli.generate", *argv], env=_cli_env(), cwd=REPO, timeout=300)


@pytest.mark.parametrize("case, args, names", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_in_one_line(paths, case, args, names):
  p = cli_inprocess.run(_argv(args, paths))
  lines = p.stderr.rstrip("\n").splitlines()
  assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  assert lines and lines[-1].startswith("error: "), p.stderr[-3000:]
  assert sum(l.startswith("error:") for l in lines) == 1, p.stderr[-3000:]
  for name in names:
    assert name.format(**paths) in lines[-1], (name, lines[-1])
  if case in PLAN_PRINTED:   # refused before any allocation, the plan shown above the error line
    assert "memory plan per device" in p.stderr and "  total " in p.stderr, p.stderr
  if case in BEFORE_JAX:
    assert "memory plan per device" not in p.stderr, p.stderr
  assert p.stdout == "", p.stdout   # nothing was generated


def test_cli_verbose_shows_the_traceback():
  p = _run_cli(["--preset=llama9", "--prompt_ids=1", "--verbose"])
  assert p.returncode != 0 and p.returncode != 2
  assert "Traceback" in p.stderr and "ConfigError: unknown preset 'llama9'" in p.stderr


def test_cli_generates_what_the_api_generates(api):
  """The refusals do not refuse good input: the CLI, run as a script, prints the text that the Python API
  generates from the same checkpoint and prompt (the oracle; the run configs differ only in decode_steps, which
  never changes tokens)."""
  p = _run_cli(CLI_RUN + [f"--checkpoint={api['good']}", "--prompt_ids=5,6,7,8,9", "--max_new_tokens=6",
                          "--nostream"])
  assert p.returncode == 0, p.stderr[-3000:]
  want = api["eng"].generate(REF_PROMPT, max_new_tokens=6)
  assert want.token_ids == api["ref"] and p.stdout.startswith(want.text + "\n\nstats\n"), (want.text, p.stdout)


def test_converter_clis_refuse_in_one_line(paths, tmp_path):
  """tools/convert_hf.py with a missing shard (the converters exit 2 with `convert_hf: error:`, like the generate CLI; convert_gguf's
  CLI refusal is tested in test_convert_gguf.py)."""
  dst = str(tmp_path / "out")
  p = forkserver.run([sys.executable, os.path.join(REPO, "tools", "convert_hf.py"), f"--src={paths['hf']}",
                      f"--dst={dst}"], env=_cli_env(), timeout=300)
  last = p.stderr.strip().splitlines()[-1]
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
  assert last.startswith("convert_hf: error: ") and f"shard {paths['hf_shard']}" in last and "missing" in last
  assert not os.path.exists(dst) and os.listdir(tmp_path) == []


# -- the Python API -----------------------------------------------------------------------------------------------

REF_PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def api(paths):
  eng = Engine.load(paths["good"], run=RUN)
  return {"eng": eng, "ref": eng.generate(REF_PROMPT, max_new_tokens=6).token_ids, **paths}


def _gen(prompt, **kw):
  return lambda a: a["eng"].generate(prompt, **{"max_new_tokens": 4, **kw})


def _stream(prompt, **kw):
  return lambda a: list(a["eng"].generate_stream(prompt, **{"max_new_tokens": 4, **kw}))


# (case, call, exception type, what the message must name)
API_CASES = [
    ("unknown run config key", lambda a: RunConfig.from_dict({"pagesize": 64}), ConfigError,
     ["['pagesize']", "'page_size'"]),
    ("unknown model config key", lambda a: ModelConfig.from_dict({**CFG.to_dict(), "n_head": 4}), ConfigError,
     ["['n_head']", "'n_heads'"]),
    ("unknown run config key in Engine.load", lambda a: Engine.load(a["good"], run=RUN, max_ctx=2048), ConfigError,
     ["['max_ctx']", "'max_context'"]),
    ("run config value of the wrong kind", lambda a: RUN.replace(prefix_cache="no"), ConfigError,
     ["prefix_cache='no'", "true or false"]),
    ("negative max_context", lambda a: RUN.replace(max_context=-5), ConfigError, ["max_context=-5", ">= 0"]),
    ("one page", lambda a: RUN.replace(num_pages=1), ConfigError, ["num_pages=1", ">= 2"]),
    ("host tier without the prefix cache", lambda a: RUN.replace(prefix_cache=False, host_cache_gib=1.0),
     ConfigError, ["host_cache_gib=1.0", "prefix_cache=False"]),
    ("unknown preset", lambda a: preset("llama9"), ConfigError, ["'llama9'", "llama3.1-70b"]),
    ("heads not divisible by KV heads", lambda a: ModelConfig("x", 10, 8, 1, 6, 4, 2, 8), ConfigError,
     ["n_heads=6", "n_kv_heads=4"]),
    ("mesh needing more devices than exist", lambda a: Engine.load(a["good"], run=RUN.replace(tensor=16)),
     ConfigError, ["needs 16 devices", "only 8"]),
    ("random engine on too few devices", lambda a: Engine.random(CFG, run=RUN.replace(seq=3, tensor=3)),
     ConfigError, ["needs 9 devices", "only 8"]),
    ("tensor not dividing the heads", lambda a: Engine.load(a["good"], run=RUN, tensor=3), ConfigError,
     ["n_heads=4", "tensor=3"]),
    ("missing checkpoint dir", lambda a: Engine.load(a["root"] + "/nowhere", run=RUN), CheckpointError,
     ["nowhere", "no such checkpoint directory"]),
    ("incomplete checkpoint", lambda a: Engine.load(a["incomplete"], run=RUN), CheckpointError,
     ["incomplete checkpoint", "lcjax_manifest.json"]),
    ("checkpoint with a missing array", lambda a: Engine.load(a["missing_array"], run=RUN), CheckpointError,
     ["layers/attn/wk layer 1", "missing"]),
    ("checkpoint with a truncated array", lambda a: Engine.load(a["truncated_array"], run=RUN), CheckpointError,
     ["cannot read tensor layers/mlp/w_up layer 1"]),
    ("checkpoint with an array of another shape", lambda a: Engine.load(a["reshaped_array"], run=RUN),
     CheckpointError, ["layers/attn/wq layer 1", "(32, 4, 8)", "(32, 4, 4)"]),
    ("corrupt tokenizer", lambda a: Engine.load(a["corrupt_tokenizer"], run=RUN), TokenizerError,
     ["corrupt_tokenizer/tokenizer.json", "not a readable tokenizer file"]),
    ("chat template that does not compile", lambda a: Engine.load(a["broken_template"], run=RUN),
     ChatTemplateError, ["broken_template/chat_template.jinja", "does not compile"]),
    ("tokenizer config that is not an object", lambda a: Engine.load(a["list_tokenizer_config"], run=RUN),
     TokenizerError, ["tokenizer_config.json", "holds a JSON list"]),
    ("GGUF of a mixture of experts", lambda a: convert_gguf(a["moe_gguf"], a["root"] + "/moe", progress=False),
     CheckpointError, ["moe.gguf", "expert_count=8", "not supported"]),
    # requests to a working engine
    ("text prompt without a tokenizer",
     lambda a: Engine.load(a["no_tokenizer"], run=RUN).generate("hi", max_new_tokens=2), RequestError,
     ["no tokenizer", "token ids"]),
    ("chat template past its bounds",
     lambda a: Engine.load(a["bomb_template"], run=RUN).generate("hi", chat=True, max_new_tokens=2),
     ChatTemplateError, ["bomb_template/chat_template.jinja", "characters"]),
    ("empty text prompt", _gen(""), RequestError, ["empty prompt"]),
    ("prompt None", _gen(None), RequestError, ["prompts are text", "NoneType"]),
    ("prompt an int", _gen(5), RequestError, ["prompts are text", "int 5"]),
    ("prompt in a batch an int", _gen([[5, 6], 7]), RequestError, ["a prompt is text", "int 7"]),
    ("float token ids", _gen([[1.5, 2.7]]), RequestError, ["token ids are integers", "[1.5, 2.7]"]),
    ("one prompt of float token ids", _gen([5, 2.0]), RequestError, ["token ids are integers", "[2.0]"]),
    ("bool token ids", _gen([True, 5]), RequestError, ["token ids are integers", "[True]"]),
    ("float array of token ids", _gen(np.array([5.0, 6.0])), RequestError, ["1-D integer array", "float64"]),
    ("context not a Context", _gen([5], context="abc"), RequestError, ["context= takes a Context", "str 'abc'"]),
    ("decode_steps past the context", _gen([5], decode_steps=10**9), RequestError,
     ["decode_steps=1000000000", "max_context=256"]),
    ("warm-up bucket past the prefill chunk", lambda a: a["eng"].warm_up(4, more_buckets=(10**9,)), RequestError,
     ["more_buckets: 1000000000", "from 1 to 64"]),
    ("warm-up bucket of 0", lambda a: a["eng"].warm_up(4, more_buckets=range(0, 65)), RequestError,
     ["more_buckets: 0", "from 1 to 64"]),
    ("warm-up buckets not a sequence", lambda a: a["eng"].warm_up(4, more_buckets=None), RequestError,
     ["more_buckets=None", "sequence"]),
    ("on_progress not callable", _gen([5], on_progress=5), RequestError, ["on_progress=5", "callable"]),
    ("logits of float ids", lambda a: a["eng"].logits([[1.7, 2.9]]), RequestError, ["token ids are integers"]),
    ("logits longer than the context", lambda a: a["eng"].logits([[1] * 257]), RequestError,
     ["logits of 257 tokens > max context 256"]),
    ("logits of ragged prompts", lambda a: a["eng"].logits([[1, 2], [3]]), RequestError, ["lengths [1, 2]"]),
    ("logits of text", lambda a: a["eng"].logits("abc"), RequestError, ["not str 'abc'"]),
    ("max_new_tokens a narrow numpy integer", _gen([5] * 250, max_new_tokens=np.uint8(255)), RequestError,
     ["max_new_tokens=255", "505 > max context 256"]),
    ("seed a bool", _gen([5], sampling=dict(seed=True, temperature=1.0)), RequestError, ["seed=True", "not bool"]),
    ("temperature past float32's range of logits", _gen([5], sampling=dict(temperature=3e38, top_k=1)),
     RequestError, ["temperature=3e+38", "from 0 to 1e+06"]),
    ("warm-up prompt past the context", lambda a: a["eng"].warm_up(10**9), RequestError,
     ["prompt_tokens: 1000000000", "from 0 to 256"]),
    ("system turn not text", lambda a: a["eng"].prefill("hi", chat=True, system=5), RequestError,
     ["system= takes the text", "int 5"]),
    ("decode_steps past the context, streamed", _stream([5], decode_steps=257), RequestError,
     ["decode_steps=257", "max_context=256"]),
    ("empty prompt in a batch", _gen([[5, 6], []]), RequestError, ["empty prompt"]),
    ("empty prefix", _gen([5, 6], prefix=[]), RequestError, ["empty prompt"]),
    ("text that is not Unicode", _gen("caf\udce9"), RequestError, ["not valid Unicode", "'\\udce9'", "index 3"]),
    ("negative token id", _gen([5, -1]), RequestError, ["[-1]", "[0, 300)"]),
    ("token id at the vocabulary size", _gen([5, 300]), RequestError, ["[300]", "[0, 300)"]),
    ("token id outside the vocabulary, streamed", _stream([2**40]), RequestError, [str(2**40), "[0, 300)"]),
    ("logits of a token outside the vocabulary", lambda a: a["eng"].logits([[1, 300]]), RequestError,
     ["[300]", "[0, 300)"]),
    ("prompt longer than the context", _gen([5] * 257), RequestError, ["257 tokens", "> max context 256"]),
    ("prefix + prompt longer than the context", _gen([5] * 100, prefix=[6] * 160), RequestError,
     ["260 tokens", "= 264 > max context 256"]),
    ("max_new_tokens past the context", _gen([5], max_new_tokens=256), RequestError,
     ["max_new_tokens=256", "257 > max context 256"]),
    ("max_new_tokens not an integer", _gen([5], max_new_tokens=2.5), RequestError, ["max_new_tokens=2.5"]),
    ("max_new_tokens a bool", _gen([5], max_new_tokens=True), RequestError, ["max_new_tokens=True"]),
    ("top_p above 1", _gen([5], sampling=dict(top_p=1.5, temperature=1.0)), RequestError, ["top_p=1.5", "(0, 1]"]),
    ("top_p NaN", _gen([5], sampling=dict(top_p=float("nan"))), RequestError, ["top_p=nan", "(0, 1]"]),
    ("temperature infinite", _gen([5], sampling=dict(temperature=float("inf"))), RequestError,
     ["temperature=inf", "from 0 to 1e+06"]),
    ("top_k not an integer", _gen([5], sampling=dict(top_k=2.5)), RequestError, ["top_k=2.5", "integer"]),
    ("seed above uint32", _gen([5], sampling=dict(seed=2**32, temperature=1.0)), RequestError,
     ["seed=4294967296", "[0, 2**32)"]),
    ("negative seed", _stream([5], sampling=dict(seed=-7, temperature=1.0)), RequestError, ["seed=-7", "[0, 2**32)"]),
]


@pytest.mark.parametrize("case, call, exc, names", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_refuses_in_one_line(api, case, call, exc, names):
  with pytest.raises(exc) as e:
    call(api)
  msg = str(e.value)
  assert "\n" not in msg, msg
  for name in names:
    assert name in msg, (name, msg)
  eng = api["eng"]
  assert eng.pool.pages_used == 0
  eng.pool.check()
  assert eng.generate(REF_PROMPT, max_new_tokens=6).token_ids == api["ref"]


def test_api_refuses_a_plan_that_does_not_fit_before_any_allocation(api, monkeypatch):
  """num_pages far beyond memory: Engine.load refuses with the plan's numbers and reads no weights."""
  def never(*a, **kw):
    raise AssertionError("weights were read before the memory plan was checked")
  monkeypatch.setattr(lcjax.checkpoint, "load_checkpoint", never)
  monkeypatch.setattr(restore, "restore_params", never)
  before = len(jax.live_arrays())
  with pytest.raises(ConfigError) as e:
    Engine.load(api["good"], run=RUN.replace(num_pages=100_000_000))
  msg = str(e.value)
  assert "\n" not in msg and "num_pages=100000000 does not fit" in msg and "(KV cache 381.47 GiB" in msg, msg
  assert len(jax.live_arrays()) == before


def test_api_refuses_a_plan_that_does_not_fit_before_converting(paths, monkeypatch):
  """An HF folder of a model past the machine is refused from its config.json alone: nothing is converted (the
  folder holds no weights, whose absence a conversion would report instead)."""
  from lcjax.checkpoint import hf
  def never(*a, **kw):
    raise AssertionError("the source was converted before the memory plan was checked")
  monkeypatch.setattr(hf, "convert_hf", never)
  with pytest.raises(ConfigError) as e:
    Engine.load(paths["hf_huge"], run=RUN)
  assert "\n" not in str(e.value) and "does not fit" in str(e.value), str(e.value)


def test_refusals_are_value_errors():
  """Every refusal type is a ValueError, so `except ValueError` (and the CLI) catches them all."""
  for t in (ConfigError, RequestError, CheckpointError, TokenizerError, PagePoolExhausted):
    assert issubclass(t, ValueError), t


@pytest.mark.parametrize("fname", ["lcjax_manifest.json", "lcjax_config.json"])
def test_corrupt_checkpoint_json_is_named(tmp_path, fname, smollm2_checkpoint):
  """A truncated manifest or config names the file instead of surfacing a bare JSONDecodeError."""
  import shutil
  from lcjax.checkpoint import CheckpointError, load_config
  ckpt = tmp_path / "ckpt"
  src = smollm2_checkpoint     # the bundled model, converted once per run (tests/conftest.py)
  shutil.copytree(src, ckpt, ignore=shutil.ignore_patterns("params"))
  (ckpt / fname).write_text('{"format": "lcjax-orb')
  with pytest.raises(CheckpointError, match=rf"{fname} is corrupt .*rerun the conversion"):
    load_config(str(ckpt))


@pytest.mark.parametrize("name, exc", [("broken_template", ChatTemplateError),
                                       ("list_tokenizer_config", TokenizerError)])
def test_tokenizer_files_are_checked_before_any_weight_is_read(paths, monkeypatch, name, exc):
  def no_weights(*a, **k):
    raise AssertionError("weights restored before the tokenizer was checked")
  monkeypatch.setattr(restore, "restore_params", no_weights)
  with pytest.raises(exc, match=name):
    Engine.load(paths[name], run=RUN)
