"""The paged kind (jaxspec/state/paged.py) against contiguous K/V.

The same sequence of blocks as tests/test_sliding_kv.py (a padded prefill chunk, chain blocks
accepted in part, tree blocks whose path is moved into place) runs over a contiguous state and
over a paged one whose rows own scattered pages of a pool of 3-slot pages, so every verify
block crosses a page boundary and no row's pages are in order. Every block's logits must agree
in each KV format; a broken table (two rows sharing a page) must not. The same holds for a DSA
target, whose MLA latents and indexer keys are paged under one table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import ConfigError
from jaxspec.io.architectures import config_from_hf
from jaxspec.models import target as target_lib
from jaxspec.state import (
  DEFAULT_SLACK,
  LATENT_FORMATS,
  DecodingState,
  IndexerKeys,
  PagedKV,
  Paging,
  SlidingKV,
  SparseLatent,
)

from tests import hf_models
from tests.test_sliding_kv import B, MAX_LEN, WIDTH, _differs, _run
from tests.test_sliding_kv import target  # noqa: F401  (the shared module fixture)

PAGE = 3
PAGES_PER_ROW = MAX_LEN // PAGE


def _scattered(num_pages: int, seed: int = 0) -> np.ndarray:
  """A [B, W] table of distinct pages drawn from the pool in a random order."""
  pages = np.random.default_rng(seed).permutation(num_pages)[: B * PAGES_PER_ROW]
  return pages.reshape(B, PAGES_PER_ROW).astype(np.int32)


def _paged(config, fmt: str, slack: int, table: np.ndarray, num_pages: int) -> DecodingState:
  state = DecodingState.create(config, B, MAX_LEN, fmt, slack=slack, paging=Paging(PAGE, num_pages))
  return state.with_page_table(jnp.asarray(table))


@pytest.mark.parametrize("fmt", ["float", "fp8", "q4_0"])
def test_paged_equals_contiguous_kv(target, fmt):  # noqa: F811
  """FP8 and Q4_0: every layer paged; float: the sliding runs keep their per-row rings beside
  the paged full-attention run."""
  config, params = target
  num_pages = B * PAGES_PER_ROW + 7
  slack = WIDTH if fmt == "float" else MAX_LEN
  paged = _paged(config, fmt, slack, _scattered(num_pages), num_pages)
  kinds = [type(s) for s in paged.segments]
  assert kinds == ([SlidingKV, PagedKV, SlidingKV] if fmt == "float" else [PagedKV] * 3)
  assert paged.max_len == MAX_LEN and paged.kv_format == fmt
  contiguous = DecodingState.create(config, B, MAX_LEN, fmt, slack=slack)
  for a, b in zip(_run(config, params, paged), _run(config, params, contiguous)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


def test_rows_sharing_a_page_go_wrong(target):  # noqa: F811
  config, params = target
  num_pages = B * PAGES_PER_ROW
  table = _scattered(num_pages)
  table[1, 2] = table[0, 2]  # row 1's third page is row 0's
  paged = _paged(config, "float", MAX_LEN, table, num_pages)
  contiguous = DecodingState.create(config, B, MAX_LEN, slack=MAX_LEN)
  assert _differs(_run(config, params, paged), _run(config, params, contiguous)) > 1e-3


def test_unmapped_pages_drop_writes_and_read_zeros(target):  # noqa: F811
  config, _ = target
  state = DecodingState.create(config, 1, MAX_LEN, slack=MAX_LEN, paging=Paging(PAGE, 4))
  entry = state.segments[0]
  assert np.asarray(entry.table[0, 4:]).tolist() == [4] * (PAGES_PER_ROW - 4)  # unmapped
  k = jnp.ones((1, 2 * PAGE, *entry.pool.k.shape[3:]))
  entry, _, _ = entry.write(jnp.int32(0), jnp.asarray([3 * PAGE]), k, k)  # pages 3 and 4
  read_k, _ = entry.read(jnp.int32(0), jnp.int32(3 * PAGE), 2 * PAGE)
  np.testing.assert_array_equal(np.asarray(read_k[0, :, 0, 0]), [1.0] * PAGE + [0.0] * PAGE)
  assert float(jnp.abs(entry.pool.k).sum()) == PAGE * k[0, 0].size  # nothing else written


def test_paging_is_checked(target):  # noqa: F811
  config, _ = target
  with pytest.raises(ConfigError, match="page_size must divide"):
    DecodingState.create(config, 1, MAX_LEN, paging=Paging(7))


def test_adopt_row_copies_pages_into_the_slot(target):  # noqa: F811
  config, _ = target
  num_pages = 2 * PAGES_PER_ROW + 3
  big = _paged(config, "fp8", MAX_LEN, _scattered(num_pages, seed=2), num_pages)
  row = DecodingState.create(config, 1, MAX_LEN, "fp8", slack=MAX_LEN, paging=Paging(PAGE))
  k = jax.random.normal(jax.random.PRNGKey(0), (1, 10, *row.segments[0].pool.k.shape[3:]))
  entry, _, _ = row.segments[0].write(jnp.int32(0), jnp.asarray([0]), k, 2 * k)
  row = row.replace(segments=(entry, *row.segments[1:]))
  merged, spliced = big.adopt_row(jnp.int32(1), row)
  np.testing.assert_array_equal(spliced.segments[0].table[0], big.segments[0].table[1])
  got = merged.segments[0].read(jnp.int32(0), 0, 12)  # every row of the big state
  want = entry.read(jnp.int32(0), 0, 12)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g[1]), np.asarray(w[0]))
    assert float(jnp.abs(w[0, :10]).min()) > 0 and float(jnp.abs(w[0, 10:]).max()) == 0


# ------------------------------------------------------------------------------------------------
# MLA latents and DSA indexer keys in pages
# ------------------------------------------------------------------------------------------------


def _latent_config():
  """A GLM-5 shaped DSA target (layers: own indexer, shared indexer, own indexer)."""
  hf = {**hf_models.DSA_CONFIGS["glm5_dsa_shared"][2], "architectures": ["GlmMoeDsaForCausalLM"]}
  return config_from_hf(hf).with_options(dtype="float32", param_dtype="float32")


@pytest.mark.parametrize("kind", [*LATENT_FORMATS.values(), IndexerKeys])
def test_paged_latent_and_indexer_storage_equals_contiguous(kind):
  """Blocks written across page boundaries, a tree path moved: every slot reads back as the
  contiguous kind's (quantized alike), through a scattered table; unmapped pages read zeros."""
  config, layers, max_len, page = _latent_config(), 2, 24, 4
  width = max_len // page
  num_pages = B * width + 3
  table = np.random.default_rng(3).permutation(num_pages)[: B * width].reshape(B, width)
  table[1, -1] = num_pages  # row 1's last page: unmapped
  paged = PagedKV.create(kind, config, layers, B, max_len, page, num_pages)
  paged = paged.with_table(jnp.asarray(table, jnp.int32))
  assert paged.paged_part is paged and paged.num_pages == num_pages
  contiguous = kind.create(config, layers, B, max_len)
  probe = contiguous.read(jnp.int32(0), 0, 1)
  dim = (probe[0] if isinstance(probe, tuple) else probe).shape[2:]
  noise = lambda i, t: jax.random.normal(jax.random.PRNGKey(i), (B, t, *dim))
  blocks = [
    (jnp.asarray([start, start + 1], jnp.int32), noise(i, t))
    for i, (start, t) in enumerate(((0, 7), (7, 5), (12, 9)))
  ]

  @jax.jit
  def exercise(entry):
    """What each block reads as stored, then every slot of every layer after a tree commit."""
    stored = []
    for i, (at, block) in enumerate(blocks):
      entry, *out = entry.write(jnp.int32(i % layers), at, block)
      stored.append(out)
    path = jnp.asarray([[0, 2, 3], [1, 4, 5]], jnp.int32)
    entry = entry.commit_path(jnp.asarray([5, 9], jnp.int32), path)
    return stored, [jax.tree.leaves(entry.read(jnp.int32(l), 0, max_len)) for l in range(layers)]

  (want_stored, want), (got_stored, got) = exercise(contiguous), exercise(paged)
  for w, g in zip(jax.tree.leaves(want_stored), jax.tree.leaves(got_stored)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # quantized alike
  mapped = max_len - page  # row 1's last page is unmapped
  dropped = 0
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    w, g = np.asarray(w), np.asarray(g)
    np.testing.assert_array_equal(g[0], w[0])
    np.testing.assert_array_equal(g[1, :mapped], w[1, :mapped])
    assert not g[1, mapped:].any()
    dropped += np.count_nonzero(w[1, mapped:])
  assert dropped  # something was written there, and dropped


@pytest.fixture(scope="module")
def dsa_target():
  config = _latent_config()
  model = target_lib.TargetModel.random(config, seed=0)
  return config, jax.tree_util.tree_map(lambda x: x * 3.0, model.params)


def test_paged_dsa_target_equals_contiguous(dsa_target):
  """A DSA target's latents and indexer keys in scattered 3-slot pages: prefill, chain and tree
  blocks give a contiguous state's logits (the indexer reads every key through the table); a
  table whose rows share a page does not."""
  config, params = dsa_target
  num_pages = B * PAGES_PER_ROW + 5
  table = _scattered(num_pages, seed=1)
  paged = _paged(config, "float", DEFAULT_SLACK, table, num_pages)
  assert [type(s) for s in paged.segments] == [SparseLatent, PagedKV, SparseLatent]
  assert paged.paged and paged.unmapped_page == num_pages
  assert np.array_equal(paged.page_table, table)
  want = _run(config, params, DecodingState.create(config, B, MAX_LEN))
  for a, b in zip(_run(config, params, paged), want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
  table[1, 2] = table[0, 2]  # row 1's third page is row 0's
  broken = _paged(config, "float", DEFAULT_SLACK, table, num_pages)
  assert _differs(_run(config, params, broken), want) > 1e-3
