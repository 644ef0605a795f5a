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

  "recursive" (recursive rejection sampling, `RecursiveRule`; the rule for T > 0). The
    children of every node are the first draws of a sample without replacement from the
    drafter's warped q (`tree.sample_candidates`), not its top-k. At each node: accept child
    c_j with probability min(1, p_j(c_j) / q_j(c_j)); after a rejection the target becomes
    the residual normalise(max(0, p_j − q_j)) and the proposal q without c_j. A node whose
    children are all rejected draws the next root from the last residual. Exact at every
    temperature; at T > 0 a node accepts at least what a sampled chain's single draft would
    (its first child is that draft), and the siblings take what is left. Greedy rows use the
    argmax walk over a top-k tree, as "ddtree".

Siblings must carry distinct tokens (top-k ranks of one position do). The walk is a
`lax.fori_loop` over the static maximum depth D; nothing leaves the device.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.sampling import SamplingParams
from jaxspec.speculative.tree import Tree

RULES = ("ddtree", "eagle2", "recursive")
SAMPLED_CANDIDATE_RULES = ("recursive",)  # rules whose trees draw their children from q


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

  def verify(self, key, tree, logits, params, max_depth, draft_probs=None):
    del draft_probs  # the target's samples alone decide
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

  def verify(self, key, tree, logits, params, max_depth, draft_probs=None):
    del draft_probs  # q = δ at the deterministic children
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


@dataclasses.dataclass(frozen=True)
class RecursiveRule:
  """Recursive rejection sampling over children drawn without replacement (SpecInfer's
  multi-step speculative sampling, in the without-replacement form of recursive speculative
  decoding), for trees built by `TreeVerifier` from `tree.sample_candidates`.

  At a node with warped target distribution p and children c_1..c_m (the first m draws
  without replacement from the drafter's warped q at that depth): accept c_j with probability
  min(1, p_j(c_j) / q_j(c_j)); on rejection p_{j+1} = normalise(max(0, p_j − q_j)) and
  q_{j+1} = q_j without c_j, renormalised. If every child is rejected the next root is drawn
  from p_{m+1}. Each step is one speculative-sampling step (exact for any target and any
  proposal), and what follows a rejection is exact for its residual whatever was drawn, so the
  node's output is p exactly; the walk then repeats at the accepted child. The number of
  children may depend on q but not on which tokens were drawn (the builder's shape comes from
  q's sorted probabilities alone). Greedy rows walk the argmax (`DDTreeRule`).

  The three decisions are methods so the statistical tests can break each one.
  """

  def accept(self, u: jax.Array, px: jax.Array, qx: jax.Array, mp: jax.Array, mq: jax.Array):
    """Accept x with probability min(1, (p(x)/mp) / (q(x)/mq)) for unnormalised p, q."""
    return u * qx * mp < px * mq

  def residual(self, p: jax.Array, q: jax.Array, mp: jax.Array, mq: jax.Array) -> jax.Array:
    """The target after a rejection: max(0, p/mp − q/mq) (unnormalised)."""
    return jnp.maximum(p / mp - q / mq, 0.0)

  def exclude(self, q: jax.Array, x: jax.Array) -> jax.Array:
    """The proposal of the next sibling: q without the rejected x (unnormalised)."""
    return q.at[jnp.arange(q.shape[0]), x].set(0.0)

  def verify(self, key, tree, logits, params, max_depth, draft_probs=None):
    if draft_probs is None:
      raise ValueError("the recursive rule needs the drafter's warped probabilities per depth")
    greedy = sampling.is_greedy(params)
    g = lambda: DDTreeRule().verify(key, tree, logits, params, max_depth)

    def sampled():
      path, n, nxt = self._walk(key, tree, logits, params, max_depth, draft_probs)
      # Greedy rows of a mixed batch: the argmax walk, without warping every node.
      top = sampling.argmax(logits)
      g_path, g_n = walk_samples(tree, top, max_depth)
      last = jnp.take_along_axis(g_path, g_n[:, None], axis=1)
      g_next = jnp.take_along_axis(top, last, axis=1)[:, 0]
      return (
        jnp.where(greedy[:, None], g_path, path),
        jnp.where(greedy, g_n, n),
        jnp.where(greedy, g_next, nxt),
      )

    return jax.lax.cond(jnp.all(greedy), g, sampled)

  def _walk(self, key, tree, logits, params, max_depth, draft_probs):
    batch, n_slots, _ = logits.shape
    rows = jnp.arange(batch)
    # The walk warps only the nodes it visits (a sampled walk rarely goes deep).
    warped_at = lambda cur: sampling.warped_probs(logits[rows, cur], params)  # [B, V]
    q_all = draft_probs.astype(jnp.float32)  # [B, D, V]
    key_u, key_res = sampling.split_key(key)
    u_all = sampling.uniform(key_u, (batch, max_depth, n_slots - 1))

    def child_body(d, kid, order):
      def body(c):
        j, p, q, found, nxt = c
        is_j = kid & (order == j)  # children in slot order are in rank order (the builder
        has = jnp.any(is_j, axis=1) & ~found  # pops siblings by rank)
        slot = jnp.argmax(is_j, axis=1).astype(jnp.int32)
        x = tree.tokens[rows, slot]
        mp, mq = jnp.sum(p, axis=1), jnp.sum(q, axis=1)
        px, qx = p[rows, x], q[rows, x]
        ok = has & self.accept(u_all[rows, d, j], px, qx, mp, mq)
        rej = (has & ~ok)[:, None]
        p = jnp.where(rej, self.residual(p, q, mp[:, None], mq[:, None]), p)
        q = jnp.where(rej, self.exclude(q, x), q)
        return j + 1, p, q, found | ok, jnp.where(ok, slot, nxt)

      return body

    def depth_body(carry):
      d, cur, stopped, path, final = carry
      kid = _children(tree, cur) & ~stopped[:, None]
      order = jnp.cumsum(kid, axis=1) - 1  # each child's rank among its siblings
      p0 = warped_at(cur)
      q0 = q_all[rows, jnp.minimum(d, max_depth - 1)]
      n_kids = jnp.sum(kid, axis=1)
      # Siblings in rank order until every row accepted one or ran out of them.
      more = lambda c: jnp.any(~c[3] & (c[0] < n_kids))
      init = (jnp.int32(0), p0, q0, jnp.zeros((batch,), bool), cur)
      _, p, _, found, nxt = jax.lax.while_loop(more, child_body(d, kid, order), init)
      # A row that stops here draws the next root from its residual (p0 if no mass is left,
      # which only rounding can cause); one that reached depth D, from p0 after the loop.
      p = jnp.where(jnp.sum(p, axis=1, keepdims=True) > 0, p, p0)
      final = jnp.where((~stopped & ~found)[:, None], p, final)
      cur = jnp.where(found, nxt, cur)
      path = path.at[:, d + 1].set(jnp.where(found, nxt, 0))
      return d + 1, cur, stopped | ~found, path, final

    init = (
      jnp.int32(0),
      jnp.zeros((batch,), jnp.int32),
      jnp.zeros((batch,), bool),
      jnp.zeros((batch, max_depth + 1), jnp.int32),
      jnp.zeros((batch, logits.shape[-1]), jnp.float32),
    )
    # Most sampled walks stop within a few levels: loop only while some row is still walking.
    go_on = lambda c: (c[0] < max_depth) & ~jnp.all(c[2])
    _, cur, stopped, path, final = jax.lax.while_loop(go_on, depth_body, init)
    final = jnp.where(stopped[:, None], final, warped_at(cur))
    next_tok = sampling.sample_from_probs(key_res, final)
    return path, jnp.take_along_axis(tree.depths, cur[:, None], axis=1)[:, 0], next_tok


RULE_OBJECTS = {"ddtree": DDTreeRule(), "eagle2": Eagle2Rule(), "recursive": RecursiveRule()}


def verify_tree(
  key: jax.Array,
  tree: Tree,
  target_logits: jax.Array,
  params: SamplingParams,
  max_depth: int,
  rule: Union[str, DDTreeRule, Eagle2Rule, RecursiveRule] = "ddtree",
  draft_probs: Optional[jax.Array] = None,
) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Lossless verification of a draft tree from one target pass.

  Args:
    key: PRNG key for this step.
    tree: the verified `Tree` (N+1 slots, root at slot 0).
    target_logits: [B, N+1, V] raw target logits at every slot (warped here with `params`).
    params: per-sequence sampling parameters; temperature-0 rows walk the argmax.
    max_depth: D, the tree's static maximum depth (the drafter's γ).
    rule: "ddtree", "eagle2" or "recursive" (see the module docstring; all exact), or a rule
      object (one of theirs or a subclass: the tests' deliberately broken variants).
    draft_probs: [B, D, V] the drafter's warped q per depth that the children were drawn from
      without replacement (`tree.sample_candidates`); needed by "recursive" only.

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
  logits = target_logits.astype(jnp.float32)
  return rule.verify(key, tree, logits, params, max_depth, draft_probs=draft_probs)


def sibling_ranks(tree: Tree) -> jax.Array:
  """[B, N+1] each node's rank among its siblings (children of one node, in slot order)."""
  n = tree.parents.shape[1]
  earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [i, j]: j before i
  same = (tree.parents[:, :, None] == tree.parents[:, None, :]) & tree.valid[:, None, :]
  return jnp.sum(same & earlier[None], axis=2).astype(jnp.int32)


Q_BUCKETS = 12  # bucket b holds sorted draft probabilities in (2^-(b+1), 2^-b]; the last, the rest


def q_buckets(sorted_q: jax.Array) -> jax.Array:
  """int32 bucket of each sorted draft probability (`Q_BUCKETS` halvings below 1)."""
  halvings = jnp.floor(-jnp.log2(jnp.maximum(sorted_q.astype(jnp.float32), 1e-30)))
  return jnp.clip(halvings, 0, Q_BUCKETS - 1).astype(jnp.int32)


def rank_outcomes(tree: Tree, path: jax.Array, num_accepted: jax.Array, ranks: int) -> jax.Array:
  """[B, D, K=ranks, 2] int32 what one walk tried and accepted, by depth and sibling rank.

  At depth i + 1 ≤ n (n = num_accepted) the walk tried the children of ranks 0..r and accepted
  rank r, the path's node there; at depth n + 1 it tried all m children of the path's last
  node and accepted none. [..., 0] counts tries, [..., 1] acceptances: summed over steps,
  accepted / tried estimates P(rank r accepted | depth reached, ranks < r rejected), the
  acceptance model a calibrated tree shape is built from (`TreeOptions.acceptance`). Exact
  for the recursive and EAGLE-2 rules, which try siblings in rank order.
  """
  batch, width = path.shape
  depth = width - 1
  rows = jnp.arange(batch)[:, None]
  rank = sibling_ranks(tree)
  path_rank = rank[rows, path[:, 1:]]  # [B, D] the accepted node's rank at each depth
  last = jnp.take_along_axis(path, num_accepted[:, None], axis=1)[:, 0]
  kids = jnp.sum(tree.valid & (tree.parents == last[:, None]), axis=1)  # m
  d = jnp.arange(depth)[None, :, None]
  r = jnp.arange(ranks)[None, None, :]
  n = num_accepted[:, None, None]
  on_path = d < n
  tried = (on_path & (r <= path_rank[:, :, None])) | ((d == n) & (r < kids[:, None, None]))
  accepted = on_path & (r == path_rank[:, :, None])
  return jnp.stack([tried, accepted], axis=-1).astype(jnp.int32)


def path_tokens(tree: Tree, path: jax.Array) -> jax.Array:
  """[B, D] the tokens of the path's nodes at depths 1..D (scratch past num_accepted)."""
  return jnp.take_along_axis(tree.tokens, path[:, 1:], axis=1)
