"""Tree verification (DDTree) on hybrid targets: the Gated DeltaNet layers' per-node states
and `LinearState.commit_path` under the engine (no transformers needed: the target is built
from the hybrid test shapes with random weights).

- Greedy: DFlash + DDTree equals plain greedy decoding, batch 4 and 1; committing the last tree
  node's state instead of the accepted node's (tests/broken_rules.py) breaks the equality.
- One tree block through the target, committed along a path, equals the path run as a chain
  (states, K/V and logits): the model/state seam on its own.
- Sampled: whole sequences follow the target's exact distribution (chi-square), and the broken
  commit fails the same check.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import target as target_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState, LinearState
from jaxspec.io.architectures import config_from_hf
from tests import broken_rules, near_ties
from tests.drafter_models import (
  exact_sequence_probs,
  prompts,
  random_params,
  sampled_pvalue,
  small_dflash,
)

# ------------------------------------------------------------------------------------------------
# Tree verification (DDTree) over the recurrent state
# ------------------------------------------------------------------------------------------------


# tests/hf_models.py's "qwen3_5_dense_3to1_tied" shapes (3 linear layers, then full attention).
HYBRID = dict(
  architectures=["Qwen3_5ForCausalLM"],
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  tie_word_embeddings=True,
  linear_conv_kernel_dim=4,
  linear_key_head_dim=8,
  linear_value_head_dim=6,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
)


def _small_hybrid(
  vocab: int = 64, factor: float = 4.0, seed: int = 0, mixer: float = 1.0, **overrides
) -> target_lib.TargetModel:
  """A small hybrid target with random weights scaled up (sharp logits) and the Gated DeltaNet
  matrices scaled by `mixer` (how much the context, hence the recurrent state, moves the
  logits)."""
  config = config_from_hf({**HYBRID, "vocab_size": vocab, **overrides})
  params = random_params(target_lib.param_shapes(config), seed, factor)

  def boost(path, x):
    where = jax.tree_util.keystr(path)
    return x * mixer if "linear_attn" in where and ("proj" in where or "conv" in where) else x

  return target_lib.TargetModel(config, jax.tree_util.tree_map_with_path(boost, params))


@pytest.fixture(scope="module")
def tree_setup():
  """A hybrid target, a DFlash drafter on it and plain greedy outputs (batch 4)."""
  target = _small_hybrid()
  drafter = small_dflash(target, target_layer_ids=(0, 2))
  cfg = EngineConfig(max_len=64, batch_size=4, use_eos=False)
  ps = prompts(4, target.config.vocab_size)
  plain = SpecEngine(target, None, cfg).generate(ps, max_new_tokens=20)
  tree_cfg = dataclasses.replace(cfg, verify="tree", tree_budget=6)
  return target, drafter, tree_cfg, ps, plain


@pytest.mark.slow  # ~110 s on 2 busy cores: four engine programs over a hybrid target
def test_greedy_tree_speculation_on_hybrid_equals_plain(tree_setup, monkeypatch):
  """DFlash + DDTree on a hybrid target, batch 4 and 1: greedy output equals plain decoding;
  with the broken commit (the last tree node's state kept instead of the accepted node's) it
  does not, so the equality depends on commit_path. A budget wider than the kept per-node
  states is refused."""
  target, drafter, tree_cfg, ps, plain = tree_setup
  spec = SpecEngine(target, drafter, tree_cfg).generate(ps, max_new_tokens=20)
  near_ties.assert_greedy_match(target, ps, plain.tokens, spec.tokens)
  assert spec.stats.acceptance_length > 1.0  # paths deeper than the root are committed
  one = SpecEngine(target, drafter, dataclasses.replace(tree_cfg, batch_size=1))
  single = one.generate(ps[1:2], max_new_tokens=20)
  near_ties.assert_greedy_match(target, ps[1:2], plain.tokens[1:2], single.tokens)
  monkeypatch.setattr(LinearState, "commit_path", broken_rules.commit_last_tree_node)
  broken = SpecEngine(target, drafter, tree_cfg).generate(ps, max_new_tokens=20)
  assert [list(t) for t in broken.tokens] != [list(t) for t in plain.tokens]
  monkeypatch.undo()
  # A tree wider than the snapshots kept per block widens them (budget + 1 = 17): every node's
  # state stays available for commit_path.
  wide = SpecEngine(target, drafter, dataclasses.replace(tree_cfg, tree_budget=16))
  assert wide.target.config.options.linear_snapshots == 17


@pytest.mark.slow  # ~55 s: two engine programs at batch 512 over a hybrid target
def test_sampled_tree_sequences_on_hybrid_follow_the_target_distribution(monkeypatch):
  """Temperature 1, DFlash + DDTree (γ = 2) on a 4-token hybrid target: 4-token continuations
  follow the target's exact distribution (chi-square over all 256, rare ones pooled); with the
  broken commit they do not (p = 0 measured; every continuation spans at least two tree
  steps, and the Gated DeltaNet weights are scaled up so that the state moves the logits)."""
  target = _small_hybrid(4, 2.0, 3, mixer=8.0)  # the state moves the logits
  prompt, length = [1, 3, 2], 4
  outcomes, probs = exact_sequence_probs(target, prompt, length)
  drafter = small_dflash(target, num_layers=1, block_size=3, stddev=0.3)
  cfg = EngineConfig(
    max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4, verify="tree", tree_budget=4
  )
  engine = SpecEngine(target, drafter, cfg)
  good = sampled_pvalue(engine, prompt, length, 12, outcomes, probs)
  monkeypatch.setattr(LinearState, "commit_path", broken_rules.commit_last_tree_node)
  broken = SpecEngine(target, drafter, cfg)
  bad = sampled_pvalue(broken, prompt, length, 12, outcomes, probs)
  assert good > 1e-4
  assert bad < 1e-8


@pytest.mark.slow  # ~22 s on 2 busy cores: two target programs
def test_tree_block_commit_equals_the_accepted_chain():
  """One target forward over a tree block (ancestor mask, positions start + depth), then
  `commit_path` along an accepted path and the new length: the Gated DeltaNet states (conv
  window, recurrent state) and attention K/V equal those of a forward over the path as a chain,
  and so do the logits at the path's nodes. The model-level seam the engine uses."""
  target = _small_hybrid()
  config, params = target.config, target.params
  forward = jax.jit(functools.partial(target_lib.apply_decoder, config))
  rng = np.random.default_rng(2)
  prompt = jnp.asarray(rng.integers(0, 64, (1, 5)), jnp.int32)
  state = DecodingState.create(config, 1, 32)
  # A 4-token prefill: the same program as the 4-token chain below (one compile less).
  state = forward(params, prompt[:, :4], jnp.array([0], jnp.int32), state).state
  state = state.with_lengths(jnp.array([4], jnp.int32))
  start = jnp.array([4], jnp.int32)
  parents = [-1, 0, 0, 1, 3, 1, 4]  # depths 0, 1, 1, 2, 3, 2, 4
  mask = np.eye(7, dtype=bool)
  for i, j in enumerate(parents):
    while j >= 0:
      mask[i, j], j = True, parents[j]
  block = jnp.concatenate([prompt[:, 4:], jnp.asarray(rng.integers(0, 64, (1, 6)))], axis=1)
  tree = forward(
    params,
    block,
    start,
    state,
    positions=start[:, None] + jnp.asarray(mask.sum(-1)[None] - 1),
    block_mask=jnp.asarray(mask[None]),
  )
  path = jnp.asarray([[0, 1, 3, 4]], jnp.int32)
  kept = tree.state.commit_path(path).with_lengths(start + 4)
  chain = forward(params, block[:, path[0]], start, state)
  want = chain.state.with_lengths(start + 4)
  np.testing.assert_allclose(tree.logits[0, path[0]], chain.logits[0], atol=1e-5, rtol=1e-5)
  linear, attention = kept.segments[0], kept.segments[1]
  assert isinstance(linear, LinearState) and not linear.has_pending
  np.testing.assert_allclose(linear.conv, want.segments[0].conv, atol=1e-6)
  np.testing.assert_allclose(linear.ssm, want.segments[0].ssm, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(
    attention.k[:, :, :8], want.segments[1].k[:, :, :8], atol=1e-5, rtol=1e-5
  )
