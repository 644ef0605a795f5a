"""DeepSeek-style multi-token prediction (MTP) as a drafter: the target drafts for itself.

The target's MTP layer reads the target's final-normed hidden h_i beside the embedding of token
t_{i+1} ([enorm(emb); hnorm(h)] → eh_proj → one full decoder block → shared_head.norm → the
target's LM head) and predicts t_{i+2}. Its own KV cache holds one entry per position i, written
at RoPE position i (the convention of `jaxspec.train.losses`, which trained it).

Drafting γ tokens chains the layer (DeepSeek-V3 / vLLM reuse of the single released MTP layer):
step 0 reads (h_{n-1}, root) at position n-1, where n = seq_len - 1 is the root's slot; step j
reads the layer's own previous output hidden beside draft j at position n-1+j. The loop (prefill,
propose, commit) is `jaxspec.drafters.feature_chain`, shared with EAGLE-3; this module supplies
the MTP layer as its block.

State: the layer's decoding state (one segment of one layer; `lengths` = seq_len - 2, the exact
entries) and the target hidden of the slot just before the root. Cache invariant between steps: entries at positions < n-1 hold (target hidden h_i, true
token t_{i+1}); propose writes n-1 (exact) and scratch after it; commit rewrites the entries of
the newly committed positions from the verify pass's hidden states.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.drafters import feature_chain
from jaxspec.drafters.base import CommitContext, Drafter, PrefillContext, Proposal, ProposeContext
from jaxspec.drafters.base import check_gamma
from jaxspec.models import target as target_lib
from jaxspec.state import DecodingState


@flax.struct.dataclass
class MTPState:
  cache: DecodingState  # the MTP layer's own KV cache (one segment of one layer)
  last_hidden: jax.Array  # [B, H] target final-normed hidden at slot seq_len - 2

  AXES: ClassVar[dict] = {"last_hidden": ("batch", "embed")}  # the cache names its own


@dataclasses.dataclass(frozen=True)
class MTPDrafter(Drafter):
  """Chains the target's MTP layer `layer` for γ steps.

  config: the target's ModelConfig (the MTP block has the target's architecture).
  sample_drafts: at T > 0 draw each draft from the warped MTP distribution q (returned for
    lossless verification); False drafts the argmax (q one-hot), as greedy drafters do.
  Every proposal carries per-position `logprobs` (`feature_chain.tree_logprobs`); for tree
  verification (`for_tree`) the chain follows the argmax, so depth i's distribution is
  conditioned on the tree's top-1 branch.
  """

  config: ModelConfig = None  # type: ignore[assignment]
  gamma: int = 2
  layer: int = 0
  sample_drafts: bool = True
  prefill_reads_hidden: ClassVar[bool] = True

  def __post_init__(self):
    if self.config is None:
      raise ConfigError("MTPDrafter needs the target's ModelConfig")
    if self.config.num_mtp_layers < 1:
      raise ConfigError(
        f"{self.config.architecture}: the target has no MTP layers "
        f"(num_nextn_predict_layers = 0); the MTP drafter needs at least one"
      )
    if not 0 <= self.layer < self.config.num_mtp_layers:
      raise ConfigError(
        f"MTP layer {self.layer} out of range: the target has {self.config.num_mtp_layers}"
      )
    check_gamma("MTPDrafter", self.gamma)

  @classmethod
  def from_target(
    cls, target: target_lib.TargetModel, gamma: int = 2, layer: int = 0, sample_drafts: bool = True
  ) -> "MTPDrafter":
    """Shares the target's arrays (embedding, LM head, MTP layer): nothing is copied."""
    cfg = target.config
    if cfg.num_mtp_layers < 1:
      raise ConfigError(
        f"{cfg.architecture}: the target has no MTP layers "
        f"(num_nextn_predict_layers = 0); the MTP drafter needs at least one"
      )
    keys = ["embed", f"mtp_{layer}"] + ([] if cfg.tie_word_embeddings else ["lm_head"])
    missing = [k for k in keys if k not in target.params]
    if missing:
      raise ConfigError(f"target parameters lack {missing} needed by the MTP drafter")
    params = {k: target.params[k] for k in keys}
    return cls(gamma=gamma, params=params, config=cfg, layer=layer, sample_drafts=sample_drafts)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def param_axes(self) -> dict:
    """The target's own axes for the arrays it shares (embedding, LM head, MTP layer)."""
    axes = target_lib.logical_axes(self.config)
    return {k: axes[k] for k in self.params}

  def for_tree(self, sampled_chain: bool = False) -> "MTPDrafter":
    return dataclasses.replace(self, sample_drafts=sampled_chain)

  def _block(self, params: Any) -> feature_chain.Block:
    """The MTP layer as the chain's block: (cache, tokens, hidden, start) → (h, logits, cache)."""

    def block(cache, tokens, hidden, start):
      logits, h, cache = target_lib.apply_mtp(
        self.config, params, self.layer, tokens, hidden, start, cache
      )
      return h, logits, cache

    return block

  def init_state(self, params: Any, batch: int, max_len: int) -> MTPState:
    del params
    cache = DecodingState.create(self.config, batch, max_len, segment_layers=(1,))
    hidden = jnp.zeros((batch, self.config.hidden_size), jnp.dtype(self.config.dtype))
    return MTPState(cache, hidden)

  def prefill(self, params: Any, state: MTPState, ctx: PrefillContext) -> MTPState:
    # Entry i reads (h_i, t_{i+1}); t_P is the first sampled token (already in the buffer).
    cache, last = feature_chain.prefill(
      self._block(params), state.cache, state.last_hidden, ctx.hidden, ctx
    )
    return MTPState(cache.with_lengths(ctx.prompt_lens - 1), last)

  def propose(self, params: Any, state: MTPState, ctx: ProposeContext) -> tuple[Proposal, MTPState]:
    proposal, cache = feature_chain.propose(
      self._block(params), state.cache, state.last_hidden, ctx, self.gamma, self.sample_drafts
    )
    return proposal, state.replace(cache=cache)

  def commit(self, params: Any, state: MTPState, ctx: CommitContext) -> MTPState:
    cache, last = feature_chain.commit(
      self._block(params), state.cache, state.last_hidden, ctx.hidden, ctx, self.gamma
    )
    return MTPState(cache.with_lengths(ctx.seq_len - 2), last)
