"""Tests for jaxspec.sampling: warping masks, greedy rows, sampling frequencies, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxspec import sampling
from jaxspec.sampling import make_sampling_params, sample

# Jitted once per input shape: eager lax.cond / sort dispatch is slow on CPU.
warp_logits = jax.jit(sampling.warp_logits)
warped_probs = jax.jit(sampling.warped_probs)


def _finite(x):
  return np.isfinite(np.asarray(x))


def test_make_sampling_params_broadcasts():
  sp = make_sampling_params(3, temperature=[0.0, 0.5, 1.0], top_k=5, top_p=0.9)
  assert sp.temperature.shape == sp.top_k.shape == sp.top_p.shape == (3,)
  assert sp.temperature.dtype == jnp.float32 and sp.top_k.dtype == jnp.int32
  np.testing.assert_allclose(sp.temperature, [0.0, 0.5, 1.0])
  np.testing.assert_array_equal(sp.top_k, [5, 5, 5])
  assert sp.batch_size == 3
  # A pytree of arrays: leaves are the three arrays.
  assert len(jax.tree_util.tree_leaves(sp)) == 3


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=[0.1, 0.2]), "length batch=3"),
  ],
)
def test_make_sampling_params_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_sampling_params(3, **kwargs)


def test_temperature_scaling():
  logits = jnp.array([[1.0, 2.0, 0.5, -1.0]])
  sp = make_sampling_params(1, temperature=0.5)
  np.testing.assert_allclose(warped_probs(logits, sp), jax.nn.softmax(logits / 0.5), rtol=1e-6)


def test_top_k_mask():
  logits = jnp.array([[0.1, 3.0, -1.0, 2.0, 5.0, 0.0]] * 4)
  sp = make_sampling_params(4, temperature=1.0, top_k=[2, 0, 6, 1])
  w = warp_logits(logits, sp)
  np.testing.assert_array_equal(_finite(w[0]), [0, 1, 0, 0, 1, 0])
  assert _finite(w[1]).all() and _finite(w[2]).all()  # 0 = off, k >= V = off
  np.testing.assert_array_equal(_finite(w[3]), [0, 0, 0, 0, 1, 0])
  # Kept entries are unchanged; probabilities renormalise over the kept set.
  np.testing.assert_allclose(w[0, [1, 4]], [3.0, 5.0])
  np.testing.assert_allclose(
    warped_probs(logits, sp)[0, [1, 4]], jax.nn.softmax(jnp.array([3.0, 5.0])), rtol=1e-6
  )


def test_top_k_keeps_ties():
  logits = jnp.array([[1.0, 2.0, 2.0, 0.0]])
  w = warp_logits(logits, make_sampling_params(1, temperature=1.0, top_k=1))
  np.testing.assert_array_equal(_finite(w[0]), [0, 1, 1, 0])


def test_top_p_mask():
  probs = np.array([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
  logits = jnp.log(jnp.array([probs] * 5, jnp.float32))
  sp = make_sampling_params(5, temperature=1.0, top_p=[0.45, 0.7, 0.81, 1.0, 1e-3])
  keep = _finite(warp_logits(logits, sp))
  np.testing.assert_array_equal(keep[0], [0, 1, 0, 0])  # 0.5 >= 0.45
  np.testing.assert_array_equal(keep[1], [0, 1, 0, 1])  # 0.8 >= 0.7
  np.testing.assert_array_equal(keep[2], [0, 1, 1, 1])  # 0.95 >= 0.81
  assert keep[3].all()  # off
  np.testing.assert_array_equal(keep[4], [0, 1, 0, 0])  # top token always kept
  np.testing.assert_allclose(warped_probs(logits, sp)[1], [0, 0.5 / 0.8, 0, 0.3 / 0.8], rtol=1e-5)


def test_top_p_off_keeps_tiny_tail():
  # With p = 1 nothing may be dropped, even tokens whose mass rounds away in float32.
  logits = jnp.array([[30.0, 0.0, -5.0, -40.0]])
  assert _finite(warp_logits(logits, make_sampling_params(1, temperature=1.0, top_p=1.0))).all()


def test_top_k_then_top_p():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  logits = jnp.log(jnp.array([probs], jnp.float32))
  # After top-3: [0.526, 0.316, 0.158]; nucleus 0.8 needs the first two (0.842).
  sp = make_sampling_params(1, temperature=1.0, top_k=3, top_p=0.8)
  np.testing.assert_array_equal(_finite(warp_logits(logits, sp))[0], [1, 1, 0, 0])
  # Temperature is applied before top-p: T=0.1 concentrates mass on the top token.
  sp = make_sampling_params(1, temperature=0.1, top_p=0.8)
  np.testing.assert_array_equal(_finite(warp_logits(logits, sp))[0], [1, 0, 0, 0])


def test_greedy_rows_are_one_hot_at_argmax():
  logits = jnp.array([[0.0, 3.0, 3.0, 1.0], [2.0, -1.0, 0.5, 2.5]])
  sp = make_sampling_params(2, temperature=0.0, top_k=[0, 2], top_p=[1.0, 0.3])
  probs = warped_probs(logits, sp)
  np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [0, 0, 0, 1]])  # tie -> lowest index
  toks = sample(jax.random.PRNGKey(0), logits, sp)
  np.testing.assert_array_equal(toks, jnp.argmax(logits, -1))
  assert toks.dtype == jnp.int32


def test_greedy_sampling_is_exact_argmax_many_rows():
  logits = jax.random.normal(jax.random.PRNGKey(1), (512, 3, 50))
  sp = make_sampling_params(512, temperature=0.0)
  toks = jax.jit(sample)(jax.random.PRNGKey(2), logits, sp)
  np.testing.assert_array_equal(toks, jnp.argmax(logits, -1))


def test_middle_axes_and_per_row_params():
  key = jax.random.PRNGKey(3)
  logits = 2.0 * jax.random.normal(key, (4, 3, 20))
  sp = make_sampling_params(
    4, temperature=[0.0, 0.7, 1.3, 1.0], top_k=[0, 5, 0, 3], top_p=[1.0, 1.0, 0.6, 0.9]
  )
  batched = warp_logits(logits, sp)
  assert batched.shape == logits.shape and batched.dtype == jnp.float32
  for b in range(4):
    one = sampling.SamplingParams(
      sp.temperature[b : b + 1], sp.top_k[b : b + 1], sp.top_p[b : b + 1]
    )
    for t in range(3):
      np.testing.assert_array_equal(warp_logits(logits[b : b + 1, t], one)[0], batched[b, t])


def _chisq(samples, probs):
  probs = np.asarray(probs, np.float64)
  probs = probs / probs.sum()
  counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size)
  support = probs > 0
  assert counts[~support].sum() == 0, "sampled a masked token"
  return scipy.stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue


def test_sampling_frequencies_match_warped_probs():
  n = 200_000
  logits = 1.5 * jax.random.normal(jax.random.PRNGKey(4), (12,))
  configs = [
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=6),
    dict(temperature=1.4, top_p=0.85),
    dict(temperature=0.9, top_k=8, top_p=0.9),
  ]
  # All configurations in one batch: rows [i*n, (i+1)*n) use configuration i.
  temps = np.repeat([c.get("temperature", 1.0) for c in configs], n)
  ks = np.repeat([c.get("top_k", 0) for c in configs], n)
  ps = np.repeat([c.get("top_p", 1.0) for c in configs], n)
  sp = make_sampling_params(len(configs) * n, temperature=temps, top_k=ks, top_p=ps)
  toks = np.asarray(
    jax.jit(sample)(jax.random.PRNGKey(5), jnp.broadcast_to(logits, (len(ps), 12)), sp)
  )
  for i, c in enumerate(configs):
    expected = warped_probs(logits[None], make_sampling_params(1, **c))[0]
    pval = _chisq(toks[i * n : (i + 1) * n], expected)
    assert pval > 1e-4, (c, pval)


def test_new_temperature_does_not_recompile():
  traces = []

  @jax.jit
  def f(key, logits, params):
    traces.append(1)  # Python side effect: runs once per trace
    return sample(key, logits, params)

  logits = jax.random.normal(jax.random.PRNGKey(6), (2, 16))
  for t, k, p in [(0.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.5), (2.0, 16, 1.0)]:
    f(jax.random.PRNGKey(0), logits, make_sampling_params(2, temperature=t, top_k=k, top_p=p))
  assert len(traces) == 1


def test_fast_argmax_matches_jnp_argmax_with_ties_and_bools():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 5, (3, 7, 64)).astype(np.float32)  # many ties: first index wins
  np.testing.assert_array_equal(np.asarray(sampling.argmax(jnp.asarray(x))), np.argmax(x, axis=-1))
  b = rng.random((4, 33)) > 0.8
  b[0] = False  # an all-False row gives 0, as jnp.argmax does
  np.testing.assert_array_equal(np.asarray(sampling.argmax(jnp.asarray(b))), np.argmax(b, -1))
  assert sampling.argmax(jnp.zeros((2, 5))).dtype == jnp.int32
