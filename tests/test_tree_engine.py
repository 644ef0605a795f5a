"""Tree verification in the engine (EngineConfig(verify="tree")): losslessness and bookkeeping.

- Greedy tree speculation equals plain greedy decoding token for token (batch 1 and 4, with and
  without the seeded chain, every walk rule, per-sequence budgets); budget 1 too.
- Step by step: the target cache equals a fresh prefill of the committed tokens after every step
  (tree nodes never leak), the draft model's cache is valid up to its tracked length, the
  features handed to the drafter equal the target's features of the committed tokens, and with
  the chain seeded the tree never accepts fewer tokens than chain verification from the same
  state.
- Sampled: whole sequences from exact bigram models follow the target distribution (chi-square),
  for the three walk rules (the recursive one over sampled children) and three temperatures.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jaxspec.drafters.base import Drafter
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.models import target as target_lib
from jaxspec.models.target import InputError, TargetModel
from jaxspec.speculative import step as step_lib, tree_verify, verifiers
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState

from tests import engine_models, near_ties


def _sharpen(model: TargetModel, factor: float) -> TargetModel:
  """Scales the final norm: logits × factor (peaked distributions make deep trees)."""
  params = dict(model.params)
  params["norm"] = {"scale": model.params["norm"]["scale"] * factor}
  return TargetModel(model.config, params)


def _perturbed(model: TargetModel, eps: float, seed: int = 5) -> TargetModel:
  """The same architecture with every weight perturbed: a draft that agrees part of the time."""
  leaves, treedef = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  leaves = [x + eps * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return TargetModel(model.config, jax.tree_util.tree_unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def models():
  target = _sharpen(engine_models.random_target(), 3.0)
  return target, _perturbed(target, 0.4)


def _prompts(batch, vocab=96, seed=0):
  rng = np.random.default_rng(seed)
  lens = [5, 11, 3, 8][:batch]
  return [list(rng.integers(3, vocab, n)) for n in lens]


# ------------------------------------------------------------------------------------------------
# Greedy losslessness
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "batch, budget, seed, rule",
  [(1, 8, False, "ddtree"), (4, 12, True, "eagle2"), (1, 8, True, "recursive")],
)
def test_greedy_tree_speculation_equals_plain(models, batch, budget, seed, rule):
  target, draft = models
  cfg = EngineConfig(max_len=80, batch_size=batch, use_eos=False)
  tree_cfg = dataclasses.replace(
    cfg, verify="tree", tree_budget=budget, tree_chain_seed=seed, tree_rule=rule
  )
  prompts = _prompts(batch)
  budgets = [40, 33, 40, 25][:batch]
  plain = SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=budgets)
  spec = SpecEngine(target, DraftModelDrafter.from_model(draft, gamma=4), tree_cfg).generate(
    prompts, max_new_tokens=budgets
  )
  near_ties.assert_greedy_match(target, prompts, plain.tokens, spec.tokens)
  assert [len(t) for t in spec.tokens] == budgets
  assert spec.stats.acceptance_length > 1.1  # the tree does accept drafts
  assert len(spec.stats.summary["accept_hist"]) == 4 + 1  # histogram over depths 0..γ


def test_mixed_batch_greedy_rows_equal_plain(models):
  """Under the recursive rule a greedy row sharing its batch with sampled rows (whose trees
  draw their children) still decodes exactly as plain greedy decoding."""
  target, draft = models
  cfg = EngineConfig(max_len=80, batch_size=2, use_eos=False)
  prompts = _prompts(2)
  plain = SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=30)
  tree_cfg = dataclasses.replace(cfg, verify="tree", tree_budget=8, tree_rule="recursive")
  spec = SpecEngine(target, DraftModelDrafter.from_model(draft, gamma=4), tree_cfg).generate(
    prompts, max_new_tokens=30, temperature=[0.0, 1.0], seed=3
  )
  near_ties.assert_greedy_match(target, prompts[:1], plain.tokens[:1], spec.tokens[:1])
  assert len(spec.tokens[1]) == 30 and spec.tokens[1] != plain.tokens[1]
  # The walk's rank counts agree with the acceptance histogram: depth d + 1 was accepted in
  # every pass that accepted more than d drafts, and tried in every pass that reached it.
  summary = spec.stats.summary
  accepted = np.asarray(summary["tree_rank_accepted"]).sum(axis=(1, 2))  # over ranks, buckets
  at_least = np.cumsum(np.asarray(summary["accept_hist"])[::-1])[::-1]
  np.testing.assert_array_equal(accepted, at_least[1:])
  tried_first = np.asarray(summary["tree_rank_tried"])[:, 0].sum(axis=-1)
  assert np.all(tried_first <= at_least[:-1]) and tried_first[0] > 0


def test_budget_one_reproduces_plain_decoding(models):
  target, _ = models
  cfg = EngineConfig(max_len=64, use_eos=False)
  prompts = _prompts(1)
  plain = SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=21)
  # The target drafting for itself: its one node (the top-1 token) is always right, so every
  # pass commits exactly 2 tokens, i.e. budget 1 is chain speculation with γ = 1.
  eng = SpecEngine(
    target,
    DraftModelDrafter.from_model(target, gamma=3),
    dataclasses.replace(cfg, verify="tree", tree_budget=1),
  )
  out = eng.generate(prompts, max_new_tokens=21)
  near_ties.assert_greedy_match(target, prompts, plain.tokens, out.tokens)
  assert out.stats.target_passes == 10  # the first token comes from prefill, then 10 × 2
  assert out.stats.summary["accept_hist"][1] == 10


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_feature_drafters_in_tree_mode_equal_plain(kind):
  """DFlash (per-position marginals of one block pass) and EAGLE-3 (top-K of each chain step,
  mapped from a reduced draft vocabulary: tokens outside it are -inf and never nodes)."""
  # pylint: disable=import-outside-toplevel
  from jaxspec.drafters.eagle3 import Eagle3Drafter
  from tests.drafter_models import prompts, small_dflash, small_target

  if kind == "dflash":
    target = small_target(num_layers=3)
    drafter = small_dflash(target)
  else:
    target = small_target(num_layers=4)
    vocab = np.random.default_rng(0).choice(64, 40, replace=False)
    drafter = Eagle3Drafter.random(
      target, draft_vocab=vocab, target_layer_ids=(0, 2, 3), stddev=0.2, gamma=3, seed=2
    )
  cfg = EngineConfig(max_len=80, batch_size=2, use_eos=False)
  ps = prompts(2, target.config.vocab_size)
  plain = SpecEngine(target, None, cfg).generate(ps, max_new_tokens=24)
  spec = SpecEngine(target, drafter, dataclasses.replace(cfg, verify="tree", tree_budget=6))
  out = spec.generate(ps, max_new_tokens=24)
  near_ties.assert_greedy_match(target, ps, plain.tokens, out.tokens)


# ------------------------------------------------------------------------------------------------
# Step by step: cache oracle, features, chain comparison
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FeatureRecorder(Drafter):
  """Wraps a drafter and records, per committed slot, the target features it was handed."""

  inner: Any = None
  feature_size: int = 0
  tap_ids: tuple[int, ...] = (0,)

  @property
  def taps(self):
    return self.tap_ids

  def for_tree(self, sampled_chain=False):
    return dataclasses.replace(self, inner=self.inner.for_tree(sampled_chain))

  def init_state(self, params, batch, max_len):
    h = self.feature_size
    return (
      self.inner.init_state(params, batch, max_len),
      jnp.zeros((batch, max_len, h)),
      jnp.zeros((batch, max_len, h)),
    )

  def prefill(self, params, state, ctx):
    inner, hid, tap = state
    p = ctx.hidden.shape[1]
    return (
      self.inner.prefill(params, inner, ctx),
      hid.at[:, :p].set(ctx.hidden),
      tap.at[:, :p].set(ctx.taps[0]),
    )

  def propose(self, params, state, ctx):
    proposal, inner = self.inner.propose(params, state[0], ctx)
    return proposal, (inner, state[1], state[2])

  def commit(self, params, state, ctx):
    inner, hid, tap = state
    batch, width = ctx.hidden.shape[:2]
    j = jnp.arange(width)[None, :]
    slots = ctx.old_seq_len[:, None] - 1 + j
    # Slot j ↔ the j-th committed token (root first); j ≤ accepted and inside the new cache.
    slots = jnp.where(
      (j <= ctx.num_accepted[:, None]) & (slots < ctx.seq_len[:, None] - 1), slots, hid.shape[1]
    )
    rows = jnp.arange(batch)[:, None]
    hid = hid.at[rows, slots].set(ctx.hidden, mode="drop")
    tap = tap.at[rows, slots].set(ctx.taps[0], mode="drop")
    return (self.inner.commit(params, inner, ctx), hid, tap)


def _all_layers(state: DecodingState) -> tuple[jax.Array, jax.Array]:
  """K and V [L, B, S, K, D] over every layer: the state's segments concatenated."""
  return (
    jnp.concatenate([s.k for s in state.segments], axis=0),
    jnp.concatenate([s.v for s in state.segments], axis=0),
  )


def test_step_by_step_cache_features_and_chain_comparison(models):
  target, draft = models
  batch, max_len, gamma = 2, 64, 4
  cfg = EngineConfig(
    max_len=max_len,
    batch_size=batch,
    use_eos=False,
    verify="tree",
    tree_budget=10,
    tree_chain_seed=True,
  )
  inner = DraftModelDrafter.from_model(draft, gamma=gamma)
  eng = SpecEngine(
    target,
    FeatureRecorder(
      gamma=gamma, params=draft.params, inner=inner, feature_size=target.config.hidden_size
    ),
    cfg,
  )
  drafter, tcfg = eng.drafter, target.config
  tree_step = jax.jit(functools.partial(step_lib.step, tcfg, drafter, eng.verifier))
  chain = verifiers.ChainVerifier(drafter.gamma)
  chain_step = jax.jit(functools.partial(step_lib.step, tcfg, drafter, chain))

  @jax.jit
  def fresh(tokens):
    zeros = jnp.zeros((batch,), jnp.int32)
    out = target_lib.apply_decoder(
      tcfg, target.params, tokens, zeros, target.init_state(batch, max_len), taps=(0,)
    )
    dout = target_lib.apply_decoder(
      draft.config, draft.params, tokens, zeros, draft.init_state(batch, max_len)
    )
    return *_all_layers(out.state), out.hidden, out.taps[0], *_all_layers(dout.state)

  state = eng.init_state(_prompts(batch), max_new_tokens=36)
  params = (target.params, drafter.params)
  tree_n, chain_n, steps = [], [], 0
  while not bool(np.all(np.asarray(state.done))):
    before = np.asarray(state.seq_len)
    chain = chain_step(*params, state)
    state = tree_step(*params, state)
    tree_n.append(np.asarray(state.seq_len) - before)
    chain_n.append(np.asarray(chain.seq_len) - before)
    steps += 1

    seq = np.asarray(state.seq_len)
    assert np.asarray(state.target_state.lengths).tolist() == (seq - 1).tolist()
    ck, cv, hid, tap, dk, dv = fresh(state.tokens)
    got_k, got_v = map(np.asarray, _all_layers(state.target_state))
    inner_state, rec_hid, rec_tap = state.drafter_state
    valid_draft = np.asarray(inner_state.cache.lengths)
    draft_k, draft_v = map(np.asarray, _all_layers(inner_state.cache))
    # The last layer is MoE: the final hidden state is compared up to a routing near-tie (the
    # K/V and the tap come before it).
    # (the whole buffer: one compilation; positions past seq_len cannot affect earlier ones)
    stable = near_ties.stable_positions(target, np.asarray(state.tokens))
    for b in range(batch):
      n = seq[b] - 1  # committed tokens in the target cache
      np.testing.assert_allclose(got_k[:, b, :n], np.asarray(ck)[:, b, :n], atol=2e-5)
      np.testing.assert_allclose(got_v[:, b, :n], np.asarray(cv)[:, b, :n], atol=2e-5)
      keep = stable[b, :n]
      np.testing.assert_allclose(
        np.asarray(rec_hid)[b, :n][keep], np.asarray(hid)[b, :n][keep], atol=2e-4
      )
      np.testing.assert_allclose(np.asarray(rec_tap)[b, :n], np.asarray(tap)[b, :n], atol=2e-4)
      m = valid_draft[b]
      assert seq[b] - 1 - gamma <= m <= seq[b] - 1
      np.testing.assert_allclose(draft_k[:, b, :m], np.asarray(dk)[:, b, :m], atol=2e-5)
      np.testing.assert_allclose(draft_v[:, b, :m], np.asarray(dv)[:, b, :m], atol=2e-5)
  tree_n, chain_n = np.stack(tree_n), np.stack(chain_n)
  assert np.all(tree_n >= chain_n), (tree_n.T, chain_n.T)
  assert np.any(tree_n > chain_n)  # the extra branches are used
  assert steps < 36


# ------------------------------------------------------------------------------------------------
# Sampled losslessness on exact bigram models
# ------------------------------------------------------------------------------------------------


def _random_table(rng, vocab, alpha=1.0):
  return rng.dirichlet(np.full(vocab, alpha), size=vocab).astype(np.float64)


def _exact_probs(table, start, length):
  outcomes = list(itertools.product(range(table.shape[0]), repeat=length))
  probs = []
  for seq in outcomes:
    p, prev = 1.0, start
    for tok in seq:
      p *= table[prev, tok]
      prev = tok
    probs.append(p)
  return outcomes, np.asarray(probs)


def _chi2_pvalue(counts, outcomes, probs):
  obs = np.array([counts.get(o, 0) for o in outcomes], np.float64)
  assert obs.sum() == sum(counts.values())
  return scipy_stats.chisquare(obs, probs * obs.sum()).pvalue


@pytest.mark.parametrize(
  "rule, chain_seed, temperature, calibrated",
  [
    ("ddtree", False, 1.0, False),
    ("eagle2", True, 0.7, False),
    ("recursive", True, 0.6, False),
    ("recursive", False, 1.0, True),  # shaped by a measured acceptance table
  ],
)
def test_sampled_tree_sequences_follow_the_target_distribution(
  rule, chain_seed, temperature, calibrated
):
  rng = np.random.default_rng(4)
  p_table, q_table = _random_table(rng, 3), _random_table(rng, 3)
  target, draft = engine_models.bigram_model(p_table), engine_models.bigram_model(q_table)
  batch = 512
  drafter = DraftModelDrafter.from_model(draft, gamma=3)
  if calibrated:
    table = rng.uniform(0.05, 0.95, (3, 2, tree_verify.Q_BUCKETS))
    drafter = dataclasses.replace(drafter, tree_acceptance=((1.0, table.tolist()),))
  eng = SpecEngine(
    target,
    drafter,
    EngineConfig(
      max_len=16,
      batch_size=batch,
      use_eos=False,
      min_prompt_bucket=1,
      verify="tree",
      tree_budget=4,
      tree_chain_seed=chain_seed,
      tree_rule=rule,
    ),
  )
  counts = {}
  for s in range(24):
    out = eng.generate([[0]] * batch, max_new_tokens=4, temperature=temperature, seed=s)
    for t in out.tokens:
      counts[tuple(t)] = counts.get(tuple(t), 0) + 1
  warped = p_table ** (1.0 / temperature)
  warped /= warped.sum(axis=1, keepdims=True)
  outcomes, probs = _exact_probs(warped, 0, 4)
  assert _chi2_pvalue(counts, outcomes, probs) > 1e-4
  _, q_probs = _exact_probs(q_table, 0, 4)
  assert _chi2_pvalue(counts, outcomes, q_probs) < 1e-8  # the test has power
  assert out.stats.acceptance_length > 1.0


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_tree_config_errors(models):
  target, draft = models
  with pytest.raises(ValueError, match="tree_budget"):
    EngineConfig(verify="tree", tree_budget=0)
  with pytest.raises(ValueError, match="tree_rule"):
    EngineConfig(verify="tree", tree_rule="medusa")
  with pytest.raises(ValueError, match="verify="):
    EngineConfig(verify="beam")
  with pytest.raises(ValueError, match="needs a drafter"):
    SpecEngine(target, None, EngineConfig(verify="tree"))
  eng = SpecEngine(
    target,
    DraftModelDrafter.from_model(draft, gamma=2),
    EngineConfig(max_len=32, verify="tree", tree_budget=16),
  )
  assert eng.drafter.tree
  with pytest.raises(InputError, match="tree of 16 draft nodes"):
    eng.generate([[5] * 10], max_new_tokens=6)  # 10 + 6 + 16 + 1 > 32
  with pytest.raises(ValueError, match="per-position distributions"):
    SpecEngine(
      target, NgramDrafter(gamma=3), EngineConfig(max_len=32, verify="tree", tree_budget=4)
    ).generate([[5, 6]], 3)
