"""How a step verifies a proposal: plain, chain or tree, one small object each.

The step (jaxspec/speculative/step.py) asks every verifier the same questions, so it has no
branch on the method:

  width, max_commit, lookahead: static sizes (tokens the target runs per step, the most tokens
    a step commits, the slots past the root a step may write);
  block(key, root, proposal, params): the tokens the target verifies, with their positions and
    mask (a sampled tree draws its children with `key`);
  accept(key, block, logits, proposal, params): what the target accepts (`Accepted`);
  commit(target_state, accepted): the target's decoding state holding only committed tokens;
  features(taps, hidden, accepted): the target's features of the committed tokens, in order,
    for the drafter.

`PlainVerifier` is plain decoding (no drafter: the root alone, one token per pass);
`ChainVerifier` checks γ drafts in order under the causal mask (jaxspec/speculative/verify.py);
`TreeVerifier` builds a DDTree from the drafter's per-position distributions and verifies it
under the ancestor mask (tree.py, tree_verify.py); under the "recursive" rule the children of
sampled rows are drawn from the drafter's warped q without replacement. `make` picks one from
the engine's options.

A smaller speculation budget on the same state (`with_budget`, for `EngineConfig(speculation=
"auto")`): `ShortChainVerifier` checks only the first of the drafter's drafts,
`TreeVerifier` takes a smaller budget, and `NoDraftVerifier` skips the drafter's proposal
(plain decoding) while the drafter still absorbs what is committed. Their blocks are narrower,
but the features they hand the drafter keep the full block's width (zero-padded past what was
committed), so every variant runs on the same drafter state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling
from jaxspec.drafters.base import Drafter, Proposal
from jaxspec.errors import ConfigError
from jaxspec.speculative import tree as tree_lib, tree_verify, verify
from jaxspec.state import DecodingState


def fit_table(table: Any, depth: int, ranks: int) -> np.ndarray:
  """A measured acceptance table a[d][r][b] (`TreeOptions.acceptance`; b a q bucket,
  `tree_verify.q_buckets`) as a [depth, ranks, NB] array in (0, 1): depths and ranks it lacks
  repeat its last ones, and unmeasured entries (NaN) read 0.5."""
  a = np.asarray(table, np.float64)
  if a.ndim != 3 or not a.size or a.shape[2] != tree_verify.Q_BUCKETS:
    raise ConfigError(
      f"a tree acceptance table is [depth][rank][{tree_verify.Q_BUCKETS} q buckets], got "
      f"shape {a.shape}"
    )
  a = a[:depth, :ranks]
  a = np.concatenate([a, np.repeat(a[-1:], depth - a.shape[0], 0)], 0)
  a = np.concatenate([a, np.repeat(a[:, -1:], ranks - a.shape[1], 1)], 1)
  return np.clip(np.where(np.isnan(a), 0.5, a), 1e-3, 1 - 1e-3)


@dataclasses.dataclass(frozen=True)
class TreeOptions:
  """The static tree-verification choices a `TreeVerifier` is compiled for."""

  budget: int = 8
  topk: int = 0
  chain_seed: bool = False
  rule: str = "recursive"
  draft_temperature: float = 1.0  # sampled trees: children drawn from q at T × this
  # Sampled trees: the acceptance model the shape is built from, ((temperature, a), ...) with
  # a[d][r][b] = P(rank r accepted | depth d + 1 reached, ranks < r rejected, its sorted draft
  # probability in q bucket b) measured by `launch/bench.py tree-calibrate`; each row takes
  # the nearest temperature's. None: q's sorted probabilities (the sample-and-match model).
  acceptance: Optional[tuple] = None


@dataclasses.dataclass(frozen=True)
class Block:
  """The tokens [B, T] the target verifies in one pass, and their tree (None: a chain, at
  consecutive positions under the causal mask)."""

  tokens: jax.Array
  tree: Optional[tree_lib.Tree] = None
  draft_probs: Optional[jax.Array] = None  # [B, D, V] the q a sampled tree's children came from
  draft_top: Optional[jax.Array] = None  # [B, D, K] its K largest probabilities per depth

  def positions(self, start: jax.Array) -> Optional[jax.Array]:
    """[B, T] RoPE positions (None: start, start + 1, ...)."""
    return None if self.tree is None else self.tree.positions(start)

  @property
  def mask(self) -> Optional[jax.Array]:
    """[B, T, T] the ancestor mask (None: causal)."""
    return None if self.tree is None else self.tree.mask


@dataclasses.dataclass(frozen=True)
class Accepted:
  """What one pass accepts, per row.

  drafts: [B, D] the accepted drafts first (entries past num_accepted are scratch).
  num_accepted: [B] int32 drafts accepted, 0..D.
  next_token: [B] int32 the target's token after them (correction or bonus).
  source: [B, D+1] where in the verify block new token j's distribution sits: j for a chain,
    the accepted path's node j for a tree (root first).
  ranks: [B, D, K, NB, 2] a tree walk's tries and acceptances by depth, sibling rank and the
    bucket of the rank's draft probability (None for chains; `tree_verify.rank_outcomes`).
  """

  drafts: jax.Array
  num_accepted: jax.Array
  next_token: jax.Array
  source: jax.Array
  ranks: Optional[jax.Array] = None


class Verifier:
  """The interface (see the module docstring); a chain's defaults for commit and features."""

  width: int  # tokens the target verifies per pass
  max_commit: int  # the most tokens one pass commits per row
  lookahead: int  # slots past the root a pass may write
  rank_shape: tuple[int, ...] = ()  # (K, NB) of `Accepted.ranks` (none: ())
  drafts: ClassVar[bool] = True  # whether the step asks the drafter for a proposal

  def describe(self) -> str:
    """What a step drafts, for error messages."""
    raise NotImplementedError

  def block(
    self,
    key: jax.Array,
    root: jax.Array,
    proposal: Optional[Proposal],
    params: sampling.SamplingParams,
  ) -> Block:
    """The verify block for each row's root [B] and the drafter's proposal."""
    raise NotImplementedError

  def accept(
    self,
    key: jax.Array,
    block: Block,
    logits: jax.Array,
    proposal: Optional[Proposal],
    params: sampling.SamplingParams,
  ) -> Accepted:
    """What the target's logits [B, T, V] over `block` accept (lossless at any temperature)."""
    raise NotImplementedError

  def commit(self, target_state: DecodingState, accepted: Accepted) -> DecodingState:
    """The state after the pass with the accepted tokens in place (a chain's prefix already
    is: the lengths cut the rest)."""
    del accepted
    return target_state

  def features(self, taps: Any, hidden: jax.Array, accepted: Accepted) -> tuple[Any, jax.Array]:
    """The block's taps [n, B, T, H] and hidden [B, T, H] at the committed tokens, in order
    (a chain's already are)."""
    del accepted
    return taps, hidden


@dataclasses.dataclass(frozen=True)
class PlainVerifier(Verifier):
  """Plain decoding: the target runs the root alone and samples the next token."""

  width = 1
  max_commit = 1
  lookahead = 0

  def describe(self) -> str:
    return "no draft tokens"

  def block(self, key, root, proposal, params) -> Block:
    del key, proposal, params
    return Block(root[:, None])

  def accept(self, key, block, logits, proposal, params) -> Accepted:
    del proposal
    zeros = jnp.zeros((block.tokens.shape[0],), jnp.int32)
    next_token = sampling.sample(key, logits[:, 0], params)
    return Accepted(block.tokens[:, 1:], zeros, next_token, zeros[:, None])


@dataclasses.dataclass(frozen=True)
class ChainVerifier(Verifier):
  """γ drafts checked in order after the root (lossless; jaxspec/speculative/verify.py)."""

  gamma: int

  @property
  def width(self) -> int:
    return self.gamma + 1

  @property
  def max_commit(self) -> int:
    return self.gamma + 1

  @property
  def lookahead(self) -> int:
    return self.gamma

  def describe(self) -> str:
    return f"{self.gamma} draft tokens"

  def block(self, key, root, proposal, params) -> Block:
    del key, params
    return Block(jnp.concatenate([root[:, None], proposal.tokens.astype(jnp.int32)], axis=1))

  def accept(self, key, block, logits, proposal, params) -> Accepted:
    num_accepted, next_token = verify.verify_chain(
      key, proposal.tokens, proposal.probs, logits, params
    )
    batch = block.tokens.shape[0]
    source = jnp.broadcast_to(jnp.arange(self.gamma + 1), (batch, self.gamma + 1))
    return Accepted(block.tokens[:, 1:], num_accepted, next_token, source)


@dataclasses.dataclass(frozen=True)
class TreeVerifier(Verifier):
  """A DDTree of `options.budget` nodes from the drafter's per-position log-probs, verified
  under the ancestor mask; the accepted path is committed into contiguous slots (the rest of
  the tree is scratch past the new length) and its features go to the drafter in order."""

  gamma: int
  options: TreeOptions
  drafter_name: str = "the drafter"

  @property
  def width(self) -> int:
    return self.options.budget + 1

  @property
  def max_commit(self) -> int:
    return self.gamma + 1  # a path is at most γ deep, then the next token

  @property
  def lookahead(self) -> int:
    return max(self.gamma, self.options.budget)

  @property
  def rank_width(self) -> int:
    """K: the most children a node may have (the tree's sibling ranks)."""
    o = self.options
    return o.topk if o.topk > 0 else min(o.budget, tree_lib.DEFAULT_MAX_TOPK)

  @property
  def rank_shape(self) -> tuple[int, ...]:
    return (self.rank_width, tree_verify.Q_BUCKETS)

  def describe(self) -> str:
    return f"a tree of {self.options.budget} draft nodes (depth ≤ {self.gamma})"

  def block(self, key, root, proposal, params) -> Block:
    if proposal.logprobs is None:
      raise ConfigError(
        f"{self.drafter_name} gives no per-position distributions (Proposal.logprobs); "
        "tree verification needs them — use verify='chain' with this drafter"
      )
    if proposal.logprobs.shape[1] != self.gamma:
      raise ConfigError(
        f"{self.drafter_name}: logprobs cover {proposal.logprobs.shape[1]} positions, "
        f"expected γ={self.gamma}"
      )
    o = self.options
    if o.rule not in tree_verify.SAMPLED_CANDIDATE_RULES:
      built = tree_lib.build_tree(root, proposal.logprobs, o.budget, o.topk, o.chain_seed)
      return Block(built.tokens, built)
    greedy = sampling.is_greedy(params)

    v = proposal.logprobs.shape[-1]
    k = tree_lib.default_topk(o.budget, v, o.topk)

    def top_k_tree():
      built = tree_lib.build_tree(root, proposal.logprobs, o.budget, o.topk, o.chain_seed)
      b, d = proposal.logprobs.shape[:2]
      return built, jnp.zeros((b, d, v), jnp.float32), jnp.zeros((b, d, k), jnp.float32)

    def sampled_tree():
      q, first = self.draft_distribution(proposal, params)
      top_q = jax.lax.top_k(q.reshape(-1, v), k)[0].reshape(q.shape[:2] + (k,))
      # `key` is also the accept key, which splits it: fold in a constant for these draws.
      drawn = tree_lib.sample_candidates(sampling.fold_in(key, 1), q, k, first)
      # Shape from q (sampled rows) or the drafter's log-probs (greedy rows, whose children
      # stay its top-k), never from which tokens were drawn.
      shape_lp = jnp.where(greedy[:, None, None], proposal.logprobs, jnp.log(q))
      built = tree_lib.build_tree(
        root,
        shape_lp,
        o.budget,
        o.topk,
        o.chain_seed,
        drawn,
        use_candidates=~greedy,
        shape_scores=self.calibrated_scores(params, top_q),
      )
      return built, q, top_q

    built, q, top_q = jax.lax.cond(jnp.all(greedy), top_k_tree, sampled_tree)
    return Block(built.tokens, built, q, top_q)

  def calibrated_scores(
    self, params: sampling.SamplingParams, top_q: jax.Array
  ) -> Optional[jax.Array]:
    """[B, D, K] the shape's log-scores of rank r at depth d + 1 under a calibrated acceptance
    model (None without one): the mean of log Π_{j<r}(1 − a_j) · a_r, the measured chance
    that the walk accepts rank r once its parent is reached (a_j: the acceptance of rank j at
    that depth given the bucket of its sorted draft probability this step, from the nearest
    calibrated temperature's table), and log q_(r), the drafter's own sorted probability
    (`top_q` [B, D, K]). The mean measured above either alone at T = 0.6 and 1 (docs/tree.md).
    Only sampled rows use these (`build_tree(use_candidates=...)`)."""
    if self.options.acceptance is None:
      return None
    temps = jnp.asarray([t for t, _ in self.options.acceptance], jnp.float32)
    k = top_q.shape[-1]
    tables = np.asarray([fit_table(a, self.gamma, k) for _, a in self.options.acceptance])
    nearest = jnp.argmin(jnp.abs(params.temperature[:, None] - temps[None]), axis=1)
    table = jnp.asarray(tables, jnp.float32)[nearest]  # [B, D, K, NB]
    bucket = tree_verify.q_buckets(top_q)
    a = jnp.take_along_axis(table, bucket[..., None], axis=-1)[..., 0]  # [B, D, K]
    survive = jnp.cumprod(jnp.concatenate([jnp.ones_like(a[..., :1]), 1 - a[..., :-1]], -1), -1)
    return 0.5 * (jnp.log(survive * a) + jnp.log(top_q))

  def draft_distribution(
    self, proposal: Proposal, params: sampling.SamplingParams
  ) -> tuple[jax.Array, Optional[jax.Array]]:
    """(q [B, D, V], first [B, D] or None): the warped draft distribution per depth, and the
    drafter's own tokens when it sampled them from that q (they become every depth's first
    candidate, so the tree holds the sampled chain). Drafters that give only log-probs
    (log_softmax(logits / T)) are warped here with the same top-k / top-p as the target."""
    scale = self.options.draft_temperature
    if proposal.probs is not None and scale == 1.0:
      return proposal.probs.astype(jnp.float32), proposal.tokens.astype(jnp.int32)
    # logprobs are log_softmax(logits / T): at temperature `scale` they give q at T × scale.
    unit = params.replace(temperature=jnp.where(sampling.is_greedy(params), 0.0, scale))
    return sampling.warped_probs(proposal.logprobs, unit), None

  def accept(self, key, block, logits, proposal, params) -> Accepted:
    path, num_accepted, next_token = tree_verify.verify_tree(
      key, block.tree, logits, params, self.gamma, self.options.rule, block.draft_probs
    )
    outcomes = tree_verify.rank_outcomes(block.tree, path, num_accepted, self.rank_width)
    top_q = block.draft_top
    if top_q is None:  # a top-k tree: bucket the drafter's own probabilities
      lp = proposal.logprobs
      width = min(self.rank_width, lp.shape[-1])
      top_q = jnp.exp(jax.lax.top_k(lp.reshape(-1, lp.shape[-1]), width)[0])
      top_q = top_q.reshape(lp.shape[:2] + (-1,))
    top_q = jnp.pad(top_q, ((0, 0), (0, 0), (0, self.rank_width - top_q.shape[-1])))
    buckets = jax.nn.one_hot(tree_verify.q_buckets(top_q), tree_verify.Q_BUCKETS)
    ranks = outcomes[..., None, :] * buckets.astype(jnp.int32)[..., None]  # [B, D, K, NB, 2]
    drafts = tree_verify.path_tokens(block.tree, path)
    return Accepted(drafts, num_accepted, next_token, path, ranks)

  def commit(self, target_state: DecodingState, accepted: Accepted) -> DecodingState:
    return target_state.commit_path(accepted.source)

  def features(self, taps: Any, hidden: jax.Array, accepted: Accepted) -> tuple[Any, jax.Array]:
    path = accepted.source
    rows = jnp.arange(path.shape[0])[:, None]
    return (None if taps is None else taps[:, rows, path]), hidden[rows, path]


def _nested_tuple(x: Any) -> Any:
  """Nested lists or arrays as nested tuples of floats (hashable, for static options)."""
  if hasattr(x, "tolist"):
    x = x.tolist()
  return tuple(_nested_tuple(v) for v in x) if isinstance(x, (list, tuple)) else float(x)


def _padded(taps: Any, hidden: jax.Array, width: int) -> tuple[Any, jax.Array]:
  """A narrower block's features zero-padded to `width` positions (past the committed ones a
  drafter's commit treats them as scratch)."""
  extra = width - hidden.shape[1]
  if extra <= 0:
    return taps, hidden
  hidden = jnp.pad(hidden, ((0, 0), (0, extra), (0, 0)))
  return (None if taps is None else jnp.pad(taps, ((0, 0), (0, 0), (0, extra), (0, 0)))), hidden


@dataclasses.dataclass(frozen=True)
class ShortChainVerifier(ChainVerifier):
  """The first `gamma` of the drafter's `full` drafts checked in order: a smaller budget on
  the state of a γ = `full` engine."""

  full: int = 0

  def _cut(self, proposal: Proposal) -> Proposal:
    cut = lambda x: None if x is None else x[:, : self.gamma]
    return Proposal(cut(proposal.tokens), cut(proposal.probs), cut(proposal.logprobs))

  def block(self, key, root, proposal, params) -> Block:
    return super().block(key, root, self._cut(proposal), params)

  def accept(self, key, block, logits, proposal, params) -> Accepted:
    return super().accept(key, block, logits, self._cut(proposal), params)

  def features(self, taps: Any, hidden: jax.Array, accepted: Accepted) -> tuple[Any, jax.Array]:
    return _padded(taps, hidden, self.full + 1)


@dataclasses.dataclass(frozen=True)
class NoDraftVerifier(PlainVerifier):
  """No speculation this step, beside a drafter: it proposes nothing, the target runs the root
  alone, and the drafter absorbs the committed token (features padded to `full_width`)."""

  full_width: int = 1
  drafts = False

  def features(self, taps: Any, hidden: jax.Array, accepted: Accepted) -> tuple[Any, jax.Array]:
    return _padded(taps, hidden, self.full_width)


def budget_of(verifier: Verifier) -> int:
  """A verifier's speculation budget: γ of a chain, the nodes of a tree, 0 for none."""
  if isinstance(verifier, TreeVerifier):
    return verifier.options.budget
  return getattr(verifier, "gamma", 0)


def with_budget(verifier: Verifier, budget: int, drafter: Optional[Drafter]) -> Verifier:
  """`verifier` (an engine's) with a speculation budget of at most its own, on the same state:
  fewer chain drafts, fewer tree nodes, or 0 (the drafter proposes nothing this step)."""
  full = budget_of(verifier)
  if not 0 <= budget <= full:
    raise ConfigError(f"speculation budget {budget} is outside [0, {full}] for this engine")
  if budget == full:
    return verifier
  if budget == 0:
    if drafter is not None and not drafter.can_skip_proposals:
      raise ConfigError(
        f"{drafter.name} must propose every step (its state catches up there): budget 0 is "
        "not offered for it"
      )
    return NoDraftVerifier(verifier.max_commit)
  if isinstance(verifier, TreeVerifier):
    # The same sibling-rank width as the full tree, so the statistics keep their shape.
    options = dataclasses.replace(verifier.options, budget=budget, topk=verifier.rank_width)
    return TreeVerifier(verifier.gamma, options, verifier.drafter_name)
  return ShortChainVerifier(budget, full)


def make(drafter: Optional[Drafter], tree: Optional[TreeOptions] = None) -> Verifier:
  """The verifier for a drafter (None: plain decoding) and tree options (None: a chain); a
  tree without an acceptance model takes the drafter's (`Drafter.tree_acceptance`)."""
  if drafter is None:
    if tree is not None:
      raise ConfigError("verify='tree' needs a drafter that gives per-position distributions")
    return PlainVerifier()
  if tree is None:
    return ChainVerifier(drafter.gamma)
  if tree.acceptance is None and drafter.tree_acceptance is not None:
    frozen = tuple((float(t), _nested_tuple(a)) for t, a in drafter.tree_acceptance)
    tree = dataclasses.replace(tree, acceptance=frozen)
  return TreeVerifier(drafter.gamma, tree, drafter.name)
