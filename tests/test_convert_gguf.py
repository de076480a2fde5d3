"""tools/convert_gguf.py on the bundled SmolLM2-135M-Instruct Q4_1 file, checked against transformers loading the
same GGUF (logits, config, tokenizer, chat template), plus a small sentencepiece-vocabulary GGUF written here
(llama.cpp's Q/K permutation applied as its converter does) checked against the HF model it came from.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.checkpoint import CheckpointError, convert_gguf, load_config
from lcjax.checkpoint.gguf import smollm2_gguf_path
from lcjax.config import ModelConfig, preset
from lcjax.tokenizer import Tokenizer
from tests import fixtures_ckpt as fx, forkserver
from tests import hf_oracle
from tests.run_cache import REPO, cpu_env


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 12 * 13?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away, there lived a small robot who",
]

TOKENIZER_TEXTS = fx.TEXTS + [
    "12345678901234567890", "x = [1, 2, 3]; y = {'a': 1.5e-3}", "    indented\n        more\n",
    "I'm you're they'll we've she'd", "ÀÉÎÕÜ ß ñ ø 한국어 العربية हिन्दी", "a\u00a0b\u2003c\u200bd", "🎉🎉🎉 🏳️‍🌈",
    "<|endoftext|>tail <repo_name>x<file_sep>", "trailing spaces   ", "\n\n\n", "<|im_end|><|im_start|>",
]


@contextlib.contextmanager
def _gguf_parsed_once():
  """transformers' GGUF loading with the gguf package's GGUFReader built once per file and its tensor name map once
  per (architecture, layers), for the duration of the block. transformers imports both from the gguf module at
  each call: the config, the weights and the tokenizer each parse the whole file again (about 4 s each for
  SmolLM2's 49,152-token vocabulary), and the weights' name mapping builds the same map for each of the HF model's
  397 modules (about 6 s). Readers and maps are read, never written, by their callers: the values transformers
  loads are the gguf package's, as without the block."""
  import gguf
  readers = {}
  reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

  def reader(path, mode="r"):
    key = (os.path.realpath(path), mode)
    if key not in readers:
      readers[key] = reader_cls(path, mode)
    return readers[key]

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(gguf, "GGUFReader", reader)
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(name_map))
    yield


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
  """(lcjax ckpt dir, HF model, HF tokenizer): the GGUF converted by convert_gguf (once per test run, shared with
  the other tests of the converted model: tests/conftest.py), and transformers' reading of it."""
  import torch
  import transformers
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  path = smollm2_gguf_path()
  dst = smollm2_checkpoint
  folder, fname = os.path.split(path)
  with _gguf_parsed_once():
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=fname)
  return dst, hf, hf_tok


def test_config_from_metadata(smollm2):
  dst, hf, _ = smollm2
  cfg = load_config(dst)
  h = hf.config
  assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (
      h.vocab_size, h.hidden_size, h.num_hidden_layers, h.num_attention_heads, h.num_key_value_heads,
      h.head_dim, h.intermediate_size)
  assert cfg.rope_theta == pytest.approx(h.rope_parameters["rope_theta"])
  assert cfg.norm_eps == pytest.approx(h.rms_norm_eps)
  assert cfg.tie_embeddings and h.tie_word_embeddings
  assert (cfg.bos_id, cfg.eos_ids, cfg.add_bos) == (1, (2,), False)
  p = preset("smollm2-135m")
  assert dataclasses.replace(cfg, name=p.name) == p


def test_logits_match_transformers(smollm2):
  import torch
  dst, hf, _ = smollm2
  model, tok = fx.lcjax_model(dst)
  ids = [tok.encode(p) for p in PROMPTS]
  T = max(map(len, ids))
  # right padding: causal attention keeps each prompt's logits independent of what follows it
  tokens = np.array([x + [0] * (T - len(x)) for x in ids], np.int32)
  got = np.asarray(model(jnp.asarray(tokens))[0])
  with torch.no_grad():
    want = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
  for b, prompt in enumerate(PROMPTS):
    g, w = got[b, :len(ids[b])], want[b, :len(ids[b])]
    np.testing.assert_allclose(g, w, atol=1e-3, rtol=0, err_msg=prompt)
    top2 = np.sort(w, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05
    assert clear.sum() >= len(ids[b]) // 2
    np.testing.assert_array_equal(g.argmax(-1)[clear], w.argmax(-1)[clear])


def test_tokenizer_matches_transformers(smollm2):
  dst, _, hf_tok = smollm2
  tok = Tokenizer(dst)
  assert tok.vocab_size == len(hf_tok) == 49152
  for text in TOKENIZER_TEXTS:
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"], text    # no BOS: SmolLM2 adds none
    assert tok.decode(ids) == hf_tok.decode(ids), text
  assert tok.encode("hi", add_bos=True) == [1] + tok.encode("hi")


def test_chat_template_matches_transformers(smollm2):
  dst, _, hf_tok = smollm2
  tok = Tokenizer(dst)
  for msgs in ([{"role": "user", "content": "What is 2+2?"}],
               [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
    for gen in (True, False):
      want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
      assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
      assert tok.encode_chat(msgs, add_generation_prompt=gen) == hf_tok(want, add_special_tokens=False)["input_ids"]


def _llama_cpp_permute(w, n_head):
  """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rotate_half rows to interleaved pairs."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_sentencepiece_gguf_matches_its_hf_model(tmp_path):
  """A llama-vocabulary GGUF with an untied head, made from a random HF model as llama.cpp would."""
  sp_file = str(tmp_path / "sp.model")
  fx.sentencepiece_model(sp_file)
  vocab = fx.sentencepiece_vocab(sp_file)
  cfg = ModelConfig("sp", vocab_size=len(vocab["tokens"]), dim=48, n_layers=2, n_heads=6, n_kv_heads=2,
                    head_dim=8, ffn_dim=64, rope_theta=10000.0, max_position=256, bos_id=1, eos_ids=(2,))
  hf = hf_oracle.make_hf_llama(cfg, seed=5)
  sd = fx.hf_state_dict(hf)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
  tensors = {}
  for hf_name, w in sd.items():
    if hf_name in names:
      tensors[names[hf_name]] = w
      continue
    _, _, i, rest = hf_name.split(".", 3)
    g = per_layer[rest.rsplit(".", 1)[0]]
    if g == "attn_q":
      w = _llama_cpp_permute(w, cfg.n_heads)
    elif g == "attn_k":
      w = _llama_cpp_permute(w, cfg.n_kv_heads)
    tensors[f"blk.{i}.{g}.weight"] = w
  src = str(tmp_path / "sp.gguf")
  fx.write_gguf(src, cfg=cfg, tensors=tensors, tokenizer=vocab)
  dst = str(tmp_path / "ckpt")
  convert_gguf(src, dst, progress=False)
  got_cfg = load_config(dst)
  assert dataclasses.replace(got_cfg, name=cfg.name) == cfg
  model, tok = fx.lcjax_model(dst)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
  ref = hf_oracle.hf_logits(hf, tokens)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens, jnp.int32))[0]), ref,
                             atol=1e-4 * np.abs(ref).max(), rtol=0)
  # the vocabulary rebuilt as tokenizer.model tokenizes as the original sentencepiece model (plus BOS)
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=sp_file)
  assert os.path.exists(os.path.join(dst, "tokenizer.model"))
  for text in fx.TEXTS:
    assert tok.encode(text) == [1] + sp.encode(text), text
    assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_refuses_other_architecture_and_bad_files(tmp_path):
  src = str(tmp_path / "qwen.gguf")
  fx.write_gguf(src, arch="qwen2")
  dst = str(tmp_path / "out")
  env = cpu_env()
  p = forkserver.run([sys.executable, os.path.join(REPO, "tools", "convert_gguf.py"), f"--src={src}",
                      f"--dst={dst}"], env=env, timeout=120)     # the tool as a process of its own, forked
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1] == (f"convert_gguf: error: {src}: general.architecture='qwen2'; "
                                              "lcjax converts 'llama' GGUF files only")
  assert not os.path.exists(dst)
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"not a gguf file at all")
  with pytest.raises(CheckpointError, match=r"bad.gguf: not a GGUF file \(it starts with b'not ', not b'GGUF'\)"):
    convert_gguf(str(bad), dst, progress=False)
  with pytest.raises(CheckpointError, match="missing.gguf: no such GGUF file"):
    convert_gguf(str(tmp_path / "missing.gguf"), dst, progress=False)
  cfg = preset("tiny")
  scaled = str(tmp_path / "scaled.gguf")
  fx.write_gguf(scaled, cfg=cfg, extra={"llama.rope.scaling.type": "yarn"})
  with pytest.raises(CheckpointError, match="scaled.gguf: llama.rope.scaling.type='yarn' is not supported"):
    convert_gguf(scaled, dst, progress=False)
  pre = str(tmp_path / "pre.gguf")
  fx.write_gguf(pre, cfg=cfg, tokenizer={"model": "gpt2", "pre": "mystery", "tokens": ["a", "b"],
                                        "token_type": [1, 1], "merges": ["a b"], "bos": 0, "eos": 1})
  with pytest.raises(CheckpointError, match="pre.gguf: tokenizer.ggml.pre='mystery' is not"):
    convert_gguf(pre, dst, progress=False)
  assert not os.path.exists(dst)


@pytest.mark.parametrize("pre, key, want", [("llama-bpe", None, True), ("smollm", None, False),
                                            ("llama-bpe", False, False)])
def test_bpe_vocabularies_add_bos_as_llama_cpp_does(tmp_path, pre, key, want):
  """Without tokenizer.ggml.add_bos_token, llama.cpp adds BOS for the Llama-3 pre-tokenizer, not for other BPE
  vocabularies; the key, when present, wins."""
  from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config
  tok = {"model": "gpt2", "pre": pre, "tokens": ["a", "b", "c"], "token_type": [1, 1, 1], "merges": ["a b"],
         "bos": 0, "eos": 1}
  if key is not None:
    tok["add_bos"] = key
  path = str(tmp_path / "v.gguf")
  fx.write_gguf(path, cfg=preset("tiny"), tokenizer=tok)
  cfg = gguf_model_config(GGUFFile(path))
  assert (cfg.bos_id, cfg.add_bos) == (0, want)


def _every_kind_gguf(path: str) -> None:
  """A GGUF (gguf.GGUFWriter) with a metadata value of every scalar type, strings, arrays of ints, floats, bools
  and strings, and tensors of plain types and of block-quantized ones."""
  import gguf
  from gguf import GGMLQuantizationType as Q, GGUFValueType as V
  w = gguf.GGUFWriter(path, "llama")
  for key, value, vtype in [("u8", 200, V.UINT8), ("i8", -5, V.INT8), ("u16", 60000, V.UINT16),
                            ("i16", -300, V.INT16), ("u32", 4000000000, V.UINT32), ("i32", -7, V.INT32),
                            ("f32", 1e-5, V.FLOAT32), ("u64", 2**40 + 3, V.UINT64), ("i64", -2**40, V.INT64),
                            ("f64", 0.1, V.FLOAT64), ("yes", True, V.BOOL), ("no", False, V.BOOL),
                            ("text", "héllo wörld ✓", V.STRING)]:
    w.add_key_value(f"t.{key}", value, vtype)
  w.add_key_value("t.u16s", [1, 2, 65535], V.ARRAY, sub_type=V.UINT16)
  w.add_key_value("t.f32s", [0.5, -1.25, 3e-8], V.ARRAY, sub_type=V.FLOAT32)
  w.add_key_value("t.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
  w.add_token_list(["a", "Ġb", "<|x|>", "ü"])
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 64)).astype(np.float32)
  w.add_tensor("f32", x)
  w.add_tensor("f16", x.astype(np.float16))
  for q in (Q.Q8_0, Q.Q4_1, Q.Q5_0):
    w.add_tensor(q.name.lower(), gguf.quants.quantize(x, q), raw_dtype=q)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_reader_matches_the_gguf_package(tmp_path):
  """GGUFFile's own header reader against gguf.GGUFReader: every metadata value (type and value) and every
  tensor's dequantized data equal."""
  import gguf
  from lcjax.checkpoint.gguf import GGUFFile
  path = str(tmp_path / "kinds.gguf")
  _every_kind_gguf(path)
  g, ref = GGUFFile(path), gguf.GGUFReader(path)
  keys = [k for k in ref.fields if not k.startswith("GGUF.")]
  assert g.keys() == keys and len(keys) == 18
  for k in keys:
    want, got = ref.fields[k].contents(), g.get(k)
    assert type(got) is type(want) and got == want, (k, got, want)
    if isinstance(want, list):
      assert [type(v) for v in got] == [type(v) for v in want], k
  assert list(g.tensors) == [t.name for t in ref.tensors] == ["f32", "f16", "q8_0", "q4_1", "q5_0"]
  for t in ref.tensors:
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    got = g.read(t.name)
    assert got.dtype == np.float32 and got.shape == want.shape == (4, 64), t.name
    np.testing.assert_array_equal(got, want, err_msg=t.name)
    assert tuple(g.tensors[t.name].shape) == tuple(int(d) for d in t.shape)
  assert g.get("t.missing", "default") == "default"


def _raw_gguf(path, kv=(), tensors=(), data=b"") -> str:
  """GGUF v3 bytes written by hand: kv (key, value type, packed value), tensors (name, dims, ggml type, offset)."""
  import struct
  s = lambda b: struct.pack("<Q", len(b)) + b
  out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
  for key, vtype, payload in kv:
    out += s(key.encode()) + struct.pack("<I", vtype) + payload
  for name, dims, ttype, offset in tensors:
    out += s(name.encode()) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)
  path.write_bytes(out + b"\0" * (-len(out) % 32) + data)
  return str(path)


def test_reader_refuses_what_the_gguf_package_refused_in_one_line(tmp_path):
  """Keys or tensor names twice, a general.alignment that is not a uint32, rows that are not whole blocks of a
  quantized type: one-line CheckpointErrors naming the field. A value that is not UTF-8 fails when it is read."""
  import struct
  from lcjax.checkpoint.gguf import GGUFFile
  u32 = lambda v: (4, struct.pack("<I", v))
  f32 = lambda name, offset: (name, [4], 0, offset)
  cases = [
      (dict(kv=[("a", *u32(1)), ("a", *u32(2))]), "metadata key a appears twice"),
      (dict(tensors=[f32("w", 0), f32("w", 16)], data=bytes(32)), "tensor name w appears twice"),
      (dict(kv=[("general.alignment", 10, struct.pack("<Q", 32))]),
       "general.alignment has value type 10, not uint32 (4)"),
      (dict(tensors=[("q", [16, 4], 8, 0)], data=bytes(68)),    # Q8_0: blocks of 32 elements in 34 bytes
       "tensor q has shape [16, 4]: 64 elements in rows of 16, not positive whole blocks of its type's 32"),
  ]
  for i, (kw, want) in enumerate(cases):
    path = _raw_gguf(tmp_path / f"{i}.gguf", **kw)
    with pytest.raises(CheckpointError) as e:
      GGUFFile(path)
    assert f"{path}: malformed GGUF header: {want} (at byte " in str(e.value) and "\n" not in str(e.value)
  not_utf8 = (8, struct.pack("<Q", 2) + b"\xff\xfe")
  g = GGUFFile(_raw_gguf(tmp_path / "utf8.gguf", kv=[("bad", *not_utf8), ("ok", *u32(7))]))
  assert g.get("ok") == 7
  with pytest.raises(CheckpointError, match=r"utf8.gguf: metadata bad cannot be read: UnicodeDecodeError"):
    g.get("bad")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_value_is_refused(tmp_path, bad):
  """A NaN (or inf) anywhere in a tensor, one value of a norm included, turned every logit NaN and the answer
  into token 0 without a word: the reader refuses it, naming the tensor and where."""
  from lcjax.checkpoint.gguf import GGUFFile
  w = np.ones((4, 8), np.float32)
  w[2, 5] = bad
  path = str(tmp_path / "bad.gguf")
  fx.write_gguf(path, tensors={"output_norm.weight": w})
  with pytest.raises(CheckpointError, match=r"bad.gguf: tensor output_norm.weight \(F32\) holds 1 value\(s\) that "
                                            r"are NaN or infinite, the first at \(2, 5\)"):
    GGUFFile(path).read("output_norm.weight")


def test_vocab_size_from_metadata_alone(tmp_path):
  """llama.vocab_size is enough: the fallbacks (the token list, token_embd.weight's shape) are looked at only
  without it, so a file with neither reads its config (and is refused later, naming the missing tensor)."""
  from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config
  path = str(tmp_path / "bare.gguf")
  fx.write_gguf(path, cfg=preset("tiny"))
  assert gguf_model_config(GGUFFile(path)).vocab_size == preset("tiny").vocab_size
  with pytest.raises(CheckpointError) as e:
    convert_gguf(path, str(tmp_path / "out"), progress=False)
  assert "\n" not in str(e.value) and "bare.gguf" in str(e.value), str(e.value)


@pytest.mark.parametrize("extra, refused", [
    ({"llama.rope.scaling.factor": 4.0}, "llama.rope.scaling.factor=4.0"),
    ({"llama.rope.scale_linear": 2.0}, "llama.rope.scale_linear=2.0"),
    ({"llama.rope.scaling.attn_factor": 1.5}, "llama.rope.scaling.attn_factor=1.5"),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.factor": 1.0}, None),
    ({"llama.rope.scaling.factor": 0.0}, None),
], ids=["factor", "old-key", "attn-factor", "type-none", "factor-1", "factor-0"])
def test_rope_scaling_as_llama_cpp_reads_it(tmp_path, extra, refused):
  """llama.cpp (llama_model::load_hparams) reads a missing llama.rope.scaling.type as "linear" and scales the
  rotary frequencies by 1 / llama.rope.scaling.factor (or the older llama.rope.scale_linear) unless that is 0 or
  the type is "none"; rope.scaling.attn_factor multiplies the rotations. lcjax rotates unscaled, so a file that
  asks for either is refused with one line naming the key; one that asks for none converts."""
  from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config
  path = str(tmp_path / "scaled.gguf")
  fx.write_gguf(path, cfg=preset("tiny"), extra=extra)
  if refused is None:
    assert gguf_model_config(GGUFFile(path)).rope_scaling is None
    return
  with pytest.raises(CheckpointError) as e:
    gguf_model_config(GGUFFile(path))
  assert refused in str(e.value) and "scaled.gguf" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_cast_that_overflows_is_refused(tmp_path):
  """convert_gguf(dtype="float16") of a value past float16's largest (65504) would store inf: refused in one
  line naming the tensor and the value."""
  from tests.test_bos import _tensors
  cfg = preset("tiny")
  tensors = _tensors(cfg)
  tensors["output_norm.weight"][3] = 1e5
  path = str(tmp_path / "big.gguf")
  fx.write_gguf(path, cfg=cfg, tensors=tensors, tokenizer={"model": "gpt2", "pre": "gpt2", "tokens": [
      chr(0x100 + i) for i in range(cfg.vocab_size)], "token_type": [1] * cfg.vocab_size, "merges": [], "bos": 1,
      "eos": 2})
  with pytest.raises(CheckpointError) as e:
    convert_gguf(path, str(tmp_path / "out"), dtype="float16", progress=False)
  msg = str(e.value)
  assert "\n" not in msg and "output_norm.weight" in msg and "100000" in msg and "float16" in msg, msg
  convert_gguf(path, str(tmp_path / "out32"), progress=False)


@pytest.mark.parametrize("key", ["llama.attention.layer_norm_rms_epsilon", "llama.context_length"])
def test_keys_llama_cpp_requires_are_required(tmp_path, key):
  """llama.cpp (llama_model::load_hparams, LLM_ARCH_LLAMA) refuses a file without the RMS norm epsilon or the
  trained context length; lcjax took 1e-5 and 4096 for them, a guess that normalizes with another epsilon than the
  model was trained with. Refused in one line naming the key."""
  import gguf
  from lcjax.checkpoint.gguf import GGUFFile, gguf_model_config
  cfg = preset("tiny")
  path = str(tmp_path / "partial.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(cfg.n_layers)
  w.add_embedding_length(cfg.dim)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.n_heads)
  w.add_vocab_size(cfg.vocab_size)
  if key != "llama.context_length":
    w.add_context_length(cfg.max_position)
  if key != "llama.attention.layer_norm_rms_epsilon":
    w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError) as e:
    gguf_model_config(GGUFFile(path))
  assert str(e.value) == f"{path}: metadata {key} is missing"


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe) for tokenizer.ggml.pre "default" (and a
# file without the key), applied one after the other, each splitting the pieces the ones before left.
LLAMA_CPP_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+",
                     r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                     r"\p{N}+", r"[0-9][0-9][0-9]"]
LLAMA_CPP_SMOLLM = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]


def _llama_cpp_split(text: str, exprs: list[str]) -> list[str]:
  """unicode_regex_split as llama.cpp runs it: for each regex in turn, every piece becomes its matches and the
  text between them."""
  import regex
  pieces = [text]
  for e in exprs:
    r, out = regex.compile(e), []
    for p in pieces:
      at = 0
      for m in r.finditer(p):
        if m.start() > at:
          out.append(p[at:m.start()])
        if m.end() > m.start():
          out.append(m.group())
        at = m.end()
      if at < len(p):
        out.append(p[at:])
    pieces = out
  return pieces


@pytest.mark.parametrize("pre, exprs", [("default", LLAMA_CPP_DEFAULT), (None, LLAMA_CPP_DEFAULT),
                                        ("smollm", LLAMA_CPP_SMOLLM)], ids=["default", "no-pre-key", "smollm"])
def test_byte_level_pre_tokenizers_split_as_llama_cpp(tmp_path, pre, exprs):
  """The byte-level vocabulary rebuilt from a GGUF tokenizes as llama.cpp does: its regexes split the text (for
  "default", punctuation runs, then GPT-2's pattern, then digit runs, then three-digit groups) and each piece is
  BPE-merged on its own (GPT-2's pattern alone would keep " 12345" and " ," whole)."""
  import json as json_
  from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
  from lcjax.checkpoint.gguf import GGUFFile, _byte_level_tokenizer
  tj = json_.load(open(_trained_byte_level(tmp_path)))
  vocab, merges = tj["model"]["vocab"], [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
  tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
  tok = {"model": "gpt2", "tokens": tokens, "token_type": [3, 3] + [1] * (len(tokens) - 2), "merges": merges,
         "bos": 0, "eos": 1}
  if pre is not None:
    tok["pre"] = pre
  path = str(tmp_path / "bpe.gguf")
  fx.write_gguf(path, cfg=dataclasses.replace(preset("tiny"), vocab_size=len(tokens)), tokenizer=tok)
  got = _byte_level_tokenizer(GGUFFile(path))
  bpe = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  for text in fx.TEXTS[:-1] + ["Hello, world!! 12345 and 3.14159 $100 a+b<=c 1,000,000 x^2 ~y |z| (yes) 'quoted'",
                               "1234567 ,,, ... !? 42"]:
    want = [i for piece in _llama_cpp_split(text, exprs) for i in bpe.encode(piece).ids]
    assert got.encode(text).ids == want, text


def _trained_byte_level(tmp_path) -> str:
  path = str(tmp_path / "tokenizer.json")
  fx.byte_level_tokenizer_json(path)
  return path
