"""Prefill and plain autoregressive decoding as one on-device `lax.while_loop`.

This is the baseline every speculative method is measured against, and the reference that
greedy speculation must reproduce token for token. Prompts of different lengths share one padded
batch: sequence b's prompt occupies slots 0..len_b-1, its first new token is sampled from the
logits at len_b-1, and every later token is written at slot len_b + i.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import target as target_lib
from jaxspec.spec import sampling


class DecodeResult(NamedTuple):
  tokens: jax.Array  # [B, max_len]: prompt followed by generated tokens
  lengths: jax.Array  # [B]: prompt + generated tokens (stop token included)
  num_generated: jax.Array  # [B]
  cache: KVCache


def prefill(
  config: ModelConfig,
  params: Any,
  prompts: jax.Array,
  prompt_lens: jax.Array,
  cache: KVCache,
  taps: tuple[int, ...] = (),
):
  """Runs the padded prompts [B, P]; returns (last-position logits [B, V], cache, taps, hidden).

  The cache's lengths become prompt_lens. Positions past a prompt's end hold padding K/V that
  no later query can see (they are at or past the committed length until overwritten).
  """
  out = target_lib.apply_decoder(
    config,
    params,
    prompts,
    jnp.zeros_like(prompt_lens),
    cache.k,
    cache.v,
    taps=taps,
    logits_index=prompt_lens - 1,
  )
  last = out.logits[:, 0]
  cache = KVCache(out.cache_k, out.cache_v, prompt_lens.astype(jnp.int32))
  return last, cache, out.taps, out.hidden


@functools.partial(
  jax.jit, static_argnames=("config", "max_new_tokens"), donate_argnames=("cache",)
)
def generate_plain(
  config: ModelConfig,
  params: Any,
  prompts: jax.Array,
  prompt_lens: jax.Array,
  cache: KVCache,
  max_new_tokens: int,
  params_sampling: sampling.SamplingParams,
  key: jax.Array,
  stop_ids: jax.Array,
) -> DecodeResult:
  """Plain decoding of up to max_new_tokens per sequence, stopping at any of stop_ids [n]."""
  b, p = prompts.shape
  max_len = cache.max_len
  tokens = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(prompts)
  logits, cache, _, _ = prefill(config, params, prompts, prompt_lens, cache)

  def is_stop(tok):
    return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

  key, sub = jax.random.split(key)
  first = sampling.sample(sub, logits, params_sampling)
  rows = jnp.arange(b)
  tokens = tokens.at[rows, prompt_lens].set(first)
  done = is_stop(first) | (max_new_tokens <= 1)
  state = (tokens, cache, first, jnp.ones((b,), jnp.int32), done, key)

  def cond(state):
    return ~jnp.all(state[4])

  def body(state):
    tokens, cache, last, count, done, key = state
    out = target_lib.apply_decoder(config, params, last[:, None], cache.lengths, cache.k, cache.v)
    key, sub = jax.random.split(key)
    nxt = sampling.sample(sub, out.logits[:, 0], params_sampling)
    active = ~done
    nxt = jnp.where(active, nxt, last)
    lengths = cache.lengths + active.astype(jnp.int32)
    tokens = tokens.at[rows, jnp.where(active, lengths, max_len)].set(nxt, mode="drop")
    count = count + active.astype(jnp.int32)
    done = done | is_stop(nxt) | (count >= max_new_tokens)
    cache = KVCache(out.cache_k, out.cache_v, lengths)
    return tokens, cache, nxt, count, done, key

  tokens, cache, _, count, _, _ = jax.lax.while_loop(cond, body, state)
  return DecodeResult(tokens, prompt_lens + count, count, cache)
