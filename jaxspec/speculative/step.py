"""The compiled program of the engine: state, prefill, step, loop, row operations, read-back.

`SpecState` holds everything a generation needs (token buffer, lengths, the target's decoding
state (jaxspec/state/), the drafter's state, per-row keys, stop ids and sampling parameters,
stop flags, statistics) as one pytree. Every function here is pure and jit-able with static
shapes; jaxspec/speculative/engine.py jits them once per shape bucket and donates the state.

Reading order:
  prefill   the prompts through the target chunk by chunk, the first token, the drafter's prefill;
  step      draft → verify → accept → commit for every row that is not done, where a verifier
            (jaxspec/speculative/verifiers.py: plain, chain or tree) answers how the block is
            built, what is accepted and what the decoding state commits;
  run_loop  `step` in a `lax.while_loop`, no host round trip;
  insert_row / evict_rows   slots that come and go (continuous batching);
  recent    what a loop chunk produced, per row, in a fixed-size window (a server's read-back).

A long prompt is prefilled `chunk` positions at a time: each chunk is written into the decoding
state and attends to the chunks before it, so activations, logits and tap features are bounded
by the chunk whatever the prompt length.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec import sampling
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import CommitContext, Drafter, PrefillContext, ProposeContext
from jaxspec.models import target as target_lib
from jaxspec.penalties import Penalties, block_counts
from jaxspec.speculative import metrics, verifiers
from jaxspec.speculative import prefix as prefix_lib
from jaxspec.speculative.placement import laid_out
from jaxspec.speculative.verifiers import Accepted, Verifier
from jaxspec.state import DEFAULT_SLACK, ROW_AXES, DecodingState, Paging, logical_axes


@flax.struct.dataclass
class SpecState:
  """The whole generation state (a pytree; donated to the jitted step)."""

  tokens: jax.Array  # [B, L] committed tokens; tokens[b, seq_len[b]-1] is the root
  seq_len: jax.Array  # [B]
  prompt_len: jax.Array  # [B]
  max_new: jax.Array  # [B] generation budget per sequence
  target_state: DecodingState  # the target's decoding state for tokens[:, :seq_len-1]
  drafter_state: Any
  keys: jax.Array  # [B, 2] uint32 row keys (sampling.row_keys): row b draws from its own
  done: jax.Array  # [B] bool
  sampling: sampling.SamplingParams
  stop_ids: jax.Array  # [B, max_stop_ids] int32 per row, -1 padded
  stats: metrics.SpecStats
  penalties: Penalties  # per-row logit adjustments and their token counts (jaxspec/penalties.py)
  # [B, L] float32: the target's log-probability (raw distribution: temperature 1, no top-k/p)
  # of each generated token at its slot; 0 at prompt slots.
  logprobs: jax.Array
  # [B, L, K]: the K most likely tokens of the raw distribution each generated token was drawn
  # at, and their log-probs (EngineConfig.top_logprobs = K; [B, 1, 1] zeros when 0).
  top_ids: jax.Array
  top_logprobs: jax.Array
  # [P, page_size, F]: per position of each pool page, the target features a drafter's prefill
  # reads, kept for cached prompt prefixes (speculative/prefix.py; F = 0 when not kept).
  prefix_features: jax.Array

  # Logical axes (jaxspec.state.logical_axes); the target's and drafter's states name their own,
  # sampling parameters and statistics are split by rows.
  AXES: ClassVar[dict] = {
    "tokens": ("batch", "length"),
    "seq_len": ROW_AXES,
    "prompt_len": ROW_AXES,
    "max_new": ROW_AXES,
    "keys": ("batch", None),
    "done": ROW_AXES,
    "stop_ids": ("batch", None),
    "logprobs": ("batch", "length"),
    "top_ids": ("batch", "length", None),
    "top_logprobs": ("batch", "length", None),
    "prefix_features": prefix_lib.FEATURE_AXES,
  }

  @property
  def num_generated(self) -> jax.Array:
    return self.seq_len - self.prompt_len


def is_stop(tok: jax.Array, stop_ids: jax.Array) -> jax.Array:
  """tok [B, ...] against each row's stop ids [B, S] → bool [B, ...]."""
  per_row = stop_ids.reshape(stop_ids.shape[0], *([1] * (tok.ndim - 1)), stop_ids.shape[-1])
  return jnp.any(tok[..., None] == per_row, axis=-1)


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k most likely tokens of log softmax(logits [..., V]) and their log-probs [..., k]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  values, ids = jax.lax.top_k(logp, k)
  return ids.astype(jnp.int32), values


def _top_buffers(batch: int, max_len: int, k: int) -> tuple[jax.Array, jax.Array]:
  shape = (batch, max_len, k) if k else (batch, 1, 1)
  return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)


def _keeps_top(state: "SpecState") -> bool:
  return state.top_ids.shape[1] == state.tokens.shape[1] and state.tokens.shape[1] > 1


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log softmax(logits)[token]: logits [B, ..., V], tokens [B, ...] → float32 [B, ...]."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


# --------------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------------


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
  Positions past a prompt's end hold padding K/V that no later query can see (they are at or
  past the committed length until overwritten) and never enter a recurrent state (`valid`).
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


def prefill_prompts(
  config: ModelConfig,
  params: Any,
  prompts: jax.Array,
  prompt_lens: jax.Array,
  state: DecodingState,
  taps: tuple[int, ...] = (),
):
  """The padded prompts [B, P] through the target in one chunk: (last-position logits [B, V],
  state with lengths prompt_lens, taps, hidden). The reference the chunked prefill is tested
  against."""
  logits, _, state, taps, hidden = prefill_chunk(
    config, params, prompts, 0, prompts.shape[1], prompt_lens, state, taps
  )
  return logits, state.with_lengths(prompt_lens), taps, hidden


def prefill(
  config: ModelConfig,
  drafter: Optional[Drafter],
  target_params: Any,
  drafter_params: Any,
  tokens: jax.Array,
  prompt_len: jax.Array,
  max_new: jax.Array,
  active: jax.Array,
  params: sampling.SamplingParams,
  keys: jax.Array,
  stop_ids: jax.Array,
  num_chunks: jax.Array,
  penalty_rows: Optional[tuple] = None,
  chunk: int = 1,
  kv_format: str = "float",
  state_axes: Optional[SpecState] = None,
  slack: int = DEFAULT_SLACK,
  tree_ranks: tuple[int, ...] = (),
  paging: Optional[Paging] = None,
  copies: int = 1,
  top_k: int = 0,
  prefix: Optional[prefix_lib.CachedPrefix] = None,
  prefix_width: int = 0,
) -> SpecState:
  """Target prefill, first token, drafter prefill: the state before the first step.

  tokens [B, max_len] holds the prompts. They run through the target `num_chunks` chunks of
  `chunk` positions at a time in a loop on device (one compilation per chunk size); each
  chunk's target features go to the drafter before the next chunk runs, and a prompt's first
  token is sampled in the chunk that holds its last position. `state_axes` (the state's logical
  axes, `SpecEngine.state_axes`) lays the state out on the active mesh from its creation on;
  `slack` is the widest block a step verifies (sliding-window rings keep window + slack);
  `paging` pages the full-attention K/V (`DecodingState.create`); `penalty_rows` (presence,
  frequency, repetition [B], logit-bias ids and values [B, N]) turns on `Penalties` (None: off).

  copies > 1: the B rows are samples of one prompt (`n` > 1): the target prefills it once, as
  one row, and its logits and features feed every row's first token (each row with its own
  key and sampling parameters) and drafter; the target's state is then that row's, B times
  (a paged entry's rows share its pages). `top_k` > 0 keeps each generated token's top_k
  alternatives (`SpecState.top_ids`).

  prefix: the first `prefix.count` pages of the (one) prompt are cached in the engine's pool
  (speculative/prefix.py): the target's paged K/V reads them from there, the drafter absorbs
  their kept features, and the chunks start after them (`num_chunks` counts the rest); the
  returned state leaves those pages unmapped, so `insert` copies only what this prefill wrote.
  prefix_width: target features kept per position for later prefixes (F; 0: none kept).
  """
  lay = functools.partial(laid_out, state_axes)
  batch, max_len = tokens.shape
  target_rows = 1 if copies > 1 else batch
  taps = drafter.taps if drafter is not None else ()
  rows = jnp.arange(batch)
  keys, sub = sampling.split_key(keys)
  drafter_state = ()
  if drafter is not None:
    drafter_state = drafter.init_state(drafter_params, batch, max_len)
  page_size = paging.page_size if paging is not None else 1
  skip = jnp.int32(0) if prefix is None else prefix.count * page_size
  penalties = Penalties.off(batch)
  if penalty_rows is not None:
    penalties = Penalties.create(config.vocab_size, *penalty_rows, tokens, prompt_len)

  def lay_carry(target_state, drafter_state, tokens, logprobs, top, features):
    return (
      # (copies > 1: the target's one row is laid out once repeated, below)
      lay("target_state", target_state) if copies == 1 else target_state,
      lay("drafter_state", drafter_state),
      lay("tokens", tokens),
      lay("logprobs", logprobs),
      (lay("top_ids", top[0]), lay("top_logprobs", top[1])),
      lay("prefix_features", features),
    )

  def body(c, carry):
    target_state, drafter_state, tokens, logprobs, top, features = carry
    start = skip + c * chunk
    logits, in_chunk, target_state, chunk_taps, hidden = prefill_chunk(
      config,
      target_params,
      tokens[:target_rows],
      start,
      chunk,
      prompt_len[:target_rows],
      target_state,
      taps,
    )
    if prefix_width:  # kept for prompts that will start with these positions' pages
      values = prefix_lib.pack(drafter, chunk_taps, hidden)
      features = prefix_lib.write(features, target_state.page_table, start, values)
    if copies > 1:  # the one prompt's outputs, for every row
      rows_of = lambda x, axis=0: None if x is None else jnp.repeat(x, batch, axis=axis)
      logits, in_chunk, hidden = rows_of(logits), rows_of(in_chunk), rows_of(hidden)
      chunk_taps = rows_of(chunk_taps, axis=1)
    # Same key for every chunk: a row's first token is what one-shot prefill would sample.
    drawn = sampling.sample(sub, penalties.adjust(logits), params)
    first = jnp.where(in_chunk, drawn, tokens[rows, prompt_len])
    tokens = tokens.at[rows, prompt_len].set(first)
    lp = jnp.where(in_chunk, token_logprobs(logits, first), logprobs[rows, prompt_len])
    logprobs = logprobs.at[rows, prompt_len].set(lp)
    if top_k:
      ids, values = top_logprobs(logits, top_k)
      slot = jnp.where(in_chunk, prompt_len, max_len)  # rows whose last position is elsewhere
      top = tuple(x.at[rows, slot].set(v, mode="drop") for x, v in zip(top, (ids, values)))
    if drafter is not None:
      ctx = PrefillContext(tokens, prompt_len, chunk_taps, hidden, start)
      drafter_state = drafter.prefill(drafter_params, drafter_state, ctx)
    return lay_carry(target_state, drafter_state, tokens, logprobs, top, features)

  target_state = DecodingState.create(
    config, target_rows, max_len, kv_format, slack=slack, paging=paging
  )
  if prefix is not None:  # the cached pages: the target's K/V, then the drafter's prefill
    target_state = target_state.load_pages(prefix.state, prefix.pages[None])
    if drafter is not None:
      drafter_state = prefix_lib.absorb(
        drafter,
        drafter_params,
        drafter_state,
        tokens,
        prompt_len,
        prefix,
        page_size,
        config.hidden_size,
      )
  num_pages = paging.num_pages if paging is not None else 0
  init = lay_carry(
    target_state,
    drafter_state,
    tokens,
    jnp.zeros((batch, max_len), jnp.float32),
    _top_buffers(batch, max_len, top_k),
    prefix_lib.empty_features(num_pages, page_size, prefix_width, config.dtype),
  )
  target_state, drafter_state, tokens, logprobs, top, features = jax.lax.fori_loop(
    0, num_chunks, body, init
  )
  if prefix is not None:
    target_state = prefix_lib.hide_cached(target_state, prefix.count)
  if copies > 1:
    target_state = repeat_rows(target_state, batch)
  first = tokens[rows, prompt_len]
  gamma = drafter.gamma if drafter is not None else 0
  done = ~active | is_stop(first, stop_ids) | (max_new <= 1)
  state = SpecState(
    tokens=tokens,
    seq_len=prompt_len + 1,
    prompt_len=prompt_len,
    max_new=max_new,
    target_state=target_state.with_lengths(prompt_len),
    drafter_state=drafter_state,
    keys=keys,
    done=done,
    sampling=params,
    stop_ids=stop_ids,
    stats=metrics.init_stats(batch, gamma, tree_ranks),
    logprobs=logprobs,
    penalties=penalties.observe(first[:, None], active[:, None]),
    top_ids=top[0],
    top_logprobs=top[1],
    prefix_features=features,
  )
  return lay(None, state)


# --------------------------------------------------------------------------------------------------
# The step: draft → verify → accept → commit
# --------------------------------------------------------------------------------------------------


def repeat_rows(state: DecodingState, n: int) -> DecodingState:
  """A one-row decoding state as n equal rows: every leaf with a `batch` axis (its kinds'
  AXES tables) repeated; what rows share (a paged pool) kept once, so the rows' page tables
  name the same pages."""
  specs = jax.tree_util.tree_leaves(
    logical_axes(state), is_leaf=lambda x: isinstance(x, PartitionSpec)
  )
  leaves, treedef = jax.tree_util.tree_flatten(state)
  out = [
    jnp.repeat(x, n, axis=tuple(spec).index("batch")) if "batch" in tuple(spec) else x
    for spec, x in zip(specs, leaves)
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def step(
  config: ModelConfig,
  drafter: Optional[Drafter],
  verifier: Verifier,
  target_params: Any,
  drafter_params: Any,
  state: SpecState,
) -> SpecState:
  """One draft → verify → accept → commit step for every sequence that is not done.

  The drafter proposes from the committed tokens (no drafter: plain decoding); the verifier
  makes the block the target runs once at positions seq_len-1.. (a chain under the causal mask,
  or a DDTree at start + depth under the ancestor mask) and decides what it accepts; the new
  tokens, their log-probs, the decoding state and the drafter's features of the committed
  tokens are then committed (see jaxspec/speculative/verifiers.py).
  """
  rows = jnp.arange(state.tokens.shape[0])
  keys, k_draft, k_verify = sampling.split_key(state.keys, 3)
  root = state.tokens[rows, state.seq_len - 1]
  start = state.seq_len - 1  # the root's slot: the state holds everything before it

  # Draft.
  proposal, drafter_state = None, state.drafter_state
  if drafter is not None and verifier.drafts:
    proposal, drafter_state = drafter.propose(
      drafter_params,
      state.drafter_state,
      ProposeContext(state.tokens, state.seq_len, state.sampling, k_draft, state.target_state),
    )
  # Verify: one target pass over the block.
  block = verifier.block(k_verify, root, proposal, state.sampling)
  out = target_lib.apply_decoder(
    config,
    target_params,
    block.tokens,
    start,
    state.target_state,
    positions=block.positions(start),
    block_mask=block.mask,
    taps=drafter.taps if drafter is not None else (),
  )
  # Accept, from the target's distributions as the row's penalties and logit bias adjust them:
  # each block position after its own prefix (jaxspec/penalties.py).
  logits = out.logits
  if state.penalties.enabled:
    prefix = block_counts(block.tokens, logits.shape[-1], block.mask)
    logits = state.penalties.adjust(logits, prefix)
  accepted = verifier.accept(k_verify, block, logits, proposal, state.sampling)
  # Commit: tokens and log-probs (the raw distribution's), the decoding state, statistics,
  # the drafter, the penalties' counts.
  tokens, logprobs, seq_len, done, count, top = _commit_tokens(state, accepted, out.logits)
  new = jnp.arange(verifier.max_commit)[None, :]
  fresh = tokens[rows[:, None], jnp.minimum(state.seq_len[:, None] + new, tokens.shape[1] - 1)]
  penalties = state.penalties.observe(fresh, new < count[:, None])
  target_state = verifier.commit(out.state, accepted).with_lengths(seq_len - 1)
  stats = metrics.update_stats(
    state.stats, accepted.num_accepted, ~state.done, count, accepted.ranks
  )
  if drafter is not None:
    taps, hidden = verifier.features(out.taps, out.hidden, accepted)
    drafter_state = drafter.commit(
      drafter_params,
      drafter_state,
      CommitContext(
        tokens,
        state.seq_len,
        jnp.minimum(accepted.num_accepted, count),
        seq_len,
        taps,
        hidden,
      ),
    )
  return state.replace(
    tokens=tokens,
    seq_len=seq_len,
    target_state=target_state,
    drafter_state=drafter_state,
    keys=keys,
    done=done,
    stats=stats,
    logprobs=logprobs,
    penalties=penalties,
    top_ids=top[0],
    top_logprobs=top[1],
  )


def _commit_tokens(
  state: SpecState, accepted: Accepted, logits: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Writes the accepted drafts [B, D] (first num_accepted) then next_token into the buffer,
  with their log-probs: new token j was drawn from the verify block's logits [B, T, V] at
  index accepted.source[b, j].

  The new tokens are cut at each sequence's budget and after its first stop token; finished
  sequences commit nothing. Returns (tokens, logprobs, seq_len, done, count committed, the
  top alternatives' buffers, written at the same slots when the state keeps them).
  """
  batch, max_len = state.tokens.shape
  rows = jnp.arange(batch)
  drafts, num_accepted = accepted.drafts, accepted.num_accepted
  depth = drafts.shape[1]
  new = jnp.concatenate([drafts.astype(jnp.int32), jnp.zeros((batch, 1), jnp.int32)], axis=1)
  new = new.at[rows, num_accepted].set(accepted.next_token)  # [B, D+1]
  j = jnp.arange(depth + 1)[None, :]
  budget = state.max_new - (state.seq_len - state.prompt_len)
  keep = (j <= num_accepted[:, None]) & (j < budget[:, None])
  stop_here = is_stop(new, state.stop_ids) & keep
  first_stop = jnp.argmax(stop_here, axis=1)
  keep = keep & (~jnp.any(stop_here, axis=1)[:, None] | (j <= first_stop[:, None]))
  keep = keep & ~state.done[:, None]
  count = jnp.sum(keep, axis=1).astype(jnp.int32)

  slots = jnp.where(keep, state.seq_len[:, None] + j, max_len)
  tokens = state.tokens.at[rows[:, None], slots].set(new, mode="drop")
  drawn_at = logits[rows[:, None], accepted.source]  # [B, D+1, V]
  new_logprobs = token_logprobs(drawn_at, new)
  logprobs = state.logprobs.at[rows[:, None], slots].set(new_logprobs, mode="drop")
  top = (state.top_ids, state.top_logprobs)
  if _keeps_top(state):
    ids, values = top_logprobs(drawn_at, state.top_ids.shape[-1])
    top = tuple(x.at[rows[:, None], slots].set(v, mode="drop") for x, v in zip(top, (ids, values)))
  seq_len = state.seq_len + count
  done = state.done | jnp.any(stop_here, axis=1) | (seq_len - state.prompt_len >= state.max_new)
  return tokens, logprobs, seq_len, done, count, top


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def run_loop(
  config: ModelConfig,
  drafter: Optional[Drafter],
  target_params: Any,
  drafter_params: Any,
  state: SpecState,
  max_steps: Optional[jax.Array] = None,
  verifier: Optional[Verifier] = None,
  state_axes: Optional[SpecState] = None,
) -> SpecState:
  """`step` in a while_loop until every sequence is done or after `max_steps` steps (a traced
  int32, so streaming and slot serving at any chunk size share one program; None: no limit).
  `verifier` defaults to the drafter's chain (plain decoding without a drafter). With
  `state_axes` every step's state keeps the layout they give it on the active mesh."""
  verifier = verifier or verifiers.make(drafter)
  lay = functools.partial(laid_out, state_axes, None)

  def cond(carry):
    s, i = carry
    go = ~jnp.all(s.done)
    return go if max_steps is None else go & (i < max_steps)

  def body(carry):
    s, i = carry
    return lay(step(config, drafter, verifier, target_params, drafter_params, s)), i + 1

  state, _ = jax.lax.while_loop(cond, body, (lay(state), jnp.int32(0)))
  return lay(state)  # the loop's result too: XLA may pick another layout for a while's output


def run_rows(
  config: ModelConfig,
  drafter: Optional[Drafter],
  axes: Any,
  target_params: Any,
  drafter_params: Any,
  state: SpecState,
  max_steps: jax.Array,
  rows: jax.Array,
  valid: jax.Array,
  verifier: Optional[Verifier] = None,
  state_axes: Optional[SpecState] = None,
) -> SpecState:
  """`run_loop` over the rows `rows` [R] of `state` only (R, a row bucket, below the batch:
  a step then costs what R rows cost). Entries where `valid` [R] is False pad the bucket: they
  run as done rows whose page tables map nothing, and are not written back. `axes`: each
  leaf's batch axis (None for what rows share, such as a paged pool, which the loop updates
  in place)."""
  take = lambda ax, x: x if ax is None else jnp.take(x, rows, axis=ax)
  sub = jax.tree_util.tree_map(take, axes, state, is_leaf=lambda x: x is None)
  sub = sub.replace(done=sub.done | ~valid)
  if sub.target_state.paged:  # a padding row writes nothing (it may copy a live row)
    unmapped = sub.target_state.unmapped_page
    table = jnp.where(valid[:, None], sub.target_state.page_table, unmapped)
    sub = sub.replace(target_state=sub.target_state.with_page_table(table))
  sub = run_loop(config, drafter, target_params, drafter_params, sub, max_steps, verifier)
  back = jnp.where(valid, rows, state.tokens.shape[0])  # padding: dropped

  def put(ax, x, r):
    if ax is None:
      return r
    index = (slice(None),) * ax + (back,)
    return x.at[index].set(r.astype(x.dtype), mode="drop")

  out = jax.tree_util.tree_map(put, axes, state, sub, is_leaf=lambda x: x is None)
  return laid_out(state_axes, None, out)


# --------------------------------------------------------------------------------------------------
# Rows (slots) and the read-back
# --------------------------------------------------------------------------------------------------


def insert_row(
  axes: Any,
  state: SpecState,
  slot: jax.Array,
  row: SpecState,
  state_axes: Optional[SpecState] = None,
) -> SpecState:
  """Row `slot` of every batched leaf of `state` ← the one-row state `row` (`axes`: each leaf's
  batch axis, None for shared leaves, which keep `state`'s, after the target's paged K/V took
  the row's pages: `DecodingState.adopt_row`); laid out by `state_axes`."""

  def put(ax, x, r):
    if ax is None:
      return x
    return jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, axis=ax)

  # What rows share (a paged pool) takes the row's content first; then the rows' leaves.
  if state.prefix_features.size:
    slot_table = jnp.take(state.target_state.page_table, slot, axis=0)
    features = prefix_lib.adopt(
      state.prefix_features, slot_table, row.prefix_features, row.target_state.page_table[0]
    )
    state = state.replace(prefix_features=features)
  target_state, row_target = state.target_state.adopt_row(slot, row.target_state)
  state, row = state.replace(target_state=target_state), row.replace(target_state=row_target)

  spliced = jax.tree_util.tree_map(put, axes, state, row, is_leaf=lambda x: x is None)
  return laid_out(state_axes, None, spliced)


def evict_rows(
  state: SpecState, rows: jax.Array, state_axes: Optional[SpecState] = None
) -> SpecState:
  """The rows where `rows` [B] bool is set marked done: they commit nothing more."""
  return laid_out(state_axes, None, state.replace(done=state.done | rows))


def set_page_table(
  state: SpecState, table: jax.Array, state_axes: Optional[SpecState] = None
) -> SpecState:
  """The target's paged K/V with page tables [B, W] (the host's allocation, serve/pages.py)."""
  target_state = state.target_state.with_page_table(table)
  return laid_out(state_axes, None, state.replace(target_state=target_state))


def recent(state: SpecState, window: int) -> dict[str, jax.Array]:
  """What each row's last `window` slots hold, and its progress: all a server reads back after
  a loop chunk that commits at most `window` tokens per row (its size does not grow with
  max_len).

  Returns a dict of [B, window] `tokens` and `logprobs` (slots seq_len-window .. seq_len-1;
  those before slot 0 are padding), and per row `seq_len`, `done`, `stopped` (done on a stop
  token: the last committed token is one of the row's stop ids), `target_passes`,
  `tokens_committed` and `accept_hist` (the rows' counters: passes accepting k drafts).
  """
  rows = jnp.arange(state.tokens.shape[0])[:, None]
  slots = jnp.maximum(state.seq_len[:, None] - window + jnp.arange(window), 0)
  last = state.tokens[rows[:, 0], jnp.maximum(state.seq_len - 1, 0)]
  top = {}
  if _keeps_top(state):
    top = dict(top_ids=state.top_ids[rows, slots], top_logprobs=state.top_logprobs[rows, slots])
  return dict(
    **top,
    tokens=state.tokens[rows, slots],
    logprobs=state.logprobs[rows, slots],
    seq_len=state.seq_len,
    done=state.done,
    stopped=state.done & is_stop(last, state.stop_ids),
    target_passes=state.stats.target_passes,
    tokens_committed=state.stats.tokens_committed,
    accept_hist=state.stats.accept_hist,
  )
