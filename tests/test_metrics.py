"""Tests for jaxspec.speculative.metrics: on-device accumulation and host summary."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.speculative.metrics import SpecStats, init_stats, summarize, update_stats


def test_init_shapes():
  s = init_stats(3, 4)
  assert s.target_passes.shape == (3,) and s.tokens_committed.shape == (3,)
  assert s.accept_hist.shape == (3, 5) and s.gamma == 4
  assert all(x.dtype == jnp.int32 for x in jax.tree_util.tree_leaves(s))


def test_update_counts_active_rows_only_and_jits():
  s = init_stats(3, 2)
  step = jax.jit(update_stats)
  s = step(s, jnp.array([2, 0, 1]), jnp.array([True, True, False]))
  s = step(s, jnp.array([1, 2, 2]), jnp.array([True, True, True]))
  np.testing.assert_array_equal(s.target_passes, [2, 2, 1])
  np.testing.assert_array_equal(s.tokens_committed, [5, 4, 3])
  np.testing.assert_array_equal(s.accept_hist, [[0, 1, 1], [1, 0, 1], [0, 0, 1]])


def test_update_with_truncated_commit():
  s = update_stats(
    init_stats(2, 3), jnp.array([3, 3]), jnp.array([True, True]), num_committed=jnp.array([2, 4])
  )
  np.testing.assert_array_equal(s.tokens_committed, [2, 4])
  np.testing.assert_array_equal(s.accept_hist[:, 3], [1, 1])


def test_summarize():
  s = init_stats(2, 2)
  # Row 0: n = 2, 2, 0 ; row 1: n = 1.
  for n, act in [([2, 1], [1, 1]), ([2, 0], [1, 0]), ([0, 0], [1, 0])]:
    s = update_stats(s, jnp.array(n), jnp.array(act, bool))
  out = summarize(s, elapsed_s=2.0, ttft_s=0.25)
  assert out["target_passes"] == 4
  assert out["tokens_committed"] == 3 + 3 + 1 + 2
  assert out["acceptance_length"] == 9 / 4
  np.testing.assert_allclose(out["acceptance_length_per_seq"], [7 / 3, 2.0])
  assert out["accept_hist"] == [1, 1, 2]
  # Position 0 reached in 4 passes, accepted in 3; position 1 reached in 3, accepted in 2.
  np.testing.assert_allclose(out["acceptance_rate_per_position"], [3 / 4, 2 / 3])
  np.testing.assert_allclose(out["accepted_at_least"], [3 / 4, 2 / 4])
  assert out["tokens_per_second"] == 9 / 2.0
  assert out["ttft_s"] == 0.25 and out["elapsed_s"] == 2.0


def test_summarize_empty_is_nan_not_error():
  out = summarize(init_stats(1, 3), elapsed_s=0.0)
  assert math.isnan(out["acceptance_length"]) and math.isnan(out["tokens_per_second"])
  assert all(math.isnan(r) for r in out["acceptance_rate_per_position"])
  assert out["ttft_s"] is None


def test_stats_is_a_pytree_usable_in_while_loop():
  def body(carry):
    i, s = carry
    return i + 1, update_stats(s, jnp.array([i % 3, 1]), jnp.array([True, i < 2]))

  _, s = jax.lax.while_loop(lambda c: c[0] < 5, body, (0, init_stats(2, 2)))
  assert isinstance(s, SpecStats)
  np.testing.assert_array_equal(s.target_passes, [5, 2])
  np.testing.assert_array_equal(s.accept_hist[0], [2, 2, 1])
