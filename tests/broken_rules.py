"""Deliberately broken verification rules: each is a mistake an implementation could plausibly
make. The statistical tests run them through the same goodness-of-fit checks as the exact rules
and require them to fail, which shows that the checks have power.

Chain rules subclass `verify.ChainRule` and tree rules `tree_verify.DDTreeRule`,
`tree_verify.Eagle2Rule` or `tree_verify.RecursiveRule` (the exact rules), each overriding one
decision.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec import sampling

from jaxspec.speculative import tree_verify, verify


@dataclasses.dataclass(frozen=True)
class UnnormalizedCdf(verify.ChainRule):
  """The correction is drawn by inverse CDF over max(0, p − q) without dividing by its sum:
  when the uniform draw exceeds the residual's mass, argmax of an all-False row is 0, so the
  missing mass lands on token 0."""

  def correction(self, key, p_n, q_n):
    res = verify.residual_probs(p_n, q_n)
    u = jax.random.uniform(key, res.shape[:-1] + (1,), dtype=jnp.float32)
    return sampling.argmax(jnp.cumsum(res, axis=-1) > u)


@dataclasses.dataclass(frozen=True)
class UnnormalizedMixture(verify.ChainRule):
  """The residual's missing mass is topped up with p instead of renormalising."""

  def correction(self, key, p_n, q_n):
    res = verify.residual_probs(p_n, q_n)
    mass = jnp.sum(res, axis=-1, keepdims=True)
    return sampling.sample_from_probs(key, res + (1.0 - mass) * p_n)


@dataclasses.dataclass(frozen=True)
class CorrectionFromP(verify.ChainRule):
  """The token after a rejection is drawn from p, not from the residual."""

  def correction(self, key, p_n, q_n):
    del q_n
    return sampling.sample_from_probs(key, p_n)


@dataclasses.dataclass(frozen=True)
class AcceptAlways(verify.ChainRule):
  """Every proposed token (q(x) > 0) is accepted, with no ratio test: the output follows q."""

  def accept(self, u, px, qx):
    del u, px
    return qx > 0


@dataclasses.dataclass(frozen=True)
class AcceptP(verify.ChainRule):
  """x is accepted with probability p(x) instead of min(1, p(x)/q(x))."""

  def accept(self, u, px, qx):
    del qx
    return u < px


@dataclasses.dataclass(frozen=True)
class BonusOffByOne(verify.ChainRule):
  """When all γ drafts are accepted the bonus is drawn from p[γ−1] instead of p[γ]: invisible
  in the first token, caught only by a multi-token test."""

  def target_row(self, num_accepted, gamma):
    return jnp.minimum(num_accepted, gamma - 1)


CHAIN = {
  "unnormalized_cdf": UnnormalizedCdf(),
  "unnormalized_mixture": UnnormalizedMixture(),
  "correction_from_p": CorrectionFromP(),
  "accept_always": AcceptAlways(),
  "accept_p": AcceptP(),
  "bonus_off_by_one": BonusOffByOne(),
}


# --------------------------------------------------------------------------------------------------
# Tree rules (subclasses of tree_verify.DDTreeRule / Eagle2Rule)
# --------------------------------------------------------------------------------------------------


def _path_to(tree, node, max_depth):
  """[B, D+1] slot indices of the root→node path by depth (0 past the node's depth)."""
  anc = jnp.take_along_axis(tree.mask, node[:, None, None], axis=1)[:, 0]  # [B, N+1]
  d = jnp.arange(max_depth + 1)[None, :, None]
  on = anc[:, None, :] & (tree.depths[:, None, :] == d)  # [B, D+1, N+1]
  return jnp.argmax(on, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NoParentCheck(tree_verify.DDTreeRule):
  """Each node is checked against its parent's target sample and the deepest match is
  accepted, without checking that its ancestors were accepted: unaccepted ancestors' draft
  tokens get committed."""

  def walk(self, tree, post, max_depth):
    parent_post = jnp.take_along_axis(post, jnp.maximum(tree.parents, 0), axis=1)
    ok = tree.valid & (tree.tokens == parent_post) & (tree.parents >= 0)
    ok = ok.at[:, 0].set(True)
    best = jnp.argmax(jnp.where(ok, tree.depths, -1), axis=1).astype(jnp.int32)
    depth = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0]
    return _path_to(tree, best, max_depth), depth


@dataclasses.dataclass(frozen=True)
class Eagle2NoRenorm(tree_verify.Eagle2Rule):
  """Accepts child x_j with probability p(x_j) instead of the renormalised p̃(x_j) after the
  earlier siblings were rejected."""

  def accept(self, u, px, before):
    del before
    return u < px


@dataclasses.dataclass(frozen=True)
class Eagle2ResidualP(tree_verify.Eagle2Rule):
  """When every child is rejected, samples the next root from p itself instead of p with the
  rejected children zeroed."""

  def fallback(self, p, kid_tokens, kid):
    del kid_tokens, kid
    return p


@dataclasses.dataclass(frozen=True)
class RecursiveNoResidual(tree_verify.RecursiveRule):
  """After a rejected child the next sibling is tested against p itself, not the residual
  max(0, p − q): the rejected mass is counted twice."""

  def residual(self, p, q, mp, mq):
    del q, mq
    return p / mp


@dataclasses.dataclass(frozen=True)
class RecursiveWithReplacement(tree_verify.RecursiveRule):
  """The next sibling is tested against q itself, as if the children were drawn with
  replacement (SpecInfer's i.i.d. rule), although they are distinct draws without replacement:
  a later child's q is understated, so it is accepted too often."""

  def exclude(self, q, x):
    del x
    return q


TREE = {
  "no_parent_check": NoParentCheck(),
  "eagle2_no_renorm": Eagle2NoRenorm(),
  "eagle2_residual_p": Eagle2ResidualP(),
  "recursive_no_residual": RecursiveNoResidual(),
  "recursive_with_replacement": RecursiveWithReplacement(),
}


def commit_last_tree_node(self, start, path):
  """A broken `LinearState.commit_path`: keeps the state (and conv window) after the last node
  of the tree block, whatever path was accepted: as if the tree were a chain committed whole.
  For monkeypatching onto `state.LinearState`."""
  del start
  k, width = self.conv.shape[2], path.shape[1]
  last = self.pending_ssm.shape[2] - 2  # the block's last node
  rows = jnp.arange(path.shape[0])[:, None]
  wrong = jnp.full_like(path, last)
  conv = self.pending_conv.at[:, rows, k + jnp.arange(width)].set(
    self.pending_conv[:, rows, k + wrong]
  )
  ssm = self.pending_ssm.at[:, rows, 1 + jnp.arange(width)].set(
    self.pending_ssm[:, rows, 1 + wrong]
  )
  return self.replace(pending_conv=conv, pending_ssm=ssm)
