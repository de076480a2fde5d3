"""Planted bugs the tests must catch: each mutant edits one line of a temporary copy of the repository's package
and runs the tests that name the invariant it breaks; every one of those tests must fail.

  python tools/mutation_check.py                 # every mutant
  python tools/mutation_check.py NAME [NAME...]  # some of them
  python tools/mutation_check.py --list          # names, bugs and tests

A mutant whose tests pass "survived": those tests no longer check what they name (exit status 1). A mutant whose
`old` text is not exactly once in its file, or whose tests do not run (pytest exit status other than 0 or 1, e.g.
a test id that no longer exists), is an error (exit status 2): the code or the tests moved, and the mutant must
be updated to plant the same bug in the new code. tests/test_mutations.py runs every mutant (marked slow: .ci/run
runs it) and checks on every run that each mutant's text is still in its file.

Adding an invariant (or a test for one that had none)? Add a Mutant to MUTANTS below: the smallest edit that
breaks the invariant the way a real bug would (a bound off by one, an index from the wrong base, a term left out),
`old` exactly once in `path` (take a line or two of context to make it unique), and the ids of the tests that
name the invariant, cheapest first; each of them must fail with the bug. Run `python tools/mutation_check.py
NAME` (it must say "caught"), then the tests without it (they pass). Keep the tests of a mutant few and fast: each
mutant is a pytest process of its own, and CI runs them all.

Each run copies lcjax/, tests/, configs/ and pyproject.toml into a temporary directory, plants the bug there,
checks that the copy is what `import lcjax` finds, and runs pytest on the CPU with that directory as the root.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("lcjax", "tests", "configs", "pyproject.toml")


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  bug: str                   # what the edit breaks, in words
  path: str                  # the file edited, relative to the repository root
  old: str                   # text found exactly once in `path` ...
  new: str                   # ... and what replaces it
  tests: tuple[str, ...]     # pytest ids (file::test[params]) of tests that name the invariant: each must fail


MUTANTS = (
    Mutant("paged-reference-skips-key-0",
           "the paged jnp reference never attends to a sequence's first key (position 0)",
           "lcjax/ops/attention.py",
           "    valid = j[None, :] < kv_len[:, None]\n    kb, vb = load(",
           "    valid = (j[None, :] < kv_len[:, None]) & (j[None, :] > 0)\n    kb, vb = load(",
           ("tests/test_engine.py::test_prefill_logits_match_full_forward",
            "tests/test_context.py::test_second_question_reuses_the_document[inside-a-page]")),
    Mutant("context-load-writes-blocks-from-page-0",
           "a context block starting at page s > 0 is written into the pages from the context's first one",
           "lcjax/engine/context_mover.py",
           "      target[i] = pages[s + i]",
           "      target[i] = pages[i]",
           ("tests/test_context.py::test_a_context_moves_in_blocks_onto_pages_the_prefix_cache_holds[float32]",)),
    Mutant("hash-chain-drops-last-token",
           "a page's prefix-cache key leaves out the page's last token",
           "lcjax/cache/prefix.py",
           "ids[m * page_size:(m + 1) * page_size].tobytes()",
           "ids[m * page_size:(m + 1) * page_size - 1].tobytes()",
           ("tests/test_prefix_cache.py::test_keys_chain_and_salt",)),
    Mutant("context-gather-drops-v-scale",
           "fp8 pages leave the device (offload, save) with K's scales in place of V's",
           "lcjax/engine/context_mover.py",
           "*(s[..., ::rep] for s in scales))",
           "*(scales[0][..., ::rep] for s in scales))",
           ("tests/test_context.py::test_a_context_moves_in_blocks_onto_pages_the_prefix_cache_holds[fp8]",)),
    Mutant("context-save-scales-at-page-0",
           "a save writes each block's fp8 scales at the context's first pages (right only for one block a layer)",
           "lcjax/engine/context_file.py",
           "scales[l, :, s:s + len(parts[0])] = parts[2:]",
           "scales[l, :, :len(parts[0])] = parts[2:]",
           ("tests/test_context.py::test_a_context_moves_in_blocks_onto_pages_the_prefix_cache_holds[fp8]",)),
    Mutant("fp8-checkpoint-scales-on-the-wrong-axis",
           "an fp8 checkpoint's per-channel scales of a (head, dim) output (q, k, v) are laid out with the head "
           "axis varying fastest: each scale lands on another channel's row",
           "lcjax/checkpoint/hf.py",
           "  return np.ascontiguousarray(s.reshape((1,) * in_dims + out))",
           "  return np.ascontiguousarray(s.reshape((1,) * in_dims + out, order=\"F\"))",
           ("tests/test_fp8_weights.py::test_per_channel_scales_stay_on_their_channels",)),
    Mutant("gemv-reference-quantizes-x",
           "the GEMV kernels' float32 reference quantizes x to e4m3 (the prefill product) instead of widening the "
           "weight, so the kernel tests compare against another product",
           "lcjax/ops/linear.py",
           'dense_reference(x, w, s, spec, path="widened")',
           'dense_reference(x, w, s, spec, path="fp8")',
           ("tests/test_fp8_gemv.py::test_reference_is_the_widened_product",)),
    Mutant("warm-up-compiles-the-whole-length-bucket",
           "warm-up compiles every chunk of a prompt at the padded length of its first, not each at its own: a "
           "prompt longer than a chunk then compiles its last chunk's program in the call",
           "lcjax/engine/scheduler.py",
           "{(chunk_bucket(min(chunk, n - c0), chunk),",
           "{(chunk_bucket(min(chunk, n), chunk),",
           ("tests/test_engine.py::test_warm_up_compiles_what_generate_then_uses[greedy]",
            "tests/test_cli.py::test_warm_up_leaves_nothing_to_compile[context]")),
    Mutant("first-chunk-reads-the-whole-table",
           "a prompt's first chunk gets the whole page table, so its program reads a prefix over the table's keys "
           "(sized by max_context) where nothing is cached",
           "lcjax/engine/scheduler.py",
           "tables[c0 > 0]",
           "tables[True]",
           ("tests/test_engine.py::test_a_first_chunk_reads_no_prefix",)),
    Mutant("chat-context-separator-one-newline",
           "a question continues a chat context after one newline, not the blank line of the cold chat of "
           "document + \"\\n\\n\" + question",
           "lcjax/tokenizer.py",
           'CHAT_SEPARATOR = "\\n\\n"',
           'CHAT_SEPARATOR = "\\n"',
           ("tests/test_chat_context.py::test_the_split_holds_back_what_a_question_could_merge",
            "tests/test_chat_context.py::test_chat_context_tokens_are_the_cold_chat[a sentence]")),
    Mutant("context-load-writes-shared-pages",
           "a load writes its saved pages into the pages it shares from the prefix cache too: a damaged load "
           "(NaN pages, written as zeros) wipes the K/V of the open context that holds them",
           "lcjax/engine/context_mover.py",
           "    for i in range(max(0, first - s), min(b, n - s)):",
           "    for i in range(min(b, n - s)):",
           ("tests/test_context.py::test_a_damaged_load_onto_shared_pages_leaves_their_context_as_it_was[nan-pages]",)),
    Mutant("decode-samples-from-nonfinite-logits",
           "a decode step samples from logits that hold NaN (argmax: token 0) instead of stopping the request with "
           "finish_reason 'nonfinite': a silent wrong answer",
           "lcjax/engine/steps.py",
           "      bad = live & ~finite(logits[:, 0])",
           "      bad = live & False",
           ("tests/test_speculate.py::test_nonfinite_logits_stop_the_request_and_say_so[off]",)),
    Mutant("gemv-split-reads-unrounded-x",
           "the Mosaic GEMV's band split widens bf16 x with a plain cast, which XLA's GPU compiler may drop: values "
           "just below 1/4 kept in float32 go to the lo band and overflow float16 (NaN logits on an H100)",
           "lcjax/ops/mosaic_gpu/gemv.py",
           "  xf = precision.widen(x2)",
           "  xf = x2.astype(jnp.float32)",
           ("tests/test_precision.py::test_gemv_splits_read_bf16_x_through_widen",)),
    Mutant("fp8-page-write-quantizes-unrounded-k",
           "XLA's fp8 page write widens K with a plain cast: under excess precision it quantizes other values than "
           "the page-writer kernels, whose pages then differ from XLA's",
           "lcjax/cache/kv.py",
           "  x = precision.widen(x)                                            # the model dtype's values",
           "  x = x.astype(jnp.float32)                                         # the model dtype's values",
           ("tests/test_precision.py::test_fp8_page_writes_read_bf16_k_through_widen",)),
    Mutant("cudnn-fp8-decode-reads-v-scales-for-k",
           "the cuDNN backend's fp8 decode kernel (the Triton kernel off Hopper) is handed V's page scales for K",
           "lcjax/ops/cudnn/backend.py",
           "      return self.fp8_decode(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kvl, k_scale=k_scale,",
           "      return self.fp8_decode(q, k_pages, v_pages, page_table, q_pos=q_pos, kv_len=kvl, k_scale=v_scale,",
           ("tests/test_fp8_decode.py::test_cudnn_backend_decodes_fp8_pages_with_its_fp8_decode_kernel[True]",)),
    Mutant("paged-flash-prefill-masks-from-kv-len",
           "the paged flash prefill masks a chunk's rows by kv_len instead of the first row's position: every row "
           "sees the chunk's later keys",
           "lcjax/ops/pallas_backend.py",
           "    d = q_pos[:, 0]\n",
           "    d = kvl\n",
           ("tests/test_kernels.py::test_pallas_backend_prefill_route_mosaic[split]",)),
    Mutant("paged-flash-prefill-calls-rows-past-by-the-first",
           "a sequence's rows in any order count as past every key when the first row is, though an earlier row "
           "still precedes some keys: under the paged flash prefill that row sees keys after it",
           "lcjax/ops/cudnn/backend.py",
           "  return (kvl <= qmin + 1) & (qmin >= 0)",
           "  return (kvl <= q_pos[:, 0] + 1) & (q_pos[:, 0] >= 0)",
           ("tests/test_kernels.py::test_pallas_backend_prefill_route_mosaic[unordered-partial]",)),
    Mutant("paged-flash-copies-page-from-the-wrong-row",
           "the paged flash kernel's load of a block that is part of a page starts at the page's first row: every "
           "second block of 128 keys in a 256-key page reads the first 128 again",
           "lcjax/ops/mosaic_gpu/flash.py",
           "    return [(i * block_kv // Z, i * block_kv % Z, block_kv, 0)]",
           "    return [(i * block_kv // Z, 0, block_kv, 0)]",
           ("tests/test_kernels.py::test_paged_flash_block_copies_load_each_blocks_keys[128]",)),
    Mutant("hopper-fp8-decode-joins-splits-in-triton",
           "decode rows over fp8 pages on Hopper join their splits with Triton's combine: a default path lowers "
           "through the deprecated Pallas Triton backend again",
           "lcjax/ops/pallas_backend.py",
           "                                             tuning=MOSAIC_FP8_DECODE)\n",
           "                                             tuning=mgpu_paged.DecodeTuning(combine=\"triton\"))\n",
           ("tests/test_fp8_decode.py::test_decode_route_sends_decode_rows_to_its_kernel[float8_e4m3fn-auto]",)),
    Mutant("prefix-read-told-one-real-row-too-few",
           "a padded chunk tells its prefix read one real row fewer than it has: a kernel that leaves padding out "
           "leaves out the last real row's attention to the cached prefix",
           "lcjax/model/llama.py",
           "kv_len=step.prefix_len, q_len=step.lengths,\n",
           "kv_len=step.prefix_len, q_len=step.lengths - 1,\n",
           ("tests/test_model.py::test_a_padded_chunk_tells_the_prefix_read_its_real_rows",)),
    Mutant("flash-cta-loads-a-padding-warpgroups-blocks",
           "a flash CTA whose second warpgroup is all padding still loads that warpgroup's (longer causal) range: "
           "blocks no warpgroup waits for, TMA copies that can outlive the CTA",
           "lcjax/ops/mosaic_gpu/flash.py",
           "    need = jnp.where(tile_base + bq < q_len, need, jnp.where(tile_base < q_len, first, 0))",
           "    need = jnp.where(tile_base < q_len, need, 0)",
           ("tests/test_kernels.py::test_flash_schedule_loads_what_its_warpgroups_compute",)),
    Mutant("flash-split-merge-unnormalised",
           "the merge of a stack of attention partials (the flash kernel's key splits) weighs them by exp(lse - max) "
           "without dividing by their sum",
           "lcjax/ops/attention.py",
           "  merged = jnp.sum(out.astype(jnp.float32) * jnp.exp(lse - safe)[..., None], axis=0)",
           "  merged = jnp.sum(out.astype(jnp.float32) * jnp.exp(lse - jnp.max(lse, axis=0))[..., None], axis=0)",
           ("tests/test_kernels.py::test_merge_splits_is_attention_over_every_key[2]",)),
    Mutant("fp8-page-scales-count-pages-past-kv-len",
           "the largest V scale of a key block read in place counts the pages past kv_len (another owner's), so "
           "the block's live P underflows e4m3",
           "lcjax/ops/fp8.py",
           "  vs = grouped(jnp.where(live, v_scale[pages].astype(jnp.float32), 0.0))",
           "  vs = grouped(v_scale[pages].astype(jnp.float32))",
           ("tests/test_fp8.py::test_paged_scales_model_is_attention_over_the_dequantized_pages[64]",)),
    Mutant("fp8-paged-accumulator-keeps-its-units",
           "the FP8 model over pages read in place does not rescale its accumulator when the block's largest V "
           "scale changes",
           "lcjax/ops/fp8.py",
           "    rescale = alpha * (ref_v / v_max)[:, :, None, None, None]",
           "    rescale = alpha",
           ("tests/test_fp8.py::test_paged_scales_model_is_attention_over_the_dequantized_pages[128]",)),
    Mutant("v-words-swap-two-byte-picks",
           "the in-place FP8 read's V copy swaps bytes 1 and 2 of each output word t (keys 2t + 1 and 8 + 2t of "
           "a 16-key group), so P V pairs those probabilities with the wrong values",
           "lcjax/ops/mosaic_gpu/flash.py",
           "    return (byte(0, 0) | (byte(0, 1) << jnp.uint32(8)) | (byte(1, 0) << jnp.uint32(16))",
           "    return (byte(0, 0) | (byte(1, 0) << jnp.uint32(8)) | (byte(0, 1) << jnp.uint32(16))",
           ("tests/test_fp8.py::test_v_operand_of_pages_is_v_operand_of_the_gathered_keys[64]",)),
    Mutant("chunk-prefix-read-promised-for-positions-given",
           "the model promises the backends that a chunk's cached prefix precedes its rows even when the caller "
           "passed the positions, so rows placed before the prefix's end see keys after them",
           "lcjax/model/llama.py",
           "q_len=step.lengths,\n                                     past=step.built)",
           "q_len=step.lengths,\n                                     past=True)",
           ("tests/test_model.py::test_a_chunk_at_the_positions_the_model_builds_has_no_device_side_choice"
            "[cudnn-bfloat16]",)),
    Mutant("chunk-prefix-read-checks-positions-on-the-device",
           "the model's prefill chunk at positions it built reads its cached prefix without promising that the "
           "prefix precedes its rows, so the backends choose their path by a lax.cond (a GPU waits for its queue)",
           "lcjax/model/llama.py",
           "q_len=step.lengths,\n                                     past=step.built)",
           "q_len=step.lengths,\n                                     past=False)",
           ("tests/test_model.py::test_a_chunk_at_the_positions_the_model_builds_has_no_device_side_choice"
            "[pallas-fp8-float8_e4m3fn]",)),
    Mutant("fp8-prefill-scales-values-past-kv-len",
           "FP8 prefill attention takes V's per-head scale over the values past kv_len too (stale slots of reused "
           "pages, a chunk's own keys past its prefix), which set the quantization step of every visible value",
           "lcjax/ops/mosaic_gpu/flash.py",
           "  k, v = jnp.where(valid, k, 0), jnp.where(valid, v, 0)\n",
           "  k = jnp.where(valid, k, 0)\n",
           ("tests/test_fp8.py::test_keys_past_kv_len_change_nothing[int8]",
            "tests/test_fp8.py::test_engine_fp8_prefix_read_ignores_what_earlier_requests_left_in_the_pages")),
    Mutant("reference-reads-a-nan-row-as-empty",
           "the jnp reference attention takes a row whose softmax sum is NaN (a NaN or inf score) for one that saw "
           "no key: out 0 and lse -inf, so an overflowed K leaves attention out instead of stopping the request",
           "lcjax/ops/attention.py",
           "  empty = l == 0\n",
           "  empty = ~(l > 0)\n",
           ("tests/test_engine.py::test_an_overflowed_key_stops_the_request_in_every_cache[float32-auto]",
            "tests/test_fp8.py::test_a_nonfinite_key_reaches_every_row_that_sees_it")),
)


class MutantError(Exception):
  """A mutant that cannot be planted or whose tests did not run; the message says which and why."""


@dataclasses.dataclass
class Outcome:
  mutant: Mutant
  caught: bool
  failed: dict[str, str]     # the listed tests that failed: {pytest's id: its one-line reason}
  passed: list[str]          # the listed tests that did not fail
  seconds: float
  output: str                # pytest's output tail


def plant(root: str, m: Mutant) -> None:
  """Apply `m` to the copy of the repository at `root`."""
  path = os.path.join(root, m.path)
  text = check_text(m, root)
  with open(path, "w") as f:
    f.write(text.replace(m.old, m.new))


def check_text(m: Mutant, repo: str = REPO) -> str:
  """The text of `m`'s file in `repo`; MutantError unless `m.old` is exactly once in it (the mutant applies)."""
  with open(os.path.join(repo, m.path)) as f:
    text = f.read()
  n = text.count(m.old)
  if n != 1:
    raise MutantError(f"mutant {m.name}: its text is {n} times in {m.path}, not once: plant the same bug in the "
                      f"code as it is now ({m.old!r})")
  return text


def _copy(repo: str, root: str) -> None:
  for name in COPIED:
    src, dst = os.path.join(repo, name), os.path.join(root, name)
    if os.path.isdir(src):
      shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
      shutil.copy2(src, dst)


def _failures(output: str) -> dict[str, str]:
  """{test id: pytest's one-line reason} of the FAILED lines of pytest's -rf summary (parameters may hold spaces)."""
  return {m[1]: m[2] for m in re.finditer(r"^FAILED (\S+?(?:\[[^\]]*\])?)(?: - (.*))?$", output, flags=re.M)}


def _fails(test: str, failed) -> bool:
  """Whether the listed id `test` failed (an id without parameters: any of its parametrizations)."""
  return any(f == test or f.startswith(test + "[") for f in failed)


def python(argv: list[str], *, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
  """`run`'s default way to run a Python command line (`python -c ...`, `python -m pytest ...`): a fresh
  interpreter whose first sys.path entry is `cwd` (the copy), its output captured as text."""
  return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run(m: Mutant, repo: str = REPO, timeout: float = 900, spawn=python) -> Outcome:
  """Plant `m` in a copy of `repo` and run its tests there. spawn(argv, env=, cwd=, timeout=) runs the Python
  command lines (`python`'s contract: the copy first on sys.path; tests/test_mutations.py forks them from a server
  that has imported jax). The copy is found as the job's first sys.path entry, not through PYTHONPATH: a process a
  mutant's test starts must put the copy on its own path (the tests' helpers name their REPO, the copy)."""
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f"lcjax-mutant-{m.name}-") as root:
    _copy(repo, root)
    plant(root, m)
    env = dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="240")   # wide: -rf's reasons
    where = spawn([sys.executable, "-c", "import lcjax; print(lcjax.__file__)"], env=env, cwd=root, timeout=120)
    if where.returncode or not os.path.realpath(where.stdout.strip()).startswith(os.path.realpath(root)):
      raise MutantError(f"mutant {m.name}: `import lcjax` in the copy finds {where.stdout.strip() or where.stderr}, "
                        f"not {root}/lcjax")
    p = spawn([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *m.tests], env=env, cwd=root,
              timeout=timeout)
  output = (p.stdout + p.stderr)[-4000:]
  if p.returncode not in (0, 1):
    raise MutantError(f"mutant {m.name}: pytest exited with status {p.returncode} (its tests did not run: a test "
                      f"id that no longer exists?):\n{output}")
  failed = _failures(p.stdout)
  hit = {f: why for f, why in failed.items() if any(_fails(t, [f]) for t in m.tests)}
  missed = [t for t in m.tests if not _fails(t, failed)]
  return Outcome(m, caught=not missed, failed=hit, passed=missed, seconds=time.perf_counter() - t0, output=output)


def main(argv: list[str]) -> int:
  if "--list" in argv:
    for m in MUTANTS:
      print(f"{m.name}: {m.bug} ({m.path})")
      for t in m.tests:
        print(f"  {t}")
    return 0
  by_name = {m.name: m for m in MUTANTS}
  unknown = [a for a in argv if a not in by_name]
  if unknown:
    print(f"unknown mutant(s) {unknown}; known: {sorted(by_name)}", file=sys.stderr)
    return 2
  status = 0
  for m in [by_name[a] for a in argv] or MUTANTS:
    try:
      out = run(m)
    except MutantError as e:
      print(f"ERROR     {e}", flush=True)
      status = 2
      continue
    if out.caught:
      print(f"caught    {m.name} ({out.seconds:.0f} s): {m.bug}", flush=True)
      for test, why in out.failed.items():
        print(f"  failed  {test}: {(why or '')[:200]}", flush=True)
    else:
      print(f"SURVIVED  {m.name} ({out.seconds:.0f} s): {m.bug}; these tests passed with it: {out.passed}\n"
            f"{out.output}", flush=True)
      status = max(status, 1)
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
