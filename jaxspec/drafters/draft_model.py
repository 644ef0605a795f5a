"""Classic speculative sampling's drafter: an independent small LM with its own KV cache.

Each step it runs γ autoregressive forwards inside the jitted step (a `lax.scan`), sampling every
draft token from its warped distribution q (same temperature/top-k/top-p as the target) and
returning q for lossless verification.

Cache bookkeeping needs no state beyond the cache itself: every propose re-runs the last two
committed tokens (slots seq_len-2, seq_len-1). After any verify outcome, the draft KV of every
slot before seq_len-2 belongs to committed tokens: the drafts it wrote for accepted tokens are
those tokens, and at most the correction and one accepted draft (after a full accept) are new.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Drafter, PrefillContext, Proposal, ProposeContext
from jaxspec.models import target as target_lib
from jaxspec.spec import sampling


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(Drafter):
  """A small causal LM (any supported architecture) drafting γ tokens per step."""

  config: ModelConfig = None  # type: ignore[assignment]
  gamma: int = 4

  def __post_init__(self):
    if self.config is None:
      raise ValueError("DraftModelDrafter needs the draft model's ModelConfig")
    if self.gamma < 1:
      raise ValueError(f"DraftModelDrafter needs gamma >= 1, got {self.gamma}")

  @classmethod
  def from_model(cls, model: target_lib.TargetModel, gamma: int = 4) -> "DraftModelDrafter":
    return cls(gamma=gamma, params=model.params, config=model.config)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def init_state(self, params: Any, batch: int, max_len: int) -> KVCache:
    del params
    return KVCache.for_model(self.config, batch, max_len)

  def prefill(self, params: Any, state: KVCache, ctx: PrefillContext) -> KVCache:
    prompts = ctx.tokens[:, :ctx.hidden.shape[1]]
    out = target_lib.apply_decoder(self.config, params, prompts, jnp.zeros_like(ctx.prompt_lens),
                                   state.k, state.v, last_only=True)
    return KVCache(out.cache_k, out.cache_v, ctx.prompt_lens)

  def propose(self, params: Any, state: KVCache,
              ctx: ProposeContext) -> tuple[Proposal, KVCache]:
    rows = jnp.arange(ctx.tokens.shape[0])
    start = ctx.seq_len - 2
    last_two = jnp.stack([ctx.tokens[rows, start], ctx.tokens[rows, start + 1]], axis=1)
    out = target_lib.apply_decoder(self.config, params, last_two, start, state.k, state.v,
                                   last_only=True)
    keys = jax.random.split(ctx.key, self.gamma)

    def draw(logits, key):
      q = sampling.warped_probs(logits, ctx.sampling)
      return sampling.sample_from_probs(key, q), q

    tok, q = draw(out.logits[:, 0], keys[0])

    def step(carry, key):
      cache_k, cache_v, prev, pos = carry
      o = target_lib.apply_decoder(self.config, params, prev[:, None], pos, cache_k, cache_v)
      nxt, qn = draw(o.logits[:, 0], key)
      return (o.cache_k, o.cache_v, nxt, pos + 1), (nxt, qn)

    (cache_k, cache_v, _, _), (toks, qs) = jax.lax.scan(
        step, (out.cache_k, out.cache_v, tok, ctx.seq_len), keys[1:])
    tokens = jnp.concatenate([tok[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)
    probs = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return Proposal(tokens, probs), KVCache(cache_k, cache_v, ctx.seq_len - 1)
