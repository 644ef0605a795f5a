"""pallas_kernels/tree_attention: the Pallas kernel (interpret mode) against the jnp reference,
and the reference against the decoder's XLA attention path, on random draft trees.

No GPU was available for these tests: the kernel runs with interpret=True on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import layers
from jaxspec.spec.tree import build_tree
from pallas_kernels.tree_attention import (
  tree_attention,
  tree_attention_pallas,
  tree_attention_reference,
)


def _case(seed, batch, budget, heads, kv_heads, head_dim, cache_len, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  t = budget + 1
  lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(batch, 4, 16)) * 2, jnp.float32), -1)
  tree = build_tree(jnp.zeros((batch,), jnp.int32), lp, budget)
  start = jnp.asarray(rng.integers(0, cache_len - t + 1, batch), jnp.int32)
  q = jnp.asarray(rng.normal(size=(batch, t, heads, head_dim)), dtype)
  k = jnp.asarray(rng.normal(size=(batch, cache_len, kv_heads, head_dim)), dtype)
  v = jnp.asarray(rng.normal(size=(batch, cache_len, kv_heads, head_dim)), dtype)
  return q, k, v, start, tree.mask


@pytest.mark.parametrize(
  "seed, batch, budget, heads, kv_heads, cache_len, block_k",
  [
    (0, 1, 6, 2, 1, 32, 16),  # one sequence, MQA
    (1, 3, 10, 4, 2, 50, 16),  # cache not a multiple of the tile (padded), GQA
    (2, 2, 22, 4, 4, 64, 32),  # DDTree's default budget (23 slots → 32 padded queries)
  ],
)
def test_pallas_kernel_matches_reference(seed, batch, budget, heads, kv_heads, cache_len, block_k):
  q, k, v, start, mask = _case(seed, batch, budget, heads, kv_heads, 8, cache_len)
  want = tree_attention_reference(q, k, v, start, mask)
  got = tree_attention_pallas(q, k, v, start, mask, block_k=block_k, interpret=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_pallas_kernel_edge_lengths_and_shared_mask():
  # Empty prefix for one sequence, block ending at the last slot for the other; a [T, T] mask.
  q, k, v, _, mask = _case(3, 2, 5, 2, 1, 8, 24)
  start = jnp.array([0, 24 - 6], jnp.int32)
  shared = mask[0]
  want = tree_attention_reference(q, k, v, start, shared)
  got = tree_attention_pallas(q, k, v, start, shared, block_k=16, interpret=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_pallas_kernel_bfloat16():
  q, k, v, start, mask = _case(4, 2, 7, 4, 2, 8, 40, jnp.bfloat16)
  want = tree_attention_reference(q, k, v, start, mask).astype(jnp.float32)
  got = tree_attention_pallas(q, k, v, start, mask, block_k=16, interpret=True)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(want), atol=3e-2)


def test_reference_equals_the_decoder_xla_path():
  q, k, v, start, mask = _case(5, 3, 12, 4, 2, 8, 48)
  t = q.shape[1]
  visible = layers.block_visibility(start, t, k.shape[1], mask)
  want = layers.gqa_attention(q, k, v, visible, 8**-0.5)
  np.testing.assert_allclose(
    np.asarray(tree_attention_reference(q, k, v, start, mask)), np.asarray(want), atol=1e-6
  )
  np.testing.assert_allclose(
    np.asarray(tree_attention(q, k, v, start, mask, impl="xla")), np.asarray(want), atol=1e-6
  )
  with pytest.raises(ValueError, match="impl"):
    tree_attention(q, k, v, start, mask, impl="cuda")
