"""Classic speculative sampling's drafter: an independent small LM with its own KV cache.

Each step it runs γ autoregressive forwards inside the jitted step (a `lax.scan`). For chain
verification it samples every draft token from its warped distribution q (same
temperature/top-k/top-p as the target) and returns q for lossless verification. For tree
verification (`tree=True`, what `for_tree()` returns) it follows its own argmax chain and returns
the per-step log-probabilities along it (`Proposal.logprobs`, temperature-scaled, no top-k/top-p)
from which the engine's tree builder expands the top-K tokens of every step; for sampled trees
(`for_tree(sampled_chain=True)`) the chain is sampled at T > 0 as in chain mode, with its q.

Cache bookkeeping: the state is the draft model's decoding state, whose `lengths` count the
slots whose draft KV is known to belong to the committed text, plus the chain fed during the last propose. A
propose writes the root and the first γ-1 chain tokens at slots seq_len-1..seq_len+γ-2; at commit
the chain slots stay valid as far as the committed tokens agree with the chain (always the
accepted drafts after a chain step; after a tree step the accepted path may leave the chain at
any depth). The next propose re-processes the pending committed tokens (slots lengths..seq_len-1,
at least the new root) as one fixed-size padded block: 2 slots suffice for chains, γ+1 for trees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.errors import ConfigError
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import CommitContext, Drafter, PrefillContext, Proposal, ProposeContext
from jaxspec.drafters.base import check_gamma
from jaxspec.drafters.feature_chain import tree_logprobs
from jaxspec.models import target as target_lib
from jaxspec import sampling
from jaxspec.state import DecodingState


@flax.struct.dataclass
class DraftModelState:
  """cache.lengths[b]: leading slots of valid draft KV; chain: the tokens fed last propose."""

  cache: DecodingState
  chain: jax.Array  # [B, γ] int32

  AXES: ClassVar[dict] = {"chain": ("batch", None)}  # the cache names its own


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(Drafter):
  """A small causal LM (any supported architecture) drafting γ tokens per step."""

  config: ModelConfig = None  # type: ignore[assignment]
  gamma: int = 4
  tree: bool = False
  sampled_tree: bool = False  # tree mode: sample the chain at T > 0 (see Drafter.for_tree)
  can_skip_proposals: ClassVar[bool] = False  # its cache absorbs committed tokens in propose

  def __post_init__(self):
    if self.config is None:
      raise ConfigError("DraftModelDrafter needs the draft model's ModelConfig")
    if "linear_attention" in self.config.layer_types:
      # Its propose re-runs committed tokens from an earlier slot; a recurrent state cannot
      # rewind to it (jaxspec/state/linear.py: LinearState).
      raise ConfigError("a draft model with linear-attention layers is not supported")
    check_gamma("DraftModelDrafter", self.gamma)

  @classmethod
  def from_model(
    cls, model: target_lib.TargetModel, gamma: int = 4, tree: bool = False
  ) -> "DraftModelDrafter":
    return cls(gamma=gamma, params=model.params, config=model.config, tree=tree)

  def param_axes(self) -> Any:
    return target_lib.logical_axes(self.config)

  def for_tree(self, sampled_chain: bool = False) -> "DraftModelDrafter":
    return dataclasses.replace(self, tree=True, sampled_tree=sampled_chain)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def pending_block(self) -> int:
    """Committed tokens a propose may have to (re-)process: 2 after chains, γ+1 after trees."""
    return self.gamma + 1 if self.tree else 2

  def init_state(self, params: Any, batch: int, max_len: int) -> DraftModelState:
    del params
    return DraftModelState(
      DecodingState.create(self.config, batch, max_len), jnp.zeros((batch, self.gamma), jnp.int32)
    )

  def prefill(self, params: Any, state: DraftModelState, ctx: PrefillContext) -> DraftModelState:
    out = target_lib.apply_decoder(
      self.config,
      params,
      ctx.shifted_tokens(0),
      jnp.full_like(ctx.prompt_lens, ctx.first),
      state.cache,
      last_only=True,
    )
    return state.replace(cache=out.state.with_lengths(ctx.prompt_lens))

  def propose(
    self, params: Any, state: DraftModelState, ctx: ProposeContext
  ) -> tuple[Proposal, DraftModelState]:
    batch, max_len = ctx.tokens.shape
    # Pending committed tokens: slots valid..seq_len-1 (≥ 1: the root), padded to a fixed block.
    width = self.pending_block
    valid = jnp.clip(state.cache.lengths, ctx.seq_len - width, ctx.seq_len - 1)
    slots = jnp.minimum(valid[:, None] + jnp.arange(width)[None, :], max_len - 1)
    pending = jnp.take_along_axis(ctx.tokens, slots, axis=1)
    out = target_lib.apply_decoder(
      self.config,
      params,
      pending,
      valid,
      state.cache,
      logits_index=ctx.seq_len - 1 - valid,
    )
    first_logits = out.logits[:, 0]  # at the root
    keys = sampling.split_key(ctx.key, self.gamma)

    def draw(logits, key):
      """(token, q or None, tree log-probs or None) for one step."""
      lp = tree_logprobs(logits, ctx.sampling) if self.tree else None
      if self.tree and not self.sampled_tree:  # argmax chain for a top-k tree
        return sampling.argmax(logits), None, lp
      q = sampling.warped_probs(logits, ctx.sampling)
      return sampling.sample_from_probs(key, q), q, lp

    first = draw(first_logits, keys[0])

    def step(carry, key):
      cache, prev, pos = carry
      o = target_lib.apply_decoder(self.config, params, prev[:, None], pos, cache)
      drawn = draw(o.logits[:, 0], key)
      return (o.state, drawn[0], pos + 1), drawn

    (cache, _, _), rest = jax.lax.scan(step, (out.state, first[0], ctx.seq_len), keys[1:])
    stack = lambda a, b: jnp.concatenate([a[:, None], jnp.moveaxis(b, 0, 1)], axis=1)
    tokens, probs, logprobs = jax.tree.map(stack, first, rest)
    proposal = Proposal(tokens, probs, logprobs)
    # Valid now: everything up to the root; the chain slots are judged at commit.
    return proposal, DraftModelState(cache.with_lengths(ctx.seq_len), tokens)

  def commit(self, params: Any, state: DraftModelState, ctx: CommitContext) -> DraftModelState:
    del params
    batch, max_len = ctx.tokens.shape
    # Chain token i was fed at slot old_seq_len + i (i < γ-1); its KV stays valid while the
    # committed tokens agree with the chain up to it. Keep at least the new root pending.
    slots = jnp.minimum(ctx.old_seq_len[:, None] + jnp.arange(self.gamma)[None, :], max_len - 1)
    agree = sampling.leading_true_count(jnp.take_along_axis(ctx.tokens, slots, axis=1) == state.chain)
    fed = jnp.minimum(agree, self.gamma - 1)
    valid = jnp.minimum(ctx.old_seq_len + fed, ctx.seq_len - 1)
    return state.replace(cache=state.cache.with_lengths(valid))
