"""Prefill: the padded prompts through the target, the state the first step starts from.

Prompts of different lengths share one padded batch: sequence b's prompt occupies slots
0..len_b-1 and its first new token is sampled from the logits at len_b-1. Plain decoding is the
engine without a drafter (`SpecEngine(target, None, ...)`): one loop serves every method.

A long prompt is prefilled chunk by chunk (`prefill_chunk`): each chunk of C positions is
written into the decoding state and attends to the chunks before it, so activations, logits
and tap features are bounded by C whatever the prompt length.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.models import target as target_lib
from jaxspec.state import DecodingState


def prefill(
  config: ModelConfig,
  params: Any,
  prompts: jax.Array,
  prompt_lens: jax.Array,
  state: DecodingState,
  taps: tuple[int, ...] = (),
):
  """Runs the padded prompts [B, P]; returns (last-position logits [B, V], state, taps, hidden).

  The state's lengths become prompt_lens. Positions past a prompt's end hold padding K/V that
  no later query can see (they are at or past the committed length until overwritten), and
  never enter a linear-attention layer's recurrent state (`valid`).
  """
  out = target_lib.apply_decoder(
    config,
    params,
    prompts,
    jnp.zeros_like(prompt_lens),
    state,
    taps=taps,
    logits_index=prompt_lens - 1,
    valid=prompt_lens,
  )
  return out.logits[:, 0], out.state.with_lengths(prompt_lens), out.taps, out.hidden


def chunk_tokens(tokens: jax.Array, start: jax.Array, size: int) -> jax.Array:
  """tokens[:, start:start+size] of a [B, L] buffer; positions past L read the last slot (they
  are padding whose K/V writes are dropped)."""
  idx = jnp.minimum(start + jnp.arange(size, dtype=jnp.int32), tokens.shape[1] - 1)
  return jnp.take(tokens, idx, axis=1)


def prefill_chunk(
  config: ModelConfig,
  params: Any,
  tokens: jax.Array,
  start: jax.Array,
  size: int,
  prompt_lens: jax.Array,
  state: DecodingState,
  taps: tuple[int, ...] = (),
):
  """Positions start..start+size-1 of the prompts in `tokens` [B, L] through the target.

  Returns (logits [B, V] at each prompt's last position, in_chunk [B] (whether that position
  is in this chunk; the logits are meaningful only there), state, taps [n, B, size, H], hidden
  [B, size, H]). The state's lengths are left as they are; set them once the last chunk is in.
  """
  last = prompt_lens - 1 - start
  out = target_lib.apply_decoder(
    config,
    params,
    chunk_tokens(tokens, start, size),
    jnp.full_like(prompt_lens, start),
    state,
    taps=taps,
    logits_index=jnp.clip(last, 0, size - 1),
    valid=jnp.clip(prompt_lens - start, 0, size),
  )
  in_chunk = (last >= 0) & (last < size)
  return out.logits[:, 0], in_chunk, out.state, out.taps, out.hidden
