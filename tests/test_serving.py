"""What runs, in one table: `resolve()` on this CPU, on an emulated Ada (sm_89) and Hopper (sm_90) GPU, and on a
2 x 4 mesh, for the Llama-3.1-8B shape with fp8 weights and an fp8 KV cache. Nothing is read or compiled: the
emulation answers `jax.default_backend()` and the compute capability the kernels' checks read, and cuDNN's
presence (a CPU jaxlib has none)."""
from __future__ import annotations

import dataclasses
import logging

import jax
import pytest

from lcjax import config
from lcjax.config import ConfigError, RunConfig, preset
from lcjax.engine.serving import resolve
from lcjax.ops import hardware, kernels
from lcjax.ops.cudnn import backend as cudnn

CFG = preset("llama3.1-8b")
RUN = RunConfig(max_context=4096, page_size=64, cache_dtype="float8_e4m3fn", weight_dtype="float8_e4m3fn")


def _gpu(monkeypatch, cc):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(hardware, "compute_capability", lambda: cc)       # every kernel's probe asks hardware
  monkeypatch.setattr(cudnn.CudnnBackend, "why_not", lambda self, **kw: None)
  monkeypatch.setattr(hardware, "pallas_triton_reason", lambda: None)     # this JAX lowers through Triton


def _kernels(s):
  """The names of what runs; the GEMV kernel and the page writer the model receives are the objects of their
  names (None: XLA)."""
  for choice in (s.linear, s.page_write):
    assert choice.kernel is None if choice.name == "xla" else choice.kernel.name == choice.name, choice
  return dict(attention=s.attention.name, decode=s.decode.name, linear=s.linear.name, page_write=s.page_write.name)


def test_on_this_cpu():
  s = resolve(CFG, RUN, check_fit=False)
  assert s.run.dtype == "float32"
  assert _kernels(s) == dict(attention="reference", decode="reference", linear="xla", page_write="xla")
  assert "needs a CUDA GPU" in s.page_write.why and "linear_kernel='auto'" in s.linear.why
  assert s.draft.name == "off"
  table = s.table()
  for row in ("attention", "prefill over pages", "decode attention", "fp8 products, decode", "fp8 page write",
              "speculation"):
    assert f"\n  {row} " in table, table
  # 8-bit attention here: the FP8 kernel's model, decode rows through the Triton kernel in the interpreter, whose
  # pages must still be ones it reads (refused in one line, not at the first decode step)
  fp8 = resolve(CFG, RUN.replace(attention_dtype="float8_e4m3fn"), check_fit=False)
  assert fp8.decode.name == "triton-interpret" and "Pallas interpreter" in fp8.decode.why
  with pytest.raises(ConfigError, match="page_size=96: neither decode kernel of the pallas-fp8-model backend reads "
                                        "these pages \\(Mosaic GPU: .*interpret.*; Triton: .*power of two"):
    resolve(CFG, RUN.replace(attention_dtype="float8_e4m3fn", page_size=96, prefill_chunk=960), check_fit=False)


def _jax_0_11(monkeypatch, yes=True):
  from lcjax.ops.mosaic_gpu import page_write
  monkeypatch.setattr(page_write, "refs_into_kernels", lambda: yes)


def test_on_hopper(monkeypatch):
  """Hopper's defaults: the Mosaic GPU decode kernels with their Mosaic GPU split combine (over bf16 and fp8 pages),
  the Mosaic GPU fp8 GEMV and fp8 page write; Triton decode and the Triton page write only where the Mosaic GPU
  kernels cannot serve, with the reason."""
  _gpu(monkeypatch, (9, 0))
  _jax_0_11(monkeypatch)
  s = resolve(CFG, RUN.replace(draft="prompt"), check_fit=False)
  assert s.run.dtype == "bfloat16"
  assert _kernels(s) == dict(attention="pallas", decode="mosaic", linear="mosaic", page_write="mosaic")
  assert "decode_kernel='auto' on Hopper" in s.decode.why and "split combine (" in s.decode.why
  assert "Triton" not in s.decode.why + s.linear.why + s.page_write.why
  assert s.page_write.why == "page_write='auto'"
  assert s.draft.name == "prompt" and "4 drafts" in s.draft.why
  bf16 = resolve(CFG, RUN.replace(cache_dtype="bfloat16"), check_fit=False).decode
  assert bf16.name == "mosaic" and "decode_kernel='auto' on Hopper" in bf16.why and "split combine" in bf16.why
  # 32-token pages: the Mosaic GPU decode kernels do not read them
  small = resolve(CFG, RUN.replace(page_size=32), check_fit=False)
  assert (small.decode.name, small.page_write.name) == ("triton", "pallas")
  assert "blocks of 64 tokens; page_size=32" in small.decode.why
  assert "not mosaic: the Mosaic GPU fp8 page writer needs a page_size that is a multiple of 64" in small.page_write.why
  # float16 activations over bf16 pages
  f16 = resolve(CFG, RUN.replace(dtype="float16", cache_dtype="bfloat16"), check_fit=False)
  assert f16.decode.name == "triton" and "bfloat16 queries, not float16" in f16.decode.why
  # pages neither decode kernel reads: refused in one line, not at the first decode step
  with pytest.raises(ConfigError, match="page_size=96: neither decode kernel of the pallas backend reads these pages "
                                        "\\(Mosaic GPU: .*not a multiple; Triton: .*power of two"):
    resolve(CFG, RUN.replace(page_size=96, prefill_chunk=960), check_fit=False)
  assert resolve(CFG, RUN.replace(page_size=192, prefill_chunk=1920), check_fit=False).decode.name == "mosaic"
  # verify steps of more rows than the decode kernels take (9 tokens x 8 heads) run as chunks: not refused
  wide = dataclasses.replace(CFG, n_heads=64, n_kv_heads=8)
  resolve(wide, RUN.replace(page_size=96, prefill_chunk=960, draft="prompt", draft_tokens=8, max_batch=1),
          check_fit=False)
  assert resolve(CFG, RUN.replace(page_write="mosaic"), check_fit=False).page_write.name == "mosaic"
  assert resolve(CFG, RUN.replace(page_write="pallas"), check_fit=False).page_write.name == "pallas"
  _jax_0_11(monkeypatch, False)
  old_jax = resolve(CFG, RUN, check_fit=False).page_write
  assert old_jax.name == "pallas" and "not mosaic: " in old_jax.why and "JAX 0.11" in old_jax.why
  with pytest.raises(ConfigError, match="page_write='mosaic': .*mutable refs, which Mosaic GPU kernels take from "
                                        "JAX 0.11"):
    resolve(CFG, RUN.replace(page_write="mosaic"), check_fit=False)


def test_a_jax_without_pallas_triton(monkeypatch):
  """A JAX without the Pallas Triton lowering (deprecated in 0.11, to be removed): Hopper's defaults are unchanged
  (none of them lowers through Triton); every Triton kernel says it cannot serve, so `auto` takes another and a
  Triton kernel asked for by name is refused in one line."""
  _gpu(monkeypatch, (9, 0))
  _jax_0_11(monkeypatch)
  gone = "this JAX (9.9) has no Pallas Triton lowering (no module jax.experimental.pallas.triton)"
  monkeypatch.setattr(hardware, "pallas_triton_reason", lambda: gone)
  s = resolve(CFG, RUN, check_fit=False)
  assert _kernels(s) == dict(attention="pallas", decode="mosaic", linear="mosaic", page_write="mosaic")
  assert resolve(CFG, RUN.replace(cache_dtype="bfloat16"), check_fit=False).decode.name == "mosaic"
  for kernel in (kernels.TritonGemv(), kernels.TritonGemv(interpret=True)):
    assert kernel.why_not({}) == gone
  for kernel in (kernels.TritonPageWriter(), kernels.TritonPageWriter(interpret=True), kernels.TritonFp8Decode(),
                 kernels.TritonFp8Decode(interpret=True)):
    assert kernel.why_not(64, 128) == gone
  with pytest.raises(ConfigError, match="page_size=32: neither decode kernel of the pallas backend reads these pages "
                                        ".*Triton: this JAX \\(9.9\\) has no Pallas Triton lowering"):
    resolve(CFG, RUN.replace(page_size=32), check_fit=False)         # 32-token pages: no Mosaic GPU kernel reads them
  with pytest.raises(ConfigError, match="decode_kernel='triton': this JAX \\(9.9\\) has no Pallas Triton lowering"):
    resolve(CFG, RUN.replace(decode_kernel="triton"), check_fit=False)
  for field in ("page_write", "linear_kernel"):
    for name in ("pallas", "pallas-interpret"):
      with pytest.raises(ConfigError) as e:
        resolve(CFG, RUN.replace(**{field: name}), check_fit=False)
      assert str(e.value) == f"{field}={name!r}: {gone}"          # no pointer to an interpreter that needs it too


def test_pallas_triton_reason_asks_as_jax_lowers(monkeypatch):
  """The probe imports JAX's Triton registration, as JAX's GPU lowering does: present here (None), and where the
  import fails, a line naming this JAX and the error."""
  import importlib
  hardware.pallas_triton_reason.cache_clear()
  assert hardware.pallas_triton_reason() is None
  real = importlib.import_module

  def without_triton(name, *args):
    if name.startswith("jax._src.pallas.triton"):
      raise ImportError("No module named 'jax._src.lib.triton'")
    return real(name, *args)

  monkeypatch.setattr(importlib, "import_module", without_triton)
  hardware.pallas_triton_reason.cache_clear()
  try:
    assert hardware.pallas_triton_reason() == (f"this JAX ({jax.__version__}) has no Pallas Triton lowering (No module "
                                               "named 'jax._src.lib.triton')")
  finally:
    hardware.pallas_triton_reason.cache_clear()


def test_decode_kernel_asked_for_by_name(monkeypatch):
  """RunConfig.decode_kernel on Hopper: "mosaic" and "triton" reach the pallas backend (its decode_route) and the
  table; refused in one line under another backend, where the Mosaic GPU kernels cannot read the pages, and on
  Ada (whose "auto" attention is cuDNN)."""
  _gpu(monkeypatch, (9, 0))
  for cache in ("bfloat16", "float8_e4m3fn"):
    s = resolve(CFG, RUN.replace(cache_dtype=cache, decode_kernel="mosaic"), check_fit=False)
    assert (s.decode.name, s.attention.decode_route) == ("mosaic", "mosaic")
    assert "decode_kernel='mosaic'" in s.decode.why and "mosaic_gpu.paged" in s.decode.why
  s = resolve(CFG, RUN.replace(decode_kernel="triton"), check_fit=False)
  assert (s.decode.name, s.attention.decode_route) == ("triton", "triton") and "asked for" in s.decode.why
  assert resolve(CFG, RUN, check_fit=False).attention.decode_route == "auto"
  with pytest.raises(ConfigError, match="decode_kernel='mosaic' picks among the pallas backend's decode kernels, "
                                        "and attention='cudnn', which decodes with its own kernel"):
    resolve(CFG, RUN.replace(attention="cudnn", decode_kernel="mosaic"), check_fit=False)
  with pytest.raises(ConfigError, match="decode_kernel='mosaic': .*blocks of 64 tokens; page_size=32"):
    resolve(CFG, RUN.replace(page_size=32, decode_kernel="mosaic"), check_fit=False)
  assert resolve(CFG, RUN.replace(page_size=32, decode_kernel="triton"), check_fit=False).decode.name == "triton"
  with pytest.raises(ConfigError, match="decode_kernel='triton': page size Z=192 must be a power of two"):
    resolve(CFG, RUN.replace(page_size=192, prefill_chunk=1920, decode_kernel="triton"), check_fit=False)
  with pytest.raises(ConfigError, match="decode_kernel='mosaic': .*float16"):
    resolve(CFG, RUN.replace(dtype="float16", cache_dtype="auto", decode_kernel="mosaic"), check_fit=False)
  with pytest.raises(ConfigError, match="decode_kernel='mosaic': .*bfloat16 queries, not float16"):
    resolve(CFG, RUN.replace(dtype="float16", cache_dtype="bfloat16", decode_kernel="mosaic"), check_fit=False)
  # verify steps: draft_tokens + 1 tokens of 8 query heads a kv head (a 70B's grouping) past the kernels' 64 rows
  wide = dataclasses.replace(CFG, n_heads=64, n_kv_heads=8)
  for route in ("mosaic", "triton"):
    spec = RUN.replace(decode_kernel=route, draft="prompt", draft_tokens=8, max_batch=1)
    with pytest.raises(ConfigError, match=f"decode_kernel='{route}': a verify step's 9 tokens x 8 query heads a kv "
                                          "head are 72 rows, past the decode kernels' 64"):
      resolve(wide, spec, check_fit=False)
    assert resolve(wide, spec.replace(draft_tokens=7), check_fit=False).decode.name == route
  monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 9))
  with pytest.raises(ConfigError, match="decode_kernel='triton'.*attention='auto' runs the cudnn backend"):
    resolve(CFG, RUN.replace(decode_kernel="triton"), check_fit=False)
  with pytest.raises(ConfigError, match="decode_kernel='fast' must be one of auto, mosaic, triton"):
    RunConfig(decode_kernel="fast")


def test_a_gathered_fp8_prefix_is_logged(monkeypatch, caplog):
  """FP8 attention over fp8 pages it cannot read in place (pages of 32 tokens): the log says the prefix is gathered
  and why, as a warning on a GPU; over pages it reads in place, nothing."""
  _gpu(monkeypatch, (9, 0))
  for page_size, logged in [(32, True), (64, False)]:
    caplog.clear()
    s = resolve(CFG, RUN.replace(attention_dtype="float8_e4m3fn", page_size=page_size), check_fit=False)
    with caplog.at_level(logging.INFO, logger="lcjax.engine.serving"):
      s.log_slow_paths()
    line = [r for r in caplog.records if "prefill chunks gather their cached prefix" in r.getMessage()]
    assert bool(line) == logged, caplog.text
    if logged:
      assert line[0].levelno == logging.WARNING and "page_size=32 must be" in line[0].getMessage()


def test_prefill_kernel(monkeypatch):
  """RunConfig.prefill_kernel: "auto" takes the Mosaic GPU paged flash kernel on Hopper over bf16 pages and keeps
  cuDNN's paged kernel where it cannot read the pages, saying why (and says what reads the prefix under each
  backend); "mosaic" reaches the pallas backend's prefill_route and the table on Hopper over bf16 pages, and is
  refused in one line for fp8 pages, FP8 attention, another backend (cuDNN: `auto` on GPUs that are not Hopper)
  and page shapes the kernel cannot read."""
  _gpu(monkeypatch, (9, 0))
  bf16 = RUN.replace(cache_dtype="bfloat16")
  s = resolve(CFG, bf16, check_fit=False)
  assert (s.prefill.name, s.attention.prefill_route) == ("mosaic", "mosaic")
  assert "prefill_kernel='auto' on Hopper over bf16 pages" in s.prefill.why
  fp8_pages = resolve(CFG, RUN, check_fit=False)
  assert (fp8_pages.prefill.name, fp8_pages.attention.prefill_route) == ("cudnn", "cudnn")
  assert "dequantized" in fp8_pages.prefill.why
  assert "queries' dtype (bfloat16), not float8_e4m3fn" in fp8_pages.prefill.why
  odd = resolve(CFG, bf16.replace(page_size=192, prefill_chunk=1920), check_fit=False).prefill
  assert odd.name == "cudnn" and "page_size=192 must be a multiple of it" in odd.why
  small = resolve(CFG, bf16.replace(page_size=32), check_fit=False).prefill
  assert small.name == "cudnn" and "pages of 64 tokens or more, which it was timed on; page_size=32" in small.why
  f16 = resolve(CFG, RUN.replace(dtype="float16", cache_dtype="auto"), check_fit=False).prefill
  assert f16.name == "cudnn" and "over bfloat16 pages, which it was timed on, not float16" in f16.why
  fp8_attn = resolve(CFG, RUN.replace(attention_dtype="float8_e4m3fn"), check_fit=False).prefill
  assert fp8_attn.name == "pallas-fp8-in-place" and "fp8 K pages where they lie" in fp8_attn.why
  for run, why in [(RUN.replace(attention_dtype="float8_e4m3fn", page_size=32), "page_size=32 must be"),
                   (RUN.replace(attention_dtype="int8_fp8"), "qk_dtype='int8' multiplies int8 keys"),
                   (bf16.replace(attention_dtype="float8_e4m3fn"), "the pages hold bfloat16")]:
    gathered = resolve(CFG, run, check_fit=False).prefill
    assert gathered.name.endswith("-gather") and "gathered" in gathered.why and why in gathered.why, gathered
  cudnn_s = resolve(CFG, bf16.replace(prefill_kernel="cudnn"), check_fit=False)
  assert (cudnn_s.prefill.name, cudnn_s.attention.prefill_route) == ("cudnn", "cudnn")
  assert "not the Mosaic GPU" not in cudnn_s.prefill.why
  s = resolve(CFG, bf16.replace(prefill_kernel="mosaic"), check_fit=False)
  assert (s.prefill.name, s.attention.prefill_route) == ("mosaic", "mosaic")
  assert "flash_attention_paged" in s.prefill.why and "\n  prefill over pages    mosaic: " in s.table()
  assert "asked for by prefill_kernel='mosaic'" in s.prefill.why
  refusals = {
      "reads pages in the queries' dtype \\(bfloat16\\), not float8_e4m3fn": RUN.replace(prefill_kernel="mosaic"),
      "attention_dtype='float8_e4m3fn' reads the cached prefix with the FP8 flash kernel":
          bf16.replace(prefill_kernel="mosaic", attention_dtype="float8_e4m3fn"),
      "the cudnn backend reads them with its own": bf16.replace(prefill_kernel="mosaic", attention="cudnn"),
      "page_size=192 must be a multiple of it": bf16.replace(prefill_kernel="mosaic", page_size=192,
                                                             prefill_chunk=1920),
  }
  for message, run in refusals.items():
    with pytest.raises(ConfigError, match="prefill_kernel='mosaic'.*" + message):
      resolve(CFG, run, check_fit=False)
  with pytest.raises(ConfigError, match="prefill_kernel='cudnn': attention_dtype='float8_e4m3fn' reads"):
    resolve(CFG, bf16.replace(prefill_kernel="cudnn", attention_dtype="float8_e4m3fn"), check_fit=False)
  assert resolve(CFG, bf16.replace(prefill_kernel="cudnn", attention="cudnn"), check_fit=False).prefill.name == "cudnn"
  with pytest.raises(ConfigError, match="prefill_kernel='cudnn' picks what reads the pages on the pallas and cudnn "
                                        "backends, and the reference backend reads them with its own"):
    resolve(CFG, bf16.replace(prefill_kernel="cudnn", attention="reference"), check_fit=False)
  assert resolve(CFG, bf16.replace(prefill_kernel="mosaic", page_size=32), check_fit=False).prefill.name == "mosaic"
  monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 9))
  with pytest.raises(ConfigError, match="prefill_kernel='mosaic' picks what reads the pages on the pallas and "
                                        "cudnn backends, and the cudnn backend"):
    resolve(CFG, bf16.replace(prefill_kernel="mosaic"), check_fit=False)
  with pytest.raises(ConfigError, match="prefill_kernel='fast' must be one of auto, cudnn, mosaic"):
    RunConfig(prefill_kernel="fast")
  monkeypatch.setattr(hardware, "compute_capability", lambda: (10, 0))        # Blackwell: no wgmma
  from lcjax.ops.pallas_backend import PallasBackend
  assert resolve(CFG, bf16, check_fit=False).attention.name == "cudnn"
  assert "wgmma needs a Hopper GPU (sm_90), got compute capability (10, 0)" in PallasBackend().why_not(
      head_dim=128, dtype="bfloat16")


def test_on_ada(monkeypatch):
  _gpu(monkeypatch, (8, 9))
  s = resolve(CFG, RUN, check_fit=False)
  # cuDNN's paged decode reads no fp8 pages: its fp8 decode rows run the Triton fp8 decode kernel.
  assert _kernels(s) == dict(attention="cudnn", decode="triton", linear="pallas", page_write="pallas")
  assert "Hopper" in s.linear.why and "cudnn backend reads no fp8 pages" in s.decode.why
  assert "not mosaic: the Mosaic GPU fp8 page writer needs a Hopper GPU" in s.page_write.why
  assert s.attention.fp8_decode.name == "triton"
  # Pages the Triton kernel cannot read: the jnp reference, and the table says why.
  odd = resolve(CFG, RUN.replace(page_size=192, prefill_chunk=1920), check_fit=False)
  assert odd.decode.name == "reference" and odd.attention.fp8_decode is None
  assert "slow: a decode row over fp8 pages, and page size Z=192 must be a power of two" in odd.decode.why
  monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 0))          # Ampere: no fp8 conversion
  assert "compute capability 8.9 or later" in resolve(CFG, RUN, check_fit=False).decode.why
  monkeypatch.setattr(hardware, "compute_capability", lambda: (8, 9))
  bf16 = resolve(CFG, RUN.replace(cache_dtype="bfloat16"), check_fit=False)
  assert bf16.decode.name == "cudnn" and bf16.page_write.name == "xla" and bf16.attention.fp8_decode is None
  with pytest.raises(ConfigError, match="linear_kernel='mosaic'.*Hopper"):
    resolve(CFG, RUN.replace(linear_kernel="mosaic"), check_fit=False)
  with pytest.raises(ConfigError, match="attention_dtype=float8_e4m3fn cannot run here"):
    resolve(CFG, RUN.replace(attention_dtype="float8_e4m3fn"), check_fit=False)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")
def test_on_a_hopper_mesh(monkeypatch):
  _gpu(monkeypatch, (9, 0))
  _jax_0_11(monkeypatch)
  s = resolve(CFG, RUN.replace(seq=2, tensor=4), check_fit=False)
  assert dict(s.mesh.shape) == {"seq": 2, "tensor": 4} and s.kv_rep == 1
  assert _kernels(s) == dict(attention="pallas", decode="mosaic", linear="mosaic", page_write="mosaic")
  bf16 = resolve(CFG, RUN.replace(seq=2, tensor=4, cache_dtype="bfloat16"), check_fit=False)
  assert (bf16.prefill.name, bf16.decode.name) == ("mosaic", "mosaic")
  assert s.limits.shards == 2 and s.plan.num_pages == s.limits.pages_per_shard * 2


def test_kernel_names_are_defined_once():
  """RunConfig's choices are lcjax.config's kernel names and "auto"; lcjax.ops.kernels holds one object for each
  name but "xla", which is None."""
  assert config.LINEAR_KERNELS == ("auto", *config.GEMV_NAMES)
  assert config.PAGE_WRITES == ("auto", *config.PAGE_WRITER_NAMES)
  assert ("xla", *kernels.GEMV_KERNELS) == config.GEMV_NAMES
  assert ("xla", *kernels.PAGE_WRITERS) == config.PAGE_WRITER_NAMES
  assert kernels.gemv_kernel("xla") is None and kernels.page_writer("xla") is None
  assert [kernels.gemv_kernel(n).name for n in config.GEMV_NAMES[1:]] == list(config.GEMV_NAMES[1:])
  assert [kernels.page_writer(n).name for n in config.PAGE_WRITER_NAMES[1:]] == list(config.PAGE_WRITER_NAMES[1:])
  with pytest.raises(ValueError, match="gemv_kernel='fast' must be one of xla, mosaic, pallas, pallas-interpret"):
    kernels.gemv_kernel("fast")


def test_speculation_over_fp8_weights_stays_within_the_decode_product():
  with pytest.raises(ConfigError, match=r"draft_tokens=8 with max_batch=8 feeds 72 rows .* past the 64 rows"):
    resolve(CFG, RUN.replace(draft="prompt", draft_tokens=8, max_batch=8), check_fit=False)
  assert resolve(CFG, RUN.replace(draft="prompt", draft_tokens=7, max_batch=8), check_fit=False).draft.name == "prompt"
  assert resolve(CFG, RUN.replace(draft="prompt", draft_tokens=8, max_batch=8, weight_dtype="auto"),
                 check_fit=False).draft.name == "prompt"           # bf16 weights: one product at any row count
