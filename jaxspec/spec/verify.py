"""Lossless chain verification (greedy and sampled), float32, static shapes.

Conventions (Leviathan et al.): ``p`` is the *warped* target distribution, ``q``
the drafter's distribution (already warped with the same `SamplingParams`). A
chain of γ draft tokens is checked against ``γ + 1`` target distributions from
one target pass; between 1 and γ + 1 tokens are committed per pass:
``num_accepted`` drafts followed by ``next_token`` (the correction sampled at the
first rejection, or the bonus sampled from ``p[γ]`` when every draft is accepted).

See docs/verification.md for why the rule is lossless and how it is tested.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxspec.spec import sampling
from jaxspec.spec.sampling import SamplingParams

# Deliberately broken acceptance rules, used only by the statistical tests to show
# that they detect real bugs. Each is a mistake an implementation could plausibly make:
#   "unnormalized_cdf":    the correction is drawn by inverse CDF over the residual
#                          max(0, p - q) without dividing by its sum; when the uniform
#                          draw exceeds the residual's mass no index satisfies
#                          ``cdf > u`` and ``argmax`` of an all-False row returns 0,
#                          so the missing mass lands on token 0.
#   "unnormalized_mixture": instead of renormalising the residual, its missing mass
#                          1 - sum(residual) is topped up with p (a mis-remembered
#                          "fall back to p" rule): dist = res + (1 - sum(res)) * p.
#   "correction_from_p":   the token after a rejection is drawn from p, not from the
#                          residual (over-represents tokens the draft already favours).
#   "accept_always":       every token the drafter proposed (q(x) > 0) is accepted,
#                          with no ratio test at all; the output follows q.
#   "accept_p":            x is accepted with probability p(x) instead of
#                          min(1, p(x) / q(x)) (the ratio's denominator is forgotten).
#   "bonus_off_by_one":    when all γ drafts are accepted the bonus is drawn from
#                          p[γ-1] instead of p[γ] (an indexing slip that only affects
#                          later tokens, so only a multi-token test can catch it).
VARIANTS = (
  "exact",
  "unnormalized_cdf",
  "unnormalized_mixture",
  "correction_from_p",
  "accept_always",
  "accept_p",
  "bonus_off_by_one",
)


def leading_true_count(mask: jax.Array) -> jax.Array:
  """[B] int32: length of the all-True prefix of each row of a [B, γ] bool mask."""
  padded = jnp.concatenate([mask.astype(bool), jnp.zeros(mask.shape[:1] + (1,), bool)], axis=1)
  return jnp.argmin(padded, axis=1).astype(jnp.int32)  # index of the first False


def verify_chain_greedy(
  draft_tokens: jax.Array, target_logits: jax.Array
) -> Tuple[jax.Array, jax.Array]:
  """Greedy chain verification.

  Args:
    draft_tokens: [B, γ] int drafted tokens.
    target_logits: [B, γ+1, V] target logits at the positions that predict each
      draft token and the bonus position.

  Returns:
    num_accepted: [B] int32, the length of the longest prefix of the drafts equal
      to the target's argmax.
    next_token: [B] int32, the target's argmax at the first mismatch (the bonus
      argmax at position γ when all drafts match).
  """
  gamma = draft_tokens.shape[1]
  target_top = sampling.argmax(target_logits.astype(jnp.float32))
  num_accepted = leading_true_count(draft_tokens.astype(jnp.int32) == target_top[:, :gamma])
  next_token = jnp.take_along_axis(target_top, num_accepted[:, None], axis=1)[:, 0]
  return num_accepted, next_token


def residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
  """Unnormalised residual max(0, p - q) along the last axis (float32)."""
  return jnp.maximum(p.astype(jnp.float32) - q.astype(jnp.float32), 0.0)


def _accept_mask(u: jax.Array, px: jax.Array, qx: jax.Array, variant: str) -> jax.Array:
  """[B, γ] bool: whether each draft passes its own acceptance test."""
  if variant == "accept_always":
    return qx > 0  # "the drafter proposed it"
  if variant == "accept_p":
    return u < px
  # Exact: accept with probability min(1, p/q), i.e. u < p/q, written without a
  # division so that q(x) = 0 (ratio = inf) accepts whenever p(x) > 0.
  return u * qx < px


def _correction(key: jax.Array, p_n: jax.Array, q_n: jax.Array, variant: str) -> jax.Array:
  """[B] int32: the token emitted after the accepted prefix (correction or bonus).

  ``q_n`` is zero at the bonus position, so the residual there is ``p`` itself.
  """
  if variant == "correction_from_p":
    return sampling.sample_from_probs(key, p_n)
  res = residual_probs(p_n, q_n)
  mass = jnp.sum(res, axis=-1, keepdims=True)
  if variant == "unnormalized_cdf":
    u = jax.random.uniform(key, mass.shape, dtype=jnp.float32)
    return sampling.argmax(jnp.cumsum(res, axis=-1) > u)
  if variant == "unnormalized_mixture":
    return sampling.sample_from_probs(key, res + (1.0 - mass) * p_n)
  # Exact: normalise(residual); if it has no mass (p == q there) fall back to p.
  return sampling.sample_from_probs(key, jnp.where(mass > 0, res, p_n))


def _verify_chain(
  key: jax.Array,
  draft_tokens: jax.Array,
  draft_probs: Optional[jax.Array],
  target_logits: jax.Array,
  params: SamplingParams,
  _variant: str = "exact",
) -> Tuple[jax.Array, jax.Array]:
  """`verify_chain` with a selectable (possibly deliberately broken) rule; tests only."""
  if _variant not in VARIANTS:
    raise ValueError(f"unknown verification variant {_variant!r}; expected one of {VARIANTS}")
  batch, gamma = draft_tokens.shape
  vocab = target_logits.shape[-1]
  if target_logits.shape[:2] != (batch, gamma + 1):
    raise ValueError(
      f"target_logits must be [B, γ+1, V] = [{batch}, {gamma + 1}, V], got {target_logits.shape}"
    )
  draft_tokens = draft_tokens.astype(jnp.int32)
  if draft_probs is None:
    q = jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.float32)
  else:
    if draft_probs.shape != (batch, gamma, vocab):
      raise ValueError(
        f"draft_probs must be [B, γ, V] = [{batch}, {gamma}, {vocab}], got {draft_probs.shape}"
      )
    q = draft_probs.astype(jnp.float32)

  p = sampling.warped_probs(target_logits, params)  # [B, γ+1, V]
  key_accept, key_correct = jax.random.split(key)
  px = jnp.take_along_axis(p[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  qx = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(key_accept, (batch, gamma), dtype=jnp.float32)
  num_accepted = leading_true_count(_accept_mask(u, px, qx, _variant))

  rows = jnp.arange(batch)
  p_index = jnp.minimum(num_accepted, gamma - 1) if _variant == "bonus_off_by_one" else num_accepted
  p_n = p[rows, p_index]
  q_pad = jnp.concatenate([q, jnp.zeros((batch, 1, vocab), jnp.float32)], axis=1)
  q_n = q_pad[rows, num_accepted]
  next_token = _correction(key_correct, p_n, q_n, _variant)

  # Temperature-0 rows: the rule above already reduces to greedy (p is one-hot), but
  # select the greedy result explicitly so that it holds bit-for-bit whatever q is.
  greedy = sampling.is_greedy(params)
  g_accepted, g_next = verify_chain_greedy(draft_tokens, target_logits)
  num_accepted = jnp.where(greedy, g_accepted, num_accepted)
  next_token = jnp.where(greedy, g_next, next_token)
  return num_accepted, next_token


def verify_chain(
  key: jax.Array,
  draft_tokens: jax.Array,
  draft_probs: Optional[jax.Array],
  target_logits: jax.Array,
  params: SamplingParams,
) -> Tuple[jax.Array, jax.Array]:
  """Lossless speculative-sampling verification of a draft chain.

  Draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
  rejection the next token is drawn from normalise(max(0, p_i - q_i)) (from p_i if
  that residual is all zero); if every draft is accepted the bonus is drawn from
  p_γ. Committed tokens are then distributed exactly as sampling from the warped
  target one token at a time. Rows with temperature 0 give exactly
  `verify_chain_greedy`.

  Args:
    key: PRNG key for this step.
    draft_tokens: [B, γ] int drafted tokens.
    draft_probs: [B, γ, V] the drafter's (warped) probabilities q_i, or None for a
      deterministic drafter (q one-hot at the draft, e.g. n-gram lookup; then
      x_i is accepted with probability p_i(x_i)).
    target_logits: [B, γ+1, V] raw target logits; warped here with ``params``.
    params: per-sequence sampling parameters ([B] arrays).

  Returns:
    num_accepted: [B] int32 in [0, γ].
    next_token: [B] int32, the correction or bonus token.
  """
  # An all-greedy batch skips the vocabulary-wide sampling arithmetic (the result is the same:
  # greedy rows take the greedy answer either way).
  return jax.lax.cond(
    jnp.all(sampling.is_greedy(params)),
    lambda: verify_chain_greedy(draft_tokens, target_logits),
    lambda: _verify_chain(key, draft_tokens, draft_probs, target_logits, params),
  )
