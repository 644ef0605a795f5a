"""Tree verification: walk a verified draft tree and decide what to commit (lossless).

One target forward over the flattened tree (root + N nodes, ancestor mask) gives the target's
logits at every node: `logits[:, i]` is the target's next-token distribution after the path
root→i. A walk starts at the root and moves down while the target agrees; every committed token
is decided by the target alone, so the output distribution is exactly the warped target's.

Rules (all return the same triple, see `verify_tree`):

  "ddtree" (default; DDTree `follow_verified_tree`). Sample the target's token at every node
    from its warped distribution (argmax for greedy rows). From the root: if a child of the
    current node carries the current node's sample, move there; else stop, and the current
    node's sample is the next root. Each committed token is a fresh target sample given the
    committed prefix, hence lossless at any temperature; greedy is the same walk with argmax.

  "eagle2" (EAGLE-2 `evaluate_posterior`, deterministic top-k children, q = δ). At the current
    node with target distribution p and children x_1..x_m in rank order: accept x_j with
    probability p̃(x_j), where p̃ is p with the already-rejected siblings zeroed and
    renormalised; on rejection zero x_j and go on. If every child is rejected, sample the next
    root from the final p̃ (p without the children). P(x_j) = Π_{i<j}(1 − p̃_i)·p̃_j = p(x_j), so
    it is exact too. Greedy rows use the argmax walk.

Siblings must carry distinct tokens (top-k ranks of one position do). The walk is a
`lax.fori_loop` over the static maximum depth D; nothing leaves the device.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple, Union

import jax
import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.sampling import SamplingParams
from jaxspec.speculative.tree import Tree

RULES = ("ddtree", "eagle2")


def _children(tree: Tree, cur: jax.Array) -> jax.Array:
  """[B, N+1] bool: valid nodes whose parent is cur [B]."""
  return tree.valid & (tree.parents == cur[:, None])


def walk_samples(tree: Tree, post: jax.Array, max_depth: int) -> Tuple[jax.Array, jax.Array]:
  """Follows per-node target samples `post [B, N+1]` down the tree.

  Returns (path [B, D+1] slot indices, root first, 0-padded; num_accepted [B]).
  """
  batch = post.shape[0]
  rows = jnp.arange(batch)

  def body(d, carry):
    cur, stopped, path = carry
    match = _children(tree, cur) & (tree.tokens == post[rows, cur][:, None])
    found = jnp.any(match, axis=1) & ~stopped
    nxt = jnp.argmax(match, axis=1).astype(jnp.int32)  # first match (siblings are distinct)
    cur = jnp.where(found, nxt, cur)
    path = path.at[:, d + 1].set(jnp.where(found, nxt, 0))
    return cur, stopped | ~found, path

  init = (
    jnp.zeros((batch,), jnp.int32),
    jnp.zeros((batch,), bool),
    jnp.zeros((batch, max_depth + 1), jnp.int32),
  )
  cur, _, path = jax.lax.fori_loop(0, max_depth, body, init)
  return path, jnp.take_along_axis(tree.depths, cur[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class DDTreeRule:
  """DDTree's rule: sample the target at every node, follow the matching child."""

  def walk(self, tree: Tree, post: jax.Array, max_depth: int) -> Tuple[jax.Array, jax.Array]:
    """(path [B, D+1], num_accepted [B]) from per-node target samples post [B, N+1]."""
    return walk_samples(tree, post, max_depth)

  def verify(self, key, tree, logits, params, max_depth):
    post = sampling.sample(key, logits, params)  # [B, N+1]; argmax on greedy rows
    path, n = self.walk(tree, post, max_depth)
    last = jnp.take_along_axis(path, n[:, None], axis=1)[:, 0]
    return path, n, jnp.take_along_axis(post, last[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class Eagle2Rule:
  """EAGLE-2's rule for deterministic top-k children (q = δ); its two decisions are methods
  so that the statistical tests can show that each plausible mistake is caught."""

  def accept(self, u: jax.Array, px: jax.Array, before: jax.Array) -> jax.Array:
    """Accept child x_j with probability p(x_j) / (1 − Σ_{i<j} p(x_i))."""
    return u * (1.0 - before) < px

  def fallback(self, p: jax.Array, kid_tokens: jax.Array, kid: jax.Array) -> jax.Array:
    """The distribution of the next root when every child was rejected: p with the children
    zeroed (renormalised by the sampler; p itself if nothing is left)."""
    batch, vocab = p.shape
    keep = (
      jnp.ones((batch, vocab), jnp.float32)
      .at[jnp.arange(batch)[:, None], kid_tokens]
      .min(jnp.where(kid, 0.0, 1.0))
    )
    res = p * keep
    return jnp.where(jnp.sum(res, axis=1, keepdims=True) > 0, res, p)

  def verify(self, key, tree, logits, params, max_depth):
    batch, n_slots, _ = logits.shape
    rows = jnp.arange(batch)
    probs = sampling.warped_probs(logits, params)  # [B, N+1, V]
    key_u, key_res = sampling.split_key(key)

    def body(d, carry):
      cur, stopped, path, next_tok = carry
      kid = _children(tree, cur)  # [B, N+1], in slot order = rank order
      p = probs[rows, cur]  # [B, V]
      px = jnp.where(kid, jnp.take_along_axis(p, tree.tokens, axis=1), 0.0)  # [B, N+1]
      before = jnp.cumsum(px, axis=1) - px  # mass of the earlier (rejected) siblings
      u = sampling.uniform(sampling.fold_in(key_u, d), (batch, n_slots))
      acc = kid & self.accept(u, px, before)
      found = jnp.any(acc, axis=1) & ~stopped
      nxt = jnp.argmax(acc, axis=1).astype(jnp.int32)
      drawn = sampling.sample_from_probs(
        sampling.fold_in(key_res, d), self.fallback(p, tree.tokens, kid)
      )
      stop_now = ~stopped & ~found
      next_tok = jnp.where(stop_now, drawn, next_tok)
      cur = jnp.where(found, nxt, cur)
      path = path.at[:, d + 1].set(jnp.where(found, nxt, 0))
      return cur, stopped | ~found, path, next_tok

    init = (
      jnp.zeros((batch,), jnp.int32),
      jnp.zeros((batch,), bool),
      jnp.zeros((batch, max_depth + 1), jnp.int32),
      jnp.zeros((batch,), jnp.int32),
    )
    cur, stopped, path, next_tok = jax.lax.fori_loop(0, max_depth, body, init)
    # Reached depth D without stopping: the bonus is a sample from p at the deepest node.
    bonus = sampling.sample_from_probs(sampling.fold_in(key_res, max_depth), probs[rows, cur])
    next_tok = jnp.where(stopped, next_tok, bonus)
    n = jnp.take_along_axis(tree.depths, cur[:, None], axis=1)[:, 0]

    greedy = sampling.is_greedy(params)
    g_path, g_n, g_next = DDTreeRule().verify(key, tree, logits, params, max_depth)
    return (
      jnp.where(greedy[:, None], g_path, path),
      jnp.where(greedy, g_n, n),
      jnp.where(greedy, g_next, next_tok),
    )


RULE_OBJECTS = {"ddtree": DDTreeRule(), "eagle2": Eagle2Rule()}


def verify_tree(
  key: jax.Array,
  tree: Tree,
  target_logits: jax.Array,
  params: SamplingParams,
  max_depth: int,
  rule: Union[str, DDTreeRule, Eagle2Rule] = "ddtree",
) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Lossless verification of a draft tree from one target pass.

  Args:
    key: PRNG key for this step.
    tree: the verified `Tree` (N+1 slots, root at slot 0).
    target_logits: [B, N+1, V] raw target logits at every slot (warped here with `params`).
    params: per-sequence sampling parameters; temperature-0 rows walk the argmax.
    max_depth: D, the tree's static maximum depth (the drafter's γ).
    rule: "ddtree" or "eagle2" (see the module docstring; both exact), or a rule object
      (`DDTreeRule`, `Eagle2Rule` or a subclass: the tests' deliberately broken variants).

  Returns:
    path: [B, D+1] int32 slot indices of the accepted path, root first; entries past
      num_accepted are 0 (scratch for `DecodingState.commit_path`).
    num_accepted: [B] int32 draft nodes accepted (the path's depth), 0..D.
    next_token: [B] int32 the target's token after the path (the next root).
  """
  if isinstance(rule, str):
    if rule not in RULES:
      raise ValueError(f"unknown tree verification rule {rule!r}; expected one of {RULES}")
    rule = RULE_OBJECTS[rule]
  if target_logits.shape[:2] != tree.tokens.shape:
    raise ValueError(
      f"target_logits must be [B, N+1, V] = {tree.tokens.shape + ('V',)}, got {target_logits.shape}"
    )
  return rule.verify(key, tree, target_logits.astype(jnp.float32), params, max_depth)


def path_tokens(tree: Tree, path: jax.Array) -> jax.Array:
  """[B, D] the tokens of the path's nodes at depths 1..D (scratch past num_accepted)."""
  return jnp.take_along_axis(tree.tokens, path[:, 1:], axis=1)
