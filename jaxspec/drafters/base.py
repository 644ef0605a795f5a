"""The Drafter protocol: the one interface between every drafter and the engine's loop.

A drafter is a frozen, hashable description (static under jit) plus a parameter pytree passed
to it explicitly; its caches live in a `state` pytree that the engine threads through the step.

  taps                         target layers whose outputs the drafter consumes (HF
                               hidden_states[i + 1]); () for draft models and n-grams
  init_state(params, b, L)     its caches for batch b and max length L
  prefill(params, state, ctx)  absorb the prompt (and its target features) after target prefill
  propose(params, state, ctx)  → (Proposal, state): γ chain tokens with their draft
                               probabilities, or per-position log-probs for the tree builder
  commit(params, state, ctx)   absorb what the target accepted this step
  for_tree()                   the drafter configured for tree verification: its proposals
                               carry per-position `logprobs` (default: itself)

Sequence bookkeeping shared by all of them: `tokens[b, :seq_len[b]]` is the committed text; its
last token (the root of the next draft) is sampled but not yet in the target's KV cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax

from jaxspec.errors import ConfigError
from jaxspec.speculative.sampling import SamplingParams


@flax.struct.dataclass
class Proposal:
  """What a drafter proposes for one step.

  tokens: [B, γ] int32 draft chain (for tree drafters: the top-1 chain).
  probs: [B, γ, V] float32 warped draft probabilities q the tokens were sampled from, or None
    for a deterministic drafter (q is one-hot at the token).
  logprobs: [B, γ, V] float32 per-position draft log-probabilities (position i predicts the
    token at depth i+1), for the tree builder; None when the drafter gives no distribution.
  """

  tokens: jax.Array
  probs: Optional[jax.Array] = None
  logprobs: Optional[jax.Array] = None


@flax.struct.dataclass
class PrefillContext:
  """After the target's prefill.

  tokens: [B, L] buffer holding the prompts (and the first sampled token at prompt_lens).
  prompt_lens: [B] prompt lengths (the target cache holds these many entries).
  taps: [n_taps, B, P, H] target features of the prompt positions (None without taps).
  hidden: [B, P, H] the target's final-normed hidden states of the prompt positions.
  """

  tokens: jax.Array
  prompt_lens: jax.Array
  taps: Optional[jax.Array]
  hidden: jax.Array


@flax.struct.dataclass
class ProposeContext:
  """Before a verify pass. seq_len[b] counts tokens including the root (tokens[seq_len-1])."""

  tokens: jax.Array
  seq_len: jax.Array
  sampling: SamplingParams
  key: jax.Array


@flax.struct.dataclass
class CommitContext:
  """After a verify pass.

  tokens: [B, L] buffer with the newly committed tokens written.
  old_seq_len: [B] seq_len before this step (the block started at slot old_seq_len - 1).
  num_accepted: [B] drafts accepted (0..γ); the tokens at old_seq_len..old_seq_len+n-1 are the
    accepted drafts, the next one is the target's correction/bonus (the new root).
  seq_len: [B] new seq_len.
  taps: [n_taps, B, γ+1, H] target features of the verified block (slot j ↔ block token j;
    slots 0..n are committed) or None.
  hidden: [B, γ+1, H] final-normed target hidden states of the block.
  After a tree step the block is the accepted root→leaf path: taps and hidden are gathered
  along it, so slot j still holds the j-th token in committed order.
  """

  tokens: jax.Array
  old_seq_len: jax.Array
  num_accepted: jax.Array
  seq_len: jax.Array
  taps: Optional[jax.Array]
  hidden: jax.Array


def check_gamma(owner: str, gamma: Any, most: Optional[int] = None, why: str = "") -> None:
  """Raises ConfigError unless `gamma` (drafts per step) is an integer in [1, most]."""
  ok = isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 1
  if not ok:
    raise ConfigError(f"{owner} needs gamma (drafts per step) to be an integer ≥ 1, got {gamma!r}")
  if most is not None and gamma > most:
    raise ConfigError(f"{owner}: gamma={gamma} is more than {most}{why}")


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class: a static drafter description. Subclasses override the four methods.

  `params` holds the drafter's weights; it is excluded from equality and hashing so that the
  drafter itself can be a static jit argument while the weights are traced.
  """

  gamma: int
  params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

  @property
  def taps(self) -> tuple[int, ...]:
    return ()

  @property
  def name(self) -> str:
    return type(self).__name__

  @property
  def vocab_size(self) -> Optional[int]:
    """Vocabulary the drafter proposes in (None = any, e.g. n-grams)."""
    return None

  def for_tree(self) -> "Drafter":
    """This drafter set up for tree verification (`EngineConfig(verify="tree")`).

    Tree verification builds its tree from `Proposal.logprobs`; a drafter that fills them only
    on request (a draft model following its argmax chain) returns a reconfigured copy here.
    Afterwards its commit receives the accepted path, which may leave its own chain.
    """
    return self

  def init_state(self, params: Any, batch: int, max_len: int) -> Any:
    del params, batch, max_len
    return ()

  def prefill(self, params: Any, state: Any, ctx: PrefillContext) -> Any:
    del params, ctx
    return state

  def propose(self, params: Any, state: Any, ctx: ProposeContext) -> tuple[Proposal, Any]:
    raise NotImplementedError

  def commit(self, params: Any, state: Any, ctx: CommitContext) -> Any:
    del params, ctx
    return state
