"""Tests for jaxspec.speculative.verify: greedy cases, statistical losslessness, and mutation tests.

The statistical tests draw N samples of one speculative step in a single jitted
call (the batch axis is the sample axis) and apply a chi-square goodness-of-fit
test against the exact target distribution. The exact rule must pass
(p-value > 1e-4); every deliberately broken rule must fail the same test
(p-value < 1e-6). Seeds are fixed, so the tests are deterministic.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxspec.speculative import verify
from jaxspec.sampling import SamplingParams, make_sampling_params, warped_probs
from jaxspec.speculative.verify import verify_chain, verify_chain_greedy

from tests import broken_rules

N = 200_000
V = 8
PASS_P = 1e-4
FAIL_P = 1e-6
BROKEN = sorted(broken_rules.CHAIN)
# Rules that are wrong already for the first committed token (bonus_off_by_one is not:
# it only changes the token after γ accepted drafts).
BROKEN_FIRST = [v for v in BROKEN if v != "bonus_off_by_one"]


def _dirichlet(rng, shape, alpha=1.5):
  return rng.dirichlet(np.full(shape[-1], alpha), size=shape[:-1]).astype(np.float32)


def _pvalue(samples, probs):
  """Chi-square p-value of integer samples against probs; 0 if a zero-probability cell is hit."""
  probs = np.asarray(probs, np.float64).ravel()
  probs = probs / probs.sum()
  counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size)
  support = probs > 0
  if counts[~support].sum() > 0:
    return 0.0
  return scipy.stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue


# --------------------------------------------------------------------------- greedy


def _logits_with_argmax(argmaxes, vocab=6):
  """[1, len, vocab] logits whose argmax at each position is the given token."""
  logits = np.zeros((1, len(argmaxes), vocab), np.float32)
  for i, a in enumerate(argmaxes):
    logits[0, i, a] = 1.0
  return jnp.asarray(logits)


@pytest.mark.parametrize(
  "draft, want_n, want_next",
  [
    ([2, 4, 1], 3, 5),  # all accepted, bonus = argmax at position γ
    ([0, 4, 1], 0, 2),  # first draft wrong
    ([2, 4, 3], 2, 1),  # middle
    ([2, 0, 1], 1, 4),  # a later match after a mismatch does not count
  ],
)
def test_verify_chain_greedy_by_hand(draft, want_n, want_next):
  logits = _logits_with_argmax([2, 4, 1, 5])
  n, nxt = verify_chain_greedy(jnp.array([draft]), logits)
  assert n.dtype == jnp.int32 and nxt.dtype == jnp.int32
  assert (int(n[0]), int(nxt[0])) == (want_n, want_next)


def test_verify_chain_greedy_ties_take_lowest_index():
  logits = jnp.array([[[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]])
  assert [int(x[0]) for x in verify_chain_greedy(jnp.array([[2]]), logits)] == [0, 1]
  assert [int(x[0]) for x in verify_chain_greedy(jnp.array([[1]]), logits)] == [1, 0]


def _random_greedy_case(seed, batch=256, gamma=4, vocab=32):
  """Random logits plus drafts that follow the argmax for a random number of positions."""
  rng = np.random.RandomState(seed)
  logits = rng.randn(batch, gamma + 1, vocab).astype(np.float32)
  top = logits.argmax(-1)
  draft = rng.randint(0, vocab, (batch, gamma))
  keep = rng.randint(0, gamma + 1, batch)
  for b in range(batch):
    draft[b, : keep[b]] = top[b, : keep[b]]
  return jnp.asarray(draft, jnp.int32), jnp.asarray(logits)


@pytest.mark.parametrize("q_kind", ["dirichlet", "one_hot", "none"])
def test_temperature_zero_rows_equal_greedy(q_kind):
  draft, logits = _random_greedy_case(0)
  batch, gamma = draft.shape
  vocab = logits.shape[-1]
  rng = np.random.RandomState(1)
  if q_kind == "dirichlet":
    q = jnp.asarray(_dirichlet(rng, (batch, gamma, vocab), alpha=0.3))
  elif q_kind == "one_hot":
    q = jax.nn.one_hot(draft, vocab)
  else:
    q = None
  temps = np.where(np.arange(batch) % 2 == 0, 0.0, 1.0)  # even rows greedy
  sp = make_sampling_params(batch, temperature=temps, top_k=np.arange(batch) % 4, top_p=0.9)
  n, nxt = jax.jit(verify_chain)(jax.random.PRNGKey(0), draft, q, logits, sp)
  gn, gnxt = verify_chain_greedy(draft, logits)
  np.testing.assert_array_equal(n[::2], gn[::2])
  np.testing.assert_array_equal(nxt[::2], gnxt[::2])


@pytest.mark.parametrize("q_kind", ["dirichlet", "one_hot"])
def test_temperature_zero_core_rule_is_greedy(q_kind):
  """Without the explicit greedy select, one-hot p already gives the greedy rule."""
  draft, logits = _random_greedy_case(2)
  batch, gamma = draft.shape
  vocab = logits.shape[-1]
  if q_kind == "dirichlet":
    q = jnp.asarray(_dirichlet(np.random.RandomState(3), (batch, gamma, vocab), alpha=0.3))
  else:
    q = jax.nn.one_hot(draft, vocab)
  sp = make_sampling_params(batch, temperature=0.0)
  # Feed the warped (one-hot) target as T=1 logits so the greedy select is not taken.
  greedy_logp = jnp.log(warped_probs(logits, sp))
  n, nxt = jax.jit(verify_chain)(
    jax.random.PRNGKey(4), draft, q, greedy_logp, make_sampling_params(batch, 1.0)
  )
  gn, gnxt = verify_chain_greedy(draft, logits)
  np.testing.assert_array_equal(n, gn)
  np.testing.assert_array_equal(nxt, gnxt)


def test_none_draft_probs_equals_one_hot_and_is_seeded():
  draft, logits = _random_greedy_case(5, gamma=3)
  sp = make_sampling_params(draft.shape[0], temperature=0.8)
  key = jax.random.PRNGKey(7)
  run = jax.jit(verify_chain)
  a = run(key, draft, None, logits, sp)
  b = run(key, draft, jax.nn.one_hot(draft, logits.shape[-1]), logits, sp)
  c = run(key, draft, None, logits, sp)
  for x, y, z in zip(a, b, c):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(x, z)


def test_shape_errors_are_clear():
  sp = make_sampling_params(2, temperature=1.0)
  with pytest.raises(ValueError, match="target_logits"):
    verify_chain(
      jax.random.PRNGKey(0), jnp.zeros((2, 3), jnp.int32), None, jnp.zeros((2, 3, 5)), sp
    )
  with pytest.raises(ValueError, match="draft_probs"):
    verify_chain(
      jax.random.PRNGKey(0),
      jnp.zeros((2, 3), jnp.int32),
      jnp.zeros((2, 3, 4)),
      jnp.zeros((2, 4, 5)),
      sp,
    )


# ------------------------------------------------------------ statistical: one step


@functools.partial(jax.jit, static_argnames=("gamma", "variant"))
def _first_token(key, p, q, gamma, variant):
  """First committed token of N context-free speculative steps (same p, q at every position).

  ``q=None`` drafts deterministically: the draft is token V-1 at every position.
  """
  k_draft, k_verify = jax.random.split(key)
  if q is None:
    draft = jnp.full((N, gamma), V - 1, jnp.int32)
    q_arr = None
  else:
    draft = jax.random.categorical(k_draft, jnp.log(q), shape=(N, gamma)).astype(jnp.int32)
    q_arr = jnp.broadcast_to(q, (N, gamma, V))
  logits = jnp.broadcast_to(jnp.log(p), (N, gamma + 1, V))
  sp = make_sampling_params_jit(N)
  n, nxt = verify.verify_chain_sampled(k_verify, draft, q_arr, logits, sp, _rule(variant))
  return jnp.where(n > 0, draft[:, 0], nxt), n


def _rule(variant: str) -> verify.ChainRule:
  return verify.EXACT if variant == "exact" else broken_rules.CHAIN[variant]


def make_sampling_params_jit(batch, temperature=1.0):
  """In-jit constructor (make_sampling_params validates on the host)."""
  return SamplingParams(
    jnp.full((batch,), temperature, jnp.float32),
    jnp.zeros((batch,), jnp.int32),
    jnp.ones((batch,), jnp.float32),
  )


def _pq(seed):
  rng = np.random.RandomState(seed)
  return jnp.asarray(_dirichlet(rng, (V,))), jnp.asarray(_dirichlet(rng, (V,)))


@pytest.mark.parametrize("gamma", [1, 3])
def test_exact_rule_first_token_matches_target(gamma):
  p, q = _pq(10 + gamma)
  first, _ = _first_token(jax.random.PRNGKey(gamma), p, q, gamma, "exact")
  pval = _pvalue(first, p)
  assert pval > PASS_P, pval
  # Total variation within 3 sqrt(V/N) as well.
  freq = np.bincount(np.asarray(first), minlength=V) / N
  assert 0.5 * np.abs(freq - np.asarray(p)).sum() < 3 * np.sqrt(V / N)


@pytest.mark.parametrize("variant", BROKEN_FIRST)
def test_broken_rules_fail_first_token_test(variant):
  p, q = _pq(11)
  first, _ = _first_token(jax.random.PRNGKey(1), p, q, 1, variant)
  pval = _pvalue(first, p)
  assert pval < FAIL_P, (variant, pval)


def test_deterministic_draft_is_lossless():
  p, _ = _pq(12)
  first, n = _first_token(jax.random.PRNGKey(2), p, None, 2, "exact")
  assert _pvalue(first, p) > PASS_P
  # With a one-hot q the acceptance probability is p(x).
  np.testing.assert_allclose(
    np.mean(np.asarray(n) > 0), float(p[V - 1]), atol=5 * np.sqrt(0.25 / N)
  )


def test_warped_target_is_the_reference():
  """Losslessness is relative to the warped target (temperature, top-k, top-p)."""
  key = jax.random.PRNGKey(3)
  kp, kq, kd, kv = jax.random.split(key, 4)
  vocab, gamma = 12, 2
  target = 0.5 * jax.random.normal(kp, (vocab,))
  drafter = target + 0.4 * jax.random.normal(kq, (vocab,))
  sp1 = make_sampling_params(1, temperature=0.7, top_k=6, top_p=0.9)
  p = warped_probs(target[None], sp1)[0]
  q = warped_probs(drafter[None], sp1)[0]

  @jax.jit
  def run(kd, kv, target, q):
    sp = make_sampling_params_jit(N, 0.7)
    sp = sp.replace(top_k=jnp.full((N,), 6, jnp.int32), top_p=jnp.full((N,), 0.9, jnp.float32))
    draft = jax.random.categorical(kd, jnp.log(q), shape=(N, gamma)).astype(jnp.int32)
    n, nxt = verify_chain(
      kv,
      draft,
      jnp.broadcast_to(q, (N, gamma, vocab)),
      jnp.broadcast_to(target, (N, gamma + 1, vocab)),
      sp,
    )
    return jnp.where(n > 0, draft[:, 0], nxt)

  assert _pvalue(run(kd, kv, target, q), p) > PASS_P


# ------------------------------------------------- statistical: two tokens, bigram target


@functools.partial(jax.jit, static_argnames=("gamma", "variant"))
def _first_two_tokens(key, p1, ptab, q1, qtab, gamma, variant):
  """First two committed tokens of the stream, with bigram target and draft tables.

  Target: y1 ~ p1, y_{t+1} ~ ptab[y_t]; draft: x1 ~ q1, x_{t+1} ~ qtab[x_t]. When
  the first step commits only one token, the second comes from a second step
  whose context is that token (its first distributions are ptab[y1], qtab[y1]).
  """
  keys = jax.random.split(key, 2 * gamma + 2)

  def step(k_draft, k_verify, p_first, q_first):
    drafts, qs, ps = [], [q_first], [p_first]
    for i in range(gamma):  # static γ, drafts are sequential by definition
      x = jax.random.categorical(k_draft[i], jnp.log(qs[-1])).astype(jnp.int32)
      drafts.append(x)
      qs.append(qtab[x])
      ps.append(ptab[x])
    draft = jnp.stack(drafts, axis=1)
    q_arr = jnp.stack(qs[:gamma], axis=1)
    logits = jnp.log(jnp.stack(ps, axis=1))
    n, nxt = verify.verify_chain_sampled(
      k_verify, draft, q_arr, logits, make_sampling_params_jit(N), _rule(variant)
    )
    return draft, n, nxt

  d1, n1, t1 = step(
    keys[:gamma], keys[gamma], jnp.broadcast_to(p1, (N, V)), jnp.broadcast_to(q1, (N, V))
  )
  y1 = jnp.where(n1 > 0, d1[:, 0], t1)
  d2, n2, t2 = step(keys[gamma + 1 : 2 * gamma + 1], keys[2 * gamma + 1], ptab[y1], qtab[y1])
  y2_next_step = jnp.where(n2 > 0, d2[:, 0], t2)
  y2 = jnp.where(n1 >= 2, d1[:, min(1, gamma - 1)], jnp.where(n1 == 1, t1, y2_next_step))
  return y1, y2


def _bigram_tables(seed):
  rng = np.random.RandomState(seed)
  return tuple(
    jnp.asarray(x)
    for x in (
      _dirichlet(rng, (V,)),
      _dirichlet(rng, (V, V)),
      _dirichlet(rng, (V,)),
      _dirichlet(rng, (V, V)),
    )
  )


def _joint_pvalue(y1, y2, p1, ptab):
  joint = np.asarray(p1, np.float64)[:, None] * np.asarray(ptab, np.float64)
  return _pvalue(np.asarray(y1) * V + np.asarray(y2), joint)


def test_exact_rule_joint_of_first_two_tokens():
  p1, ptab, q1, qtab = _bigram_tables(20)
  y1, y2 = _first_two_tokens(jax.random.PRNGKey(4), p1, ptab, q1, qtab, 3, "exact")
  assert _pvalue(y1, p1) > PASS_P
  pval = _joint_pvalue(y1, y2, p1, ptab)
  assert pval > PASS_P, pval


@pytest.mark.parametrize("variant", BROKEN)
def test_broken_rules_fail_joint_test(variant):
  p1, ptab, q1, qtab = _bigram_tables(21)
  gamma = 1 if variant == "bonus_off_by_one" else 3  # with γ=1 the bonus is the 2nd token
  y1, y2 = _first_two_tokens(jax.random.PRNGKey(5), p1, ptab, q1, qtab, gamma, variant)
  pval = _joint_pvalue(y1, y2, p1, ptab)
  assert pval < FAIL_P, (variant, pval)


# ---------------------------------------------------------- acceptance-length oracle


@pytest.mark.parametrize("gamma", [1, 4])
def test_mean_acceptance_matches_closed_form(gamma):
  p, q = _pq(30 + gamma)
  _, n = _first_token(jax.random.PRNGKey(6 + gamma), p, q, gamma, "exact")
  tokens = np.asarray(n, np.float64) + 1
  alpha = float(np.minimum(np.asarray(p, np.float64), np.asarray(q, np.float64)).sum())
  expected = (1 - alpha ** (gamma + 1)) / (1 - alpha)
  half_width = 5 * tokens.std() / np.sqrt(N)
  assert abs(tokens.mean() - expected) < half_width, (tokens.mean(), expected, half_width)
