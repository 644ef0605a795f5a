"""OpenAI's logit adjustments, kept lossless under speculative sampling.

`logit_bias`, `presence_penalty`, `frequency_penalty` and the `repetition_penalty` extension
change the target's distribution at every position, and how depends on the text before it:
the penalties count the tokens generated so far. A verify block scores several positions in one
pass, each after a different prefix (in a chain, the drafts before it; in a tree, its
ancestors), so each position's logits are adjusted with the counts of its own prefix
(`Penalties.adjust` with `block_counts`). The verifier then accepts, resamples and draws the
bonus token from those adjusted distributions, so what a step emits is distributed exactly as
plain decoding from the adjusted target. The drafter proposes from its own distribution,
unadjusted: exactness needs only that the verifier knows the q it drew from.

Semantics, as OpenAI's and vLLM's:
  logit_bias: a value in [-100, 100] added to a token's raw logit.
  presence_penalty (in [-2, 2]): subtracted once from every token generated at least once.
  frequency_penalty (in [-2, 2]): subtracted once per time the token was generated.
  repetition_penalty (> 0, 1 = off; CTRL's, as Hugging Face and vLLM apply it): the logit of
    every token of the prompt or of the text generated so far is divided by it when positive
    and multiplied by it when negative.
Order: bias, repetition, presence and frequency; then temperature, top-k and top-p
(jaxspec/sampling.py). The engine's reported log-probs stay those of the raw distribution.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import flax.struct
import jax
import jax.numpy as jnp

# The most logit_bias entries one request may hold (OpenAI accepts up to 300).
MAX_LOGIT_BIAS = 300


@flax.struct.dataclass
class Penalties:
  """Per-row adjustments and what they count (a pytree; one row per sequence).

  Attributes:
    presence, frequency, repetition: [B] float32 (0, 0, 1: off).
    bias_ids: [B, N] int32 token ids of logit_bias (vocab size: unused entry).
    bias_values: [B, N] float32.
    counts: [B, V] int32: how often each token was generated so far.
    seen: [B, V] bool: tokens of the prompt or generated (the repetition penalty's set).
    enabled: static; False: nothing is adjusted and every array has one column (the engine
      was built without `EngineConfig.penalties`).
  """

  presence: jax.Array
  frequency: jax.Array
  repetition: jax.Array
  bias_ids: jax.Array
  bias_values: jax.Array
  counts: jax.Array
  seen: jax.Array
  enabled: bool = flax.struct.field(pytree_node=False, default=False)

  AXES: ClassVar[dict] = {
    "presence": ("batch",),
    "frequency": ("batch",),
    "repetition": ("batch",),
    "bias_ids": ("batch", None),
    "bias_values": ("batch", None),
    "counts": ("batch", None),
    "seen": ("batch", None),
  }

  @classmethod
  def create(
    cls,
    vocab: int,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
    prompts: jax.Array,
    prompt_len: jax.Array,
  ) -> "Penalties":
    """Rows whose prompts [B, L] (the first prompt_len [B] tokens of each) are seen."""
    batch, length = prompts.shape
    in_prompt = jnp.arange(length)[None, :] < prompt_len[:, None]
    seen = jnp.zeros((batch, vocab), bool)
    seen = seen.at[jnp.arange(batch)[:, None], jnp.where(in_prompt, prompts, vocab)].set(
      True, mode="drop"
    )
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return cls(
      f32(presence),
      f32(frequency),
      f32(repetition),
      jnp.asarray(bias_ids, jnp.int32),
      f32(bias_values),
      jnp.zeros((batch, vocab), jnp.int32),
      seen,
      True,
    )

  @classmethod
  def off(cls, batch: int) -> "Penalties":
    """No adjustment (one-column placeholders, so the state's structure does not change)."""
    zeros = lambda dtype: jnp.zeros((batch, 1), dtype)
    row = jnp.zeros((batch,), jnp.float32)
    ids, values = zeros(jnp.int32), zeros(jnp.float32)
    return cls(row, row, row + 1, ids, values, zeros(jnp.int32), zeros(bool))

  def adjust(self, logits: jax.Array, extra: Optional[jax.Array] = None) -> jax.Array:
    """logits [B, T, V] (or [B, V]) adjusted per row; `extra` [B, T, V] counts each position's
    prefix adds to the committed counts (`block_counts`; None: none)."""
    if not self.enabled:
      return logits
    flat = logits.ndim == 2
    x = (logits[:, None] if flat else logits).astype(jnp.float32)
    batch, _, vocab = x.shape
    bias = jnp.zeros((batch, vocab), jnp.float32)
    bias = bias.at[jnp.arange(batch)[:, None], self.bias_ids].add(self.bias_values, mode="drop")
    x = x + bias[:, None]
    counts = jnp.broadcast_to(self.counts[:, None], x.shape)
    if extra is not None:
      counts = counts + extra
    seen = self.seen[:, None] | (counts > 0)
    r = self.repetition[:, None, None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    x = x - self.presence[:, None, None] * (counts > 0) - self.frequency[:, None, None] * counts
    x = x.astype(logits.dtype)
    return x[:, 0] if flat else x

  def observe(self, tokens: jax.Array, keep: jax.Array) -> "Penalties":
    """The rows after generating tokens [B, N] where keep [B, N]."""
    if not self.enabled:
      return self
    vocab = self.counts.shape[1]
    rows = jnp.arange(tokens.shape[0])[:, None]
    ids = jnp.where(keep, tokens, vocab)
    counts = self.counts.at[rows, ids].add(1, mode="drop")
    return self.replace(counts=counts, seen=self.seen.at[rows, ids].set(True, mode="drop"))


def block_counts(tokens: jax.Array, vocab: int, mask: Optional[jax.Array] = None) -> jax.Array:
  """[B, T, V] int32: per block position j, how often each token occurs among the block's
  tokens 1..T−1 that precede j or are j (a chain: causally; a tree: `mask` [B?, T, T], j's
  ancestors and itself). Token 0, the root, is committed text already counted."""
  t = tokens.shape[1]
  if mask is None:
    mask = jnp.tril(jnp.ones((t, t), bool))
  mask = jnp.broadcast_to(mask, (tokens.shape[0], t, t)) & (jnp.arange(t) > 0)[None, None, :]
  one_hot = jax.nn.one_hot(tokens, vocab, dtype=jnp.int32)  # [B, T, V]
  return jnp.einsum("bij,bjv->biv", mask.astype(jnp.int32), one_hot)
