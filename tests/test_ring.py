"""Sequence-parallel attention on 8 fake CPU devices against the unsharded dense oracle (attention_dense)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lcjax import sharding as sh
from lcjax.ops import attention as ref
from lcjax.ops import ring
from lcjax.ops.backends import ReferenceBackend
from lcjax.ops.ulysses import ulysses_attention

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (fake CPU devices via conftest)")

BE = ReferenceBackend(block_k=8, pages_per_block=2)
TOL = dict(rtol=1e-5, atol=1e-5)
# The oracles as one program per shape (eager, every operation is one).
_attention_dense = jax.jit(ref.attention_dense, static_argnames=("causal",))
_attention_reference = jax.jit(ref.attention_reference, static_argnames=("causal",))


def _qkv(B, T, N, K, H, seed=0):
  r = np.random.default_rng(seed)
  return tuple(r.standard_normal(s, np.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))


def _dense(q, k, v, kv_len, causal):
  """Oracle: the full score matrix of the whole chunk; positions relative to the chunk start."""
  B, T = q.shape[:2]
  return _attention_dense(q, k, v, q_pos=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)), kv_len=kv_len,
                          causal=causal)


def _sharded(fn, q, k, v, *, seq, zigzag, **kw):
  """Run fn on the layout-ordered arrays and return its result in natural order."""
  lay = (lambda x: ring.to_zigzag(x, seq)) if zigzag else (lambda x: x)
  o, l = jax.jit(lambda q, k, v: fn(q, k, v, zigzag=zigzag, **kw))(lay(q), lay(k), lay(v))
  unlay = (lambda x: ring.from_zigzag(np.asarray(x), seq)) if zigzag else np.asarray
  return unlay(o), unlay(l)


def test_zigzag_order_layout():
  n, c = 4, 3
  order = ring.zigzag_order(2 * n * c, n)
  per_device = order.reshape(n, 2 * c)
  for d in range(n):  # device d: chunk d then chunk 2n-1-d
    np.testing.assert_array_equal(per_device[d], np.r_[np.arange(d * c, d * c + c),
                                                       np.arange((2 * n - 1 - d) * c, (2 * n - d) * c)])
  x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
  np.testing.assert_array_equal(ring.to_zigzag(x, n), x[:, order])
  np.testing.assert_array_equal(ring.from_zigzag(ring.to_zigzag(x, n), n), x)
  np.testing.assert_array_equal(ring.from_zigzag(ring.to_zigzag(jnp.asarray(x), n), n), x)
  with pytest.raises(ValueError, match="length=20 seq=3"):
    ring.zigzag_order(20, 3)


slow = pytest.mark.slow

# (seq, tensor, N, K, zigzag): GQA ratios 1 and 4, with and without a tensor axis; the plain layout's variants
# beyond two meshes only repeat the zigzag coverage and run with the slow tests.
RING_CASES = [(2, 1, 4, 4, True), (4, 1, 4, 1, True), (8, 1, 4, 4, True), (4, 2, 8, 2, True), (2, 4, 4, 4, True),
              (4, 1, 4, 1, False), (4, 2, 8, 2, False), pytest.param(2, 1, 4, 4, False, marks=slow),
              pytest.param(8, 1, 4, 4, False, marks=slow), pytest.param(2, 4, 4, 4, False, marks=slow)]


@pytest.mark.parametrize("seq,tensor,N,K,zigzag", RING_CASES)
def test_ring_matches_dense(seq, tensor, N, K, zigzag):
  B, T, H = 3, 32, 8
  q, k, v = _qkv(B, T, N, K, H)
  kv_len = np.array([T, 19, 1])                    # ragged: padding tokens after kv_len are never attended
  offset = np.array([0, 5, 40])                    # positions are relative: the prefix length shifts nothing
  mesh = sh.make_mesh(tensor=tensor, seq=seq)
  o, l = _sharded(ring.ring_attention, q, k, v, seq=seq, zigzag=zigzag, mesh=mesh, backend=BE,
                  offset=offset, kv_len=kv_len)
  want_o, want_l = _dense(q, k, v, kv_len, True)
  np.testing.assert_allclose(o, want_o, **TOL)
  np.testing.assert_allclose(l, want_l, **TOL)


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "plain"])
def test_ring_non_causal(zigzag):
  B, T, N, K, H, seq = 2, 32, 4, 1, 8, 4
  q, k, v = _qkv(B, T, N, K, H, seed=1)
  kv_len = np.array([T, 10])
  mesh = sh.make_mesh(tensor=1, seq=seq)
  o, l = _sharded(ring.ring_attention, q, k, v, seq=seq, zigzag=zigzag, mesh=mesh, backend=BE, causal=False,
                  kv_len=kv_len)
  want_o, want_l = _dense(q, k, v, kv_len, False)
  np.testing.assert_allclose(o, want_o, **TOL)
  np.testing.assert_allclose(l, want_l, **TOL)


def test_ring_bfloat16_accumulates_in_float32():
  B, T, N, K, H, seq = 1, 32, 2, 2, 16, 8
  q, k, v = (jnp.asarray(x.astype(jnp.bfloat16)) for x in _qkv(B, T, N, K, H, seed=2))
  mesh = sh.make_mesh(tensor=1, seq=seq)
  o, l = _sharded(ring.ring_attention, q, k, v, seq=seq, zigzag=True, mesh=mesh, backend=BE)
  assert o.dtype == jnp.bfloat16 and l.dtype == np.float32
  want_o, want_l = _dense(q, k, v, None, True)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want_o, np.float32), atol=2e-2)
  np.testing.assert_allclose(l, want_l, rtol=1e-5, atol=1e-4)


@dataclasses.dataclass(frozen=True)
class _Strict:
  """Reference backend that poisons its output with nan when the ring wastes work on a block: a block wholly in
  the future (nothing visible), or a causal mask on a block that is wholly visible."""
  inner: ReferenceBackend = BE

  def attend(self, q, k, v, *, q_pos, k_start, kv_len, causal, q_len=None):
    o, lse = self.inner.attend(q, k, v, q_pos=q_pos, k_start=k_start, kv_len=kv_len, q_len=q_len, causal=causal)
    first_key, last_key = k_start, k_start + k.shape[1] - 1
    future = jnp.all(first_key > q_pos.max(1))
    needless_mask = causal & jnp.all(last_key <= q_pos.min(1))
    return jnp.where(future | needless_mask, jnp.nan, o), lse


@pytest.mark.parametrize("seq,zigzag", [(4, True), (4, False), pytest.param(8, True, marks=slow)])
def test_ring_skips_future_blocks(seq, zigzag):
  B, T, N, K, H = 2, 64, 2, 1, 8
  q, k, v = _qkv(B, T, N, K, H, seed=3)
  mesh = sh.make_mesh(tensor=1, seq=seq)
  o, _ = _sharded(ring.ring_attention, q, k, v, seq=seq, zigzag=zigzag, mesh=mesh, backend=_Strict())
  np.testing.assert_allclose(o, _dense(q, k, v, None, True)[0], **TOL)


def test_strict_backend_catches_waste():
  """The poison check itself: a future block does turn into nan."""
  q, k, v = _qkv(1, 4, 1, 1, 4)
  attend = jax.jit(lambda *a: _Strict().attend(*a[:3], q_pos=a[3], k_start=a[4], kv_len=a[5], causal=True))
  o, _ = attend(q, k, v, np.arange(4, dtype=np.int32)[None], np.array([4], np.int32), np.array([4], np.int32))
  assert np.isnan(o).all()


def test_ring_chunk_merged_with_cached_prefix():
  """Chunked prefill: the chunk's ring partial merged with the partial over the cached prefix is the full
  attention of the chunk's queries over prefix + chunk."""
  B, S0, T, N, K, H, seq = 2, 24, 32, 4, 2, 8, 4
  q, k, v = _qkv(B, S0 + T, N, K, H, seed=4)
  mesh = sh.make_mesh(tensor=2, seq=seq)
  qc, kc, vc = q[:, S0:], k[:, S0:], v[:, S0:]
  o_ring, l_ring = _sharded(ring.ring_attention, qc, kc, vc, seq=seq, zigzag=True, mesh=mesh, backend=BE,
                            offset=S0)
  o_pre, l_pre = _attention_reference(qc, k[:, :S0], v[:, :S0],
                                      q_pos=S0 + np.arange(T, dtype=np.int32)[None].repeat(B, 0))
  o, l = jax.jit(ref.merge)(o_ring, l_ring, o_pre, l_pre)
  want_o, want_l = _attention_dense(q, k, v)
  np.testing.assert_allclose(o, want_o[:, S0:], **TOL)
  np.testing.assert_allclose(l, want_l[:, S0:], **TOL)


def test_ring_shape_errors():
  mesh = sh.make_mesh(tensor=2, seq=4)
  q, k, v = _qkv(1, 20, 4, 2, 8)
  with pytest.raises(ValueError, match=r"length T=20 is not divisible by 8 \(2 \* seq=4\)"):
    ring.ring_attention(q, k, v, mesh=mesh, backend=BE)
  q, k, v = _qkv(1, 32, 4, 1, 8)
  with pytest.raises(ValueError, match="kv heads K=1 must both be divisible by tensor=2"):
    ring.ring_attention(q, k, v, mesh=mesh, backend=BE)


@pytest.mark.parametrize("seq,tensor,N,K,zigzag", [
    (4, 1, 8, 4, False), (2, 2, 8, 4, True), (4, 2, 16, 8, False), pytest.param(4, 1, 8, 4, True, marks=slow),
    pytest.param(2, 2, 8, 4, False, marks=slow), pytest.param(4, 2, 16, 8, True, marks=slow)])
def test_ulysses_matches_dense(seq, tensor, N, K, zigzag):
  B, T, H = 2, 32, 8
  q, k, v = _qkv(B, T, N, K, H, seed=5)
  kv_len = np.array([T, 21])
  mesh = sh.make_mesh(tensor=tensor, seq=seq)
  o, l = _sharded(ulysses_attention, q, k, v, seq=seq, zigzag=zigzag, mesh=mesh, backend=BE, offset=[3, 0],
                  kv_len=kv_len)
  want_o, want_l = _dense(q, k, v, kv_len, True)
  np.testing.assert_allclose(o, want_o, **TOL)
  np.testing.assert_allclose(l, want_l, **TOL)


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "plain"])
@pytest.mark.parametrize("fn", [ring.ring_attention, ulysses_attention], ids=["ring", "ulysses"])
def test_padding_rows_change_no_real_row_of_fp8_sequence_parallel_attention(fn, zigzag):
  """Over seq = 2 with the FP8 backend (its kernel's jnp model): what the padding rows past kv_len hold (1e5 times
  the real rows) changes no real row's bits, as each block's backend call is told its real rows (Q's block scales
  are absmaxes over rows), and the real rows are one device's FP8 attention told the same rows, within FP8's error
  (the shards quantize other blocks)."""
  from lcjax.ops.pallas_backend import PallasFp8Backend
  B, T, N, K, H, seq = 2, 256, 4, 4, 64, 2
  q, k, v = _qkv(B, T, N, K, H, seed=4)
  kv_len = np.array([200, 75])
  pad = (np.arange(T)[None, :] >= kv_len[:, None])[:, :, None, None]
  real = ~pad[:, :, 0, 0]
  be = PallasFp8Backend(interpret=True)
  mesh = sh.make_mesh(tensor=1, seq=seq)
  run = lambda q: _sharded(fn, q, k, v, seq=seq, zigzag=zigzag, mesh=mesh, backend=be, kv_len=kv_len)[0]
  loud, quiet = run(np.where(pad, 1e5 * q, q)), run(np.where(pad, 0.0, q))
  np.testing.assert_array_equal(loud[real], quiet[real])
  one = np.asarray(jax.jit(lambda q, k, v, n: be.attend(q, k, v, kv_len=n, q_len=n))(q, k, v, kv_len)[0])
  exact = np.asarray(_dense(q, k, v, kv_len, True)[0])
  rel = lambda a: float(np.linalg.norm(a[real] - exact[real]) / np.linalg.norm(exact[real]))
  assert rel(one) < 0.06 and rel(loud) < 1.2 * rel(one) + 1e-3, (rel(one), rel(loud))


def test_ulysses_refuses_indivisible_heads():
  q, k, v = _qkv(1, 32, 8, 2, 8)
  with pytest.raises(ValueError, match="n_heads=8 n_kv_heads=2 seq=4"):
    ulysses_attention(q, k, v, mesh=sh.make_mesh(tensor=1, seq=4), backend=BE)
  with pytest.raises(ValueError, match="n_heads=4 n_kv_heads=1 seq=2"):   # per tensor shard: 8/2, 2/2
    ulysses_attention(q, k, v, mesh=sh.make_mesh(tensor=2, seq=2), backend=BE)


def _shard_pages(k, v, kv_len, Z, n):
  """Distribute each sequence's pages round-robin over n shards (slot m on shard m % n).

  Returns per-shard pools [n * P_l, Z, K, H] (local page 0 is the null page), page tables [n, B, M_l] of local
  page ids, and the valid token count of each shard [n, B]. A sequence's tokens fill its slots in order, so on
  every shard the valid tokens are a prefix of its local slots, as the paged contract requires.
  """
  B, S, K, H = k.shape
  M = S // Z
  M_l = -(-M // n)
  P_l = 1 + B * M_l
  kp = np.zeros((n, P_l, Z, K, H), np.float32)
  vp = np.zeros_like(kp)
  table = np.zeros((n, B, M_l), np.int32)
  lens = np.zeros((n, B), np.int32)
  for b in range(B):
    for m in range(M):
      d, slot = m % n, m // n
      page = 1 + b * M_l + slot
      kp[d, page], vp[d, page] = k[b, m * Z:(m + 1) * Z], v[b, m * Z:(m + 1) * Z]
      table[d, b, slot] = page
      lens[d, b] += np.clip(kv_len[b] - m * Z, 0, Z)
  return kp.reshape(n * P_l, Z, K, H), vp.reshape(n * P_l, Z, K, H), table, lens


@pytest.mark.parametrize("seq", [2, 8, pytest.param(4, marks=slow)])
def test_combine_seq_partials_decode(seq):
  """Decode against a seq-sharded paged cache: each shard attends to its own pages, the partials combine to
  attention over the whole contiguous cache. Rows with tokens on one shard only, or none, are included."""
  B, S, N, K, H, Z = 4, 64, 4, 2, 8, 4
  _, k, v = _qkv(B, S, N, K, H, seed=6)
  q = _qkv(B, 1, N, K, H, seed=7)[0]
  kv_len = np.array([64, 37, 3, 0])
  kp, vp, table, lens = _shard_pages(k, v, kv_len, Z, seq)
  q_pos = np.maximum(kv_len - 1, 0)[:, None]

  def body(q, kp, vp, table, lens, q_pos):
    o, l = BE.paged(q, kp, vp, table[0], q_pos=q_pos, kv_len=lens[0])
    o, l = ring.combine_seq_partials(o, l, sh.SEQ)
    return o[None], l[None]

  mesh = sh.make_mesh(tensor=1, seq=seq)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("seq"), P("seq"), P("seq"), P("seq"), P()),
                            out_specs=(P("seq"), P("seq")), check_vma=False))
  o, l = map(np.asarray, f(q, kp, vp, table, lens, q_pos))
  want_o, want_l = _attention_dense(q, k, v, q_pos=q_pos, kv_len=kv_len)
  for d in range(seq):                              # every shard holds the same, complete result
    np.testing.assert_allclose(o[d], want_o, **TOL)
    np.testing.assert_allclose(l[d], want_l, **TOL)
  assert np.all(np.isneginf(l[:, 3])) and np.all(o[:, 3] == 0)


def test_combine_seq_partials_scatter():
  """Prefill chunk after a seq-sharded cached prefix: queries gathered from the shards attend to each shard's
  pages, and the combine reduce-scatters so each shard keeps its own queries."""
  B, S, T, N, K, H, Z, seq = 2, 32, 16, 4, 1, 8, 4, 4
  _, k, v = _qkv(B, S, N, K, H, seed=8)
  q = _qkv(B, T, N, K, H, seed=9)[0]
  kv_len = np.array([32, 9])
  kp, vp, table, lens = _shard_pages(k, v, kv_len, Z, seq)
  q_pos = kv_len[:, None] + np.arange(T)

  def body(q, q_pos, kp, vp, table, lens):
    q_all = jax.lax.all_gather(q, sh.SEQ, axis=1, tiled=True)
    pos_all = jax.lax.all_gather(q_pos, sh.SEQ, axis=1, tiled=True)
    o, l = BE.paged(q_all, kp, vp, table[0], q_pos=pos_all, kv_len=lens[0])
    return ring.combine_seq_partials(o, l, sh.SEQ, scatter_axis=1)

  mesh = sh.make_mesh(tensor=1, seq=seq)
  f = jax.jit(jax.shard_map(body, mesh=mesh,
                            in_specs=(P(None, "seq"), P(None, "seq"), P("seq"), P("seq"), P("seq"), P("seq")),
                            out_specs=(P(None, "seq"), P(None, "seq")), check_vma=False))
  o, l = f(q, q_pos, kp, vp, table, lens)
  want_o, want_l = _attention_dense(q, k, v, q_pos=q_pos, kv_len=kv_len)
  np.testing.assert_allclose(o, want_o, **TOL)
  np.testing.assert_allclose(l, want_l, **TOL)
