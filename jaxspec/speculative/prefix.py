"""Prompt prefixes cached in pages, the device side (the host side: serve/pages.py).

With paged K/V and `EngineConfig(prefix_cache=True)`, a server keeps the full pages of the
prompts it has prefilled, and a request whose prompt starts with cached pages prefills only
the rest:

- the target reads the cached pages' K/V from the pool (`DecodingState.load_pages`), and its
  prefill continues after them;
- the drafter absorbs the cached prefix from the target features that the first request's
  prefill produced. The state keeps them in pages beside the K/V (`SpecState.prefix_features`:
  each position's taps, and its final hidden state where the drafter's prefill reads it). A
  drafter's state after a cache hit is therefore what a full prefill gives: the prefix is
  cached consistently, not rebuilt. A draft model or n-gram drafter reads only tokens and
  keeps no features.

A target whose decoding state is not all in pages (sliding-window rings, Gated DeltaNet
recurrences) cannot use it: a cached page would not hold its prefix state
(`why_uncacheable`). Full-attention K/V, MLA latents and DSA indexer keys are all paged.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.drafters.base import Drafter, PrefillContext
from jaxspec.state import DecodingState, Paging
from jaxspec.state.paged import copy_pages, page_slots

FEATURE_AXES = ("pages", None, None)  # SpecState.prefix_features [P, page_size, F]


@flax.struct.dataclass
class CachedPrefix:
  """Where a prefill finds the first pages of its prompt: the engine's pool.

  Attributes:
    state: the engine's target DecodingState (only its page pools are read).
    features: the engine's `SpecState.prefix_features` [P, page_size, F].
    pages: int32 [W]: the pool page of each of the prompt's first logical pages; entries from
      `count` on are P (none).
    count: int32 scalar: how many leading pages are cached.
  """

  state: DecodingState
  features: jax.Array
  pages: jax.Array
  count: jax.Array


def why_uncacheable(config: Any, max_len: int, kv_format: str, page_size: int) -> Optional[str]:
  """Why a target (its ModelConfig) cannot cache prompt prefixes in pages of `page_size`, or
  None if it can: every entry of its paged decoding state must be in pages (`paged_part`)."""
  state = jax.eval_shape(
    lambda: DecodingState.create(config, 1, max_len, kv_format, paging=Paging(page_size))
  )
  others = sorted({s.format for s in state.segments if s.paged_part is None})
  if not others:
    return None
  return (
    f"the target keeps state that pages cannot hold ({', '.join(others)}); prefix caching "
    "needs every layer's state in pages"
  )


def feature_width(drafter: Optional[Drafter], hidden_size: int) -> int:
  """Values kept per cached position for `drafter`'s prefill (0: it reads only tokens)."""
  if drafter is None:
    return 0
  return (len(drafter.taps) + int(drafter.prefill_reads_hidden)) * hidden_size


def empty_features(num_pages: int, page_size: int, width: int, dtype: Any) -> jax.Array:
  """A zero feature pool [num_pages, page_size, width] (width 0: nothing is kept)."""
  return jnp.zeros((num_pages, page_size, width), dtype)


def pack(drafter: Drafter, taps: Optional[jax.Array], hidden: jax.Array) -> jax.Array:
  """A chunk's taps [n, B, C, H] and hidden [B, C, H] as kept per position: [B, C, F]."""
  b, c, h = hidden.shape
  parts = []
  if drafter.taps:
    parts.append(jnp.moveaxis(taps, 0, 2).reshape(b, c, len(drafter.taps) * h))
  if drafter.prefill_reads_hidden:
    parts.append(hidden)
  return jnp.concatenate(parts, axis=-1)


def unpack(
  drafter: Drafter, feats: jax.Array, hidden_size: int
) -> tuple[Optional[jax.Array], jax.Array]:
  """`pack`'s inverse: (taps [n, B, C, H] or None, hidden [B, C, H]; zeros when not kept)."""
  b, c, _ = feats.shape
  n = len(drafter.taps)
  taps = None
  if n:
    taps = jnp.moveaxis(feats[..., : n * hidden_size].reshape(b, c, n, hidden_size), 2, 0)
  hidden = jnp.zeros((b, c, hidden_size), feats.dtype)
  if drafter.prefill_reads_hidden:
    hidden = feats[..., n * hidden_size :]
  return taps, hidden


def write(features: jax.Array, table: jax.Array, start: jax.Array, values: jax.Array):
  """features [P, page, F] with positions start..start+C−1 of each row (through its page
  table [B, W]) ← values [B, C, F]; positions past the table, or on unmapped pages, dropped."""
  page_size = features.shape[1]
  b, c, _ = values.shape
  slots = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))
  pages, offsets = page_slots(table, slots, page_size)
  pages = jnp.where(slots < table.shape[1] * page_size, pages, features.shape[0])
  return features.at[pages, offsets].set(values.astype(features.dtype), mode="drop")


def adopt(
  features: jax.Array, slot_table: jax.Array, row_features: jax.Array, row_table: jax.Array
) -> jax.Array:
  """A one-row state's feature pages (its table row_table [W]) copied to the pages of a slot
  (slot_table [W]); pages the row does not map (cached ones it only read) are not copied."""
  return copy_pages(features, slot_table, row_features, row_table, axis=0)


def absorb(
  drafter: Drafter,
  params: Any,
  state: Any,
  tokens: jax.Array,
  prompt_lens: jax.Array,
  prefix: CachedPrefix,
  page_size: int,
  hidden_size: int,
) -> Any:
  """The drafter's prefill over the cached pages, one page at a time, from the kept features
  (the same calls a full prefill makes, in page-sized chunks)."""
  rows = tokens.shape[0]

  def body(j, drafter_state):
    page = jnp.take(prefix.features, prefix.pages[j], axis=0, mode="clip")  # [page, F]
    feats = jnp.broadcast_to(page[None], (rows, *page.shape))
    taps, hidden = unpack(drafter, feats, hidden_size)
    ctx = PrefillContext(tokens, prompt_lens, taps, hidden, j * page_size)
    return drafter.prefill(params, drafter_state, ctx)

  return jax.lax.fori_loop(0, prefix.count, body, state)


def hide_cached(state: DecodingState, count: jax.Array) -> DecodingState:
  """The rows' first `count` logical pages unmapped: a one-row state that only read them
  (cached) does not copy them back when it is inserted (`PagedKV.adopt_row`)."""
  table = state.page_table
  cached = jnp.arange(table.shape[1], dtype=jnp.int32)[None] < count
  return state.with_page_table(jnp.where(cached, state.unmapped_page, table))
