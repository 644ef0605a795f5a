"""The gated delta rule: chunked and recurrent forms against the token-by-token reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import gated_deltanet as gdn


def _inputs(seed: int, b: int = 2, t: int = 11, h: int = 3, dk: int = 8, dv: int = 4):
  rng = np.random.default_rng(seed)
  q = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) * dk**-0.5
  k = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32))
  v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
  g = -jnp.asarray(rng.uniform(0.01, 1.5, size=(b, t, h)), jnp.float32)  # log decay ≤ 0
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32))
  s0 = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
  return q, k, v, g, beta, s0


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_chunked_equals_recurrent_reference(chunk):
  """Across chunk borders (11 tokens in chunks of 4 and 5: padded last chunk), one chunk
  wider than the block, with and without an initial state."""
  q, k, v, g, beta, s0 = _inputs(0)
  for init in (None, s0):
    ref_out, ref_s = gdn.recurrent_reference(q, k, v, g, beta, init)
    out, s = jax.jit(gdn.chunked, static_argnames="chunk_size")(
      q, k, v, g, beta, init, chunk_size=chunk
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-5, rtol=1e-5)


def test_recurrent_snapshots_are_prefix_states():
  """states[:, j] is the reference's final state after tokens 0..j; outputs agree too."""
  q, k, v, g, beta, s0 = _inputs(1, t=6)
  out, states = jax.jit(gdn.recurrent)(q, k, v, g, beta, s0)
  ref_out, _ = gdn.recurrent_reference(q, k, v, g, beta, s0)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5)
  for j in range(6):
    _, ref_s = gdn.recurrent_reference(
      q[:, : j + 1], k[:, : j + 1], v[:, : j + 1], g[:, : j + 1], beta[:, : j + 1], s0
    )
    np.testing.assert_allclose(np.asarray(states[:, j]), np.asarray(ref_s), atol=1e-5)


def test_state_carried_across_calls_equals_one_call():
  """Two chunked calls (7 + 6 tokens, chunks of 4) with the state carried equal one call; a
  padding token (g = 0, β = 0) leaves the state unchanged."""
  q, k, v, g, beta, s0 = _inputs(2, t=13)
  chunked = jax.jit(gdn.chunked, static_argnames="chunk_size")
  out, s = chunked(q, k, v, g, beta, s0, chunk_size=4)
  a = [x[:, :7] for x in (q, k, v, g, beta)]
  c = [x[:, 7:] for x in (q, k, v, g, beta)]
  out1, s1 = chunked(*a, s0, chunk_size=4)
  out2, s2 = chunked(*c, s1, chunk_size=4)
  np.testing.assert_allclose(np.concatenate([out1, out2], 1), np.asarray(out), atol=1e-5)
  np.testing.assert_allclose(np.asarray(s2), np.asarray(s), atol=1e-5)
  zero = jnp.zeros_like(g[:, :3])
  _, s3 = chunked(q[:, :3], k[:, :3], v[:, :3], zero, zero, s, chunk_size=4)
  np.testing.assert_allclose(np.asarray(s3), np.asarray(s), atol=1e-6)


def test_chunked_with_strong_decay_stays_finite_and_exact():
  """Decays of e^-20 per token (exp of the in-chunk cumulative decay underflows to 0): still
  finite and equal to the reference."""
  q, k, v, g, beta, s0 = _inputs(3, t=9)
  g = g * 14.0 - 1.0
  ref_out, ref_s = gdn.recurrent_reference(q, k, v, g, beta, s0)
  out, s = jax.jit(gdn.chunked, static_argnames="chunk_size")(q, k, v, g, beta, s0, chunk_size=8)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-5, rtol=1e-5)
