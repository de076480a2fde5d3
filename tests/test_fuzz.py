"""Fuzzing the request path with hypothesis: prompts of random Unicode, control characters, long runs of one
character and special-token text, token-id prompts, and sampling options, valid or not.

The model is tiny and random but its tokenizer is real: SmolLM2's byte-level BPE (49,152 tokens), rebuilt from the
bundled GGUF, with the model's vocabulary the same size. Properties: a request either generates or is refused
with a RequestError exactly when an independent validity rule says it must be; generated tokens lie inside the
vocabulary; the same request with the same seed gives the same tokens and text again; the engine keeps no page
afterwards; and the tokenizer gives back the text it encoded, unless that text holds a byte the vocabulary lacks
(SmolLM2's has 235 of the 256 byte tokens: "\x16" and five other control characters, and 15 high bytes that
text hardly ever holds, 0xc0, 0xc1, 0xf1, 0xf2, 0xf5-0xff, are dropped, as transformers drops them). The
@example rows pin the cases the fuzzing found: a prompt that encodes to no token, and a top_k beyond int32.
"""
from __future__ import annotations

import json
import math
import os
import signal
import struct
import time
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the requests are drawn by hypothesis: pip install -e '.[test]'")
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from lcjax.checkpoint.layout import CheckpointError
from lcjax.config import ConfigError, ModelConfig, RunConfig
from lcjax.engine.engine import Engine, RequestError
from lcjax.tokenizer import Tokenizer

V = 49152
CFG = ModelConfig("fuzz-tiny", vocab_size=V, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
                  max_position=8192, bos_id=1, eos_ids=(2,), add_bos=False)
RUN = RunConfig(dtype="float32", page_size=16, prefill_chunk=256, max_context=1024, max_batch=2, decode_steps=8)
FUZZ = settings(max_examples=int(os.environ.get("LCJAX_FUZZ_EXAMPLES", "40")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
  from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config, smollm2_gguf_path, write_tokenizer
  g = GGUFFile(smollm2_gguf_path())
  path = str(tmp_path_factory.mktemp("smollm2_tokenizer"))
  write_tokenizer(g, path, gguf_model_config(g))
  tok = Tokenizer(path)
  assert tok.vocab_size == V and tok.eos_ids == CFG.eos_ids
  e = Engine.random(CFG, run=RUN, seed=0, tokenizer=tok)
  vocab = {tok.id_to_token(i) for i in range(V)}
  e.byte_gaps = {b for b, c in _bytes_to_unicode().items() if c not in vocab}
  assert 0x16 in e.byte_gaps and 0x41 not in e.byte_gaps
  return e


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  out, n = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + n)
      n += 1
  return out


_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "user\n", "assistant\n", "\n", " ", "é", "🎉", "<|im_"]
_CONTROL = st.characters(max_codepoint=0x1f) | st.sampled_from("\x7f\x85\xa0\u2028\u2029\ufeff\u200b\u200d")
texts = st.one_of(
    st.text(min_size=1, max_size=300),                                            # any code point but surrogates
    st.text(_CONTROL, min_size=1, max_size=120),                                  # control characters
    st.builds(lambda c, n: c * n, st.characters(exclude_categories=("Cs",)),     # one character, many times
              st.integers(100, 4000)),
    st.lists(st.sampled_from(_SPECIAL), min_size=1, max_size=40).map("".join),   # special tokens as text
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=20), st.characters(categories=("Cs",)),
              st.text(max_size=20)),                                            # a lone surrogate
)
samplings = st.fixed_dictionaries({
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    "top_k": st.one_of(st.just(0), st.integers(1, V + 100)),
    "top_p": st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    "seed": st.integers(0, 2**32 - 1),
})


def _check_result(eng, res, max_new):
  assert 1 <= len(res.token_ids) <= max_new
  assert all(0 <= t < V for t in res.token_ids), res.token_ids
  if res.finish_reason == "eos":
    assert res.token_ids[-1] in CFG.eos_ids
  else:
    assert res.finish_reason == "length" and len(res.token_ids) == max_new
  assert isinstance(res.text, str)
  assert eng.pool.pages_used == 0


@FUZZ
@given(text=texts, sampling=samplings, max_new=st.integers(1, 12))
@example(text="", sampling=dict(temperature=0.0, top_k=0, top_p=1.0, seed=0), max_new=2)
@example(text="\x16", sampling=dict(temperature=0.0, top_k=0, top_p=1.0, seed=0), max_new=2)
@example(text="ab\udcffc", sampling=dict(temperature=0.0, top_k=0, top_p=1.0, seed=0), max_new=2)
@example(text="\x00" * 3000, sampling=dict(temperature=2.0, top_k=5, top_p=0.5, seed=2**32 - 1), max_new=12)
def test_text_prompts(eng, text, sampling, max_new):
  valid_unicode = not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
  if not text or not valid_unicode:
    event("refused: empty" if not text else "refused: not Unicode")
    with pytest.raises(RequestError, match="empty prompt" if not text else "not valid Unicode"):
      eng.generate(text, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  ids = eng.tokenizer.encode(text)
  if not eng.byte_gaps & set(text.encode("utf-8")):
    assert eng.tokenizer.decode(ids) == text                   # byte-level BPE loses nothing else
  if not ids:
    event("refused: no tokens")
    with pytest.raises(RequestError, match="encodes to no tokens"):
      eng.generate(text, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  if len(ids) + max_new > RUN.max_context:
    event("refused: longer than the context")
    with pytest.raises(RequestError, match=rf"has {len(ids)} tokens \+ max_new_tokens={max_new} = "
                                           rf"{len(ids) + max_new} > max context {RUN.max_context}"):
      eng.generate(text, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  event("generated")
  first = eng.generate(text, max_new_tokens=max_new, sampling=sampling)
  _check_result(eng, first, max_new)
  assert first.prompt_tokens == len(ids)
  again = eng.generate(text, max_new_tokens=max_new, sampling=sampling)
  assert (again.token_ids, again.text) == (first.token_ids, first.text)


def _valid_sampling(s) -> bool:
  """The rule the engine documents, written independently of lcjax.engine.sampling."""
  def integer(x):
    return isinstance(x, int) and not isinstance(x, bool)
  def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)
  t, k, p, seed = s["temperature"], s["top_k"], s["top_p"], s["seed"]
  return (number(t) and 0 <= t <= 1e6 and integer(k) and k >= 0
          and number(p) and 0 < p <= 1 and integer(seed) and 0 <= seed < 2**32)


any_number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**40, 2**40))
wild_samplings = st.fixed_dictionaries({
    "temperature": st.one_of(st.floats(-1, 3), any_number), "top_k": st.one_of(st.integers(-5, 100), any_number),
    "top_p": st.one_of(st.floats(-0.5, 1.5), any_number), "seed": st.one_of(st.integers(-5, 2**33), any_number)})


@FUZZ
@given(ids=st.one_of(st.lists(st.integers(0, V - 1), min_size=1, max_size=60),
                     st.lists(st.one_of(st.integers(-3, V + 3), st.integers(-2**62, 2**62)), max_size=60)),
       sampling=st.one_of(samplings, wild_samplings), max_new=st.integers(-2, 10))
@example(ids=[5, 6], sampling=dict(temperature=1.0, top_k=2**40, top_p=1.0, seed=2**32 - 1), max_new=3)
@example(ids=[5, 6], sampling=dict(temperature=1e300, top_k=0, top_p=0.5, seed=0), max_new=3)
@example(ids=[5, 6], sampling=dict(temperature=1.0, top_k=0, top_p=1.0, seed=2**32), max_new=3)
def test_token_id_prompts_and_sampling_options(eng, ids, sampling, max_new):
  valid = (bool(ids) and all(0 <= t < V for t in ids) and max_new >= 1 and _valid_sampling(sampling)
           and len(ids) + max_new <= RUN.max_context)
  event("refused" if not valid else "generated")
  if not valid:
    with pytest.raises(RequestError):
      eng.generate(ids, max_new_tokens=max_new, sampling=sampling)
    assert eng.pool.pages_used == 0
    return
  first = eng.generate(ids, max_new_tokens=max_new, sampling=sampling)
  _check_result(eng, first, max_new)
  assert eng.generate(ids, max_new_tokens=max_new, sampling=sampling).token_ids == first.token_ids


# -- hostile checkpoints: GGUF and safetensors headers ------------------------------------------------------------
# Every file a loader is given either loads or is refused with a one-line CheckpointError / ConfigError, within
# seconds and in bounded memory (a header claiming 2^40 items must not be believed). The oracle is the rule itself:
# nothing but those two errors may come out, and no call may take longer or allocate more than the bounds.

LOAD_SECONDS = 5.0
LOAD_BYTES = 64 << 20
HEADER_FUZZ = settings(FUZZ, max_examples=int(os.environ.get("LCJAX_FUZZ_EXAMPLES", "60")))
GG = ModelConfig("gguf-fuzz", vocab_size=8, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
                 max_position=64, bos_id=1, eos_ids=(2,))


def _bounded(fn, *args):
  """fn(*args) -> "ok", or the refusal's message; fails on any other exception, a multi-line message, more than
  LOAD_SECONDS or more than LOAD_BYTES of Python / numpy allocations."""
  def too_long(*_):
    raise TimeoutError(f"still loading after {LOAD_SECONDS} s")

  tracemalloc.start()
  before = signal.signal(signal.SIGALRM, too_long)
  signal.setitimer(signal.ITIMER_REAL, LOAD_SECONDS)        # a loader that believes a count is stopped here
  t0 = time.perf_counter()
  try:
    fn(*args)
    out = "ok"
  except (CheckpointError, ConfigError) as e:
    out = str(e)
    assert "\n" not in out and len(out) < 1000, out
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, before)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
  assert seconds < LOAD_SECONDS, (seconds, out)
  assert peak < LOAD_BYTES, (peak, out)
  return out


def _write_gguf(path, hparams: dict | None = None, tensors: dict | None = None, tokens=None, bos=1, eos=2):
  """A llama GGUF of GG's shape: hparams (llama.* keys) override GG's, tensors default to GG's, float32."""
  import gguf
  from lcjax.checkpoint.gguf import GGUF_NAMES
  from lcjax.checkpoint.hf import hf_shape
  from lcjax.checkpoint.layout import param_shapes
  w = gguf.GGUFWriter(str(path), "llama")
  h = {"block_count": GG.n_layers, "context_length": GG.max_position, "embedding_length": GG.dim,
       "feed_forward_length": GG.ffn_dim, "attention.head_count": GG.n_heads, "attention.head_count_kv": 1,
       "vocab_size": GG.vocab_size}
  h.update(hparams or {})
  for key, value in h.items():
    w.add_uint32(f"llama.{key}", value) if isinstance(value, int) else w.add_string(f"llama.{key}", value)
  w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens or [chr(97 + i) for i in range(GG.vocab_size)])
  w.add_token_types([1] * len(tokens or range(GG.vocab_size)))
  w.add_bos_token_id(bos)
  w.add_eos_token_id(eos)
  if tensors is None:
    shapes, tensors = param_shapes(GG), {}
    for gname, (name, in_dims) in GGUF_NAMES.items():
      if name in shapes:
        full, stacked = shapes[name]
        for i in range(GG.n_layers) if stacked else [None]:
          shape = hf_shape(full[1:] if stacked else full, in_dims)
          tensors[gname.replace("{i}", str(i))] = np.full(shape, 0.01, np.float32)
  for name, arr in tensors.items():
    w.add_tensor(name, arr)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _load_gguf(path: str, out: str) -> None:
  """What convert_gguf does before it writes a tensor: header, config, tokenizer, blocks, every tensor read."""
  from lcjax.checkpoint.gguf import GGUFFile, _check_blocks, gguf_model_config, write_tokenizer
  g = GGUFFile(path)
  cfg = gguf_model_config(g)
  write_tokenizer(g, out, cfg)
  _check_blocks(g, cfg)
  for name in g.tensors:
    g.read(name)


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "ok.gguf"
  _write_gguf(path)
  data = path.read_bytes()
  out = str(tmp_path_factory.mktemp("tok"))
  assert _bounded(_load_gguf, str(path), out) == "ok"
  return data


HOSTILE = [0, 1, 2**31 - 1, 2**32 - 1, 2**40, 2**63, 2**64 - 1]


@HEADER_FUZZ
@given(data=st.data())
def test_gguf_headers_load_or_are_refused_in_one_line(gguf_bytes, tmp_path_factory, data):
  """Hostile values over the counts and lengths of the header (u64 / u32 writes), flipped bytes and cuts."""
  raw = bytearray(gguf_bytes)
  end = min(len(raw), 4096)                        # the header and the tokenizer's metadata
  for _ in range(data.draw(st.integers(1, 3))):
    kind = data.draw(st.sampled_from(["u64", "u32", "byte", "cut"]))
    at = data.draw(st.integers(4, end - 8))
    if kind == "u64":
      raw[at:at + 8] = struct.pack("<Q", data.draw(st.sampled_from(HOSTILE)))
    elif kind == "u32":
      raw[at:at + 4] = struct.pack("<I", data.draw(st.sampled_from(HOSTILE)) & 0xFFFFFFFF)
    elif kind == "byte":
      raw[at] = data.draw(st.integers(0, 255))
    else:
      del raw[at:]
      break
  d = tmp_path_factory.mktemp("g")
  (d / "x.gguf").write_bytes(bytes(raw))
  event(_bounded(_load_gguf, str(d / "x.gguf"), str(d)).split(": ", 1)[-1][:30])


def _gguf_case(tmp_path, **kw):
  _write_gguf(tmp_path / "m.gguf", **kw)
  return _bounded(_load_gguf, str(tmp_path / "m.gguf"), str(tmp_path))


def test_hostile_gguf_files_from_the_issue(tmp_path):
  # 109 bytes whose one array claims 2^40 items (the reader allocated ~90 MB/s for it)
  raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 9) + b"llama.big" + struct.pack("<IIQ", 9, 4,
                                                                                                    2**40)
  (tmp_path / "big.gguf").write_bytes(raw.ljust(109, b"\0"))
  assert "llama.big claims 1099511627776 items of at least 4 bytes" in _bounded(
      _load_gguf, str(tmp_path / "big.gguf"), str(tmp_path))
  assert "llama.block_count=4294967295 must be an integer in [1, 2147483647]" in _gguf_case(
      tmp_path, hparams={"block_count": 0xFFFFFFFF})
  assert "llama.block_count=3, its tensors hold blocks 0..1 (2 of them)" in _gguf_case(
      tmp_path, hparams={"block_count": 3})
  assert "llama.attention.head_count=0 must be an integer in [1, " in _gguf_case(
      tmp_path, hparams={"attention.head_count": 0})
  assert "llama.attention.head_count='two' must be an integer" in _gguf_case(
      tmp_path, hparams={"attention.head_count": "two"})
  assert "tokenizer.ggml.bos_token_id=8 must be an integer in [-1, 7]" in _gguf_case(tmp_path, bos=8)
  assert "the eos token id 5 is not among the 4 tokens" in _gguf_case(
      tmp_path, tokens=["a", "b", "c", "d"], eos=5)
  assert _gguf_case(tmp_path) == "ok"


def _write_safetensors(path, header: dict, data: bytes) -> None:
  raw = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _load_safetensors(path: str) -> None:
  from lcjax.checkpoint.hf import SafetensorsFile
  f = SafetensorsFile(path)
  for name, t in f.tensors.items():
    x = f.read(name)
    assert x.shape == t.shape and x.nbytes == t.end - t.begin


any_int = st.one_of(st.integers(-300, 300), st.sampled_from([-2**63, 2**40, 2**63, 2**64 + 5]), st.booleans(),
                    st.just("8"), st.none())
entries = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "I64", "F8_E4M3", ""]), any_int),
    "shape": st.one_of(st.lists(any_int, max_size=4), any_int),
    "data_offsets": st.one_of(st.lists(any_int, max_size=3), any_int),
})


@HEADER_FUZZ
@given(header=st.dictionaries(st.sampled_from(["a", "b", "__metadata__", "model.norm.weight"]),
                              st.one_of(entries, any_int, st.lists(any_int, max_size=2)), max_size=3),
       data_len=st.integers(0, 256))
@example(header={"a": {"dtype": "F32", "shape": [64], "data_offsets": [-256, 0]}}, data_len=256)
@example(header={"a": {"dtype": "F32", "shape": [64]}}, data_len=256)
@example(header={"a": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}, data_len=16)
def test_safetensors_headers_load_or_are_refused_in_one_line(tmp_path_factory, header, data_len):
  d = tmp_path_factory.mktemp("s")
  _write_safetensors(d / "x.safetensors", header, bytes(data_len))
  out = _bounded(_load_safetensors, str(d / "x.safetensors"))
  offsets = [h.get("data_offsets") for h in header.values() if isinstance(h, dict)]
  if any(isinstance(o, list) and o and isinstance(o[0], int) and o[0] < 0 for o in offsets):
    assert out != "ok"                              # a negative offset would read the header as weights
  event(out.split(": ", 1)[-1][:30])


@pytest.mark.parametrize("change, names", [
    (lambda c: c.pop("vocab_size"), ["config.json: no vocab_size in the HF config"]),
    (lambda c: c.update(rms_norm_eps="tiny"), ["norm_eps='tiny' must be a finite number > 0"]),
    (lambda c: c.update(bos_token_id=10**6), ["bos_id=1000000 is not a token id of the vocabulary [0, 256)"]),
    (lambda c: c.update(eos_token_id=[2, -1]), ["eos id=-1 is not a token id"]),
    (lambda c: c.update(num_attention_heads=0), ["num_attention_heads=0 and hidden_size=64 must be integers"]),
    (lambda c: c.update(num_hidden_layers=True), ["n_layers=True must be an integer"]),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": "x", "low_freq_factor": 1,
                                      "high_freq_factor": 4, "original_max_position_embeddings": 8}),
     ["rope_scaling of rope_type 'llama3' holds a value that is not a number"]),
], ids=["no-vocab_size", "eps-a-string", "bos-outside", "eos-negative", "no-heads", "layers-a-bool", "rope-str"])
def test_a_malformed_hf_config_is_refused_in_one_line(tmp_path, change, names):
  from lcjax.checkpoint.hf import hf_model_config
  hf = preset_tiny_hf()
  change(hf)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  msg = _bounded(hf_model_config, str(tmp_path))
  for name in names:
    assert name in msg, msg


def preset_tiny_hf() -> dict:
  from lcjax.config import preset
  return preset("tiny").to_hf()


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_an_index_cannot_name_a_shard_outside_its_folder(tmp_path, shard):
  from lcjax.checkpoint.hf import convert_hf
  src = tmp_path / "model"
  src.mkdir()
  (src / "config.json").write_text(json.dumps(preset_tiny_hf()))
  _write_safetensors(tmp_path / "outside.safetensors", {}, b"")
  (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
  msg = _bounded(convert_hf, str(src), str(tmp_path / "out"))
  assert f"shard {shard!r} (holding tensor model.norm.weight) is not a file of the checkpoint folder" in msg, msg
  assert not os.path.exists(tmp_path / "out")
