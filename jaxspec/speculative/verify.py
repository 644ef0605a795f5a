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

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.sampling import SamplingParams, leading_true_count


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


@dataclasses.dataclass(frozen=True)
class ChainRule:
  """The three decisions of sampled chain verification, as overridable methods.

  This class is the exact rule. The statistical tests subclass it with plausible mistakes
  (tests/broken_rules.py) to show that their goodness-of-fit checks catch each one.
  """

  def accept(self, u: jax.Array, px: jax.Array, qx: jax.Array) -> jax.Array:
    """[B, γ] bool: draft x passes with probability min(1, p(x) / q(x)), written without a
    division so that q(x) = 0 (ratio = inf) accepts whenever p(x) > 0."""
    return u * qx < px

  def target_row(self, num_accepted: jax.Array, gamma: int) -> jax.Array:
    """[B] index of the target distribution the next token is drawn from (γ = the bonus)."""
    del gamma
    return num_accepted

  def correction(self, key: jax.Array, p_n: jax.Array, q_n: jax.Array) -> jax.Array:
    """[B] the token after the accepted prefix: from normalise(max(0, p − q)), or from p when
    that residual has no mass (p == q there). q_n is zero at the bonus position."""
    res = residual_probs(p_n, q_n)
    mass = jnp.sum(res, axis=-1, keepdims=True)
    return sampling.sample_from_probs(key, jnp.where(mass > 0, res, p_n))


EXACT = ChainRule()


def verify_chain_sampled(
  key: jax.Array,
  draft_tokens: jax.Array,
  draft_probs: Optional[jax.Array],
  target_logits: jax.Array,
  params: SamplingParams,
  rule: ChainRule = EXACT,
) -> Tuple[jax.Array, jax.Array]:
  """Speculative-sampling verification under `rule` (see `verify_chain`)."""
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
  key_accept, key_correct = sampling.split_key(key)
  px = jnp.take_along_axis(p[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  qx = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
  u = sampling.uniform(key_accept, (batch, gamma))
  num_accepted = leading_true_count(rule.accept(u, px, qx))

  rows = jnp.arange(batch)
  p_n = p[rows, rule.target_row(num_accepted, gamma)]
  q_pad = jnp.concatenate([q, jnp.zeros((batch, 1, vocab), jnp.float32)], axis=1)
  q_n = q_pad[rows, num_accepted]
  next_token = rule.correction(key_correct, p_n, q_n)

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
    lambda: verify_chain_sampled(key, draft_tokens, draft_probs, target_logits, params),
  )
