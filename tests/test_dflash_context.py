"""DFlash's chunked context attention: the inference path reads only the live context slots.

The chunked reader (propose / block_logits: the store read as a `ContextRing` by the shared
`attention.attend_xla`) must equal the dense `block_attention` over
the whole store (training) for every visibility rule (per-row lengths, sliding windows, the
context ring), never read slots past the live ones, and keep greedy speculation lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters.base import PrefillContext
from jaxspec.drafters.dflash import (
  ContextView,
  block_attention,
  context_attention,
  context_visibility,
)
from jaxspec.drafters.features import target_head
from jaxspec.models import target as target_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from tests import near_ties
from tests.drafter_models import GreedyCheck, prompts, small_dflash, small_target

MASK = 2
CHUNK = 4  # smaller than the prompts, so every propose reads several chunks


@pytest.fixture(scope="module")
def target():
  return small_target(num_layers=3)


@pytest.fixture(scope="module")
def drafter(target):
  return small_dflash(target, context_chunk=CHUNK)


# ------------------------------------------------------------------------------------------------
# The attention itself: chunked equals dense
# ------------------------------------------------------------------------------------------------


def _store(lens, cap, ring, rng, k=2, d=8):
  """Random K/V [B, C, K, D] with slot positions as DFlashDrafter keeps them (slot = position,
  or position mod C in a ring holding the last C positions); empty slots hold −1."""
  b = len(lens)
  pos = np.full((b, cap), -1, np.int32)
  for r, n in enumerate(lens):
    for p in range(max(0, n - cap) if ring else 0, n):
      pos[r, p % cap] = p
  kk = rng.normal(size=(b, cap, k, d)).astype(np.float32)
  vv = rng.normal(size=(b, cap, k, d)).astype(np.float32)
  return jnp.asarray(kk), jnp.asarray(vv), jnp.asarray(pos)


def _both(lens, cap, window, ring, chunk, seed=0, t=4, h=4, k=2, d=8):
  rng = np.random.default_rng(seed)
  ctx_k, ctx_v, ctx_pos = _store(lens, cap, ring, rng, k, d)
  b = len(lens)
  q = jnp.asarray(rng.normal(size=(b, 1, t, h, d)).astype(np.float32))
  blk_k = jnp.asarray(rng.normal(size=(b, 1, t, k, d)).astype(np.float32))
  blk_v = jnp.asarray(rng.normal(size=(b, 1, t, k, d)).astype(np.float32))
  limit = jnp.asarray(lens, jnp.int32)[:, None]
  q_pos = limit[..., None] + jnp.arange(t, dtype=jnp.int32)
  scale = d**-0.5
  dense = block_attention(
    q, ctx_k, ctx_v, context_visibility(q_pos, ctx_pos, limit, window), blk_k, blk_v, scale
  )
  view = ContextView(q_pos, ctx_pos, limit, window, chunk)
  chunked = jax.jit(lambda *a: context_attention(*a, scale, view))(
    q, ctx_k, ctx_v, blk_k, blk_v
  )
  return np.asarray(chunked), np.asarray(dense)


@pytest.mark.parametrize("window", [0, 3, 5, 9])
@pytest.mark.parametrize(
  "lens,cap",
  [
    ((0, 1, 3, 4, 5, 8, 9), 40),  # around chunk borders, one row without context
    ((7, 8, 9), 10),  # the last chunk is clamped to the store's end (re-read slots masked)
    ((13, 16, 17), 40),  # all long: windowed layers skip the chunks before every window
    ((12, 12), 12),  # exactly a full store
  ],
)
def test_chunked_equals_dense(lens, cap, window):
  chunked, dense = _both(lens, cap, window, ring=False, chunk=CHUNK)
  np.testing.assert_allclose(chunked, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 4, 6])
@pytest.mark.parametrize("lens", [(2, 6, 7, 25), (13, 30)])
def test_chunked_equals_dense_on_a_ring(lens, window):
  """A 6-slot ring read in 4-slot chunks (the second one clamped), wrapped several times."""
  chunked, dense = _both(lens, 6, window or 6, ring=True, chunk=CHUNK)
  np.testing.assert_allclose(chunked, dense, atol=1e-5, rtol=1e-5)


def test_chunk_larger_than_the_store():
  chunked, dense = _both((2, 5), 6, 0, ring=False, chunk=256)
  np.testing.assert_allclose(chunked, dense, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# The drafter: block_logits after a prefill
# ------------------------------------------------------------------------------------------------


def _prefilled(target, drafter, lens, max_len, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(3, 64, (len(lens), max(lens))), jnp.int32)
  out = target_lib.forward(target.config, target.params, tokens, taps=drafter.taps)
  lens = jnp.asarray(lens, jnp.int32)
  st = drafter.init_state(drafter.params, len(lens), max_len)
  st = drafter.prefill(drafter.params, st, PrefillContext(tokens, lens, out.taps, out.hidden))
  block = jnp.concatenate(
    [tokens[jnp.arange(len(lens)), lens - 1][:, None], jnp.full((len(lens), 3), MASK)], axis=1
  )
  return st, block, lens


def _logits(drafter, state, block, start):
  return np.asarray(jax.jit(drafter.block_logits)(drafter.params, state, block, start))


@pytest.mark.parametrize(
  "layer_windows,max_len", [((0, 0), 40), ((0, 5), 40), ((6, 3), 10), ((0, 0), 10)]
)
def test_block_logits_chunked_equal_dense(target, drafter, layer_windows, max_len):
  """Per-row context lengths around the 4-slot chunk borders; max_len 10 clamps the last chunk."""
  d = dataclasses.replace(drafter, config=drafter.config.replace(layer_windows=layer_windows))
  st, block, start = _prefilled(target, d, (3, 4, 5, 8, 9), max_len)
  dense = _logits(dataclasses.replace(d, context_chunk=0), st, block, start)
  np.testing.assert_allclose(_logits(d, st, block, start), dense, atol=1e-5, rtol=1e-5)


def test_slots_past_the_live_length_are_not_read(target, drafter):
  """Large finite garbage past each row's context changes nothing; NaN in the slots past the
  last chunk read (ceil(max len / chunk) chunks) is never touched, while the dense path reads
  it; a live slot does change the output."""
  lens = (5, 9)
  st, block, start = _prefilled(target, drafter, lens, 32)
  base = _logits(drafter, st, block, start)
  slot = np.arange(32)[None, None, :, None, None]  # store [L, B, C, K, D]
  past = slot >= np.asarray(lens)[None, :, None, None, None]
  garbage = dataclasses.replace(
    st, ctx_k=jnp.where(past, 1e6, st.ctx_k), ctx_v=jnp.where(past, -1e6, st.ctx_v)
  )
  np.testing.assert_array_equal(_logits(drafter, garbage, block, start), base)

  unread = slot >= -(-max(lens) // CHUNK) * CHUNK
  poisoned = dataclasses.replace(
    st, ctx_k=jnp.where(unread, jnp.nan, st.ctx_k), ctx_v=jnp.where(unread, jnp.nan, st.ctx_v)
  )
  np.testing.assert_array_equal(_logits(drafter, poisoned, block, start), base)
  dense = dataclasses.replace(drafter, context_chunk=0)
  assert np.isnan(_logits(dense, poisoned, block, start)).all()

  live = dataclasses.replace(st, ctx_v=st.ctx_v.at[:, 0, lens[0] - 1].add(1.0))
  changed = _logits(drafter, live, block, start)
  assert not np.allclose(changed[0], base[0], atol=1e-3)
  np.testing.assert_array_equal(changed[1], base[1])


def test_training_path_stays_dense_and_differentiable(target, drafter):
  """train_hidden (N blocks) keeps the dense attention: it has gradients, and its block at an
  anchor equals the chunked inference block_logits there."""
  s = 12
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (1, s)), jnp.int32)
  taps = target_lib.forward(target.config, target.params, tokens, taps=drafter.taps).taps
  anchors = jnp.array([[3, 9]], jnp.int32)

  def loss(draft):
    params = {**drafter.params, "draft": draft}
    return jnp.sum(drafter.train_hidden(params, tokens, taps, anchors) ** 2)

  grads = jax.jit(jax.grad(loss))(drafter.params["draft"])
  norms = [float(jnp.linalg.norm(g)) for g in jax.tree_util.tree_leaves(grads)]
  assert all(np.isfinite(norms)) and sum(norms) > 0

  hidden = jax.jit(drafter.train_hidden)(drafter.params, tokens, taps, anchors)
  pre = target_lib.forward(target.config, target.params, tokens[:, :9], taps=drafter.taps)
  st = drafter.init_state(drafter.params, 1, s)
  st = drafter.prefill(
    drafter.params, st, PrefillContext(tokens[:, :9], jnp.array([9]), pre.taps, pre.hidden)
  )
  block = jnp.concatenate([tokens[:, 9:10], jnp.full((1, 3), MASK)], axis=1)
  got = _logits(drafter, st, block, jnp.array([9]))
  want = np.asarray(target_head(drafter.params, hidden[:, 1], drafter.config.dtype))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# End to end: greedy speculation with a chunk smaller than the prompts
# ------------------------------------------------------------------------------------------------


def test_greedy_speculation_equals_plain(target, drafter):
  assert drafter.context_chunk < min(len(p) for p in prompts(2, 64))
  GreedyCheck(target, drafter).check(2)


def test_context_ring_greedy_equals_plain(target, drafter):
  """A 6-slot ring (wrapped many times) read in 4-slot chunks, with a 5-wide layer window."""
  ring = dataclasses.replace(
    drafter, config=drafter.config.replace(layer_windows=(0, 5)), context_window=6
  )
  cfg = EngineConfig(max_len=80, batch_size=2, use_eos=False)
  ps = prompts(2, 64)
  plain = SpecEngine(target, None, cfg).generate(ps, max_new_tokens=24)
  spec = SpecEngine(target, ring, cfg).generate(ps, max_new_tokens=24)
  near_ties.assert_greedy_match(target, ps, plain.tokens, spec.tokens)

  st, block, start = _prefilled(target, ring, (3, 6, 7, 11), 80)
  assert st.ctx_k.shape[2] == 6
  dense = _logits(dataclasses.replace(ring, context_chunk=0), st, block, start)
  np.testing.assert_allclose(_logits(ring, st, block, start), dense, atol=1e-5, rtol=1e-5)


def test_context_chunk_is_validated(drafter):
  with pytest.raises(ValueError, match="context_chunk"):
    dataclasses.replace(drafter, context_chunk=-1)
