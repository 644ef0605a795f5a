"""Speculation that adapts to the load: budgets and row buckets chosen per tick.

An engine with `speculation="auto"` runs a few draft budgets (fewer chain drafts, fewer tree
nodes, none) on one state, over the live rows compacted into a row bucket. Whatever budget and
rows each call picks, greedy outputs must equal plain decoding's; the policy must pick the
budget with the most expected tokens per second for the live rows' bucket, explore stale
budgets, predict chain budgets from acceptance per draft position, and the scheduler must
serve with it without compiling.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.errors import ConfigError, InputError
from jaxspec.serve import SamplingOptions, Scheduler
from jaxspec.serve.speculation import SpeculationPolicy, default_row_buckets
from jaxspec.speculative import verifiers
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig

from tests import near_ties

MAX_LEN, NEW = 96, 24


@pytest.fixture(scope="module")
def auto_engine(target, bundled_drafter):
  """EAGLE-3 chain (γ = 4): budgets 0, 2, 4 on row buckets 2 and 4."""
  drafter = bundled_drafter("eagle3")
  config = EngineConfig(
    max_len=MAX_LEN, batch_size=4, stream_every=2, speculation="auto", row_buckets=(2,)
  )
  return SpecEngine(target, drafter, config)


def _prompts(target, n: int) -> list[list[int]]:
  with open("docs/serving.md") as f:
    ids = target.tokenizer.encode(f.read())
  return [ids[i * 70 : i * 70 + 6 + 5 * i] for i in range(n)]


def _plain(target, prompts) -> list[list[int]]:
  engine = SpecEngine(target, None, EngineConfig(max_len=MAX_LEN, batch_size=len(prompts)))
  return engine.generate(prompts, max_new_tokens=NEW, temperature=0.0).tokens


def _random_schedule(engine, prompts, seed: int) -> list[list[int]]:
  """Every prompt in a row, then loop calls of a random budget over a random subset of rows
  until all are done."""
  state = engine.empty_state()
  for i, p in enumerate(prompts):
    state = engine.insert(state, i, engine.prefill_row(p, max_new_tokens=NEW, temperature=0.0))
  rng = np.random.default_rng(seed)
  for _ in range(200):
    budget = int(rng.choice(engine.budgets))
    rows = rng.permutation(len(prompts))[: int(rng.integers(1, len(prompts) + 1))]
    state = engine.run(state, 2, budget, rows=rows.tolist())
    if bool(np.all(np.asarray(state.done))):
      break
  return [list(map(int, t)) for t in engine._outputs(state, len(prompts))]


def test_every_budget_and_row_bucket_is_lossless(target, auto_engine):
  assert auto_engine.budgets == (0, 2, 4) and auto_engine.row_buckets == (2, 4)
  prompts = _prompts(target, 4)
  got, want = _random_schedule(auto_engine, prompts, seed=0), _plain(target, prompts)
  if got != want:
    near_ties.assert_greedy_match(target, prompts, want, got)
  with pytest.raises(InputError, match="budgets"):
    auto_engine.run(auto_engine.empty_state(), 1, budget=3)


def test_tree_budgets_are_lossless(target, bundled_drafter):
  """DFlash + DDTree: a tree of 3 nodes and one of 6 on the same state."""
  drafter = bundled_drafter("dflash")
  config = EngineConfig(
    max_len=MAX_LEN,
    batch_size=2,
    verify="tree",
    tree_budget=6,
    speculation="auto",
    speculation_budgets=(3,),
  )
  engine = SpecEngine(target, drafter, config)
  assert engine.budgets == (3, 6) and isinstance(engine._variants[3], verifiers.TreeVerifier)
  prompts = _prompts(target, 2)
  got, want = _random_schedule(engine, prompts, seed=1), _plain(target, prompts)
  if got != want:
    near_ties.assert_greedy_match(target, prompts, want, got)


def test_auto_server_equals_the_engine(target, auto_engine):
  """A scheduler over the auto engine: outputs equal plain decoding, more than one budget and
  bucket ran, nothing compiled while serving."""
  scheduler = Scheduler(auto_engine, max_queue=16)
  scheduler.start()
  # Four drafts over four rows priced out: once the first request's passes have measured
  # every position (4 passes each, for this short test), the ticks with more than 2 live
  # rows must switch budget (one the depth model predicts, or none) on a program compiled
  # at start.
  scheduler._policy.costs[(4, 4)] = 10.0
  scheduler._policy.min_passes = 4
  try:
    compiled = auto_engine.compile_counts()
    prompts = _prompts(target, 6)
    options = SamplingOptions(max_tokens=NEW, temperature=0.0)
    alone = scheduler.submit(prompts[0], options).result()[0]  # alone: a small bucket
    handles = scheduler.submit_many([(p, options) for p in prompts[1:]])
    results = [alone] + [h.result()[0] for h in handles]
    assert auto_engine.compile_counts() == compiled
    policy = scheduler._policy
  finally:
    scheduler.shutdown(drain=False, timeout=60)
  chosen = policy.chosen
  assert len({b for b, _ in chosen}) >= 2 and len({r for _, r in chosen}) >= 2, chosen
  # A chain engine: acceptance measured per draft position predicts both draft budgets.
  assert policy.depth_model and policy.acceptance_by_position()[1] is not None
  assert 1 <= policy.tokens_per_step[2] <= policy.tokens_per_step[4] <= 5
  want = _plain(target, prompts)
  stop = set(auto_engine.stop_ids)
  want = [w[:-1] if w and w[-1] in stop else w for w in want]
  if results != want:
    near_ties.assert_greedy_match(target, prompts, want, results)


def test_policy_maximises_expected_tokens_per_second():
  costs = {(0, 2): 1.0, (4, 2): 2.0, (0, 8): 1.5, (4, 8): 6.0}
  policy = SpeculationPolicy((0, 4), (2, 8), costs, explore_every=4)
  assert policy.choose(1) == (4, 2)  # budget 4 not measured yet: explored first
  policy.observe(4, 2, steps=2, seconds=4.0, passes=2, committed=6)  # 3 tokens a step
  assert policy.tokens_per_step[4] == 3.0 and policy.costs[(4, 2)] == 2.0
  assert policy.choose(2) == (4, 2)  # 3 tokens per 2 s beats 1 token per 1 s
  assert policy.choose(5) == (0, 8)  # 3 per 6 s loses to 1 per 1.5 s at 8 rows
  assert policy.expected_rate(0, 5) == pytest.approx(5 / 1.5)
  for _ in range(2):
    assert policy.choose(5) == (0, 8)
  assert policy.choose(5) == (4, 8)  # stale after 4 ticks: measured again
  policy.observe(4, 8, steps=1, seconds=1.0, passes=8, committed=8)  # now 1 token a step
  assert policy.tokens_per_step[4] == pytest.approx(0.7 * 3 + 0.3 * 1)
  fixed = SpeculationPolicy((4,), (4,))
  assert fixed.choose(3) == (4, 4) and fixed.chosen[(4, 4)] == 1
  assert default_row_buckets(64) == (4, 16) and default_row_buckets(2) == (1,)


def test_speculation_config_is_checked(target, bundled_drafter):
  with pytest.raises(ConfigError, match="speculation must be"):
    EngineConfig(speculation="adaptive")
  with pytest.raises(ConfigError, match="needs speculation='auto'"):
    EngineConfig(speculation_budgets=(2,))
  with pytest.raises(ConfigError, match="row_buckets"):
    EngineConfig(batch_size=4, row_buckets=(8,))
  with pytest.raises(ConfigError, match="needs a drafter"):
    SpecEngine(target, None, EngineConfig(speculation="auto"))
  draft = bundled_drafter("draft")
  with pytest.raises(ConfigError, match="must propose every step"):
    SpecEngine(target, draft, EngineConfig(speculation="auto", speculation_budgets=(0,)))


def test_chain_budgets_are_predicted_from_acceptance_by_position():
  """A tick at the full budget measures every shorter chain budget: E[b] = 1 + Σ_{k≤b}
  p_1…p_k from the passes that reached and accepted each position, so budget 2 is never run
  to explore it. A tree policy (no depth model) must run budget 2 to know it."""
  costs = {(0, 4): 1.0, (2, 4): 1.5, (4, 4): 1.6}
  policy = SpeculationPolicy((0, 2, 4), (4,), costs, explore_every=8, depth_model=True)
  assert policy.choose(4) == (4, 4)  # nothing measured: the longest chain measures both
  # 4 passes accepting 0, 1, 2, 3, 4 drafts: 1, 2, 3, 2, 2 of them; position 4 was reached
  # by 4 passes, fewer than min_passes: neither budget is predicted yet.
  policy.observe(4, 4, steps=1, seconds=1.6, passes=10, committed=0, accepted=[1, 2, 3, 2, 2])
  assert policy.tokens_per_step[2] is None and policy.tokens_per_step[4] is None
  # Three more such ticks (40 passes in all): positions 1..4 reached by 40, 36, 28, 16.
  policy = SpeculationPolicy(
    (0, 2, 4), (4,), costs, explore_every=8, depth_model=True, half_life=float("inf")
  )
  policy.observe(4, 4, steps=1, seconds=1.6, passes=40, committed=0, accepted=[4, 8, 12, 8, 8])
  p = policy.acceptance_by_position()
  assert p == {1: 0.9, 2: pytest.approx(7 / 9), 3: pytest.approx(4 / 7), 4: 0.5}
  assert policy.tokens_per_step[2] == pytest.approx(1 + 0.9 + 0.7)
  assert policy.tokens_per_step[4] == pytest.approx(1 + 0.9 + 0.7 + 0.4 + 0.2)
  # 4 · 3.2 / 1.6 beats 4 · 2.6 / 1.5 and 4 · 1 / 1: budget 4 for every tick until stale.
  assert [policy.choose(4) for _ in range(8)] == [(4, 4)] * 8
  # A budget-2 tick refines positions 1 and 2 only (its passes cannot reach 3); with a half
  # life of 4 passes, position 1's 4 new passes halve the old counts, position 2's 2 new
  # passes keep 1/√2 of them.
  policy.half_life = 4.0
  policy.observe(2, 4, steps=1, seconds=1.5, passes=4, committed=0, accepted=[2, 2, 0, 0, 0])
  p2 = policy.acceptance_by_position()
  assert p2[1] == pytest.approx((0.5 * 36 + 2) / (0.5 * 40 + 4))
  assert p2[2] == pytest.approx(28 / 2**0.5 / (36 / 2**0.5 + 2)) and p2[3] == p[3]
  tree = SpeculationPolicy((0, 2, 4), (4,), costs, explore_every=8)
  tree.observe(4, 4, steps=1, seconds=1.6, passes=10, committed=25, accepted=[1, 2, 3, 2, 2])
  assert tree.tokens_per_step[2] is None and tree.tokens_per_step[4] == 2.5
  assert tree.choose(4) == (2, 4)  # never measured: explored
