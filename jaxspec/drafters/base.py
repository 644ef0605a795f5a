"""The Drafter protocol: the one interface between every drafter and the engine's loop.

A drafter is a frozen, hashable description (static under jit) plus a parameter pytree passed
to it explicitly; its caches live in a `state` pytree that the engine threads through the step.

  taps                         target layers whose outputs the drafter consumes (HF
                               hidden_states[i + 1]); () for draft models and n-grams
  prefill_reads_hidden         whether `prefill` reads the target's final hidden states (a
                               prompt prefix cached in pages keeps what prefill reads)
  init_state(params, b, L)     its caches for batch b and max length L
  prefill(params, state, ctx)  absorb one chunk of the prompt (and its target features) after the
                               target has prefilled it; called once per chunk, in order
  propose(params, state, ctx)  → (Proposal, state): γ chain tokens with their draft
                               probabilities, or per-position log-probs for the tree builder
                               (ctx also carries the target's decoding state, for drafters
                               that read its K/V)
  commit(params, state, ctx)   absorb what the target accepted this step
  for_tree(sampled_chain)      the drafter configured for tree verification: its proposals
                               carry per-position `logprobs` (default: itself); with
                               sampled_chain, a chain drafter samples its chain at T > 0 (and
                               returns its q) instead of following the argmax
  param_axes()                 logical axes of `params`, for placing them on a device mesh
                               (default None: replicated); its state's arrays are named by
                               `AXES` tables on the state structs (jaxspec/state/)

Sequence bookkeeping shared by all of them: `tokens[b, :seq_len[b]]` is the committed text; its
last token (the root of the next draft) is sampled but not yet in the target's KV cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.errors import ConfigError
from jaxspec.sampling import SamplingParams


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
  """After the target has prefilled one chunk of the prompts: positions start..start+C-1.

  tokens: [B, L] buffer holding the whole prompts, and the first sampled token at prompt_lens
    once the chunk holding a prompt's last position has run (so a chunk's next-token view,
    `shifted_tokens`, is complete).
  prompt_lens: [B] prompt lengths (the target cache holds these many entries at the end).
  taps: [n_taps, B, C, H] target features of the chunk's positions (None without taps).
  hidden: [B, C, H] the target's final-normed hidden states of the chunk's positions.
  start: scalar int32, the chunk's first position (None = 0: the whole prompt in one chunk).
  Positions at or past a prompt's length are padding: a drafter must not let them displace
  anything (a ring store writes only positions < prompt_lens).
  """

  tokens: jax.Array
  prompt_lens: jax.Array
  taps: Optional[jax.Array]
  hidden: jax.Array
  start: Optional[jax.Array] = None

  @property
  def first(self) -> jax.Array:
    """The chunk's first position (int32 scalar)."""
    return jnp.int32(0) if self.start is None else jnp.asarray(self.start, jnp.int32)

  @property
  def size(self) -> int:
    return self.hidden.shape[1]

  def positions(self) -> jax.Array:
    """[B, C] positions of the chunk."""
    b, c = self.hidden.shape[:2]
    return jnp.broadcast_to(self.first + jnp.arange(c, dtype=jnp.int32)[None], (b, c))

  def shifted_tokens(self, shift: int = 0) -> jax.Array:
    """[B, C] tokens at the chunk's positions + shift (shift 1: each position's next token)."""
    idx = jnp.minimum(self.positions() + shift, self.tokens.shape[1] - 1)
    return jnp.take_along_axis(self.tokens, idx, axis=1)

  def at_last(self, values: jax.Array, previous: jax.Array) -> jax.Array:
    """values [B, C, ...] at each prompt's last position where the chunk holds it, else
    `previous` [B, ...]."""
    last = self.prompt_lens - 1 - self.first
    inside = (last >= 0) & (last < self.size)
    picked = values[jnp.arange(values.shape[0]), jnp.clip(last, 0, self.size - 1)]
    inside = inside.reshape(inside.shape + (1,) * (picked.ndim - 1))
    return jnp.where(inside, picked.astype(previous.dtype), previous)


@flax.struct.dataclass
class ProposeContext:
  """Before a verify pass. seq_len[b] counts tokens including the root (tokens[seq_len-1]).

  target_state: the target's decoding state, holding every position before the root (read by
  drafters that attend to the target's K/V: the Gemma 4 assistant), or None.
  """

  tokens: jax.Array
  seq_len: jax.Array
  sampling: SamplingParams
  key: jax.Array
  target_state: Any = None


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
  # Sampled trees' acceptance model measured for this drafter and its target
  # (`verifiers.TreeOptions.acceptance`; `tree_acceptance.json` beside its checkpoint).
  tree_acceptance: Optional[tuple] = dataclasses.field(default=None, repr=False)

  @property
  def taps(self) -> tuple[int, ...]:
    return ()

  # Whether `prefill` reads `PrefillContext.hidden` (MTP heads, assistants): a cached prompt
  # prefix then keeps each position's hidden state beside its taps (speculative/prefix.py).
  prefill_reads_hidden: ClassVar[bool] = False
  # Whether a step may skip `propose` (no speculation that step: EngineConfig(speculation=
  # "auto")) and still `commit`: False for a drafter whose proposal catches its state up.
  can_skip_proposals: ClassVar[bool] = True

  @property
  def name(self) -> str:
    return type(self).__name__

  @property
  def vocab_size(self) -> Optional[int]:
    """Vocabulary the drafter proposes in (None = any, e.g. n-grams)."""
    return None

  def for_tree(self, sampled_chain: bool = False) -> "Drafter":
    """This drafter set up for tree verification (`EngineConfig(verify="tree")`).

    Tree verification builds its tree from `Proposal.logprobs`; a drafter that fills them only
    on request (a draft model following its argmax chain) returns a reconfigured copy here.
    Afterwards its commit receives the accepted path, which may leave its own chain.

    sampled_chain: the tree's children are sampled (the "recursive" rule): a drafter whose
    depth-i distribution depends on its own earlier drafts should sample its chain from q at
    T > 0 rows and return q in `Proposal.probs` (greedy rows still follow the argmax), so that
    each depth's q is conditioned on the tree's first branch. Without it the chain follows the
    argmax, the branch a top-k tree is built around.
    """
    del sampled_chain
    return self

  def param_axes(self) -> Any:
    """Logical axes of `params`: a tree of logical `PartitionSpec`s with its structure (as
    `nn.get_partition_spec` gives), which `SpecEngine(mesh=...)` places them by; None
    replicates them all (fine for a drafter small beside the target). Arrays the drafter shares
    with the target take the target's placement whatever this says."""
    return None

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
