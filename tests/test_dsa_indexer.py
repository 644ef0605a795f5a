"""DeepSeek Sparse Attention's lightning indexer (models/dsa.py) and its key cache
(state/indexer.py): the top-k sets match transformers' GlmMoeDsaIndexer (interleaved RoPE) and
DeepseekV32Indexer (half-split), a cached block chooses as the full sequence does, a tree node
chooses among its own ancestors only, and the cache moves an accepted path as FloatKV does."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec
from transformers import DeepseekV32Config, GlmMoeDsaConfig
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

from jaxspec.io.architectures import config_from_hf
from jaxspec.models.dsa import Indexer, Selection, select_topk
from jaxspec.models.layers import rope_tables
from jaxspec.state import INDEXER_AXES, FloatKV, IndexerKeys, logical_axes

T, PREFIX, BATCH, MAX_LEN, TOPK = 12, 7, 2, 16, 5
THETA = 10000.0
HF_FIELDS = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  moe_intermediate_size=16,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=2,
  q_lora_rank=16,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=8,
  v_head_dim=8,
  index_n_heads=4,
  index_head_dim=16,
  index_topk=TOPK,
  n_routed_experts=4,
  num_experts_per_tok=2,
  n_group=1,
  topk_group=1,
  first_k_dense_replace=1,
  max_position_embeddings=64,
)
# name → (HF config class, architecture, HF indexer, HF rotary embedding, interleaved RoPE)
CASES = {
  "glm_moe_dsa": (
    GlmMoeDsaConfig,
    "GlmMoeDsaForCausalLM",
    hf_glm.GlmMoeDsaIndexer,
    hf_glm.GlmMoeDsaRotaryEmbedding,
    True,
  ),
  "deepseek_v32": (
    DeepseekV32Config,
    "DeepseekV32ForCausalLM",
    hf_v32.DeepseekV32Indexer,
    hf_v32.DeepseekV32RotaryEmbedding,
    False,
  ),
}


def _tables(positions: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """RoPE tables [B, T, qk_rope_head_dim] for positions [B, T] (MLA's tables)."""
  return rope_tables(jnp.asarray(positions), HF_FIELDS["qk_rope_head_dim"], THETA)


def _positions(start: int, n: int) -> np.ndarray:
  return np.broadcast_to(start + np.arange(n), (BATCH, n))


class Case:
  """One architecture: HF's indexer with random weights, the same weights as jaxspec params,
  inputs for T tokens per row, and a jitted apply of jaxspec's Indexer."""

  def __init__(self, name: str):
    hf_cls, arch, indexer_cls, rotary_cls, interleave = CASES[name]
    hf_config = hf_cls(architectures=[arch], **HF_FIELDS)
    fields = hf_config.to_dict()
    fields.pop("layer_types", None)  # transformers' "indexed_attention" marks every layer
    self.config = config_from_hf(fields).with_options(dtype="float32", param_dtype="float32")
    assert self.config.indexer_rope_interleave == interleave
    torch.manual_seed(0)
    hf = indexer_cls(hf_config, 0).float().eval()
    with torch.no_grad():
      # Positive-leaning queries and key biases: relu rarely zeroes a head's score, so the
      # index scores have no ties (several keys at 0) at the top-k boundaries.
      hf.wq_b.weight.copy_(torch.randn_like(hf.wq_b.weight) * 0.3 + 0.3)
      hf.wk.weight.copy_(torch.randn_like(hf.wk.weight) * 0.5)
      hf.k_norm.weight.copy_(1 + 0.2 * torch.randn_like(hf.k_norm.weight))
      hf.k_norm.bias.copy_(1.0 + 0.3 * torch.randn_like(hf.k_norm.bias))
      hf.weights_proj.weight.copy_(torch.randn_like(hf.weights_proj.weight) * 0.5)
    self.hf, self.rotary = hf, rotary_cls(hf_config)
    heads, dim = HF_FIELDS["index_n_heads"], HF_FIELDS["index_head_dim"]
    weight = lambda m: m.weight.detach().numpy()
    self.params = {
      "wq_b": {"kernel": weight(hf.wq_b).T.reshape(-1, heads, dim)},
      "wk": {"kernel": weight(hf.wk).T},
      "k_norm": {"scale": weight(hf.k_norm), "bias": hf.k_norm.bias.detach().numpy()},
      "weights_proj": {"kernel": weight(hf.weights_proj).T},
    }
    rng = np.random.default_rng(1)
    self.x = rng.standard_normal((BATCH, T, HF_FIELDS["hidden_size"]), np.float32)
    self.q = rng.standard_normal((BATCH, T, HF_FIELDS["q_lora_rank"]), np.float32) + 1
    module = Indexer(self.config)

    @jax.jit
    def apply(params, x, q, cos, sin, keys, start, mask):
      (sel, keys), inter = module.apply(
        {"params": params}, x, q, cos, sin, keys, 0, start, mask, mutable=["intermediates"]
      )
      return sel, keys, inter["intermediates"]["index_scores"][0]

    self.module, self._apply = module, apply

  def run(self, x, q, positions, keys=None, start=0, mask=None):
    """(Selection, keys, scores) of jaxspec's indexer for a block at `positions` [B, n] and
    slots start.. (an int, or one per row)."""
    cos, sin = _tables(positions)
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (BATCH,))
    mask = None if mask is None else jnp.asarray(mask)
    return self._apply(self.params, jnp.asarray(x), jnp.asarray(q), cos, sin, keys, start, mask)

  def full(self):
    """The uncached selection of all T tokens (causal)."""
    return self.run(self.x, self.q, _positions(0, T))

  def hf_topk(self):
    """transformers' top-k indices [B, T, min(topk, T)] of the T tokens (causal), and its
    RoPE tables."""
    ids = torch.arange(T)[None].expand(BATCH, T)
    x = torch.from_numpy(self.x)
    cos, sin = self.rotary(x, ids)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
    out = self.hf(x, torch.from_numpy(self.q), (cos, sin), causal, ids)
    return out.numpy(), (cos.numpy(), sin.numpy())


@functools.cache
def _case(name: str) -> Case:
  return Case(name)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
  return _case(request.param)


@pytest.fixture(scope="module")
def glm():
  return _case("glm_moe_dsa")


def _no_boundary_ties(scores: np.ndarray, visible: np.ndarray, k: int) -> None:
  """Every row with more than k visible keys separates its k-th and (k+1)-th scores clearly,
  so comparing top-k sets across implementations is meaningful."""
  n = scores.shape[-1]
  for row, sees in zip(scores.reshape(-1, n), visible.reshape(-1, n)):
    v = np.sort(row[sees])[::-1]
    if v.size > k:
      assert v[k - 1] - v[k] > 1e-4 * max(1.0, abs(v[k - 1])), v


# --------------------------------------------------------------------------------------------------
# select_topk
# --------------------------------------------------------------------------------------------------


def test_select_topk_keeps_the_highest_visible():
  scores = jnp.array([[3.0, 1.0, 2.0, 5.0, 4.0]])
  every = jnp.ones_like(scores, bool)
  some = jnp.array([[True, True, True, False, False]])
  one = jnp.array([[False, True, False, False, False]])
  np.testing.assert_array_equal(select_topk(scores, every, 2), [[0, 0, 0, 1, 1]])
  np.testing.assert_array_equal(select_topk(scores, some, 2), [[1, 0, 1, 0, 0]])
  np.testing.assert_array_equal(select_topk(scores, one, 3), one)  # sees ≤ k: keeps what it sees
  np.testing.assert_array_equal(select_topk(scores, some, 9), some)  # k past N
  batched = select_topk(jnp.stack([scores, -scores]), jnp.stack([every, every]), 1)
  np.testing.assert_array_equal(batched, [[[0, 0, 0, 1, 0]], [[0, 1, 0, 0, 0]]])
  # Exact ties (keys whose every head's q·k is negative score 0): the earlier key wins.
  tied = jnp.array([[-1.0, 0.0, 2.0, 0.0, 0.0]])
  np.testing.assert_array_equal(select_topk(tied, every, 2), [[0, 1, 1, 0, 0]])
  np.testing.assert_array_equal(select_topk(tied, every, 3), [[0, 1, 1, 1, 0]])


# --------------------------------------------------------------------------------------------------
# Parity with transformers (full sequence, no state)
# --------------------------------------------------------------------------------------------------


def test_params_are_named_as_the_checkpoint(case):
  cos, sin = _tables(_positions(0, T))
  init = case.module.init(
    jax.random.PRNGKey(0), case.x, case.q, cos, sin, None, 0, jnp.zeros((BATCH,), jnp.int32)
  )
  shapes = jax.tree.map(np.shape, nn.meta.unbox(init["params"]))
  assert shapes == jax.tree.map(np.shape, case.params)
  specs = nn.get_partition_spec(init["params"])
  assert specs["wq_b"]["kernel"] == PartitionSpec("q_lora", "heads", "head_dim")
  assert specs["wk"]["kernel"] == PartitionSpec("embed", "head_dim")
  assert specs["k_norm"] == {"scale": PartitionSpec("head_dim"), "bias": PartitionSpec("head_dim")}
  assert specs["weights_proj"]["kernel"] == PartitionSpec("embed", "heads")
  hf_names = {k.replace(".weight", "").replace(".bias", "") for k in case.hf.state_dict()}
  assert hf_names == set(case.params)


def test_matches_transformers_topk_sets(case):
  hf_idx, (hf_cos, hf_sin) = case.hf_topk()
  cos, sin = _tables(_positions(0, T))
  np.testing.assert_allclose(cos, hf_cos, atol=1e-6)
  np.testing.assert_allclose(sin, hf_sin, atol=1e-6)
  sel, keys, scores = case.full()
  assert keys is None and sel.cache is None
  causal = np.tril(np.ones((T, T), bool))
  _no_boundary_ties(np.asarray(scores), np.broadcast_to(causal, scores.shape), TOPK)
  block = np.asarray(sel.block)
  for b in range(BATCH):
    for t in range(T):
      want = {int(i) for i in hf_idx[b, t] if i <= t}  # HF's top-k also picks masked keys
      assert set(np.flatnonzero(block[b, t])) == want, (b, t)
      assert len(want) == min(TOPK, t + 1)


# --------------------------------------------------------------------------------------------------
# The decoding state
# --------------------------------------------------------------------------------------------------


def _prefilled(c: Case):
  keys = IndexerKeys.create(c.config, 1, BATCH, MAX_LEN)
  sel, keys, _ = c.run(c.x[:, :PREFIX], c.q[:, :PREFIX], _positions(0, PREFIX), keys, 0)
  return sel, keys


def test_cached_block_selects_as_the_full_sequence(case):
  full = np.asarray(case.full()[0].block)
  pre, keys = _prefilled(case)
  assert not np.asarray(pre.cache).any()
  np.testing.assert_array_equal(pre.block, full[:, :PREFIX, :PREFIX])
  sel, keys, _ = case.run(
    case.x[:, PREFIX:], case.q[:, PREFIX:], _positions(PREFIX, T - PREFIX), keys, PREFIX
  )
  assert sel.cache.shape == (BATCH, T - PREFIX, MAX_LEN)
  np.testing.assert_array_equal(sel.cache[..., :PREFIX], full[:, PREFIX:, :PREFIX])
  assert not np.asarray(sel.cache[..., PREFIX:]).any()  # the block's own slots and scratch
  np.testing.assert_array_equal(sel.block, full[:, PREFIX:, PREFIX:])
  # The block's keys were written at slots PREFIX..T-1 for later steps.
  assert np.abs(np.asarray(keys.k[0, :, PREFIX:T])).sum(-1).all()
  assert not np.asarray(keys.k[0, :, T:]).any()


def test_rows_with_different_starts(case):
  """Row 0 continues at 7, row 1 at 5 (overwriting its scratch slots 5, 6): each row chooses
  as its own full sequence does."""
  full = np.asarray(case.full()[0].block)
  _, keys = _prefilled(case)
  starts, n = np.array([PREFIX, 5]), T - PREFIX
  take = lambda a: np.stack([a[b, s : s + n] for b, s in enumerate(starts)])
  positions = starts[:, None] + np.arange(n)
  sel, _, _ = case.run(take(case.x), take(case.q), positions, keys, starts)
  for b, s in enumerate(starts):
    np.testing.assert_array_equal(sel.cache[b, :, :s], full[b, s : s + n, :s])
    assert not np.asarray(sel.cache[b, :, s:]).any()
    np.testing.assert_array_equal(sel.block[b], full[b, s : s + n, s : s + n])


# Tree: node 0 the root, 1 and 2 its children, 3 the child of 1.
PARENTS = (-1, 0, 0, 1)


def _path(node: int) -> list[int]:
  return _path(PARENTS[node]) + [node] if node >= 0 else []


ANCESTORS = np.array([[u in _path(n) for u in range(len(PARENTS))] for n in range(len(PARENTS))])
DEPTHS = np.array([len(_path(n)) - 1 for n in range(len(PARENTS))])


def _tree_inputs():
  rng = np.random.default_rng(2)
  n = len(PARENTS)
  x = rng.standard_normal((BATCH, n, HF_FIELDS["hidden_size"]), np.float32)
  q = rng.standard_normal((BATCH, n, HF_FIELDS["q_lora_rank"]), np.float32) + 1
  return x, q


def _tree_matches_chains(c: Case, keys, sel: Selection) -> bool:
  """Whether each node's selection is the one its own path, decoded as a chain, makes."""
  x, q = _tree_inputs()
  for node in range(len(PARENTS)):
    path = _path(node)
    chain, _, _ = c.run(x[:, path], q[:, path], _positions(PREFIX, len(path)), keys, PREFIX)
    others = [u for u in range(len(PARENTS)) if u not in path]
    if not (
      np.array_equal(sel.cache[:, node], chain.cache[:, -1])
      and np.array_equal(np.asarray(sel.block)[:, node][:, path], chain.block[:, -1])
      and not np.asarray(sel.block)[:, node][:, others].any()
    ):
      return False
  return True


def test_tree_node_selects_among_its_ancestors(glm):
  _, keys = _prefilled(glm)
  x, q = _tree_inputs()
  positions = np.broadcast_to(PREFIX + DEPTHS, (BATCH, len(PARENTS)))
  sel, _, _ = glm.run(x, q, positions, keys, PREFIX, ANCESTORS)
  assert _tree_matches_chains(glm, keys, sel)
  # Broken: nodes that see every block key (top-k ignoring ancestry) are caught.
  seen_all = np.ones_like(ANCESTORS)
  broken, _, _ = glm.run(x, q, positions, keys, PREFIX, seen_all)
  assert not _tree_matches_chains(glm, keys, broken)


def test_commit_path_moves_slots_as_float_kv():
  rng = np.random.default_rng(3)
  k = jnp.asarray(rng.standard_normal((2, BATCH, 10, 4), np.float32))
  start = jnp.array([3, 5], jnp.int32)
  path = jnp.array([[0, 2, 3], [1, 1, 0]], jnp.int32)
  moved = IndexerKeys(k).commit_path(start, path)
  want = FloatKV(k[:, :, :, None], k[:, :, :, None]).commit_path(start, path)
  np.testing.assert_array_equal(moved.k, want.k[:, :, :, 0])
  entry, stored = IndexerKeys(k).write(1, start, k[0, :, :2])
  np.testing.assert_array_equal(stored, k[0, :, :2])
  np.testing.assert_array_equal(entry.read(1, 3, 2)[0], k[0, 0, :2])


def test_logical_axes_of_indexer_keys(glm):
  one = IndexerKeys.create(glm.config, 1, 1, 8)
  two = IndexerKeys.create(glm.config, 1, 2, 8)
  assert logical_axes(one) == IndexerKeys(PartitionSpec(*INDEXER_AXES))
  assert logical_axes(one, two) == IndexerKeys(PartitionSpec(*INDEXER_AXES))
  assert one.max_len == 8 and one.k.dtype == jnp.float32
  assert one.begin_block(jnp.zeros((1,), jnp.int32), 3, True) is one  # Kind's defaults apply
