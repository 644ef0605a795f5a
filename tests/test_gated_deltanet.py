"""The gated delta rule: chunked and recurrent forms against the token-by-token reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import gated_deltanet as gdn
from pallas_kernels.gated_delta import reference


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
    ref_out, ref_s = reference.recurrent_reference(q, k, v, g, beta, init)
    out, s = jax.jit(gdn.chunked, static_argnames="chunk_size")(
      q, k, v, g, beta, init, chunk_size=chunk
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-5, rtol=1e-5)


def test_recurrent_snapshots_are_prefix_states():
  """states[:, j] is the reference's final state after tokens 0..j; outputs agree too."""
  q, k, v, g, beta, s0 = _inputs(1, t=6)
  out, states = jax.jit(gdn.recurrent)(q, k, v, g, beta, s0)
  ref_out, _ = reference.recurrent_reference(q, k, v, g, beta, s0)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5)
  for j in range(6):
    _, ref_s = reference.recurrent_reference(
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
  ref_out, ref_s = reference.recurrent_reference(q, k, v, g, beta, s0)
  out, s = jax.jit(gdn.chunked, static_argnames="chunk_size")(q, k, v, g, beta, s0, chunk_size=8)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Tree blocks
# --------------------------------------------------------------------------------------------------

TREES = {  # parents of nodes 0..6 (node 0 the root)
  "chain": [-1, 0, 1, 2, 3, 4, 5],
  "star": [-1, 0, 0, 0, 0, 0, 0],
  "random": [-1, 0, 0, 1, 3, 1, 4],  # depths 0, 1, 1, 2, 3, 2, 4
}


def _mask(parents: list[int]) -> np.ndarray:
  t = len(parents)
  mask = np.eye(t, dtype=bool)
  for i in range(t):
    j = parents[i]
    while j >= 0:
      mask[i, j] = True
      j = parents[j]
  return mask


def _root_path(parents: list[int], i: int) -> list[int]:
  path = [i]
  while parents[path[-1]] >= 0:
    path.append(parents[path[-1]])
  return path[::-1]


@pytest.mark.parametrize("shape", sorted(TREES))
def test_tree_block_equals_each_root_path_run_sequentially(shape):
  """Every node's conv output, rule output and state equal the chain forms run over its root
  path (conv from a committed window of an earlier block, rule from a committed state); row 1
  always has the "random" tree (trees differ per row). Then `LinearState.commit_path`
  + `committed` keep the accepted node's state and the last K − 1 conv inputs of its path."""
  from jaxspec.state import LinearState  # pylint: disable=import-outside-toplevel

  t, kernel, ch = 7, 4, 5
  parents = [TREES[shape], TREES["random"]]
  mask = jnp.asarray(np.stack([_mask(p) for p in parents]))
  q, k, v, g, beta, s0 = _inputs(7, t=t)
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.normal(size=(2, t, ch)), jnp.float32)
  window = jnp.asarray(rng.normal(size=(2, kernel - 1, ch)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(kernel, ch)), jnp.float32)

  par, depth = gdn.tree_structure(mask)
  np.testing.assert_array_equal(np.asarray(par), np.asarray(parents))
  conv_out, z = jax.jit(gdn.tree_causal_conv)(x, window, w, par, depth)
  out, states = jax.jit(gdn.tree_recurrent)(q, k, v, g, beta, par, s0)
  # The oracle, batched over every (row, node): its root path front-padded with tokens that
  # leave the state alone (g = 0, β = 0), and the conv window it ends with.
  pads, windows, last = [], [], []
  for b in range(2):
    for i in range(t):
      path = _root_path(parents[b], i)
      pads.append([-1] * (t - len(path)) + path)
      seen = np.concatenate([np.asarray(window[b]), np.asarray(x[b, path])])
      windows.append(seen[-kernel:-1])
      last.append(np.asarray(x[b, i]))
  pads = np.asarray(pads).reshape(2, t, t)
  rows = np.arange(2)[:, None, None]
  pick = lambda y, fill: jnp.where(
    (pads >= 0).reshape(2, t, t, *([1] * (y.ndim - 2))), y[rows, np.maximum(pads, 0)], fill
  ).reshape(2 * t, t, *y.shape[2:])
  ref_out, ref_s = reference.recurrent_reference(
    pick(q, 0.0), pick(k, 0.0), pick(v, 0.0), pick(g, 0.0), pick(beta, 0.0), jnp.repeat(s0, t, 0)
  )
  ref_conv, _ = gdn.causal_conv(jnp.asarray(last)[:, None], jnp.asarray(windows), w)
  np.testing.assert_allclose(conv_out.reshape(2 * t, ch), ref_conv[:, 0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out.reshape(2 * t, *out.shape[2:]), ref_out[:, -1], atol=1e-5)
  np.testing.assert_allclose(states.reshape(ref_s.shape), ref_s, atol=1e-5, rtol=1e-5)

  # Commit the path to the deepest node of row 0's tree and to node 5 of row 1's.
  ends = [int(np.argmax(np.asarray(depth[0]))), 5]
  paths = [_root_path(parents[b], ends[b]) for b in range(2)]
  width = max(len(p) for p in paths)
  path = jnp.asarray([p + [0] * (width - len(p)) for p in paths], jnp.int32)
  h, dk, dv = s0.shape[1:]
  entry = LinearState(jnp.zeros((1, 2, kernel - 1, ch)), jnp.zeros((1, 2, h, dk, dv)))
  start = jnp.asarray([9, 4], jnp.int32)
  entry = entry.with_pending(start, t).write_snapshots(jnp.int32(0), z, s0, states)
  lengths = start + jnp.asarray([len(p) for p in paths])
  kept = entry.commit_path(start, path).committed(lengths)
  for b in range(2):
    full = np.concatenate([np.asarray(window[b]), np.asarray(x[b, paths[b]])])
    np.testing.assert_array_equal(kept.conv[0, b], full[-(kernel - 1) :])
    np.testing.assert_array_equal(kept.ssm[0, b], states[b, ends[b]])


@pytest.mark.parametrize("c", [1, 3, 16, 37, 64])
def test_unit_lower_inverse_equals_numpy_inverse(c):
  """Random and fully correlated systems (all-ones lower part: β = 1, no decay, equal keys,
  where the powers of the nilpotent part grow like binomials and a Neumann product cancels
  catastrophically); C not a power of two is padded."""
  rng = np.random.default_rng(c)
  rand = np.tril(rng.normal(size=(2, c, c)), -1) * 0.5 + np.eye(c)
  ones = (np.tril(np.ones((c, c)), -1) + np.eye(c))[None]
  for a in (rand, ones):
    got = np.asarray(reference.unit_lower_inverse(jnp.asarray(a, jnp.float32)))
    np.testing.assert_allclose(got, np.linalg.inv(a), atol=1e-4, rtol=1e-5)


def test_chunked_gradients_equal_the_reference_gradients():
  """Training differentiates the chunked form: its gradients match the token-by-token rule's."""
  q, k, v, g, beta, s0 = _inputs(4, t=9)
  loss = lambda fn: lambda *xs: jnp.sum(jnp.sin(fn(*xs)[0])) + jnp.sum(fn(*xs)[1] ** 2)
  chunked = lambda *xs: gdn.chunked(*xs, chunk_size=4)
  args = (q, k, v, g, beta, s0)
  want = jax.grad(loss(reference.recurrent_reference), argnums=range(6))(*args)
  got = jax.jit(jax.grad(loss(chunked), argnums=range(6)))(*args)
  for w, x in zip(want, got):
    np.testing.assert_allclose(np.asarray(x), np.asarray(w), atol=1e-4, rtol=1e-4)
