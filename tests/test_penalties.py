"""Penalties and logit bias (jaxspec/penalties.py) under speculative sampling.

The adjustments are checked against a numpy oracle; then whole generations from exact bigram
models, with a draft model proposing chains and recursive trees, must follow the *adjusted*
target's distribution over 4-token continuations (chi-square). Two wrong engines must fail the
same test: one that adjusts every verify position with the counts of the committed text only
(ignoring the drafts before it in the block), and one without the adjustments.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.errors import InputError
from jaxspec.penalties import Penalties, block_counts
from jaxspec.speculative import step as step_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig

from tests import engine_models

VOCAB = 3
ADJUST = dict(presence_penalty=0.9, frequency_penalty=0.6, repetition_penalty=1.4)
BIAS = {1: 0.7, 2: -0.4}


def _oracle(logits, seen, counts, presence, frequency, repetition, bias):
  x = logits.astype(np.float64).copy()
  for token, value in bias.items():
    x[token] += value
  rep = seen | (counts > 0)
  x = np.where(rep, np.where(x > 0, x / repetition, x * repetition), x)
  return x - presence * (counts > 0) - frequency * counts


def test_adjust_equals_the_oracle_in_a_chain_and_a_tree():
  rng = np.random.default_rng(0)
  batch, t, vocab = 2, 4, 7
  logits = rng.normal(0, 2, (batch, t, vocab)).astype(np.float32)
  prompts = np.array([[1, 2, 2, 0], [3, 3, 0, 0]], np.int32)
  prompt_len = np.array([3, 2], np.int32)
  bias_ids = np.array([[4, 1, vocab], [6, vocab, vocab]], np.int32)
  bias_values = np.array([[1.5, -2.0, 9.0], [3.0, 9.0, 9.0]], np.float32)
  presence, frequency, repetition = [0.5, -0.3], [0.25, 0.75], [1.3, 0.8]
  pen = Penalties.create(
    vocab, presence, frequency, repetition, bias_ids, bias_values, prompts, prompt_len
  )
  pen = pen.observe(jnp.asarray([[5, 5, 1], [2, 0, 0]]), jnp.asarray([[1, 1, 1], [1, 0, 0]], bool))
  block = np.array([[5, 2, 4, 2], [1, 6, 6, 3]], np.int32)  # position 0: the committed root
  parents = (-1, 0, 1, 0)  # a tree: 0 → 1 → 2, 0 → 3
  tree = np.zeros((t, t), bool)
  for i, p in enumerate(parents):
    tree[i, i] = True
    while p >= 0:
      tree[i, p], p = True, parents[p]
  for mask in (None, tree):
    got = np.asarray(pen.adjust(jnp.asarray(logits), block_counts(jnp.asarray(block), vocab, mask)))
    ancestors = np.tril(np.ones((t, t), bool)) if mask is None else tree
    for b in range(batch):
      counts0 = np.bincount([[5, 5, 1], [2]][b], minlength=vocab)
      seen = np.zeros(vocab, bool)
      seen[prompts[b, : prompt_len[b]]] = True
      bias = {int(i): float(v) for i, v in zip(bias_ids[b], bias_values[b]) if i < vocab}
      for j in range(t):
        prefix = [block[b, i] for i in range(1, t) if ancestors[j, i]]
        counts = counts0 + np.bincount(prefix, minlength=vocab)
        want = _oracle(
          logits[b, j], seen, counts, presence[b], frequency[b], repetition[b], bias
        )
        np.testing.assert_allclose(got[b, j], want, atol=1e-5)
  off = Penalties.off(batch)
  assert off.adjust(jnp.asarray(logits)) is not None and not off.enabled
  np.testing.assert_array_equal(np.asarray(off.adjust(jnp.asarray(logits))), logits)


def _exact_adjusted(table, start, length, temperature, adjust=True):
  """Outcomes of `length` tokens after the prompt [start] and their probabilities under the
  bigram `table` adjusted by ADJUST and BIAS (the prompt token is seen), at `temperature`."""
  outcomes = list(itertools.product(range(table.shape[0]), repeat=length))
  probs = []
  for seq in outcomes:
    p, prev, counts = 1.0, start, np.zeros(VOCAB)
    seen = np.zeros(VOCAB, bool)
    seen[start] = True
    for tok in seq:
      logits = np.log(table[prev])
      if adjust:
        logits = _oracle(
          logits,
          seen,
          counts,
          ADJUST["presence_penalty"],
          ADJUST["frequency_penalty"],
          ADJUST["repetition_penalty"],
          BIAS,
        )
      w = np.exp((logits - logits.max()) / temperature)
      p *= w[tok] / w.sum()
      counts[tok] += 1
      prev = tok
    probs.append(p)
  return outcomes, np.asarray(probs)


def _pvalue(counts, outcomes, probs):
  obs = np.array([counts.get(o, 0) for o in outcomes], np.float64)
  return scipy_stats.chisquare(obs, probs * obs.sum()).pvalue


def _sample(verify: str, temperature: float, runs: int = 12, batch: int = 512):
  rng = np.random.default_rng(7)
  p_table = rng.dirichlet(np.ones(VOCAB), size=VOCAB)
  q_table = rng.dirichlet(np.ones(VOCAB), size=VOCAB)
  target = engine_models.bigram_model(p_table)
  drafter = DraftModelDrafter.from_model(engine_models.bigram_model(q_table), gamma=3)
  config = EngineConfig(
    max_len=16,
    batch_size=batch,
    use_eos=False,
    min_prompt_bucket=1,
    verify=verify,
    tree_budget=4,
    penalties=True,
  )
  engine = SpecEngine(target, drafter, config)
  counts: dict = {}
  for seed in range(runs):
    out = engine.generate(
      [[0]] * batch,
      max_new_tokens=4,
      temperature=temperature,
      seed=seed,
      logit_bias=BIAS,
      **ADJUST,
    )
    for tokens in out.tokens:
      counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
  assert out.stats.acceptance_length > 1.2  # drafts were accepted: verification was exercised
  return p_table, counts


@pytest.mark.parametrize("verify, temperature", [("chain", 1.0), ("tree", 0.8)])
def test_adjusted_sampling_follows_the_adjusted_target(verify, temperature):
  p_table, counts = _sample(verify, temperature)
  outcomes, probs = _exact_adjusted(p_table, 0, 4, temperature)
  assert _pvalue(counts, outcomes, probs) > 1e-4
  _, raw = _exact_adjusted(p_table, 0, 4, temperature, adjust=False)
  assert _pvalue(counts, outcomes, raw) < 1e-8  # the test has power


def test_adjusting_with_the_committed_counts_only_fails(monkeypatch):
  """The broken engine adjusts every verify position as if no draft preceded it in the block
  (what applying the penalties to the target's step logits alone does)."""
  monkeypatch.setattr(step_lib, "block_counts", lambda tokens, vocab, mask: jnp.zeros(
    (*tokens.shape, vocab), jnp.int32
  ))
  p_table, counts = _sample("chain", 1.0)
  outcomes, probs = _exact_adjusted(p_table, 0, 4, 1.0)
  assert _pvalue(counts, outcomes, probs) < 1e-6


def test_penalties_need_an_engine_built_for_them():
  target = engine_models.bigram_model(np.full((VOCAB, VOCAB), 1 / VOCAB))
  engine = SpecEngine(target, None, EngineConfig(max_len=16, use_eos=False))
  with pytest.raises(InputError, match="penalties=True"):
    engine.generate([[0]], max_new_tokens=2, presence_penalty=0.5)
  engine = SpecEngine(target, None, EngineConfig(max_len=16, use_eos=False, penalties=True))
  with pytest.raises(InputError, match="outside the vocabulary"):
    engine.generate([[0]], max_new_tokens=2, logit_bias={VOCAB: 1.0})
  with pytest.raises(InputError, match="presence_penalty"):
    engine.generate([[0]], max_new_tokens=2, presence_penalty=3.0)
  with pytest.raises(InputError, match="logit_bias values"):
    engine.generate([[0]], max_new_tokens=2, logit_bias={1: 101})
  with pytest.raises(InputError, match="at most 300"):
    engine.generate([[0]], max_new_tokens=2, logit_bias={i: 1.0 for i in range(301)})
  # Greedy with a bias that forbids the argmax: the next best token.
  free = engine.generate([[0]], max_new_tokens=1).tokens[0][0]
  banned = engine.generate([[0]], max_new_tokens=1, logit_bias={free: -100}).tokens[0][0]
  assert banned != free
