"""DDTree construction: the best draft tree under a node budget, built on device.

Input: the drafter's per-position log-probabilities `logprobs [B, D, V]` (position i predicts
the token at depth i+1; D is the drafter's γ). Each position keeps its top-K tokens. A node at
depth d with rank r (the r-th most likely token of position d-1) scores the sum of the
log-probs along its rank path: the product of the drafter's marginals, DDTree's surrogate for
"this node will be accepted".

Best-first construction (DDTree `build_ddtree_tree`): start with (depth 1, rank 0); repeatedly
pop the best frontier entry, make it the next node, push its next sibling (same parent, rank+1)
and its first child (depth+1, rank 0); stop after `budget` nodes. A child never outscores its
parent and a sibling never outscores its elder sibling, so pop order is topological (parents have
smaller indices) and siblings appear in rank order.

Everything is fixed-size: the "heap" is an append-only frontier array of 2·budget+1 entries
(each pop appends two, at known slots) and each of the `budget` iterations of a `lax.fori_loop`
takes a masked argmax over it. No host work; budget and K are static.

Outputs (`Tree`) use the flattened verify block layout: slot 0 is the root (the last committed
token, not in the target's KV cache yet), slots 1..N are the draft nodes in pop order.
  tokens  [B, N+1]   root token, then node tokens
  parents [B, N+1]   -1 for the root, else a slot index < own index
  depths  [B, N+1]   0 for the root; RoPE positions are start + depth
  valid   [B, N+1]   False for slots the budget could not fill (frontier ran dry)
  mask    [B, N+1, N+1]  ancestor-or-self: mask[i, j] iff slot j is on the root→i path
The budget counts draft nodes, excluding the root: budget N verifies N+1 tokens in one pass.

Option `chain_seed` (Lucebox): the drafter's full top-1 chain is inserted first (nodes 1..D, or
1..N when the budget is shorter), then best-first continues from the frontier those pops left
(the rank-1 sibling at every chain depth, the first child of the last chain node). The tree then
contains the chain, so (greedy) it never accepts fewer tokens than chain verification would.

Sampled trees (`candidates`, from `sample_candidates`): the shape is built as above from the
sorted log-probs of the warped draft distribution q, but the token at rank r of position d is
the r-th draw of a sample without replacement from q_d, so every node's children are the first
draws of such a sample: what the recursive rule (tree_verify.RecursiveRule) verifies exactly.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec import sampling

NEG_INF = float("-inf")
DEFAULT_MAX_TOPK = 8


@flax.struct.dataclass
class Tree:
  """A draft tree in the flattened verify-block layout (see the module docstring)."""

  tokens: jax.Array  # [B, N+1] int32
  parents: jax.Array  # [B, N+1] int32
  depths: jax.Array  # [B, N+1] int32
  valid: jax.Array  # [B, N+1] bool
  mask: jax.Array  # [B, N+1, N+1] bool, ancestor-or-self
  scores: jax.Array  # [B, N+1] float32 surrogate log-score (0 for the root, -inf if invalid)

  @property
  def size(self) -> int:
    """Slots in the verify block: budget + 1."""
    return self.tokens.shape[1]

  def positions(self, start: jax.Array) -> jax.Array:
    """[B, N+1] RoPE positions of the block written at slots start..: start + depth."""
    return start[:, None] + self.depths


def default_topk(budget: int, vocab: int, topk: int = 0) -> int:
  """K for a budget: `topk` if given, else min(budget, 8); never above budget or vocab."""
  k = topk if topk > 0 else min(budget, DEFAULT_MAX_TOPK)
  return max(1, min(k, budget, vocab))


class _Frontier(NamedTuple):
  """The best-first frontier: 2·budget+1 fixed slots (each pop appends two at known slots)."""

  pos: jax.Array  # [F] int32 draft position d (the entry's depth is d + 1)
  rank: jax.Array  # [F] int32 rank r among position d's top-K tokens
  parent: jax.Array  # [F] int32 the parent's slot in the tree
  score: jax.Array  # [F] float32 the path's summed log-probs
  live: jax.Array  # [F] bool not popped yet, and a real token

  def push(self, slot: int, pos, rank, parent, score, live) -> "_Frontier":
    return _Frontier(
      self.pos.at[slot].set(pos),
      self.rank.at[slot].set(rank),
      self.parent.at[slot].set(parent),
      self.score.at[slot].set(score),
      self.live.at[slot].set(live),
    )


class _Build(NamedTuple):
  """The fori_loop carry of `_build_one`: the frontier, the tree so far, whether the top-1
  chain is still being seeded."""

  frontier: _Frontier
  tree: Tree
  seeding: jax.Array


def _build_one(
  root: jax.Array, top_lp: jax.Array, top_ids: jax.Array, budget: int, chain_seed: bool
) -> Tree:
  """One sequence: root [], top_lp/top_ids [D, K] (log-probs sorted descending) → Tree."""
  depth_max, k = top_lp.shape
  n = budget + 1
  f = 2 * budget + 1
  frontier = _Frontier(
    pos=jnp.zeros((f,), jnp.int32),
    rank=jnp.zeros((f,), jnp.int32),
    parent=jnp.zeros((f,), jnp.int32),
    score=jnp.full((f,), NEG_INF, jnp.float32).at[0].set(top_lp[0, 0]),
    live=jnp.zeros((f,), bool).at[0].set(top_lp[0, 0] > NEG_INF),
  )
  tree = Tree(
    tokens=jnp.zeros((n,), jnp.int32).at[0].set(root.astype(jnp.int32)),
    parents=jnp.full((n,), -1, jnp.int32),
    depths=jnp.zeros((n,), jnp.int32),
    valid=jnp.zeros((n,), bool).at[0].set(True),
    mask=jnp.eye(n, dtype=bool),
    scores=jnp.full((n,), NEG_INF, jnp.float32).at[0].set(0.0),
  )

  def body(i, carry: _Build) -> _Build:
    fr, t, seeding = carry
    best = jnp.argmax(jnp.where(fr.live, fr.score, NEG_INF)).astype(jnp.int32)
    if chain_seed:
      # While seeding, pop i is the chain's next node: the first child pushed by pop i-1, which
      # sits at slot 2i (slot 0 for i = 0). Seeding ends at depth D or if the chain runs dry.
      seeding = seeding & (i < depth_max) & fr.live[2 * i]
      best = jnp.where(seeding, 2 * i, best)
    ok = fr.live[best]
    d, r, par, sc = fr.pos[best], fr.rank[best], fr.parent[best], fr.score[best]
    node = i + 1
    t = t.replace(
      tokens=t.tokens.at[node].set(jnp.where(ok, top_ids[d, r], 0)),
      parents=t.parents.at[node].set(jnp.where(ok, par, -1)),
      depths=t.depths.at[node].set(jnp.where(ok, d + 1, 0)),
      valid=t.valid.at[node].set(ok),
      scores=t.scores.at[node].set(jnp.where(ok, sc, NEG_INF)),
      mask=t.mask.at[node].set(jnp.where(ok, t.mask[par], False).at[node].set(True)),
    )
    fr = fr._replace(live=fr.live.at[best].set(False))
    # Next sibling (slot 2i+1) and first child (slot 2i+2).
    r1 = jnp.minimum(r + 1, k - 1)
    sib_score = t.scores[jnp.maximum(par, 0)] + top_lp[d, r1]
    sib_ok = ok & (r + 1 < k) & (top_lp[d, r1] > NEG_INF)
    d1 = jnp.minimum(d + 1, depth_max - 1)
    child_score = sc + top_lp[d1, 0]
    child_ok = ok & (d + 1 < depth_max) & (top_lp[d1, 0] > NEG_INF)
    fr = fr.push(2 * i + 1, d, r1, par, sib_score, sib_ok)
    fr = fr.push(2 * i + 2, d1, 0, node, child_score, child_ok)
    return _Build(fr, t, seeding)

  return jax.lax.fori_loop(0, budget, body, _Build(frontier, tree, jnp.bool_(chain_seed))).tree


def build_tree(
  root: jax.Array,
  logprobs: jax.Array,
  budget: int,
  topk: int = 0,
  chain_seed: bool = False,
  candidates: Optional[jax.Array] = None,
  use_candidates: Optional[jax.Array] = None,
  shape_scores: Optional[jax.Array] = None,
) -> Tree:
  """Builds the best-first draft tree for every sequence (jit-able; budget/topk static).

  Args:
    root: [B] int the root token (the last committed token) of each sequence.
    logprobs: [B, D, V] per-position draft log-probabilities (position i → depth i+1);
      -inf entries (tokens the drafter rules out) never become nodes.
    budget: N, the number of draft nodes (the root excluded); ≥ 1.
    topk: tokens kept per position; 0 means `default_topk` (min(budget, 8)).
    chain_seed: insert the top-1 chain first (see the module docstring).
    candidates: [B, D, ≥K] int token ids in rank order per position (`sample_candidates`:
      drawn without replacement, for sampled verification), or None for the top-K tokens of
      `logprobs`. The tree's shape is the same either way: it is built from the sorted top-K
      log-probs alone, so which tokens were drawn never decides how many siblings they get.
    use_candidates: [B] bool rows that take `candidates` and `shape_scores` (None: all); the
      others keep the top-K tokens of `logprobs` and their log-probs.
    shape_scores: [B, D, K] log-scores of rank r at position d that replace the sorted top-K
      log-probs in the best-first search (a calibrated acceptance model); ranks beyond the
      support of `logprobs` stay out of the tree.

  Returns:
    A `Tree` of N+1 slots per sequence.
  """
  if budget < 1:
    raise ValueError(f"tree budget must be ≥ 1 draft node, got {budget}")
  if logprobs.ndim != 3:
    raise ValueError(f"logprobs must be [B, D, V], got shape {logprobs.shape}")
  k = default_topk(budget, logprobs.shape[-1], topk)
  b, d, v = logprobs.shape
  # top_k on a 2-D operand: XLA:CPU lowers a rank-3 top_k feeding the loop below to a full
  # vocabulary sort (measured 20 ms vs 0.3 ms per tree at D=15, V=8192).
  top_lp, top_ids = jax.lax.top_k(logprobs.astype(jnp.float32).reshape(b * d, v), k)
  top_lp, top_ids = top_lp.reshape(b, d, k), top_ids.reshape(b, d, k)
  use = True if use_candidates is None else use_candidates[:, None, None]
  if candidates is not None:
    if candidates.shape[:2] != (b, d) or candidates.shape[2] < k:
      raise ValueError(
        f"candidates must be [B, D, ≥{k}] = [{b}, {d}, ≥{k}], got {candidates.shape}"
      )
    top_ids = jnp.where(use, candidates[:, :, :k], top_ids)
  if shape_scores is not None:
    if shape_scores.shape != (b, d, k):
      raise ValueError(
        f"shape_scores must be [B, D, K] = [{b}, {d}, {k}], got {shape_scores.shape}"
      )
    scores = jnp.where(top_lp > NEG_INF, shape_scores.astype(jnp.float32), NEG_INF)
    top_lp = jnp.where(use, scores, top_lp)
  build = lambda r, lp, ids: _build_one(r, lp, ids, budget, chain_seed)
  return jax.vmap(build)(root, top_lp, top_ids.astype(jnp.int32))


def sample_candidates(
  key: jax.Array, probs: jax.Array, k: int, first: Optional[jax.Array] = None
) -> jax.Array:
  """[B, D, k] int32: per draft position, k tokens drawn from probs [B, D, V] without
  replacement, in draw order (the Gumbel-top-k trick, as an exponential race).

  Sampled tree verification (`tree_verify.RecursiveRule`) needs each node's children to be the
  first draws of such a sample from the q it verifies against. `first` [B, D] fixes the first
  draw to a token already sampled from the same q (the drafter's own sampled chain): the rest
  are then a sample without replacement from q without it, which is the same joint law. Tokens
  with q = 0 come last (their rank is never a node: `build_tree` drops ranks beyond q's
  support). `key` is one key or row keys [B, 2] (`sampling.uniform`).
  """
  b, d, v = probs.shape
  # The exponential race (Gumbel-top-k without the logarithm of q): the k largest q / E for
  # E ~ Exp(1) are the first k draws without replacement. One logarithm per entry.
  race = -jnp.log1p(-sampling.uniform(key, (b, d, v)))
  scores = probs.astype(jnp.float32) / jnp.maximum(race, jnp.finfo(jnp.float32).tiny)
  if first is not None:
    iota = jax.lax.broadcasted_iota(jnp.int32, (b, d, v), 2)
    scores = jnp.where(iota == first[..., None], jnp.inf, scores)
  _, ids = jax.lax.top_k(scores.reshape(b * d, v), k)  # 2-D: see build_tree
  return ids.reshape(b, d, k).astype(jnp.int32)


def ancestor_mask(parents: jax.Array, valid: Optional[jax.Array] = None) -> jax.Array:
  """[..., N, N] ancestor-or-self mask from parents [..., N] (-1 = root), any topology.

  `log2(N)` pointer-doubling rounds; the reference that `build_tree`'s incremental mask is
  checked against, and a helper for trees built elsewhere.
  """
  n = parents.shape[-1]
  eye = jnp.eye(n, dtype=bool)
  par_oh = (parents[..., :, None] == jnp.arange(n)) & (parents[..., :, None] >= 0)
  anc = eye | par_oh  # paths of length ≤ 1
  hop = par_oh
  steps = max(1, (n - 1).bit_length())
  for _ in range(steps):
    # anc(i) ∪= anc(2^s-th ancestor of i); hop = hop∘hop.
    hop_f = hop.astype(jnp.float32)
    anc = anc | (jnp.einsum("...ij,...jk->...ik", hop_f, anc.astype(jnp.float32)) > 0)
    hop = jnp.einsum("...ij,...jk->...ik", hop_f, hop_f) > 0
  if valid is not None:
    anc = jnp.where(valid[..., :, None], anc, eye)
  return anc
