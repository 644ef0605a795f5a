"""The target-feature ring: drafters keep only the N most recent committed features.

A drafter with a ring of N slots must propose exactly what the same drafter proposes when its
store holds only the last N features (every older one removed), however many times the ring
has wrapped; the window must really bite (the unbounded drafter proposes otherwise), and
speculation with a ring stays lossless.
"""

from __future__ import annotations


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import plan
from jaxspec.drafters.base import PrefillContext, ProposeContext
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.models import attention as attention_lib
from jaxspec.models import target as target_lib
from jaxspec import sampling
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import NO_LIMIT, ContextRing, FloatKV, RingKV
from tests import near_ties
from tests.drafter_models import small_dflash, small_target

N = 8  # ring size under test: much shorter than the prompts, so rings wrap several times
GAMMA = 3
MAX_LEN = 96
LENS = (37, 50, 21)


@pytest.fixture(scope="module")
def target():
  return small_target(num_layers=4)


def _eagle(target, window):
  vocab = np.random.default_rng(0).choice(64, 40, replace=False)
  return Eagle3Drafter.random(
    target,
    draft_vocab=vocab,
    target_layer_ids=(0, 2, 3),
    stddev=0.2,
    gamma=GAMMA,
    seed=2,
    context_window=window,
  )


def _dflash(target, window):
  return small_dflash(target, context_chunk=4, context_window=window)


def _tokens(vocab=64, seed=0):
  rng = np.random.default_rng(seed)
  buf = np.zeros((len(LENS), MAX_LEN), np.int32)
  for b, n in enumerate(LENS):
    buf[b, : n + 1] = rng.integers(3, vocab, n + 1)  # the prompt and its first token
  return jnp.asarray(buf)


def _prefill(target, drafter, buf, state=None, chunk=16):
  """Chunk-by-chunk drafter prefill of prompts of LENS (chunks of 16, as the engine would)."""
  lens = jnp.asarray(LENS, jnp.int32)
  st = state if state is not None else drafter.init_state(drafter.params, len(LENS), MAX_LEN)
  full = target_lib.forward(target.config, target.params, buf, taps=drafter.taps)
  for start in range(0, max(LENS), chunk):
    ctx = PrefillContext(
      buf,
      lens,
      full.taps[:, :, start : start + chunk],
      full.hidden[:, start : start + chunk],
      jnp.int32(start),
    )
    st = drafter.prefill(drafter.params, st, ctx)
  return st


def _propose(drafter, st, buf):
  ctx = ProposeContext(
    buf,
    jnp.asarray(LENS, jnp.int32) + 1,
    sampling.make_sampling_params(len(LENS)),
    jax.random.PRNGKey(0),
  )
  prop, _ = jax.jit(drafter.propose)(drafter.params, st, ctx)
  return np.asarray(prop.logprobs)


def _finite_close(got, want):
  assert np.array_equal(np.isfinite(got), np.isfinite(want))
  ok = np.isfinite(want)
  np.testing.assert_allclose(got[ok], want[ok], atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------------
# RingKV itself
# ------------------------------------------------------------------------------------------------


def _ring_config():
  return small_target(num_layers=1).config


def test_ring_keeps_the_last_positions_and_never_writes_padding():
  ring = RingKV.create(_ring_config(), 1, 2, 6).with_bounds(limit=jnp.array([9, 20]))
  k = jnp.arange(2 * 16, dtype=jnp.float32).reshape(2, 16, 1, 1)
  k = jnp.broadcast_to(k, (2, 16, ring.k.shape[3], ring.k.shape[4]))
  ring, _, _ = ring.write(jnp.int32(0), jnp.zeros((2,), jnp.int32), k, k)
  pos = np.asarray(ring.pos[0])
  # Row 0: positions 0..8 are real (limit 9), the last 6 of them are kept; row 1: 10..15.
  assert sorted(pos[0].tolist()) == list(range(3, 9))
  assert sorted(pos[1].tolist()) == list(range(10, 16))
  for b in range(2):
    for slot, p in enumerate(pos[b]):
      assert p % 6 == slot
      assert float(ring.k[0, b, slot, 0, 0]) == b * 16 + p


@pytest.mark.parametrize("floor", [0, 35])
def test_attention_over_a_wrapped_ring_equals_attention_over_its_last_positions(floor):
  """A block of 4 at start 40 over a 12-slot ring written 0..39 in blocks of 4 (wrapped three
  times): the block's own write displaces 28..31, so it sees positions max(floor, 32)..39 of
  the full K/V and itself, as dense attention over exactly those does."""
  cfg = _ring_config()
  rng = np.random.default_rng(1)
  b, h, kh, d = 2, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  full_k = rng.normal(size=(b, 44, kh, d)).astype(np.float32)
  full_v = rng.normal(size=(b, 44, kh, d)).astype(np.float32)
  ring = RingKV.create(cfg, 1, b, 12)
  for s in range(0, 40, 4):
    start = jnp.full((b,), s, jnp.int32)
    ring, _, _ = ring.write(jnp.int32(0), start, full_k[:, s : s + 4], full_v[:, s : s + 4])
  ring = ring.with_bounds(floor=jnp.full((b,), floor))
  q = rng.normal(size=(b, 4, h, d)).astype(np.float32)
  start = jnp.full((b,), 40, jnp.int32)
  out, _ = jax.jit(
    lambda q, k, v, ring: attention_lib.attention(
      q, k, v, ring, jnp.int32(0), start, None, d**-0.5, chunk=5
    )
  )(q, full_k[:, 40:44], full_v[:, 40:44], ring)

  lo = max(floor, 32)
  keys = np.concatenate([full_k[:, lo:40], full_k[:, 40:44]], axis=1)
  vals = np.concatenate([full_v[:, lo:40], full_v[:, 40:44]], axis=1)
  g = h // kh
  s = np.einsum("bthd,bshd->bhts", q, np.repeat(keys, g, axis=2)) * d**-0.5
  n_prefix = 40 - lo
  causal = np.concatenate([np.ones((4, n_prefix), bool), np.tril(np.ones((4, 4), bool))], 1)
  s = np.where(causal[None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.einsum("bhts,bshd->bthd", p, np.repeat(vals, g, axis=2))
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
  "cap,start,path",
  [
    (8, 3, [[0, 2, 4], [0, 1, 3]]),  # inside the ring
    (8, 6, [[0, 2, 4], [0, 1, 2]]),  # the block (positions 6..10) wraps around slot 0
    (4, 2, [[0, 3, 5], [0, 1, 4]]),  # a 6-wide block in 4 slots: node 0 was displaced
  ],
)
def test_ring_commit_path_moves_the_path_as_a_full_cache_does(cap, start, path):
  """After a block at `start` and commit_path, positions start..start+n−1 hold the path's
  nodes exactly as a full-length cache's slots do; a node the ring no longer held leaves its
  position empty, and the positions past the path keep what the block wrote there."""
  cfg = _ring_config()
  rng = np.random.default_rng(2)
  b, t = 2, 6 if cap == 4 else 5
  k = rng.normal(size=(b, t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
  v = rng.normal(size=k.shape).astype(np.float32)
  starts, path = jnp.full((b,), start, jnp.int32), jnp.asarray(path, jnp.int32)
  ring, _, _ = RingKV.create(cfg, 1, b, cap).write(jnp.int32(0), starts, k, v)
  before = np.asarray(ring.pos[0])
  ring = jax.jit(RingKV.commit_path)(ring, starts, path)
  full, _, _ = FloatKV.create(cfg, 1, b, 16).write(jnp.int32(0), starts, k, v)
  full = full.commit_path(starts, path)
  pos = np.asarray(ring.pos[0])
  for r in range(b):
    for j, node in enumerate(np.asarray(path[r])):
      p, slot = start + j, (start + j) % cap
      if start + node < start + t - cap:  # displaced by the block's own later positions
        assert pos[r, slot] == -1
        continue
      assert pos[r, slot] == p
      np.testing.assert_array_equal(ring.k[0, r, slot], full.k[0, r, p])
      np.testing.assert_array_equal(ring.v[0, r, slot], full.v[0, r, p])
    targets = {(start + j) % cap for j in range(path.shape[1])}
    for slot in set(range(cap)) - targets:
      assert pos[r, slot] == before[r, slot]


def test_context_ring_writes_reads_and_commits_as_a_ring_does():
  """DFlash's store kind (positions shared by its layers) against RingKV on one layer: the
  same slots after a wrapping block (written per layer or appended for all layers at once),
  the same chunks read, the same tree-path commit."""
  cfg = _ring_config()
  rng = np.random.default_rng(3)
  b, t, cap = 2, 5, 8
  k = rng.normal(size=(b, t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
  v = rng.normal(size=k.shape).astype(np.float32)
  starts, layer = jnp.full((b,), 6, jnp.int32), jnp.int32(0)
  ring, _, _ = RingKV.create(cfg, 1, b, cap).write(layer, starts, k, v)
  ctx, _, _ = ContextRing.create(cfg, 1, b, cap).write(layer, starts, k, v)
  appended = ContextRing.create(cfg, 1, b, cap).append(
    starts, k[None], v[None], jnp.full((b,), NO_LIMIT, jnp.int32)
  )
  for got in (ctx, appended):
    np.testing.assert_array_equal(got.ctx_k, ring.k)
    np.testing.assert_array_equal(got.ctx_pos, ring.pos[0])
  for offset in (0, 4):
    want = ring.read_chunk(layer, jnp.int32(offset), 4, starts + 3)
    got = ctx.read_chunk(layer, jnp.int32(offset), 4, starts + 3)
    for a, w in zip(got, want):
      np.testing.assert_array_equal(a, w)
  path = jnp.asarray([[0, 2, 4], [0, 1, 2]], jnp.int32)
  ring, ctx = ring.commit_path(starts, path), ctx.commit_path(starts, path)
  np.testing.assert_array_equal(ctx.ctx_k, ring.k)
  np.testing.assert_array_equal(ctx.ctx_v, ring.v)
  np.testing.assert_array_equal(ctx.ctx_pos, ring.pos[0])


def test_pallas_attention_refuses_a_ring():
  from jaxspec.errors import ConfigError  # pylint: disable=import-outside-toplevel

  cfg = _ring_config()
  ring = RingKV.create(cfg, 1, 1, 8)
  x = jnp.zeros((1, 1, cfg.num_heads, cfg.head_dim))
  kv = jnp.zeros((1, 1, cfg.num_kv_heads, cfg.head_dim))
  with pytest.raises(ConfigError, match="ring"):
    attention_lib.attention(
      x, kv, kv, ring, jnp.int32(0), jnp.zeros((1,), jnp.int32), None, 1.0, impl="pallas"
    )


# ------------------------------------------------------------------------------------------------
# EAGLE-3
# ------------------------------------------------------------------------------------------------


def test_eagle3_ring_proposes_what_the_last_n_entries_give(target):
  """Ring of N + γ + 1 slots, wrapped, against a never-wrapping store of the same entries from
  which everything older than the last N committed entries has been removed."""
  ring = _eagle(target, N)
  assert ring.ring_capacity(MAX_LEN) == N + GAMMA + 1
  buf = _tokens()
  st = _prefill(target, ring, buf)
  assert isinstance(st.kv, RingKV) and st.kv.k.shape[2] == N + GAMMA + 1
  got = _propose(ring, st, buf)

  unbounded = _eagle(target, 0)
  full = _prefill(target, unbounded, buf)
  assert isinstance(full.kv, FloatKV)
  # Only the last N committed entries (positions n−1−N..n−2, n = the root's slot) remain.
  pos = np.arange(MAX_LEN)[None, :]
  root = np.asarray(LENS)[:, None]
  kept = (pos >= root - 1 - N) & (pos < MAX_LEN)
  only_last = RingKV(
    full.kv.k,
    full.kv.v,
    jnp.asarray(np.where(kept, pos, -1)[None].astype(np.int32)),
    jnp.zeros((len(LENS),), jnp.int32),
    jnp.full((len(LENS),), 2**31 - 1, jnp.int32),
  )
  want = _propose(ring, full.replace(kv=only_last), buf)
  _finite_close(got, want)
  # The window bites: with every entry the drafter proposes something else.
  everything = _propose(unbounded, full, buf)
  assert not np.allclose(everything[np.isfinite(everything)], got[np.isfinite(got)], atol=1e-3)


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_eagle3_ring_greedy_equals_plain(target, verify):
  drafter = _eagle(target, N)
  tree = dict(verify="tree", tree_budget=6) if verify == "tree" else {}
  cfg = EngineConfig(max_len=MAX_LEN, batch_size=2, use_eos=False, prefill_chunk=16)
  rng = np.random.default_rng(3)
  ps = [rng.integers(3, 64, n).tolist() for n in (41, 29)]  # longer than the 12-slot ring
  plain = SpecEngine(target, None, cfg).generate(ps, max_new_tokens=24)
  engine = SpecEngine(target, drafter, dataclasses.replace(cfg, **tree))
  assert isinstance(engine.init_state(ps, 4).drafter_state.kv, RingKV)
  spec = engine.generate(ps, max_new_tokens=24)
  near_ties.assert_greedy_match(target, ps, plain.tokens, spec.tokens)


# ------------------------------------------------------------------------------------------------
# DFlash
# ------------------------------------------------------------------------------------------------


def _dflash_logits(drafter, st, buf):
  lens = jnp.asarray(LENS, jnp.int32)
  rows = jnp.arange(len(LENS))
  block = jnp.concatenate(
    [buf[rows, lens][:, None], jnp.full((len(LENS), drafter.gamma), 2, jnp.int32)], axis=1
  )
  return np.asarray(jax.jit(drafter.block_logits)(drafter.params, st, block, lens))


def test_dflash_ring_proposes_what_the_last_n_features_give(target):
  ring = _dflash(target, N)
  buf = _tokens()
  st = _prefill(target, ring, buf)
  assert st.ctx_k.shape[2] == N
  got = _dflash_logits(ring, st, buf)

  unbounded = _dflash(target, 0)
  full = _prefill(target, unbounded, buf)
  pos = np.asarray(full.ctx_pos)
  only_last = np.where(pos >= np.asarray(LENS)[:, None] - N, pos, -1)
  want = _dflash_logits(unbounded, full.replace(ctx_pos=jnp.asarray(only_last)), buf)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  everything = _dflash_logits(unbounded, full, buf)
  assert not np.allclose(everything, got, atol=1e-3)


def test_ring_memory_is_reported(target):
  """The drafter state with a ring is O(N): it does not grow with max_len."""
  for make in (_eagle, _dflash):
    small = plan.drafter_state_bytes(make(target, N), 1, 1024)
    large = plan.drafter_state_bytes(make(target, N), 1, 8192)
    unbounded = plan.drafter_state_bytes(make(target, 0), 1, 8192)
    assert small == large < unbounded / 100


def test_make_drafter_passes_the_window_to_checkpoint_drafters():
  import jaxspec  # pylint: disable=import-outside-toplevel
  from jaxspec.drafters import registry  # pylint: disable=import-outside-toplevel

  target = jaxspec.load_model(registry.bundled_dir("target"))
  for method in ("dflash", "eagle3"):
    d = registry.make_drafter(
      method, target, draft_dir=registry.bundled_dir(method), context_window=512
    )
    assert d.context_window == 512
  with pytest.raises(jaxspec.ConfigError, match="takes no drafter options"):
    registry.make_drafter("mtp", target, context_window=512)
  with pytest.raises(jaxspec.ConfigError, match="takes no drafter options"):
    registry.load_drafter(registry.bundled_dir("draft"), target, context_window=512)
