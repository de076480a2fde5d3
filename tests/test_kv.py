"""fp8 page scales set by the writes (lcjax.cache.kv) against a numpy oracle, through XLA and through the page-write
kernel (lcjax.ops.triton.page_write, in the Pallas interpreter: the page writer
`lcjax.ops.kernels.page_writer("pallas-interpret")`, `kernel="pallas-interpret"` here).

Oracle: after any sequence of writes, a page's scale is the smallest power of two >= (max |x| over the tokens its
sequence wrote into it) / 448, and every stored token dequantizes to its float value within e4m3's rounding (no
clipping). Whatever the split of a sequence into calls (token by token as decode writes, chunks as prefill writes,
or both), the stored values are the same wherever they are e4m3 normals.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcjax.cache import kv as kvc
from lcjax.ops import kernels

L, P, Z, K, H = 2, 10, 4, 2, 8
LAYER = 1
RNG = np.random.default_rng(0)


def _tokens(n, rng, big=()):
  x = rng.normal(size=(n, K, H)).astype(np.float32)
  for t, f in big:
    x[t] *= f
  return x


# Two sequences written side by side: (page table, K or V values).
SEQS = [([3, 6, 1], _tokens(11, RNG, big=[(6, 10.0), (9, 0.01)])),     # token 6 in page 6 is 10x the others
        ([2, 5, 7], _tokens(9, RNG, big=[(1, 30.0)]))]
SCHEDULES = {"one-call": [11], "decode": [1] * 11, "chunks": [4, 4, 3], "unaligned": [3, 5, 3],
             "mixed": [5, 1, 1, 4], "chunk-then-decode": [6] + [1] * 5}


def _empty():
  return kvc.init_cache(L, P, Z, K, H, "float8_e4m3fn")


@functools.partial(jax.jit, static_argnames="kernel")
def _write(cache, x, slots, kernel="xla"):
  """Write x [B, T, K, H] at slots [B, T] into layer LAYER of K (and -x into V); `kernel`: the name of write_kv's
  page writer, for decode calls (T = 1)."""
  pages = kvc.written_pages(slots, Z)
  return kvc.PagedKV(*kvc.write_kv(cache.k, cache.v, cache.k_scale, cache.v_scale, x, -x, slots, pages, LAYER,
                                   page_writer=kernels.page_writer(kernel)))


def _call(seqs, start: list[int], count: list[int], T: int, pad_value=100.0):
  """One call's x [B, T, K, H] and slots [B, T]: row b holds tokens start[b] .. start[b] + count[b] - 1 of its
  sequence, padded (slot 0: the null page) with large values."""
  x = np.full((len(seqs), T, K, H), pad_value, np.float32)
  slots = np.zeros((len(seqs), T), np.int32)
  for b, ((table, vals), s, c) in enumerate(zip(seqs, start, count)):
    pos = np.arange(s, s + c)
    x[b, :c] = vals[pos]
    slots[b, :c] = np.asarray(table)[pos // Z] * Z + pos % Z
  return jnp.asarray(x), jnp.asarray(slots)


def _run(cache, seqs, schedule, kernel="xla"):
  """Write every sequence by the chunk sizes of `schedule` (a row past its sequence's end is all padding)."""
  pos = 0
  for c in schedule:
    T = max(4, 1 << (c - 1).bit_length()) if c > 1 else 1      # chunk calls padded like the engine's buckets
    counts = [max(0, min(c, len(vals) - pos)) for _, vals in seqs]
    cache = _write(cache, *_call(seqs, [pos] * len(seqs), counts, T), kernel=kernel)
    pos += c
  return cache


def _oracle_scale(x):
  """The smallest power of two >= max |x| / 448 over tokens x [n, K, H]: [K]."""
  return 2.0 ** np.ceil(np.log2(np.abs(x).max(axis=(0, 2)).astype(np.float64) / 448.0))


def _check_against_oracle(cache, seqs, sign=1.0, pool="k"):
  """Each page of `pool` holds its tokens (K: as fp8 pools hold keys, rotated by kvc.fp8_basis) at the oracle's
  scale, within e4m3's rounding."""
  arr, scales = (np.asarray(getattr(cache, pool)), np.asarray(getattr(cache, pool + "_scale")))
  for table, vals in seqs:
    vals = sign * vals
    if pool == "k":
      vals = np.asarray(kvc.fp8_basis(jnp.asarray(vals, jnp.float32)))
    for j, page in enumerate(table):
      tok = vals[j * Z:(j + 1) * Z]
      want = _oracle_scale(tok)
      np.testing.assert_array_equal(scales[LAYER, page], want)
      deq = arr[LAYER, page, :len(tok)].astype(np.float32) * scales[LAYER, page][None, :, None]
      s = want[None, :, None]
      # e4m3: half an ulp (2^-4 relative) for normals; subnormals step 2^-9 * scale.
      assert np.all(np.abs(deq - tok) <= 2.0 ** -4 * np.abs(tok) + 2.0 ** -9 * s), (page, deq, tok)
  assert not np.any(np.asarray(arr[1 - LAYER], np.float32)) and not np.any(scales[1 - LAYER])


@pytest.mark.parametrize("schedule,kernel", [(s, "xla") for s in SCHEDULES]
                         + [(s, "pallas-interpret") for s in ("decode", "mixed", "chunk-then-decode")])
def test_scales_follow_the_tokens_whatever_the_write_pattern(schedule, kernel):
  cache = _run(_empty(), SEQS, SCHEDULES[schedule], kernel)
  _check_against_oracle(cache, SEQS)
  _check_against_oracle(cache, SEQS, -1.0, "v")
  # The 10x token (page 6) would be clipped at the scale of the page's earlier tokens: the oracle check above
  # shows it was not (the scale rose and the earlier tokens were requantized to it).
  vals = SEQS[0][1]
  assert np.all(np.abs(vals[6]).max(axis=-1) > 448 * _oracle_scale(vals[4:6]))
  # The padding (slot 0, large values) reached nothing: the null page and its scales are still zero.
  for part in cache.parts():
    assert not np.any(np.asarray(part[:, 0], np.float32)), "a padded token was written into the null page"
  # Normal e4m3 values are stored bit for bit as one call stores them: power-of-two scales requantize exactly.
  one = _run(_empty(), SEQS, SCHEDULES["one-call"])
  for (table, vals) in SEQS:
    got, want = (np.asarray(c.k)[LAYER, table].astype(np.float32) for c in (cache, one))
    normal = np.abs(want) >= 2.0 ** -6
    np.testing.assert_array_equal(got[normal], want[normal])
    np.testing.assert_array_equal(np.asarray(cache.k_scale)[LAYER, table], np.asarray(one.k_scale)[LAYER, table])


@pytest.mark.parametrize("kernel", ["xla", "pallas-interpret"])
def test_a_reused_page_starts_from_its_new_tokens_scale(kernel):
  """A page freed by one sequence and handed to another: the first write at offset 0 drops the old owner's much
  larger scale (kept, it would push the new tokens into e4m3's subnormals)."""
  rng = np.random.default_rng(1)
  old = [([1, 2], _tokens(6, rng) * 1000.0)]
  cache = _run(_empty(), old, [6])
  assert np.asarray(cache.k_scale)[LAYER, 2].min() > 1.0
  new = [([2, 4], _tokens(7, rng))]
  for schedule in ([7], [1] * 7, [2, 5]):
    got = _run(cache, new, schedule, kernel)
    _check_against_oracle(got, new)
  # Copy-on-write of the new sequence's partly filled last page (4: 3 tokens), then the copy grows on its own.
  cache = kvc.copy_pages(got, jnp.asarray([4]), jnp.asarray([5]))
  for part in cache.parts():
    np.testing.assert_array_equal(np.asarray(part)[:, 5], np.asarray(part)[:, 4])
  tail = _tokens(8, rng, big=[(7, 20.0)])
  tail[:7] = new[0][1]
  fork = [([2, 5], tail)]
  cache = _write(cache, *_call(fork, [7], [1], 1), kernel=kernel)
  _check_against_oracle(cache, fork)
  _check_against_oracle(cache, [([4], new[0][1][4:])])          # the original page is untouched


@pytest.mark.parametrize("schedule,kernel", [("unaligned", "xla"), ("chunk-then-decode", "xla"),
                                             ("chunk-then-decode", "pallas-interpret")])
def test_a_seq_shard_writes_its_own_pages_as_one_pool_does(schedule, kernel):
  """write_kv on each of 2 shards (pages split in halves) == on the whole pool, for chunks and for decode's one
  token per row (its own write path, and the kernel's), the shard index traced as inside shard_map."""
  S, Pl = 2, P // 2
  whole = _run(_empty(), SEQS, SCHEDULES[schedule])

  @jax.jit
  def write(parts, x, slots):
    pages = kvc.written_pages(slots, Z)
    out = []
    for d in range(S):
      k, v, ks, vs = (p[:, d * Pl:(d + 1) * Pl] for p in parts)
      out.append(kvc.write_kv(k, v, ks, vs, x, -x, slots, pages, LAYER, shard=jnp.int32(d) + 0 * slots[0, 0],
                              page_writer=kernels.page_writer(kernel)))
    return tuple(jnp.concatenate(a, axis=1) for a in zip(*out))

  parts = (_empty().k, _empty().v, _empty().k_scale, _empty().v_scale)
  pos = 0
  for c in SCHEDULES[schedule]:
    counts = [max(0, min(c, len(vals) - pos)) for _, vals in SEQS]
    parts = write(parts, *_call(SEQS, [pos] * 2, counts, max(4, 1 << (c - 1).bit_length()) if c > 1 else 1))
    pos += c
  for got, want in zip(parts, (whole.k, whole.v, whole.k_scale, whole.v_scale)):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_the_kernel_writes_what_xla_writes_bit_for_bit():
  """Decode through the kernel and through XLA from the same chunked start: every real page's bytes and scales
  equal (page 0, the null page, takes the padding rows of both, in whatever order)."""
  for schedule in ("decode", "chunk-then-decode"):
    a, b = (_run(_empty(), SEQS, SCHEDULES[schedule], kernel) for kernel in ("xla", "pallas-interpret"))
    for x, y in zip(a.parts(), b.parts()):
      np.testing.assert_array_equal(np.asarray(x)[:, 1:].view(np.uint8), np.asarray(y)[:, 1:].view(np.uint8))
  with pytest.raises(ValueError, match="page_writer='fast' must be one of xla, pallas, mosaic, pallas-interpret"):
    _write(_empty(), *_call(SEQS, [0, 0], [1, 1], 1), kernel="fast")


@pytest.mark.parametrize("seq", [1, 2])
def test_zero_pages_zeroes_those_pages_only(seq):
  """zero_pages (a stopped request's own pages, Scheduler._scrub): the pages named lose values and scales in every
  layer, the others and the null page keep theirs; on a pool sharded over a `seq` mesh axis as on one device."""
  from lcjax.sharding import make_mesh
  mesh = make_mesh(tensor=1, seq=seq) if seq > 1 else None
  cache = _run(_empty(), SEQS, [11])
  want = [np.array(x, np.float32) for x in cache.parts()]
  if mesh is not None:
    cache = jax.device_put(cache, kvc.cache_shardings(mesh, True))
  idx = [3, 7, 0, 0]                                   # padded with the null page, which is not zeroed
  got = jax.jit(kvc.zero_pages)(cache, jnp.asarray(idx, jnp.int32))
  for g, w in zip(got.parts(), want):
    w[:, [3, 7]] = 0
    np.testing.assert_array_equal(np.asarray(g, np.float32), w)
  assert np.asarray(cache.k_scale)[:, [3, 7]].any()    # the case writes those pages


def test_pages_move_with_their_scales():
  """gather_pages / scatter_pages (the host tier) carry the scales; a float pool has none to carry."""
  cache = _run(_empty(), SEQS, [11])
  idx = jnp.asarray([3, 6, 1])
  parts = kvc.gather_pages(cache, idx)
  assert [p.shape for p in parts] == [(L, 3, Z, K, H)] * 2 + [(L, 3, K)] * 2
  back = kvc.scatter_pages(_empty(), idx, *parts)
  for a, b in zip(back.parts(), cache.parts()):
    np.testing.assert_array_equal(np.asarray(a, np.float32)[:, idx], np.asarray(b, np.float32)[:, idx])
  with pytest.raises(ValueError, match="2 arrays for a cache of 4"):
    kvc.scatter_pages(cache, idx, *parts[:2])
  plain = kvc.init_cache(L, P, Z, K, H, "float32")
  assert len(kvc.gather_pages(plain, idx)) == 2 and plain.k_scale is None


def test_written_pages_cover_every_page_a_row_writes():
  """Rows starting at any offset, of any length up to T, padded with slot 0: every page holding one of the row's
  tokens is listed (the null page may be too), and nothing else."""
  T = 9
  for start in range(Z):
    for n in range(1, T + 1):
      table = np.asarray([7, 3, 9, 2, 5])
      pos = start + np.arange(n)
      slots = np.zeros((1, T), np.int32)
      slots[0, :n] = table[pos // Z] * Z + pos % Z
      got = set(np.asarray(kvc.written_pages(jnp.asarray(slots), Z)).ravel().tolist())
      want = set(table[pos // Z].tolist())
      assert want <= got <= want | {0}, (start, n, got, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("shard", [None, 0, 1])
def test_padded_tokens_write_nothing(dtype, shard):
  """A prefill chunk's padded tokens (slot 0) are dropped, not written into the null page: on a GPU a scatter of
  every padded row into the same page's slots serialises. The real tokens land at their slots, on one device and
  in each seq shard's half of the pool (write_kv(shard=...): global pages 0-4 on shard 0, 5-9 on shard 1)."""
  rng = np.random.default_rng(2)
  cache = kvc.init_cache(L, P, Z, K, H, dtype)
  S = 2 if shard is not None else 1
  Pl = P // S
  parts = [x if shard is None else x[:, shard * Pl:(shard + 1) * Pl] for x in cache.parts()]
  real = 6                                             # tokens 0..5 of a sequence on pages 3 and 6; 10 padded
  x = rng.normal(size=(1, 16, K, H)).astype(np.float32)
  x[0, real:] = 1000.0
  slots = np.zeros((1, 16), np.int32)
  slots[0, :real] = [3 * Z, 3 * Z + 1, 3 * Z + 2, 3 * Z + 3, 6 * Z, 6 * Z + 1]
  slots = jnp.asarray(slots)
  pages = kvc.written_pages(slots, Z) if dtype == "float8_e4m3fn" else None
  k, v, ks, vs = kvc.write_kv(*parts[:2], *(parts[2:] or (None, None)), jnp.asarray(x, jnp.bfloat16),
                              jnp.asarray(-x, jnp.bfloat16), slots, pages, LAYER, shard=shard)
  first = 0 if shard is None else shard * Pl
  for part in (k, v) + ((ks, vs) if ks is not None else ()):
    assert not np.any(np.asarray(part[:, 0], np.float32)), "a padded token was written into the null page"
  got = np.asarray(k, np.float32)
  scale = np.ones((L, Pl, K), np.float32) if ks is None else np.asarray(ks)
  if ks is not None:                                   # fp8 pools hold the keys rotated (kvc.fp8_basis)
    x = np.asarray(kvc.fp8_basis(jnp.asarray(x, jnp.bfloat16)), np.float32)
  for t in range(real):
    page, off = divmod(int(slots[0, t]), Z)
    if first <= page < first + Pl:
      np.testing.assert_allclose(got[LAYER, page - first, off] * scale[LAYER, page - first][:, None], x[0, t],
                                 rtol=2 ** -3, atol=1e-2)
  # Pages other than the ones the real tokens landed on hold nothing.
  mine = {p - first for p in (3, 6) if first <= p < first + Pl}
  others = [p for p in range(Pl) if p not in mine]
  assert not np.any(got[:, others]) and not np.any(got[1 - LAYER])


def test_fp8_basis_rotates_power_of_two_head_dims_only():
  """Keys of a power-of-two head dim go into fp8 pools rotated (an orthogonal matrix: norms and dot products
  kept); other head dims (80, 96, 100: LLaMA-architecture models have them) as computed, and such an engine
  writes and reads its fp8 pages."""
  x = jax.random.normal(jax.random.key(0), (3, 16), jnp.float32)
  y = kvc.fp8_basis(x)
  np.testing.assert_allclose(np.asarray(y @ y.T), np.asarray(x @ x.T), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(y), np.asarray(x))
  x12 = x[:, :12]
  assert kvc.fp8_basis(x12) is x12 and not kvc.rotates_keys(12) and kvc.rotates_keys(128)
  import dataclasses
  from lcjax import Engine, RunConfig
  from lcjax.config import WeightFormat, preset
  from lcjax.engine import context_file
  cfg = dataclasses.replace(preset("tiny"), head_dim=12)
  run = RunConfig(dtype="float32", cache_dtype="float8_e4m3fn", page_size=8, prefill_chunk=16, max_context=64,
                  max_batch=1)
  out = Engine.random(cfg, run=run, seed=0).generate([[5, 6, 7] * 7], max_new_tokens=4)[0]
  assert len(out.token_ids) == 4
  assert "key_layout" not in context_file.fingerprint(cfg, run, WeightFormat(), "digest")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's float8 handling")
def test_fp8_pools_are_read_and_written_without_widening_the_whole_pool(monkeypatch):
  """On the CPU, a decode token written into an fp8 pool, a page copied, and pages read back through the
  attention reference's gather compile to byte-wise updates and gathers: no instruction of the optimized program
  makes the whole pool in a wider dtype. XLA's CPU backend has no float8 update, gather or slice and widens a
  float8 operand to float16 around each one: the whole cache of every layer, for each layer's token. The same
  program through plain float8 indexing (fp8.take / set_at's byte view off) is the positive control and the
  oracle: it widens the pool (a check that fails once XLA's CPU backend handles float8 itself), and its bytes are
  the same."""
  import re
  from lcjax.ops import attention as ref
  from lcjax.ops import fp8 as fp8_ops
  L, P, Z, K, H = 3, 9, 16, 2, 64
  e4 = jnp.float8_e4m3fn

  def step(pool, scale, x, page, offset, layer, table):
    pool, scale = kvc._write_one_token(pool, scale, x, page, offset, layer)
    pages = kvc.copy_pages(kvc.PagedKV(pool, pool, scale, scale), jnp.asarray([1]), jnp.asarray([2]))
    return pages.k, scale, ref.gather_pages(pages.k, scale, table, jnp.float32, layer)

  whole = re.escape(f"[{L},{P},{Z},{K},{H}]")
  rng = np.random.default_rng(0)
  args = (jnp.asarray(rng.standard_normal((L, P, Z, K, H)), jnp.float32).astype(e4), jnp.ones((L, P, K), jnp.float32),
          jnp.asarray(rng.standard_normal((1, K, H)), jnp.float32), jnp.asarray([1]), jnp.asarray([3]),
          jnp.asarray(1, jnp.int32), jnp.asarray([[1, 2, 0, 4]]))

  def run():                                     # a new function each time: no trace cached from another run
    compiled = jax.jit(lambda *a: step(*a)).lower(*args).compile()
    widened = [line.strip()[:160] for line in compiled.as_text().splitlines()
               if re.search(rf"= (f16|bf16|f32|f64){whole}", line)]
    return widened, [np.asarray(a) for a in compiled(*args)]

  widened, got = run()
  assert not widened, widened
  monkeypatch.setattr(fp8_ops, "_byte_floats", lambda x: False)
  widened, want = run()
  assert widened                                 # plain float8 indexing widens the pool: the check can fail
  assert np.array_equal(got[0].view(np.uint8), want[0].view(np.uint8))
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[2], want[2])
