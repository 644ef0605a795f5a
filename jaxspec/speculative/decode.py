"""Prefill: the padded prompts through the target, the state the first step starts from.

Prompts of different lengths share one padded batch: sequence b's prompt occupies slots
0..len_b-1 and its first new token is sampled from the logits at len_b-1. Plain decoding is the
engine without a drafter (`SpecEngine(target, None, ...)`): one loop serves every method.
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
  no later query can see (they are at or past the committed length until overwritten).
  """
  out = target_lib.apply_decoder(
    config,
    params,
    prompts,
    jnp.zeros_like(prompt_lens),
    state,
    taps=taps,
    logits_index=prompt_lens - 1,
  )
  return out.logits[:, 0], out.state.with_lengths(prompt_lens), out.taps, out.hidden
