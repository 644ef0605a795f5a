"""Pure-jnp oracles of the gated delta rule: the recurrence token by token and its chunked form.

Per value head the rule keeps a state S [Dk, Dv] and, for each token (q_t, k_t, v_t, log-decay
g_t <= 0, write strength beta_t in (0, 1)),

    S <- exp(g_t) * S;   S <- S + k_t (x) beta_t (v_t - S^T k_t);   o_t = S^T q_t.

* `recurrent_reference`: the recurrence, one token at a time (`lax.scan`), written as literally
  as possible: the independent oracle.
* `gated_delta_reference` (= `chunked`): the chunk-wise UT-transform form the kernel
  (kernel_gpu.py) computes, with one unit-lower-triangular inverse per chunk
  (`unit_lower_inverse`, all matmuls). It is also the model's XLA path:
  `jaxspec.models.gated_deltanet` calls it, this module imports nothing from jaxspec.

Shapes: q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv] or None
(zeros); float32 throughout. Returns (out [B, T, H, Dv], final state [B, H, Dk, Dv]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST


def zeros_state(q: jax.Array, v: jax.Array) -> jax.Array:
  b, _, h, dk = q.shape
  return jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)


def as_float32(*xs: jax.Array) -> list[jax.Array]:
  return [x.astype(jnp.float32) for x in xs]


def recurrent_reference(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The gated delta rule token by token: (out [B, T, H, Dv] float32, final state)."""
  q, k, v, g, beta = as_float32(q, k, v, g, beta)
  s0 = zeros_state(q, v) if state is None else state.astype(jnp.float32)

  def step(s, x):
    q_t, k_t, v_t, g_t, b_t = x  # [B, H, D], ..., [B, H]
    s = s * jnp.exp(g_t)[..., None, None]
    predicted = jnp.sum(s * k_t[..., :, None], axis=-2)  # Sᵀ k  [B, H, Dv]
    delta = (v_t - predicted) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.sum(s * q_t[..., :, None], axis=-2)

  xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
  s, out = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(out, 0, 1), s


def chunked(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array | None = None,
  chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
  """The chunked (UT-transform) form: (out [B, T, H, Dv] float32, final state [B, H, Dk, Dv]).

  T is padded to a multiple of `chunk_size` with tokens of g = 0, β = 0, k = 0 (they leave the
  state unchanged). Inside chunk c, with Γ_i the cumulative log-decay up to position i and
  L[i, j] = exp(Γ_i − Γ_j) for j ≤ i: the C delta-rule corrections u satisfy
  (I + strictly_lower(diag(β) K Kᵀ ⊙ L)) u = β ⊙ (V − exp(Γ) ⊙ K S), one unit-lower-triangular
  inverse per chunk; then O = (Q ⊙ exp(Γ)) S + (Q Kᵀ ⊙ L) u and
  S' = exp(Γ_C) S + (K ⊙ exp(Γ_C − Γ))ᵀ u.
  """
  q, k, v, g, beta = as_float32(q, k, v, g, beta)
  b, t, h, _ = q.shape
  dv = v.shape[-1]
  s0 = zeros_state(q, v) if state is None else state.astype(jnp.float32)
  c = max(1, min(chunk_size, t))
  pad = (-t) % c
  if pad:
    padding = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(padding, (q, k, v, g, beta))
  n = (t + pad) // c
  # [B, H, N, C, D] / [B, H, N, C]
  split = lambda x: jnp.moveaxis(x.reshape(b, n, c, h, *x.shape[3:]), 3, 1)
  q, k, v, g, beta = map(split, (q, k, v, g, beta))
  cum = jnp.cumsum(g, axis=-1)  # Γ
  causal = jnp.tril(jnp.ones((c, c), bool))
  diff = jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf)
  decay = jnp.exp(diff)  # L [B, H, N, C, C], 0 above the diagonal
  k_beta = k * beta[..., None]
  mm = lambda x, y: jnp.einsum("...ik,...jk->...ij", x, y, precision=HIGHEST)
  system = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), mm(k_beta, k) * decay, 0.0)
  system = system + jnp.eye(c, dtype=jnp.float32)
  inverse = unit_lower_inverse(system)  # [B, H, N, C, C]
  solve = lambda rhs: jnp.einsum("...ij,...jd->...id", inverse, rhs, precision=HIGHEST)
  new_values = solve(v * beta[..., None])  # [B, H, N, C, Dv]
  k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])  # [B, H, N, C, Dk]
  intra = mm(q, k) * decay  # [B, H, N, C, C]
  q_decayed = q * jnp.exp(cum)[..., None]
  k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

  def body(s, x):
    nv, kc, intra_c, qd, kd, cd = x
    v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kc, s, precision=HIGHEST)
    out = jnp.einsum("bhck,bhkv->bhcv", qd, s, precision=HIGHEST) + jnp.einsum(
      "bhij,bhjv->bhiv", intra_c, v_new, precision=HIGHEST
    )
    s = s * cd[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new, precision=HIGHEST)
    return s, out

  xs = [jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, intra, q_decayed, k_decayed)]
  xs.append(jnp.moveaxis(chunk_decay, 2, 0))
  s, out = jax.lax.scan(body, s0, xs)  # out [N, B, H, C, Dv]
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
  return jnp.moveaxis(out, 1, 2), s


def unit_lower_inverse(a: jax.Array) -> jax.Array:
  """(A)⁻¹ of unit-lower-triangular matrices [..., C, C], by recursive block inversion.

  Bottom-up over block sizes s = 1, 2, 4, …: the inverse of a 2s-block [[A11, 0], [A21, A22]]
  is [[X1, 0], [−X2 A21 X1, X2]] with X1, X2 the inverses of its diagonal halves, so log2(C)
  rounds of batched matmuls replace a sequential substitution. Exact algebra (no power series:
  a Neumann product would cancel catastrophically for correlated keys), and all matmuls, which
  is what accelerators want. It also replaces `lax.linalg.triangular_solve`, whose CPU
  custom call intermittently never completed under `jax.grad` in training (jaxlib 0.10.2).
  C that is not a power of two is padded with identity rows.
  """
  c = a.shape[-1]
  size = 1 << max(0, (c - 1).bit_length())
  if size != c:
    pad = [(0, 0)] * (a.ndim - 2) + [(0, size - c), (0, size - c)]
    a = jnp.pad(a, pad) + jnp.diag((jnp.arange(size) >= c).astype(a.dtype))
  batch = a.shape[:-2]
  inv = jnp.ones(batch + (size, 1, 1), a.dtype)  # the inverses of the 1 × 1 diagonal blocks
  mm = lambda x, y: jnp.matmul(x, y, precision=HIGHEST)
  s = 1
  while s < size:
    m = size // (2 * s)
    base = (np.arange(m) * 2 * s)[:, None, None]
    rows = base + s + np.arange(s)[None, :, None]
    cols = base + np.arange(s)[None, None, :]
    lower_left = a[..., rows, cols]  # A21 of each 2s block [..., m, s, s]
    pairs = inv.reshape(batch + (m, 2, s, s))
    x1, x2 = pairs[..., 0, :, :], pairs[..., 1, :, :]
    new = -mm(mm(x2, lower_left), x1)
    top = jnp.concatenate([x1, jnp.zeros_like(x1)], axis=-1)
    bottom = jnp.concatenate([new, x2], axis=-1)
    inv = jnp.concatenate([top, bottom], axis=-2)  # [..., m, 2s, 2s]
    s *= 2
  return inv.reshape(batch + (size, size))[..., :c, :c]


gated_delta_reference = chunked

__all__ = ["chunked", "gated_delta_reference", "recurrent_reference", "unit_lower_inverse"]
