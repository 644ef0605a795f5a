"""The sliding-window state kind (jaxspec/state/sliding.py) against full-length K/V.

A gpt-oss-shaped target (sliding window 5 on layers 0 and 2, full attention on layer 1, sinks)
runs the same sequence of blocks over two decoding states: sliding layers as rings of
window + slack slots, and every layer holding every position. The sequence covers what a
generation does to a ring: a padded prefill chunk wider than the ring (read before it is
written, padding never stored), chain blocks accepted in part (rejected tokens left in the
ring), and tree blocks whose accepted path is moved into place; the text grows to several
times the ring. Every block's logits must agree in each KV format, and two broken rings (a
slack below the verify width; a tree commit that does not move the path) must not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.io.architectures import config_from_hf
from jaxspec.models import target as target_lib
from jaxspec.state import DecodingState, SlidingKV

from tests import hf_models

WINDOW, WIDTH, MAX_LEN, B = 5, 4, 96, 2
# A tree of WIDTH nodes: 0 → {1, 2}, 1 → 3; ancestor-or-self mask, depths, accepted paths.
PARENTS = (-1, 0, 0, 1)
DEPTH = np.array([0, 1, 1, 2], np.int32)
MASK = np.eye(WIDTH, dtype=bool)
for _i, _p in enumerate(PARENTS):
  while _p >= 0:
    MASK[_i, _p] = True
    _p = PARENTS[_p]
PATHS = np.array([[0, 1], [0, 2]], np.int32)  # the rows accept different branches


@pytest.fixture(scope="module")
def target():
  hf = {**hf_models.CONFIGS["gptoss_sliding_sinks"][2], "architectures": ["GptOssForCausalLM"]}
  hf.update(sliding_window=WINDOW, hidden_size=32, head_dim=32)  # Q4_0: blocks of 32 values
  config = config_from_hf(hf).with_options(dtype="float32", param_dtype="float32")
  model = target_lib.TargetModel.random(config, seed=0)
  params = jax.tree_util.tree_map(lambda x: x * 3.0, model.params)  # sharper: fewer ties
  return config, params


@functools.lru_cache(maxsize=None)
def _forward(config):
  return jax.jit(
    lambda params, tokens, start, state, positions, mask, valid: target_lib.apply_decoder(
      config, params, tokens, start, state, positions=positions, block_mask=mask, valid=valid
    )[:2]
  )


def _run(config, params, state, rounds: int = 9, seed: int = 0):
  """Prefill, then alternate chain blocks (accepted in part) and tree blocks (a path moved
  into place); the logits of every block, in order."""
  rng = np.random.default_rng(seed)
  fwd = _forward(config)
  vocab = config.vocab_size
  prompt = rng.integers(0, vocab, (B, 16))
  valid = jnp.asarray([16, 11], jnp.int32)  # row 1 is padded: 5 positions never stored
  zero = jnp.zeros((B,), jnp.int32)
  logits, state = fwd(params, prompt, zero, state, None, None, valid)
  out = [np.asarray(logits)[0, :16], np.asarray(logits)[1, :11]]
  state = state.with_lengths(valid)
  for r in range(rounds):
    start = state.lengths
    tokens = rng.integers(0, vocab, (B, WIDTH))
    if r % 2 == 0:  # chain: causal block, rows accept 0..WIDTH tokens
      logits, state = fwd(params, tokens, start, state, None, None, None)
      state = state.commit(jnp.asarray(rng.integers(0, WIDTH + 1, B), jnp.int32))
    else:  # tree: ancestor mask, RoPE at depth, the accepted path moved to start..
      positions = start[:, None] + DEPTH[None]
      logits, state = fwd(params, tokens, start, state, positions, jnp.asarray(MASK), None)
      state = state.commit_path(jnp.asarray(PATHS)).commit(jnp.full((B,), PATHS.shape[1]))
    out.append(np.asarray(logits))
  assert int(state.lengths.min()) > 3 * (WINDOW + WIDTH)  # the rings wrapped 3+ times
  return out


@pytest.mark.parametrize("fmt", ["float", "fp8", "q4_0"])
def test_ring_equals_full_length_kv(target, fmt):
  config, params = target
  ring = DecodingState.create(config, B, MAX_LEN, fmt, slack=WIDTH)
  kinds = [type(s).__name__ for s in ring.segments]
  assert kinds.count("SlidingKV") == 2  # layers 0 and 2; layer 1 keeps every position
  assert all(s.max_len == WINDOW + WIDTH for s in ring.segments if isinstance(s, SlidingKV))
  assert ring.max_len == MAX_LEN
  full = DecodingState.create(config, B, MAX_LEN, fmt, slack=MAX_LEN)
  assert not any(isinstance(s, SlidingKV) for s in full.segments)
  for a, b in zip(_run(config, params, ring), _run(config, params, full)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


def test_ring_is_the_window_not_the_context(target):
  config, _ = target
  bytes_of = lambda max_len, slack: sum(
    x.size * x.dtype.itemsize
    for x in jax.tree_util.tree_leaves(
      jax.eval_shape(lambda: DecodingState.create(config, 1, max_len, slack=slack))
    )
  )
  short, long = bytes_of(1024, WIDTH), bytes_of(32768, WIDTH)
  full_short, full_long = bytes_of(1024, 10**6), bytes_of(32768, 10**6)
  # Only the full layer (1 of 3) grows with the context.
  assert (long - short) * 3 == pytest.approx((full_long - full_short), rel=1e-6)


def _differs(a_outs, b_outs) -> float:
  return max(float(np.abs(a - b).max()) for a, b in zip(a_outs, b_outs))


def test_a_ring_without_verify_slack_goes_wrong(target):
  """A ring of window + 1 slots under 4-token blocks: rejected tokens displace keys still
  inside the window, and later queries read wrong values."""
  config, params = target
  full = DecodingState.create(config, B, MAX_LEN, slack=MAX_LEN)
  short = DecodingState.create(config, B, MAX_LEN, slack=1)
  assert _differs(_run(config, params, short), _run(config, params, full)) > 1e-3


def test_a_tree_commit_that_leaves_the_path_in_place_goes_wrong(target, monkeypatch):
  config, params = target
  full = DecodingState.create(config, B, MAX_LEN, slack=MAX_LEN)
  want = _run(config, params, full)
  monkeypatch.setattr(SlidingKV, "commit_path", lambda self, start, path: self)
  _forward.cache_clear()
  ring = DecodingState.create(config, B, MAX_LEN, slack=WIDTH)
  got = _run(config, params, ring)
  _forward.cache_clear()
  assert _differs(got, want) > 1e-3
