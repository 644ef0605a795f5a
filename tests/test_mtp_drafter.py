"""The MTP drafter: greedy equality, exact sampled distribution, cache bookkeeping, errors."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.drafters.mtp import MTPDrafter
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState

from tests.drafter_models import (
  random_params,
  small_target,
  prompts,
  exact_sequence_probs,
  sampled_pvalue,
  GreedyCheck,
)


# ------------------------------------------------------------------------------------------------
# MTP
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
  return small_target(num_mtp_layers=1)


@pytest.fixture(scope="module")
def greedy(target):
  return GreedyCheck(target, MTPDrafter.from_target(target, gamma=3))


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_speculation_equals_plain(greedy, batch):
  greedy.check(batch)


def test_tree_verification_greedy_equals_plain(greedy):
  greedy.check(2, tree_budget=6)


def test_greedy_with_a_moe_target_and_moe_mtp_block():
  """The bundled target's shape: GLM-4 MoE with partial RoPE and a routed-expert MTP block."""
  cfg = ModelConfig(
    architecture="Glm4MoeForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router="sigmoid",
    n_shared_experts=1,
    layer_is_moe=(False, True),
    partial_rotary_factor=0.5,
    num_mtp_layers=1,
  )
  target = TargetModel(cfg, random_params(target_lib.param_shapes(cfg), 0))
  GreedyCheck(target, MTPDrafter.from_target(target, gamma=2)).check(2)


def test_cache_holds_exact_entries_after_steps(target, greedy):
  """After a generation, the MTP cache below the root equals a fresh recomputation."""
  eng = greedy.spec
  state = eng.init_state(prompts(2, 64), max_new_tokens=20)
  state = eng._loop(eng.target.params, eng.drafter_params, state)  # pylint: disable=protected-access
  tokens, seq = jnp.asarray(state.tokens), np.asarray(state.seq_len)
  length = int(seq.max())
  zeros = jnp.zeros((2,), jnp.int32)
  full = target_lib.forward(target.config, target.params, tokens[:, :length])
  fresh = DecodingState.create(target.config, 2, length, segment_layers=(1,))
  _, _, mstate = target_lib.apply_mtp(
    target.config, target.params, 0, tokens[:, 1 : length + 1], full.hidden, zeros, fresh
  )
  ck = mstate.segments[0].k
  for b in range(2):
    n = int(seq[b]) - 1  # root slot; cache entries below n - 1 are committed
    got = np.asarray(state.drafter_state.cache.segments[0].k[0, b, : n - 1])
    np.testing.assert_allclose(got, np.asarray(ck[0, b, : n - 1]), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(
      np.asarray(state.drafter_state.last_hidden[b]),
      np.asarray(full.hidden[b, n - 1]),
      atol=2e-4,
      rtol=2e-4,
    )


@dataclasses.dataclass(frozen=True)
class _ArgmaxButReportsQ(MTPDrafter):
  """A broken drafter: drafts the argmax but reports the warped q (what a bug would look like)."""

  def propose(self, params, state, ctx):
    prop, state = super().propose(params, state, ctx)
    return prop.replace(tokens=jnp.argmax(prop.probs, axis=-1).astype(jnp.int32)), state


def test_sampled_sequences_follow_the_target_distribution():
  target = small_target(vocab=6, num_mtp_layers=1, seed=3, factor=2.0)
  prompt, length = [1, 4, 2], 3
  outcomes, probs = exact_sequence_probs(target, prompt, length)
  cfg = EngineConfig(max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4)
  good = SpecEngine(target, MTPDrafter.from_target(target, gamma=2), cfg)
  assert sampled_pvalue(good, prompt, length, 12, outcomes, probs) > 1e-4
  base = MTPDrafter.from_target(target, gamma=2)
  bad = SpecEngine(target, _ArgmaxButReportsQ(gamma=2, params=base.params, config=base.config), cfg)
  assert sampled_pvalue(bad, prompt, length, 12, outcomes, probs) < 1e-6


def test_clear_errors(target):
  plain = TargetModel(target.config.replace(num_mtp_layers=0), {})
  with pytest.raises(jaxspec.ConfigError, match="no MTP layers"):
    MTPDrafter.from_target(plain)
  with pytest.raises(ValueError, match="gamma"):
    MTPDrafter.from_target(target, gamma=0)
  drafter = jaxspec.make_drafter("mtp", target, gamma=2)
  assert isinstance(drafter, MTPDrafter) and drafter.gamma == 2
