"""The speculative engine: losslessness (greedy and sampled), stops, errors, compile counts."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import jaxspec
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.models import target as target_lib
from jaxspec.speculative import step as step_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig

from tests import engine_models, near_ties


@pytest.fixture(scope="module")
def models():
  return engine_models.random_target(), engine_models.random_draft()


def _prompts(batch, vocab=96, seed=0):
  rng = np.random.default_rng(seed)
  lens = [5, 11, 3, 8][:batch]
  # Repetitive prompts give the n-gram drafter something to find.
  return [list(rng.integers(3, vocab, n // 2 + 1)) * 2 for n in lens]


@pytest.mark.parametrize(
  "kind, batch",
  [
    ("small_draft", 4),
    ("self_draft", 4),
    ("ngram", 4),
    ("ngram", 1),
    # Batch 1 of the draft-model drafters: the batch-4 cases cover the same code.
    pytest.param("small_draft", 1, marks=pytest.mark.slow),
    pytest.param("self_draft", 1, marks=pytest.mark.slow),
  ],
)
def test_greedy_speculation_equals_plain(models, kind, batch):
  target, draft = models
  cfg = EngineConfig(max_len=96, batch_size=batch, use_eos=False)
  drafter = {
    "small_draft": lambda: DraftModelDrafter.from_model(draft, gamma=4),
    "self_draft": lambda: DraftModelDrafter.from_model(target, gamma=4),
    "ngram": lambda: NgramDrafter(gamma=3, n=2),
  }[kind]()
  prompts = _prompts(batch)
  plain = SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=40)
  spec = SpecEngine(target, drafter, cfg).generate(prompts, max_new_tokens=40)
  near_ties.assert_greedy_match(target, prompts, plain.tokens, spec.tokens)
  assert all(len(t) == 40 for t in spec.tokens)
  assert plain.stats.acceptance_length == pytest.approx(1.0)
  if kind == "self_draft":
    # The target drafting for itself is always right: every step commits γ+1 tokens (the last
    # step is cut by the budget). Wrong draft-cache bookkeeping would break this.
    assert spec.stats.summary["accept_hist"][-1] == spec.stats.target_passes
    assert spec.stats.target_passes == batch * int(np.ceil(39 / 5))
  if kind == "ngram":
    assert spec.stats.target_passes < plain.stats.target_passes


def test_plain_engine_matches_reference_decode_loop(models):
  target, _ = models
  prompts = _prompts(1)
  out = SpecEngine(target, None, EngineConfig(max_len=64, use_eos=False)).generate(
    prompts, max_new_tokens=20
  )
  # The reference: prefill, then one greedy token per target forward, committed one by one.
  p = np.asarray(prompts[0], np.int32)[None]
  logits, state, _, _ = jax.jit(step_lib.prefill_prompts, static_argnums=0)(
    target.config,
    target.params,
    jnp.asarray(p),
    jnp.array([p.shape[1]], jnp.int32),
    target.init_state(1, 64),
  )
  ref = []
  for _ in range(20):
    ref.append(int(np.argmax(np.asarray(logits[0]))))
    step = target_lib.forward(
      target.config,
      target.params,
      jnp.array([[ref[-1]]], jnp.int32),
      jnp.copy(state.lengths),
      state,
    )
    state, logits = step.state.commit(jnp.ones((1,), jnp.int32)), step.logits[:, -1]
  assert out.tokens[0] == ref


def test_stop_token_ends_sequence_and_nothing_follows(models):
  target, draft = models
  prompts = _prompts(2)
  cfg = EngineConfig(max_len=96, batch_size=2, use_eos=False)
  free = SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=30).tokens
  stop = free[0][6]
  cut = EngineConfig(max_len=96, batch_size=2, use_eos=False, stop_ids=(stop,))
  for drafter in (None, DraftModelDrafter.from_model(draft, gamma=4)):
    out = SpecEngine(target, drafter, cut).generate(prompts, max_new_tokens=30).tokens
    for ref, got in zip(free, out):
      expected = ref[: ref.index(stop) + 1] if stop in ref else ref
      assert got == expected


def test_per_sequence_budgets(models):
  target, draft = models
  eng = SpecEngine(
    target,
    DraftModelDrafter.from_model(draft, gamma=4),
    EngineConfig(max_len=96, batch_size=2, use_eos=False),
  )
  out = eng.generate(_prompts(2), max_new_tokens=[7, 13])
  assert [len(t) for t in out.tokens] == [7, 13]


def test_clear_errors_before_compiling(models):
  target, draft = models
  eng = SpecEngine(
    target, DraftModelDrafter.from_model(draft, gamma=4), EngineConfig(max_len=32, batch_size=2)
  )
  with pytest.raises(jaxspec.InputError, match="more than max_len=32"):
    eng.generate([[5] * 20], max_new_tokens=10)
  with pytest.raises(jaxspec.InputError, match="outside the vocabulary"):
    eng.generate([[5, 96]], max_new_tokens=2)
  with pytest.raises(jaxspec.InputError, match="1..2 per call"):
    eng.generate([[5]] * 3, max_new_tokens=2)
  with pytest.raises(jaxspec.InputError, match="tokenizer"):
    eng.generate(["def f():"], max_new_tokens=2)
  assert eng.compile_counts()["loop"] == 0
  small = engine_models.random_draft(vocab=50)
  with pytest.raises(jaxspec.InputError, match="vocabulary"):
    SpecEngine(target, DraftModelDrafter.from_model(small), EngineConfig())


def test_one_compile_for_twenty_calls_and_seeded_repeats(models):
  target, draft = models
  eng = SpecEngine(
    target,
    DraftModelDrafter.from_model(draft, gamma=3),
    EngineConfig(max_len=64, batch_size=2, use_eos=False),
  )
  rng = np.random.default_rng(7)
  for i in range(20):
    n = int(rng.integers(1, 16))
    prompts = [list(rng.integers(0, 96, n)), list(rng.integers(0, 96, max(1, n - 3)))][: 1 + i % 2]
    eng.generate(
      prompts,
      max_new_tokens=int(rng.integers(2, 30)),
      temperature=float(rng.choice([0.0, 0.7, 1.0])),
      top_p=float(rng.choice([1.0, 0.9])),
      seed=i,
    )
  compiles = dict(prefill=1, loop=1, insert=0, insert_rows=0, evict=0, set_page_table=0)
  assert eng.compile_counts() == compiles
  a = eng.generate([[1, 2, 3]], max_new_tokens=20, temperature=1.0, seed=5).tokens
  b = eng.generate([[1, 2, 3]], max_new_tokens=20, temperature=1.0, seed=5).tokens
  c = eng.generate([[1, 2, 3]], max_new_tokens=20, temperature=1.0, seed=6).tokens
  assert a == b and a != c


def test_stream_yields_the_same_tokens(models):
  target, draft = models
  eng = SpecEngine(
    target,
    DraftModelDrafter.from_model(draft, gamma=3),
    EngineConfig(max_len=64, batch_size=2, use_eos=False, stream_every=2),
  )
  prompts = _prompts(2)
  full = eng.generate(prompts, max_new_tokens=17).tokens
  pieces = [[], []]
  for chunk in eng.stream(prompts, max_new_tokens=17):
    for i, c in enumerate(chunk):
      pieces[i] += c
  assert pieces == full


# ------------------------------------------------------------------------------------------------
# Sampled losslessness on exact bigram models
# ------------------------------------------------------------------------------------------------


def _random_table(rng, vocab, alpha=1.0):
  return rng.dirichlet(np.full(vocab, alpha), size=vocab).astype(np.float64)


def _sequence_distribution(engine, start, length, calls, batch):
  counts = {}
  for s in range(calls):
    out = engine.generate([[start]] * batch, max_new_tokens=length, temperature=1.0, seed=s)
    for t in out.tokens:
      counts[tuple(t)] = counts.get(tuple(t), 0) + 1
  return counts


def _exact_probs(table, start, length):
  vocab = table.shape[0]
  outcomes = list(itertools.product(range(vocab), repeat=length))
  probs = []
  for seq in outcomes:
    p, prev = 1.0, start
    for tok in seq:
      p *= table[prev, tok]
      prev = tok
    probs.append(p)
  return outcomes, np.asarray(probs)


def _chi2_pvalue(counts, outcomes, probs):
  n = sum(counts.values())
  obs = np.array([counts.get(o, 0) for o in outcomes], np.float64)
  assert obs.sum() == n
  return scipy_stats.chisquare(obs, probs * n).pvalue


@pytest.mark.parametrize("gamma", [1, 3])
def test_sampled_sequences_follow_the_target_distribution(gamma):
  rng = np.random.default_rng(gamma)
  p_table, q_table = _random_table(rng, 3), _random_table(rng, 3)
  target, draft = engine_models.bigram_model(p_table), engine_models.bigram_model(q_table)
  batch = 512
  eng = SpecEngine(
    target,
    DraftModelDrafter.from_model(draft, gamma=gamma),
    EngineConfig(max_len=16, batch_size=batch, use_eos=False, min_prompt_bucket=1),
  )
  counts = _sequence_distribution(eng, 0, 4, calls=24, batch=batch)
  outcomes, probs = _exact_probs(p_table, 0, 4)
  assert _chi2_pvalue(counts, outcomes, probs) > 1e-4
  # The same samples are far from the draft's own distribution (the test has power).
  _, q_probs = _exact_probs(q_table, 0, 4)
  assert _chi2_pvalue(counts, outcomes, q_probs) < 1e-8


def test_acceptance_length_matches_closed_form():
  rng = np.random.default_rng(11)
  vocab, gamma = 4, 3
  p = rng.dirichlet(np.ones(vocab))
  q = rng.dirichlet(np.ones(vocab))
  target = engine_models.bigram_model(np.tile(p, (vocab, 1)))
  draft = engine_models.bigram_model(np.tile(q, (vocab, 1)))
  alpha = float(np.minimum(p, q).sum())
  expected = (1 - alpha ** (gamma + 1)) / (1 - alpha)
  eng = SpecEngine(
    target,
    DraftModelDrafter.from_model(draft, gamma=gamma),
    EngineConfig(max_len=80, batch_size=256, use_eos=False, min_prompt_bucket=1),
  )
  hist = np.zeros(gamma + 1)
  for s in range(4):
    out = eng.generate([[0]] * 256, max_new_tokens=60, temperature=1.0, seed=s)
    hist += np.asarray(out.stats.summary["accept_hist"])
  k = np.arange(gamma + 1)
  mean = float((hist * (k + 1)).sum() / hist.sum())
  std_err = float(np.sqrt((hist * (k + 1 - mean) ** 2).sum() / hist.sum() / hist.sum()))
  assert abs(mean - expected) < 5 * std_err + 1e-3, (mean, expected, std_err)
