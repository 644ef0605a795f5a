"""DDTree construction (speculative/tree.py) and tree verification walks (speculative/tree_verify.py).

- Construction equals a host heapq port of DDTree's `build_ddtree_tree` node for node (with and
  without the seeded top-1 chain), and the incremental ancestor mask equals an independent one.
- Tree-mask oracle: with the ancestor mask and positions start + depth, every node's target
  logits equal a plain causal forward over prefix + its root→node path (batch 2, different
  prefix lengths).
- Walks: greedy by hand; the chain-seeded tree never accepts fewer than the chain; sampled walks
  (DDTree and EAGLE-2 rules, two temperatures) pass a chi-square test against the exact
  sequence distribution of a bigram target, and deliberately broken rules fail the same test.
"""

from __future__ import annotations

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxspec import sampling

from jaxspec.speculative import tree as tree_lib, tree_verify
from jaxspec.speculative.tree import build_tree

from tests import broken_rules, engine_models

PASS_P = 1e-4
FAIL_P = 1e-6


# ------------------------------------------------------------------------------------------------
# Construction
# ------------------------------------------------------------------------------------------------


def _ref_build(lp: np.ndarray, budget: int, k: int, chain_seed: bool):
  """Host reference (DDTree's heap): returns lists tokens, parents, depths (root excluded)."""
  depth_max = lp.shape[0]
  order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
  top = np.take_along_axis(lp, order, axis=1).astype(np.float64)
  tokens, parents, depths, scores = [], [], [], [0.0]
  heap, counter = [], itertools.count()

  def push(score, d, r, parent):
    if r < k and d < depth_max and np.isfinite(top[d, r]):
      heapq.heappush(heap, (-score, next(counter), d, r, parent))

  def add(d, r, parent, score):
    tokens.append(int(order[d, r]))
    parents.append(parent)
    depths.append(d + 1)
    scores.append(score)
    node = len(tokens)
    push(scores[parent] + (top[d, r + 1] if r + 1 < k else 0), d, r + 1, parent)
    push(score + (top[d + 1, 0] if d + 1 < depth_max else 0), d + 1, 0, node)
    return node

  if chain_seed:
    parent, score = 0, 0.0
    for d in range(min(depth_max, budget)):
      score += top[d, 0]
      # Pushing the chain's own next node is harmless: it is dropped below.
      parent = add(d, 0, parent, score)
    chain_len = len(tokens)
    # The first child of chain node j < chain_len is chain node j+1, already a node.
    heap = [e for e in heap if not (e[3] == 0 and 1 <= e[4] < chain_len)]
    heapq.heapify(heap)
  else:
    push(top[0, 0], 0, 0, 0)
  while len(tokens) < budget and heap:
    neg, _, d, r, parent = heapq.heappop(heap)
    add(d, r, parent, -neg)
  return tokens, parents, depths


def _ancestor_oracle(parents: np.ndarray) -> np.ndarray:
  n = parents.shape[0]
  out = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      out[i, j] = True
      j = parents[j]
  return out


@pytest.mark.parametrize(
  "budget, depth, topk, chain_seed",
  [
    (1, 4, 0, False),
    (7, 3, 0, False),
    (22, 6, 0, False),
    (22, 6, 0, True),
    (9, 4, 3, True),
    (30, 2, 4, False),  # more budget than the 4 + 16 possible nodes: the rest is invalid
    (3, 6, 0, True),  # budget shorter than the chain
  ],
)
def test_build_matches_heap_reference(budget, depth, topk, chain_seed):
  rng = np.random.default_rng(budget * 10 + depth)
  batch, vocab = 3, 40
  # Peaked random distributions (a few likely tokens), as drafters give.
  logits = rng.normal(size=(batch, depth, vocab)) * 3.0
  lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
  roots = rng.integers(0, vocab, batch)
  tree = build_tree(jnp.asarray(roots), jnp.asarray(lp), budget, topk, chain_seed)
  k = tree_lib.default_topk(budget, vocab, topk)
  assert tree.tokens.shape == (batch, budget + 1)
  for b in range(batch):
    tok, par, dep = _ref_build(lp[b], budget, k, chain_seed)
    n = len(tok)
    got_valid = np.asarray(tree.valid[b])
    assert got_valid.tolist() == [True] * (n + 1) + [False] * (budget - n)
    assert np.asarray(tree.tokens[b, 1 : n + 1]).tolist() == tok
    assert np.asarray(tree.parents[b, 1 : n + 1]).tolist() == par
    assert np.asarray(tree.depths[b, 1 : n + 1]).tolist() == dep
    assert int(tree.tokens[b, 0]) == roots[b] and int(tree.parents[b, 0]) == -1
    parents = np.asarray(tree.parents[b])
    assert all(parents[i] < i for i in range(1, budget + 1))
    mask = np.asarray(tree.mask[b])
    want = _ancestor_oracle(np.where(got_valid, parents, -1))
    want[~got_valid] = np.eye(budget + 1, dtype=bool)[~got_valid]
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(
      np.asarray(tree_lib.ancestor_mask(tree.parents[b], tree.valid[b])), want
    )
    if chain_seed:
      chain = np.argmax(lp[b], axis=-1)[: min(depth, budget)]
      assert np.asarray(tree.tokens[b, 1 : len(chain) + 1]).tolist() == chain.tolist()


def test_build_skips_impossible_tokens_and_is_jittable():
  lp = np.full((1, 3, 6), -np.inf, np.float32)
  lp[0, 0, [1, 4]] = np.log([0.7, 0.3])
  lp[0, 1, 2] = 0.0
  lp[0, 2, [0, 5]] = np.log([0.5, 0.5])
  build = jax.jit(build_tree, static_argnums=(2, 3, 4))
  tree = build(jnp.array([3]), jnp.asarray(lp), 8, 0, False)
  valid = np.asarray(tree.valid[0])
  # Possible nodes: 2 at depth 1, 2 at depth 2 (one child each), 4 at depth 3.
  assert valid.sum() == 1 + 8
  tree = build(jnp.array([3]), jnp.asarray(lp), 12, 0, False)
  assert np.asarray(tree.valid[0]).sum() == 1 + 8
  assert set(np.asarray(tree.tokens[0, 1:9]).tolist()) <= {0, 1, 2, 4, 5}


def test_build_rejects_bad_budget():
  with pytest.raises(ValueError, match="budget"):
    build_tree(jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2, 4)), 0)


# ------------------------------------------------------------------------------------------------
# Tree-mask oracle: node logits == causal forward over prefix + path
# ------------------------------------------------------------------------------------------------


def test_tree_mask_oracle_every_node_matches_causal_forward():
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel

  model = engine_models.random_target()
  cfg = model.config
  rng = np.random.default_rng(3)
  batch, budget, depth, max_len = 2, 10, 4, 32
  prefix_lens = np.array([5, 9])
  ids = rng.integers(0, cfg.vocab_size, (batch, 12)).astype(np.int32)
  out = target_lib.forward(
    cfg,
    model.params,
    jnp.asarray(ids),
    jnp.zeros((batch,), jnp.int32),
    model.init_state(batch, max_len),
  )  # slots ≥ prefix_len are overwritten below
  start = jnp.asarray(prefix_lens, jnp.int32)
  roots = ids[np.arange(batch), prefix_lens]
  lp = jax.nn.log_softmax(
    jnp.asarray(rng.normal(size=(batch, depth, cfg.vocab_size)) * 2, jnp.float32), axis=-1
  )
  tree = build_tree(jnp.asarray(roots), lp, budget, 3)
  got = target_lib.forward(
    cfg,
    model.params,
    tree.tokens,
    start,
    out.state.with_lengths(jnp.asarray(prefix_lens, jnp.int32)),  # not an alias of start
    positions=tree.positions(start),
    block_mask=tree.mask,
  ).logits
  # Reference: one padded causal batch holding prefix + path of every node.
  seqs, where = [], []
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  for b in range(batch):
    for i in range(budget + 1):
      path, j = [], i
      while j >= 0:
        path.append(tokens[b, j])
        j = parents[b, j]
      seq = list(ids[b, : prefix_lens[b]]) + path[::-1]
      seqs.append(seq)
      where.append((b, i, len(seq) - 1))
  width = max(map(len, seqs))
  padded = np.zeros((len(seqs), width), np.int32)
  for r, s in enumerate(seqs):
    padded[r, : len(s)] = s
  ref = np.asarray(model.logits(padded))
  for r, (b, i, pos) in enumerate(where):
    np.testing.assert_allclose(
      np.asarray(got[b, i]), ref[r, pos], atol=1e-4, rtol=1e-4, err_msg=f"sequence {b}, node {i}"
    )


# ------------------------------------------------------------------------------------------------
# Walks
# ------------------------------------------------------------------------------------------------


def _hand_tree():
  """root(9) → a(1) → c(3) → e(5); root → b(2) → d(4); a → f(6)."""
  tokens = jnp.array([[9, 1, 2, 3, 4, 5, 6]])
  parents = jnp.array([[-1, 0, 0, 1, 2, 3, 1]])
  depths = jnp.array([[0, 1, 1, 2, 2, 3, 2]])
  valid = jnp.ones((1, 7), bool)
  return tree_lib.Tree(
    tokens, parents, depths, valid, tree_lib.ancestor_mask(parents), jnp.zeros((1, 7))
  )


@pytest.mark.parametrize(
  "argmaxes, want_path, want_next",
  [
    ([1, 3, 0, 5, 0, 7, 0], [0, 1, 3, 5], 7),  # full depth, bonus at e
    ([2, 0, 4, 0, 8, 0, 0], [0, 2, 4, 0], 8),  # second branch
    ([1, 6, 0, 0, 0, 0, 7], [0, 1, 6, 0], 7),  # a's second child f
    ([7, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0], 7),  # nothing accepted
    ([1, 4, 0, 0, 0, 0, 0], [0, 1, 0, 0], 4),  # 4 is b's child, not a's: stop at a
  ],
)
def test_greedy_walk_by_hand(argmaxes, want_path, want_next):
  tree = _hand_tree()
  logits = jax.nn.one_hot(jnp.array([argmaxes]), 10) * 5.0
  params = sampling.make_sampling_params(1)
  q = jnp.full((1, 3, 10), 0.1)  # the recursive rule's draft distributions (unused when greedy)
  for rule in tree_verify.RULES:
    path, n, nxt = tree_verify.verify_tree(jax.random.PRNGKey(0), tree, logits, params, 3, rule, q)
    n_want = sum(1 for p in want_path[1:] if p)
    assert np.asarray(path[0]).tolist() == want_path
    assert (int(n[0]), int(nxt[0])) == (n_want, want_next)


def test_seeded_tree_never_accepts_fewer_than_the_chain():
  rng = np.random.default_rng(0)
  batch, depth, vocab = 512, 5, 6
  lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(batch, depth, vocab)) * 2, jnp.float32))
  chain = np.asarray(jnp.argmax(lp, axis=-1))
  wins = 0
  for budget in (1, 4, 12):
    tree = build_tree(jnp.zeros((batch,), jnp.int32), lp, budget, chain_seed=True)
    # Target argmax per node: agrees with the drafter's chain often, not always.
    logits = jnp.asarray(rng.normal(size=(batch, budget + 1, vocab)), jnp.float32)
    _, n, _ = tree_verify.verify_tree(
      jax.random.PRNGKey(1), tree, logits, sampling.make_sampling_params(batch), depth
    )
    # The chain's own greedy acceptance along the seeded nodes 1..min(D, budget).
    top = np.asarray(jnp.argmax(logits, axis=-1))
    L = min(depth, budget)
    chain_ok = np.asarray(tree.tokens[:, 1 : L + 1]) == top[:, :L]
    chain_n = np.asarray(jax.vmap(lambda r: jnp.argmin(jnp.append(r, False)))(chain_ok))
    assert np.all(np.asarray(tree.tokens[:, 1 : L + 1]) == chain[:, :L])
    assert np.all(np.asarray(n) >= chain_n)
    wins += int(np.sum(np.asarray(n) > chain_n))
  assert wins > 0  # the extra branches do help sometimes


# Sampled walks against the exact distribution of a bigram target --------------------------------


def _bigram_case(seed, batch, vocab=4, depth=3, budget=6, topk=2, chain_seed=False):
  """Random per-row draft trees under a bigram target table P; target logits per node.

  top-2 of 4 tokens: nodes have 0-2 children, so every path of the rules (accept a child, fall
  back after rejecting some, bonus at a leaf) is exercised. The draft distributions share one
  base across rows plus a little per-row noise: trees vary, but not so evenly that a broken
  rule's bias averages out over them.
  """
  rng = np.random.default_rng(seed)
  table = rng.dirichlet(np.full(vocab, 2.0), size=vocab)
  base = rng.normal(size=(1, depth, vocab)) * 1.5
  draft_lp = jax.nn.log_softmax(
    jnp.asarray(base + rng.normal(size=(batch, depth, vocab)) * 0.5, jnp.float32), axis=-1
  )
  tree = build_tree(jnp.zeros((batch,), jnp.int32), draft_lp, budget, topk, chain_seed)
  logits = jnp.log(jnp.asarray(table, jnp.float32))[tree.tokens]  # [B, N+1, V]
  return table, tree, logits


def _sequences(table, tree, logits, temperature, rule, variant, depth, seed):
  """Commits one tree step per row, then extends with exact bigram samples to depth+1 tokens."""
  batch = tree.tokens.shape[0]
  params = sampling.make_sampling_params(batch, temperature)
  rule = tree_verify.RULE_OBJECTS[rule] if variant == "exact" else broken_rules.TREE[variant]
  fn = jax.jit(tree_verify.verify_tree, static_argnums=(4, 5))
  path, n, nxt = fn(jax.random.PRNGKey(seed), tree, logits, params, depth, rule)
  toks = np.asarray(tree_verify.path_tokens(tree, path))
  n, nxt = np.asarray(n), np.asarray(nxt)
  warped = table ** (1.0 / temperature)
  warped /= warped.sum(axis=1, keepdims=True)
  rng = np.random.default_rng(seed + 1)
  length = depth + 1
  seqs = np.concatenate([toks, np.zeros((batch, 1), toks.dtype)], axis=1).astype(np.int64)
  seqs[np.arange(batch), n] = nxt
  cdf = np.cumsum(warped, axis=1)
  for k in range(1, length):  # positions past the committed ones: exact bigram samples
    fresh = rng.random(batch)
    drawn = np.minimum((fresh[:, None] > cdf[seqs[:, k - 1]]).sum(axis=1), warped.shape[0] - 1)
    seqs[:, k] = np.where(k > n, drawn, seqs[:, k])
  return seqs, warped


def _seq_pvalue(seqs, warped, start=0):
  vocab, length = warped.shape[0], seqs.shape[1]
  codes = np.ravel_multi_index(seqs.T, (vocab,) * length)
  probs = np.zeros(vocab**length)
  for idx, seq in enumerate(itertools.product(range(vocab), repeat=length)):
    p, prev = 1.0, start
    for t in seq:
      p *= warped[prev, t]
      prev = t
    probs[idx] = p
  counts = np.bincount(codes, minlength=probs.size)
  impossible = probs == 0  # top-k / top-p cut these: a single hit fails the test
  if counts[impossible].any():
    return 0.0
  counts, probs = counts[~impossible], probs[~impossible]
  expected = probs * counts.sum()
  small = expected < 5  # pooled into one cell (the chi-square approximation needs ≥ 5)
  obs, exp = counts[~small], expected[~small]
  if small.any():
    obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
  return scipy.stats.chisquare(obs, exp).pvalue


N_SAMPLES = 60_000


@pytest.mark.parametrize("rule", ["ddtree", "eagle2"])  # over top-k trees; "recursive" below
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_walk_is_exact(rule, temperature):
  depth = 3
  table, tree, logits = _bigram_case(0, N_SAMPLES, depth=depth)
  seqs, warped = _sequences(table, tree, logits, temperature, rule, "exact", depth, seed=3)
  assert _seq_pvalue(seqs, warped) > PASS_P


@pytest.mark.parametrize(
  "rule, variant",
  [("ddtree", "no_parent_check"), ("eagle2", "eagle2_no_renorm"), ("eagle2", "eagle2_residual_p")],
)
def test_broken_walks_fail_the_same_test(rule, variant):
  depth = 3
  table, tree, logits = _bigram_case(0, N_SAMPLES, depth=depth)
  seqs, warped = _sequences(table, tree, logits, 1.0, rule, variant, depth, seed=3)
  assert _seq_pvalue(seqs, warped) < FAIL_P


# The recursive rule over children sampled without replacement ----------------------------------


def _sampled_case(seed, batch, params, vocab=4, depth=3, budget=6, topk=2, candidates="sampled"):
  """A bigram target and per-row draft trees whose children are drawn from the warped q.

  candidates: "sampled" (`sample_candidates`), "sampled_first" (the first draw given, as a
  drafter's own sampled chain) or "top_k" (the naive tree: q's top-k verified as if drawn).
  Returns (warped target table [V, V], tree, target logits [B, N+1, V], q [B, D, V], the raw
  log table [V, V]).
  """
  rng = np.random.default_rng(seed)
  table = rng.dirichlet(np.full(vocab, 2.0), size=vocab)
  base = rng.normal(size=(1, depth, vocab)) * 1.5
  draft_logits = jnp.asarray(base + rng.normal(size=(batch, depth, vocab)) * 0.5, jnp.float32)
  q = sampling.warped_probs(draft_logits, params)
  key_first, key_rest = jax.random.split(jax.random.PRNGKey(seed + 7))
  first = None
  if candidates == "sampled_first":
    first = sampling.sample_from_probs(key_first, q)
  if candidates == "top_k":
    drawn = jax.lax.top_k(q, topk)[1]
  else:
    drawn = tree_lib.sample_candidates(key_rest, q, topk, first)
  tree = build_tree(jnp.zeros((batch,), jnp.int32), jnp.log(q), budget, topk, False, drawn)
  logits = jnp.log(jnp.asarray(table, jnp.float32))[tree.tokens]
  row_params = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], (vocab,)), params)
  warped = np.asarray(sampling.warped_probs(jnp.log(jnp.asarray(table, jnp.float32)), row_params))
  warped = warped.astype(np.float64)
  return warped / warped.sum(axis=1, keepdims=True), tree, logits, q, jnp.log(table)


def _recursive_sequences(warped, tree, logits, q, params, rule, depth, seed):
  """One recursive-rule tree step per row, extended with exact samples to depth + 1 tokens."""
  batch = tree.tokens.shape[0]
  fn = jax.jit(tree_verify.verify_tree, static_argnums=(4, 5))
  path, n, nxt = fn(jax.random.PRNGKey(seed), tree, logits, params, depth, rule, q)
  toks = np.asarray(tree_verify.path_tokens(tree, path))
  n, nxt = np.asarray(n), np.asarray(nxt)
  rng = np.random.default_rng(seed + 1)
  seqs = np.concatenate([toks, np.zeros((batch, 1), toks.dtype)], axis=1).astype(np.int64)
  seqs[np.arange(batch), n] = nxt
  cdf = np.cumsum(warped, axis=1)
  for k in range(1, depth + 1):
    drawn = np.minimum((rng.random(batch)[:, None] > cdf[seqs[:, k - 1]]).sum(axis=1), 3)
    seqs[:, k] = np.where(k > n, drawn, seqs[:, k])
  return seqs, n


RECURSIVE_SETTINGS = {  # temperature, top_k, top_p
  "t1_topp": (1.0, 0, 0.85),
  "t0.6_topk": (0.6, 3, 1.0),
}


@pytest.mark.parametrize("setting", sorted(RECURSIVE_SETTINGS))
@pytest.mark.parametrize("candidates", ["sampled", "sampled_first"])
def test_recursive_walk_is_exact(setting, candidates):
  """The recursive rule over sampled children is exact with temperature, top-k and top-p
  applied to both sides, whether or not the first child is the drafter's own draw."""
  depth = 3
  params = sampling.make_sampling_params(N_SAMPLES, *RECURSIVE_SETTINGS[setting])
  warped, tree, logits, q, _ = _sampled_case(0, N_SAMPLES, params, candidates=candidates)
  assert int(jnp.sum(tree.valid)) > 4 * N_SAMPLES  # branching trees, not chains
  seqs, n = _recursive_sequences(warped, tree, logits, q, params, "recursive", depth, seed=3)
  assert _seq_pvalue(seqs, warped) > PASS_P
  assert np.mean(n) > 0.5  # drafts do get accepted


@pytest.mark.parametrize(
  "variant, candidates",
  [
    ("recursive_no_residual", "sampled"),
    ("recursive_with_replacement", "sampled"),
    ("exact", "top_k"),  # min(1, p/q) over q's top-k, as if they had been drawn
  ],
)
def test_broken_recursive_walks_fail(variant, candidates):
  depth = 3
  params = sampling.make_sampling_params(N_SAMPLES, 1.0, 0, 0.85)
  warped, tree, logits, q, _ = _sampled_case(0, N_SAMPLES, params, candidates=candidates)
  rule = tree_verify.RecursiveRule() if variant == "exact" else broken_rules.TREE[variant]
  seqs, _ = _recursive_sequences(warped, tree, logits, q, params, rule, depth, seed=3)
  assert _seq_pvalue(seqs, warped) < FAIL_P


@pytest.mark.parametrize("with_first", [False, True])
def test_sample_candidates_draw_without_replacement(with_first):
  """The first two draws follow q(a) · q(b) / (1 − q(a)); a given first draw (itself drawn from
  q) keeps that law. Distinct tokens, tokens with q = 0 last."""
  n, vocab = 40_000, 5
  q = jnp.asarray([0.4, 0.3, 0.2, 0.1, 0.0], jnp.float32)
  probs = jnp.broadcast_to(q, (n, 1, vocab))
  key_first, key = jax.random.split(jax.random.PRNGKey(5))
  first = sampling.sample_from_probs(key_first, probs) if with_first else None
  ids = np.asarray(tree_lib.sample_candidates(key, probs, 4, first))[:, 0]
  assert np.all(np.sort(ids, axis=1) == np.arange(4)) and np.all(ids[:, :4] != 4)
  if with_first:
    assert np.all(ids[:, 0] == np.asarray(first)[:, 0])
  qn = np.asarray(q, np.float64)
  pairs = [(a, b) for a in range(4) for b in range(4) if a != b]
  expected = np.array([qn[a] * qn[b] / (1 - qn[a]) for a, b in pairs])
  expected *= n / expected.sum()  # 1 up to q's float32 rounding
  counts = np.array([np.sum((ids[:, 0] == a) & (ids[:, 1] == b)) for a, b in pairs])
  assert scipy.stats.chisquare(counts, expected).pvalue > PASS_P


def test_sampled_tree_shape_depends_on_q_only():
  """Two different candidate draws give the same parents, depths and validity: the shape is
  built from q's sorted probabilities, never from which tokens were drawn."""
  rng = np.random.default_rng(2)
  q = jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 4, 12)) * 2, jnp.float32))
  trees = [
    build_tree(jnp.zeros((3,), jnp.int32), jnp.log(q), 9, 3, False,
               tree_lib.sample_candidates(jax.random.PRNGKey(s), q, 3))
    for s in (0, 1)
  ]
  for field in ("parents", "depths", "valid", "mask"):
    assert np.array_equal(getattr(trees[0], field), getattr(trees[1], field))
  assert not np.array_equal(trees[0].tokens, trees[1].tokens)


# What a walk tried and accepted, by depth and sibling rank --------------------------------------


def test_rank_outcomes_by_hand():
  """root → a, b; a → c, f; c → e. Path root→a→f (f is a's second child): depth 1 tried rank 0
  and accepted it; depth 2 tried ranks 0, 1 and accepted rank 1; depth 3: f has no children.
  Path root→b: depth 1 tried 0 (rejected) and 1 (accepted); depth 2 tried b's one child."""
  tree = _hand_tree()
  np.testing.assert_array_equal(tree_verify.sibling_ranks(tree)[0], [0, 0, 1, 0, 0, 0, 1])
  tree2 = jax.tree.map(lambda x: jnp.concatenate([x, x]), tree)
  path = jnp.array([[0, 1, 6, 0], [0, 2, 0, 0]])
  out = np.asarray(tree_verify.rank_outcomes(tree2, path, jnp.array([2, 1]), 3))
  tried, accepted = out[..., 0], out[..., 1]
  np.testing.assert_array_equal(tried[0], [[1, 0, 0], [1, 1, 0], [0, 0, 0]])
  np.testing.assert_array_equal(accepted[0], [[1, 0, 0], [0, 1, 0], [0, 0, 0]])
  np.testing.assert_array_equal(tried[1], [[1, 1, 0], [1, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(accepted[1], [[0, 1, 0], [0, 0, 0], [0, 0, 0]])


def test_calibrated_shape_stays_exact():
  """A shape from a measured acceptance table (any fixed table) keeps the recursive walk exact:
  it depends on the table and q, not on which children were drawn."""
  depth = 3
  params = sampling.make_sampling_params(N_SAMPLES, 1.0, 0, 0.85)
  warped, tree, _, q, log_table = _sampled_case(0, N_SAMPLES, params)
  table = np.array([[0.9, 0.1], [0.2, 0.7], [0.5, 0.5]])
  survive = np.concatenate([np.ones((depth, 1)), 1 - table[:, :-1]], 1)
  scores = jnp.broadcast_to(jnp.log(jnp.asarray(survive * table, jnp.float32)), (N_SAMPLES, 3, 2))
  drawn = tree_lib.sample_candidates(jax.random.PRNGKey(11), q, 2)
  root = jnp.zeros((N_SAMPLES,), jnp.int32)
  calibrated = build_tree(root, jnp.log(q), 6, 2, False, drawn, shape_scores=scores)
  assert not np.array_equal(calibrated.parents, tree.parents)  # another shape
  logits = jnp.asarray(log_table, jnp.float32)[calibrated.tokens]
  seqs, _ = _recursive_sequences(warped, calibrated, logits, q, params, "recursive", depth, 3)
  assert _seq_pvalue(seqs, warped) > PASS_P


def test_acceptance_tables_round_trip_and_fill(tmp_path):
  from jaxspec.errors import ConfigError
  from jaxspec.io import tree_acceptance
  from jaxspec.speculative import verifiers

  nb = tree_verify.Q_BUCKETS
  acc = np.full((2, 2, nb), np.nan)
  acc[0, 0, 0], acc[1, 1, 3] = 0.6, 0.2
  tree_acceptance.write(str(tmp_path), [(1.0, acc, np.zeros((2, 2, nb)))], target="t")
  ((t, table),) = tree_acceptance.read(str(tmp_path))
  assert t == 1.0 and table[0][0][0] == 0.6 and np.isnan(table[0][1][0])
  # Missing depths and ranks repeat the last ones, unmeasured entries read 0.5, and everything
  # lies strictly inside (0, 1).
  fitted = verifiers.fit_table(table, 3, 3)
  assert fitted.shape == (3, 3, nb) and fitted[0, 0, 0] == 0.6 and fitted[0, 1, 0] == 0.5
  assert fitted[2, 2, 3] == 0.2 and fitted[2, 1, 3] == 0.2
  assert verifiers.fit_table(np.zeros((1, 1, nb)), 1, 1).min() == 1e-3
  with pytest.raises(ConfigError, match="q buckets"):
    verifiers.fit_table([[0.5, 0.5]], 1, 2)
  assert tree_acceptance.read(str(tmp_path / "none")) is None
  (tmp_path / tree_acceptance.FILENAME).write_text('{"format": "x"}')
  with pytest.raises(ConfigError, match="format"):
    tree_acceptance.read(str(tmp_path))


def test_q_buckets_halve():
  q = jnp.asarray([1.0, 0.6, 0.5, 0.3, 0.2, 1e-3, 0.0])
  assert tree_verify.q_buckets(q).tolist() == [0, 0, 1, 1, 2, 9, tree_verify.Q_BUCKETS - 1]
