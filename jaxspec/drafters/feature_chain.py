"""The autoregressive feature chain: EAGLE-3 and MTP draft γ tokens from the last target feature.

Both drafters are one causal block over (token t_{i+1}, feature f_i) pairs at RoPE position i
that predicts t_{i+2}, with its own one-layer cache. They differ only in that block (EAGLE-3's
fused taps and own head over a draft vocabulary; MTP's target layer over the target's final
hidden) and in how their state names its parts; this module is the loop they share:

- `prefill`: entry i of a prompt chunk reads (f_i, t_{i+1}); the feature of each prompt's last
  position is kept as the chain's start.
- `propose`: step 0 reads (f_{n−1}, root) at position n−1 (n = seq_len − 1, the root's slot);
  step j reads the block's own previous output hidden beside draft j at position n−1+j. Each
  draft is drawn from the warped distribution q (`sample`, chain verification at T > 0) or is
  the argmax (`sample=False`: greedy drafters, and tree verification, where the chain follows
  the top-1 branch); every step also gives its `tree_logprobs` for the DDTree builder.
- `commit`: rewrites the entries of the verified block (exact for the committed positions, the
  rest lie past the committed prefix and are rewritten later) and keeps the feature just before
  the new root.

A drafter supplies `block(cache, tokens [B, T], features [B, T, H], start [B])` → (hidden
[B, T, H], logits [B, T, V_d], cache) and, with a reduced draft vocabulary, a `DraftVocab`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.drafters.base import CommitContext, PrefillContext, Proposal, ProposeContext

# block(cache, tokens [B, T], features [B, T, H], start [B]) → (hidden, logits [B, T, V_d], cache)
Block = Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, Any]]


class DraftVocab(NamedTuple):
  """How a drafter's reduced vocabulary maps into the target's.

  ids(draft_ids) → target ids; values(x [..., V_d], fill) → [..., V] with `fill` at target ids
  the draft vocabulary lacks.
  """

  ids: Callable[[jax.Array], jax.Array]
  values: Callable[[jax.Array, float], jax.Array]


def tree_logprobs(logits: jax.Array, params: sampling.SamplingParams) -> jax.Array:
  """Per-position draft log-probabilities for the tree builder: log_softmax(logits / T), with
  T = 1 for greedy rows and no top-k / top-p (the draft model's convention). logits [B, ..., V]."""
  temp = jnp.where(sampling.is_greedy(params), 1.0, params.temperature).astype(jnp.float32)
  temp = temp.reshape(temp.shape + (1,) * (logits.ndim - 1))
  return jax.nn.log_softmax(logits.astype(jnp.float32) / temp, axis=-1)


def draw(
  key: jax.Array, logits: jax.Array, params: sampling.SamplingParams, sample: bool
) -> tuple[jax.Array, Optional[jax.Array]]:
  """One draft token per row from logits [B, V]: (token, warped q) or (argmax, None)."""
  if not sample:
    return sampling.argmax(logits), None
  q = sampling.warped_probs(logits, params)
  return sampling.sample_from_probs(key, q), q


def prefill(
  block: Block, cache: Any, last: jax.Array, features: jax.Array, ctx: PrefillContext
) -> tuple[Any, jax.Array]:
  """Absorbs a prompt chunk's features [B, C, H]: (cache, feature at each prompt's last
  position, or `last` [B, H] where the chunk does not hold it)."""
  start = jnp.full(ctx.prompt_lens.shape, ctx.first)
  _, _, cache = block(cache, ctx.shifted_tokens(1), features, start)
  return cache, ctx.at_last(features, last)


def propose(
  block: Block,
  cache: Any,
  last: jax.Array,
  ctx: ProposeContext,
  gamma: int,
  sample: bool,
  vocab: Optional[DraftVocab] = None,
) -> tuple[Proposal, Any]:
  """γ chained draft steps from the root after feature `last` [B, H] → (Proposal, cache).

  The proposal's tokens and `logprobs` are in target ids (−inf outside a reduced draft
  vocabulary); `probs` (q over the target vocabulary) only when `sample`.
  """
  rows = jnp.arange(ctx.tokens.shape[0])
  root = ctx.tokens[rows, ctx.seq_len - 1]
  keys = sampling.split_key(ctx.key, gamma)

  def step(carry, key):
    cache, tok, hidden, pos = carry
    h, logits, cache = block(cache, tok[:, None], hidden[:, None], pos)
    logits = logits[:, 0].astype(jnp.float32)
    draft, q = draw(key, logits, ctx.sampling, sample)
    lp = tree_logprobs(logits, ctx.sampling)
    if vocab is not None:
      draft, lp = vocab.ids(draft), vocab.values(lp, -jnp.inf)
      q = None if q is None else vocab.values(q, 0.0)
    nxt = draft.astype(jnp.int32)
    out = (nxt, lp) + ((q,) if q is not None else ())
    return (cache, nxt, h[:, 0].astype(hidden.dtype), pos + 1), out

  init = (cache, root, last, ctx.seq_len - 2)
  (cache, _, _, _), outs = jax.lax.scan(step, init, keys)
  tokens = jnp.moveaxis(outs[0], 0, 1)
  logprobs = jnp.moveaxis(outs[1], 0, 1)
  probs = jnp.moveaxis(outs[2], 0, 1) if sample else None
  return Proposal(tokens, probs, logprobs), cache


def commit(
  block: Block,
  cache: Any,
  last: jax.Array,
  features: jax.Array,
  ctx: CommitContext,
  gamma: int,
) -> tuple[Any, jax.Array]:
  """Absorbs a verified block's features [B, γ+1, H] → (cache, feature before the new root).

  Entries start..start+γ−1 (start = the block's root slot) read (feature of block slot j,
  committed token at start+j+1); only the first num_accepted are exact, the rest lie past the
  committed prefix and are rewritten by later steps. The feature kept is block slot (new
  seq_len − old seq_len − 1), num_accepted unless the budget or a stop cut the block; rows that
  committed nothing (done) keep `last`.
  """
  b, max_len = ctx.tokens.shape
  start = ctx.old_seq_len - 1
  idx = jnp.minimum(start[:, None] + 1 + jnp.arange(gamma)[None, :], max_len - 1)
  tokens = jnp.take_along_axis(ctx.tokens, idx, axis=1)
  _, _, cache = block(cache, tokens, features[:, :gamma], start)
  count = ctx.seq_len - ctx.old_seq_len
  kept = features[jnp.arange(b), jnp.maximum(count - 1, 0)].astype(last.dtype)
  return cache, jnp.where((count > 0)[:, None], kept, last)
