"""pallas_kernels/tree_attention: the Pallas kernel (interpret mode) against the jnp reference,
and the reference against the decoder's XLA attention path, on random draft trees.

No GPU was available for these tests: the kernel runs with interpret=True on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import attention
from jaxspec.speculative.tree import build_tree
from jaxspec.state import FloatKV
from pallas_kernels.tree_attention import (
  choose_num_splits,
  combine_splits,
  tree_attention,
  tree_attention_pallas,
  tree_attention_partials,
  tree_attention_reference,
)
from pallas_kernels.tree_attention import reference

_build_tree = jax.jit(build_tree, static_argnums=2)  # one compile, not one per eager op


def _case(seed, batch, budget, heads, kv_heads, head_dim, cache_len, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  t = budget + 1
  lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(batch, 4, 16)) * 2, jnp.float32), -1)
  tree = _build_tree(jnp.zeros((batch,), jnp.int32), lp, budget)
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
  # The decoder's attention (jaxspec.models.attention) writes the block into layer 1 of a stacked
  # state whose block slots hold stale zeros, then attends: the reference on the written cache.
  q, k, v, start, mask = _case(5, 3, 12, 4, 2, 8, 48)
  t = q.shape[1]
  rows, slots = jnp.arange(q.shape[0])[:, None], start[:, None] + jnp.arange(t)
  stale = lambda x: jnp.zeros((2, *x.shape), x.dtype).at[1].set(x.at[rows, slots].set(0))
  kv = FloatKV(stale(k), stale(v))
  decoder = jax.jit(attention.attention, static_argnames=("impl",))
  want, kv = decoder(
    q, k[rows, slots], v[rows, slots], kv, jnp.int32(1), start, mask, 8**-0.5, impl="xla"
  )
  np.testing.assert_array_equal(np.asarray(kv.k[1]), np.asarray(k))
  np.testing.assert_allclose(
    np.asarray(tree_attention_reference(q, k, v, start, mask)), np.asarray(want), atol=1e-6
  )
  np.testing.assert_allclose(
    np.asarray(tree_attention(q, kv.k, kv.v, start, mask, impl="xla", layer=1)),
    np.asarray(want),
    atol=1e-6,
  )
  with pytest.raises(ValueError, match="impl"):
    tree_attention(q, k, v, start, mask, impl="cuda")


# --- GQA grouping, split-K, stacked cache, FP8 scales, mask kinds --------------------------------
# Tiny shapes, numpy-built trees (no build_tree compile), and varied starts as traced values so
# several checks share one compiled kernel.

TOL = {"atol": 2e-5, "rtol": 2e-5}


def _tree_masks(rng, batch, t):
  """[B, T, T] bool ancestor-or-self masks of random trees (node i's parent drawn from [0, i))."""
  masks = np.zeros((batch, t, t), bool)
  for b in range(batch):
    for i in range(t):
      if i:
        masks[b, i] = masks[b, rng.integers(0, i)]
      masks[b, i, i] = True
  return jnp.asarray(masks)


def _qkv(rng, batch, t, heads, kv_heads, cache_len, n_layers=None, head_dim=8):
  lead = () if n_layers is None else (n_layers,)
  q = jnp.asarray(rng.normal(size=(batch, t, heads, head_dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=lead + (batch, cache_len, kv_heads, head_dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=lead + (batch, cache_len, kv_heads, head_dim)), jnp.float32)
  return q, k, v


def _pallas_calls(fn, *args):
  """The pallas_call equations in fn's jaxpr (searched through nested jits)."""

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        yield eqn
      for p in eqn.params.values():
        inner = getattr(p, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          yield from walk(inner)

  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _close(got, want):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_gqa_groups_one_program_per_kv_head(group):
  rng = np.random.default_rng(10 + group)
  kv_heads, t, s_len = 2, 6, 40
  q, k, v = _qkv(rng, 3, t, kv_heads * group, kv_heads, s_len)
  start = jnp.array([0, 13, s_len - t], jnp.int32)
  mask = _tree_masks(rng, 3, t)
  run = lambda q, k, v: tree_attention_pallas(
    q, k, v, start, mask, block_k=16, interpret=True, num_splits=2
  )
  want = tree_attention_reference(q, k, v, start, mask)
  _close(run(q, k, v), want)
  # Grid (B, K, splits): K/V are read once per KV head, not once per query head.
  (call,) = _pallas_calls(run, q, k, v)
  assert call.params["grid_mapping"].grid == (3, kv_heads, 2)
  if group > 1:  # query heads of a group are distinct: a head-order mix-up would show
    swapped = q.at[:, :, [0, 1]].set(q[:, :, [1, 0]])
    assert not np.allclose(np.asarray(run(swapped, k, v)), np.asarray(want), **TOL)


@pytest.mark.parametrize("num_splits", [2, 3, 6])
def test_splits_at_tile_and_split_borders_per_row_starts(num_splits):
  # S = 90: six 16-slot tiles, the last one loaded from slot 74 (clamped, its first 6 slots
  # masked); num_splits 2, 3, 6 → partitions of 48, 32, 16 slots (1 split: the tests above).
  # One batch row per start: 0, at / around multiples of 16, 32 and 48, and the block ending
  # at the last slot.
  rng = np.random.default_rng(20)
  t, cache_len, heads = 5, 90, 2
  starts = [0, 11, 15, 16, 17, 27, 31, 32, 43, 47, 48, 63, 64, 75, cache_len - t]
  batch = len(starts)
  q, k, v = _qkv(rng, batch, t, heads, 1, cache_len)
  start = jnp.asarray(starts, jnp.int32)
  mask = _tree_masks(rng, batch, t)
  want = tree_attention_reference(q, k, v, start, mask)
  # Slots past each block never reach the result, even when they hold NaN.
  stale = jnp.arange(cache_len)[None, :, None, None] >= (start + t)[:, None, None, None]
  k, v = jnp.where(stale, jnp.nan, k), jnp.where(stale, jnp.nan, v)
  acc, m, l = tree_attention_partials(
    q, k, v, start, mask, block_k=16, interpret=True, num_splits=num_splits
  )
  n = -(-6 // -(-6 // num_splits))  # effective partitions of the 6 tiles
  assert acc.shape[:3] == (batch, 1, n)
  merged = combine_splits(acc, m, l)[:, 0, : heads * t]  # rows g * T + t (one KV head)
  got = merged.reshape(batch, heads, t, -1).transpose(0, 2, 1, 3)
  _close(got, want)
  # Partitions wholly past start + T are skipped (nothing accumulated); the others are not.
  first_slot = np.arange(n) * (-(-6 // n)) * 16
  skipped = first_slot[None, :] >= np.asarray(start + t)[:, None]  # [B, N]
  l_real = np.asarray(l)[:, 0, :, : heads * t]  # [B, N, G*T]
  assert np.all(l_real[skipped] == 0) and np.all(l_real[~skipped] > 0)
  # Rows whose live length spans several partitions need the merge: partition 0 alone differs.
  multi = (~skipped).sum(1) > 1
  assert multi.any() == (n > 1)
  if n > 1:
    first_only = combine_splits(acc[:, :, :1], m[:, :, :1], l[:, :, :1])[:, 0, : heads * t]
    assert not np.allclose(np.asarray(first_only)[multi], np.asarray(merged)[multi], **TOL)


def test_auto_num_splits():
  assert choose_num_splits(96, 16, split_len=32) == 3
  assert choose_num_splits(4096, 64) == 8  # ceil(4096 / 512)
  assert choose_num_splits(100, 64) == 1
  assert choose_num_splits(4096, 64, split_len=16) == 64  # at most one split per tile
  rng = np.random.default_rng(30)
  q, k, v = _qkv(rng, 2, 4, 2, 1, 64)
  start = jnp.array([3, 60], jnp.int32)
  run = lambda q, k, v: tree_attention_pallas(
    q, k, v, start, None, block_k=16, interpret=True, split_len=32
  )
  (call,) = _pallas_calls(run, q, k, v)
  assert call.params["grid_mapping"].grid == (2, 1, 2)  # ceil(64 / 32) partitions
  _close(run(q, k, v), tree_attention_reference(q, k, v, start, None))


def test_stacked_cache_layer_index():
  rng = np.random.default_rng(40)
  layers, t, s_len = 3, 5, 48
  q, k, v = _qkv(rng, 2, t, 4, 2, s_len, n_layers=layers)
  start = jnp.array([7, 32], jnp.int32)
  mask = _tree_masks(rng, 2, t)
  run = lambda q, k, v, layer: tree_attention_pallas(
    q, k, v, start, mask, block_k=16, interpret=True, num_splits=2, layer=layer
  )
  outs = {}
  for layer in (0, layers - 1):
    got = run(q, k, v, jnp.int32(layer))  # traced: one compilation serves every layer
    _close(got, tree_attention_reference(q, k[layer], v[layer], start, mask))
    _close(got, tree_attention_reference(q, k, v, start, mask, layer=layer))
    outs[layer] = np.asarray(got)
  assert not np.allclose(outs[0], outs[layers - 1], **TOL)  # a wrong layer index would show
  # The kernel takes the whole stacked cache as its operand: no per-layer copy is sliced out.
  (call,) = _pallas_calls(run, q, k, v, jnp.int32(1))
  shapes = [x.aval.shape for x in call.invars]
  assert shapes.count(k.shape) == 2
  with pytest.raises(ValueError, match="layer"):
    tree_attention_pallas(q, k, v, start, mask, interpret=True)
  with pytest.raises(ValueError, match="layer"):
    tree_attention_pallas(q, k[0], v[0], start, mask, interpret=True, layer=0)


def _fp8(rng, x):
  """x ≈ x8.astype(f32) * scale[..., None]: per-(slot, head) scales, deliberately far from 1."""
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = amax / 448.0 * jnp.asarray(rng.uniform(2.0, 8.0, size=amax.shape), jnp.float32)
  x8 = (x / scale[..., None]).astype(jnp.float8_e4m3fn)
  return x8, scale.astype(jnp.float32)


def test_fp8_scales():
  rng = np.random.default_rng(50)
  t, s_len = 6, 40
  q, k, v = _qkv(rng, 2, t, 4, 2, s_len, n_layers=2)
  k8, ks = _fp8(rng, k)
  v8, vs = _fp8(rng, v)
  start = jnp.array([16, 34], jnp.int32)
  mask = _tree_masks(rng, 2, t)
  layer = jnp.int32(1)
  got = tree_attention(
    q, k8, v8, start, mask, impl="pallas", interpret=True, block_k=16, num_splits=2,
    layer=layer, k_scale=ks, v_scale=vs,
  )  # fmt: skip
  want = tree_attention(q, k8, v8, start, mask, impl="xla", layer=layer, k_scale=ks, v_scale=vs)
  _close(got, want)
  k_deq = k8[1].astype(jnp.float32) * ks[1][..., None]
  v_deq = v8[1].astype(jnp.float32) * vs[1][..., None]
  _close(got, tree_attention_reference(q, k_deq, v_deq, start, mask))
  # One layer's cache [B, S, K, D] with [B, S, K] scales.
  one = tree_attention_pallas(
    q, k8[1], v8[1], start, mask, block_k=16, interpret=True, num_splits=2, k_scale=ks[1],
    v_scale=vs[1],
  )  # fmt: skip
  _close(one, want)
  # Dropping either scale changes the answer (so the kernel must apply both).
  raw = lambda x: x.astype(jnp.float32)
  no_k = tree_attention_reference(q, raw(k8), v8, start, mask, layer=layer, v_scale=vs)
  no_v = tree_attention_reference(q, k8, raw(v8), start, mask, layer=layer, k_scale=ks)
  for wrong in (no_k, no_v):
    assert not np.allclose(np.asarray(got), np.asarray(wrong), **TOL)


@pytest.mark.parametrize("kind", ["causal", "shared_2d", "per_row_3d"])
def test_mask_kinds(kind):
  rng = np.random.default_rng(60)
  t, s_len = 7, 48
  q, k, v = _qkv(rng, 3, t, 4, 2, s_len)
  start = jnp.array([0, 16, 41], jnp.int32)
  trees = _tree_masks(rng, 3, t)
  mask = {"causal": None, "shared_2d": trees[0], "per_row_3d": trees}[kind]
  got = tree_attention_pallas(q, k, v, start, mask, block_k=16, interpret=True, num_splits=3)
  want = tree_attention_reference(q, k, v, start, mask)
  _close(got, want)
  if kind == "causal":  # None means the lower-triangular mask, which is not all-visible
    tril = jnp.tril(jnp.ones((t, t), bool))
    _close(want, tree_attention_reference(q, k, v, start, tril))
    full = tree_attention_reference(q, k, v, start, jnp.ones((t, t), bool))
    assert not np.allclose(np.asarray(got), np.asarray(full), **TOL)
  else:  # the ancestor mask matters: all-causal would differ
    assert not np.allclose(
      np.asarray(got), np.asarray(tree_attention_reference(q, k, v, start, None)), **TOL
    )


def test_paged_pools_read_through_the_page_table():
  """Pools [L, P, page, K, D] and a page table that scatters each sequence's pages over the
  pool: the kernel (float and FP8, tree and causal masks, tiles smaller than a page, verify
  blocks that cross pages) equals the reference over the contiguous cache the table describes.
  A table with two sequences swapped fails it."""
  rng = np.random.default_rng(70)
  batch, t, page, width, pages = 2, 5, 16, 4, 11  # 64 logical slots per sequence
  q = jnp.asarray(rng.normal(size=(batch, t, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, pages, page, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, pages, page, 2, 8)), jnp.float32)
  table = jnp.asarray(rng.permutation(pages)[: batch * width].reshape(batch, width), jnp.int32)
  table = table.at[0, 3].set(pages)  # unmapped: past sequence 0's live length
  start = jnp.array([14, 44], jnp.int32)  # sequence 0's block crosses its first page
  layer = jnp.int32(1)
  for mask in (_tree_masks(rng, batch, t), None):
    got = tree_attention(
      q, k, v, start, mask, impl="pallas", interpret=True, block_k=16, num_splits=2,
      layer=layer, page_table=table,
    )  # fmt: skip
    want = tree_attention(q, k, v, start, mask, impl="xla", layer=layer, page_table=table)
    _close(got, want)
    flat_k, flat_v = (reference.gather_pages(x, table, True) for x in (k, v))
    _close(got, tree_attention_reference(q, flat_k, flat_v, start, mask, layer=layer))
  swapped = tree_attention(q, k, v, start, None, impl="xla", layer=layer, page_table=table[::-1])
  assert not np.allclose(np.asarray(got), np.asarray(swapped), **TOL)
  k8, ks = _fp8(rng, k)
  v8, vs = _fp8(rng, v)
  fp8 = dict(layer=layer, k_scale=ks, v_scale=vs, page_table=table)
  got = tree_attention(q, k8, v8, start, None, impl="pallas", interpret=True, block_k=16, **fp8)
  _close(got, tree_attention(q, k8, v8, start, None, impl="xla", **fp8))
  with pytest.raises(ValueError, match="power of two"):
    tree_attention_pallas(q, k[:, :, :12], v[:, :, :12], start, None, interpret=True,
                          layer=layer, page_table=table)  # fmt: skip
